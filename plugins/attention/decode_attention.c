/* Decode attention on the KV cache in place: one query token a request, its keys and values
 * read through the request's slot table, no gathered copy.
 *
 * q [B][H][D] float32; k_cache, v_cache [slots][KVH][D], float32, bf16 or float16 (kv_format);
 * kv_slots [B][stride] int64, the first seq_lens[b] of row b are the request's tokens;
 * out [B][H][D] float32. The H / KVH query heads of a KV head read its keys and values together.
 * Threads: OpenMP over (request, KV head), in torch's runtime.
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


enum { KV_FLOAT32 = 0, KV_BFLOAT16 = 1, KV_FLOAT16 = 2 };

/* Row `offset` of a cache as float32: in place for a float32 cache, else widened into `row`. */
static inline const float *cache_row(const void *cache, int64_t offset, int kv_format, int64_t d, float *row) {
    if (kv_format == KV_FLOAT32) return (const float *)cache + offset;
    const uint16_t *src = (const uint16_t *)cache + offset;
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const __m128i half = _mm_loadu_si128((const __m128i *)(src + i));
        const __m256 wide = kv_format == KV_BFLOAT16
            ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16))
            : _mm256_cvtph_ps(half);
        _mm256_storeu_ps(row + i, wide);
    }
    for (; i < d; i++) {
        if (kv_format == KV_BFLOAT16) {
            const uint32_t bits = (uint32_t)src[i] << 16;
            memcpy(row + i, &bits, sizeof(float));
        } else {
            row[i] = _cvtsh_ss(src[i]);
        }
    }
    return row;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float total = hsum(acc);
    for (; i < d; i++) total += a[i] * b[i];
    return total;
}

/* Slots are scattered over the cache: ask for a row some tokens ahead, so that DRAM latency
 * overlaps the arithmetic instead of stalling on each row in turn (1.3 to 1.8x on a cold
 * cache with 4 ahead; 8 and 16 did no better). */
#define PREFETCH_AHEAD 4

static inline void prefetch_row(const void *cache, int64_t offset, int kv_format, int64_t d) {
    const int64_t width = kv_format == KV_FLOAT32 ? 4 : 2;
    const char *start = (const char *)cache + offset * width;
    for (int64_t line = 0; line < d * width; line += 64) _mm_prefetch(start + line, _MM_HINT_T0);
}

/* exp(x) for x <= 0, eight at a time: 2^n * e^r with |r| <= ln2 / 2, e^r by its degree-6
 * Taylor polynomial (relative error under 2e-7, float32 rounding); below -87 it is 0. glibc's
 * scalar expf took 40% of a decode step's attention. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.0f);
    const __m256 underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_max_ps(x, low);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2, with ln2 split in two so that n * ln2 loses no precision */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

/* scores = softmax(scores), in place */
static void softmax(float *scores, int64_t len) {
    float largest = -INFINITY, total = 0.0f;
    for (int64_t t = 0; t < len; t++) largest = scores[t] > largest ? scores[t] : largest;
    const __m256 shift = _mm256_set1_ps(largest);
    __m256 sums = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
        _mm256_storeu_ps(scores + t, e);
        sums = _mm256_add_ps(sums, e);
    }
    float rest[8] = {0};
    for (int64_t i = 0; t + i < len; i++) rest[i] = scores[t + i] - largest;
    const __m256 e = exp_nonpositive(_mm256_loadu_ps(rest));
    _mm256_storeu_ps(rest, e);
    for (int64_t i = 0; t + i < len; i++) {
        scores[t + i] = rest[i];
        total += rest[i];
    }
    total += hsum(sums);
    const float inverse = 1.0f / total;
    for (t = 0; t < len; t++) scores[t] *= inverse;
}

/* acc += p * v */
static inline void add_scaled(float *acc, float p, const float *v, int64_t d) {
    const __m256 pv = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
    for (; i < d; i++) acc[i] += p * v[i];
}

void srv_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_format,
                          const int64_t *kv_slots, int64_t stride, const int64_t *seq_lens, int64_t batch,
                          int64_t heads, int64_t kv_heads, int64_t d, float scale, float *out) {
    const int64_t group = heads / kv_heads;
    int64_t longest = 1;
    for (int64_t b = 0; b < batch; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;
#pragma omp parallel
    {
        /* Three passes a (request, KV head): every score, then softmax, then the weighted sum
         * of values. Each pass is a run of independent products, where a running softmax
         * chains every token's exp and rescale behind the previous one's. */
        float *scores = malloc(group * longest * sizeof(float));
        float *acc = malloc(group * d * sizeof(float));
        float *row = malloc(d * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < batch * kv_heads; task++) {
            const int64_t b = task / kv_heads, kvh = task % kv_heads, len = seq_lens[b];
            const int64_t *slots = kv_slots + b * stride;
            const float *qb = q + (b * heads + kvh * group) * d;
            for (int64_t t = 0; t < len; t++) {
                if (t + PREFETCH_AHEAD < len)
                    prefetch_row(k_cache, (slots[t + PREFETCH_AHEAD] * kv_heads + kvh) * d, kv_format, d);
                const float *key = cache_row(k_cache, (slots[t] * kv_heads + kvh) * d, kv_format, d, row);
                for (int64_t g = 0; g < group; g++) scores[g * len + t] = dot(qb + g * d, key, d) * scale;
            }
            for (int64_t g = 0; g < group; g++) softmax(scores + g * len, len);
            memset(acc, 0, group * d * sizeof(float));
            for (int64_t t = 0; t < len; t++) {
                if (t + PREFETCH_AHEAD < len)
                    prefetch_row(v_cache, (slots[t + PREFETCH_AHEAD] * kv_heads + kvh) * d, kv_format, d);
                const float *value = cache_row(v_cache, (slots[t] * kv_heads + kvh) * d, kv_format, d, row);
                for (int64_t g = 0; g < group; g++) add_scaled(acc + g * d, scores[g * len + t], value, d);
            }
            memcpy(out + (b * heads + kvh * group) * d, acc, group * d * sizeof(float));
        }
        free(scores);
        free(acc);
        free(row);
    }
}

/* Decode attention on the KV cache in place: one query token a request, its keys and values
 * read through the request's slot table, no gathered copy.
 *
 * q [B][H][D] float32; k_cache, v_cache [slots][KVH][D], float32, bf16 or float16 (kv_format);
 * kv_slots [B][stride] int64, the first seq_lens[b] of row b are the request's tokens;
 * out [B][H][D] float32. The H / KVH query heads of a KV head read its keys and values together.
 * Softmax is computed online (running max and sum), so no score buffer grows with the sequence.
 * Threads: OpenMP over (request, KV head), in torch's runtime.
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

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

static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float total = _mm_cvtss_f32(s);
    for (; i < d; i++) total += a[i] * b[i];
    return total;
}

/* acc = acc * keep + p * v */
static inline void scale_add(float *acc, float keep, float p, const float *v, int64_t d) {
    const __m256 k = _mm256_set1_ps(keep), pv = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_mul_ps(k, _mm256_loadu_ps(acc + i))));
    for (; i < d; i++) acc[i] = acc[i] * keep + p * v[i];
}

/* Returns 0, or -1 when the shapes exceed the fixed buffers (checked by the caller first). */
int srv_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_format,
                         const int64_t *kv_slots, int64_t stride, const int64_t *seq_lens, int64_t batch,
                         int64_t heads, int64_t kv_heads, int64_t d, float scale, float *out) {
    const int64_t group = heads / kv_heads;
    if (group > MAX_GROUP || d > MAX_HEAD_DIM) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < batch * kv_heads; task++) {
        const int64_t b = task / kv_heads, kvh = task % kv_heads;
        float acc[MAX_GROUP][MAX_HEAD_DIM], running_max[MAX_GROUP], running_sum[MAX_GROUP];
        float key_row[MAX_HEAD_DIM], value_row[MAX_HEAD_DIM];
        const float *qb = q + (b * heads + kvh * group) * d;
        for (int64_t g = 0; g < group; g++) {
            memset(acc[g], 0, d * sizeof(float));
            running_max[g] = -INFINITY;
            running_sum[g] = 0.0f;
        }
        for (int64_t t = 0; t < seq_lens[b]; t++) {
            const int64_t offset = (kv_slots[b * stride + t] * kv_heads + kvh) * d;
            const float *key = cache_row(k_cache, offset, kv_format, d, key_row);
            const float *value = cache_row(v_cache, offset, kv_format, d, value_row);
            for (int64_t g = 0; g < group; g++) {
                const float s = dot(qb + g * d, key, d) * scale;
                if (s > running_max[g]) { /* a new maximum rescales what came before */
                    const float keep = expf(running_max[g] - s);
                    running_sum[g] = running_sum[g] * keep + 1.0f;
                    running_max[g] = s;
                    scale_add(acc[g], keep, 1.0f, value, d);
                } else {
                    const float p = expf(s - running_max[g]);
                    running_sum[g] += p;
                    scale_add(acc[g], 1.0f, p, value, d);
                }
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *o = out + (b * heads + kvh * group + g) * d;
            const float inverse = 1.0f / running_sum[g];
            for (int64_t i = 0; i < d; i++) o[i] = acc[g][i] * inverse;
        }
    }
    return 0;
}

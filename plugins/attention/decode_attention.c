/* Decode attention on the KV cache in place: one query token a request, its keys and values
 * read through the request's slot table, no gathered copy.
 *
 * q [B][H][D] float32, tokens q_stride floats apart; k_cache, v_cache [slots][KVH][D], float32,
 * bf16, float16, or float8 (e4m3fn, e5m2) holding value / scale with one scale a layer for keys
 * and one for values (kv_format; srv.sdk.attention.KVCache); kv_slots [B][stride] int64, the first seq_lens[b] of row b are
 * the request's tokens; out [B][H][D] float32. The H / KVH query heads of a KV head read its
 * keys and values together, and so do the requests of a group that share a prefix of slots
 * (RequestGroup). Threads: OpenMP over (group, KV head), in torch's runtime; a request alone
 * over parts of each KV head (attend_alone).
 *
 * With k_new and v_new ([B][KVH][D] float32, tokens new_stride floats apart), this step's keys
 * and values are first written to the cache at new_slots, in its format: one call a layer
 * instead of two scatters in torch, which cost more than the attention itself at one token.
 *
 * A head is taken in chunks of up to 64 values (CHUNK vectors of eight), held in registers:
 * a query chunk against eight keys at a time (eight independent dot products, summed across
 * lanes together), then a chunk of the output accumulated over every value row. A last vector
 * that is not full is read and written under a mask, so any head size works.
 */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "srv_kv_formats.h"

/* Row `offset` of a cache widened to float32 into `row`. */
static inline void widen_row(const uint16_t *src, int kv_format, int64_t d, float *row) {
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
}

/* A float32 row narrowed into the cache's format, rounding to nearest even as torch does. */
static inline void narrow_row(const float *src, int kv_format, int64_t d, uint16_t *dst) {
    for (int64_t i = 0; i < d; i++) {
        if (kv_format == KV_FLOAT16) {
            dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
        } else {
            uint32_t bits;
            memcpy(&bits, src + i, sizeof(float));
            const uint32_t rounded = bits + 0x7FFF + ((bits >> 16) & 1);
            dst[i] = (uint16_t)(isnan(src[i]) ? (bits >> 16) | 0x40 : rounded >> 16);
        }
    }
}

static void store_new(const float *k_new, const float *v_new, int64_t new_stride, const int64_t *new_slots,
                      void *k_cache, void *v_cache, int kv_format, const float scales[2], int64_t batch,
                      int64_t kv_heads, int64_t d) {
    for (int64_t b = 0; b < batch; b++) {
        const int64_t offset = new_slots[b] * kv_heads * d;
        const float *sources[2] = {k_new + b * new_stride, v_new + b * new_stride};
        void *caches[2] = {k_cache, v_cache};
        for (int which = 0; which < 2; which++) {
            if (kv_format == KV_FLOAT32)
                memcpy((float *)caches[which] + offset, sources[which], kv_heads * d * sizeof(float));
            else if (is_float8(kv_format))
                for (int64_t i = 0; i < kv_heads * d; i++)
                    ((uint8_t *)caches[which])[offset + i] = narrow_float8(sources[which][i], kv_format, scales[which]);
            else
                narrow_row(sources[which], kv_format, kv_heads * d, (uint16_t *)caches[which] + offset);
        }
    }
}

/* The first n (1..8) lanes set. */
static inline __m256i lane_mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Slots are scattered over the cache: ask for a row some tokens ahead, so that DRAM latency
 * overlaps the arithmetic instead of stalling on each row in turn (1.3 to 1.8x on a cold
 * cache with 4 ahead; 8 and 16 did no better). */
#define PREFETCH_AHEAD 4
/* A 16-bit or float8 cache's rows are widened one after another, a few instructions each, so the
 * row asked for must be further ahead for its fetch to arrive in time: at 4 rows the widening
 * waited on every load (perf annotate), 16 and 32 did equally well (-DWIDEN_AHEAD=N to measure). */
#ifndef WIDEN_AHEAD
#define WIDEN_AHEAD 16
#endif

static inline void prefetch_floats(const float *start, int64_t count) {
    for (int64_t i = 0; i < count; i += 16) _mm_prefetch((const char *)(start + i), _MM_HINT_T0);
}

static inline void prefetch_row(const void *cache, int64_t offset, int kv_format, int64_t d) {
    const int64_t width = element_size(kv_format);
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

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* scores[0, len) = softmax(scale * scores[0, len)), in place. The buffer runs on to len rounded
 * up to 8; the entries past len are left out of the max and the sum. */
static void softmax(float *scores, int64_t len, float scale) {
    const int64_t last = (len - 1) / 8 * 8;
    const __m256 tail = _mm256_castsi256_ps(lane_mask(len - last)), lowest = _mm256_set1_ps(-INFINITY);
    __m256 largest = lowest;
    for (int64_t t = 0; t <= last; t += 8) {
        const __m256 s = _mm256_loadu_ps(scores + t);
        largest = _mm256_max_ps(largest, t == last ? _mm256_blendv_ps(lowest, s, tail) : s);
    }
    const __m256 shift = _mm256_set1_ps(hmax(largest)), factor = _mm256_set1_ps(scale);
    __m256 sums = _mm256_setzero_ps();
    for (int64_t t = 0; t <= last; t += 8) {
        __m256 e = exp_nonpositive(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift), factor));
        if (t == last) e = _mm256_and_ps(e, tail);
        _mm256_storeu_ps(scores + t, e);
        sums = _mm256_add_ps(sums, e);
    }
    const __m256 inverse = _mm256_set1_ps(1.0f / hsum(sums));
    for (int64_t t = 0; t <= last; t += 8)
        _mm256_storeu_ps(scores + t, _mm256_mul_ps(_mm256_loadu_ps(scores + t), inverse));
}

#define INLINE static inline __attribute__((always_inline))
#define CHUNK 8
/* Tokens a block: the query heads of a KV head take turns on a block of its rows (16 KB at
 * head size 64) while it is in L1, rather than each streaming every row from L2. Batch 16 at
 * 700 tokens of context: 31 ms a step (30 layers) against 36; 32 and 128 did no better. */
#define TOKEN_BLOCK 64

/* The last vector of a chunk: under the mask where the head size is not a multiple of 8 (a
 * masked load costs more than a plain one, and cannot be folded into the FMA). */
INLINE __m256 load_last(const float *p, __m256i tail, const int masked) {
    return masked ? _mm256_maskload_ps(p, tail) : _mm256_loadu_ps(p);
}

/* Lane i of the result: the sum of v[i]'s lanes. */
static inline __m256 sum_lanes_8(const __m256 v[8]) {
    const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* scores[t] (+)= q . keys[t][offset ...] over one chunk of `vectors` (constant) vectors, the last
 * under `tail`, for t < len rounded up to 8 (keys past len point at a real row). */
INLINE void chunk_scores(const float *q, const float *const *keys, int64_t len, int64_t offset, __m256i tail,
                         int accumulate, int fetch, float *scores, const int vectors, const int masked) {
    __m256 qv[CHUNK];
    for (int i = 0; i < vectors - 1; i++) qv[i] = _mm256_loadu_ps(q + 8 * i);
    qv[vectors - 1] = load_last(q + 8 * (vectors - 1), tail, masked);
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
        if (fetch && t0 + 8 < len)
            for (int t = 0; t < 8; t++) prefetch_floats(keys[t0 + 8 + t] + offset, 8 * vectors);
        __m256 acc[8];
        for (int t = 0; t < 8; t++) {
            const float *key = keys[t0 + t] + offset;
            __m256 a = _mm256_mul_ps(qv[vectors - 1], load_last(key + 8 * (vectors - 1), tail, masked));
            for (int i = 0; i < vectors - 1; i++) a = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(key + 8 * i), a);
            acc[t] = a;
        }
        __m256 sums = sum_lanes_8(acc);
        if (accumulate) sums = _mm256_add_ps(sums, _mm256_loadu_ps(scores + t0));
        _mm256_storeu_ps(scores + t0, sums);
    }
}

/* out[offset ...] (+)= sum over t < len of p[t] * values[t][offset ...], one chunk. */
INLINE void chunk_values(const float *p, const float *const *values, int64_t len, int64_t offset, __m256i tail,
                         int accumulate, int fetch, float *out, const int vectors, const int masked) {
    __m256 acc[CHUNK];
    for (int i = 0; i < vectors - 1; i++)
        acc[i] = accumulate ? _mm256_loadu_ps(out + offset + 8 * i) : _mm256_setzero_ps();
    acc[vectors - 1] = accumulate ? load_last(out + offset + 8 * (vectors - 1), tail, masked) : _mm256_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        if (fetch && t + PREFETCH_AHEAD < len) prefetch_floats(values[t + PREFETCH_AHEAD] + offset, 8 * vectors);
        const __m256 pt = _mm256_broadcast_ss(p + t);
        const float *value = values[t] + offset;
        for (int i = 0; i < vectors - 1; i++) acc[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(value + 8 * i), acc[i]);
        acc[vectors - 1] = _mm256_fmadd_ps(pt, load_last(value + 8 * (vectors - 1), tail, masked), acc[vectors - 1]);
    }
    for (int i = 0; i < vectors - 1; i++) _mm256_storeu_ps(out + offset + 8 * i, acc[i]);
    if (masked)
        _mm256_maskstore_ps(out + offset + 8 * (vectors - 1), tail, acc[vectors - 1]);
    else
        _mm256_storeu_ps(out + offset + 8 * (vectors - 1), acc[vectors - 1]);
}

/* `statement` with VECTORS a constant equal to `vectors` (1..CHUNK). */
#define FOR_VECTORS(vectors, statement)                                                                   \
    switch (vectors) {                                                                                    \
    case 1: { const int VECTORS = 1; statement; } break;                                                 \
    case 2: { const int VECTORS = 2; statement; } break;                                                 \
    case 3: { const int VECTORS = 3; statement; } break;                                                 \
    case 4: { const int VECTORS = 4; statement; } break;                                                 \
    case 5: { const int VECTORS = 5; statement; } break;                                                 \
    case 6: { const int VECTORS = 6; statement; } break;                                                 \
    case 7: { const int VECTORS = 7; statement; } break;                                                 \
    default: { const int VECTORS = 8; statement; } break;                                                \
    }

/* `statement` with VECTORS and MASKED constants equal to `vectors` and `masked` (0 or 1). */
#define FOR_CHUNK(vectors, masked, statement)                                                             \
    if (masked) {                                                                                         \
        const int MASKED = 1;                                                                             \
        FOR_VECTORS(vectors, statement)                                                                   \
    } else {                                                                                              \
        const int MASKED = 0;                                                                             \
        FOR_VECTORS(vectors, statement)                                                                   \
    }

/* `statement` for each chunk of a head's values [first, end) (first a multiple of 8): `offset`,
 * `tail`, VECTORS and MASKED set. */
#define FOR_EACH_CHUNK_IN(first, end, statement)                                                          \
    for (int64_t offset = (first); offset < (end); offset += 8 * CHUNK) {                                 \
        const int64_t left = (end) - offset, vectors = left >= 8 * CHUNK ? CHUNK : (left + 7) / 8;        \
        const __m256i tail = lane_mask(left - 8 * (vectors - 1));                                         \
        FOR_CHUNK(vectors, left % 8, statement)                                                           \
    }

/* `statement` for each chunk of a head of size d. */
#define FOR_EACH_CHUNK(d, statement) FOR_EACH_CHUNK_IN(0, d, statement)

/* Pointers to one block's rows, [start, stop) of a request's keys or values for one KV head, at
 * rows[0, stop - start): in place in a float32 cache, else widened into `widened` [TOKEN_BLOCK][d]
 * (only the row's values [first, first + width), where the rest go unread); entries on to a
 * multiple of 8 repeat the first. Widened a block at a time, the rows
 * are still in L1 when the query heads read them (widening a request's whole length first sent
 * them out to L2 and back, which cost more than the arithmetic). Rows are scattered over the
 * cache, so each is fetched some tokens ahead, across blocks up to the request's `len`. */
static void block_rows(const void *cache, int kv_format, float scale, const int64_t *slots, int64_t start,
                       int64_t stop, int64_t len, int64_t kv_heads, int64_t kvh, int64_t d, int64_t first,
                       int64_t width, float *widened, const float **rows) {
    for (int64_t t = start; t < stop; t++) {
        if (kv_format != KV_FLOAT32 && t + WIDEN_AHEAD < len)
            prefetch_row(cache, (slots[t + WIDEN_AHEAD] * kv_heads + kvh) * d + first, kv_format, width);
        const int64_t offset = (slots[t] * kv_heads + kvh) * d;
        float *row = widened + (t - start) * d;
        if (kv_format == KV_FLOAT32) {
            rows[t - start] = (const float *)cache + offset;
        } else {
            if (is_float8(kv_format))
                widen_float8_row((const uint8_t *)cache + offset + first, kv_format, width, scale, row + first);
            else
                widen_row((const uint16_t *)cache + offset + first, kv_format, width, row + first);
            rows[t - start] = row;
        }
    }
    for (int64_t t = stop - start; t % 8; t++) rows[t] = rows[0];
}

/* Consecutive requests of a batch whose slot tables begin with the same `shared` slots: a prefix
 * they share in the cache (a system prompt, a few-shot preamble). Each block of those keys and
 * values is read from memory once for the whole group, and every request's queries take their
 * turn on it while it is in L1, instead of each request streaming it again. A request alone is a
 * group of one with nothing shared. */
typedef struct {
    int64_t first, count, shared;
} RequestGroup;

/* Requests in a group at most: enough to read a shared block from L1 for all but one of them. */
#define MAX_GROUP 8

/* The batch's groups, in order, written to `groups` (room for `batch`); returns their count. A
 * group is cut short so that every thread gets at least two (group, KV head) tasks. Shared
 * prefixes are whole TOKEN_BLOCKs and leave every request at least one token of its own. */
int64_t srv_decode_groups(const int64_t *kv_slots, int64_t stride, const int64_t *seq_lens, int64_t batch,
                          int64_t kv_heads, RequestGroup *groups) {
    const int64_t wanted = (2 * omp_get_max_threads() + kv_heads - 1) / kv_heads;
    int64_t cap = (batch + wanted - 1) / wanted;
    cap = cap < 1 ? 1 : (cap > MAX_GROUP ? MAX_GROUP : cap);
    int64_t count = 0;
    for (int64_t b = 0; b < batch;) {
        RequestGroup *group = groups + count++;
        const int64_t *first = kv_slots + b * stride;
        int64_t shared = seq_lens[b] - 1, members = 1;
        for (; b + members < batch && members < cap; members++) {
            const int64_t *other = kv_slots + (b + members) * stride;
            const int64_t limit = seq_lens[b + members] - 1 < shared ? seq_lens[b + members] - 1 : shared;
            int64_t same = 0;
            while (same < limit && first[same] == other[same]) same++;
            same = same / TOKEN_BLOCK * TOKEN_BLOCK;
            if (same == 0) break;
            shared = same;
        }
        *group = (RequestGroup){b, members, members > 1 ? shared : 0};
        b += members;
    }
    return count;
}

/* Per thread: each member's scores [group heads][longest], and one block's row pointers
 * [TOKEN_BLOCK] and, for caches not in float32, its widened rows [TOKEN_BLOCK][d]. */
typedef struct {
    float *scores;
    const float **rows;
    float *widened;
    int64_t longest;
} Scratch;

/* Attention for one KV head of one group: every score, then softmax, then the weighted sum of
 * values, each pass over the shared blocks for all members first, then each member's own
 * tokens. Three passes rather than a running softmax: each is a run of independent products,
 * where a running softmax chains every token's exp and rescale behind the previous one's. */
static void attend_group(const RequestGroup *group, int64_t kvh, const float *q, int64_t q_stride,
                         const void *k_cache, const void *v_cache, int kv_format, const float scales[2],
                         const int64_t *kv_slots,
                         int64_t stride, const int64_t *seq_lens, int64_t heads, int64_t kv_heads, int64_t d,
                         float scale, float *out, const Scratch *s) {
    const int64_t per_kv = heads / kv_heads, shared = group->shared, longest = s->longest;
    const float *const *rows = (const float *const *)s->rows;
#define SCORES(m, g) (s->scores + ((m) * per_kv + (g)) * longest)
#define QUERY(m, g) (q + (group->first + (m)) * q_stride + (kvh * per_kv + (g)) * d)
#define OUTPUT(m, g) (out + ((group->first + (m)) * heads + kvh * per_kv + (g)) * d)
#define SLOTS(m) (kv_slots + (group->first + (m)) * stride)
    for (int pass = 0; pass < 2; pass++) {
        const void *cache = pass == 0 ? k_cache : v_cache;
        for (int64_t t0 = 0; t0 < shared; t0 += TOKEN_BLOCK) {
            block_rows(cache, kv_format, scales[pass], SLOTS(0), t0, t0 + TOKEN_BLOCK, shared, kv_heads, kvh, d, 0, d,
                       s->widened, s->rows);
            for (int64_t m = 0; m < group->count; m++)
                for (int64_t g = 0; g < per_kv; g++) {
                    const int fetch = m == 0 && g == 0;
                    if (pass == 0)
                        FOR_EACH_CHUNK(d, chunk_scores(QUERY(m, g) + offset, rows, TOKEN_BLOCK, offset, tail,
                                                       offset > 0, fetch, SCORES(m, g) + t0, VECTORS, MASKED))
                    else
                        FOR_EACH_CHUNK(d, chunk_values(SCORES(m, g) + t0, rows, TOKEN_BLOCK, offset, tail, t0 > 0,
                                                       fetch, OUTPUT(m, g), VECTORS, MASKED))
                }
        }
        for (int64_t m = 0; m < group->count; m++) {
            const int64_t len = seq_lens[group->first + m], end = pass == 0 ? (len + 7) / 8 * 8 : len;
            for (int64_t t0 = shared; t0 < end; t0 += TOKEN_BLOCK) {
                const int64_t count = end - t0 < TOKEN_BLOCK ? end - t0 : TOKEN_BLOCK;
                block_rows(cache, kv_format, scales[pass], SLOTS(m), t0, t0 + count < len ? t0 + count : len, len,
                           kv_heads, kvh, d, 0, d, s->widened, s->rows);
                for (int64_t g = 0; g < per_kv; g++) {
                    if (pass == 0)
                        FOR_EACH_CHUNK(d, chunk_scores(QUERY(m, g) + offset, rows, count, offset, tail, offset > 0,
                                                       g == 0, SCORES(m, g) + t0, VECTORS, MASKED))
                    else
                        FOR_EACH_CHUNK(d, chunk_values(SCORES(m, g) + t0, rows, count, offset, tail, t0 > 0, g == 0,
                                                       OUTPUT(m, g), VECTORS, MASKED))
                }
            }
            if (pass == 0)
                for (int64_t g = 0; g < per_kv; g++) softmax(SCORES(m, g), len, scale);
        }
    }
#undef SCORES
#undef QUERY
#undef OUTPUT
#undef SLOTS
}

/* Tokens from which a lone request takes attend_alone: over a shorter context its two extra
 * barriers cost more than the uneven split (BENCHMARKS.md has the measurement). */
#define ALONE_FROM 256

/* A request alone in its step (a batch of one) when its KV heads do not split evenly over the
 * threads (3 heads on 2 threads: one thread did two heads' work while the other waited): each
 * KV head's work is cut in `parts`, so that the threads get equal shares, in three passes with a
 * barrier between them: the scores, each part a range of the tokens; the softmax, a head at a
 * time; the weighted sum of values, each part a range of the head's values (each thread widens
 * only the values it reads). Every score, probability and output value is summed in the order
 * attend_group sums it, so a request's output is the same to the bit in a batch or alone. */
static void attend_alone(const float *q, const void *k_cache, const void *v_cache, int kv_format,
                         const float scales[2], const int64_t *slots, int64_t len, int64_t heads, int64_t kv_heads,
                         int64_t d, float scale, int64_t parts, float *out) {
    const int64_t per_kv = heads / kv_heads, longest = (len + 7) / 8 * 8;
    const int64_t span = ((longest + parts - 1) / parts + 7) / 8 * 8;          /* tokens a part, scores */
    const int64_t width = ((d + 7) / 8 + parts - 1) / parts * 8;               /* values a part, sums */
    float *scores = malloc((size_t)(heads * longest) * sizeof(float));
#define SCORES(g) (scores + (kvh * per_kv + (g)) * longest)
#pragma omp parallel
    {
        const float **rows = malloc(TOKEN_BLOCK * sizeof(float *));
        float *widened = kv_format == KV_FLOAT32 ? NULL : malloc(TOKEN_BLOCK * d * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * parts; task++) {
            const int64_t kvh = task / parts, part = task % parts;
            const int64_t end = (part + 1) * span < longest ? (part + 1) * span : longest;
            for (int64_t t0 = part * span; t0 < end; t0 += TOKEN_BLOCK) {
                const int64_t count = end - t0 < TOKEN_BLOCK ? end - t0 : TOKEN_BLOCK;
                block_rows(k_cache, kv_format, scales[0], slots, t0, t0 + count < len ? t0 + count : len, len, kv_heads,
                           kvh, d, 0, d, widened, rows);
                for (int64_t g = 0; g < per_kv; g++)
                    FOR_EACH_CHUNK(d, chunk_scores(q + (kvh * per_kv + g) * d + offset, rows, count, offset, tail,
                                                   offset > 0, g == 0, SCORES(g) + t0, VECTORS, MASKED))
            }
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < heads; h++) softmax(scores + h * longest, len, scale);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * parts; task++) {
            const int64_t kvh = task / parts, first = task % parts * width;
            const int64_t end = first + width < d ? first + width : d;
            for (int64_t t0 = 0; t0 < len && first < end; t0 += TOKEN_BLOCK) {
                const int64_t count = len - t0 < TOKEN_BLOCK ? len - t0 : TOKEN_BLOCK;
                block_rows(v_cache, kv_format, scales[1], slots, t0, t0 + count, len, kv_heads, kvh, d, first,
                           end - first, widened, rows);
                for (int64_t g = 0; g < per_kv; g++)
                    FOR_EACH_CHUNK_IN(first, end, chunk_values(SCORES(g) + t0, rows, count, offset, tail, t0 > 0, g == 0,
                                                                out + (kvh * per_kv + g) * d, VECTORS, MASKED))
            }
        }
        free((void *)rows);
        free(widened);
    }
#undef SCORES
    free(scores);
}

static void decode_attention(const float *q, int64_t q_stride, const float *k_new, const float *v_new,
                             int64_t new_stride, const int64_t *new_slots, void *k_cache, void *v_cache,
                             int kv_format, const float scales[2], const int64_t *kv_slots, int64_t stride, const int64_t *seq_lens,
                             const RequestGroup *groups, int64_t group_count, int64_t batch, int64_t heads,
                             int64_t kv_heads, int64_t d, float scale, float *out) {
    if (k_new != NULL)
        store_new(k_new, v_new, new_stride, new_slots, k_cache, v_cache, kv_format, scales, batch, kv_heads, d);
    const int threads = omp_get_max_threads();
    if (batch == 1 && threads > 1 && kv_heads % threads && seq_lens[0] >= ALONE_FROM) {
        int64_t parts = threads;   /* the fewest that make kv_heads * parts a multiple of threads */
        for (int64_t p = 1; p < threads; p++)
            if (kv_heads * p % threads == 0) { parts = p; break; }
        attend_alone(q, k_cache, v_cache, kv_format, scales, kv_slots, seq_lens[0], heads, kv_heads, d, scale, parts,
                     out);
        return;
    }
    int64_t longest = 8, members = 1;
    for (int64_t b = 0; b < batch; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    for (int64_t i = 0; i < group_count; i++) members = groups[i].count > members ? groups[i].count : members;
    longest = (longest + 7) / 8 * 8;
#pragma omp parallel
    {
        const Scratch s = {malloc(members * (heads / kv_heads) * longest * sizeof(float)),
                           malloc(TOKEN_BLOCK * sizeof(float *)),
                           kv_format == KV_FLOAT32 ? NULL : malloc(TOKEN_BLOCK * d * sizeof(float)), longest};
#pragma omp for schedule(static)
        for (int64_t task = 0; task < group_count * kv_heads; task++)
            attend_group(groups + task / kv_heads, task % kv_heads, q, q_stride, k_cache, v_cache, kv_format, scales,
                         kv_slots, stride, seq_lens, heads, kv_heads, d, scale, out, &s);
        free(s.scores);
        free((void *)s.rows);
        free(s.widened);
    }
}

/* decode_attention as srv.sdk.native.NativeKernel calls it, the step's metadata in the context
 * (built once a step by the backend's prepare): the backend's own decode calls it too. */
typedef struct {
    void *const *k_caches, *const *v_caches; /* one a layer */
    int64_t kv_format;
    const float *k_scales, *v_scales; /* one a layer, for float8 caches (else NULL) */
    const int64_t *new_slots, *kv_slots, *seq_lens;
    const RequestGroup *groups; /* srv_decode_groups' */
    int64_t group_count, kv_slots_stride, batch, heads, kv_heads, d;
    float scale;
} DecodeContext;

void srv_decode_attention_layer(const void *context, int64_t layer, const float *q, int64_t q_stride,
                                const float *k, const float *v, int64_t kv_stride, float *out) {
    const DecodeContext *c = context;
    const float scales[2] = {c->k_scales ? c->k_scales[layer] : 1.0f, c->v_scales ? c->v_scales[layer] : 1.0f};
    decode_attention(q, q_stride, k, v, kv_stride, c->new_slots, c->k_caches[layer], c->v_caches[layer],
                     (int)c->kv_format, scales, c->kv_slots, c->kv_slots_stride, c->seq_lens, c->groups, c->group_count,
                     c->batch, c->heads, c->kv_heads, c->d, c->scale, out);
}

/* Prefill attention on the KV cache in place: a batch's new tokens (prompts, prefill chunks,
 * draft tokens to verify) over their requests' cached and new keys and values, causal, read
 * through each request's slot table, with no padded copy of the batch.
 *
 * q [T][H][D] float32, tokens q_stride floats apart, each request's new tokens after the
 * previous request's; k_cache, v_cache [slots][KVH][D] in any of srv_kv_formats.h's formats (a
 * float8 cache's values times the layer's scale); kv_slots [B][stride] int64, whose first prefix + extend
 * entries of row b are request b's tokens (the new ones already stored); out [T][H][D] float32.
 *
 * An item is one request, one KV head and a block of its new tokens: its rows are the block's
 * tokens times the H / KVH query heads that read that KV head, so each key read serves every one
 * of them. OpenMP's threads (torch's runtime) take items in turn. An item walks the request's keys
 * a chunk at a time, flash-attention style: scores for the chunk, the softmax's running maximum
 * and sum brought up to date (the output so far rescaled), then the chunk's values added in.
 * Keys past a row's own token are masked; chunks past the block's last token are never read.
 *
 * The products are outer products, so no sum runs across a vector's lanes:
 *   scores: rows in the lanes; the queries transposed once an item ([D][rows]), a key's value
 *           broadcast times a vector of rows (a tile of KEY_TILE keys by ROW_VECTORS vectors);
 *   values: the head's values in the lanes; a row's probability broadcast times a vector of a
 *           value row (a tile of ROW_TILE rows by VALUE_VECTORS vectors).
 * The softmax runs down the columns of the chunk's scores, rows in the lanes, too.
 *
 * Instruction sets, picked per call (`isa`) by the Python side from the CPU's flags: 0 AVX2 with
 * FMA and F16C, 1 AVX-512, 2 AVX-512 with AVX512_BF16 for bf16 queries over a bf16 cache. One
 * body (the end of this file, which includes itself once per set) on GCC's vector extension, each
 * time with the set's register width and tiles that fit its registers; multiply-adds are fused
 * (-ffp-contract=fast). The bf16 body (BF16_DOT) keeps the softmax and swaps the products for
 * VDPBF16PS on pairs of bf16 values: the keys copied rather than widened, the values and the
 * probabilities interleaved in pairs of keys.
 */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "srv_kv_formats.h"

#ifndef EXTEND_BODY

/* Keys a chunk: its scores ([CHUNK][rows]) and widened keys and values stay in L2. */
#define CHUNK 128
/* Rows an item aims at (tokens times query heads a KV head): enough to make each key read worth
 * its widening, few enough that an extend of a few hundred tokens still gives every thread items. */
#define ITEM_ROWS 96
/* Rows are scattered over the cache: each is asked for this many rows before it is widened. */
#define WIDEN_AHEAD 16

typedef struct {
    const void *const *k_caches;     /* every layer's */
    const void *const *v_caches;
    int64_t kv_format;
    const float *k_scales, *v_scales; /* one a layer, for float8 caches (else NULL) */
    const int64_t *kv_slots;         /* [batch][kv_slots_stride] */
    int64_t kv_slots_stride;
    const int64_t *prefix_lens;      /* [batch] */
    const int64_t *extend_lens;      /* [batch] */
    int64_t batch, heads, kv_heads, d;
    float scale;
} ExtendContext;

typedef struct {
    int64_t request, first, end;     /* the request's new tokens [first, end) */
    int64_t q_row;                   /* the row of q of its token `first` */
} Block;

static inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

/* Each thread's scratch, kept from call to call (OpenMP's threads live on): its size depends on the
 * head size and the heads a KV head serves, not on the context, and a fresh allocation of it every
 * layer was a fresh mapping, faulted in page by page. */
static _Thread_local float *scratch_floats;
static _Thread_local int64_t scratch_size;

static float *thread_scratch(int64_t floats) {
    if (floats > scratch_size) {
        free(scratch_floats);
        scratch_floats = aligned_alloc(64, (size_t)round_up(floats * (int64_t)sizeof(float), 64));
        scratch_size = floats;
    }
    return scratch_floats;
}

#define INLINE static inline __attribute__((always_inline))

/* 16-bit lanes that interleave two runs, element i of the first then of the second (VPERMT2W's
 * and VPERMW's indices; a second operand's lanes number from 32): the bf16 body pairs two keys'
 * values (from the first 16 of each row's 32 lanes, then the last 16) and two keys'
 * probabilities (the two halves of one vector). */
static const uint16_t interleave_low[32] = {
    0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t interleave_high[32] = {
    16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
static const uint16_t interleave_halves[32] = {
    0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

#define EXTEND_BODY
#define NAME(name) name##_avx512
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define WIDTH 16
#define KEY_TILE 4
#define ROW_VECTORS 6
#define ROW_TILE 4
#define VALUE_VECTORS 4
#include __FILE__

#define NAME(name) name##_avx512bf16
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
#define BF16_DOT
#define WIDTH 16
#define KEY_TILE 4
#define ROW_VECTORS 6
#define ROW_TILE 4
#define VALUE_VECTORS 4
#include __FILE__

#define NAME(name) name##_avx2
#define TARGET __attribute__((target("avx2,fma,f16c")))
#define WIDTH 8
#define KEY_TILE 4
#define ROW_VECTORS 3
#define ROW_TILE 4
#define VALUE_VECTORS 2
#include __FILE__

/* out = causal attention of q over the cache for every new token of the batch, layer `layer`. */
void srv_extend_attention_layer(const ExtendContext *c, int64_t layer, const float *q, int64_t q_stride, float *out,
                                int64_t isa) {
    const int64_t group = c->heads / c->kv_heads;
    const int64_t tokens_a_block = group >= ITEM_ROWS ? 1 : ITEM_ROWS / group;
    int64_t count = 0;
    for (int64_t b = 0; b < c->batch; b++) count += (c->extend_lens[b] + tokens_a_block - 1) / tokens_a_block;
    Block *blocks = malloc((size_t)count * sizeof(Block));
    int64_t n = 0, q_row = 0;
    for (int64_t b = 0; b < c->batch; b++) {
        for (int64_t first = 0; first < c->extend_lens[b]; first += tokens_a_block) {
            const int64_t end = first + tokens_a_block < c->extend_lens[b] ? first + tokens_a_block : c->extend_lens[b];
            blocks[n++] = (Block){b, first, end, q_row + first};
        }
        q_row += c->extend_lens[b];
    }
    if (isa == 2) extend_attention_avx512bf16(c, layer, blocks, count, tokens_a_block, q, q_stride, out);
    else if (isa == 1) extend_attention_avx512(c, layer, blocks, count, tokens_a_block, q, q_stride, out);
    else extend_attention_avx2(c, layer, blocks, count, tokens_a_block, q, q_stride, out);
    free(blocks);
}

#else /* EXTEND_BODY: one instruction set's body */

typedef float NAME(vf) __attribute__((vector_size(4 * WIDTH)));
typedef int32_t NAME(vi) __attribute__((vector_size(4 * WIDTH)));
typedef uint32_t NAME(vu) __attribute__((vector_size(4 * WIDTH)));
typedef uint16_t NAME(vh) __attribute__((vector_size(2 * WIDTH)));
typedef _Float16 NAME(vhf) __attribute__((vector_size(2 * WIDTH)));
#define vf NAME(vf)
#define vi NAME(vi)
#define vu NAME(vu)
#define vh NAME(vh)
#define vhf NAME(vhf)

_Static_assert(CHUNK % KEY_TILE == 0 && WIDTH % ROW_TILE == 0,
               "a chunk holds whole key tiles, a vector whole row tiles");

TARGET INLINE vf NAME(load)(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
TARGET INLINE void NAME(store)(float *p, vf v) { memcpy(p, &v, sizeof v); }
TARGET INLINE vf NAME(select)(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }
TARGET INLINE vf NAME(larger)(vf a, vf b) { return NAME(select)(a > b, a, b); }

/* exp(x) for x <= 0 (or -inf): 2^n * e^r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
 * polynomial (relative error under 2e-7); below -87 it is 0. n is x / ln2 rounded by adding
 * 1.5 * 2^23, which leaves it in the low bits of the sum. */
TARGET INLINE vf NAME(exp_nonpositive)(vf x) {
    const vi underflow = x < -87.0f;
    x = NAME(select)(underflow, (vf){} - 87.0f, x);
    const vf shifted = x * 1.44269504088896341f + 12582912.0f;
    const vf n = shifted - 12582912.0f;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi exponent = ((vi)shifted - 0x4B400000 + 127) << 23;
    return (vf)((vi)(p * (vf)exponent) & ~underflow);
}

#ifndef BF16_DOT
/* Rows [0, n) of one KV head's keys or values at `slots` as float32 rows `stride` floats apart,
 * the columns from d to stride zero. */
TARGET static void NAME(widen_rows)(const void *cache, int64_t format, float scale, const int64_t *slots, int64_t n,
                                    int64_t head, int64_t kv_heads, int64_t d, float *rows, int64_t stride) {
    const int64_t row_bytes = d * element_size(format);
    for (int64_t t = 0; t < n; t++) {
        const int64_t offset = (slots[t] * kv_heads + head) * d;
        if (t + WIDEN_AHEAD < n) {
            const char *ahead = (const char *)cache + (slots[t + WIDEN_AHEAD] * kv_heads + head) * row_bytes;
            for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(ahead + line);
        }
        float *row = rows + t * stride;
        int64_t i = 0;
        if (format == KV_FLOAT32) {
            memcpy(row, (const float *)cache + offset, d * sizeof(float));
            i = d;
        } else if (format == KV_BFLOAT16) {
            const uint16_t *src = (const uint16_t *)cache + offset;
            for (; i + WIDTH <= d; i += WIDTH) {
                vh h;
                memcpy(&h, src + i, sizeof h);
                NAME(store)(row + i, (vf)(__builtin_convertvector(h, vu) << 16));
            }
            for (; i < d; i++) {
                const uint32_t bits = (uint32_t)src[i] << 16;
                memcpy(row + i, &bits, sizeof(float));
            }
        } else if (is_float8(format)) {
            widen_float8_row((const uint8_t *)cache + offset, format, d, scale, row);
            i = d;
        } else {
            const _Float16 *src = (const _Float16 *)cache + offset;
            for (; i + WIDTH <= d; i += WIDTH) {
                vhf h;
                memcpy(&h, src + i, sizeof h);
                NAME(store)(row + i, __builtin_convertvector(h, vf));
            }
            for (; i < d; i++) row[i] = (float)src[i];
        }
        for (; i < stride; i++) row[i] = 0.0f;
    }
}
#endif

/* scores[k][rows] = scale * keys[k] . queries[rows] for KEY_TILE keys and `vectors` (constant,
 * at most ROW_VECTORS) vectors of rows; qt [d][row_stride], the queries transposed. */
TARGET INLINE void NAME(score_tile)(const float *qt, int64_t row_stride, const float *keys, int64_t key_stride,
                                    int64_t d, float scale, float *scores, const int vectors) {
    vf acc[KEY_TILE][ROW_VECTORS];
    for (int k = 0; k < KEY_TILE; k++)
        for (int j = 0; j < vectors; j++) acc[k][j] = (vf){};
    for (int64_t e = 0; e < d; e++) {
        vf qv[ROW_VECTORS];
        for (int j = 0; j < vectors; j++) qv[j] = NAME(load)(qt + e * row_stride + j * WIDTH);
        for (int k = 0; k < KEY_TILE; k++) {
            const float key = keys[k * key_stride + e];
            for (int j = 0; j < vectors; j++) acc[k][j] += qv[j] * key;
        }
    }
    for (int k = 0; k < KEY_TILE; k++)
        for (int j = 0; j < vectors; j++) NAME(store)(scores + k * row_stride + j * WIDTH, acc[k][j] * scale);
}

/* out[ROW_TILE rows][vectors (constant, at most VALUE_VECTORS) vectors] += sum over k < len of
 * p[k][row] * values[k]; p is the chunk's probabilities [k][row_stride]. */
TARGET INLINE void NAME(value_tile)(const float *p, int64_t row_stride, const float *values, int64_t value_stride,
                                    int64_t len, float *out, const int vectors) {
    vf acc[ROW_TILE][VALUE_VECTORS];
    for (int r = 0; r < ROW_TILE; r++)
        for (int j = 0; j < vectors; j++) acc[r][j] = NAME(load)(out + r * value_stride + j * WIDTH);
    for (int64_t k = 0; k < len; k++) {
        vf v[VALUE_VECTORS];
        for (int j = 0; j < vectors; j++) v[j] = NAME(load)(values + k * value_stride + j * WIDTH);
        for (int r = 0; r < ROW_TILE; r++) {
            const float pr = p[k * row_stride + r];
            for (int j = 0; j < vectors; j++) acc[r][j] += v[j] * pr;
        }
    }
    for (int r = 0; r < ROW_TILE; r++)
        for (int j = 0; j < vectors; j++) NAME(store)(out + r * value_stride + j * WIDTH, acc[r][j]);
}

#ifdef BF16_DOT
/* The bf16 products (AVX512_BF16's VDPBF16PS: a lane sums two products of bf16 pairs in float32):
 * the queries, the keys and the values are bf16 already; the probabilities are rounded to bf16
 * for the values' products, as a bf16 matrix product would round them. A pair is a 32-bit word,
 * its first element in the low half. */

/* Rows [0, n) of one KV head's bf16 keys at `slots`, `stride` elements apart (d rounded up to
 * even, the padding zero), and rows n to `padded` zero. */
TARGET static void NAME(copy_keys)(const uint16_t *cache, const int64_t *slots, int64_t n, int64_t padded,
                                   int64_t head, int64_t kv_heads, int64_t d, uint16_t *rows, int64_t stride) {
    for (int64_t t = 0; t < padded; t++) {
        uint16_t *row = rows + t * stride;
        if (t >= n) {
            memset(row, 0, stride * sizeof(uint16_t));
            continue;
        }
        if (t + WIDEN_AHEAD < n) {
            const char *ahead = (const char *)(cache + (slots[t + WIDEN_AHEAD] * kv_heads + head) * d);
            for (int64_t line = 0; line < d * 2; line += 64) __builtin_prefetch(ahead + line);
        }
        memcpy(row, cache + (slots[t] * kv_heads + head) * d, d * sizeof(uint16_t));
        if (stride > d) row[d] = 0;
    }
}

/* The values of keys 2i and 2i + 1 side by side: pairs[i][e] holds both keys' value e, for
 * i < padded / 2 and e < d_pad, zero past d and past key n. */
TARGET static void NAME(pair_values)(const uint16_t *cache, const int64_t *slots, int64_t n, int64_t padded,
                                     int64_t head, int64_t kv_heads, int64_t d, int64_t d_pad, uint32_t *pairs) {
    const __m512i low = _mm512_loadu_si512(interleave_low), high = _mm512_loadu_si512(interleave_high);
    for (int64_t i = 0; i < padded / 2; i++) {
        const int64_t t = 2 * i;
        if (t + WIDEN_AHEAD + 1 < n)
            for (int u = 0; u < 2; u++) {
                const char *ahead = (const char *)(cache + (slots[t + WIDEN_AHEAD + u] * kv_heads + head) * d);
                for (int64_t line = 0; line < d * 2; line += 64) __builtin_prefetch(ahead + line);
            }
        const uint16_t *first = t < n ? cache + (slots[t] * kv_heads + head) * d : NULL;
        const uint16_t *second = t + 1 < n ? cache + (slots[t + 1] * kv_heads + head) * d : NULL;
        for (int64_t e = 0; e < d_pad; e += 32) {
            const int64_t left = d - e;
            const __mmask32 mask = left >= 32 ? (__mmask32)~0u : (left > 0 ? (__mmask32)((1u << left) - 1) : 0);
            const __m512i a = first ? _mm512_maskz_loadu_epi16(mask, first + e) : _mm512_setzero_si512();
            const __m512i b = second ? _mm512_maskz_loadu_epi16(mask, second + e) : _mm512_setzero_si512();
            _mm512_storeu_si512(pairs + i * d_pad + e, _mm512_permutex2var_epi16(a, low, b));
            if (e + 16 < d_pad) _mm512_storeu_si512(pairs + i * d_pad + e + 16, _mm512_permutex2var_epi16(a, high, b));
        }
    }
}

/* p2[i][rows] = the probabilities of keys 2i and 2i + 1 in bf16 pairs, for i < padded / 2. */
TARGET static void NAME(pair_probabilities)(const float *p, int64_t padded, int64_t vectors, int64_t row_stride,
                                            uint32_t *p2) {
    const __m512i interleave = _mm512_loadu_si512(interleave_halves);
    for (int64_t i = 0; i < padded / 2; i++)
        for (int64_t j = 0; j < vectors; j++) {
            const __m512 even = _mm512_loadu_ps(p + 2 * i * row_stride + j * WIDTH);
            const __m512 odd = _mm512_loadu_ps(p + (2 * i + 1) * row_stride + j * WIDTH);
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);   /* even in the low half */
            _mm512_storeu_si512(p2 + i * row_stride + j * WIDTH, _mm512_permutexvar_epi16(interleave, both));
        }
}

/* score_tile's products on bf16 pairs: qt2 [d / 2][row_stride] pairs of the queries, keys
 * [KEY_TILE][key_stride] bf16. */
TARGET INLINE void NAME(score_tile_bf16)(const uint32_t *qt2, int64_t row_stride, const uint16_t *keys,
                                         int64_t key_stride, int64_t pairs, float scale, float *scores,
                                         const int vectors) {
    __m512 acc[KEY_TILE][ROW_VECTORS];
    for (int k = 0; k < KEY_TILE; k++)
        for (int j = 0; j < vectors; j++) acc[k][j] = _mm512_setzero_ps();
    for (int64_t e = 0; e < pairs; e++) {
        __m512bh qv[ROW_VECTORS];
        for (int j = 0; j < vectors; j++) qv[j] = (__m512bh)_mm512_loadu_si512(qt2 + e * row_stride + j * WIDTH);
        for (int k = 0; k < KEY_TILE; k++) {
            int32_t pair;
            memcpy(&pair, keys + k * key_stride + 2 * e, sizeof pair);
            const __m512bh key = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < vectors; j++) acc[k][j] = _mm512_dpbf16_ps(acc[k][j], qv[j], key);
        }
    }
    const __m512 factor = _mm512_set1_ps(scale);
    for (int k = 0; k < KEY_TILE; k++)
        for (int j = 0; j < vectors; j++)
            _mm512_storeu_ps(scores + k * row_stride + j * WIDTH, _mm512_mul_ps(acc[k][j], factor));
}

/* value_tile's products on bf16 pairs of keys: p2 [len2][row_stride], values [len2][value_stride]. */
TARGET INLINE void NAME(value_tile_bf16)(const uint32_t *p2, int64_t row_stride, const uint32_t *values,
                                         int64_t value_stride, int64_t len2, float *out, const int vectors) {
    __m512 acc[ROW_TILE][VALUE_VECTORS];
    for (int r = 0; r < ROW_TILE; r++)
        for (int j = 0; j < vectors; j++) acc[r][j] = _mm512_loadu_ps(out + r * value_stride + j * WIDTH);
    for (int64_t i = 0; i < len2; i++) {
        __m512bh v[VALUE_VECTORS];
        for (int j = 0; j < vectors; j++) v[j] = (__m512bh)_mm512_loadu_si512(values + i * value_stride + j * WIDTH);
        for (int r = 0; r < ROW_TILE; r++) {
            const __m512bh pr = (__m512bh)_mm512_set1_epi32((int32_t)p2[i * row_stride + r]);
            for (int j = 0; j < vectors; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], v[j], pr);
        }
    }
    for (int r = 0; r < ROW_TILE; r++)
        for (int j = 0; j < vectors; j++) _mm512_storeu_ps(out + r * value_stride + j * WIDTH, acc[r][j]);
}
#endif

TARGET static void NAME(extend_attention)(const ExtendContext *c, int64_t layer, const Block *blocks, int64_t count,
                                          int64_t tokens_a_block, const float *q, int64_t q_stride, float *out) {
    const void *k_cache = c->k_caches[layer], *v_cache = c->v_caches[layer];
#ifndef BF16_DOT   /* the bf16 body reads bf16 caches only */
    const float k_scale = c->k_scales ? c->k_scales[layer] : 1.0f, v_scale = c->v_scales ? c->v_scales[layer] : 1.0f;
#endif
    const int64_t d = c->d, group = c->heads / c->kv_heads, kv_heads = c->kv_heads;
    const int64_t d_pad = round_up(d, WIDTH), row_stride = round_up(tokens_a_block * group, WIDTH);
    const int64_t value_vectors = d_pad / WIDTH;
#pragma omp parallel
    {
        /* queries transposed [d][rows], scores [CHUNK][rows], keys and values [CHUNK][d_pad], the
         * output [rows][d_pad], and each row's position, running maximum, sum and rescaling */
        const int64_t floats = d * row_stride + CHUNK * row_stride + 2 * CHUNK * d_pad + row_stride * d_pad
                               + 4 * row_stride + CHUNK / 2 * row_stride;
        float *scratch = thread_scratch(floats);
        float *qt = scratch, *scores = qt + d * row_stride, *keys = scores + CHUNK * row_stride;
        float *values = keys + CHUNK * d_pad, *o = values + CHUNK * d_pad, *position = o + row_stride * d_pad;
        float *maximum = position + row_stride, *sum = maximum + row_stride, *rescale = sum + row_stride;
#ifdef BF16_DOT
        /* the same places hold the queries, keys and values in bf16 pairs, and the probabilities' pairs */
        uint32_t *qt2 = (uint32_t *)qt, *value_pairs = (uint32_t *)values, *p2 = (uint32_t *)(rescale + row_stride);
        uint16_t *key_rows = (uint16_t *)keys;
        const int64_t d_even = round_up(d, 2);
#endif
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < count * kv_heads; item++) {
            const Block *block = blocks + item / kv_heads;
            const int64_t head = item % kv_heads, b = block->request, prefix = c->prefix_lens[b];
            const int64_t rows = (block->end - block->first) * group, vectors = round_up(rows, WIDTH) / WIDTH;
            const int64_t *slots = c->kv_slots + b * c->kv_slots_stride;
            /* row r: token first + r / group, query head head * group + r % group; the padding
             * rows (zero queries) are never masked and never written out */
            for (int64_t r = 0; r < vectors * WIDTH; r++) {
                const int64_t token = block->first + r / group;
                const float *query = q + (block->q_row + r / group) * q_stride + (head * group + r % group) * d;
#ifdef BF16_DOT
                for (int64_t e = 0; e < d; e += 2) {
                    uint32_t pair = 0;
                    if (r < rows) {   /* the queries are bf16 values: their float32 bits' high half */
                        uint32_t first, second = 0;
                        memcpy(&first, query + e, sizeof first);
                        if (e + 1 < d) memcpy(&second, query + e + 1, sizeof second);
                        pair = (first >> 16) | (second & 0xFFFF0000u);
                    }
                    qt2[e / 2 * row_stride + r] = pair;
                }
#else
                for (int64_t e = 0; e < d; e++) qt[e * row_stride + r] = r < rows ? query[e] : 0.0f;
#endif
                position[r] = r < rows ? (float)(prefix + token) : INFINITY;
                maximum[r] = -INFINITY;
                sum[r] = 0.0f;
            }
            memset(o, 0, (size_t)(vectors * WIDTH * d_pad) * sizeof(float));
            const int64_t n = prefix + block->end;   /* keys the block's last token reads */
            for (int64_t k0 = 0; k0 < n; k0 += CHUNK) {
                const int64_t len = n - k0 < CHUNK ? n - k0 : CHUNK, padded = round_up(len, KEY_TILE);
#ifdef BF16_DOT
                NAME(copy_keys)(k_cache, slots + k0, len, padded, head, kv_heads, d, key_rows, d_even);
                NAME(pair_values)(v_cache, slots + k0, len, padded, head, kv_heads, d, d_pad, value_pairs);
#else
                NAME(widen_rows)(k_cache, c->kv_format, k_scale, slots + k0, len, head, kv_heads, d, keys, d_pad);
                NAME(widen_rows)(v_cache, c->kv_format, v_scale, slots + k0, len, head, kv_heads, d, values, d_pad);
                for (int64_t k = len; k < padded; k++) memset(keys + k * d_pad, 0, d_pad * sizeof(float));
#endif
                for (int64_t k = 0; k < padded; k += KEY_TILE)
                    for (int64_t j = 0; j < vectors; j += ROW_VECTORS) {
                        const float *qj = qt + j * WIDTH;
                        float *sj = scores + k * row_stride + j * WIDTH;
                        switch (vectors - j < ROW_VECTORS ? vectors - j : ROW_VECTORS) {
#ifdef BF16_DOT
#define SCORE_TILE(n) NAME(score_tile_bf16)((const uint32_t *)qj, row_stride, key_rows + k * d_even, d_even, \
                                            d_even / 2, c->scale, sj, n)
#else
#define SCORE_TILE(n) NAME(score_tile)(qj, row_stride, keys + k * d_pad, d_pad, d, c->scale, sj, n)
#endif
                        case 1: SCORE_TILE(1); break;
#if ROW_VECTORS > 1
                        case 2: SCORE_TILE(2); break;
#endif
#if ROW_VECTORS > 2
                        case 3: SCORE_TILE(3); break;
#endif
#if ROW_VECTORS > 3
                        case 4: SCORE_TILE(4); break;
#endif
#if ROW_VECTORS > 4
                        case 5: SCORE_TILE(5); break;
#endif
#if ROW_VECTORS > 5
                        case 6: SCORE_TILE(6); break;
#endif
#undef SCORE_TILE
                        }
                    }
                /* the softmax's running state, rows in the lanes; keys past a row's token (and
                 * the chunk's padding keys, past every row's) count as minus infinity */
                const int masked = k0 + padded > prefix + block->first + 1;
                for (int64_t j = 0; j < vectors; j++) {
                    const vf where = NAME(load)(position + j * WIDTH);
                    vf largest = NAME(load)(maximum + j * WIDTH);
                    const vf before = largest;
                    for (int64_t k = 0; k < padded; k++) {
                        vf s = NAME(load)(scores + k * row_stride + j * WIDTH);
                        if (masked) {
                            s = NAME(select)((float)(k0 + k) > where, (vf){} - INFINITY, s);
                            NAME(store)(scores + k * row_stride + j * WIDTH, s);
                        }
                        largest = NAME(larger)(s, largest);
                    }
                    vf total = (vf){};
                    for (int64_t k = 0; k < padded; k++) {
                        float *at = scores + k * row_stride + j * WIDTH;
                        const vf e = NAME(exp_nonpositive)(NAME(load)(at) - largest);
                        NAME(store)(at, e);
                        total += e;
                    }
                    const vf factor = NAME(exp_nonpositive)(before - largest);
                    NAME(store)(sum + j * WIDTH, NAME(load)(sum + j * WIDTH) * factor + total);
                    NAME(store)(maximum + j * WIDTH, largest);
                    NAME(store)(rescale + j * WIDTH, factor);
                }
                if (k0 > 0)
                    for (int64_t r = 0; r < vectors * WIDTH; r++)
                        for (int64_t e = 0; e < d_pad; e += WIDTH)
                            NAME(store)(o + r * d_pad + e, NAME(load)(o + r * d_pad + e) * rescale[r]);
#ifdef BF16_DOT
                NAME(pair_probabilities)(scores, padded, vectors, row_stride, p2);
#endif
                for (int64_t r = 0; r < vectors * WIDTH; r += ROW_TILE)
                    for (int64_t j = 0; j < value_vectors; j += VALUE_VECTORS) {
                        float *out_rj = o + r * d_pad + j * WIDTH;
                        switch (value_vectors - j < VALUE_VECTORS ? value_vectors - j : VALUE_VECTORS) {
#ifdef BF16_DOT
#define VALUE_TILE(n) NAME(value_tile_bf16)(p2 + r, row_stride, value_pairs + j * WIDTH, d_pad, padded / 2, out_rj, n)
#else
#define VALUE_TILE(n) NAME(value_tile)(scores + r, row_stride, values + j * WIDTH, d_pad, len, out_rj, n)
#endif
                        case 1: VALUE_TILE(1); break;
#if VALUE_VECTORS > 1
                        case 2: VALUE_TILE(2); break;
#endif
#if VALUE_VECTORS > 2
                        case 3: VALUE_TILE(3); break;
#endif
#if VALUE_VECTORS > 3
                        case 4: VALUE_TILE(4); break;
#endif
#undef VALUE_TILE
                        }
                    }
            }
            for (int64_t r = 0; r < rows; r++) {
                float *target = out + (block->q_row + r / group) * c->heads * d + (head * group + r % group) * d;
                const float inverse = 1.0f / sum[r];
                for (int64_t e = 0; e < d; e++) target[e] = o[r * d_pad + e] * inverse;
            }
        }
    }
}

#undef vf
#undef vi
#undef vu
#undef vh
#undef vhf
#undef NAME
#undef TARGET
#undef WIDTH
#undef KEY_TILE
#undef ROW_VECTORS
#undef ROW_TILE
#undef VALUE_VECTORS
#undef BF16_DOT

#endif /* EXTEND_BODY */

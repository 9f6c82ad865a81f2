/* srv's fused MoE runner: one call a layer groups the routes by expert, gathers each expert's
 * rows, runs gate/up, the activation and down for every expert, and adds each route's weighted
 * output into its token's row.
 *
 * Decode batches are bound by the bytes of the expert weights, so each weight row is read once
 * for all the rows routed to its expert (it stays in L1 while they pass), and the work is split
 * over (expert, block of weight rows) items so that both cores stay busy even when one expert
 * has every token. Weights are float32, bfloat16 (widened on the fly) or int8 with a float32
 * scale per output row; sums are float32. With bfloat16 weights the products' inputs are
 * bfloat16 values too, as the served model holds them: the rows of x are, and the activation
 * between the two products is rounded to bfloat16 (as the reference's bf16 products round it).
 *
 * The dot products are compiled for AMX (bfloat16 weights: sixteen weight rows a tile against
 * up to sixteen rows of x, the arithmetic nearly free, so a step reads the weights at the memory's
 * pace), AVX-512 with BF16 (bfloat16 pairs multiplied and added in one instruction, for bfloat16
 * weights), AVX-512, AVX2+FMA and portable C, and picked at run time from the CPU's flags (and, for
 * AMX, the OS's leave); srv_moe_set_isa forces one (the tests check each against the others).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "srv_amx.h"

enum { WEIGHT_F32 = 0, WEIGHT_BF16 = 1, WEIGHT_I8 = 2 };
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3, ISA_AMX = 4 };

typedef struct {
    int64_t tokens, top_k, hidden, inter, local, start, weight_type, activation;   /* activation: 0 silu, 1 gelu (tanh) */
    const void *w13;      /* [local][2 * inter][hidden] */
    const void *w2;       /* [local][hidden][inter] */
    const float *w13_scale, *w2_scale;   /* int8: [local][2 * inter], [local][hidden] */
    const float *x;       /* [tokens][hidden] */
    const int64_t *ids;   /* [tokens][top_k], global expert ids */
    const float *weights; /* [tokens][top_k] */
    float *out;           /* [tokens][hidden], zeroed by the caller */
} MoEArgs;

static inline float bf16_to_float(uint16_t v) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}

/* float32 to the nearest bfloat16 (ties to even; the activations here are finite). */
static inline uint16_t float_to_bf16(float v) {
    union { uint32_t u; float f; } c;
    c.f = v;
    return (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16);
}

/* A weight of each type as float32. */
#define AS_WEIGHT_f32(v) (v)
#define AS_WEIGHT_bf16(v) bf16_to_float(v)
#define AS_WEIGHT_i8(v) ((float)(v))

/* y[r * y_stride] = w . x[r] for the n rows of x (each `len` long, `len` apart): what every
 * instruction set computes. The portable one, four rows at a time so that each weight value
 * loaded serves four products, is left to the compiler's vectorizer. */
#define DOT_ROWS_OF(TYPE, NAME, LOAD)                                                                     \
    static void NAME##_portable(const TYPE *w, const float *x, int64_t n, int64_t len, float *y,          \
                                int64_t y_stride) {                                                      \
        int64_t r = 0;                                                                                   \
        for (; r + 4 <= n; r += 4) {                                                                     \
            const float *x0 = x + r * len, *x1 = x0 + len, *x2 = x1 + len, *x3 = x2 + len;               \
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;                                            \
            _Pragma("omp simd reduction(+:a0,a1,a2,a3)") for (int64_t i = 0; i < len; i++) {             \
                float v = LOAD(w[i]);                                                                    \
                a0 += v * x0[i]; a1 += v * x1[i]; a2 += v * x2[i]; a3 += v * x3[i];                      \
            }                                                                                            \
            y[r * y_stride] = a0; y[(r + 1) * y_stride] = a1;                                            \
            y[(r + 2) * y_stride] = a2; y[(r + 3) * y_stride] = a3;                                      \
        }                                                                                                \
        for (; r < n; r++) {                                                                             \
            const float *xr = x + r * len;                                                               \
            float acc = 0.0f;                                                                            \
            _Pragma("omp simd reduction(+:acc)") for (int64_t i = 0; i < len; i++) acc += LOAD(w[i]) * xr[i]; \
            y[r * y_stride] = acc;                                                                       \
        }                                                                                                \
    }
DOT_ROWS_OF(float, dots_f32, AS_WEIGHT_f32)
DOT_ROWS_OF(uint16_t, dots_bf16, AS_WEIGHT_bf16)
DOT_ROWS_OF(int8_t, dots_i8, AS_WEIGHT_i8)

/* The vector bodies, in intrinsics: a group of up to four rows of x reads each weight vector
 * once, each row sums in two independent accumulators (even and odd vectors), and each sum is
 * reduced in registers once a weight row. (The vectorizer's versions of the loops above
 * reduced through the stack, one lane at a time, which cost as much as the products at these
 * lengths, and re-read the weight row for every row past a multiple of four.) */
#define INLINE static inline __attribute__((always_inline))
#define AVX512 __attribute__((target("avx512f,avx512bw,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

/* Each instruction set's vector (vec_ISA, LANES_ISA floats) and the operations the group body
 * below uses: zero, load floats, multiply-add, sum the lanes, and widen LANES weights of each
 * type to float32. */
typedef __m512 vec_512;
typedef __m256 vec_avx2;
#define LANES_512 16
#define LANES_avx2 8
AVX512 INLINE __m512 zero_512(void) { return _mm512_setzero_ps(); }
AVX512 INLINE __m512 load_512(const float *x) { return _mm512_loadu_ps(x); }
AVX512 INLINE __m512 fma_512(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
AVX512 INLINE float sum_512(__m512 a, __m512 b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
AVX512 INLINE __m512 widen_f32_512(const float *w) { return _mm512_loadu_ps(w); }
AVX512 INLINE __m512 widen_bf16_512(const uint16_t *w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16));
}
AVX512 INLINE __m512 widen_i8_512(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}
AVX2 INLINE __m256 zero_avx2(void) { return _mm256_setzero_ps(); }
AVX2 INLINE __m256 load_avx2(const float *x) { return _mm256_loadu_ps(x); }
AVX2 INLINE __m256 fma_avx2(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
AVX2 INLINE float sum_avx2(__m256 a, __m256 b) {
    const __m256 v = _mm256_add_ps(a, b);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
AVX2 INLINE __m256 widen_f32_avx2(const float *w) { return _mm256_loadu_ps(w); }
AVX2 INLINE __m256 widen_bf16_avx2(const uint16_t *w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}
AVX2 INLINE __m256 widen_i8_avx2(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}
/* `rows` (1..4, a constant where inlined) rows of x against one weight row; the weights past
 * the last whole vector are summed one by one. */
#define GROUP(TYPE, SUFFIX, ISA, ATTR)                                                                     \
    ATTR INLINE void group_##SUFFIX##_##ISA(const TYPE *w, const float *x, int64_t len, float *y,         \
                                            int64_t y_stride, const int rows) {                           \
        const int64_t lanes = LANES_##ISA;                                                                \
        vec_##ISA even[4], odd[4];                                                                        \
        for (int r = 0; r < rows; r++) even[r] = odd[r] = zero_##ISA();                                   \
        int64_t i = 0;                                                                                    \
        for (; i + 2 * lanes <= len; i += 2 * lanes) {                                                    \
            const vec_##ISA w0 = widen_##SUFFIX##_##ISA(w + i), w1 = widen_##SUFFIX##_##ISA(w + i + lanes); \
            for (int r = 0; r < rows; r++) {                                                              \
                even[r] = fma_##ISA(w0, load_##ISA(x + r * len + i), even[r]);                            \
                odd[r] = fma_##ISA(w1, load_##ISA(x + r * len + i + lanes), odd[r]);                      \
            }                                                                                             \
        }                                                                                                 \
        for (; i + lanes <= len; i += lanes) {                                                            \
            const vec_##ISA w0 = widen_##SUFFIX##_##ISA(w + i);                                           \
            for (int r = 0; r < rows; r++) even[r] = fma_##ISA(w0, load_##ISA(x + r * len + i), even[r]); \
        }                                                                                                 \
        for (int r = 0; r < rows; r++) {                                                                  \
            float sum = sum_##ISA(even[r], odd[r]);                                                       \
            for (int64_t t = i; t < len; t++) sum += (float)AS_WEIGHT_##SUFFIX(w[t]) * x[r * len + t];    \
            y[r * y_stride] = sum;                                                                        \
        }                                                                                                 \
    }

/* Every row of x in groups of four, the last group one of three, two or one. */
#define DOTS_VECTOR(TYPE, SUFFIX, ISA, ATTR)                                                               \
    GROUP(TYPE, SUFFIX, ISA, ATTR)                                                                         \
    ATTR static void dots_##SUFFIX##_##ISA(const TYPE *w, const float *x, int64_t n, int64_t len, float *y, \
                                           int64_t y_stride) {                                            \
        int64_t r = 0;                                                                                    \
        for (; r + 4 <= n; r += 4) group_##SUFFIX##_##ISA(w, x + r * len, len, y + r * y_stride, y_stride, 4); \
        const float *xr = x + r * len;                                                                    \
        float *yr = y + r * y_stride;                                                                     \
        switch (n - r) {                                                                                  \
        case 3: group_##SUFFIX##_##ISA(w, xr, len, yr, y_stride, 3); break;                               \
        case 2: group_##SUFFIX##_##ISA(w, xr, len, yr, y_stride, 2); break;                               \
        case 1: group_##SUFFIX##_##ISA(w, xr, len, yr, y_stride, 1); break;                               \
        default: break;                                                                                   \
        }                                                                                                 \
    }

/* dots_TYPE_ISA for each weight type. */
#define DOTS_OF_ISA(ISA, ATTR)                                                                             \
    DOTS_VECTOR(float, f32, ISA, ATTR)                                                                     \
    DOTS_VECTOR(uint16_t, bf16, ISA, ATTR)                                                                 \
    DOTS_VECTOR(int8_t, i8, ISA, ATTR)
DOTS_OF_ISA(512, AVX512)
DOTS_OF_ISA(avx2, AVX2)

/* bfloat16 weights against bfloat16 rows of x, 32 pairs a vector: vdpbf16ps adds each lane's two
 * products (exact in float32) to its sum. Up to four rows a weight vector, two accumulators each. */
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
AVX512_BF16 INLINE void group_bf16_pairs(const uint16_t *w, const uint16_t *x, int64_t len, float *y,
                                         int64_t y_stride, const int rows) {
    __m512 even[4], odd[4];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= len; i += 64) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i), w1 = (__m512bh)_mm512_loadu_si512(w + i + 32);
        for (int r = 0; r < rows; r++) {
            even[r] = _mm512_dpbf16_ps(even[r], w0, (__m512bh)_mm512_loadu_si512(x + r * len + i));
            odd[r] = _mm512_dpbf16_ps(odd[r], w1, (__m512bh)_mm512_loadu_si512(x + r * len + i + 32));
        }
    }
    for (; i + 32 <= len; i += 32) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i);
        for (int r = 0; r < rows; r++)
            even[r] = _mm512_dpbf16_ps(even[r], w0, (__m512bh)_mm512_loadu_si512(x + r * len + i));
    }
    for (int r = 0; r < rows; r++) {
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
        for (int64_t t = i; t < len; t++) sum += bf16_to_float(w[t]) * bf16_to_float(x[r * len + t]);
        y[r * y_stride] = sum;
    }
}

AVX512_BF16 static void dots_bf16_pairs(const uint16_t *w, const uint16_t *x, int64_t n, int64_t len, float *y,
                                        int64_t y_stride) {
    int64_t r = 0;
    for (; r + 4 <= n; r += 4) group_bf16_pairs(w, x + r * len, len, y + r * y_stride, y_stride, 4);
    const uint16_t *xr = x + r * len;
    float *yr = y + r * y_stride;
    switch (n - r) {
    case 3: group_bf16_pairs(w, xr, len, yr, y_stride, 3); break;
    case 2: group_bf16_pairs(w, xr, len, yr, y_stride, 2); break;
    case 1: group_bf16_pairs(w, xr, len, yr, y_stride, 1); break;
    default: break;
    }
}

/* AMX: 16 rows of bf16 weights a tile (tile 0, read where they lie, `len` apart) against up to
 * 16 bf16 rows of x laid out for the second operand (tile 1, srv_amx_pack_rows), summed into tile
 * 2: y[r * y_stride + i] = W[i] . x[r] for the n rows of x. `len` is a multiple of 32. */
#define AMX_BF16 __attribute__((target("amx-tile,amx-bf16,avx512f")))
AMX_BF16 static void tiles_bf16(const uint16_t *w, const uint32_t *packed, int64_t n, int64_t len, float *y,
                                int64_t y_stride) {
    const int64_t chunks = len / 32;
    float sums[SRV_AMX_TILE][SRV_AMX_TILE];
    for (int64_t g = 0; g * SRV_AMX_TILE < n; g++) {
        _tile_zero(2);
        for (int64_t c = 0; c < chunks; c++) {
            _tile_loadd(0, w + c * 32, len * 2);
            _tile_loadd(1, packed + (g * chunks + c) * SRV_AMX_TILE * SRV_AMX_TILE, 64);
            _tile_dpbf16ps(2, 0, 1);
        }
        _tile_stored(2, sums, 64);
        const int64_t m = n - g * SRV_AMX_TILE < SRV_AMX_TILE ? n - g * SRV_AMX_TILE : SRV_AMX_TILE;
        for (int i = 0; i < SRV_AMX_TILE; i++)
            for (int64_t r = 0; r < m; r++) y[(g * SRV_AMX_TILE + r) * y_stride + i] = sums[i][r];
    }
}

static int isa = -1;

int srv_moe_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
        if (!__builtin_cpu_supports("avx512bf16")) return ISA_AVX512;
        return srv_amx_usable(SRV_AMX_BF16) ? ISA_AMX : ISA_AVX512_BF16;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
    return ISA_PORTABLE;
}

/* Forcing a set the CPU lacks is the caller's error; the best one is looked up first, as that asks
 * the OS for the tiles. */
void srv_moe_set_isa(int level) {
    srv_moe_best_isa();
    isa = level;
}

/* A thread's tiles for tiles_bf16, and their release. */
AMX_BF16 static void amx_configure(void) { srv_amx_configure(3); }
AMX_BF16 static void amx_release(void) { _tile_release(); }

/* Whether x's rows are stored as bfloat16 (for the pairs' instruction), else as float32. */
static int bf16_rows(int64_t type) { return type == WEIGHT_BF16 && isa >= ISA_AVX512_BF16; }

/* Row `row` of a [rows][len] weight matrix of the given type, dotted with n rows of x. */
static void dots(int64_t type, const void *w, int64_t row, const void *xv, int64_t n, int64_t len, float *y,
                 int64_t y_stride) {
    const float *x = xv;
    if (bf16_rows(type)) {
        dots_bf16_pairs((const uint16_t *)w + row * len, xv, n, len, y, y_stride);
    } else if (type == WEIGHT_F32) {
        const float *r = (const float *)w + row * len;
        if (isa >= ISA_AVX512) dots_f32_512(r, x, n, len, y, y_stride);
        else if (isa == ISA_AVX2) dots_f32_avx2(r, x, n, len, y, y_stride);
        else dots_f32_portable(r, x, n, len, y, y_stride);
    } else if (type == WEIGHT_BF16) {
        const uint16_t *r = (const uint16_t *)w + row * len;
        if (isa >= ISA_AVX512) dots_bf16_512(r, x, n, len, y, y_stride);
        else if (isa == ISA_AVX2) dots_bf16_avx2(r, x, n, len, y, y_stride);
        else dots_bf16_portable(r, x, n, len, y, y_stride);
    } else {
        const int8_t *r = (const int8_t *)w + row * len;
        if (isa >= ISA_AVX512) dots_i8_512(r, x, n, len, y, y_stride);
        else if (isa == ISA_AVX2) dots_i8_avx2(r, x, n, len, y, y_stride);
        else dots_i8_portable(r, x, n, len, y, y_stride);
    }
}

/* While a weight row is computed, the next one is asked for: an item starts a new stream, too
 * short for the hardware prefetchers to run ahead of before it ends (-DPREFETCH_ROWS=N compiles
 * another distance; 0 turns it off). */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 1
#endif
static inline void prefetch_row(int64_t type, const void *w, int64_t row, int64_t len) {
    const int64_t size = type == WEIGHT_F32 ? 4 : (type == WEIGHT_BF16 ? 2 : 1);
    const char *start = (const char *)w + row * len * size;
    for (int64_t offset = 0; offset < len * size; offset += 64) __builtin_prefetch(start + offset);
}

/* Weight rows an item: enough items to share between the threads, each a stream long enough
 * to read at the memory's pace (with the weights in huge pages, 64 rows read slower). */
#define BLOCK_ROWS 256

/* Products of every (expert, block of `rows` weight rows) item: out_rows[r][j] = W_e[j] . in[r]. */
static void expert_products(const MoEArgs *a, const void *w, const float *scale, int64_t rows, int64_t len,
                            const int64_t *offsets, const void *in, float *out) {
    const int64_t in_size = bf16_rows(a->weight_type) ? 2 : 4;
    int64_t blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
    int64_t items = a->local * blocks;
    /* On AMX, each expert's rows of x laid out for the tiles first (16 rows a group). */
    uint32_t *packed = NULL;
    int64_t *packed_at = NULL;
    if (isa == ISA_AMX && bf16_rows(a->weight_type) && len % 32 == 0) {
        /* Without the memory for them the vector bodies compute it all. */
        packed_at = malloc(sizeof(int64_t) * (size_t)(a->local + 1));
        if (packed_at) {
            packed_at[0] = 0;
            for (int64_t e = 0; e < a->local; e++) {
                const int64_t n = offsets[e + 1] - offsets[e];
                packed_at[e + 1] = packed_at[e] + (n + SRV_AMX_TILE - 1) / SRV_AMX_TILE * SRV_AMX_TILE * len / 2;
            }
            packed = malloc(sizeof(uint32_t) * (size_t)(packed_at[a->local] ? packed_at[a->local] : 1));
        }
        if (!packed) {
            free(packed_at);
            packed_at = NULL;
        } else {
            for (int64_t e = 0; e < a->local; e++)
                if (offsets[e + 1] > offsets[e])
                    srv_amx_pack_rows((const uint16_t *)in + offsets[e] * len, offsets[e + 1] - offsets[e], len * 2,
                                      packed + packed_at[e]);
        }
    }
#pragma omp parallel
    {
        if (packed) amx_configure();
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            int64_t e = item / blocks, first = (item % blocks) * BLOCK_ROWS;
            int64_t n = offsets[e + 1] - offsets[e];
            if (n == 0) continue;
            int64_t last = first + BLOCK_ROWS < rows ? first + BLOCK_ROWS : rows;
            const char *x = (const char *)in + offsets[e] * len * in_size;
            float *y = out + offsets[e] * rows;
            int64_t j = first;
            if (packed) {
                for (; j + SRV_AMX_TILE <= last; j += SRV_AMX_TILE)
                    tiles_bf16((const uint16_t *)w + (e * rows + j) * len, packed + packed_at[e], n, len, y + j, rows);
            }
            for (; j < last; j++) {
                if (PREFETCH_ROWS > 0 && j + PREFETCH_ROWS < rows) prefetch_row(a->weight_type, w, e * rows + j + PREFETCH_ROWS, len);
                dots(a->weight_type, w, e * rows + j, x, n, len, y + j, rows);
                if (scale) {
                    float s = scale[e * rows + j];
                    for (int64_t r = 0; r < n; r++) y[r * rows + j] *= s;
                }
            }
        }
        if (packed) amx_release();
    }
    free(packed); free(packed_at);
}

/* Returns 0, or -1 when scratch memory could not be had. */
int srv_moe_run(const MoEArgs *a) {
    const int64_t routes = a->tokens * a->top_k, hidden = a->hidden, inter = a->inter, local = a->local;
    if (isa < 0) isa = srv_moe_best_isa();
    const int pairs = bf16_rows(a->weight_type), round_act = a->weight_type == WEIGHT_BF16;
    const size_t in_size = pairs ? 2 : 4;
    int64_t *offsets = calloc((size_t)local + 2, sizeof(int64_t));
    int64_t *route_token = malloc(sizeof(int64_t) * (size_t)(routes ? routes : 1));
    float *route_weight = malloc(sizeof(float) * (size_t)(routes ? routes : 1));
    if (!offsets || !route_token || !route_weight) {
        free(offsets); free(route_token); free(route_weight);
        return -1;
    }
    /* Counting sort of the routes this rank holds, by expert, stable in token order. */
    for (int64_t r = 0; r < routes; r++) {
        int64_t e = a->ids[r] - a->start;
        if (e >= 0 && e < local) offsets[e + 1]++;
    }
    for (int64_t e = 0; e < local; e++) offsets[e + 1] += offsets[e];
    int64_t held = offsets[local];
    int64_t *fill = calloc((size_t)local + 1, sizeof(int64_t));
    void *rows = malloc(in_size * (size_t)(held ? held : 1) * (size_t)hidden);
    float *gate_up = malloc(sizeof(float) * (size_t)(held ? held : 1) * (size_t)(2 * inter));
    void *act = malloc(in_size * (size_t)(held ? held : 1) * (size_t)inter);
    float *down = malloc(sizeof(float) * (size_t)(held ? held : 1) * (size_t)hidden);
    int status = 0;
    if (!fill || !rows || !gate_up || !act || !down) {
        status = -1;
        goto done;
    }
    for (int64_t r = 0; r < routes; r++) {
        int64_t e = a->ids[r] - a->start;
        if (e >= 0 && e < local) {
            int64_t slot = offsets[e] + fill[e]++;
            route_token[slot] = r / a->top_k;
            route_weight[slot] = a->weights[r];
        }
    }
#pragma omp parallel for
    for (int64_t s = 0; s < held; s++) {
        const float *from = a->x + route_token[s] * hidden;
        if (pairs) {
            for (int64_t i = 0; i < hidden; i++) ((uint16_t *)rows)[s * hidden + i] = float_to_bf16(from[i]);
        } else {
            memcpy((float *)rows + s * hidden, from, sizeof(float) * (size_t)hidden);
        }
    }
    expert_products(a, a->w13, a->w13_scale, 2 * inter, hidden, offsets, rows, gate_up);
#pragma omp parallel for
    for (int64_t s = 0; s < held; s++) {
        const float *g = gate_up + s * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i++) {
            float v = g[i], o;
            if (a->activation == 0) o = v / (1.0f + expf(-v)) * u[i];
            else o = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))) * u[i];
            if (pairs) ((uint16_t *)act)[s * inter + i] = float_to_bf16(o);
            else ((float *)act)[s * inter + i] = round_act ? bf16_to_float(float_to_bf16(o)) : o;
        }
    }
    expert_products(a, a->w2, a->w2_scale, hidden, inter, offsets, act, down);
    /* In expert order, as the reference adds them: each token's sum has the same order. */
    for (int64_t s = 0; s < held; s++) {
        float *o = a->out + route_token[s] * hidden;
        const float *d = down + s * hidden;
        float w = route_weight[s];
        for (int64_t i = 0; i < hidden; i++) o[i] += d[i] * w;
    }
done:
    free(offsets); free(route_token); free(route_weight); free(fill);
    free(rows); free(gate_up); free(act); free(down);
    return status;
}

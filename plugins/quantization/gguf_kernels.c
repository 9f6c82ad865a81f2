/* Products of float32 activations with GGUF-derived block weights, for a few rows at a time.
 *
 * Each weight row is read once and widened to float32 once for all M activation rows, so
 * decode is bound by the quantized bytes (6 or 9 bits a weight) rather than by float32 or bf16
 * copies of the weights. Accumulation is float32 fused multiply-add; no activation is quantized.
 *
 * Layouts (N output rows, K inputs, B = K / 32 blocks a row):
 *   Q4_1: nibbles [N][(B + 1) / 2][32], pairs of blocks (see q4_1_pair), the last one
 *         half empty when B is odd;
 *         scale [N][B], min [N][B]: w = scale * q + min.
 *   Q8_0: values [N][B][32] int8 (see q8_0_block); scale [N][B]: w = scale * q.
 *   Q8_16: values [N][K] int8 in order; scale [N][K / 16], min [N][K / 16]: w = scale * q + min,
 *          in blocks of 16 (what the 5-, 6-, 3- and 2-bit GGUF types unpack to, exactly).
 * Activations x [M][K] and outputs y [M][N] are row-major float32.
 *
 * Threads: OpenMP, in the runtime the host process already loaded (torch's), so the kernels
 * share its thread pool and thread count.
 */

#include "srv_amx.h"
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
/* Up to FEW_ROWS activation rows, each weight block is scaled in registers for every row
 * (q4_1_row, q8_0_row), and up to FEW_ROWS_512 in the AVX-512 bodies (32 registers hold eight
 * rows' accumulators); more rows take matmul_many_rows. Measured on AVX2 (SmolLM2's shapes,
 * the whole model's products): the two tie at 3 and 4 rows (11-12 ms), and at 8 rows
 * many_rows is faster (splitting 8 rows into two chunks of 4 is slower still). On AVX-512, a
 * speculative verify pass (a request's last token and up to seven drafts) runs in the few-row
 * bodies, faster there than matmul_many_rows, and each row's sums are those of a one-row
 * decode step, to the bit, so verifying cannot change a greedy token. */
#define FEW_ROWS 4
#define FEW_ROWS_512 8
/* Up to PAIRED_ROWS activation rows, the AVX-512 Q4_1 body computes two output rows at once
 * (q4_1_two_rows_512): its accumulators fit the 32 registers. */
#define PAIRED_ROWS 4

/* A few-row product reads each weight row once, a few hundred bytes in two or three arrays: too
 * short a stream for the hardware prefetchers to run ahead of, so each thread asks for the row
 * PREFETCH_AHEAD rows past the one it computes (-DPREFETCH_AHEAD=N compiles another distance; 0
 * turns it off). */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4
#endif

static inline void prefetch_bytes(const void *start, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch((const char *)start + offset, _MM_HINT_T0);
}

/* Row i + PREFETCH_AHEAD of a layout whose rows are `data_bytes` of values or nibbles and
 * `blocks` floats of scale (and of min, where `min` is given). */
static inline void prefetch_row(int64_t i, int64_t n, const void *data, int64_t data_bytes, const float *scale,
                                const float *min, int64_t blocks) {
    if (PREFETCH_AHEAD <= 0 || i + PREFETCH_AHEAD >= n) return;
    const int64_t next = i + PREFETCH_AHEAD;
    prefetch_bytes((const char *)data + next * data_bytes, data_bytes);
    prefetch_bytes(scale + next * blocks, blocks * (int64_t)sizeof(float));
    if (min) prefetch_bytes(min + next * blocks, blocks * (int64_t)sizeof(float));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Q4_1 weights come in pairs of blocks, 32 bytes: nibble s (bits 4s..4s+3) of 32-bit lane l is
 * the pair's weight 8s + l. Shifts and masks widen them, no byte shuffles: four vectors of eight
 * for each block (s = 0..3 the first, 4..7 the second). */
static inline void q4_1_pair(const uint8_t *pair, __m256 first[4], __m256 second[4]) {
    const __m256i packed = _mm256_loadu_si256((const __m256i *)pair);
    const __m256i mask = _mm256_set1_epi32(0x0F);
    for (int s = 0; s < 4; s++) {
        first[s] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(packed, 4 * s), mask));
        second[s] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(packed, 4 * s + 16), mask));
    }
}

/* Q8_0 weights, 32 bytes a block: byte s of 32-bit lane l is the block's weight 8s + l. */
static inline void q8_0_block(const int8_t *values, __m256 w[4]) {
    const __m256i packed = _mm256_loadu_si256((const __m256i *)values);
    w[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(packed, 24), 24));
    w[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(packed, 16), 24));
    w[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(packed, 8), 24));
    w[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(packed, 24));
}

/* Q8_16 weights, 16 bytes a block in order. */
static inline void q8_16_block(const int8_t *values, __m256 w[2]) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)values);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(packed));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(packed, 8)));
}

static inline __m256 dot_block(const __m256 w[4], const float *x) {
    __m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), s);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), s);
}

/* Per-block sums of x [M][K] (blocks of `size`, 16 or 32): the min term is min * sum(x over the
 * block). */
static void block_sums(const float *x, int64_t m, int64_t k, int64_t size, float *sums) {
    const int64_t blocks = k / size;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + r * k + b * size;
            __m256 s = _mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8));
            if (size == 32) s = _mm256_add_ps(s, _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
            sums[r * blocks + b] = hsum(s);
        }
}

/* One output row against `rows` (at most FEW_ROWS) activation rows. Always inlined with a
 * constant `rows` (see FOR_ROWS), so the accumulators live in registers, not on the stack. */
#define INLINE static inline __attribute__((always_inline))

INLINE void q4_1_row(const float *x, int64_t k, const uint8_t *nibbles, const float *scale, const float *min,
                     const float *sums, float *y, int64_t n, const int rows) {
    const int64_t blocks = k / GROUP;
    /* Even and odd blocks accumulate apart: two dependency chains a row instead of one. */
    __m256 even[FEW_ROWS], odd[FEW_ROWS];
    float offset[FEW_ROWS];
    for (int r = 0; r < rows; r++) {
        even[r] = odd[r] = _mm256_setzero_ps();
        offset[r] = 0.0f;
    }
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        __m256 first[4], second[4];
        q4_1_pair(nibbles + b * (GROUP / 2), first, second);
        const __m256 d0 = _mm256_set1_ps(scale[b]), d1 = _mm256_set1_ps(scale[b + 1]);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * k + b * GROUP;
            even[r] = _mm256_fmadd_ps(d0, dot_block(first, xr), even[r]);
            odd[r] = _mm256_fmadd_ps(d1, dot_block(second, xr + GROUP), odd[r]);
            offset[r] += min[b] * sums[r * blocks + b] + min[b + 1] * sums[r * blocks + b + 1];
        }
    }
    if (b < blocks) { /* an odd count: the last pair holds one block */
        __m256 first[4], second[4];
        q4_1_pair(nibbles + b * (GROUP / 2), first, second);
        const __m256 d0 = _mm256_set1_ps(scale[b]);
        for (int r = 0; r < rows; r++) {
            even[r] = _mm256_fmadd_ps(d0, dot_block(first, x + r * k + b * GROUP), even[r]);
            offset[r] += min[b] * sums[r * blocks + b];
        }
    }
    for (int r = 0; r < rows; r++) y[r * n] = hsum(_mm256_add_ps(even[r], odd[r])) + offset[r];
}

INLINE void q8_0_row(const float *x, int64_t k, const int8_t *values, const float *scale, float *y, int64_t n,
                     const int rows) {
    const int64_t blocks = k / GROUP;
    __m256 even[FEW_ROWS], odd[FEW_ROWS];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256 w[4];
        q8_0_block(values + b * GROUP, w);
        const __m256 d = _mm256_set1_ps(scale[b]);
        for (int r = 0; r < rows; r++) {
            const __m256 product = _mm256_mul_ps(d, dot_block(w, x + r * k + b * GROUP));
            if (b & 1) odd[r] = _mm256_add_ps(odd[r], product);
            else even[r] = _mm256_add_ps(even[r], product);
        }
    }
    for (int r = 0; r < rows; r++) y[r * n] = hsum(_mm256_add_ps(even[r], odd[r]));
}

INLINE void q8_16_row(const float *x, int64_t k, const int8_t *values, const float *scale, const float *min,
                      const float *sums, float *y, int64_t n, const int rows) {
    const int64_t blocks = k / 16;
    __m256 even[FEW_ROWS], odd[FEW_ROWS];
    float offset[FEW_ROWS];
    for (int r = 0; r < rows; r++) {
        even[r] = odd[r] = _mm256_setzero_ps();
        offset[r] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; b++) {
        __m256 w[2];
        q8_16_block(values + b * 16, w);
        const __m256 d = _mm256_set1_ps(scale[b]);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * k + b * 16;
            const __m256 dot = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), _mm256_mul_ps(w[0], _mm256_loadu_ps(xr)));
            if (b & 1) odd[r] = _mm256_fmadd_ps(d, dot, odd[r]);
            else even[r] = _mm256_fmadd_ps(d, dot, even[r]);
            offset[r] += min[b] * sums[r * blocks + b];
        }
    }
    for (int r = 0; r < rows; r++) y[r * n] = hsum(_mm256_add_ps(even[r], odd[r])) + offset[r];
}

/* `statement` with ROWS_NOW a constant equal to `rows` (1..4). */
#define FOR_ROWS(rows, statement)                                                                         \
    switch (rows) {                                                                                       \
    case 1: { const int ROWS_NOW = 1; statement; } break;                                                \
    case 2: { const int ROWS_NOW = 2; statement; } break;                                                \
    case 3: { const int ROWS_NOW = 3; statement; } break;                                                \
    default: { const int ROWS_NOW = 4; statement; } break;                                               \
    }

/* FOR_ROWS for 1..8 rows (the AVX-512 bodies). */
#define FOR_ROWS_8(rows, statement)                                                                       \
    switch (rows) {                                                                                       \
    case 1: { const int ROWS_NOW = 1; statement; } break;                                                \
    case 2: { const int ROWS_NOW = 2; statement; } break;                                                \
    case 3: { const int ROWS_NOW = 3; statement; } break;                                                \
    case 4: { const int ROWS_NOW = 4; statement; } break;                                                \
    case 5: { const int ROWS_NOW = 5; statement; } break;                                                \
    case 6: { const int ROWS_NOW = 6; statement; } break;                                                \
    case 7: { const int ROWS_NOW = 7; statement; } break;                                                \
    default: { const int ROWS_NOW = 8; statement; } break;                                               \
    }

/* The same two products in AVX-512, sixteen weights a vector, on the layouts above unchanged.
 * Fewer instructions a weight than the AVX2 rows, where those rows are bound by arithmetic, not
 * by the weights' bytes. Picked at run time where the CPU has AVX-512 (srv_gguf_set_isa forces
 * either). */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma")))

/* The shift counts that bring weights 16h..16h+15 of a pair into the low nibble of each lane
 * (h = 0, 1 the first block's halves, 2, 3 the second's). */
AVX512 static inline __m512i nibble_counts(int h) {
    return _mm512_inserti64x4(_mm512_set1_epi32(8 * h), _mm256_set1_epi32(8 * h + 4), 1);
}

/* Q4_1 in AVX-512 widens no nibble: a block's sixteen possible weights, scale * q + min for
 * q = 0..15 rounded once (as the file's dequantized weights are), are one vector, and vpermps
 * picks each weight from it by its nibble (it reads an index's low four bits only, so no mask
 * either). Two instructions a sixteen weights instead of three, and the min needs no term of its
 * own. Shared by the few-row products and the bf16 rows. */
AVX512 static inline void q4_1_pair_512(const uint8_t *nibbles, const float *scale, const float *min, int64_t b,
                                        int64_t blocks, __m512 w[4]) {
    /* w: blocks b (even) and b + 1's 64 weights in order, the second block's zero past the last. */
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i packed = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(nibbles + b * (GROUP / 2))));
    const __m512 first = _mm512_fmadd_ps(_mm512_set1_ps(scale[b]), levels, _mm512_set1_ps(min[b]));
    w[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(packed, nibble_counts(0)), first);
    w[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(packed, nibble_counts(1)), first);
    w[2] = w[3] = _mm512_setzero_ps();
    if (b + 1 < blocks) {   /* an odd count: the last pair holds one block */
        const __m512 second = _mm512_fmadd_ps(_mm512_set1_ps(scale[b + 1]), levels, _mm512_set1_ps(min[b + 1]));
        w[2] = _mm512_permutexvar_ps(_mm512_srlv_epi32(packed, nibble_counts(2)), second);
        w[3] = _mm512_permutexvar_ps(_mm512_srlv_epi32(packed, nibble_counts(3)), second);
    }
}

/* Q8_0 in AVX-512: vpmovsxbd widens sixteen bytes of a block as they lie, which is not the
 * weights' order (byte 4l + s is weight 8s + l, see q8_0_block), so the activations are put in
 * the bytes' order once a call instead (q8_0_byte_order). Each weight is scaled once for all
 * rows, d * q rounded once as the file's dequantized weight is. w: the block's 32 weights in its
 * bytes' order. */
AVX512 static inline void q8_0_block_512(const int8_t *block, float scale, __m512 w[2]) {
    const __m512 d = _mm512_set1_ps(scale);
    w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)block))));
    w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 16)))));
}

/* One output row against `rows` activation rows (constant, see FOR_ROWS); two accumulators a
 * row, so that its FMAs form two dependency chains instead of one. */
AVX512 INLINE void q4_1_row_512(const float *x, int64_t k, const uint8_t *nibbles, const float *scale,
                                const float *min, float *y, int64_t n, const int rows) {
    const int64_t blocks = k / GROUP;
    __m512 even[FEW_ROWS_512], odd[FEW_ROWS_512];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
        __m512 w[4];
        q4_1_pair_512(nibbles, scale, min, b, blocks, w);
        /* past an odd count's last block, x is not read: its weights are zero, its loads masked */
        const __mmask16 second = b + 1 < blocks ? 0xFFFF : 0;
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * k + b * GROUP;
            even[r] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xr), even[r]);
            odd[r] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr + 16), odd[r]);
            even[r] = _mm512_fmadd_ps(w[2], _mm512_maskz_loadu_ps(second, xr + 32), even[r]);
            odd[r] = _mm512_fmadd_ps(w[3], _mm512_maskz_loadu_ps(second, xr + 48), odd[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[r * n] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

/* q4_1_row_512 for two adjacent output rows at once: each activation vector is loaded once for
 * both, and each row of x has four independent accumulator chains instead of two, which keeps
 * more FMAs in flight for products of two to four rows. Each output sums in q4_1_row_512's
 * order, so its bits are the same. (One body taking the count of outputs as a constant, for
 * both, compiled slower from one to four rows; Q8_0's rows, read from memory, gained nothing.) */
AVX512 INLINE void q4_1_two_rows_512(const float *x, int64_t k, const uint8_t *nibbles, int64_t row_bytes,
                                     const float *scale, const float *min, float *y, int64_t n, const int rows) {
    const int64_t blocks = k / GROUP;
    __m512 even[2][PAIRED_ROWS], odd[2][PAIRED_ROWS];
    for (int o = 0; o < 2; o++)
        for (int r = 0; r < rows; r++) even[o][r] = odd[o][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
        __m512 w[2][4];
        q4_1_pair_512(nibbles, scale, min, b, blocks, w[0]);
        q4_1_pair_512(nibbles + row_bytes, scale + blocks, min + blocks, b, blocks, w[1]);
        const __mmask16 second = b + 1 < blocks ? 0xFFFF : 0;
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * k + b * GROUP;
            const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
            const __m512 x2 = _mm512_maskz_loadu_ps(second, xr + 32), x3 = _mm512_maskz_loadu_ps(second, xr + 48);
            for (int o = 0; o < 2; o++) {
                even[o][r] = _mm512_fmadd_ps(w[o][0], x0, even[o][r]);
                odd[o][r] = _mm512_fmadd_ps(w[o][1], x1, odd[o][r]);
                even[o][r] = _mm512_fmadd_ps(w[o][2], x2, even[o][r]);
                odd[o][r] = _mm512_fmadd_ps(w[o][3], x3, odd[o][r]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < 2; o++) y[r * n + o] = _mm512_reduce_add_ps(_mm512_add_ps(even[o][r], odd[o][r]));
}

AVX512 INLINE void q8_0_row_512(const float *x, int64_t k, const int8_t *values, const float *scale, float *y,
                                int64_t n, const int rows) {
    const int64_t blocks = k / GROUP;
    __m512 even[FEW_ROWS_512], odd[FEW_ROWS_512];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512 w[2];
        q8_0_block_512(values + b * GROUP, scale[b], w);
        for (int r = 0; r < rows; r++) {
            even[r] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(x + r * k + b * GROUP), even[r]);
            odd[r] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x + r * k + b * GROUP + 16), odd[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[r * n] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

/* x [m][k] with each block's 32 values in its bytes' order: position i of a block holds weight
 * 8 (i % 4) + i / 4 for i < 16, and 8 (i % 4) + 4 + (i - 16) / 4 past it. */
static void q8_0_byte_order(const float *x, int64_t m, int64_t k, float *out) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < k; b += GROUP)
            for (int i = 0; i < GROUP; i++) {
                const int j = i % 16;
                out[r * k + b + i] = x[r * k + b + 8 * (j % 4) + (i >= 16 ? 4 : 0) + j / 4];
            }
}

static int use_avx512 = -1;
static int use_amx = -1;
int srv_gguf_has_amx(void);

/* 2: the AVX-512 rows and AMX's bf16 products, 1: the AVX-512 rows and bf16 products in
 * AVX-512, 0: the AVX2 rows, -1: the CPU's best. */
void srv_gguf_set_isa(int isa) {
    __builtin_cpu_init();
    const int has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    use_avx512 = isa < 0 ? has : isa >= 1 && has;
    use_amx = (isa < 0 || isa == 2) && srv_gguf_has_amx();
}

AVX512 static void q4_1_rows_512(const float *x, int64_t m, int64_t k, const uint8_t *nibbles, const float *scale,
                                 const float *min, int64_t n, float *y) {
    const int64_t blocks = k / GROUP;
    const int64_t row_bytes = (blocks + 1) / 2 * GROUP;
    if (m <= PAIRED_ROWS) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n - 1; i += 2) {
            prefetch_row(i, n, nibbles, row_bytes, scale, min, blocks);
            prefetch_row(i + 1, n, nibbles, row_bytes, scale, min, blocks);
            FOR_ROWS(m, q4_1_two_rows_512(x, k, nibbles + i * row_bytes, row_bytes, scale + i * blocks,
                                          min + i * blocks, y + i, n, ROWS_NOW))
        }
        if (n % 2)
            FOR_ROWS(m, q4_1_row_512(x, k, nibbles + (n - 1) * row_bytes, scale + (n - 1) * blocks,
                                     min + (n - 1) * blocks, y + n - 1, n, ROWS_NOW))
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        prefetch_row(i, n, nibbles, row_bytes, scale, min, blocks);
        FOR_ROWS_8(m, q4_1_row_512(x, k, nibbles + i * row_bytes, scale + i * blocks, min + i * blocks, y + i, n,
                                   ROWS_NOW))
    }
}

AVX512 static void q8_0_rows_512(const float *x, int64_t m, int64_t k, const int8_t *values, const float *scale,
                                 int64_t n, float *y) {
    const int64_t blocks = k / GROUP;
    float *ordered = malloc((size_t)(m * k) * sizeof(float));
    q8_0_byte_order(x, m, k, ordered);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        prefetch_row(i, n, values, k, scale, NULL, blocks);
        FOR_ROWS_8(m, q8_0_row_512(ordered, k, values + i * k, scale + i * blocks, y + i, n, ROWS_NOW))
    }
    free(ordered);
}

/* Many activation rows: each thread widens WEIGHT_ROWS weight rows at a time to float32 (scale
 * and min applied) in a buffer of its own, then runs a register tile over them and four rows
 * of x at a time: independent accumulators keep both FMA pipes busy, and each weight value is
 * widened once for all rows. */
enum { Q4_1 = 0, Q8_0 = 1, Q8_16 = 2 };

typedef struct {
    int format;
    const void *data; /* nibbles or values */
    const float *scale, *min;
} QuantizedRows;

static void dequantize_row(const QuantizedRows *w, int64_t i, int64_t k, float *out) {
    const int64_t blocks = k / GROUP;
    const float *scale = w->scale + i * blocks;
    if (w->format == Q4_1) {
        const uint8_t *nibbles = (const uint8_t *)w->data + i * ((blocks + 1) / 2) * GROUP;
        const float *min = w->min + i * blocks;
        for (int64_t b = 0; b < blocks; b += 2) {
            __m256 first[4], second[4];
            q4_1_pair(nibbles + b * (GROUP / 2), first, second);
            const __m256 d0 = _mm256_set1_ps(scale[b]), m0 = _mm256_set1_ps(min[b]);
            for (int s = 0; s < 4; s++) _mm256_storeu_ps(out + b * GROUP + 8 * s, _mm256_fmadd_ps(first[s], d0, m0));
            if (b + 1 < blocks) {
                const __m256 d1 = _mm256_set1_ps(scale[b + 1]), m1 = _mm256_set1_ps(min[b + 1]);
                for (int s = 0; s < 4; s++)
                    _mm256_storeu_ps(out + (b + 1) * GROUP + 8 * s, _mm256_fmadd_ps(second[s], d1, m1));
            }
        }
    } else if (w->format == Q8_0) {
        const int8_t *values = (const int8_t *)w->data + i * k;
        for (int64_t b = 0; b < blocks; b++) {
            __m256 block[4];
            q8_0_block(values + b * GROUP, block);
            const __m256 d = _mm256_set1_ps(scale[b]);
            for (int s = 0; s < 4; s++) _mm256_storeu_ps(out + b * GROUP + 8 * s, _mm256_mul_ps(block[s], d));
        }
    } else {
        const int8_t *values = (const int8_t *)w->data + i * k;
        const float *scale16 = w->scale + i * (k / 16), *min16 = w->min + i * (k / 16);
        for (int64_t b = 0; b < k / 16; b++) {
            __m256 block[2];
            q8_16_block(values + b * 16, block);
            const __m256 d = _mm256_set1_ps(scale16[b]), m0 = _mm256_set1_ps(min16[b]);
            for (int s = 0; s < 2; s++) _mm256_storeu_ps(out + b * 16 + 8 * s, _mm256_fmadd_ps(block[s], d, m0));
        }
    }
}

/* Weight rows a tile: 3 x 4 uses 12 accumulators, 3 weight vectors and one x vector, all 16
 * AVX registers. Measured on SmolLM2's shapes at 16 rows: 32-42 ms against 42-77 for 2 x 4;
 * 4 x 4 spills and is slower than both. */
#define WEIGHT_ROWS 3

/* y[r][j] = w[j] . x[r] for j < `present` weight rows (in w, k apart) and `rows` rows of x
 * (both constant): WEIGHT_ROWS x 4 accumulators, each x vector loaded once for every weight row. */
INLINE void tile(const float *w, const float *x, int64_t k, float *y, int64_t n, const int present, const int rows) {
    __m256 acc[WEIGHT_ROWS][4];
    for (int j = 0; j < present; j++)
        for (int r = 0; r < rows; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k; c += 8) {
        __m256 wv[WEIGHT_ROWS];
        for (int j = 0; j < present; j++) wv[j] = _mm256_loadu_ps(w + j * k + c);
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * k + c);
            for (int j = 0; j < present; j++) acc[j][r] = _mm256_fmadd_ps(wv[j], xv, acc[j][r]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < present; j++) y[r * n + j] = hsum(acc[j][r]);
}

/* tile() with constant `present` (1..WEIGHT_ROWS) and `rows` (1..4). */
static void any_tile(const float *w, const float *x, int64_t k, float *y, int64_t n, int present, int rows) {
    if (present == WEIGHT_ROWS) {
        FOR_ROWS(rows, tile(w, x, k, y, n, WEIGHT_ROWS, ROWS_NOW))
    } else {
        for (int j = 0; j < present; j++) FOR_ROWS(rows, tile(w + j * k, x, k, y + j, n, 1, ROWS_NOW))
    }
}

static void matmul_many_rows(const QuantizedRows *w, const float *x, int64_t m, int64_t k, int64_t n, float *y) {
#pragma omp parallel
    {
        float *rows = malloc(WEIGHT_ROWS * k * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += WEIGHT_ROWS) {
            const int present = n - i < WEIGHT_ROWS ? (int)(n - i) : WEIGHT_ROWS;
            for (int j = 0; j < present; j++) dequantize_row(w, i + j, k, rows + j * k);
            for (int64_t r0 = 0; r0 < m; r0 += 4)
                any_tile(rows, x + r0 * k, k, y + r0 * n + i, n, present, m - r0 < 4 ? (int)(m - r0) : 4);
        }
        free(rows);
    }
}

/* Products in bf16 arithmetic, for the decode steps of a model served in bf16 that are large
 * enough for the Python layers to compute them from the dense bf16 copy: x and the weights
 * rounded to bf16 (nearest even, as torch rounds), products summed in float32 by vdpbf16ps, two
 * to a float32 lane: twice the multiply-adds of an FMA an instruction. Each thread widens
 * WEIGHT_ROWS weight rows (dequantize_row) and rounds them once for all activation rows. Needs
 * AVX512_BF16 (srv_gguf_has_bf16) and K a multiple of 32. */
#define BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma")))

int srv_gguf_has_bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}

/* count (a multiple of 16) floats rounded to bf16. */
BF16 static void round_to_bf16(const float *x, int64_t count, uint16_t *out) {
    for (int64_t i = 0; i < count; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
}

/* y[r][j] = w[j] . x[r] for j < `present` bf16 weight rows and `rows` bf16 rows of x (both
 * constant), K apart. */
BF16 INLINE void tile_bf16(const uint16_t *w, const uint16_t *x, int64_t k, float *y, int64_t n, const int present,
                           const int rows) {
    __m512 acc[WEIGHT_ROWS][4];
    for (int j = 0; j < present; j++)
        for (int r = 0; r < rows; r++) acc[j][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 32) {
        __m512bh wv[WEIGHT_ROWS];
        for (int j = 0; j < present; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * k + c);
        for (int r = 0; r < rows; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + c);
            for (int j = 0; j < present; j++) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], wv[j], xv);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < present; j++) y[r * n + j] = _mm512_reduce_add_ps(acc[j][r]);
}

BF16 static void any_tile_bf16(const uint16_t *w, const uint16_t *x, int64_t k, float *y, int64_t n, int present,
                               int rows) {
    if (present == WEIGHT_ROWS) {
        FOR_ROWS(rows, tile_bf16(w, x, k, y, n, WEIGHT_ROWS, ROWS_NOW))
    } else {
        for (int j = 0; j < present; j++) FOR_ROWS(rows, tile_bf16(w + j * k, x, k, y + j, n, 1, ROWS_NOW))
    }
}

/* Weight row i of `w` in bf16: Q4_1 from its blocks' levels (q4_1_row_512), Q8_0 in its bytes'
 * order (q8_0_row_512), others widened by dequantize_row into `widened` first. */
BF16 static void bf16_row(const QuantizedRows *w, int64_t i, int64_t k, float *widened, uint16_t *out) {
    const int64_t blocks = k / GROUP;
    const float *scale = w->scale + i * blocks;
    if (w->format == Q4_1) {
        const uint8_t *nibbles = (const uint8_t *)w->data + i * ((blocks + 1) / 2) * GROUP;
        for (int64_t b = 0; b < blocks; b += 2) {
            __m512 pair[4];
            q4_1_pair_512(nibbles, scale, w->min + i * blocks, b, blocks, pair);
            _mm512_storeu_si512(out + b * GROUP, (__m512i)_mm512_cvtne2ps_pbh(pair[1], pair[0]));
            if (b + 1 < blocks)
                _mm512_storeu_si512(out + (b + 1) * GROUP, (__m512i)_mm512_cvtne2ps_pbh(pair[3], pair[2]));
        }
    } else if (w->format == Q8_0) {
        for (int64_t b = 0; b < blocks; b++) {
            __m512 block[2];
            q8_0_block_512((const int8_t *)w->data + i * k + b * GROUP, scale[b], block);
            _mm512_storeu_si512(out + b * GROUP, (__m512i)_mm512_cvtne2ps_pbh(block[1], block[0]));
        }
    } else {
        dequantize_row(w, i, k, widened);
        round_to_bf16(widened, k, out);
    }
}
/* Products in bf16 on AMX's tiles: the same arithmetic (rows and weights rounded to bf16,
 * products summed in float32), one TDPBF16PS a 16 x 16 x 32 block where vdpbf16ps does 16 x 2.
 * The tiles compute y^T = W x^T: A, 16 weight rows widened to bf16 (bf16_row) as they lie, 32
 * inputs a tile; B, 16 rows of x with each pair of neighbouring inputs side by side (the layout
 * TDPBF16PS reads its second operand in), built once a call; C, 16 outputs of 16 rows, written
 * back transposed. Tiles: 0 holds A, 1 and 2 B for two groups of x rows, 3 and 4 their C. Each
 * thread widens 16 weight rows at a time once for every 16-row group of x, two groups a pass.
 * srv_amx.h asks the OS for the tiles and lays them out. */
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16,avx2,fma")))
#define TILE SRV_AMX_TILE

static int amx_usable = -1;

/* Whether this CPU has AMX-BF16 and the OS lets this process use the tiles. */
int srv_gguf_has_amx(void) {
    if (amx_usable < 0) amx_usable = srv_gguf_has_bf16() && srv_amx_usable(SRV_AMX_BF16);
    return amx_usable;
}

/* Rows [first, first + count) of `w` (its values or nibbles, scales and mins) asked into the cache. */
static void prefetch_rows(const QuantizedRows *w, int64_t first, int64_t count, int64_t k) {
    const int64_t scales = w->format == Q8_16 ? k / 16 : k / GROUP;
    const int64_t bytes = w->format == Q4_1 ? (k / GROUP + 1) / 2 * GROUP : k;
    prefetch_bytes((const char *)w->data + first * bytes, count * bytes);
    prefetch_bytes(w->scale + first * scales, count * scales * (int64_t)sizeof(float));
    if (w->min) prefetch_bytes(w->min + first * scales, count * scales * (int64_t)sizeof(float));
}

AMX static void matmul_amx(const QuantizedRows *w, const uint16_t *xb, int64_t m, int64_t k, int64_t n, float *y) {
    const int64_t pairs = k / 2, groups = (m + TILE - 1) / TILE;
    /* xv [groups][pairs][TILE rows][2]: row r's inputs 2p and 2p + 1 as one 32-bit unit, rows
     * past m zero. */
    uint32_t *xv = malloc((size_t)(groups * pairs * TILE) * sizeof(uint32_t));
    srv_amx_pack_rows(xb, m, k * (int64_t)sizeof(uint16_t), xv);
#pragma omp parallel
    {
        srv_amx_configure(5);
        float *widened = malloc((size_t)k * sizeof(float));
        uint16_t *rows = calloc((size_t)(TILE * k), sizeof(uint16_t));
        float out[2][TILE][TILE] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += TILE) {
            const int present = n - i < TILE ? (int)(n - i) : TILE;
            if (i + 2 * TILE <= n) prefetch_rows(w, i + TILE, TILE, k);   /* the next block, this thread's */
            for (int j = 0; j < present; j++) bf16_row(w, i + j, k, widened, rows + j * k);
            if (present < TILE) memset(rows + present * k, 0, (size_t)((TILE - present) * k) * sizeof(uint16_t));
            for (int64_t g = 0; g < groups; g += 2) {
                const int two = g + 1 < groups;
                _tile_zero(3);
                _tile_zero(4);
                for (int64_t c = 0; c < k; c += 32) {
                    _tile_loadd(0, rows + c, k * sizeof(uint16_t));
                    _tile_loadd(1, xv + (g * pairs + c / 2) * TILE, TILE * sizeof(uint32_t));
                    _tile_dpbf16ps(3, 0, 1);
                    if (two) {
                        _tile_loadd(2, xv + ((g + 1) * pairs + c / 2) * TILE, TILE * sizeof(uint32_t));
                        _tile_dpbf16ps(4, 0, 2);
                    }
                }
                _tile_stored(3, out[0], TILE * sizeof(float));
                _tile_stored(4, out[1], TILE * sizeof(float));
                const __mmask16 outputs = (__mmask16)((1u << present) - 1);
                for (int h = 0; h <= two; h++) {   /* out[h] holds [outputs][rows]: y wants [rows][outputs] */
                    __m512 v[TILE];
                    for (int o = 0; o < TILE; o++) v[o] = _mm512_load_ps(out[h][o]);
                    srv_transpose_16x16(v);
                    for (int64_t r = (g + h) * TILE; r < m && r < (g + h + 1) * TILE; r++)
                        _mm512_mask_storeu_ps(y + r * n + i, outputs, v[r % TILE]);
                }
            }
        }
        free(widened);
        free(rows);
        _tile_release();
    }
    free(xv);
}

BF16 static void matmul_bf16(const QuantizedRows *w, const float *x, int64_t m, int64_t k, int64_t n, float *y) {
    uint16_t *xb = malloc((size_t)(m * k) * sizeof(uint16_t));
    if (w->format == Q8_0) {   /* the weights come in their bytes' order */
        float *ordered = malloc((size_t)(m * k) * sizeof(float));
        q8_0_byte_order(x, m, k, ordered);
        round_to_bf16(ordered, m * k, xb);
        free(ordered);
    } else {
        round_to_bf16(x, m * k, xb);
    }
    if (use_amx < 0) srv_gguf_set_isa(-1);
    if (use_amx) {
        matmul_amx(w, xb, m, k, n, y);
        free(xb);
        return;
    }
#pragma omp parallel
    {
        float *widened = malloc((size_t)k * sizeof(float));
        uint16_t *rows = malloc((size_t)(WEIGHT_ROWS * k) * sizeof(uint16_t));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += WEIGHT_ROWS) {
            const int present = n - i < WEIGHT_ROWS ? (int)(n - i) : WEIGHT_ROWS;
            for (int j = 0; j < present; j++) bf16_row(w, i + j, k, widened, rows + j * k);
            for (int64_t r0 = 0; r0 < m; r0 += 4)
                any_tile_bf16(rows, xb + r0 * k, k, y + r0 * n + i, n, present, m - r0 < 4 ? (int)(m - r0) : 4);
        }
        free(widened);
        free(rows);
    }
    free(xb);
}

/* Whether the few-row bodies take m rows: up to FEW_ROWS_512 where an AVX-512 body runs them,
 * else FEW_ROWS. */
static int few_rows(int64_t m, int has_avx512_body) {
    if (use_avx512 < 0) srv_gguf_set_isa(-1);
    return m <= (use_avx512 && has_avx512_body ? FEW_ROWS_512 : FEW_ROWS);
}

/* Output rows split across threads, each weight row read once for all activation rows. */
static void q4_1_matmul(const float *x, int64_t m, int64_t k, const uint8_t *nibbles, const float *scale,
                        const float *min, int64_t n, float *y) {
    const int64_t blocks = k / GROUP;
    if (!few_rows(m, 1)) {
        const QuantizedRows w = {Q4_1, nibbles, scale, min};
        matmul_many_rows(&w, x, m, k, n, y);
        return;
    }
    if (use_avx512) {
        q4_1_rows_512(x, m, k, nibbles, scale, min, n, y);
        return;
    }
    float sums[FEW_ROWS * blocks];
    block_sums(x, m, k, GROUP, sums);
    const int64_t row_bytes = (blocks + 1) / 2 * GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        prefetch_row(i, n, nibbles, row_bytes, scale, min, blocks);
        FOR_ROWS(m, q4_1_row(x, k, nibbles + i * row_bytes, scale + i * blocks, min + i * blocks, sums, y + i, n,
                             ROWS_NOW))
    }
}

static void q8_0_matmul(const float *x, int64_t m, int64_t k, const int8_t *values, const float *scale, int64_t n,
                        float *y) {
    const int64_t blocks = k / GROUP;
    if (!few_rows(m, 1)) {
        const QuantizedRows w = {Q8_0, values, scale, NULL};
        matmul_many_rows(&w, x, m, k, n, y);
        return;
    }
    if (use_avx512) {
        q8_0_rows_512(x, m, k, values, scale, n, y);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        prefetch_row(i, n, values, k, scale, NULL, blocks);
        FOR_ROWS(m, q8_0_row(x, k, values + i * k, scale + i * blocks, y + i, n, ROWS_NOW))
    }
}

static void q8_16_matmul(const float *x, int64_t m, int64_t k, const int8_t *values, const float *scale,
                         const float *min, int64_t n, float *y) {
    if (!few_rows(m, 0)) {
        const QuantizedRows w = {Q8_16, values, scale, min};
        matmul_many_rows(&w, x, m, k, n, y);
        return;
    }
    const int64_t blocks = k / 16;
    float sums[FEW_ROWS * blocks];
    block_sums(x, m, k, 16, sums);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        prefetch_row(i, n, values, k, scale, min, blocks);
        FOR_ROWS(m, q8_16_row(x, k, values + i * k, scale + i * blocks, min + i * blocks, sums, y + i, n, ROWS_NOW))
    }
}

/* A layer's product, y [rows][out_features] = x [rows][in_features] W^T: what GGUFLinear calls,
 * and what it hands a model as its srv.sdk.native.NativeKernel. */
typedef struct {
    int64_t format; /* Q4_1, Q8_0 or Q8_16 */
    int64_t in_features, out_features;
    const void *data; /* nibbles or values */
    const float *scale, *min;
} LinearContext;

void srv_gguf_linear(const void *context, const float *x, int64_t rows, float *y) {
    const LinearContext *c = context;
    if (c->format == Q4_1)
        q4_1_matmul(x, rows, c->in_features, c->data, c->scale, c->min, c->out_features, y);
    else if (c->format == Q8_0)
        q8_0_matmul(x, rows, c->in_features, c->data, c->scale, c->out_features, y);
    else
        q8_16_matmul(x, rows, c->in_features, c->data, c->scale, c->min, c->out_features, y);
}

/* srv_gguf_linear in bf16 arithmetic (see matmul_bf16). */
void srv_gguf_linear_bf16(const void *context, const float *x, int64_t rows, float *y) {
    const LinearContext *c = context;
    const QuantizedRows w = {(int)c->format, c->data, c->scale, c->min};
    matmul_bf16(&w, x, rows, c->in_features, c->out_features, y);
}

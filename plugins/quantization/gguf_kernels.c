/* Products of float32 activations with GGUF Q4_1 and Q8_0 weights, for a few rows at a time.
 *
 * Each weight block (32 values of one output row) is widened to float32 once and multiplied
 * into every activation row, so a batch of M rows reads the quantized weights once: decode is
 * bound by those bytes (4.5 or 8.5 bits a weight) rather than by float32 or bf16 copies.
 * Accumulation is float32 fused multiply-add, block by block; no activation is quantized.
 *
 * Layouts (N output rows, K inputs, B = K / 32 blocks a row):
 *   Q4_1: nibbles [N][(B + 1) / 2][32], pairs of blocks (see q4_1_pair), the last one
 *         half empty when B is odd;
 *         scale [N][B], min [N][B]: w = scale * q + min.
 *   Q8_0: values [N][B][32] int8 (see q8_0_block); scale [N][B]: w = scale * q.
 * Activations x [M][K] and outputs y [M][N] are row-major float32.
 *
 * Threads: OpenMP, in the runtime the host process already loaded (torch's), so the kernels
 * share its thread pool and thread count.
 */

#include <immintrin.h>
#include <stdint.h>

#define GROUP 32
#define ROWS 8 /* activation rows kept in registers at once */

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

static inline __m256 dot_block(const __m256 w[4], const float *x) {
    __m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), s);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), s);
}

/* Per-block sums of x [M][K]: the Q4_1 min term is min * sum(x over the block). */
static void block_sums(const float *x, int64_t m, int64_t k, float *sums) {
    const int64_t blocks = k / GROUP;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + r * k + b * GROUP;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
            sums[r * blocks + b] = hsum(s);
        }
}

/* One output row against `rows` activation rows. Always inlined with a constant `rows` (see
 * FOR_ROWS), so the accumulators live in registers rather than in an array on the stack. */
#define INLINE static inline __attribute__((always_inline))

INLINE void q4_1_row(const float *x, int64_t k, const uint8_t *nibbles, const float *scale, const float *min,
                     const float *sums, float *y, int64_t n, const int rows) {
    const int64_t blocks = k / GROUP;
    /* Even and odd blocks accumulate apart: two dependency chains a row instead of one. */
    __m256 even[ROWS], odd[ROWS];
    float offset[ROWS];
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
    __m256 even[ROWS], odd[ROWS];
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

/* `statement` with ROWS_NOW a constant equal to `rows` (1..ROWS). */
#define FOR_ROWS(rows, statement)                                                                         \
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

/* Output rows split across threads; each reads its weight row once for all activation rows
 * (after the first group of ROWS, from cache). */
void srv_q4_1_matmul(const float *x, int64_t m, int64_t k, const uint8_t *nibbles, const float *scale,
                     const float *min, int64_t n, float *y, float *sums /* scratch, [m][k / 32] */) {
    const int64_t blocks = k / GROUP;
    block_sums(x, m, k, sums);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++)
        for (int64_t r0 = 0; r0 < m; r0 += ROWS)
            FOR_ROWS(m - r0, q4_1_row(x + r0 * k, k, nibbles + i * ((blocks + 1) / 2) * GROUP, scale + i * blocks,
                                      min + i * blocks, sums + r0 * blocks, y + r0 * n + i, n, ROWS_NOW))
}

void srv_q8_0_matmul(const float *x, int64_t m, int64_t k, const int8_t *values, const float *scale, int64_t n,
                     float *y) {
    const int64_t blocks = k / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++)
        for (int64_t r0 = 0; r0 < m; r0 += ROWS)
            FOR_ROWS(m - r0, q8_0_row(x + r0 * k, k, values + i * k, scale + i * blocks, y + r0 * n + i, n, ROWS_NOW))
}

/* Weight-only float8 (e4m3fn) products: float32 activations times float8 weights with float32
 * scales over blocks of the weight, accumulated in float32.
 *
 *   y[m][n] = sum over k-blocks b of scale[n / block_n][b] * sum_{k in b} x[m][k] * w8(w[n][k])
 *
 * where w8 is the e4m3fn value of the byte. A per-tensor scale is one block of N x K, a
 * per-channel one blocks of 1 x K, DeepSeek-style block scales blocks of 128 x 128.
 *
 * e4m3fn widens exactly through float16: the byte's sign, exponent and mantissa bits, moved to
 * float16's positions, are the value times 2^-8 (subnormals included). The kernels multiply
 * those images (`scale` is the checkpoint's scales times 256, exactly): the AVX2 path gets
 * eight with a sign extension, a shift, a mask and vcvtph2ps; the portable path reads them from
 * a table. (The NaN byte 0x7F reads as 480 / 256; checkpoints hold none.)
 *
 * Weights w [N][K] bytes row-major; x [M][K] and y [M][N] float32 row-major. Threads: OpenMP
 * over output channels, in torch's runtime and thread count.
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int64_t isa;                /* 0 portable, 1 AVX2 + F16C + FMA */
    int64_t in_features, out_features;
    int64_t block_n, block_k;   /* the scales' block shape */
    const uint8_t *weight;      /* [N][K] e4m3fn */
    const float *scale;         /* [ceil(N / block_n)][ceil(K / block_k)], times 256 */
    const float *bias;          /* [N] or NULL */
} Fp8Linear;

#define ROW_GROUP 4

/* Each byte's float16 image: its e4m3fn value / 256. */
static float e4m3_images[256];

__attribute__((constructor)) static void fill_e4m3_images(void) {
    for (int code = 0; code < 256; code++) {
        const int exponent = (code >> 3) & 0xF, mantissa = code & 7;
        float v = exponent == 0 ? ldexpf((float)mantissa, -17) : ldexpf((float)(8 + mantissa), exponent - 18);
        if ((code & 0x7F) == 0x7F) v = 480.0f / 256.0f;
        e4m3_images[code] = code & 0x80 ? -v : v;
    }
}

static void row_portable(const Fp8Linear *c, const float *x, int64_t rows, int64_t n, float *acc) {
    const int64_t k = c->in_features, blocks = (k + c->block_k - 1) / c->block_k;
    const uint8_t *w = c->weight + n * k;
    const float *scales = c->scale + (n / c->block_n) * blocks;
    for (int64_t m = 0; m < rows; m++) {
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t end = (b + 1) * c->block_k < k ? (b + 1) * c->block_k : k;
            float s = 0.0f;
            for (int64_t i = b * c->block_k; i < end; i++) s += x[m * k + i] * e4m3_images[w[i]];
            total += s * scales[b];
        }
        acc[m] = total;
    }
}

__attribute__((target("avx2,fma,f16c")))
static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Eight e4m3fn weights' float16 images as float32: the byte sign-extended to 16 bits and
 * shifted left by 7 has the sign at bit 15 and exponent and mantissa at bits 13..7; bit 14 (a
 * copy of the sign) and the low bits are masked off. */
__attribute__((target("avx2,fma,f16c")))
static inline __m256 widen8(const uint8_t *w) {
    const __m128i extended = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)w));
    const __m128i half = _mm_and_si128(_mm_slli_epi16(extended, 7), _mm_set1_epi16((short)0xBF80));
    return _mm256_cvtph_ps(half);
}

/* Up to ROW_GROUP rows against one weight row, each row's sums in two registers (16 weights a
 * step: two independent chains of fused multiply-adds), named rather than in an array so that
 * they stay in registers. */
__attribute__((target("avx2,fma,f16c")))
static void row_avx2(const Fp8Linear *c, const float *x, int64_t rows, int64_t n, float *acc) {
    const int64_t k = c->in_features, blocks = (k + c->block_k - 1) / c->block_k;
    const uint8_t *w = c->weight + n * k;
    const float *scales = c->scale + (n / c->block_n) * blocks;
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_GROUP) {
        const int64_t group = rows - m0 < ROW_GROUP ? rows - m0 : ROW_GROUP;
        const float *x0 = x + m0 * k, *x1 = x0 + k, *x2 = x1 + k, *x3 = x2 + k;
        float totals[ROW_GROUP] = {0};
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t start = b * c->block_k, end = start + c->block_k < k ? start + c->block_k : k;
            const int64_t body16 = start + (end - start) / 16 * 16, body8 = start + (end - start) / 8 * 8;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            int64_t i = start;
            for (; i < body16; i += 16) {
                const __m256 lo = widen8(w + i), hi = widen8(w + i + 8);
                a0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x0 + i), a0);
                b0 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x0 + i + 8), b0);
                if (group > 1) {
                    a1 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x1 + i), a1);
                    b1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x1 + i + 8), b1);
                }
                if (group > 2) {
                    a2 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x2 + i), a2);
                    b2 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x2 + i + 8), b2);
                }
                if (group > 3) {
                    a3 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x3 + i), a3);
                    b3 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x3 + i + 8), b3);
                }
            }
            for (; i < body8; i += 8) {
                const __m256 lo = widen8(w + i);
                a0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x0 + i), a0);
                if (group > 1) a1 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x1 + i), a1);
                if (group > 2) a2 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x2 + i), a2);
                if (group > 3) a3 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x3 + i), a3);
            }
            const __m256 sums[ROW_GROUP] = {_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1), _mm256_add_ps(a2, b2),
                                            _mm256_add_ps(a3, b3)};
            for (int g = 0; g < group; g++) {
                float s = hsum_avx2(sums[g]);
                for (int64_t t = body8; t < end; t++) s += x[(m0 + g) * k + t] * e4m3_images[w[t]];
                totals[g] += s * scales[b];
            }
        }
        for (int g = 0; g < group; g++) acc[m0 + g] = totals[g];
    }
}

/* y [rows][N] = x [rows][K] times the layer's weights (+ bias). */
void srv_fp8_linear(const Fp8Linear *c, const float *x, int64_t rows, float *y) {
    const int64_t n_out = c->out_features;
    #pragma omp parallel
    {
        float *acc = malloc(sizeof(float) * (size_t)rows);
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < n_out; n++) {
            if (c->isa == 1) row_avx2(c, x, rows, n, acc);
            else row_portable(c, x, rows, n, acc);
            for (int64_t m = 0; m < rows; m++) y[m * n_out + n] = c->bias ? acc[m] + c->bias[n] : acc[m];
        }
        free(acc);
    }
}

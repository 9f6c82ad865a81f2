/* w8a8_int8 products: float32 activations quantized per row to int8, multiplied into int8
 * weights quantized per output channel, accumulated exactly in int32.
 *
 *   sx[m]   = max(max_k |x[m][k]|, 1e-10) / 127
 *   q[m][k] = round_half_even(x[m][k] / sx[m]), clamped to -127..127
 *   y[m][n] = ((float)(sum_k q[m][k] * w[n][k]) * sx[m]) * scale[n]  (+ bias[n])
 *
 * The quantization and the epilogue are the same float32 operations, in the same order, as the
 * torch path of w8a8_int8.py, and int32 sums do not depend on their order, so every instruction
 * set below gives the same bits as that path (the tests compare them).
 *
 * Instruction sets, picked per context (`isa`) by the Python side from the CPU's flags:
 *   0 portable C;
 *   1 AVX2: vpmaddubsw takes unsigned times signed bytes, so |w| multiplies sign(q, w); each
 *     pair of products is at most 2 * 128 * 127, inside int16;
 *   2 AVX512-VNNI: vpdpbusd accumulates (q + 128) * w in int32; 128 * sum_k w[n][k] is taken
 *     off once per output (`weight_sums`);
 *   3 AMX-INT8 from AMX_ROWS rows (gemm_amx), VNNI's product below.
 * Weights w [N][K] int8 row-major; x [M][K] and y [M][N] float32 row-major.
 * Threads: OpenMP over output channels, in torch's runtime and thread count.
 */

#include "srv_amx.h"
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int64_t isa;
    int64_t in_features, out_features;
    const int8_t *weight;       /* [N][K] */
    const float *scale;         /* [N] */
    const float *bias;          /* [N] or NULL */
    const int32_t *weight_sums; /* [N]: sum_k w[n][k], for isa 2 */
    int64_t bf16_rows;          /* 1: x rounded to bf16 first, as a model served in bf16 hands its rows over */
} Int8Linear;

/* Rows of activations the AVX2 and VNNI loops keep in registers at once. */
#define ROW_GROUP 4

/* x[0, count) rounded to the nearest bf16 (ties to even) into out, as torch's cast rounds them;
 * a NaN stays a NaN. Integer operations on the bits, which the compiler vectorizes. */
static void round_to_bf16(const float *x, int64_t count, float *out) {
    const uint32_t *in = (const uint32_t *)x;
    uint32_t *bits = (uint32_t *)out;
    for (int64_t i = 0; i < count; i++) {
        const uint32_t b = in[i];
        const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
        const uint32_t nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
        bits[i] = nan ? (b | 0x00400000u) & 0xFFFF0000u : rounded;
    }
}

static float row_scale(float largest) { return (largest > 1e-10f ? largest : 1e-10f) / 127.0f; }

/* One value's int8: x / scale rounded half to even (nearbyintf, in the default rounding mode),
 * clamped to -127..127. */
static int8_t quantize_value(float x, float scale) {
    float v = nearbyintf(x / scale);
    return (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
}

static void quantize_row_portable(const float *row, int64_t k, int8_t *q, float *scale) {
    float largest = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        float a = fabsf(row[i]);
        largest = a > largest ? a : largest;
    }
    const float s = row_scale(largest);
    *scale = s;
    for (int64_t i = 0; i < k; i++) q[i] = quantize_value(row[i], s);
}

/* The same operations eight at a time: IEEE division, rounding half to even (the current
 * rounding mode, as nearbyintf), the same clamp; the tail as above. */
__attribute__((target("avx2,fma")))
static void quantize_row_avx2(const float *row, int64_t k, int8_t *q, float *scale) {
    const int64_t body = k - k % 8;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 largest8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < body; i += 8) largest8 = _mm256_max_ps(largest8, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, largest8);
    float largest = 0.0f;
    for (int j = 0; j < 8; j++) largest = lanes[j] > largest ? lanes[j] : largest;
    for (int64_t i = body; i < k; i++) {
        float a = fabsf(row[i]);
        largest = a > largest ? a : largest;
    }
    const float s = row_scale(largest);
    *scale = s;
    const __m256 s8 = _mm256_set1_ps(s), high = _mm256_set1_ps(127.0f), low = _mm256_set1_ps(-127.0f);
    for (int64_t i = 0; i < body; i += 8) {
        __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + i), s8), _MM_FROUND_CUR_DIRECTION);
        const __m256i n = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(v, high), low));
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(words, words));
    }
    for (int64_t i = body; i < k; i++) q[i] = quantize_value(row[i], s);
}

/* q [rows][k] and scales [rows] of x [rows][k], as above; isa as Int8Linear's. */
void srv_int8_quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *q, float *scales, int64_t isa) {
    #pragma omp parallel for schedule(static) if (rows * k >= 65536)
    for (int64_t m = 0; m < rows; m++) {
        if (isa >= 1) quantize_row_avx2(x + m * k, k, q + m * k, scales + m);
        else quantize_row_portable(x + m * k, k, q + m * k, scales + m);
    }
}

static void dot_portable(const Int8Linear *c, const int8_t *q, int64_t rows, int64_t n, int32_t *acc) {
    const int64_t k = c->in_features;
    const int8_t *w = c->weight + n * k;
    for (int64_t m = 0; m < rows; m++) {
        int32_t s = 0;
        for (int64_t i = 0; i < k; i++) s += (int32_t)q[m * k + i] * (int32_t)w[i];
        acc[m] = s;
    }
}

__attribute__((target("avx2,fma")))
static inline int32_t hsum_epi32_avx2(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

__attribute__((target("avx2,fma")))
static void dot_avx2(const Int8Linear *c, const int8_t *q, int64_t rows, int64_t n, int32_t *acc) {
    const int64_t k = c->in_features, body = k - k % 32;
    const int8_t *w = c->weight + n * k;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_GROUP) {
        const int64_t group = rows - m0 < ROW_GROUP ? rows - m0 : ROW_GROUP;
        __m256i sums[ROW_GROUP];
        for (int g = 0; g < ROW_GROUP; g++) sums[g] = _mm256_setzero_si256();
        for (int64_t i = 0; i < body; i += 32) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + i));
            const __m256i magnitude = _mm256_sign_epi8(wv, wv);
            for (int g = 0; g < group; g++) {
                const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + (m0 + g) * k + i));
                const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(qv, wv));
                sums[g] = _mm256_add_epi32(sums[g], _mm256_madd_epi16(pairs, ones));
            }
        }
        for (int g = 0; g < group; g++) {
            int32_t s = hsum_epi32_avx2(sums[g]);
            const int8_t *qr = q + (m0 + g) * k;
            for (int64_t i = body; i < k; i++) s += (int32_t)qr[i] * (int32_t)w[i];
            acc[m0 + g] = s;
        }
    }
}

/* Rows from which the AVX2 product runs in tiles (gemm_avx2); fewer take dot_avx2, which reads
 * each weight once for all rows (a decode step, bound by the weight bytes). */
#define TILED_ROWS 8
/* The tiles of gemm_avx2: output channels, rows computed at once, rows of a block. */
#define TILE_COLUMNS 16
#define TILE_ROWS 4
#define ROW_BLOCK 64

/* Four rows of q by two weight rows: the eight int32 sums of their products over the body of k
 * (a multiple of 32). Rows and columns past the edge point at the last real ones; their sums are
 * computed and not stored. */
__attribute__((target("avx2,fma")))
static inline void tile_4x2_avx2(const int8_t *const q[TILE_ROWS], const int8_t *w0, const int8_t *w1, int64_t body,
                                 int32_t out[TILE_ROWS][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s00 = _mm256_setzero_si256(), s01 = _mm256_setzero_si256(), s10 = _mm256_setzero_si256(),
            s11 = _mm256_setzero_si256(), s20 = _mm256_setzero_si256(), s21 = _mm256_setzero_si256(),
            s30 = _mm256_setzero_si256(), s31 = _mm256_setzero_si256();
    for (int64_t i = 0; i < body; i += 32) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(w0 + i));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(w1 + i));
        const __m256i ma = _mm256_sign_epi8(a, a), mb = _mm256_sign_epi8(b, b);
#define SRV_INT8_ROW(r, sa, sb) { \
            const __m256i x = _mm256_loadu_si256((const __m256i *)(q[r] + i)); \
            sa = _mm256_add_epi32(sa, _mm256_madd_epi16(_mm256_maddubs_epi16(ma, _mm256_sign_epi8(x, a)), ones)); \
            sb = _mm256_add_epi32(sb, _mm256_madd_epi16(_mm256_maddubs_epi16(mb, _mm256_sign_epi8(x, b)), ones)); }
        SRV_INT8_ROW(0, s00, s01)
        SRV_INT8_ROW(1, s10, s11)
        SRV_INT8_ROW(2, s20, s21)
        SRV_INT8_ROW(3, s30, s31)
#undef SRV_INT8_ROW
    }
    /* The eight sums into one vector, in the order of `out`: two rounds of pairwise sums within
     * each 128-bit half, then the halves added. */
    const __m256i rows01 = _mm256_hadd_epi32(_mm256_hadd_epi32(s00, s01), _mm256_hadd_epi32(s10, s11));
    const __m256i rows23 = _mm256_hadd_epi32(_mm256_hadd_epi32(s20, s21), _mm256_hadd_epi32(s30, s31));
    _mm256_storeu_si256((__m256i *)out, _mm256_add_epi32(_mm256_permute2x128_si256(rows01, rows23, 0x20),
                                                         _mm256_permute2x128_si256(rows01, rows23, 0x31)));
}

/* y [rows][N] of q [rows][k] with scales sx, and the same epilogue as srv_int8_linear's. Each
 * thread takes a run of tiles of TILE_COLUMNS output channels and walks the rows in blocks of
 * ROW_BLOCK (which stay in L2 while its tiles' weights pass), each block TILE_ROWS at a time
 * against one tile (whose weights stay in L1). */
__attribute__((target("avx2,fma")))
static void gemm_avx2(const Int8Linear *c, const int8_t *q, const float *sx, int64_t rows, float *y) {
    const int64_t k = c->in_features, n_out = c->out_features, body = k - k % 32;
    const int64_t tiles = (n_out + TILE_COLUMNS - 1) / TILE_COLUMNS;
    #pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = tiles * thread / threads, last = tiles * (thread + 1) / threads;
        for (int64_t b0 = 0; b0 < rows; b0 += ROW_BLOCK) {
            const int64_t b1 = b0 + ROW_BLOCK < rows ? b0 + ROW_BLOCK : rows;
            for (int64_t tile = first; tile < last; tile++) {
                const int64_t n_begin = tile * TILE_COLUMNS;
                const int64_t n_end = n_begin + TILE_COLUMNS < n_out ? n_begin + TILE_COLUMNS : n_out;
                for (int64_t m0 = b0; m0 < b1; m0 += TILE_ROWS) {
                    const int8_t *row[TILE_ROWS];
                    for (int r = 0; r < TILE_ROWS; r++) row[r] = q + (m0 + r < b1 ? m0 + r : b1 - 1) * k;
                    for (int64_t n = n_begin; n < n_end; n += 2) {
                        const int64_t n1 = n + 1 < n_end ? n + 1 : n;
                        const int8_t *w0 = c->weight + n * k, *w1 = c->weight + n1 * k;
                        int32_t sums[TILE_ROWS][2];
                        tile_4x2_avx2(row, w0, w1, body, sums);
                        for (int r = 0; r < TILE_ROWS && m0 + r < b1; r++) {
                            for (int j = 0; j < 2 && n + j < n_end; j++) {
                                const int8_t *w = j ? w1 : w0;
                                int32_t total = sums[r][j];
                                for (int64_t i = body; i < k; i++) total += (int32_t)row[r][i] * (int32_t)w[i];
                                float v = ((float)total * sx[m0 + r]) * c->scale[n + j];
                                if (c->bias) v += c->bias[n + j];
                                y[(m0 + r) * n_out + n + j] = v;
                            }
                        }
                    }
                }
            }
        }
    }
}

/* q + 128 as unsigned bytes: VNNI's unsigned operand. */
static void offset_rows(const int8_t *q, int64_t count, uint8_t *out) {
    for (int64_t i = 0; i < count; i++) out[i] = (uint8_t)((int32_t)q[i] + 128);
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void dot_vnni(const Int8Linear *c, const uint8_t *u, int64_t rows, int64_t n, int32_t *acc) {
    const int64_t k = c->in_features, body = k - k % 64;
    const int8_t *w = c->weight + n * k;
    const __mmask64 tail = k % 64 ? (~0ULL >> (64 - k % 64)) : 0;
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_GROUP) {
        const int64_t group = rows - m0 < ROW_GROUP ? rows - m0 : ROW_GROUP;
        __m512i sums[ROW_GROUP];
        for (int g = 0; g < ROW_GROUP; g++) sums[g] = _mm512_setzero_si512();
        for (int64_t i = 0; i < body; i += 64) {
            const __m512i wv = _mm512_loadu_si512((const void *)(w + i));
            for (int g = 0; g < group; g++)
                sums[g] = _mm512_dpbusd_epi32(sums[g], _mm512_loadu_si512((const void *)(u + (m0 + g) * k + i)), wv);
        }
        if (tail) {
            const __m512i wv = _mm512_maskz_loadu_epi8(tail, w + body);
            for (int g = 0; g < group; g++)
                sums[g] = _mm512_dpbusd_epi32(sums[g], _mm512_maskz_loadu_epi8(tail, u + (m0 + g) * k + body), wv);
        }
        for (int g = 0; g < group; g++)
            acc[m0 + g] = _mm512_reduce_add_epi32(sums[g]) - 128 * c->weight_sums[n];
    }
}

/* y [rows][N] from int32 products acc [rows][N] (computed elsewhere: oneDNN's GEMM), the
 * epilogue above. */
void srv_int8_scale_products(const Int8Linear *c, const int32_t *acc, const float *sx, int64_t rows, float *y) {
    const int64_t n_out = c->out_features;
    #pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < rows; m++) {
        const int32_t *a = acc + m * n_out;
        float *out = y + m * n_out;
        for (int64_t n = 0; n < n_out; n++) {
            float v = ((float)a[n] * sx[m]) * c->scale[n];
            if (c->bias) v += c->bias[n];
            out[n] = v;
        }
    }
}

/* AMX-INT8: TDPBUSD multiplies unsigned bytes of its first tile by signed bytes of its second,
 * sixteen by sixteen by 64 at a time. The weights are the first operand, flipped to w + 128 as
 * they are staged for the tile (a sign-bit xor), so they are read as they lie, row by row; the
 * activations are the second, sixteen rows at a time with each four neighbouring bytes of a row
 * side by side (the layout TDPBUSD reads it in), built once a call. The tiles hold
 * sum_k (w + 128) q, and 128 * sum_k q of each activation row is taken off: exact int32 sums
 * (up to 255 * 127 a product, so for K up to 66,000), the same as every other instruction set's,
 * for any K a multiple of 64 (other shapes take the VNNI product). Tiles: 0 holds the weights,
 * 1 and 2 the activations of two groups of 16 rows, 3 and 4 their sums. */
#define AMX_INT8 __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni")))
#define TILE SRV_AMX_TILE
/* Rows from which isa 3 runs a product on the tiles; fewer take VNNI's, which needs neither the
 * staged weights nor the transposes. */
#define AMX_ROWS 4

static int amx_usable = -1;

/* Whether this CPU has AMX-INT8 and the OS lets this process use the tiles. */
int srv_int8_has_amx(void) {
    if (amx_usable < 0) amx_usable = __builtin_cpu_supports("avx512vnni") && srv_amx_usable(SRV_AMX_INT8);
    return amx_usable;
}

AMX_INT8 static void gemm_amx(const Int8Linear *c, const int8_t *q, const float *sx, int64_t rows, float *y) {
    const int64_t k = c->in_features, n_out = c->out_features, chunks = k / 64, groups = (rows + TILE - 1) / TILE;
    /* qv [groups][chunks][16 units][16 rows]: row r's bytes 4u..4u+3 of a chunk as one unit;
     * and each row's 128 * sum_k q. */
    uint32_t *qv = malloc((size_t)(groups * chunks * TILE * TILE) * sizeof(uint32_t));
    int32_t *offsets = malloc((size_t)rows * sizeof(int32_t));
    srv_amx_pack_rows(q, rows, k, qv);
    for (int64_t m = 0; m < rows; m++) {
        int32_t sum = 0;
        for (int64_t i = 0; i < k; i++) sum += q[m * k + i];
        offsets[m] = 128 * sum;
    }
    #pragma omp parallel
    {
        srv_amx_configure(5);
        uint8_t *staged = malloc((size_t)(TILE * k));
        int32_t sums[2][TILE][TILE] __attribute__((aligned(64)));
        const __m512i sign = _mm512_set1_epi8((char)0x80);
        #pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < n_out; n0 += TILE) {
            const int present = n_out - n0 < TILE ? (int)(n_out - n0) : TILE;
            for (int j = 0; j < TILE; j++) {
                const int8_t *w = c->weight + (n0 + (j < present ? j : 0)) * k;
                for (int64_t i = 0; i < k; i += 64)
                    _mm512_storeu_si512(staged + j * k + i, _mm512_xor_si512(_mm512_loadu_si512(w + i), sign));
            }
            const __mmask16 outputs = (__mmask16)((1u << present) - 1);
            const __m512 scale = _mm512_maskz_loadu_ps(outputs, c->scale + n0);
            const __m512 bias = c->bias ? _mm512_maskz_loadu_ps(outputs, c->bias + n0) : _mm512_setzero_ps();
            for (int64_t g = 0; g < groups; g += 2) {
                const int two = g + 1 < groups;
                _tile_zero(3);
                _tile_zero(4);
                for (int64_t ch = 0; ch < chunks; ch++) {
                    _tile_loadd(0, staged + ch * 64, k);
                    _tile_loadd(1, qv + (g * chunks + ch) * TILE * TILE, TILE * sizeof(int32_t));
                    _tile_dpbusd(3, 0, 1);
                    if (two) {
                        _tile_loadd(2, qv + ((g + 1) * chunks + ch) * TILE * TILE, TILE * sizeof(int32_t));
                        _tile_dpbusd(4, 0, 2);
                    }
                }
                _tile_stored(3, sums[0], TILE * sizeof(int32_t));
                _tile_stored(4, sums[1], TILE * sizeof(int32_t));
                for (int h = 0; h <= two; h++) {   /* sums[h] is [outputs][rows]: y wants [rows][outputs] */
                    __m512 v[TILE];
                    for (int o = 0; o < TILE; o++) v[o] = _mm512_load_ps(sums[h][o]);
                    srv_transpose_16x16(v);
                    for (int64_t m = (g + h) * TILE; m < rows && m < (g + h + 1) * TILE; m++) {
                        const __m512i sum = _mm512_castps_si512(v[m % TILE]);
                        const __m512i exact = _mm512_sub_epi32(sum, _mm512_set1_epi32(offsets[m]));
                        const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(sx[m]));
                        __m512 out = _mm512_mul_ps(scaled, scale);
                        if (c->bias) out = _mm512_add_ps(out, bias);
                        _mm512_mask_storeu_ps(y + m * n_out + n0, outputs, out);
                    }
                }
            }
        }
        free(staged);
        _tile_release();
    }
    free(qv);
    free(offsets);
}

/* y [rows][N] = the product of x [rows][K] (float32) with the layer, as described above. */
void srv_int8_linear(const Int8Linear *c, const float *x, int64_t rows, float *y) {
    const int64_t k = c->in_features, n_out = c->out_features;
    int8_t *q = malloc((size_t)(rows * k) + 64);
    float *sx = malloc(sizeof(float) * (size_t)rows);
    if (c->bf16_rows) {
        float *rounded = malloc(sizeof(float) * (size_t)(rows * k));
        round_to_bf16(x, rows * k, rounded);
        srv_int8_quantize_rows(rounded, rows, k, q, sx, c->isa);
        free(rounded);
    } else {
        srv_int8_quantize_rows(x, rows, k, q, sx, c->isa);
    }
    if ((c->isa == 1 && rows >= TILED_ROWS) || (c->isa == 3 && rows >= AMX_ROWS && k % 64 == 0 && srv_int8_has_amx())) {
        if (c->isa == 1)
            gemm_avx2(c, q, sx, rows, y);
        else
            gemm_amx(c, q, sx, rows, y);
        free(q);
        free(sx);
        return;
    }
    const int64_t isa = c->isa == 3 ? 2 : c->isa;   /* AMX's few rows: VNNI's product */
    uint8_t *u = isa == 2 ? malloc((size_t)(rows * k) + 64) : NULL;
    if (u) offset_rows(q, rows * k, u);
    #pragma omp parallel
    {
        int32_t *acc = malloc(sizeof(int32_t) * (size_t)rows);
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < n_out; n++) {
            if (isa == 2) dot_vnni(c, u, rows, n, acc);
            else if (isa == 1) dot_avx2(c, q, rows, n, acc);
            else dot_portable(c, q, rows, n, acc);
            const float scale = c->scale[n];
            for (int64_t m = 0; m < rows; m++) {
                float v = ((float)acc[m] * sx[m]) * scale;
                if (c->bias) v += c->bias[n];
                y[m * n_out + n] = v;
            }
        }
        free(acc);
    }
    free(q);
    free(sx);
    free(u);
}

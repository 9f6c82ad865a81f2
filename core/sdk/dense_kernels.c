/* y [rows][out] = x [rows][in] W^T (+ b) for a few float32 activation rows and a float32 or
 * bfloat16 weight in its checkpoint's row-major layout: a decode step's product, bound by the
 * bytes of W. Each weight row is read from memory once for all the activation rows (tiles of
 * four weight rows by up to four activation rows stay in registers), bfloat16 is widened on the
 * fly, and the sums are float32 fused multiply-adds.
 *
 * Compiled three times (AVX-512, AVX2+FMA, portable), picked at run time from the CPU's flags;
 * srv_dense_set_isa forces one (the tests check each the machine has). Threads: OpenMP, in the
 * runtime the host process loaded (torch's), splitting the output rows.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { WEIGHT_F32 = 0, WEIGHT_BF16 = 1 };
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

typedef struct {
    int64_t weight_type, in_features, out_features;
    const void *weight;   /* [out][in] */
    const float *bias;    /* [out] or NULL */
} DenseContext;

static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}
static inline float f32_to_float(float v) { return v; }

/* One tile: NR weight rows (w, `k` apart) by MR activation rows (x, `k` apart), into y (rows
 * `ldy` apart), with the instruction set's vector type VEC of WIDTH floats and its operations.
 * bf16 rows are prefetched 4 KiB ahead: without it one row's product read them at about 0.8x
 * the float32 kernel's bytes a second. */
#define TILE(NAME, ATTR, TYPE, SCALAR, VEC, WIDTH, ZERO, LOADW, LOADX, FMA, HSUM, NR, MR)                    \
    ATTR static void NAME(const TYPE *w, int64_t k, const float *x, float *y, int64_t ldy) {              \
        VEC acc[NR][MR];                                                                               \
        for (int i = 0; i < NR; i++)                                                                   \
            for (int m = 0; m < MR; m++) acc[i][m] = ZERO;                                             \
        int64_t c = 0;                                                                                 \
        for (; c + WIDTH <= k; c += WIDTH) {                                                           \
            VEC xv[MR];                                                                                \
            for (int m = 0; m < MR; m++) xv[m] = LOADX(x + m * k + c);                                \
            if (sizeof(TYPE) == 2)                                                                     \
                for (int i = 0; i < NR; i++) __builtin_prefetch((const char *)(w + i * k + c) + 4096, 0, 1); \
            for (int i = 0; i < NR; i++) {                                                             \
                const VEC wv = LOADW(w + i * k + c);                                                   \
                for (int m = 0; m < MR; m++) acc[i][m] = FMA(wv, xv[m], acc[i][m]);                    \
            }                                                                                          \
        }                                                                                              \
        for (int i = 0; i < NR; i++)                                                                   \
            for (int m = 0; m < MR; m++) {                                                             \
                float s = HSUM(acc[i][m]);                                                             \
                for (int64_t t = c; t < k; t++) s += SCALAR(w[i * k + t]) * x[m * k + t];             \
                y[m * ldy + i] = s;                                                                    \
            }                                                                                          \
    }

/* The portable build: plain floats, which the compiler vectorizes as it can. */
#define P_ZERO 0.0f
#define P_ID(v) (v)
#define P_LOADF(p) (*(p))
#define P_LOADB(p) bf16_to_float(*(p))
#define P_FMA(a, b, c) ((c) + (a) * (b))

/* AVX2 + FMA, eight floats. */
__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
__attribute__((target("avx2,fma"))) static inline __m256 load_bf16_256(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#define A2_ZERO _mm256_setzero_ps()

/* AVX-512, sixteen floats. */
__attribute__((target("avx512f,avx512bw"))) static inline __m512 load_bf16_512(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#define A5_ZERO _mm512_setzero_ps()

#define PORTABLE_ATTR
#define AVX2_ATTR __attribute__((target("avx2,fma")))
#define AVX512_ATTR __attribute__((target("avx512f,avx512bw")))

/* Every tile shape of one instruction set and weight type: 4 or 1 weight rows by 1..4 rows. */
#define TILES(ISA, ATTR, TYPE, SCALAR, VEC, WIDTH, ZERO, LOADW, LOADX, FMA, HSUM)                               \
    TILE(ISA##_4_1, ATTR, TYPE, SCALAR, VEC, WIDTH, ZERO, LOADW, LOADX, FMA, HSUM, 4, 1)                       \
    TILE(ISA##_4_2, ATTR, TYPE, SCALAR, VEC, WIDTH, ZERO, LOADW, LOADX, FMA, HSUM, 4, 2)                       \
    TILE(ISA##_4_3, ATTR, TYPE, SCALAR, VEC, WIDTH, ZERO, LOADW, LOADX, FMA, HSUM, 4, 3)                       \
    TILE(ISA##_4_4, ATTR, TYPE, SCALAR, VEC, WIDTH, ZERO, LOADW, LOADX, FMA, HSUM, 4, 4)                       \
    TILE(ISA##_1_1, ATTR, TYPE, SCALAR, VEC, WIDTH, ZERO, LOADW, LOADX, FMA, HSUM, 1, 1)                       \
    TILE(ISA##_1_2, ATTR, TYPE, SCALAR, VEC, WIDTH, ZERO, LOADW, LOADX, FMA, HSUM, 1, 2)                       \
    TILE(ISA##_1_3, ATTR, TYPE, SCALAR, VEC, WIDTH, ZERO, LOADW, LOADX, FMA, HSUM, 1, 3)                       \
    TILE(ISA##_1_4, ATTR, TYPE, SCALAR, VEC, WIDTH, ZERO, LOADW, LOADX, FMA, HSUM, 1, 4)

TILES(portable_f32, PORTABLE_ATTR, float, f32_to_float, float, 1, P_ZERO, P_LOADF, P_LOADF, P_FMA, P_ID)
TILES(portable_bf16, PORTABLE_ATTR, uint16_t, bf16_to_float, float, 1, P_ZERO, P_LOADB, P_LOADF, P_FMA, P_ID)
TILES(avx2_f32, AVX2_ATTR, float, f32_to_float, __m256, 8, A2_ZERO, _mm256_loadu_ps, _mm256_loadu_ps,
      _mm256_fmadd_ps, hsum256)
TILES(avx2_bf16, AVX2_ATTR, uint16_t, bf16_to_float, __m256, 8, A2_ZERO, load_bf16_256, _mm256_loadu_ps,
      _mm256_fmadd_ps, hsum256)
TILES(avx512_f32, AVX512_ATTR, float, f32_to_float, __m512, 16, A5_ZERO, _mm512_loadu_ps, _mm512_loadu_ps,
      _mm512_fmadd_ps, _mm512_reduce_add_ps)
TILES(avx512_bf16, AVX512_ATTR, uint16_t, bf16_to_float, __m512, 16, A5_ZERO, load_bf16_512, _mm512_loadu_ps,
      _mm512_fmadd_ps, _mm512_reduce_add_ps)

typedef void (*Tile)(const void *w, int64_t k, const float *x, float *y, int64_t ldy);
#define ROW(ISA) {(Tile)ISA##_4_1, (Tile)ISA##_4_2, (Tile)ISA##_4_3, (Tile)ISA##_4_4}, \
                 {(Tile)ISA##_1_1, (Tile)ISA##_1_2, (Tile)ISA##_1_3, (Tile)ISA##_1_4}
/* [isa][weight type][0: four weight rows, 1: one][activation rows - 1] */
static const Tile TILES_BY[3][2][2][4] = {
    {{ROW(portable_f32)}, {ROW(portable_bf16)}},
    {{ROW(avx2_f32)}, {ROW(avx2_bf16)}},
    {{ROW(avx512_f32)}, {ROW(avx512_bf16)}},
};

static int isa = -1;

int srv_dense_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
    return ISA_PORTABLE;
}

/* -1: the CPU's best. */
void srv_dense_set_isa(int level) { isa = level < 0 ? srv_dense_best_isa() : level; }

#define ROWS_A_TILE 4

void srv_dense_linear(const void *context, const float *x, int64_t rows, float *y) {
    if (isa < 0) isa = srv_dense_best_isa();
    const DenseContext *c = context;
    const int64_t k = c->in_features, n = c->out_features;
    const int64_t element = c->weight_type == WEIGHT_BF16 ? 2 : 4;
    const Tile (*tiles)[4] = TILES_BY[isa][c->weight_type];
    const char *weight = c->weight;
    const int64_t blocks = (n + 3) / 4;
    /* Small layers (the tests' tiny models) are not worth waking a second thread for. */
#pragma omp parallel for schedule(static) if (n * k >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * 4, count = n - first < 4 ? n - first : 4;
        for (int64_t r = 0; r < rows; r += ROWS_A_TILE) {
            const int64_t m = rows - r < ROWS_A_TILE ? rows - r : ROWS_A_TILE;
            if (count == 4) {
                tiles[0][m - 1](weight + first * k * element, k, x + r * k, y + r * n + first, n);
            } else {
                for (int64_t j = first; j < first + count; j++)
                    tiles[1][m - 1](weight + j * k * element, k, x + r * k, y + r * n + j, n);
            }
        }
        if (c->bias)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = first; j < first + count; j++) y[r * n + j] += c->bias[j];
    }
}

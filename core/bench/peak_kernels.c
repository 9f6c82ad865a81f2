/* The CPU's float32 and int8 multiply-add peaks, for `srv bench one-batch`: each thread runs
 * independent chains of the widest multiply-add instruction the CPU has on values held in
 * registers, so no memory traffic and no library's blocking enters the figure. It is the
 * limit a product of that data type can approach, whatever computes it.
 *
 * isa: 0 portable C, 1 AVX2 + FMA (int8: vpmaddubsw, vpmaddwd, vpaddd), 2 AVX-512 (int8 as
 * AVX2 on 512 bits), 3 AVX-512 VNNI (int8: vpdpbusd). Each function returns the operations
 * it performed (a multiply-add counts two).
 */
#include <immintrin.h>
#include <stdint.h>

#define CHAINS 12

/* Keeps the compiler from treating a register's value as known, so a multiply-add of loop
 * invariants is not hoisted out of the loop. */
#define OPAQUE(v) __asm__ volatile("" : "+x"(v))

__attribute__((target("avx2,fma"))) static float fma_avx2(int64_t iterations) {
    __m256 acc[CHAINS], a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_ps((float)c);
    for (int64_t i = 0; i < iterations; i++)
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
    float out[8], sum = 0.0f;
    for (int c = 1; c < CHAINS; c++) acc[0] = _mm256_add_ps(acc[0], acc[c]);
    _mm256_storeu_ps(out, acc[0]);
    for (int j = 0; j < 8; j++) sum += out[j];
    return sum;
}

__attribute__((target("avx512f"))) static float fma_avx512(int64_t iterations) {
    __m512 acc[CHAINS], a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
    for (int64_t i = 0; i < iterations; i++)
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    for (int c = 1; c < CHAINS; c++) acc[0] = _mm512_add_ps(acc[0], acc[c]);
    return _mm512_reduce_add_ps(acc[0]);
}

static float fma_portable(int64_t iterations) {
    float acc[CHAINS * 8];
    for (int c = 0; c < CHAINS * 8; c++) acc[c] = (float)c;
    for (int64_t i = 0; i < iterations; i++)
        for (int c = 0; c < CHAINS * 8; c++) acc[c] = acc[c] * 0.999f + 1e-7f;
    float sum = 0.0f;
    for (int c = 0; c < CHAINS * 8; c++) sum += acc[c];
    return sum;
}

__attribute__((target("avx2,fma"))) static int32_t int8_avx2(int64_t iterations) {
    __m256i acc[CHAINS], a[CHAINS], b = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    for (int c = 0; c < CHAINS; c++) { acc[c] = _mm256_setzero_si256(); a[c] = _mm256_set1_epi8((char)(c + 1)); }
    for (int64_t i = 0; i < iterations; i++)
        for (int c = 0; c < CHAINS; c++) {
            OPAQUE(a[c]);
            __m256i pairs = _mm256_maddubs_epi16(a[c], b);
            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(pairs, ones));
        }
    for (int c = 1; c < CHAINS; c++) acc[0] = _mm256_add_epi32(acc[0], acc[c]);
    return _mm256_extract_epi32(acc[0], 0);
}

__attribute__((target("avx512f,avx512bw"))) static int32_t int8_avx512(int64_t iterations) {
    __m512i acc[CHAINS], a[CHAINS], b = _mm512_set1_epi8(3), ones = _mm512_set1_epi16(1);
    for (int c = 0; c < CHAINS; c++) { acc[c] = _mm512_setzero_si512(); a[c] = _mm512_set1_epi8((char)(c + 1)); }
    for (int64_t i = 0; i < iterations; i++)
        for (int c = 0; c < CHAINS; c++) {
            OPAQUE(a[c]);
            __m512i pairs = _mm512_maddubs_epi16(a[c], b);
            acc[c] = _mm512_add_epi32(acc[c], _mm512_madd_epi16(pairs, ones));
        }
    for (int c = 1; c < CHAINS; c++) acc[0] = _mm512_add_epi32(acc[0], acc[c]);
    return _mm512_reduce_add_epi32(acc[0]);
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static int32_t int8_vnni(int64_t iterations) {
    __m512i acc[CHAINS], a[CHAINS], b = _mm512_set1_epi8(3);
    for (int c = 0; c < CHAINS; c++) { acc[c] = _mm512_setzero_si512(); a[c] = _mm512_set1_epi8((char)(c + 1)); }
    for (int64_t i = 0; i < iterations; i++)
        for (int c = 0; c < CHAINS; c++) {
            OPAQUE(a[c]);
            acc[c] = _mm512_dpbusd_epi32(acc[c], a[c], b);
        }
    for (int c = 1; c < CHAINS; c++) acc[0] = _mm512_add_epi32(acc[0], acc[c]);
    return _mm512_reduce_add_epi32(acc[0]);
}

static int32_t int8_portable(int64_t iterations) {
    int8_t a[CHAINS * 32];
    uint8_t b[CHAINS * 32];
    int32_t acc[CHAINS * 32];
    for (int c = 0; c < CHAINS * 32; c++) { a[c] = (int8_t)(c % 7); b[c] = (uint8_t)(c % 5); acc[c] = 0; }
    for (int64_t i = 0; i < iterations; i++) {
        __asm__ volatile("" : : "r"(a), "r"(b) : "memory");
        for (int c = 0; c < CHAINS * 32; c++) acc[c] += (int32_t)a[c] * (int32_t)b[c];
    }
    int32_t sum = 0;
    for (int c = 0; c < CHAINS * 32; c++) sum += acc[c];
    return sum;
}

/* Lanes of one chain's instruction: float32 lanes, int8 multiply-adds. */
static const int64_t FMA_LANES[4] = {8, 8, 16, 16};
static const int64_t INT8_LANES[4] = {32, 32, 64, 64};

double srv_peak_fma(int isa, int64_t iterations, int threads) {
    volatile float sink = 0.0f;
    #pragma omp parallel num_threads(threads)
    {
        float r = isa >= 2 ? fma_avx512(iterations) : isa == 1 ? fma_avx2(iterations) : fma_portable(iterations);
        sink += r;
    }
    (void)sink;
    return 2.0 * (double)iterations * CHAINS * (double)FMA_LANES[isa] * threads;
}

double srv_peak_int8(int isa, int64_t iterations, int threads) {
    volatile int32_t sink = 0;
    #pragma omp parallel num_threads(threads)
    {
        int32_t r = isa == 3 ? int8_vnni(iterations) : isa == 2 ? int8_avx512(iterations)
                  : isa == 1 ? int8_avx2(iterations) : int8_portable(iterations);
        sink += r;
    }
    (void)sink;
    return 2.0 * (double)iterations * CHAINS * (double)INT8_LANES[isa] * threads;
}

/* Greedy decoding's token: the first index of each row's largest value, a NaN counting as larger
 * than any number (the first NaN where a row has one), as torch.max(x, dim=-1).indices gives it.
 * torch's kernel tracks an index beside every value and is not vectorized on the CPU, and a row
 * of a vocabulary's logits cost it several times these two passes. Here one pass finds the largest
 * value (and whether there is a NaN) a vector at a time, and a second finds where it first
 * occurs; AVX-512, AVX2 or plain C, whichever the CPU runs. Rows are split across OpenMP
 * threads (torch's runtime) when there are several. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline int64_t first_index(const float *row, int64_t from, int64_t n, float largest, int nan) {
    for (int64_t i = from; i < n; i++)
        if (nan ? row[i] != row[i] : row[i] == largest) return i;
    return 0;   /* not reached for n > 0 */
}

/* The largest of `count` lanes and of row[from, n); *nan is set where one of row[from, n) is a NaN. */
static inline float largest_of(const float *lanes, int count, const float *row, int64_t from, int64_t n, int *nan) {
    float largest = lanes[0];
    for (int j = 1; j < count; j++) largest = lanes[j] > largest ? lanes[j] : largest;
    for (int64_t t = from; t < n; t++) {
        *nan |= row[t] != row[t];
        largest = row[t] > largest ? row[t] : largest;
    }
    return largest;
}

static int64_t first_largest_c(const float *row, int64_t n) {
    const float lowest = -INFINITY;
    int nan = 0;
    const float largest = largest_of(&lowest, 1, row, 0, n, &nan);
    return first_index(row, 0, n, largest, nan);
}

__attribute__((target("avx2"))) static int64_t first_largest_avx2(const float *row, int64_t n) {
    __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_max_ps(v, best);   /* v > best ? v : best */
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, best);
    int any_nan = _mm256_movemask_ps(nan) != 0;
    const float largest = largest_of(lanes, 8, row, i, n, &any_nan);
    const __m256 target = _mm256_set1_ps(largest);
    int64_t from = 0;
    for (; from + 8 <= n; from += 8) {
        const __m256 v = _mm256_loadu_ps(row + from);
        const __m256 hit = any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ);
        const int mask = _mm256_movemask_ps(hit);
        if (mask) return from + __builtin_ctz(mask);
    }
    return first_index(row, from, n, largest, any_nan);
}

__attribute__((target("avx512f"))) static int64_t first_largest_avx512(const float *row, int64_t n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_max_ps(v, best);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, best);
    int any_nan = nan != 0;
    const float largest = largest_of(lanes, 16, row, i, n, &any_nan);
    const __m512 target = _mm512_set1_ps(largest);
    int64_t from = 0;
    for (; from + 16 <= n; from += 16) {
        const __m512 v = _mm512_loadu_ps(row + from);
        const __mmask16 hit = any_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        if (hit) return from + __builtin_ctz(hit);
    }
    return first_index(row, from, n, largest, any_nan);
}

/* Which body runs: 2 AVX-512, 1 AVX2, 0 plain C; -1 until the first call looks. */
static int body = -1;

/* Another body than the CPU's best, for tests (0, 1 or 2; -1 picks the best again). */
void srv_argmax_set_body(int which) {
    __builtin_cpu_init();
    const int best = __builtin_cpu_supports("avx512f") ? 2 : (__builtin_cpu_supports("avx2") ? 1 : 0);
    body = which < 0 || which > best ? best : which;
}

/* out[r] = the first index of row r's largest value; rows `stride` floats apart, n > 0. */
void srv_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    if (body < 0) srv_argmax_set_body(-1);
#pragma omp parallel for if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        out[r] = body == 2 ? first_largest_avx512(row, n) : (body == 1 ? first_largest_avx2(row, n) : first_largest_c(row, n));
    }
}

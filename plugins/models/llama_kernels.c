/* The Llama family's small per-layer operations on float32 rows, one call each where torch
 * runs six to eight operators of a few microseconds apiece: at one token a step those add up
 * to a fifth of the step. Plain C (the compiler vectorizes it), so no CPU feature is needed.
 * Compiled without FMA contraction: each product and sum rounds as torch's operators do.
 */

#include <math.h>
#include <stdint.h>

/* out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)), rows `stride` floats apart in x. */
void srv_rms_norm(const float *x, int64_t rows, int64_t hidden, int64_t stride, const float *weight, float eps,
                  float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        float lanes[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= hidden; i += 8)
            for (int j = 0; j < 8; j++) lanes[j] += xr[i + j] * xr[i + j];
        float squares = 0.0f;
        for (; i < hidden; i++) squares += xr[i] * xr[i];
        for (int j = 0; j < 8; j++) squares += lanes[j];
        const float inverse = 1.0f / sqrtf(squares / (float)hidden + eps);
        float *o = out + r * hidden;
        for (i = 0; i < hidden; i++) o[i] = weight[i] * (xr[i] * inverse);
    }
}

/* Rotary embedding, rotate-half style, of `heads` heads of size d per token: x [T][heads][d]
 * with tokens `stride` floats apart; cos, sin [T][d]; out [T][heads][d] contiguous. */
void srv_rotary(const float *x, int64_t tokens, int64_t heads, int64_t d, int64_t stride, const float *cos,
                const float *sin, float *out) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * stride + h * d;
            float *o = out + (t * heads + h) * d;
            for (int64_t i = 0; i < half; i++) {
                const float first = xh[i] * c[i], second = -xh[i + half] * s[i];
                o[i] = first + second;
            }
            for (int64_t i = half; i < d; i++) {
                const float first = xh[i] * c[i], second = xh[i - half] * s[i];
                o[i] = first + second;
            }
        }
    }
}

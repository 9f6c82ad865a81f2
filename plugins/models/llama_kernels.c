/* The Llama family's small per-layer operations on float32 rows, one call each where torch
 * runs six to eight operators of a few microseconds apiece: at one token a step those add up
 * to a fifth of the step. Plain C (the compiler vectorizes it), so no CPU feature is needed.
 * Compiled without FMA contraction: each product and sum rounds as torch's operators do.
 */

#include <math.h>
#include <stdint.h>

static void rms_norm_row(const float *xr, int64_t hidden, const float *weight, float eps, float *o) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= hidden; i += 8)
        for (int j = 0; j < 8; j++) lanes[j] += xr[i + j] * xr[i + j];
    float squares = 0.0f;
    for (; i < hidden; i++) squares += xr[i] * xr[i];
    for (int j = 0; j < 8; j++) squares += lanes[j];
    const float inverse = 1.0f / sqrtf(squares / (float)hidden + eps);
    for (i = 0; i < hidden; i++) o[i] = weight[i] * (xr[i] * inverse);
}

/* out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)), rows `stride` floats apart in x. */
void srv_rms_norm(const float *x, int64_t rows, int64_t hidden, int64_t stride, const float *weight, float eps,
                  float *out) {
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * stride, hidden, weight, eps, out + r * hidden);
}

/* The residual stream's step: residual += delta (in place), then out = rms_norm(residual);
 * all three [rows][hidden] contiguous. */
void srv_add_rms_norm(float *residual, const float *delta, int64_t rows, int64_t hidden, const float *weight,
                      float eps, float *out) {
    for (int64_t i = 0; i < rows * hidden; i++) residual[i] += delta[i];
    srv_rms_norm(residual, rows, hidden, hidden, weight, eps, out);
}

/* out[r][i] = silu(gate_up[r][i]) * gate_up[r][size + i]: the gated MLP's activation on the
 * fused gate/up projection's output, [rows][2 * size] contiguous. */
void srv_silu_mul(const float *gate_up, int64_t rows, int64_t size, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * size, *up = gate + size;
        float *o = out + r * size;
        for (int64_t i = 0; i < size; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* Rotary embedding, rotate-half style, in place, of `heads` heads of size d per token: x
 * [T][heads][d] with tokens `stride` floats apart; cos, sin [T][d]. */
void srv_rotary(float *x, int64_t tokens, int64_t heads, int64_t d, int64_t stride, const float *cos,
                const float *sin) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            float *xh = x + t * stride + h * d;
            for (int64_t i = 0; i < half; i++) {
                const float low = xh[i], high = xh[i + half];
                const float first = low * c[i], second = -high * s[i];
                const float third = high * c[i + half], fourth = low * s[i + half];
                xh[i] = first + second;
                xh[i + half] = third + fourth;
            }
        }
    }
}

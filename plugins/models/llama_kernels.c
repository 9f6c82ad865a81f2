/* The Llama family's small per-layer operations on float32 rows (and bf16 ones), one call each where torch
 * runs six to eight operators of a few microseconds apiece: at one token a step those add up
 * to a fifth of the step. Plain C, which the compiler vectorizes for each instruction set that
 * target_clones names (the loader picks the CPU's at load), so no CPU feature is needed; OpenMP
 * threads (torch's runtime) only where a batch is large enough to pay for them.
 * Compiled without FMA contraction: each product and sum rounds as torch's operators do.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The rows' helpers are always inlined: a function with target_clones is compiled once for each
 * instruction set, and so is what it inlines, where a helper it calls is compiled for the
 * baseline only (SSE2 vectors). Vector width changes no value here: every sum keeps its order. */
#define ROW_HELPER static inline __attribute__((always_inline))
/* Values from which a call threads over rows (fewer run on the calling thread). */
#define PARALLEL_FROM 32768
#define CLONED __attribute__((target_clones("avx512f", "avx2", "default")))

ROW_HELPER void rms_norm_row(const float *xr, int64_t hidden, const float *weight, float eps, float *o) {
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
CLONED void srv_rms_norm(const float *x, int64_t rows, int64_t hidden, int64_t stride, const float *weight, float eps,
                         float *out) {
#pragma omp parallel for if (rows * hidden >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * stride, hidden, weight, eps, out + r * hidden);
}

/* The residual stream's step: residual += delta (in place), then out = rms_norm(residual);
 * all three [rows][hidden] contiguous. */
CLONED void srv_add_rms_norm(float *residual, const float *delta, int64_t rows, int64_t hidden, const float *weight,
                             float eps, float *out) {
#pragma omp parallel for if (rows * hidden >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * hidden;
        const float *d = delta + r * hidden;
        for (int64_t i = 0; i < hidden; i++) res[i] += d[i];
        rms_norm_row(res, hidden, weight, eps, out + r * hidden);
    }
}

/* e^x, written so that the compiler vectorizes a loop of it (glibc's expf is a call a value,
 * which made SiLU cost more than the MLP's products at 64 rows): 2^n * e^r with n = round(x /
 * ln2), ln2 split in two so that r = x - n ln2 is exact, e^r by its degree-6 Taylor polynomial.
 * Relative error under 2e-7, as torch's own vectorized exp; 0 below -87, +inf above 88.7. */
static inline float exp_vectorizable(float x) {
    const float clamped = x < -87.0f ? -87.0f : (x > 88.7f ? 88.7f : x);
    /* Adding 1.5 * 2^23 rounds to the nearest integer, with no call to rintf. */
    const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    const float e = p * scale;
    return x < -87.0f ? 0.0f : (x > 88.7f ? INFINITY : e);
}

/* out[r][i] = silu(gate_up[r][i]) * gate_up[r][size + i]: the gated MLP's activation on the
 * fused gate/up projection's output, [rows][2 * size] contiguous. */
CLONED void srv_silu_mul(const float *gate_up, int64_t rows, int64_t size, float *out) {
#pragma omp parallel for if (rows * size >= 8192)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * size, *up = gate + size;
        float *o = out + r * size;
        for (int64_t i = 0; i < size; i++) o[i] = gate[i] / (1.0f + exp_vectorizable(-gate[i])) * up[i];
    }
}

/* Rotary embedding, rotate-half style, in place, of `heads` heads of size d per token: x
 * [T][heads][d] with tokens `stride` floats apart; cos, sin [T][d], or, with `positions`, tables
 * of rows [position][d] that token t reads at row positions[t]. */
CLONED void srv_rotary(float *x, int64_t tokens, int64_t heads, int64_t d, int64_t stride, const float *cos,
                       const float *sin, const int64_t *positions) {
    const int64_t half = d / 2;
#pragma omp parallel for if (tokens * heads * d >= PARALLEL_FROM)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t row = positions ? positions[t] : t;
        const float *c = cos + row * d, *s = sin + row * d;
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

/* The norms and the rotary embedding on bf16 rows, for a model served in bf16 (its prefills and
 * the steps the Python layers run): each computed in float32 and rounded to bf16 where torch's
 * operators round (nearest even), so that the rows are those torch's operators would give, where
 * torch takes several passes over the rows and converts between the dtypes in each. (torch's own
 * bf16 SiLU is as fast as this file's would be.) OpenMP threads over rows where there are enough
 * of them. */
static inline float from_bf16(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    /* a select, not a branch, so that the loops calling it vectorize; a NaN stays a quiet NaN */
    const uint32_t rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, quiet = (bits >> 16) | 0x40;
    return (uint16_t)(f != f ? quiet : rounded);
}

ROW_HELPER void rms_norm_row_bf16(const uint16_t *xr, int64_t hidden, const uint16_t *weight, float eps, uint16_t *o) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= hidden; i += 8)
        for (int j = 0; j < 8; j++) lanes[j] += from_bf16(xr[i + j]) * from_bf16(xr[i + j]);
    float squares = 0.0f;
    for (; i < hidden; i++) squares += from_bf16(xr[i]) * from_bf16(xr[i]);
    for (int j = 0; j < 8; j++) squares += lanes[j];
    const float inverse = 1.0f / sqrtf(squares / (float)hidden + eps);
    /* torch: weight * (x * rsqrt(...)).to(bf16), the product rounded again */
    for (i = 0; i < hidden; i++) o[i] = to_bf16(from_bf16(weight[i]) * from_bf16(to_bf16(from_bf16(xr[i]) * inverse)));
}

/* srv_rms_norm on bf16 rows with a bf16 weight. */
CLONED void srv_rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t hidden, int64_t stride, const uint16_t *weight,
                              float eps, uint16_t *out) {
#pragma omp parallel for if (rows * hidden >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) rms_norm_row_bf16(x + r * stride, hidden, weight, eps, out + r * hidden);
}

/* srv_add_rms_norm on bf16 rows: the sum rounded to bf16 into residual, then its norm. */
CLONED void srv_add_rms_norm_bf16(uint16_t *residual, const uint16_t *delta, int64_t rows, int64_t hidden,
                                  const uint16_t *weight, float eps, uint16_t *out) {
#pragma omp parallel for if (rows * hidden >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *res = residual + r * hidden;
        const uint16_t *d = delta + r * hidden;
        for (int64_t i = 0; i < hidden; i++) res[i] = to_bf16(from_bf16(res[i]) + from_bf16(d[i]));
        rms_norm_row_bf16(res, hidden, weight, eps, out + r * hidden);
    }
}

/* srv_rotary on bf16 rows: float32 products and sum (torch promotes bf16 rows times float32
 * cos and sin), rounded to bf16 once. */
CLONED void srv_rotary_bf16(uint16_t *x, int64_t tokens, int64_t heads, int64_t d, int64_t stride, const float *cos,
                            const float *sin, const int64_t *positions) {
    const int64_t half = d / 2;
#pragma omp parallel for if (tokens * heads * d >= PARALLEL_FROM)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t row = positions ? positions[t] : t;
        const float *c = cos + row * d, *s = sin + row * d;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *xh = x + t * stride + h * d;
            for (int64_t i = 0; i < half; i++) {
                const float low = from_bf16(xh[i]), high = from_bf16(xh[i + half]);
                const float first = low * c[i], second = -high * s[i];
                const float third = high * c[i + half], fourth = low * s[i + half];
                xh[i] = to_bf16(first + second);
                xh[i + half] = to_bf16(third + fourth);
            }
        }
    }
}

/* A kernel another plugin hands over (srv.sdk.native.NativeKernel): a quantized linear layer's
 * product, or a decode step's attention. */
typedef struct {
    const void *function;
    const void *context;
} NativeKernel;

typedef void (*LinearFunction)(const void *context, const float *x, int64_t rows, float *y);
typedef void (*DecodeAttentionFunction)(const void *context, int64_t layer, const float *q, int64_t q_stride,
                                        const float *k, const float *v, int64_t kv_stride, float *out);

static inline void linear(const NativeKernel *kernel, const float *x, int64_t rows, float *y) {
    ((LinearFunction)kernel->function)(kernel->context, x, rows, y);
}

/* Under tensor parallelism: the partial sums of a split layer's output (x, count floats) added
 * up over the ranks, in place (srv.sdk.parallel.ParallelContext.native_all_reduce, or a call
 * back into Python). No kernel at one rank. */
typedef void (*AllReduceFunction)(const void *context, float *x, int64_t count);

typedef struct {
    NativeKernel qkv, o, gate_up, down;
    const float *input_norm, *post_attention_norm;
} DecoderLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
} LayerShapes;

/* What a decode step's layers take in and hand on at the ends of the model, where the step's
 * stage holds them: the first stage looks each row's token up in the embedding matrix
 * (`ids`, `embedding`: [vocab][hidden] float32, or bf16 with `embedding_bf16`), widened to float32
 * as torch's `.float()` does; the last stage applies the final norm (`final_norm`, float32) to
 * the residual stream's last step, into `final_out` [rows][hidden], the rows the head reads. */
typedef struct {
    const int64_t *ids;
    const void *embedding;
    int64_t vocab, embedding_bf16;
    const float *final_norm;
    float *final_out;
} DecodeEnds;

/* Every decoder layer of a decode step, as DecoderLayer.forward runs them one by one: the same
 * kernels in the same order on the same buffers, so the results are the same to the bit.
 * x [rows][hidden]: the embeddings in (or looked up here, see DecodeEnds), the last layer's MLP
 * output out; residual: the residual stream before that output. A pipeline stage after the first
 * is given the previous stage's output in x and its residual stream in residual
 * (`residual_given`). cos, sin: the rotary tables, [position][head_dim], each row reading its
 * position's (`positions`). The rest is scratch, float32 rows: qkv [heads + 2 kv_heads][head_dim],
 * attention [heads][head_dim], normed [hidden], gate_up [2 intermediate], activation [intermediate].
 * Under tensor parallelism each rank runs its share of the heads and features, and `all_reduce`
 * adds up the attention output's and the MLP output's partial sums, where the Python layers do.
 * Returns 0, or 1 + the first row whose token is outside the embedding matrix (nothing computed). */
int64_t srv_decode_layers(const DecoderLayer *layers, int64_t count, const LayerShapes *shape,
                          const NativeKernel *attention, const float *cos, const float *sin, const int64_t *positions,
                          float *x, float *residual, int64_t rows, float *qkv, float *attended, float *normed,
                          float *gate_up, float *activation, const NativeKernel *all_reduce, int64_t residual_given,
                          const DecodeEnds *ends) {
    const int64_t hidden = shape->hidden, d = shape->head_dim;
    if (ends->ids) {
        for (int64_t r = 0; r < rows; r++)
            if (ends->ids[r] < 0 || ends->ids[r] >= ends->vocab) return r + 1;
        for (int64_t r = 0; r < rows; r++) {
            float *xr = x + r * hidden;
            if (ends->embedding_bf16) {
                const uint16_t *row = (const uint16_t *)ends->embedding + ends->ids[r] * hidden;
                for (int64_t i = 0; i < hidden; i++) xr[i] = from_bf16(row[i]);
            } else {
                memcpy(xr, (const float *)ends->embedding + ends->ids[r] * hidden, (size_t)hidden * sizeof(float));
            }
        }
    }
    const AllReduceFunction reduce = all_reduce ? (AllReduceFunction)all_reduce->function : NULL;
    const int64_t q_size = shape->heads * d, kv_size = shape->kv_heads * d, qkv_size = q_size + 2 * kv_size;
    const DecodeAttentionFunction attend = (DecodeAttentionFunction)attention->function;
    for (int64_t l = 0; l < count; l++) {
        const DecoderLayer *layer = layers + l;
        if (l == 0 && !residual_given) {
            memcpy(residual, x, (size_t)(rows * hidden) * sizeof(float));
            srv_rms_norm(x, rows, hidden, hidden, layer->input_norm, shape->eps, normed);
        } else {
            srv_add_rms_norm(residual, x, rows, hidden, layer->input_norm, shape->eps, normed);
        }
        linear(&layer->qkv, normed, rows, qkv);
        srv_rotary(qkv, rows, shape->heads + shape->kv_heads, d, qkv_size, cos, sin, positions);
        attend(attention->context, l, qkv, qkv_size, qkv + q_size, qkv + q_size + kv_size, qkv_size, attended);
        linear(&layer->o, attended, rows, x);
        if (reduce) reduce(all_reduce->context, x, rows * hidden);
        srv_add_rms_norm(residual, x, rows, hidden, layer->post_attention_norm, shape->eps, normed);
        linear(&layer->gate_up, normed, rows, gate_up);
        srv_silu_mul(gate_up, rows, shape->intermediate, activation);
        linear(&layer->down, activation, rows, x);
        if (reduce) reduce(all_reduce->context, x, rows * hidden);
    }
    if (ends->final_norm) srv_add_rms_norm(residual, x, rows, hidden, ends->final_norm, shape->eps, ends->final_out);
    return 0;
}

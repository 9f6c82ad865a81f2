/* The formats of srv's KV caches as its C kernels number them (`#include "srv_kv_formats.h"`:
 * srv.sdk.native.load_c_library puts this folder on the include path), and float8's codes: a
 * float8 cache (srv.sdk.attention.KVCache) holds value / scale, one scale a layer for keys and
 * one for values. The numbers are the Python side's too (intel_amx's KV_FORMATS). */
#ifndef SRV_KV_FORMATS_H
#define SRV_KV_FORMATS_H

#include <math.h>
#include <stdint.h>

enum { KV_FLOAT32 = 0, KV_BFLOAT16 = 1, KV_FLOAT16 = 2, KV_FLOAT8_E4M3 = 3, KV_FLOAT8_E5M2 = 4 };

static inline int is_float8(int kv_format) { return kv_format >= KV_FLOAT8_E4M3; }
static inline int64_t element_size(int kv_format) {
    return kv_format == KV_FLOAT32 ? 4 : (is_float8(kv_format) ? 1 : 2);
}

/* Every float8 code's value, for each format (index kv_format - KV_FLOAT8_E4M3), and the largest
 * finite code of each: e4m3fn (bias 7, no infinities, 0x7F NaN) and e5m2 (bias 15, IEEE-like). */
static float float8_values[2][256];
static const int float8_largest[2] = {0x7E, 0x7B};

__attribute__((constructor)) static void fill_float8_values(void) {
    for (int code = 0; code < 256; code++) {
        const int sign = code >> 7;
        for (int f = 0; f < 2; f++) {
            const int mantissa_bits = f == 0 ? 3 : 2, bias = f == 0 ? 7 : 15;
            const int exponent = (code & 0x7F) >> mantissa_bits, mantissa = code & ((1 << mantissa_bits) - 1);
            const int top = f == 0 ? 15 : 31;
            float v;
            if (exponent == 0)
                v = ldexpf((float)mantissa, 1 - bias - mantissa_bits);
            else if (f == 0 && exponent == top && mantissa == (1 << mantissa_bits) - 1)
                v = NAN;
            else if (f == 1 && exponent == top)
                v = mantissa ? NAN : INFINITY;
            else
                v = ldexpf((float)((1 << mantissa_bits) + mantissa), exponent - bias - mantissa_bits);
            float8_values[f][code] = sign ? -v : v;
        }
    }
}

static inline void widen_float8_row(const uint8_t *src, int kv_format, int64_t d, float scale, float *row) {
    const float *values = float8_values[kv_format - KV_FLOAT8_E4M3];
    for (int64_t i = 0; i < d; i++) row[i] = values[src[i]] * scale;
}

/* The float8 code nearest v / scale, saturated at the largest finite value, ties to the even
 * code: torch's rounding of the same clamped value. */
static inline uint8_t narrow_float8(float v, int kv_format, float scale) {
    const int f = kv_format - KV_FLOAT8_E4M3, largest = float8_largest[f];
    const float *values = float8_values[f];
    float x = v / scale;
    if (isnan(x)) return 0x7F;
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    x = fabsf(x);
    if (x >= values[largest]) return sign | (uint8_t)largest;
    int low = 0, high = largest;   /* values[low] <= x < values[high] */
    while (high - low > 1) {
        const int mid = (low + high) / 2;
        if (values[mid] <= x) low = mid; else high = mid;
    }
    const float below = x - values[low], above = values[high] - x;
    const int code = below < above ? low : (above < below ? high : (low % 2 == 0 ? low : high));
    return sign | (uint8_t)code;
}

#endif

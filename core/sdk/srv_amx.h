/* AMX for srv's C kernels (`#include "srv_amx.h"`: srv.sdk.native.load_c_library puts this
 * folder on the include path): whether the tiles can be used, their configuration, and the
 * 16 x 16 transpose that lays rows out for them and their sums back.
 *
 * Linux lends a process the tiles' state only when asked (arch_prctl), so a kernel asks once,
 * before its first tile instruction: srv_amx_usable. A thread loads a configuration before its
 * tiles (srv_amx_configure) and releases them after (_tile_release). */
#ifndef SRV_AMX_H
#define SRV_AMX_H

#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

long syscall(long number, ...);   /* unistd.h declares it only under _GNU_SOURCE or _DEFAULT_SOURCE */

#define SRV_AMX_TILE 16       /* rows of a tile, and 64 bytes a row */
#define SRV_AMX_BF16 22       /* CPUID leaf 7 EDX bits of the tiles' arithmetic */
#define SRV_AMX_INT8 25
#define SRV_ARCH_REQ_XCOMP_PERM 0x1023
#define SRV_XFEATURE_XTILEDATA 18

/* Whether this CPU has AMX's tiles and the arithmetic of CPUID bit `feature` (SRV_AMX_BF16,
 * SRV_AMX_INT8), and the OS lets this process use the tiles (asked here, once is enough). */
static inline int srv_amx_usable(int feature) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 24) & 1) && ((d >> feature) & 1) &&
           syscall(SYS_arch_prctl, SRV_ARCH_REQ_XCOMP_PERM, SRV_XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} SrvTileConfig;

/* Tiles 0 .. count - 1 as 16 rows of 64 bytes, on the calling thread. */
__attribute__((target("amx-tile"))) static inline void srv_amx_configure(int count) {
    SrvTileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < count; t++) {
        config.rows[t] = SRV_AMX_TILE;
        config.bytes_per_row[t] = 64;
    }
    /* GCC 12 may drop the stores above as dead, taking ldtilecfg for a reader of the first
     * bytes only (seen where this is not inlined into its caller): the barrier keeps them. */
    __asm__ __volatile__("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

/* v[i][j] = v[j][i] for 16 vectors of 16 32-bit values (the bits moved, never converted: int32
 * and pairs of bf16 go through as floats). */
__attribute__((target("avx512f"))) static inline void srv_transpose_16x16(__m512 v[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {   /* 32-bit pairs of neighbouring rows */
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {   /* 64-bit pairs: four rows' column c, c + 4, c + 8, c + 12 */
        for (int h = 0; h < 2; h++) {
            const __m512d a = _mm512_castps_pd(t[i + h]), b = _mm512_castps_pd(t[i + h + 2]);
            u[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            u[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    }
    for (int c = 0; c < 4; c++) {   /* the 128-bit lanes of the four row groups, column by column */
        const __m512 low01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
        const __m512 high01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
        const __m512 low23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
        const __m512 high23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
        v[c] = _mm512_shuffle_f32x4(low01, low23, 0x88);
        v[c + 4] = _mm512_shuffle_f32x4(low01, low23, 0xDD);
        v[c + 8] = _mm512_shuffle_f32x4(high01, high23, 0x88);
        v[c + 12] = _mm512_shuffle_f32x4(high01, high23, 0xDD);
    }
}

/* The second operand of the tiles from m rows of `row_bytes` bytes (a multiple of 64), row r at
 * rows + r * row_bytes: out [ceil(m / 16) groups][row_bytes / 64 chunks][16 units][16 rows], each
 * row's 4-byte units of a chunk side by side across its group's rows, rows past m zero. That is
 * the layout TDPBF16PS and TDPBUSD read their second tile in (pairs of bf16, fours of int8). */
__attribute__((target("avx512f"))) static inline void srv_amx_pack_rows(const void *rows, int64_t m,
                                                                        int64_t row_bytes, uint32_t *out) {
    const int64_t groups = (m + SRV_AMX_TILE - 1) / SRV_AMX_TILE, chunks = row_bytes / 64;
    #pragma omp parallel for schedule(static) if (groups > 1)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t c = 0; c < chunks; c++) {
            __m512 v[SRV_AMX_TILE];   /* 4-byte units, moved as floats */
            for (int r = 0; r < SRV_AMX_TILE; r++)
                v[r] = g * SRV_AMX_TILE + r < m
                    ? _mm512_loadu_ps((const char *)rows + (g * SRV_AMX_TILE + r) * row_bytes + c * 64)
                    : _mm512_setzero_ps();
            srv_transpose_16x16(v);
            for (int u = 0; u < SRV_AMX_TILE; u++)
                _mm512_storeu_ps(out + ((g * chunks + c) * SRV_AMX_TILE + u) * SRV_AMX_TILE, v[u]);
        }
}

#endif

/* trillm C kernels at the width of an AVX2 CPU's registers: 8 float lanes (`f32x8`).
 *
 * Why: every other kernel is written over GCC's 64-byte vector type (`f32x16`, one tile row
 * of 16 outputs), which is one `zmm` register with AVX-512. Without AVX-512 GCC 12 has no
 * machine mode for it and keeps every such variable on the stack: the inner loops moved each
 * accumulator through memory, and the C step ran 4-30x behind oneDNN on an AVX2-only CPU
 * (AMD EPYC Zen 2, SmolLM2's 120 float32 linears at 32 tokens: 1624 ms against oneDNN's 62;
 * `perf/linear_bench.py --tiled`). Here a tile row is two `ymm` halves and every hot variable
 * is an 8-lane vector, so GCC keeps them in the 16 registers.
 *
 * The tiles' layout is the same (16 rows a tile, k-major); only the blocking differs: a tile
 * against 6 tokens a pass (the classic 6 x 16 AVX2 block: 12 accumulators, 2 weight vectors
 * and a broadcast fill 15 of 16 registers), where the 64-byte kernels take tile pairs.
 *
 * Built where the compiler targets AVX2 without AVX-512 (`TL_NARROW`); AVX-512 builds keep
 * the 64-byte kernels unchanged, and builds without AVX2 (SSE) keep them too (slow, correct). */
#ifndef TL_NARROW_H
#define TL_NARROW_H

#include "tl_vec.h"

#ifdef TL_NARROW

#define NROWS 6 /* tokens a tile's pass takes: 12 accumulators of 16 registers */

/* `gated16` over 8 lanes: act(g) * u. */
static inline f32x8 gated8(f32x8 g, f32x8 u, int act) {
    f32x8 t = act == ACT_GELU_TANH ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
    return g / (exp8(-t) + 1.0f) * u;
}

/* out[i * 16 + r] = sum_k tile[k][r] * x[i * ldx + k] for ROWS tokens, a dense (float32 or
 * bfloat16) tile; CH chains per accumulator (k, k + 1, ...), where ROWS alone leaves the
 * FMA units waiting on their latency. */
#define DEFINE_NDOT(NAME, WT, LD, ROWS, CH)                                                   \
    static inline void NAME(const WT *tile, int K, const float *x, int ldx, float *out) {    \
        f32x8 a[CH][ROWS][2];                                                                 \
        for (int c = 0; c < CH; c++)                                                          \
            for (int i = 0; i < ROWS; i++) a[c][i][0] = a[c][i][1] = (f32x8){0};              \
        int k = 0;                                                                            \
        for (; k + CH <= K; k += CH)                                                          \
            for (int c = 0; c < CH; c++) {                                                    \
                const WT *w = tile + (size_t)(k + c) * 16;                                    \
                const f32x8 w0 = LD(w), w1 = LD(w + 8);                                       \
                for (int i = 0; i < ROWS; i++) {                                              \
                    const float xv = x[(size_t)i * ldx + k + c];                              \
                    a[c][i][0] += w0 * xv;                                                    \
                    a[c][i][1] += w1 * xv;                                                    \
                }                                                                             \
            }                                                                                 \
        for (; k < K; k++) {                                                                  \
            const WT *w = tile + (size_t)k * 16;                                              \
            const f32x8 w0 = LD(w), w1 = LD(w + 8);                                           \
            for (int i = 0; i < ROWS; i++) {                                                  \
                a[0][i][0] += w0 * x[(size_t)i * ldx + k];                                    \
                a[0][i][1] += w1 * x[(size_t)i * ldx + k];                                    \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < ROWS; i++)                                                        \
            for (int h = 0; h < 2; h++) {                                                     \
                f32x8 s = a[0][i][h];                                                         \
                for (int c = 1; c < CH; c++) s += a[c][i][h];                                 \
                st8(out + i * 16 + h * 8, s);                                                 \
            }                                                                                 \
    }

#define DEFINE_NDOTS(SUFFIX, WT, LD)                                                          \
    DEFINE_NDOT(ndot6_##SUFFIX, WT, LD, 6, 1)                                                 \
    DEFINE_NDOT(ndot4_##SUFFIX, WT, LD, 4, 1)                                                 \
    DEFINE_NDOT(ndot2_##SUFFIX, WT, LD, 2, 2)                                                 \
    DEFINE_NDOT(ndot1_##SUFFIX, WT, LD, 1, 4)                                                 \
    static int ntile_dot_##SUFFIX(const WT *tile, int K, const float *x, int ldx, int rows,  \
                                  float *out) {                                               \
        if (rows >= 6) return ndot6_##SUFFIX(tile, K, x, ldx, out), 6;                        \
        if (rows >= 4) return ndot4_##SUFFIX(tile, K, x, ldx, out), 4;                        \
        if (rows >= 2) return ndot2_##SUFFIX(tile, K, x, ldx, out), 2;                        \
        return ndot1_##SUFFIX(tile, K, x, ldx, out), 1;                                       \
    }

DEFINE_NDOTS(f32, float, ld8)
DEFINE_NDOTS(bf16, uint16_t, ld8_bf16)

#include "tl_narrow_quant.h"

/* Tile `t` of a tiled weight against `rows` tokens of x into out [done][16]; returns done. */
static int ntile_dot(const void *w, int wtype, int K, int t, const float *x, int ldx,
                     const float *xsum, int ldxs, int rows, float *out) {
    const uint8_t *bytes = (const uint8_t *)w;
    switch (wtype) {
    case TL_BF16:
        return ntile_dot_bf16((const uint16_t *)w + (size_t)t * K * 16, K, x, ldx, rows, out);
    case TL_Q4:
        return nq4_tile_dot(bytes + (size_t)t * (K / 32) * Q4_GROUP, K, x, ldx, xsum, ldxs, rows,
                            out);
    case TL_Q8:
        return nq8_tile_dot(bytes + (size_t)t * (K / 32) * Q8_GROUP, K, x, ldx, rows, out);
    default:
        return ntile_dot_f32((const float *)w + (size_t)t * K * 16, K, x, ldx, rows, out);
    }
}

#endif /* TL_NARROW */
#endif

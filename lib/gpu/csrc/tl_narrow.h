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

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define TL_NARROW 1

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

#define NROWS 6 /* tokens a tile's pass takes: 12 accumulators of 16 registers */

static inline f32x8 ld8(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st8(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }

static inline f32x8 ld8_bf16(const uint16_t *p) {
    u16x8 h;
    memcpy(&h, p, sizeof h);
    return (f32x8)(__builtin_convertvector(h, u32x8) << 16);
}

static inline f32x8 ld8_f16(const uint16_t *p) {
#ifdef __F16C__
    return (f32x8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    f32x16 v = load_f16(p); /* only the first 8 lanes are used */
    f32x8 r;
    memcpy(&r, &v, sizeof r);
    return r;
#endif
}

/* 8 bytes at p as unsigned / signed integers, to float. */
static inline f32x8 u8_to_f32x8(const uint8_t *p) {
    return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline f32x8 i8_to_f32x8(const uint8_t *p) {
    return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float hsum8(f32x8 v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}

static inline f32x8 vmax8(f32x8 a, f32x8 b) { return (f32x8)_mm256_max_ps((__m256)a, (__m256)b); }

static inline float hmax8(f32x8 v) {
    v = vmax8(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax8(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = vmax8(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
    return v[0];
}

/* `exp16` over 8 lanes (the same Cephes polynomial, the same clamps). */
static inline f32x8 exp8(f32x8 x) {
    x = (f32x8)_mm256_min_ps((__m256)x, (__m256)((f32x8){0} + 88.3762626647949f));
    x = (f32x8)_mm256_max_ps((__m256)x, (__m256)((f32x8){0} - 87.3365447504019f));
    const f32x8 magic = (f32x8){0} + 12582912.0f;
    f32x8 t = x * 1.44269504088896341f + magic;
    i32x8 n = (i32x8)t - (i32x8)magic;
    f32x8 nf = t - magic;
    f32x8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    f32x8 p = (f32x8){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (f32x8)((n + 127) << 23);
}

/* `gated16` over 8 lanes: act(g) * u. */
static inline f32x8 gated8(f32x8 g, f32x8 u, int act) {
    f32x8 t = act == ACT_GELU_TANH ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
    return g / (exp8(-t) + 1.0f) * u;
}

static inline float dot8(const float *a, const float *b, int D) {
    f32x8 s0 = {0}, s1 = {0};
    int i = 0;
    for (; i + 16 <= D; i += 16) {
        s0 += ld8(a + i) * ld8(b + i);
        s1 += ld8(a + i + 8) * ld8(b + i + 8);
    }
    for (; i + 8 <= D; i += 8) s0 += ld8(a + i) * ld8(b + i);
    float s = hsum8(s0 + s1);
    for (; i < D; i++) s += a[i] * b[i];
    return s;
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

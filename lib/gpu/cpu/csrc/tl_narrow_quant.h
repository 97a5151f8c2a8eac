/* trillm C kernels: GGUF's Q4 and Q8 tiles at 8 float lanes (`tl_narrow.h`, AVX2).
 *
 * The tiles are `tl_linear.h`'s: per 32-k group a Q4 tile holds d[16], m[16] (float16) and
 * 16 rows of 16 bytes (row kk: the 16 outputs' nibbles for k = kk (low) and kk + 16 (high));
 * a Q8 tile d[16] and 32 rows of 16 int8. The arithmetic is the 64-byte kernels': the quants
 * against float32 tokens, a group's sum scaled by d in float32, plus m times the tokens' group
 * sum (Q4_1). A group's sums are added into `out`, which stays in L1, so the registers hold
 * only the group's accumulators, the converted quants and the broadcasts (4 tokens: 14). */
#ifndef TL_NARROW_QUANT_H
#define TL_NARROW_QUANT_H

/* out[i * 16 + r] = tile . x[i] for ROWS tokens of a Q4 tile; `xsum[i * ldxs + g]`. */
#define DEFINE_NQ4_DOT(NAME, ROWS)                                                            \
    static inline void NAME(const uint8_t *tile, int K, const float *x, int ldx,            \
                            const float *xsum, int ldxs, float *out) {                       \
        memset(out, 0, sizeof(float) * 16 * ROWS);                                           \
        const __m128i low = _mm_set1_epi8(15);                                               \
        for (int g = 0; g < K / 32; g++) {                                                   \
            const uint8_t *grp = tile + (size_t)g * Q4_GROUP, *nib = grp + 64;               \
            f32x8 s[ROWS][2];                                                                \
            for (int i = 0; i < ROWS; i++) s[i][0] = s[i][1] = (f32x8){0};                   \
            for (int kk = 0; kk < 16; kk++) {                                                \
                __m128i b = _mm_loadu_si128((const __m128i *)(nib + kk * 16));               \
                __m128i lo = _mm_and_si128(b, low);                                          \
                __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);                       \
                f32x8 l0 = (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));              \
                f32x8 l1 = (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))); \
                f32x8 h0 = (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));              \
                f32x8 h1 = (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))); \
                for (int i = 0; i < ROWS; i++) {                                             \
                    const float *xi = x + (size_t)i * ldx + g * 32;                          \
                    const float xa = xi[kk], xb = xi[kk + 16];                               \
                    s[i][0] += l0 * xa + h0 * xb;                                            \
                    s[i][1] += l1 * xa + h1 * xb;                                            \
                }                                                                            \
            }                                                                                \
            const uint16_t *d = (const uint16_t *)grp, *mn = (const uint16_t *)(grp + 32);   \
            const f32x8 d0 = ld8_f16(d), d1 = ld8_f16(d + 8);                                \
            const f32x8 m0 = ld8_f16(mn), m1 = ld8_f16(mn + 8);                              \
            for (int i = 0; i < ROWS; i++) {                                                 \
                const float xs = xsum[(size_t)i * ldxs + g];                                 \
                float *o = out + i * 16;                                                     \
                st8(o, ld8(o) + d0 * s[i][0] + m0 * xs);                                     \
                st8(o + 8, ld8(o + 8) + d1 * s[i][1] + m1 * xs);                             \
            }                                                                                \
        }                                                                                    \
    }

/* out[i * 16 + r] = tile . x[i] for ROWS tokens of a Q8 tile. */
#define DEFINE_NQ8_DOT(NAME, ROWS)                                                            \
    static inline void NAME(const uint8_t *tile, int K, const float *x, int ldx, float *out) { \
        memset(out, 0, sizeof(float) * 16 * ROWS);                                           \
        for (int g = 0; g < K / 32; g++) {                                                   \
            const uint8_t *grp = tile + (size_t)g * Q8_GROUP, *q = grp + 32;                 \
            f32x8 s[ROWS][2];                                                                \
            for (int i = 0; i < ROWS; i++) s[i][0] = s[i][1] = (f32x8){0};                   \
            for (int kk = 0; kk < 32; kk++) {                                                \
                const f32x8 w0 = i8_to_f32x8(q + kk * 16), w1 = i8_to_f32x8(q + kk * 16 + 8);  \
                for (int i = 0; i < ROWS; i++) {                                             \
                    const float xv = x[(size_t)i * ldx + g * 32 + kk];                       \
                    s[i][0] += w0 * xv;                                                      \
                    s[i][1] += w1 * xv;                                                      \
                }                                                                            \
            }                                                                                \
            const uint16_t *d = (const uint16_t *)grp;                                       \
            const f32x8 d0 = ld8_f16(d), d1 = ld8_f16(d + 8);                                \
            for (int i = 0; i < ROWS; i++) {                                                 \
                float *o = out + i * 16;                                                     \
                st8(o, ld8(o) + d0 * s[i][0]);                                               \
                st8(o + 8, ld8(o + 8) + d1 * s[i][1]);                                       \
            }                                                                                \
        }                                                                                    \
    }

DEFINE_NQ4_DOT(nq4_dot4, 4)
DEFINE_NQ4_DOT(nq4_dot2, 2)
DEFINE_NQ4_DOT(nq4_dot1, 1)
DEFINE_NQ8_DOT(nq8_dot4, 4)
DEFINE_NQ8_DOT(nq8_dot2, 2)
DEFINE_NQ8_DOT(nq8_dot1, 1)

static int nq4_tile_dot(const uint8_t *tile, int K, const float *x, int ldx, const float *xsum,
                        int ldxs, int rows, float *out) {
    if (rows >= 4) return nq4_dot4(tile, K, x, ldx, xsum, ldxs, out), 4;
    if (rows >= 2) return nq4_dot2(tile, K, x, ldx, xsum, ldxs, out), 2;
    return nq4_dot1(tile, K, x, ldx, xsum, ldxs, out), 1;
}

static int nq8_tile_dot(const uint8_t *tile, int K, const float *x, int ldx, int rows,
                        float *out) {
    if (rows >= 4) return nq8_dot4(tile, K, x, ldx, out), 4;
    if (rows >= 2) return nq8_dot2(tile, K, x, ldx, out), 2;
    return nq8_dot1(tile, K, x, ldx, out), 1;
}

/* Tile `tile` of a Q4 / Q8 weight dequantised into `w` [K][16] float32: d * q + m (Q4) or
 * d * q (Q8), each product and sum rounded on its own, as GGUF's dequantisers compute them (no
 * fused multiply-add: the values are the dequantised model's, bit for bit). Why: at many
 * tokens a tile's quants were converted again for every block of 4 tokens; dequantised once
 * into L1/L2, the tile runs the float32 6-token blocks (`nlinear_tiles`, NQ_DEQUANT_MIN). */
__attribute__((optimize("fp-contract=off"))) static void nq4_dequant(const uint8_t *tile, int K,
                                                                     float *w) {
    const __m128i low = _mm_set1_epi8(15);
    for (int g = 0; g < K / 32; g++) {
        const uint8_t *grp = tile + (size_t)g * Q4_GROUP, *nib = grp + 64;
        const uint16_t *d = (const uint16_t *)grp, *mn = (const uint16_t *)(grp + 32);
        const f32x8 d0 = ld8_f16(d), d1 = ld8_f16(d + 8), m0 = ld8_f16(mn), m1 = ld8_f16(mn + 8);
        for (int kk = 0; kk < 16; kk++) {
            __m128i b = _mm_loadu_si128((const __m128i *)(nib + kk * 16));
            __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
            float *wl = w + ((size_t)g * 32 + kk) * 16, *wh = wl + 16 * 16;
            st8(wl, (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)) * d0 + m0);
            st8(wl + 8, (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))) * d1 + m1);
            st8(wh, (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)) * d0 + m0);
            st8(wh + 8, (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))) * d1 + m1);
        }
    }
}

__attribute__((optimize("fp-contract=off"))) static void nq8_dequant(const uint8_t *tile, int K,
                                                                     float *w) {
    for (int g = 0; g < K / 32; g++) {
        const uint8_t *grp = tile + (size_t)g * Q8_GROUP, *q = grp + 32;
        const uint16_t *d = (const uint16_t *)grp;
        const f32x8 d0 = ld8_f16(d), d1 = ld8_f16(d + 8);
        for (int kk = 0; kk < 32; kk++) {
            float *wk = w + ((size_t)g * 32 + kk) * 16;
            st8(wk, i8_to_f32x8(q + kk * 16) * d0);
            st8(wk + 8, i8_to_f32x8(q + kk * 16 + 8) * d1);
        }
    }
}

#endif

/* trillm C kernels: products over tiled weights (float32, bfloat16, Q4, Q8 tiles). */
#ifndef TL_LINEAR_H
#define TL_LINEAR_H

#include "tl_amx.h"
#include "tl_lora.h"
#include "tl_vec.h"

/* acc[i] = sum_k tile[k] * x[i * ldx + k] for ROWS tokens; two chains per token. */
#define DEFINE_TILE_DOT(NAME, WT, LOAD, ROWS)                                                 \
    static inline void NAME(const WT *tile, int K, const float *x, int ldx, f32x16 *acc) {   \
        f32x16 a[ROWS], b[ROWS];                                                              \
        for (int i = 0; i < ROWS; i++) a[i] = b[i] = (f32x16){0};                             \
        int k = 0;                                                                            \
        for (; k + 1 < K; k += 2) {                                                           \
            f32x16 w0 = LOAD(tile + (size_t)k * 16), w1 = LOAD(tile + (size_t)(k + 1) * 16); \
            for (int i = 0; i < ROWS; i++) {                                                  \
                a[i] += w0 * x[i * ldx + k];                                                  \
                b[i] += w1 * x[i * ldx + k + 1];                                              \
            }                                                                                 \
        }                                                                                     \
        if (k < K) {                                                                          \
            f32x16 w0 = LOAD(tile + (size_t)k * 16);                                          \
            for (int i = 0; i < ROWS; i++) a[i] += w0 * x[i * ldx + k];                       \
        }                                                                                     \
        for (int i = 0; i < ROWS; i++) acc[i] = a[i] + b[i];                                  \
    }

#define DEFINE_TILE_DOTS(SUFFIX, WT, LOAD)                          \
    DEFINE_TILE_DOT(dot1_##SUFFIX, WT, LOAD, 1)                     \
    DEFINE_TILE_DOT(dot2_##SUFFIX, WT, LOAD, 2)                     \
    DEFINE_TILE_DOT(dot4_##SUFFIX, WT, LOAD, 4)                     \
    DEFINE_TILE_DOT(dot8_##SUFFIX, WT, LOAD, 8)                     \
    static int tile_dot_##SUFFIX(const WT *tile, int K, const float *x, int ldx, int rows, \
                                 f32x16 *acc) {                     \
        if (rows >= 8 && MAX_ROWS >= 8) {                           \
            dot8_##SUFFIX(tile, K, x, ldx, acc);                    \
            return 8;                                               \
        }                                                           \
        if (rows >= 4) {                                            \
            dot4_##SUFFIX(tile, K, x, ldx, acc);                    \
            return 4;                                               \
        }                                                           \
        if (rows >= 2) {                                            \
            dot2_##SUFFIX(tile, K, x, ldx, acc);                    \
            return 2;                                               \
        }                                                           \
        dot1_##SUFFIX(tile, K, x, ldx, acc);                        \
        return 1;                                                   \
    }

DEFINE_TILE_DOTS(f32, float, load_f32)
DEFINE_TILE_DOTS(bf16, uint16_t, load_bf16)

/* Two adjacent tiles against ROWS tokens: each x[k] broadcast feeds both tiles' FMAs, so
 * at 8 tokens 16 FMAs cost 10 loads instead of 18 (the larger decode batches are FMA-bound).
 * acc0 = tile w0, acc1 = tile w1. `pf`: the same k of the next pair (2 * K * 16 elements
 * on), fetched as it goes (see `pair_dot`), or w0 itself. */
#define DEFINE_PAIR_DOT(NAME, WT, LOAD, ROWS)                                                 \
    static inline void NAME(const WT *w0, const WT *w1, int K, const float *x, int ldx,     \
                            f32x16 *acc0, f32x16 *acc1, const WT *pf) {                      \
        f32x16 a[ROWS], b[ROWS];                                                              \
        const size_t pf1 = pf == w0 ? 0 : (size_t)K * 16;                                     \
        for (int i = 0; i < ROWS; i++) a[i] = b[i] = (f32x16){0};                             \
        for (int k = 0; k < K; k++) {                                                         \
            __builtin_prefetch(pf + (size_t)k * 16, 0, 3);                                    \
            __builtin_prefetch(pf + pf1 + (size_t)k * 16, 0, 3);                              \
            f32x16 u = LOAD(w0 + (size_t)k * 16), v = LOAD(w1 + (size_t)k * 16);              \
            for (int i = 0; i < ROWS; i++) {                                                  \
                float xv = x[i * ldx + k];                                                    \
                a[i] += u * xv;                                                               \
                b[i] += v * xv;                                                               \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < ROWS; i++) {                                                      \
            acc0[i] = a[i];                                                                   \
            acc1[i] = b[i];                                                                   \
        }                                                                                     \
    }

#define DEFINE_PAIR_DOTS(SUFFIX, WT, LOAD)                                                    \
    DEFINE_PAIR_DOT(pair8_##SUFFIX, WT, LOAD, 8)                                              \
    DEFINE_PAIR_DOT(pair4_##SUFFIX, WT, LOAD, 4)                                              \
    static int pair_dot_##SUFFIX(const WT *w0, const WT *w1, int K, const float *x, int ldx,  \
                                 int rows, f32x16 *acc0, f32x16 *acc1, const WT *pf) {       \
        if (rows >= 8 && MAX_ROWS >= 8) {                                                     \
            pair8_##SUFFIX(w0, w1, K, x, ldx, acc0, acc1, pf);                                \
            return 8;                                                                         \
        }                                                                                     \
        pair4_##SUFFIX(w0, w1, K, x, ldx, acc0, acc1, pf);                                    \
        return 4;                                                                             \
    }

DEFINE_PAIR_DOTS(f32, float, load_f32)
DEFINE_PAIR_DOTS(bf16, uint16_t, load_bf16)



/* Q4 tile against ROWS tokens; `xsum[i * ldxs + g]`: token i's sum of x over group g. */
#define DEFINE_Q4_DOT(NAME, ROWS)                                                              \
    static inline void NAME(const uint8_t *tile, int K, const float *x, int ldx,             \
                            const float *xsum, int ldxs, f32x16 *acc) {                       \
        f32x16 total[ROWS];                                                                    \
        for (int i = 0; i < ROWS; i++) total[i] = (f32x16){0};                                 \
        for (int g = 0; g < K / 32; g++) {                                                     \
            const uint8_t *grp = tile + (size_t)g * Q4_GROUP, *nib = grp + 64;                 \
            f32x16 a[ROWS], b[ROWS];                                                           \
            for (int i = 0; i < ROWS; i++) a[i] = b[i] = (f32x16){0};                          \
            for (int kk = 0; kk < 16; kk++) {                                                  \
                u8x16 bytes;                                                                   \
                memcpy(&bytes, nib + kk * 16, sizeof bytes);                                   \
                f32x16 lo = u8_to_f32(bytes & 15), hi = u8_to_f32(bytes >> 4);                 \
                for (int i = 0; i < ROWS; i++) {                                               \
                    const float *xi = x + (size_t)i * ldx + g * 32;                            \
                    a[i] += lo * xi[kk];                                                       \
                    b[i] += hi * xi[kk + 16];                                                  \
                }                                                                              \
            }                                                                                  \
            f32x16 d = load_f16((const uint16_t *)grp);                                        \
            f32x16 mn = load_f16((const uint16_t *)(grp + 32));                                \
            for (int i = 0; i < ROWS; i++) total[i] += d * (a[i] + b[i]) + mn * xsum[i * ldxs + g]; \
        }                                                                                      \
        for (int i = 0; i < ROWS; i++) acc[i] = total[i];                                      \
    }

/* Q8 tile against ROWS tokens. */
#define DEFINE_Q8_DOT(NAME, ROWS)                                                              \
    static inline void NAME(const uint8_t *tile, int K, const float *x, int ldx,             \
                            const float *xsum, int ldxs, f32x16 *acc) {                       \
        (void)xsum;                                                                            \
        (void)ldxs;                                                                            \
        f32x16 total[ROWS];                                                                    \
        for (int i = 0; i < ROWS; i++) total[i] = (f32x16){0};                                 \
        for (int g = 0; g < K / 32; g++) {                                                     \
            const uint8_t *grp = tile + (size_t)g * Q8_GROUP, *q = grp + 32;                   \
            f32x16 a[ROWS], b[ROWS];                                                           \
            for (int i = 0; i < ROWS; i++) a[i] = b[i] = (f32x16){0};                          \
            for (int kk = 0; kk < 32; kk += 2) {                                               \
                i8x16 q0, q1;                                                                  \
                memcpy(&q0, q + kk * 16, sizeof q0);                                           \
                memcpy(&q1, q + (kk + 1) * 16, sizeof q1);                                     \
                f32x16 w0 = i8_to_f32(q0), w1 = i8_to_f32(q1);                                 \
                for (int i = 0; i < ROWS; i++) {                                               \
                    const float *xi = x + (size_t)i * ldx + g * 32;                            \
                    a[i] += w0 * xi[kk];                                                       \
                    b[i] += w1 * xi[kk + 1];                                                   \
                }                                                                              \
            }                                                                                  \
            f32x16 d = load_f16((const uint16_t *)grp);                                        \
            for (int i = 0; i < ROWS; i++) total[i] += d * (a[i] + b[i]);                      \
        }                                                                                      \
        for (int i = 0; i < ROWS; i++) acc[i] = total[i];                                      \
    }

#define DEFINE_QUANT_DOTS(KIND)                                                                \
    DEFINE_##KIND##_DOT(KIND##_dot1, 1)                                                        \
    DEFINE_##KIND##_DOT(KIND##_dot2, 2)                                                        \
    DEFINE_##KIND##_DOT(KIND##_dot4, 4)                                                        \
    DEFINE_##KIND##_DOT(KIND##_dot8, 8)                                                        \
    static int KIND##_tile_dot(const uint8_t *tile, int K, const float *x, int ldx,            \
                               const float *xsum, int ldxs, int rows, f32x16 *acc) {          \
        if (rows >= 8 && MAX_ROWS >= 8) {                                                      \
            KIND##_dot8(tile, K, x, ldx, xsum, ldxs, acc);                                     \
            return 8;                                                                          \
        }                                                                                      \
        if (rows >= 4) {                                                                       \
            KIND##_dot4(tile, K, x, ldx, xsum, ldxs, acc);                                     \
            return 4;                                                                          \
        }                                                                                      \
        if (rows >= 2) {                                                                       \
            KIND##_dot2(tile, K, x, ldx, xsum, ldxs, acc);                                     \
            return 2;                                                                          \
        }                                                                                      \
        KIND##_dot1(tile, K, x, ldx, xsum, ldxs, acc);                                         \
        return 1;                                                                              \
    }

DEFINE_QUANT_DOTS(Q4)
DEFINE_QUANT_DOTS(Q8)

/* Tile `t` of a tiled weight against `rows` tokens of x; returns how many it did. `xsum`
 * [rows][K / 32] (stride ldxs): the tokens' group sums, read by Q4 only. */
static int tile_dot(const void *w, int wtype, int K, int t, const float *x, int ldx,
                    const float *xsum, int ldxs, int rows, f32x16 *acc) {
    const uint8_t *bytes = (const uint8_t *)w;
    switch (wtype) {
    case TL_BF16:
        return tile_dot_bf16((const uint16_t *)w + (size_t)t * K * 16, K, x, ldx, rows, acc);
    case TL_Q4:
        return Q4_tile_dot(bytes + (size_t)t * (K / 32) * Q4_GROUP, K, x, ldx, xsum, ldxs, rows,
                           acc);
    case TL_Q8:
        return Q8_tile_dot(bytes + (size_t)t * (K / 32) * Q8_GROUP, K, x, ldx, xsum, ldxs, rows,
                           acc);
    default:
        return tile_dot_f32((const float *)w + (size_t)t * K * 16, K, x, ldx, rows, acc);
    }
}

/* Tiles t and t + 1 of a dense (float32 / bfloat16) weight against >= 4 tokens; returns how
 * many tokens it did. With `fetch`, tiles t + 2 and t + 3 (the next pair: they follow in
 * memory; the caller says they exist) are fetched meanwhile.
 *
 * Why: a pair is read from memory by its first block of tokens, then from cache by the next
 * blocks. Fetching the next pair during the first block keeps twice the reads in flight;
 * at 32 decode tokens the 120 float32 linears of SmolLM2 went from 0.94x to 0.87x oneDNN's
 * time (linear_bench --tiled; perf/README.md). During the second block it gained nothing. */
static int pair_dot(const void *w, int wtype, int K, int t, const float *x, int ldx, int rows,
                    f32x16 *acc0, f32x16 *acc1, int fetch) {
    size_t at = (size_t)t * K * 16, next = at + (size_t)K * 16;
    size_t pf = fetch ? next + (size_t)K * 16 : at;
    if (wtype == TL_BF16) {
        const uint16_t *h = (const uint16_t *)w;
        return pair_dot_bf16(h + at, h + next, K, x, ldx, rows, acc0, acc1, h + pf);
    }
    const float *f = (const float *)w;
    return pair_dot_f32(f + at, f + next, K, x, ldx, rows, acc0, acc1, f + pf);
}

/* xsum[m * (K / 32) + g] = sum of x[m, 32 g .. 32 g + 31] (what a Q4 group's minimum meets). */
static void group_sums(const float *x, int ldx, int M, int K, float *xsum) {
    for (int m = 0; m < M; m++)
        for (int g = 0; g < K / 32; g++) {
            float s = 0.0f;
            for (int k = 0; k < 32; k++) s += x[(size_t)m * ldx + g * 32 + k];
            xsum[m * (K / 32) + g] = s;
        }
}

enum { OUT_STORE = 0, OUT_ADD = 1 };

/* out[m, n] = (OUT_STORE) or += alpha * (OUT_ADD) x[m] . w[n] + bias[n] for the tiles
 * [t0, t1) and every token m < M; rows n >= N (the last tile's padding) are not written.
 * `xsum`: `group_sums` of x (Q4). `lora` (NULL: none): the tokens' adapter deltas, added to
 * x[m] . w[n] (`tl_lora.h`). */
static void amx_linear_tiles(const uint16_t *w, int K, int N, const float *bias, const float *x,
                             int ldx, int M, float *out, int ldo, int mode, float alpha, int t0,
                             int t1, const struct tl_lora_rows *lora, uint16_t *xb);

static void linear_tiles(const void *w, int wtype, int K, int N, const float *bias,
                         const float *x, int ldx, int M, const float *xsum, float *out, int ldo,
                         int mode, float alpha, int t0, int t1, const struct tl_lora_rows *lora,
                         uint16_t *xb) {
    if (wtype == TL_BF16_AMX) {
        amx_linear_tiles((const uint16_t *)w, K, N, bias, x, ldx, M, out, ldo, mode, alpha, t0, t1,
                         lora, xb);
        return;
    }
    f32x16 acc[2][MAX_ROWS];
    const int G = wtype == TL_Q4 ? K / 32 : 0, dense = wtype == TL_F32 || wtype == TL_BF16;
    for (int t = t0; t < t1;) {
        int tiles = dense && M >= 4 && t + 1 < t1 ? 2 : 1; /* a pair: see DEFINE_PAIR_DOT */
        for (int m = 0; m < M;) {
            const float *xm = x + (size_t)m * ldx, *sm = xsum ? xsum + (size_t)m * G : NULL;
            int done;
            if (tiles == 2 && M - m >= 4) {
                int fetch = m == 0 && t + 3 < t1; /* the first block: see pair_dot */
                done = pair_dot(w, wtype, K, t, xm, ldx, M - m, acc[0], acc[1], fetch);
            } else { /* one tile, or a pair's last 1-3 tokens one tile at a time */
                done = tile_dot(w, wtype, K, t, xm, ldx, sm, G, M - m, acc[0]);
                if (tiles == 2) tile_dot(w, wtype, K, t + 1, xm, ldx, sm, G, done, acc[1]);
            }
            for (int p = 0; p < tiles; p++) {
                int n0 = (t + p) * 16, width = N - n0 < 16 ? N - n0 : 16;
                for (int i = 0; i < done; i++) {
                    if (lora) acc[p][i] += lora_delta(lora, t + p, m + i);
                    float *o = out + (size_t)(m + i) * ldo + n0;
                    for (int r = 0; r < width; r++) {
                        float v = acc[p][i][r] + (bias ? bias[n0 + r] : 0.0f);
                        o[r] = mode == OUT_ADD ? o[r] + alpha * v : v;
                    }
                }
            }
            m += done;
        }
        t += tiles;
    }
}

/* The gate's activation over 16 lanes: silu(g) = g / (1 + e^-g), or GELU's tanh form
 * 0.5 g (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3), written g / (1 + e^-2z) (the
 * same function; no cancellation at 1 + tanh(z) ~ 0), times up. */
static inline f32x16 gated16(f32x16 g, f32x16 u, int act) {
    f32x16 t = act == ACT_GELU_TANH ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
    return g / (exp16(-t) + 1.0f) * u;
}

/* act[m, j] = act(gate[m, j]) * up[m, j] for the 16-wide columns [j0, j1): gate/up tiles
 * interleaved (tile 2j, 2j + 1; the dense MLP's), or in two halves (j, I / 16 + j: a GGUF
 * expert's, as `pack_quantized` keeps it). `lora` (NULL: none): the adapter deltas of the
 * [gate | up] rows, added before the activation. */
static void amx_gate_up_tiles(const uint16_t *w, int K, const float *x, int ldx, int M,
                              float *act, int I, int j0, int j1, int kind,
                              const struct tl_lora_rows *lora, uint16_t *xb);

static void gate_up_tiles(const void *w, int wtype, int K, const float *x, int ldx, int M,
                          const float *xsum, float *act, int I, int j0, int j1, int kind,
                          int interleaved, const struct tl_lora_rows *lora, uint16_t *xb) {
    if (wtype == TL_BF16_AMX) { /* always interleaved: `amx_tiles` packs dense MLPs only */
        amx_gate_up_tiles((const uint16_t *)w, K, x, ldx, M, act, I, j0, j1, kind, lora, xb);
        return;
    }
    f32x16 g[MAX_ROWS], u[MAX_ROWS];
    const int G = wtype == TL_Q4 ? K / 32 : 0, dense = wtype == TL_F32 || wtype == TL_BF16;
    for (int j = j0; j < j1; j++) {
        const int gt = interleaved ? 2 * j : j, ut = interleaved ? 2 * j + 1 : I / 16 + j;
        for (int m = 0; m < M;) {
            const float *xm = x + (size_t)m * ldx, *sm = xsum ? xsum + (size_t)m * G : NULL;
            int done;
            if (interleaved && dense && M - m >= 4) {
                int fetch = m == 0 && j + 1 < j1; /* the first block: see pair_dot */
                done = pair_dot(w, wtype, K, gt, xm, ldx, M - m, g, u, fetch);
            } else {
                done = tile_dot(w, wtype, K, gt, xm, ldx, sm, G, M - m, g);
                tile_dot(w, wtype, K, ut, xm, ldx, sm, G, done, u);
            }
            for (int i = 0; lora && i < done; i++) {
                g[i] += lora_delta(lora, j, m + i);
                u[i] += lora_delta(lora, I / 16 + j, m + i);
            }
            for (int i = 0; i < done; i++) {
                f32x16 a = gated16(g[i], u[i], kind);
                memcpy(act + (size_t)(m + i) * I + j * 16, &a, sizeof a);
            }
            m += done;
        }
    }
}

/* `linear_tiles` over AMX tiles (`tl_amx.h`): the tokens rounded to bfloat16 into this
 * thread's `xb` (`amx_rows(M)` x K), then tile pairs against blocks of 32 tokens, each block's
 * sums finished as the FMA path finishes its accumulators (LoRA delta, bias, store or add). */
static void amx_linear_tiles(const uint16_t *w, int K, int N, const float *bias, const float *x,
                             int ldx, int M, float *out, int ldo, int mode, float alpha, int t0,
                             int t1, const struct tl_lora_rows *lora, uint16_t *xb) {
    if (t0 >= t1) return;
    float c[2][AMX_ROWS][16] __attribute__((aligned(64)));
    amx_activations(x, ldx, M, K, xb);
    amx_configure();
    for (int t = t0; t < t1; t += 2) {
        const int pair = t + 1 < t1 ? 2 : 1;
        for (int m = 0; m < M; m += AMX_ROWS) {
            const int rows = M - m < AMX_ROWS ? M - m : AMX_ROWS;
            amx_block(w, K, t, pair, xb + (size_t)m * K, rows, c);
            for (int p = 0; p < pair; p++) {
                const int n0 = (t + p) * 16, width = N - n0 < 16 ? N - n0 : 16;
                const f32x16 b = bias && width == 16 ? load_f32(bias + n0) : (f32x16){0};
                for (int i = 0; i < rows; i++) {
                    f32x16 v = load_f32(c[p][i]);
                    if (lora) v += lora_delta(lora, t + p, m + i);
                    float *o = out + (size_t)(m + i) * ldo + n0;
                    if (width == 16) { /* a whole tile: vector stores (scalar: 4 ms a step) */
                        v += b;
                        if (mode == OUT_ADD) v = load_f32(o) + alpha * v;
                        memcpy(o, &v, sizeof v);
                        continue;
                    }
                    for (int r = 0; r < width; r++) {
                        float y = v[r] + (bias ? bias[n0 + r] : 0.0f);
                        o[r] = mode == OUT_ADD ? o[r] + alpha * y : y;
                    }
                }
            }
        }
    }
}

/* `gate_up_tiles` over AMX tiles: gate tile 2j and up tile 2j + 1 are one pair. */
static void amx_gate_up_tiles(const uint16_t *w, int K, const float *x, int ldx, int M,
                              float *act, int I, int j0, int j1, int kind,
                              const struct tl_lora_rows *lora, uint16_t *xb) {
    if (j0 >= j1) return;
    float c[2][AMX_ROWS][16] __attribute__((aligned(64)));
    amx_activations(x, ldx, M, K, xb);
    amx_configure();
    for (int j = j0; j < j1; j++)
        for (int m = 0; m < M; m += AMX_ROWS) {
            const int rows = M - m < AMX_ROWS ? M - m : AMX_ROWS;
            amx_block(w, K, 2 * j, 2, xb + (size_t)m * K, rows, c);
            for (int i = 0; i < rows; i++) {
                f32x16 g = load_f32(c[0][i]), u = load_f32(c[1][i]);
                if (lora) {
                    g += lora_delta(lora, j, m + i);
                    u += lora_delta(lora, I / 16 + j, m + i);
                }
                f32x16 a = gated16(g, u, kind);
                memcpy(act + (size_t)(m + i) * I + j * 16, &a, sizeof a);
            }
        }
}

#endif

/* trillm C kernels: products over tiled weights (float32, bfloat16, Q4, Q8 tiles). */
#ifndef TL_LINEAR_H
#define TL_LINEAR_H

#include "tl_amx.h"
#include "tl_lora.h"
#include "tl_narrow.h"
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

/* Two adjacent tiles (w1 = w0 + K * 16) against ROWS tokens over k0 <= k < k1: each x[k]
 * broadcast feeds both tiles' FMAs (at 12 tokens 24 FMAs cost 14 loads). The sums s0 (tile
 * w0) and s1 (w1) carry on from the span before (from 0 at k0 == 0): one chain per token and
 * tile, adding in the order of k, as one span over all of K would. `pf` (NULL: none): fetched
 * as it goes, one row of it and of the tile K * 16 elements after it every `every` k. */
#define DEFINE_PAIR_SPAN(NAME, WT, LOAD, ROWS)                                                \
    static inline void NAME(const WT *w0, int K, int k0, int k1, const float *x, int ldx,   \
                            f32x16 *s0, f32x16 *s1, const WT *pf, int every) {               \
        const WT *w1 = w0 + (size_t)K * 16;                                                   \
        f32x16 a[ROWS], b[ROWS];                                                              \
        for (int i = 0; i < ROWS; i++) {                                                      \
            a[i] = k0 ? s0[i] : (f32x16){0};                                                  \
            b[i] = k0 ? s1[i] : (f32x16){0};                                                  \
        }                                                                                     \
        if (pf) {                                                                             \
            for (int k = k0, due = k0; k < k1; k++) {                                         \
                if (k == due) {                                                               \
                    __builtin_prefetch(pf, 0, 3);                                             \
                    __builtin_prefetch(pf + (size_t)K * 16, 0, 3);                            \
                    pf += 16;                                                                 \
                    due += every;                                                             \
                }                                                                             \
                PAIR_STEP(LOAD, ROWS);                                                        \
            }                                                                                 \
        } else {                                                                              \
            for (int k = k0; k < k1; k++) PAIR_STEP(LOAD, ROWS);                              \
        }                                                                                     \
        for (int i = 0; i < ROWS; i++) {                                                      \
            s0[i] = a[i];                                                                     \
            s1[i] = b[i];                                                                     \
        }                                                                                     \
    }

#define PAIR_STEP(LOAD, ROWS)                                                                 \
    do {                                                                                      \
        f32x16 u = LOAD(w0 + (size_t)k * 16), v = LOAD(w1 + (size_t)k * 16);                  \
        for (int i = 0; i < ROWS; i++) {                                                      \
            float xv = x[i * ldx + k];                                                        \
            a[i] += u * xv;                                                                   \
            b[i] += v * xv;                                                                   \
        }                                                                                     \
    } while (0)

#define PAIR_KC 128     /* k of a pair a span covers: 16 KB of float32 rows, held in L1 */
#define PAIR_FETCH 192  /* the rows a span fetches start this many k past its own */
#define PAIR_TOKENS 64  /* tokens a `pair_rows` call takes: its sums are 2 x 64 x 64 bytes */

/* The block of tokens a pair's pass takes next, of `left`: as many as the registers hold,
 * but 16 as 8 + 8 (M=16: 0.78x of before's time, against 0.82-0.83x as 12 + 4). */
static inline int pair_block(int left) {
    if (left >= 12 && left != 16 && MAX_ROWS >= 8) return 12; /* 24 of 32 registers */
    if (left >= 8 && MAX_ROWS >= 8) return 8;
    return left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

/* Tiles t and t + 1 (w0, and the tile after it) against `rows` tokens, PAIR_TOKENS at most;
 * returns how many it did. K-blocked: PAIR_KC k of the pair against every block of tokens in
 * turn (M = 32: 12 + 12 + 8), so a weight row comes from memory for the first block and from
 * L1 for the others. The blocks share the fetch of the rows PAIR_FETCH k on (each its part,
 * a row every `blocks` k), so memory streams at one rate through the pass; with `more`
 * (tiles t + 2, t + 3 exist, next in memory) the fetch runs on into them.
 *
 * Before, each block of 8 tokens ran all of K: the pair (up to 196 KB) came from memory in a
 * burst during the first block, which also fetched all of the next pair, and from L2 for the
 * others. SmolLM2-135M's 120 float32 linears, one thread, CPU time, two alternated runs of
 * each (`linear_bench.py --tiled --threads 1 --cpu-time`, a busy machine), before -> after:
 * M=16 47.8, 51.1 -> 42.6, 42.1 ms; M=32 70.8, 76.6 -> 58.1, 60.4 (0.87x oneDNN's time ->
 * 0.68x); M=64 124.5, 119.1 -> 105.7, 113.1; M=8 within 5%, M=1 (one tile a token) as was.
 * The B=32 decode step's products with the LM head (`decode_profile.py --split --batch 32
 * --threads 1 --cpu-time`): 98.5, 97.2 ms (56-58% of the FMA peak) -> 79.8, 75.0 (69-73%). */
#define DEFINE_PAIR_ROWS(SUFFIX, WT, LOAD)                                                    \
    DEFINE_PAIR_SPAN(span12_##SUFFIX, WT, LOAD, 12)                                           \
    DEFINE_PAIR_SPAN(span8_##SUFFIX, WT, LOAD, 8)                                             \
    DEFINE_PAIR_SPAN(span4_##SUFFIX, WT, LOAD, 4)                                             \
    DEFINE_PAIR_SPAN(span2_##SUFFIX, WT, LOAD, 2)                                             \
    DEFINE_PAIR_SPAN(span1_##SUFFIX, WT, LOAD, 1)                                             \
    static int pair_rows_##SUFFIX(const WT *w0, int K, const float *x, int ldx, int rows,   \
                                  f32x16 *s0, f32x16 *s1, int more) {                        \
        if (rows > PAIR_TOKENS) rows = PAIR_TOKENS;                                           \
        int blocks = 0;                                                                       \
        for (int m = 0; m < rows; blocks++) m += pair_block(rows - m);                        \
        for (int k0 = 0; k0 < K; k0 += PAIR_KC) {                                             \
            const int k1 = K - k0 < PAIR_KC ? K : k0 + PAIR_KC, kp = k0 + PAIR_FETCH;        \
            const int share = (k1 - k0 + blocks - 1) / blocks;                                \
            const WT *pf = kp < K                ? w0 + (size_t)kp * 16                       \
                           : more && kp < 2 * K ? w0 + (size_t)(K + kp) * 16                  \
                                                : NULL;                                       \
            for (int m = 0, n; m < rows; m += n, pf = pf ? pf + (size_t)share * 16 : NULL) { \
                const float *xm = x + (size_t)m * ldx;                                        \
                f32x16 *a = s0 + m, *b = s1 + m;                                              \
                switch (n = pair_block(rows - m)) {                                           \
                case 12: span12_##SUFFIX(w0, K, k0, k1, xm, ldx, a, b, pf, blocks); break;   \
                case 8: span8_##SUFFIX(w0, K, k0, k1, xm, ldx, a, b, pf, blocks); break;     \
                case 4: span4_##SUFFIX(w0, K, k0, k1, xm, ldx, a, b, pf, blocks); break;     \
                case 2: span2_##SUFFIX(w0, K, k0, k1, xm, ldx, a, b, pf, blocks); break;     \
                default: span1_##SUFFIX(w0, K, k0, k1, xm, ldx, a, b, pf, blocks);           \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        return rows;                                                                          \
    }

DEFINE_PAIR_ROWS(f32, float, load_f32)
DEFINE_PAIR_ROWS(bf16, uint16_t, load_bf16)


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

/* Tiles t and t + 1 of a dense (float32 / bfloat16) weight against `rows` tokens (see
 * DEFINE_PAIR_ROWS); returns how many it did. `more`: tiles t + 2 and t + 3 exist, and are
 * fetched as the pair ends. */
static int pair_dot(const void *w, int wtype, int K, int t, const float *x, int ldx, int rows,
                    f32x16 *acc0, f32x16 *acc1, int more) {
    const size_t at = (size_t)t * K * 16;
    if (wtype == TL_BF16)
        return pair_rows_bf16((const uint16_t *)w + at, K, x, ldx, rows, acc0, acc1, more);
    return pair_rows_f32((const float *)w + at, K, x, ldx, rows, acc0, acc1, more);
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

#include "tl_narrow_linear.h"

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
#ifdef TL_NARROW
    nlinear_tiles(w, wtype, K, N, bias, x, ldx, M, xsum, out, ldo, mode, alpha, t0, t1, lora);
    return;
#endif
    f32x16 acc[2][PAIR_TOKENS];
    const int G = wtype == TL_Q4 ? K / 32 : 0, dense = wtype == TL_F32 || wtype == TL_BF16;
    for (int t = t0; t < t1;) {
        int tiles = dense && M >= 4 && t + 1 < t1 ? 2 : 1; /* a pair: see DEFINE_PAIR_ROWS */
        for (int m = 0; m < M;) {
            const float *xm = x + (size_t)m * ldx, *sm = xsum ? xsum + (size_t)m * G : NULL;
            int done;
            if (tiles == 2 && M - m >= 4) {
                int more = m == 0 && t + 3 < t1; /* the next pair: the first pass fetches it */
                done = pair_dot(w, wtype, K, t, xm, ldx, M - m, acc[0], acc[1], more);
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
#ifdef TL_NARROW
    ngate_up_tiles(w, wtype, K, x, ldx, M, xsum, act, I, j0, j1, kind, interleaved, lora);
    return;
#endif
    f32x16 g[PAIR_TOKENS], u[PAIR_TOKENS];
    const int G = wtype == TL_Q4 ? K / 32 : 0, dense = wtype == TL_F32 || wtype == TL_BF16;
    for (int j = j0; j < j1; j++) {
        const int gt = interleaved ? 2 * j : j, ut = interleaved ? 2 * j + 1 : I / 16 + j;
        for (int m = 0; m < M;) {
            const float *xm = x + (size_t)m * ldx, *sm = xsum ? xsum + (size_t)m * G : NULL;
            int done;
            if (interleaved && dense && M - m >= 4) {
                int more = m == 0 && j + 1 < j1; /* the next pair: the first pass fetches it */
                done = pair_dot(w, wtype, K, gt, xm, ldx, M - m, g, u, more);
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

#include "tl_linear_amx.h"

#endif

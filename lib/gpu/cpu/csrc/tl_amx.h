/* trillm C kernels: bfloat16 products on AMX tiles (Intel Sapphire Rapids and later).
 *
 * Why: a bfloat16 decode step of 32 tokens is a batch of small products (M = 32 against
 * SmolLM2's 576..3072-row weights). The C step's bfloat16 tiles widen each weight to float32
 * and run FMAs: 16 multiply-adds per instruction. oneDNN's AMX products (the torch forward)
 * were faster at 24 and more tokens, but they still took 20.7 ms for the 120 linears at
 * M = 32, 2.8x the time of reading the weights once (perf/linear_bench.py), and the torch
 * forward around them cost another 25 ms of attention and host work a step
 * (decode_profile.py --split --dtype bfloat16 --batch 32). One tile product here is
 * 16 x 16 x 32 multiply-adds, so the step's products are bound by the weight stream again,
 * inside the one C call.
 *
 * Layout (`TL_BF16_AMX`, lib/gpu/cpu/_tiles.py `amx_tiles`): the 16 output rows of a tile, per
 * chunk of 32 k, as the tile unit's B operand: 16 rows of 64 bytes, row r holding the 16
 * outputs' weights at k = 2r and 2r + 1 side by side ("VNNI" pairs). A tile is K / 32 such
 * 1 KiB blocks in k order, so a product streams it once; K % 32 == 0 (Python keeps other
 * weights in `TL_BF16`). The tokens are the A operand: the step's float32 activations rounded
 * to bfloat16 (as torch's bfloat16 forward holds them), 16 tokens a tile; products accumulate
 * in float32 tiles.
 *
 * Where the compiler or the CPU has no AMX, or the kernel refuses the tile state, the same
 * layout is read by AVX512_BF16's `vdpbf16ps` where the build has it (`dp_block`: AMD Zen 4,
 * Intel Cooper Lake), else by plain C (tests build it), and Python keeps to `TL_BF16` there
 * (`trillm_pair_products`). Why `vdpbf16ps`: on a 2-core Zen 4 (no AMX) the FMA tiles took
 * 43.8 ms for SmolLM2's 120 linears at M = 32, this 22.9, oneDNN's bfloat16 22.4
 * (`perf/linear_bench.py --tiled --amx`), and the B=32 decode step went 64.2 -> 38.1 ms.
 */
#ifndef TL_AMX_H
#define TL_AMX_H

#include "tl_norm.h"
#include "tl_vec.h"

#define AMX_ROWS 32 /* tokens a block: two A tiles */

/* Rows of `amx_activations`' buffer for M tokens: whole tiles of 16, as the tile loads read. */
static inline int amx_rows(int M) { return (M + 15) / 16 * 16; }

/* xb [amx_rows(M)][K] = x [M][ldx] rounded to bfloat16 as torch rounds (`store_bf16`), padding
 * rows zero. K % 32 == 0. */
static void amx_activations(const float *x, int ldx, int M, int K, uint16_t *xb) {
    for (int m = 0; m < amx_rows(M); m++) {
        uint16_t *row = xb + (size_t)m * K;
        if (m >= M) {
            memset(row, 0, sizeof(uint16_t) * (size_t)K);
            continue;
        }
        for (int k = 0; k < K; k += 16) store_bf16(row + k, load_f32(x + (size_t)m * ldx + k));
    }
}

/* The layout read by plain C: a build without AMX (tests run one), or a process the kernel
 * refused the tile state. */
static void amx_block_c(const uint16_t *w, int K, int t, int pair, const uint16_t *xb, int rows,
                        float c[2][AMX_ROWS][16]) {
    for (int p = 0; p < pair; p++) {
        const uint16_t *wt = w + (size_t)(t + p) * K * 16;
        for (int i = 0; i < rows; i++)
            for (int n = 0; n < 16; n++) {
                float s = 0.0f;
                for (int k = 0; k < K; k++) /* chunk k / 32, pair row (k % 32) / 2, lane k % 2 */
                    s += bf16_to_f32(xb[(size_t)i * K + k]) *
                         bf16_to_f32(wt[(size_t)(k / 32) * 512 + (k % 32) / 2 * 32 + n * 2 + k % 2]);
                c[p][i][n] = s;
            }
    }
}

#if defined(__AVX512BF16__)
#define TL_DP_PRODUCTS 1

/* Token block `xb` (ROWS rows of K bfloat16, pairs read as one 32-bit word) against tile w0
 * (and w1 when PAIR): per k pair the 16 outputs' weights are one register, each token's pair
 * is broadcast, and one `vdpbf16ps` adds both products (32 of them: twice an FMA's). Blocks of
 * 1-2 tokens keep two chains a tile (even and odd pairs) to hide the instruction's latency.
 * `pf_lines` 64-byte lines from `pf` are fetched into L2 as it goes, two a k pair (`dp_block`
 * says why). */
#define DEFINE_DP_BLOCK(NAME, ROWS, PAIR)                                                    \
    static inline void NAME(const uint16_t *w0, const uint16_t *w1, int K, const uint16_t *xb, \
                            float c[2][AMX_ROWS][16], int i0, const char *pf, int pf_lines) { \
        enum { CH = ROWS < 4 ? 2 : 1 };                                                      \
        __m512 a[CH][ROWS], b[CH][ROWS];                                                     \
        for (int h = 0; h < CH; h++)                                                         \
            for (int i = 0; i < ROWS; i++) a[h][i] = b[h][i] = _mm512_setzero_ps();          \
        const int KP = K / 2;                                                                \
        const uint32_t *x32 = (const uint32_t *)xb;                                          \
        for (int kp = 0; kp < KP; kp += CH) {                                                \
            if (pf_lines > 0) {                                                              \
                __builtin_prefetch(pf, 0, 2);                                                \
                __builtin_prefetch(pf + 64, 0, 2);                                           \
                pf += 128;                                                                   \
                pf_lines -= 2;                                                               \
            }                                                                                \
            for (int h = 0; h < CH; h++) {                                                   \
                const __m512bh u0 = (__m512bh)_mm512_loadu_si512(w0 + (size_t)(kp + h) * 32); \
                const __m512bh u1 =                                                          \
                    PAIR ? (__m512bh)_mm512_loadu_si512(w1 + (size_t)(kp + h) * 32) : u0;    \
                for (int i = 0; i < ROWS; i++) {                                             \
                    const __m512bh xv =                                                      \
                        (__m512bh)_mm512_set1_epi32((int)x32[(size_t)i * KP + kp + h]);      \
                    a[h][i] = _mm512_dpbf16_ps(a[h][i], xv, u0);                             \
                    if (PAIR) b[h][i] = _mm512_dpbf16_ps(b[h][i], xv, u1);                   \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int i = 0; i < ROWS; i++) {                                                     \
            __m512 s = CH == 2 ? _mm512_add_ps(a[0][i], a[CH - 1][i]) : a[0][i];             \
            _mm512_store_ps(c[0][i0 + i], s);                                                \
            if (PAIR) {                                                                      \
                s = CH == 2 ? _mm512_add_ps(b[0][i], b[CH - 1][i]) : b[0][i];                \
                _mm512_store_ps(c[1][i0 + i], s);                                            \
            }                                                                                \
        }                                                                                    \
    }

/* Tile pairs from 4 tokens (12: 2 x 12 sums, 2 weight rows, a broadcast: 27 of 32
 * registers); single tiles at every width (under 4 tokens a pair goes one tile after the
 * other, see `dp_block`). */
DEFINE_DP_BLOCK(dp_pair_12, 12, 1)
DEFINE_DP_BLOCK(dp_pair_8, 8, 1)
DEFINE_DP_BLOCK(dp_pair_4, 4, 1)
DEFINE_DP_BLOCK(dp_tile_12, 12, 0)
DEFINE_DP_BLOCK(dp_tile_8, 8, 0)
DEFINE_DP_BLOCK(dp_tile_4, 4, 0)
DEFINE_DP_BLOCK(dp_tile_2, 2, 0)
DEFINE_DP_BLOCK(dp_tile_1, 1, 0)

/* Tokens of `dp_block`'s next block, of `left` still to do. */
static inline int dp_rows(int left) {
    return left >= 12 ? 12 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

/* `amx_block`'s products by `vdpbf16ps` (AVX512_BF16 without AMX: AMD Zen 4, Intel Cooper
 * Lake), 12 tokens a pass over the tiles; K % 32 == 0 keeps every pair whole. Under 4 tokens
 * the step is the weights' read: a pair's tiles one after the other, one sequential stream
 * for the hardware's prefetch (both at once, with or without software prefetch, was slower
 * than the FMA tiles at M = 1; this way level: perf/README.md).
 *
 * From 20 tokens the passes after the first fetch the next tile pair into L2, shared out
 * among them: the first pass reads this pair from memory while the later ones read it from
 * L2, so without it the weight stream stalls the first pass and idles in the others. The
 * 120 linears took 0.88-0.93x the time at M = 20-32 and 0.96x at 64
 * (`linear_bench.py --tiled --amx --base`); at 16 (passes of 12 and 4) the short second pass
 * cannot hide a whole pair and it was slower. The pair after the last is past the weight:
 * a prefetch does not fault. */
static void dp_block(const uint16_t *w, int K, int t, int pair, const uint16_t *xb, int rows,
                     float c[2][AMX_ROWS][16]) {
    const uint16_t *w0 = w + (size_t)t * K * 16, *w1 = w0 + (size_t)K * 16;
    int passes = 0;
    for (int left = rows; left > 0; passes++) left -= dp_rows(left);
    const int lines = pair == 2 && rows >= 20 ? K * 16 * 2 * 2 / 64 : 0; /* of the next pair */
    const int share = passes > 1 ? (lines + passes - 2) / (passes - 1) : 0;
    const char *next = (const char *)(w0 + (size_t)2 * K * 16);
    for (int i = 0, pass = 0; i < rows; pass++) {
        const int n = dp_rows(rows - i), from = pass ? (pass - 1) * share : lines;
        const char *pf = next + (size_t)from * 64;
        const int pf_lines = from < lines ? (lines - from < share ? lines - from : share) : 0;
        const uint16_t *x = xb + (size_t)i * K;
#define DP_PAIR(R)                                                                \
    case R:                                                                       \
        if (pair == 2)                                                            \
            dp_pair_##R(w0, w1, K, x, c, i, pf, pf_lines);                        \
        else                                                                      \
            dp_tile_##R(w0, w0, K, x, c, i, NULL, 0);                             \
        break;
#define DP_TILES(R)                                                               \
    case R:                                                                       \
        dp_tile_##R(w0, w0, K, x, c, i, NULL, 0);                                 \
        if (pair == 2) dp_tile_##R(w1, w1, K, x, c + 1, i, NULL, 0); /* its c[1] */ \
        break;
        switch (n) {
            DP_PAIR(12)
            DP_PAIR(8)
            DP_PAIR(4)
            DP_TILES(2)
            DP_TILES(1)
        }
#undef DP_PAIR
#undef DP_TILES
        i += n;
    }
}
#endif

/* The products of the layout where no AMX runs: `vdpbf16ps` where built for AVX512_BF16, else
 * plain C. */
static inline void pairs_block(const uint16_t *w, int K, int t, int pair, const uint16_t *xb,
                               int rows, float c[2][AMX_ROWS][16]) {
#ifdef TL_DP_PRODUCTS
    dp_block(w, K, t, pair, xb, rows, c);
#else
    amx_block_c(w, K, t, pair, xb, rows, c);
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* Linux gives a process the tile registers' state only when it asks (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a tile instruction before that is SIGILL.
 * Asked once; every thread then sees the answer (a racing first call asks twice, harmlessly). */
static int amx_on(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return state;
}

struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Palette 1 with tiles 0 .. n - 1 of rows[i] rows x colsb[i] bytes. */
static inline void amx_load_config(int n, const uint8_t *rows, const uint16_t *colsb) {
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < n; i++) {
        c.rows[i] = rows[i];
        c.colsb[i] = colsb[i];
    }
    _tile_loadconfig(&c);
}

/* Eight tiles of 16 rows x 64 bytes: 0-3 the float32 sums (2 token tiles x 2 weight tiles),
 * 4-5 tokens, 6-7 weights. Loaded at each product: oneDNN's kernels on the same threads load
 * their own configuration. */
static inline void amx_configure(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    if (amx_on()) amx_load_config(8, rows, colsb);
}

#define AMX_LOOP(PAIR, TWO_ROWS)                                                             \
    for (int k = 0; k < K; k += 32) {                                                        \
        _tile_loadd(4, xb + k, ld);                                                          \
        _tile_loadd(6, w0 + (size_t)k * 16, 64);                                             \
        _tile_dpbf16ps(0, 4, 6);                                                             \
        if (PAIR) {                                                                          \
            _tile_loadd(7, w1 + (size_t)k * 16, 64);                                         \
            _tile_dpbf16ps(1, 4, 7);                                                         \
        }                                                                                    \
        if (TWO_ROWS) {                                                                      \
            _tile_loadd(5, xb + (size_t)16 * K + k, ld);                                     \
            _tile_dpbf16ps(2, 5, 6);                                                         \
            if (PAIR) _tile_dpbf16ps(3, 5, 7);                                               \
        }                                                                                    \
    }

/* c[p][i] = token i of xb . output row block t + p of w, for p < `pair` (1 or 2) and i <
 * `rows` (<= 32; rows past it are computed from xb's padding and not meant). */
static void amx_block(const uint16_t *w, int K, int t, int pair, const uint16_t *xb, int rows,
                      float c[2][AMX_ROWS][16]) {
    if (!amx_on()) {
        pairs_block(w, K, t, pair, xb, rows, c);
        return;
    }
    const uint16_t *w0 = w + (size_t)t * K * 16, *w1 = w0 + (size_t)K * 16;
    const size_t ld = (size_t)K * sizeof(uint16_t);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (pair == 2 && rows > 16) {
        AMX_LOOP(1, 1)
    } else if (pair == 2) {
        AMX_LOOP(1, 0)
    } else if (rows > 16) {
        AMX_LOOP(0, 1)
    } else {
        AMX_LOOP(0, 0)
    }
    _tile_stored(0, c[0][0], 64);
    if (pair == 2) _tile_stored(1, c[1][0], 64);
    if (rows > 16) {
        _tile_stored(2, c[0][16], 64);
        if (pair == 2) _tile_stored(3, c[1][16], 64);
    }
}

#else

static int amx_on(void) { return 0; }
static inline void amx_configure(void) {}

static void amx_block(const uint16_t *w, int K, int t, int pair, const uint16_t *xb, int rows,
                      float c[2][AMX_ROWS][16]) {
    pairs_block(w, K, t, pair, xb, rows, c);
}

#endif

/* 2 when AMX runs the layout's products, 1 when `vdpbf16ps` does, 0 when plain C reads it. */
static int pair_products(void) {
#ifdef TL_DP_PRODUCTS
    return amx_on() ? 2 : 1;
#else
    return amx_on() ? 2 : 0;
#endif
}

#endif

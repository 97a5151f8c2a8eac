/* trillm's CPU decode step: every decoder layer of a Llama-family model in one call.
 *
 * Why (lib/gpu/_cpu_decode.py has the whole story): around the weight reads of a batch-1
 * decode step the torch forward issued some 5,000 ops, 121 of them separate OpenMP regions,
 * and took nearly twice as long as this does (15.75 against 8.24 ms for SmolLM2 fp32). Here
 * the step is one OpenMP parallel region: per layer two RMS norms, three matrix-vector products
 * over the weights in a layout made for them, rotary, the KV cache write and paged attention,
 * with four barriers and no allocation.
 *
 * Weights are "tiled": output rows in tiles of 16, each tile stored k-major, so the 16 rows'
 * elements at one k are one 64-byte vector: out[tile] += w[tile][k] * x[k]. There is no
 * horizontal sum and one sequential stream per tile. The gate/up weight interleaves a gate
 * tile and the matching up tile, so SiLU(gate) * up is taken while both are in registers.
 * GGUF's Q4_0 / Q4_1 / Q8_0 weights stay quantized in tiles of the same 16 rows, per group of
 * 32 k (one GGUF block of each row): float16 scales (and minimums), then the quants k-major.
 * A Q4 group computes sum_k q x once per row and applies d and m per group:
 * sum_k (d q + m) x = d sum_k q x + m sum_k x.
 *
 * Built by lib/gpu/_native.py with -O3 -march=native -fopenmp; the vector types below become
 * AVX-512, AVX2 or SSE code as the CPU allows. OpenMP is the process's one libgomp (torch's,
 * already loaded), so these threads are torch's threads.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

#ifdef __AVX512F__
#define MAX_ROWS 8 /* tokens per register block: 16 accumulators of 32 registers */
#else
#define MAX_ROWS 4 /* AVX2: each f32x16 is two of 16 registers */
#endif

enum { TL_F32 = 0, TL_BF16 = 1, TL_Q4 = 2, TL_Q8 = 3 };
#define Q4_GROUP 320 /* bytes of a Q4 tile's 32-k group: d[16], m[16] float16, 256 of nibbles */
#define Q8_GROUP 544 /* bytes of a Q8 tile's 32-k group: d[16] float16, 32 x 16 int8 */

/* One decoder layer; weights tiled (see above) of the types `tqkv`..., norms and biases
 * float32. */
struct tl_layer {
    const float *ln1, *ln2;
    const void *wqkv, *wo, *wgu, *wd;
    const float *bqkv, *bo; /* NULL when the model has none */
    void *k_cache, *v_cache; /* [blocks, block_size, kv_heads, head_dim], cache_type */
    int32_t tqkv, to, tgu, td;
};

struct tl_model {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    int32_t cache_type;
    float eps, scale;
    const float *inv_freq; /* [head_dim / 2] */
};

static inline f32x16 load_f32(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline f32x16 load_bf16(const uint16_t *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    f32x16 v;
    memcpy(&v, &w, sizeof v);
    return v;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float hsum(f32x16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* exp over 16 lanes (Cephes' expf: 2^n * (1 + r + r^2 P(r)), |r| <= ln2 / 2; ~1 ulp). */
static inline f32x16 exp16(f32x16 x) {
    const f32x16 hi = (f32x16){0} + 88.3762626647949f, lo = (f32x16){0} - 87.3365447504019f;
    i32x16 over = x > hi, under = x < lo;
    x = (f32x16)(((i32x16)x & ~over) | ((i32x16)hi & over));
    x = (f32x16)(((i32x16)x & ~under) | ((i32x16)lo & under));
    const f32x16 magic = (f32x16){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds */
    f32x16 t = x * 1.44269504088896341f + magic;
    i32x16 n = (i32x16)t - (i32x16)magic;
    f32x16 nf = t - magic;
    f32x16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    f32x16 p = (f32x16){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (f32x16)((n + 127) << 23);
}

static inline float dot(const float *a, const float *b, int D) {
    f32x16 acc = {0};
    int i = 0;
    for (; i + 16 <= D; i += 16) acc += load_f32(a + i) * load_f32(b + i);
    float s = hsum(acc);
    for (; i < D; i++) s += a[i] * b[i];
    return s;
}

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
 * acc0 = tile w0, acc1 = tile w1. */
#define DEFINE_PAIR_DOT(NAME, WT, LOAD, ROWS)                                                 \
    static inline void NAME(const WT *w0, const WT *w1, int K, const float *x, int ldx,     \
                            f32x16 *acc0, f32x16 *acc1) {                                    \
        f32x16 a[ROWS], b[ROWS];                                                              \
        for (int i = 0; i < ROWS; i++) a[i] = b[i] = (f32x16){0};                             \
        for (int k = 0; k < K; k++) {                                                         \
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
                                 int rows, f32x16 *acc0, f32x16 *acc1) {                     \
        if (rows >= 8 && MAX_ROWS >= 8) {                                                     \
            pair8_##SUFFIX(w0, w1, K, x, ldx, acc0, acc1);                                    \
            return 8;                                                                         \
        }                                                                                     \
        pair4_##SUFFIX(w0, w1, K, x, ldx, acc0, acc1);                                        \
        return 4;                                                                             \
    }

DEFINE_PAIR_DOTS(f32, float, load_f32)
DEFINE_PAIR_DOTS(bf16, uint16_t, load_bf16)



static inline f32x16 load_f16(const uint16_t *p) {
    f32x16 v;
#if defined(__AVX512F__)
    __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&v, &w, sizeof v);
#elif defined(__F16C__)
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
#else
    for (int i = 0; i < 16; i++) { /* IEEE half -> float, subnormals included */
        uint32_t h = p[i], sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
        float f;
        if (exp == 0) {
            f = ldexpf((float)man, -24);
        } else if (exp == 31) {
            f = man ? NAN : INFINITY;
        } else {
            uint32_t bits = ((exp + 112) << 23) | (man << 13);
            memcpy(&f, &bits, sizeof f);
        }
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
        memcpy(&f, &bits, sizeof f);
        v[i] = f;
    }
#endif
    return v;
}

static inline f32x16 u8_to_f32(u8x16 b) {
    return __builtin_convertvector(__builtin_convertvector(b, i32x16), f32x16);
}

/* Through the unsigned widening (GCC scalarises a signed i8 -> i32 vector conversion):
 * q = (q ^ 0x80) - 128. */
static inline f32x16 i8_to_f32(i8x16 b) {
    return u8_to_f32((u8x16)b ^ 0x80) - 128.0f;
}

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
 * many tokens it did. */
static int pair_dot(const void *w, int wtype, int K, int t, const float *x, int ldx, int rows,
                    f32x16 *acc0, f32x16 *acc1) {
    size_t at = (size_t)t * K * 16, next = at + (size_t)K * 16;
    if (wtype == TL_BF16)
        return pair_dot_bf16((const uint16_t *)w + at, (const uint16_t *)w + next, K, x, ldx,
                             rows, acc0, acc1);
    return pair_dot_f32((const float *)w + at, (const float *)w + next, K, x, ldx, rows, acc0,
                        acc1);
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

/* out[m, n] (=|+=) x[m] . w[n] + bias[n] for the tiles [t0, t1) and every token m < M;
 * rows n >= N (the last tile's padding) are not written. `xsum`: `group_sums` of x (Q4). */
static void linear_tiles(const void *w, int wtype, int K, int N, const float *bias,
                         const float *x, int ldx, int M, const float *xsum, float *out, int ldo,
                         int mode, int t0, int t1) {
    f32x16 acc[2][MAX_ROWS];
    const int G = wtype == TL_Q4 ? K / 32 : 0, dense = wtype == TL_F32 || wtype == TL_BF16;
    for (int t = t0; t < t1;) {
        int tiles = dense && M >= 4 && t + 1 < t1 ? 2 : 1; /* a pair: see DEFINE_PAIR_DOT */
        for (int m = 0; m < M;) {
            const float *xm = x + (size_t)m * ldx, *sm = xsum ? xsum + (size_t)m * G : NULL;
            int done;
            if (tiles == 2 && M - m >= 4) {
                done = pair_dot(w, wtype, K, t, xm, ldx, M - m, acc[0], acc[1]);
            } else { /* one tile, or a pair's last 1-3 tokens one tile at a time */
                done = tile_dot(w, wtype, K, t, xm, ldx, sm, G, M - m, acc[0]);
                if (tiles == 2) tile_dot(w, wtype, K, t + 1, xm, ldx, sm, G, done, acc[1]);
            }
            for (int p = 0; p < tiles; p++) {
                int n0 = (t + p) * 16, width = N - n0 < 16 ? N - n0 : 16;
                for (int i = 0; i < done; i++) {
                    float *o = out + (size_t)(m + i) * ldo + n0;
                    for (int r = 0; r < width; r++) {
                        float v = acc[p][i][r] + (bias ? bias[n0 + r] : 0.0f);
                        o[r] = mode == OUT_ADD ? o[r] + v : v;
                    }
                }
            }
            m += done;
        }
        t += tiles;
    }
}

/* act[m, j] = silu(gate[m, j]) * up[m, j], gate/up tiles interleaved (tile 2j, 2j + 1). */
static void gate_up_tiles(const void *w, int wtype, int K, const float *x, int ldx, int M,
                          const float *xsum, float *act, int I, int j0, int j1) {
    f32x16 g[MAX_ROWS], u[MAX_ROWS];
    const int G = wtype == TL_Q4 ? K / 32 : 0;
    for (int j = j0; j < j1; j++) {
        for (int m = 0; m < M;) {
            const float *xm = x + (size_t)m * ldx, *sm = xsum ? xsum + (size_t)m * G : NULL;
            int done;
            if ((wtype == TL_F32 || wtype == TL_BF16) && M - m >= 4) {
                done = pair_dot(w, wtype, K, 2 * j, xm, ldx, M - m, g, u);
            } else {
                done = tile_dot(w, wtype, K, 2 * j, xm, ldx, sm, G, M - m, g);
                tile_dot(w, wtype, K, 2 * j + 1, xm, ldx, sm, G, done, u);
            }
            for (int i = 0; i < done; i++) {
                f32x16 silu = g[i] / (exp16(-g[i]) + 1.0f) * u[i];
                memcpy(act + (size_t)(m + i) * I + j * 16, &silu, sizeof silu);
            }
            m += done;
        }
    }
}

static void rms_norm(const float *x, const float *weight, int H, float eps, float *out) {
    float inv = 1.0f / sqrtf(dot(x, x, H) / (float)H + eps);
    for (int i = 0; i < H; i++) out[i] = weight[i] * (x[i] * inv);
}

/* Rotate-half RoPE of one head: out[i] = x[i] cos[i] + x[i +- D/2] (-+ sin[i]). */
static void rotate(const float *x, const float *cos_, const float *sin_, int D, float *out) {
    int h = D / 2;
    for (int i = 0; i < h; i++) {
        out[i] = x[i] * cos_[i] - x[i + h] * sin_[i];
        out[i + h] = x[i + h] * cos_[i] + x[i] * sin_[i];
    }
}

/* Key or value `j` of kv head `g` from the cache, as float32 into `buf` (or in place). */
static inline const float *cache_row(const void *cache, int ctype, const int32_t *table, int j,
                                     int B, int Hkv, int g, int D, float *buf) {
    size_t off = ((size_t)table[j / B] * B + (size_t)(j % B)) * Hkv * D + (size_t)g * D;
    if (ctype == TL_F32) return (const float *)cache + off;
    const uint16_t *h = (const uint16_t *)cache + off;
    for (int i = 0; i < D; i++) buf[i] = bf16_to_f32(h[i]);
    return buf;
}

static void cache_store(void *cache, int ctype, int64_t slot, int Hkv, int g, int D,
                        const float *x) {
    size_t off = (size_t)slot * Hkv * D + (size_t)g * D;
    if (ctype == TL_F32) {
        memcpy((float *)cache + off, x, sizeof(float) * (size_t)D);
        return;
    }
    uint16_t *h = (uint16_t *)cache + off;
    for (int i = 0; i < D; i++) h[i] = f32_to_bf16(x[i]);
}

/* One query head against its sequence's `ctx - 1` cached keys and the new key (k, v):
 * online softmax over chunks of 64 keys. `work`: 64 + 2 * D floats. */
static void attend(const float *q, const float *k, const float *v, const void *kc,
                   const void *vc, int ctype, const int32_t *table, int ctx, int B, int Hkv,
                   int g, int D, float scale, float *out, float *work) {
    float *scores = work, *kbuf = work + 64, *vbuf = work + 64 + D;
    float run_max = -INFINITY, run_sum = 0.0f;
    for (int i = 0; i < D; i++) out[i] = 0.0f;
    for (int j0 = 0; j0 < ctx; j0 += 64) {
        int n = ctx - j0 < 64 ? ctx - j0 : 64;
        float chunk_max = -INFINITY;
        for (int c = 0; c < n; c++) {
            int j = j0 + c;
            const float *key = j == ctx - 1 ? k : cache_row(kc, ctype, table, j, B, Hkv, g, D, kbuf);
            scores[c] = dot(q, key, D) * scale;
            chunk_max = scores[c] > chunk_max ? scores[c] : chunk_max;
        }
        float new_max = chunk_max > run_max ? chunk_max : run_max;
        float rescale = expf(run_max - new_max);
        run_sum *= rescale;
        for (int i = 0; i < D; i++) out[i] *= rescale;
        for (int c = 0; c < n; c += 16) {
            f32x16 p = exp16(load_f32(scores + c) - new_max);
            memcpy(scores + c, &p, sizeof p);
        }
        for (int c = 0; c < n; c++) {
            int j = j0 + c;
            float p = scores[c];
            run_sum += p;
            const float *val = j == ctx - 1 ? v : cache_row(vc, ctype, table, j, B, Hkv, g, D, vbuf);
            for (int i = 0; i < D; i++) out[i] += p * val[i];
        }
        run_max = new_max;
    }
    float inv = 1.0f / run_sum;
    for (int i = 0; i < D; i++) out[i] *= inv;
}

#define MAX_GROUP 16 /* query heads per kv head the grouped path takes (Python checks) */
#define WORK_FLOATS(D) (64 + (5 + 2 * 16 + MAX_GROUP) * (D)) /* a thread's attention work */

/* r[c] = the sum of v[c]'s lanes, for 16 vectors: a tree of 15 shuffle-adds instead of 16
 * horizontal sums. After level k each vector holds 16 >> k partial sums of 2^k inputs. */
static inline f32x16 reduce16(const f32x16 *v) {
    f32x16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                       24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                       21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                       19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                   26, 28, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                   27, 29, 31);
}

/* The `group` query heads `q` [group][D] of one kv head against its sequence's `ctx - 1`
 * cached keys and the new key (k, v), 16 keys at a time: each key is read once for the
 * whole group, its 16 scores come out of one `reduce16`, online softmax per head. D % 16 ==
 * 0. `out` [group][D]; `work`: WORK_FLOATS(D). */
static void attend_group(const float *q, int group, const float *k, const float *v,
                         const void *kc, const void *vc, int ctype, const int32_t *table,
                         int ctx, int B, int Hkv, int g, int D, float scale, float *out,
                         float *work) {
    float *kbuf = work, *vbuf = work + 16 * D, *zeros = work + 32 * D;
    float run_max[MAX_GROUP], run_sum[MAX_GROUP];
    for (int hh = 0; hh < group; hh++) {
        run_max[hh] = -INFINITY;
        run_sum[hh] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)group * D);
    memset(zeros, 0, sizeof(float) * (size_t)D);
    const size_t row = (size_t)Hkv * D;
    for (int j0 = 0; j0 < ctx; j0 += 16) {
        int n = ctx - j0 < 16 ? ctx - j0 : 16;
        const float *kp[16], *vp[16];
        for (int c = 0; c < 16; c++) { /* keys past the context read zeros, weigh 0 */
            int j = j0 + c;
            if (c >= n) {
                kp[c] = vp[c] = zeros;
            } else if (j == ctx - 1) {
                kp[c] = k;
                vp[c] = v;
            } else {
                size_t off = ((size_t)table[j / B] * B + (size_t)(j % B)) * row + (size_t)g * D;
                if (ctype == TL_F32) {
                    kp[c] = (const float *)kc + off;
                    vp[c] = (const float *)vc + off;
                } else {
                    const uint16_t *kh = (const uint16_t *)kc + off;
                    const uint16_t *vh = (const uint16_t *)vc + off;
                    for (int i = 0; i < D; i += 16) {
                        f32x16 kv = load_bf16(kh + i), vv = load_bf16(vh + i);
                        memcpy(kbuf + c * D + i, &kv, sizeof kv);
                        memcpy(vbuf + c * D + i, &vv, sizeof vv);
                    }
                    kp[c] = kbuf + c * D;
                    vp[c] = vbuf + c * D;
                }
            }
        }
        const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        const i32x16 valid = lane < n;
        for (int hh = 0; hh < group; hh++) {
            const float *qh = q + (size_t)hh * D;
            f32x16 acc[16];
            for (int c = 0; c < 16; c++) acc[c] = (f32x16){0};
            for (int i = 0; i < D; i += 16) {
                f32x16 qv = load_f32(qh + i);
                for (int c = 0; c < 16; c++) acc[c] += qv * load_f32(kp[c] + i);
            }
            f32x16 scores = reduce16(acc) * scale;
            const f32x16 minus_inf = (f32x16){0} - INFINITY;
            scores = (f32x16)(((i32x16)scores & valid) | ((i32x16)minus_inf & ~valid));
            float chunk_max = -INFINITY;
            for (int c = 0; c < 16; c++) chunk_max = scores[c] > chunk_max ? scores[c] : chunk_max;
            float new_max = chunk_max > run_max[hh] ? chunk_max : run_max[hh];
            float rescale = expf(run_max[hh] - new_max);
            f32x16 p = (f32x16)((i32x16)exp16(scores - new_max) & valid);
            run_sum[hh] = run_sum[hh] * rescale + hsum(p);
            float *oh = out + (size_t)hh * D;
            for (int i = 0; i < D; i += 16) {
                f32x16 o = load_f32(oh + i) * rescale;
                for (int c = 0; c < 16; c++) o += p[c] * load_f32(vp[c] + i);
                memcpy(oh + i, &o, sizeof o);
            }
            run_max[hh] = new_max;
        }
    }
    for (int hh = 0; hh < group; hh++) {
        float inv = 1.0f / run_sum[hh];
        for (int i = 0; i < D; i++) out[(size_t)hh * D + i] *= inv;
    }
}

static void split(int n, int tid, int nt, int *lo, int *hi) {
    *lo = (int)((int64_t)n * tid / nt);
    *hi = (int)((int64_t)n * (tid + 1) / nt);
}

/* Floats of scratch `trillm_decode` needs for M tokens on `threads` threads. */
/* The attention of tasks [t0, t1) of `num_attention_tasks`: rotate the queries and the
 * new key (`cos_`/`sin_` rows of `rope_stride`, the first head_dim / 2 used), store the new
 * K/V at the token's slot, attend over the cache and the new key. With head_dim % 16 == 0 a
 * task is a token's kv head and its query group (`attend_group`), else a token's query head
 * (`attend`). `qkv` [M, q + 2 kv], `out` [M, q]; `work`: WORK_FLOATS(head_dim). */
static void attention_tasks(const struct tl_model *md, void *k_cache, void *v_cache,
                            const float *qkv, const float *cos_, const float *sin_,
                            int rope_stride, const int64_t *slots, const int32_t *tables,
                            int table_stride, const int32_t *context_lens, float *out, int t0,
                            int t1, float *work) {
    const int D = md->head_dim, NH = md->num_heads, NKV = md->num_kv_heads, group = NH / NKV;
    const int Q = NH * D, KV = NKV * D, NQKV = Q + 2 * KV, grouped = D % 16 == 0;
    float *attn_work = work + (4 + MAX_GROUP) * D, *qrot = work, *krot = work + MAX_GROUP * D;
    for (int task = t0; task < t1; task++) {
        int per = grouped ? NKV : NH, m = task / per;
        int g = grouped ? task % per : (task % per) / group, h0 = grouped ? g * group : task % per;
        int heads = grouped ? group : 1;
        const float *row = qkv + (size_t)m * NQKV;
        const float *c = cos_ + (size_t)m * rope_stride, *s = sin_ + (size_t)m * rope_stride;
        const float *v = row + Q + KV + (size_t)g * D;
        for (int hh = 0; hh < heads; hh++)
            rotate(row + (size_t)(h0 + hh) * D, c, s, D, qrot + (size_t)hh * D);
        rotate(row + Q + (size_t)g * D, c, s, D, krot);
        if (h0 % group == 0) {
            cache_store(k_cache, md->cache_type, slots[m], NKV, g, D, krot);
            cache_store(v_cache, md->cache_type, slots[m], NKV, g, D, v);
        }
        const int32_t *table = tables + (size_t)m * table_stride;
        float *o = out + (size_t)m * Q + (size_t)h0 * D;
        if (grouped)
            attend_group(qrot, group, krot, v, k_cache, v_cache, md->cache_type, table,
                         context_lens[m], md->block_size, NKV, g, D, md->scale, o, attn_work);
        else
            attend(qrot, krot, v, k_cache, v_cache, md->cache_type, table, context_lens[m],
                   md->block_size, NKV, g, D, md->scale, o, attn_work);
    }
}

static int num_attention_tasks(const struct tl_model *md, int M) {
    return M * (md->head_dim % 16 == 0 ? md->num_kv_heads : md->num_heads);
}

static int64_t private_floats(const struct tl_model *md, int M) {
    int64_t widest = md->hidden > md->intermediate ? md->hidden : md->intermediate;
    int64_t q = (int64_t)md->num_heads * md->head_dim;
    widest = widest > q ? widest : q;
    return (int64_t)M * md->hidden + 2 * (int64_t)M * md->head_dim + WORK_FLOATS(md->head_dim) +
           (int64_t)M * (widest / 32 + 1);
}

int64_t trillm_decode_scratch(const struct tl_model *md, int M, int threads) {
    int64_t q = (int64_t)md->num_heads * md->head_dim;
    int64_t kv = (int64_t)md->num_kv_heads * md->head_dim;
    int64_t shared = M * (q + 2 * kv) + M * q + (int64_t)M * md->intermediate;
    return shared + threads * private_floats(md, M);
}

static void thread_slot(int *tid, int *nt) {
#ifdef _OPENMP
    *tid = omp_get_thread_num();
    *nt = omp_get_num_threads();
#else
    *tid = 0;
    *nt = 1;
#endif
}

/* `group_sums` of x into `xsum` when `wtype` is Q4 (each thread its own copy); else NULL. */
static const float *sums_for(int wtype, const float *x, int M, int K, float *xsum) {
    if (wtype != TL_Q4) return NULL;
    group_sums(x, K, M, K, xsum);
    return xsum;
}

/* All decoder layers for M decode tokens (one per sequence), then the final norm.
 *
 * hidden [M, hidden] float32: the embeddings in, the residual stream throughout; `out`
 * [M, hidden] gets the final-normed states. Token m is at `positions[m]`, its K/V go to
 * `slots[m]`, and it attends to the `context_lens[m]` tokens (its own included) whose blocks
 * `tables[m * table_stride ...]` lists. `scratch`: `trillm_decode_scratch` floats.
 */
void trillm_decode(const struct tl_model *md, const struct tl_layer *layers,
                   const float *final_norm, float *hidden, float *out, int M,
                   const int64_t *positions, const int64_t *slots, const int32_t *tables,
                   int table_stride, const int32_t *context_lens, float *scratch, int threads) {
    const int H = md->hidden, D = md->head_dim, NH = md->num_heads, NKV = md->num_kv_heads;
    const int I = md->intermediate;
    const int Q = NH * D, KV = NKV * D, NQKV = Q + 2 * KV;
    float *qkv = scratch, *attn = qkv + (size_t)M * NQKV, *act = attn + (size_t)M * Q;
    float *private_base = act + (size_t)M * I;
    const size_t private_size = (size_t)private_floats(md, M);
#pragma omp parallel num_threads(threads)
    {
        int tid, nt;
        thread_slot(&tid, &nt);
        float *xn = private_base + tid * private_size, *cos_ = xn + (size_t)M * H;
        float *sin_ = cos_ + (size_t)M * D, *work = sin_ + (size_t)M * D;
        float *xsum = work + WORK_FLOATS(D);
        for (int m = 0; m < M; m++) /* rotary angles, once per step, in every thread */
            for (int i = 0; i < D / 2; i++) {
                float a = (float)positions[m] * md->inv_freq[i];
                cos_[m * D + i] = cos_[m * D + i + D / 2] = cosf(a);
                sin_[m * D + i] = sin_[m * D + i + D / 2] = sinf(a);
            }
        int qkv_t0, qkv_t1, o_t0, o_t1, gu_t0, gu_t1, att0, att1;
        split((NQKV + 15) / 16, tid, nt, &qkv_t0, &qkv_t1);
        split((H + 15) / 16, tid, nt, &o_t0, &o_t1);
        split(I / 16, tid, nt, &gu_t0, &gu_t1);
        split(num_attention_tasks(md, M), tid, nt, &att0, &att1);
        for (int l = 0; l < md->num_layers; l++) {
            const struct tl_layer *L = &layers[l];
            for (int m = 0; m < M; m++)
                rms_norm(hidden + (size_t)m * H, L->ln1, H, md->eps, xn + (size_t)m * H);
            linear_tiles(L->wqkv, L->tqkv, H, NQKV, L->bqkv, xn, H, M,
                         sums_for(L->tqkv, xn, M, H, xsum), qkv, NQKV, OUT_STORE, qkv_t0, qkv_t1);
#pragma omp barrier
            attention_tasks(md, L->k_cache, L->v_cache, qkv, cos_, sin_, D, slots, tables,
                            table_stride, context_lens, attn, att0, att1, work);
#pragma omp barrier
            linear_tiles(L->wo, L->to, Q, H, L->bo, attn, Q, M, sums_for(L->to, attn, M, Q, xsum),
                         hidden, H, OUT_ADD, o_t0, o_t1);
#pragma omp barrier
            for (int m = 0; m < M; m++)
                rms_norm(hidden + (size_t)m * H, L->ln2, H, md->eps, xn + (size_t)m * H);
            gate_up_tiles(L->wgu, L->tgu, H, xn, H, M, sums_for(L->tgu, xn, M, H, xsum), act, I,
                          gu_t0, gu_t1);
#pragma omp barrier
            linear_tiles(L->wd, L->td, I, H, NULL, act, I, M, sums_for(L->td, act, M, I, xsum),
                         hidden, H, OUT_ADD, o_t0, o_t1);
#pragma omp barrier
        }
        int m0, m1;
        split(M, tid, nt, &m0, &m1);
        for (int m = m0; m < m1; m++)
            rms_norm(hidden + (size_t)m * H, final_norm, H, md->eps, out + (size_t)m * H);
    }
}

/* out[M, N] = x[M, K] . w^T over a tiled weight, on `threads` threads: the LM head, and
 * every linear of a GGUF model kept quantized (`TiledLinear`), prefill included. Returns 0, or
 * -1 if the group sums of a Q4 weight found no memory. */
int trillm_linear(const void *w, int wtype, int K, int N, const float *x, int M, float *out,
                  int threads) {
    float *xsum = NULL;
    if (wtype == TL_Q4 && !(xsum = malloc(sizeof(float) * ((size_t)M * (K / 32) + 1)))) return -1;
#pragma omp parallel num_threads(threads)
    {
        int tid, nt, m0, m1, t0, t1;
        thread_slot(&tid, &nt);
        if (xsum) {
            split(M, tid, nt, &m0, &m1);
            group_sums(x + (size_t)m0 * K, K, m1 - m0, K, xsum + (size_t)m0 * (K / 32));
#pragma omp barrier
        }
        split((N + 15) / 16, tid, nt, &t0, &t1);
        linear_tiles(w, wtype, K, N, NULL, x, K, M, xsum, out, N, OUT_STORE, t0, t1);
    }
    free(xsum);
    return 0;
}

/* One layer's decode attention for the torch forward's larger decode batches (the linears
 * there are oneDNN's): `attention_tasks` over M tokens on `threads` threads, the rotary
 * angles given (`cos_`, `sin_` [M, rope_stride], float32). */
void trillm_attention(const struct tl_model *md, void *k_cache, void *v_cache,
                      const float *qkv, const float *cos_, const float *sin_, int rope_stride,
                      const int64_t *slots, const int32_t *tables, int table_stride,
                      const int32_t *context_lens, int M, float *out, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int tid, nt, t0, t1;
        thread_slot(&tid, &nt);
        float work[WORK_FLOATS(md->head_dim)];
        split(num_attention_tasks(md, M), tid, nt, &t0, &t1);
        attention_tasks(md, k_cache, v_cache, qkv, cos_, sin_, rope_stride, slots, tables,
                        table_stride, context_lens, out, t0, t1, work);
    }
}

/* out[t, j] = silu(x[t, j]) * x[t, I + j] for a [T, 2I] gate/up projection in [gate | up]
 * order: the torch forward's MLP activation in one pass (torch made a SiLU temporary, then
 * multiplied: two passes over [T, I] and an allocation; lib/gpu/_cpu_ops.py has the figures). */
void trillm_silu_mul(const float *x, int64_t T, int I, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int j = 0;
        for (; j + 16 <= I; j += 16) {
            f32x16 gv = load_f32(g + j);
            f32x16 r = gv / (exp16(-gv) + 1.0f) * load_f32(u + j);
            memcpy(o + j, &r, sizeof r);
        }
        for (; j < I; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

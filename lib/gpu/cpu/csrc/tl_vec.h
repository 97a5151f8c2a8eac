/* trillm C kernels: vector types, loads and the scalar helpers every kernel shares. */
#ifndef TL_VEC_H
#define TL_VEC_H

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

enum { TL_F32 = 0, TL_BF16 = 1, TL_Q4 = 2, TL_Q8 = 3, TL_BF16_AMX = 4 }; /* AMX: tl_amx.h */
#define Q4_GROUP 320 /* bytes of a Q4 tile's 32-k group: d[16], m[16] float16, 256 of nibbles */
#define Q8_GROUP 544 /* bytes of a Q8 tile's 32-k group: d[16] float16, 32 x 16 int8 */

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };       /* the MLP gate's activation */
enum { QK_NONE = 0, QK_HEAD = 1, QK_PROJECTION = 2 }; /* where q and k are RMS-normed */

/* One decoder layer; weights tiled (see above) of the types `tqkv`..., norms (their
 * (offset + weight) scales) and biases float32, NULL where the layer has none.
 *
 * The block's norms: `ln1` before attention and `ln2` before the MLP (Llama's two; OLMo 2 has
 * neither), `ln_attn_out` and `ln_ff_out` on each block's output before the residual add
 * (Gemma's sandwich, OLMo 2). `q_norm`, `k_norm`: per head ([head_dim]) or over the whole
 * projection, as `tl_model.qk_norm` says. `rope_cos`, `rope_sin`: the layer's rotary table
 * (the model's `RotaryEmbedding.cos` / `.sin`, in the cache's type, rows of rotary_dim: cos |
 * cos and -sin | sin), NULL for a layer without rotary. `window` > 0: a query at position p
 * reads keys p - window < j <= p. With `router` set the MLP is a mixture of experts (`tl_moe.h`):
 * the router's tiles [num_experts rows], each expert's gate/up and down tiles. `lora`
 * (NULL: LoRA off): the adapter slots of qkv, o, gate/up and down (`tl_lora.h`). */
struct tl_lora;
struct tl_layer {
    const float *ln1, *ln2, *ln_attn_out, *ln_ff_out, *q_norm, *k_norm;
    const void *wqkv, *wo, *wgu, *wd;
    const float *bqkv, *bo;
    const void *rope_cos, *rope_sin;
    const void *router;
    const void *const *expert_gu, *const *expert_down; /* [num_experts] */
    void *k_cache, *v_cache; /* [blocks, block_size, kv_heads, head_dim], cache_type */
    const struct tl_lora *lora; /* [4] */
    int32_t tqkv, to, tgu, td, trouter, tegu, ted;
    int32_t egu_interleaved; /* expert gate/up tiles: interleaved (2j, 2j + 1), or [gate | up] */
    int32_t window;
};

/* The model's shape and the operations its family chooses. `scale`: of q.k; `softcap` > 0:
 * scores are softcap * tanh(score / softcap); `residual`: each block's output is multiplied
 * by it before the add (Granite). Experts: `num_experts` of `expert_intermediate`, `top_k` a
 * token, their router weights renormalised to sum 1 when `renormalize`. LoRA: `lora_rank`
 * R of the slot buffers (0: off), `lora_type` theirs (TL_F32 or TL_BF16). */
struct tl_model {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    int32_t cache_type, qk_norm, rotary_dim, act;
    int32_t num_experts, top_k, expert_intermediate, renormalize;
    int32_t lora_rank, lora_type;
    float eps, scale, softcap, residual;
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

static inline f32x16 vmax(f32x16 a, f32x16 b) {
    i32x16 gt = a > b;
    return (f32x16)(((i32x16)a & gt) | ((i32x16)b & ~gt));
}

/* Lane reductions in four shuffle steps (a butterfly: every lane ends with the result): a
 * scalar loop over 16 lanes is a chain of 16 dependent adds (or compares), which the
 * per-16-keys softmax of `attend_group` waited on. `OP(a, b)` combines two vectors. */
#define LANE_REDUCE(v, OP)                                                                    \
    do {                                                                                      \
        v = OP(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4,  \
                                          5, 6, 7));                                          \
        v = OP(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, \
                                          10, 11));                                           \
        v = OP(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, \
                                          12, 13));                                           \
        v = OP(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, \
                                          15, 14));                                           \
    } while (0)

static inline f32x16 vadd(f32x16 a, f32x16 b) { return a + b; }

static inline float hsum(f32x16 v) {
    LANE_REDUCE(v, vadd);
    return v[0];
}

static inline float hmax(f32x16 v) {
    LANE_REDUCE(v, vmax);
    return v[0];
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

/* tanh over 16 lanes, 1 - 2 / (e^2x + 1): exact at the saturated ends (exp16 clamps), and
 * ~1e-7 off in absolute terms near 0, where soft-capping multiplies it by the cap. */
static inline f32x16 tanh16(f32x16 x) { return 1.0f - 2.0f / (exp16(x + x) + 1.0f); }


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

/* 8-lane vectors, the width of an AVX2 CPU's registers (`TL_NARROW`): without AVX-512 GCC keeps
 * every f32x16 variable on the stack, so the hot kernels there are written over these
 * (`tl_narrow.h` says why and measures it). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define TL_NARROW 1

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

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

/* 8 bytes at p as signed integers, to float. */
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

#endif /* TL_NARROW */

static inline float dot(const float *a, const float *b, int D) {
#ifdef TL_NARROW
    return dot8(a, b, D);
#endif
    f32x16 acc = {0};
    int i = 0;
    for (; i + 16 <= D; i += 16) acc += load_f32(a + i) * load_f32(b + i);
    float s = hsum(acc);
    for (; i < D; i++) s += a[i] * b[i];
    return s;
}

static inline f32x16 u8_to_f32(u8x16 b) {
    return __builtin_convertvector(__builtin_convertvector(b, i32x16), f32x16);
}

/* Through the unsigned widening (GCC scalarises a signed i8 -> i32 vector conversion):
 * q = (q ^ 0x80) - 128. */
static inline f32x16 i8_to_f32(i8x16 b) {
    return u8_to_f32((u8x16)b ^ 0x80) - 128.0f;
}

/* [lo, hi): thread tid's share of n items among nt. */
static inline void split(int n, int tid, int nt, int *lo, int *hi) {
    *lo = (int)((int64_t)n * tid / nt);
    *hi = (int)((int64_t)n * (tid + 1) / nt);
}

static void rms_norm(const float *x, const float *weight, int H, float eps, float *out) {
    float inv = 1.0f / sqrtf(dot(x, x, H) / (float)H + eps);
    for (int i = 0; i < H; i++) out[i] = weight[i] * (x[i] * inv);
}

#endif

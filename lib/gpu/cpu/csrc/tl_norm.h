/* trillm C kernels: a row's RMSNorm, with the residual add before it, in one pass over the row.
 *
 * Why: the torch forward's float32 prefill made each residual add and norm six separate
 * passes over [T, hidden] (add, pow, mean, rsqrt, mul, mul: `perf/prefill_profile.py --top`);
 * 1.141 ms on SmolLM2's [2048, 576], 0.474 here (`perf/norm_bench.py`). Here a row is read
 * once from memory: the sum x + r is stored (the next residual) while its squares are summed,
 * and the normed row is written from the copy still in L1.
 *
 * Arithmetic, in Hugging Face's order: s = x + r (float32), inv = 1 / sqrt(sum(s^2) / H + eps),
 * out = scale * (s * inv), `scale` the norm's (offset + weight) (Gemma's 1 + w). Only the
 * order of the sum of squares differs from torch's, so results agree to float32 rounding. */
#ifndef TL_NORM_H
#define TL_NORM_H

#include "tl_vec.h"

#ifdef TL_NARROW
/* `add_rms_norm_row` at 8 lanes (`TL_NARROW`): the same sums in the same places. */
static void add_rms_norm_row8(const float *x, const float *r, const float *scale, int H,
                              float eps, float *out, float *sum_out) {
    const float *s = x;
    f32x8 acc = {0};
    int i = 0;
    if (r) {
        for (; i + 8 <= H; i += 8) {
            f32x8 v = ld8(x + i) + ld8(r + i);
            st8(sum_out + i, v);
            acc += v * v;
        }
        for (int j = i; j < H; j++) sum_out[j] = x[j] + r[j];
        s = sum_out;
    } else {
        for (; i + 8 <= H; i += 8) acc += ld8(x + i) * ld8(x + i);
    }
    float squares = hsum8(acc);
    for (; i < H; i++) squares += s[i] * s[i];
    const float inv = 1.0f / sqrtf(squares / (float)H + eps);
    for (i = 0; i + 8 <= H; i += 8) st8(out + i, ld8(scale + i) * (ld8(s + i) * inv));
    for (; i < H; i++) out[i] = scale[i] * (s[i] * inv);
}
#endif

/* out[H] = RMSNorm(x + r) by `scale`, and sum_out[H] = x + r; with r NULL, out = RMSNorm(x)
 * and sum_out is not written. */
static void add_rms_norm_row(const float *x, const float *r, const float *scale, int H, float eps,
                             float *out, float *sum_out) {
#ifdef TL_NARROW
    add_rms_norm_row8(x, r, scale, H, eps, out, sum_out);
    return;
#endif
    const float *s = x;
    float squares;
    if (r) {
        f32x16 acc = {0};
        int i = 0;
        for (; i + 16 <= H; i += 16) {
            f32x16 v = load_f32(x + i) + load_f32(r + i);
            memcpy(sum_out + i, &v, sizeof v);
            acc += v * v;
        }
        squares = hsum(acc);
        for (; i < H; i++) {
            sum_out[i] = x[i] + r[i];
            squares += sum_out[i] * sum_out[i];
        }
        s = sum_out;
    } else {
        squares = dot(x, x, H);
    }
    const float inv = 1.0f / sqrtf(squares / (float)H + eps);
    int i = 0;
    for (; i + 16 <= H; i += 16) {
        f32x16 v = load_f32(scale + i) * (load_f32(s + i) * inv);
        memcpy(out + i, &v, sizeof v);
    }
    for (; i < H; i++) out[i] = scale[i] * (s[i] * inv);
}

/* 16 floats to bfloat16, rounded to nearest even as torch does (NaN kept a quiet NaN). With
 * AVX512_BF16 one instruction (`vcvtneps2bf16`), which rounds and quiets alike but reads
 * float32 denormals (below 1.2e-38) as zero. With it, and rounding in registers where a value
 * went through memory to be rounded, bit-identical results: SiLU * up [2048, 2 x 1536] 4.32
 * against 5.72 ms, add + RMSNorm [2048, 576] 0.85 against 1.19 ms, at 160 rows 0.63x and 0.78x
 * (one thread, CPU time, `perf/elementwise_bench.py`, alternated with the integer rounding). */
static inline u16x16 to_bf16x16(f32x16 v) {
#ifdef __AVX512BF16__
    return (u16x16)_mm512_cvtneps_pbh((__m512)v);
#else
    u32x16 u;
    memcpy(&u, &v, sizeof u);
    u32x16 r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    u32x16 nan = (u32x16)((u & 0x7fffffffu) > 0x7f800000u);
    r = (r & ~nan) | (((u >> 16) | 0x40u) & nan);
    return __builtin_convertvector(r, u16x16);
#endif
}

static inline void store_bf16(uint16_t *p, f32x16 v) {
    u16x16 h = to_bf16x16(v);
    memcpy(p, &h, sizeof h);
}

/* v rounded to bfloat16 and back: a value as torch's bfloat16 tensor would hold it. */
static inline f32x16 round_bf16(f32x16 v) {
    u32x16 w = __builtin_convertvector(to_bf16x16(v), u32x16) << 16;
    f32x16 r;
    memcpy(&r, &w, sizeof r);
    return r;
}

/* A bfloat16 row in Hugging Face's rounding: s = bf16(x + r) (stored as the next residual),
 * inv = 1 / sqrt(sum(s^2) / H + eps) in float32; `cast_first` (Llama's order, offset 0):
 * out = bf16(scale * bf16(s * inv)), else (Gemma's 1 + w): out = bf16((s * inv) * scale).
 * With r NULL, s = x and sum_out is not written. `scale` [H] float32, `tmp` [H] floats. */
static void add_rms_norm_row_bf16(const uint16_t *x, const uint16_t *r, const float *scale, int H,
                                  float eps, int cast_first, uint16_t *out, uint16_t *sum_out,
                                  float *tmp) {
    f32x16 acc = {0};
    float squares = 0.0f;
    int i = 0;
    for (; i + 16 <= H; i += 16) {
        f32x16 v = load_bf16(x + i);
        if (r) {
            v = round_bf16(v + load_bf16(r + i)); /* the residual as stored */
            store_bf16(sum_out + i, v);
        }
        memcpy(tmp + i, &v, sizeof v);
        acc += v * v;
    }
    squares = hsum(acc);
    for (; i < H; i++) {
        float v = bf16_to_f32(x[i]);
        if (r) {
            sum_out[i] = f32_to_bf16(v + bf16_to_f32(r[i]));
            v = bf16_to_f32(sum_out[i]);
        }
        tmp[i] = v;
        squares += v * v;
    }
    const float inv = 1.0f / sqrtf(squares / (float)H + eps);
    i = 0;
    for (; i + 16 <= H; i += 16) {
        f32x16 n = load_f32(tmp + i) * inv;
        if (cast_first) n = round_bf16(n);
        store_bf16(out + i, load_f32(scale + i) * n);
    }
    for (; i < H; i++) {
        float n = tmp[i] * inv;
        if (cast_first) n = bf16_to_f32(f32_to_bf16(n));
        out[i] = f32_to_bf16(scale[i] * n);
    }
}

#endif

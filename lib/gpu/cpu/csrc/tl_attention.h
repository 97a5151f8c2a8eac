/* trillm C kernels: rotary, the KV cache and paged attention for decode tokens. */
#ifndef TL_ATTENTION_H
#define TL_ATTENTION_H

#include "tl_norm.h"
#include "tl_vec.h"

/* The locality the decode attention's K/V prefetches ask for: 2 (prefetcht1) brings a row into
 * L2, not L1. With 3 (prefetcht0), as before, a chunk's 64-128 fetches queue on L1's few miss
 * buffers and the walk over a cold cache ran at ~12 GB/s; into L2 the same kernels took
 * 0.49-0.54x the time on a cache past L3 (Zen 4: prompt_attention_bench.py, "64 decodes at
 * 512", "128 decodes at 512 bfloat16") and the B=32 decode step's attention part fell from
 * 11.1 to 5.2 ms in bfloat16 (decode_profile.py --split --batch 32; perf/README.md). */
#define KV_FETCH_LEVEL 2

/* Element i of a float32 or bfloat16 (`type`) array. */
static inline const void *elem_at(const void *p, int type, size_t i) {
    return (const char *)p + i * (type == TL_F32 ? 4 : 2);
}

/* n values of a float32 or bfloat16 array into `out` as float32. */
static inline void to_f32(const void *x, int type, int n, float *out) {
    if (type == TL_F32) {
        memcpy(out, x, sizeof(float) * (size_t)n);
        return;
    }
    const uint16_t *h = (const uint16_t *)x;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        f32x16 v = load_bf16(h + i);
        memcpy(out + i, &v, sizeof v);
    }
    for (; i < n; i++) out[i] = bf16_to_f32(h[i]);
}

/* Head `h` of one token's q or k projection `x` [heads][D] (float32 or bfloat16, `xtype`)
 * into `out` [D] float32: RMS-normed by `norm` (QK_HEAD: its own D values, `norm` [D];
 * QK_PROJECTION: `inv` is the whole projection's 1 / rms, `norm` the projection's [heads * D];
 * NULL: not normed), then rotate-half RoPE over its first `rd` dims by `c`, `s` [rd / 2] (cos
 * and sin; NULL: no rotary). */
static void head_in(const void *x, int xtype, int h, int D, const float *norm, int mode,
                    float inv, float eps, const float *c, const float *s, int rd, float *out) {
    const float *xh = (const float *)x + (size_t)h * D;
    if (xtype != TL_F32) { /* converted first, then normed and rotated in place */
        to_f32(elem_at(x, xtype, (size_t)h * D), xtype, D, out);
        xh = out;
    }
    if (norm) {
        const float *w = mode == QK_PROJECTION ? norm + (size_t)h * D : norm;
        if (mode != QK_PROJECTION) inv = 1.0f / sqrtf(dot(xh, xh, D) / (float)D + eps);
        for (int i = 0; i < D; i++) out[i] = w[i] * (xh[i] * inv);
    } else if (xh != out) {
        memcpy(out, xh, sizeof(float) * (size_t)D);
    }
    if (!c) return;
    const int r = rd / 2;
    int i = 0;
#ifdef TL_NARROW
    for (; i + 8 <= r; i += 8) {
        const f32x8 a = ld8(out + i), b = ld8(out + i + r), cv = ld8(c + i), sv = ld8(s + i);
        st8(out + i, a * cv - b * sv);
        st8(out + i + r, b * cv + a * sv);
    }
#endif
    for (; i + 16 <= r; i += 16) { /* a prompt step runs this per token and head */
        f32x16 a = load_f32(out + i), b = load_f32(out + i + r);
        f32x16 cv = load_f32(c + i), sv = load_f32(s + i);
        f32x16 lo = a * cv - b * sv, hi = b * cv + a * sv;
        memcpy(out + i, &lo, sizeof lo);
        memcpy(out + i + r, &hi, sizeof hi);
    }
    for (; i < r; i++) {
        float a = out[i], b = out[i + r];
        out[i] = a * c[i] - b * s[i];
        out[i + r] = b * c[i] + a * s[i];
    }
}

/* Half a row of a rotary table (`rd` elements a row, from `offset`), as float32: in place, or
 * converted into `buf` from bfloat16. */
static inline const float *rope_row(const void *table, int ctype, int64_t row, int rd,
                                    int offset, float *buf) {
    size_t at = (size_t)row * rd + (size_t)offset;
    if (ctype == TL_F32) return (const float *)table + at;
    const uint16_t *h = (const uint16_t *)table + at;
    for (int i = 0; i < rd / 2; i++) buf[i] = bf16_to_f32(h[i]);
    return buf;
}

/* The first key a query of context `ctx` (its own the last) reads: all of them, or the last
 * `window`. */
static inline int first_key(int ctx, int window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

/* Scores soft-capped: cap * tanh(score / cap) (cap 0: as they are). */
static inline float cap_score(float score, float cap) {
    return cap > 0.0f ? cap * tanhf(score / cap) : score;
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

#include "tl_attend.h"
#include "tl_attend_bf16.h"
#include "tl_narrow_attention.h"

/* `attend_group`, or over a bfloat16 cache its pair dot products where the CPU has them. */
static void attend_heads(const float *q, int group, const float *k, const float *v,
                         const void *kc, const void *vc, int ctype, const int32_t *table,
                         int ctx, int window, int B, int Hkv, int g, int D, float scale,
                         float cap, float *out, float *work) {
#ifdef TL_DPBF16
    if (ctype == TL_BF16 && D % 32 == 0) {
        attend_group_bf16(q, group, kc, vc, table, ctx, window, B, Hkv, g, D, scale, cap, out,
                          work);
        return;
    }
#endif
#ifdef TL_NARROW
    nattend_group(q, group, k, v, kc, vc, ctype, table, ctx, window, B, Hkv, g, D, scale, cap,
                  out, work);
    return;
#endif
    attend_group(q, group, k, v, kc, vc, ctype, table, ctx, window, B, Hkv, g, D, scale, cap,
                 out, work);
}

/* One step's attention inputs for one layer. `qkv` [M, q + 2 kv] (queries and keys not yet
 * normed or rotated), `out` [M, q], both of `io_type` (TL_F32, or TL_BF16: the bfloat16 torch
 * forward's own tensors, converted a head at a time where they were converted whole in torch
 * before and after the call). Token m is rotated by row `rope_rows[m]` of the layer's rotary
 * table, stores its K/V at `slots[m]` and attends to the `context_lens[m]` tokens (its own the
 * last) whose blocks row `rows[m]` of `tables` lists (row m when `rows` is NULL: one token per
 * sequence). */
struct tl_step {
    const struct tl_layer *layer;
    void *k_cache, *v_cache;
    const void *qkv;
    const int64_t *rope_rows, *slots;
    const int32_t *tables, *rows, *context_lens;
    int table_stride;
    void *out;
    int io_type; /* last: initializers that stop before it mean float32 */
};

enum { ATT_STORE = 1, ATT_ATTEND = 2, ATT_BOTH = 3 }; /* what `attention_tasks` does */

/* 1 / rms of n float32 or bfloat16 values (an RMS norm's factor). */
static inline float inv_rms(const void *x, int type, int n, float eps) {
    if (type == TL_F32) return 1.0f / sqrtf(dot((const float *)x, (const float *)x, n) / (float)n + eps);
    f32x16 acc = {0};
    const uint16_t *h = (const uint16_t *)x;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        f32x16 v = load_bf16(h + i);
        acc += v * v;
    }
    float sum = hsum(acc);
    for (; i < n; i++) sum += bf16_to_f32(h[i]) * bf16_to_f32(h[i]);
    return 1.0f / sqrtf(sum / (float)n + eps);
}

/* Rows of float32 attention output `o` [n][D] into `out` (of `type`). */
static inline void out_rows(const float *o, int n, int D, void *out, int type) {
    if (type == TL_F32) {
        memcpy(out, o, sizeof(float) * (size_t)n * D);
        return;
    }
    uint16_t *h = (uint16_t *)out;
    int i = 0;
    for (; i + 16 <= n * D; i += 16) store_bf16(h + i, load_f32(o + i));
    for (; i < n * D; i++) h[i] = f32_to_bf16(o[i]);
}

/* Tasks t0, t0 + stride, ... < t1 of `num_attention_tasks`: norm and rotate the new key and
 * store the K/V (ATT_STORE), norm and rotate the queries and attend over the cache and the
 * new key (ATT_ATTEND). With head_dim % 16 == 0 a task is a token's kv head and its query
 * group (`attend_group`), else a token's query head (`attend`). A step whose tokens read keys
 * that other tokens of it store (a prompt's) stores them all first, then attends
 * (`trillm_attention`). `work`: WORK_FLOATS(head_dim). */
static void attention_tasks(const struct tl_model *md, const struct tl_step *st, int t0, int t1,
                            int stride, int mode, float *work) {
    const int D = md->head_dim, NH = md->num_heads, NKV = md->num_kv_heads, group = NH / NKV;
    const int Q = NH * D, KV = NKV * D, NQKV = Q + 2 * KV, grouped = D % 16 == 0;
    const int rd = md->rotary_dim, ct = md->cache_type;
    const struct tl_layer *L = st->layer;
    const int whole = md->qk_norm == QK_PROJECTION && L->q_norm; /* norms over all heads */
    const int io = st->io_type;
    float *qrot = work, *krot = work + MAX_GROUP * D, *cbuf = krot + D, *sbuf = cbuf + D;
    float *vbuf = sbuf + D, *obuf = vbuf + D; /* a bfloat16 step's value and output rows */
    float *attn_work = obuf + MAX_GROUP * D;
    for (int task = t0; task < t1; task += stride) {
        int per = grouped ? NKV : NH, m = task / per;
        int g = grouped ? task % per : (task % per) / group, h0 = grouped ? g * group : task % per;
        int heads = grouped ? group : 1;
        if (!(mode & ATT_ATTEND) && h0 % group) continue; /* another task stores its K/V */
        const void *row = elem_at(st->qkv, io, (size_t)m * NQKV);
        const float *c = NULL, *s = NULL, *v = elem_at(row, io, (size_t)Q + KV + (size_t)g * D);
        if (io != TL_F32) {
            to_f32(v, io, D, vbuf);
            v = vbuf;
        }
        if (L->rope_cos) {
            c = rope_row(L->rope_cos, ct, st->rope_rows[m], rd, 0, cbuf);
            s = rope_row(L->rope_sin, ct, st->rope_rows[m], rd, rd / 2, sbuf);
        }
        const void *krow = elem_at(row, io, (size_t)Q);
        float kinv = whole ? inv_rms(krow, io, KV, md->eps) : 0.0f;
        head_in(krow, io, g, D, L->k_norm, md->qk_norm, kinv, md->eps, c, s, rd, krot);
        if ((mode & ATT_STORE) && h0 % group == 0) {
            cache_store(st->k_cache, ct, st->slots[m], NKV, g, D, krot);
            cache_store(st->v_cache, ct, st->slots[m], NKV, g, D, v);
        }
        if (!(mode & ATT_ATTEND)) continue;
        float qinv = whole ? inv_rms(row, io, Q, md->eps) : 0.0f;
        for (int hh = 0; hh < heads; hh++)
            head_in(row, io, h0 + hh, D, L->q_norm, md->qk_norm, qinv, md->eps, c, s, rd,
                    qrot + (size_t)hh * D);
        const int32_t *table = st->tables + (size_t)(st->rows ? st->rows[m] : m) * st->table_stride;
        void *dst = (void *)elem_at(st->out, io, (size_t)m * Q + (size_t)h0 * D);
        float *o = io == TL_F32 ? (float *)dst : obuf;
        int ctx = st->context_lens[m];
        if (grouped)
            attend_heads(qrot, group, krot, v, st->k_cache, st->v_cache, ct, table, ctx,
                         L->window, md->block_size, NKV, g, D, md->scale, md->softcap, o,
                         attn_work);
        else
            attend(qrot, krot, v, st->k_cache, st->v_cache, ct, table, ctx, L->window,
                   md->block_size, NKV, g, D, md->scale, md->softcap, o, attn_work);
        if (io != TL_F32) out_rows(o, heads, D, dst, io);
    }
}

static int num_attention_tasks(const struct tl_model *md, int M) {
    return M * (md->head_dim % 16 == 0 ? md->num_kv_heads : md->num_heads);
}

#endif

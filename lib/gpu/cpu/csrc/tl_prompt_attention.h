/* trillm C kernels: prompt tokens' attention, 16 queries of a sequence against 16 keys at a
 * time.
 *
 * Why a kernel of its own: `attend_group` takes one token's query heads against every key of
 * its context, so a prompt of L tokens reads its keys L times over and spends, per key and
 * head, a horizontal sum (`reduce16`) and a serial online-softmax step. Here a block of up to
 * QBLOCK consecutive tokens of one sequence (consecutive context lengths) takes one vector
 * lane each: the queries are transposed once into qt[head][d][lane], and each key block is
 * read once for the block's tokens and every query head of its kv head (GQA). A score vector
 * is then 16 tokens' scores for one key, sum_d qt[d] * k[d] (a broadcast key element and an
 * FMA, no horizontal sum), and the online softmax is per lane: maxima, rescales and sums are
 * vector operations, never a reduction. Values likewise: ot[d] (16 tokens) += p * v[d].
 *
 * Causal masking and sliding windows are per lane (each lane's context length and first
 * key), applied only to the key blocks that cross a lane's bounds; a block reads from its
 * first token's first key to its last token's own key, so a sliding layer never reads the
 * keys before its window. Every key comes from the cache (a prompt step stores all its K/V
 * first), float32 read in place, bfloat16 converted once per key block.
 */
#ifndef TL_PROMPT_ATTENTION_H
#define TL_PROMPT_ATTENTION_H

#include "tl_attention.h"

#define QBLOCK 16   /* query tokens of a block: one vector lane each */
#define KBLOCK 16   /* keys a step of the online softmax takes */
#define BLOCK_MIN 4 /* a run of fewer tokens attends token by token (`attend_group`) */
#ifdef __AVX512F__
#define KEYS_PER_PASS 16 /* score accumulators held at once: 16 of 32 registers */
#define VALUE_DIMS 8     /* output dims a pass of `block_values` holds, next to 16 weights */
#else
#define KEYS_PER_PASS 4 /* AVX2: each f32x16 is two of 16 registers */
#define VALUE_DIMS 4
#endif

/* Floats of a thread's `attend_block` work for `group` query heads of head_dim D: the
 * queries and outputs [group][D][QBLOCK], a key and a value block, two rotary rows; then
 * `attend_block_amx`'s score and output tiles and weight rows, and up to PAIR_KEYS keys'
 * value pairs (`tl_prompt_amx.h`). */
static int64_t block_base_floats(int group, int D) {
    return 2 * (int64_t)group * D * QBLOCK + 2 * (int64_t)KBLOCK * D + 2 * (int64_t)D;
}

#define PAIR_KEYS 256 /* keys whose value pairs `attend_block_amx64` makes once for all heads */

static int64_t block_work_floats(int group, int D) {
    return block_base_floats(group, D) + 3 * 256 + (int64_t)PAIR_KEYS / 2 * D;
}

/* 16 scores a lane: s[c] = qt . key c, for the KBLOCK keys `kb` [KBLOCK][D]. */
static inline void block_scores(const float *qt, const float *kb, int D, f32x16 *s) {
    for (int c0 = 0; c0 < KBLOCK; c0 += KEYS_PER_PASS) {
        f32x16 acc[KEYS_PER_PASS];
        for (int c = 0; c < KEYS_PER_PASS; c++) acc[c] = (f32x16){0};
        for (int d = 0; d < D; d++) {
            f32x16 q = load_f32(qt + (size_t)d * QBLOCK);
            for (int c = 0; c < KEYS_PER_PASS; c++) acc[c] += q * kb[(size_t)(c0 + c) * D + d];
        }
        for (int c = 0; c < KEYS_PER_PASS; c++) s[c0 + c] = acc[c];
    }
}

/* ot[d] = ot[d] * alpha + sum_c p[c] * value c [d], for the KBLOCK values `vb` [KBLOCK][D]:
 * VALUE_DIMS dims at a time, so as many accumulation chains run side by side (one chain of
 * 16 dependent FMAs a dim waited on their latency). */
static inline void block_values(float *ot, const float *vb, int D, f32x16 alpha,
                                const f32x16 *p) {
    for (int c0 = 0; c0 < KBLOCK; c0 += KEYS_PER_PASS) {
        for (int d = 0; d < D; d += VALUE_DIMS) {
            f32x16 o[VALUE_DIMS];
            for (int i = 0; i < VALUE_DIMS; i++) {
                o[i] = load_f32(ot + (size_t)(d + i) * QBLOCK);
                if (c0 == 0) o[i] *= alpha;
            }
            for (int c = 0; c < KEYS_PER_PASS; c++)
                for (int i = 0; i < VALUE_DIMS; i++)
                    o[i] += p[c0 + c] * vb[(size_t)(c0 + c) * D + d + i];
            for (int i = 0; i < VALUE_DIMS; i++)
                memcpy(ot + (size_t)(d + i) * QBLOCK, &o[i], sizeof o[i]);
        }
    }
}

/* dst[0 .. D) = src, 16 floats at a time (D % 16 == 0): inline, where memcpy of a size
 * unknown at compile time is a call. */
static inline void copy_row(float *dst, const float *src, int D) {
    for (int i = 0; i < D; i += 16) {
        f32x16 v = load_f32(src + i);
        memcpy(dst + i, &v, sizeof v);
    }
}

/* Rows i and i + s of r: the s x s blocks off the diagonal of each 2s x 2s block swapped. */
#define SWAP_BLOCKS(r, i, s, LO, HI)                                                           \
    do {                                                                                      \
        f32x16 a = r[i], b = r[i + s];                                                        \
        r[i] = __builtin_shufflevector(a, b, LO);                                             \
        r[i + s] = __builtin_shufflevector(a, b, HI);                                         \
    } while (0)
#define S8_LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define S8_HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define S4_LO 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define S4_HI 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define S2_LO 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define S2_HI 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define S1_LO 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define S1_HI 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31

/* r[i][j] <- r[j][i]: a block matrix's transpose is its off-diagonal blocks swapped and each
 * block transposed, so swapping at block sizes 8, 4, 2, 1 transposes (64 shuffles). */
static inline void transpose16(f32x16 *r) {
    for (int i = 0; i < 8; i++) SWAP_BLOCKS(r, i, 8, S8_LO, S8_HI);
    for (int i = 0; i < 16; i += 8)
        for (int k = 0; k < 4; k++) SWAP_BLOCKS(r, i + k, 4, S4_LO, S4_HI);
    for (int i = 0; i < 16; i += 4)
        for (int k = 0; k < 2; k++) SWAP_BLOCKS(r, i + k, 2, S2_LO, S2_HI);
    for (int i = 0; i < 16; i += 2) SWAP_BLOCKS(r, i, 1, S1_LO, S1_HI);
}

/* out[t][d] = ot[d][t] * inv[t] for t < n, d < D: the block's [D][16 lanes] back to rows
 * (float32 or bfloat16, `type`), 16 dims at a time through a 16 x 16 transpose in registers. */
static inline void block_out(const float *ot, f32x16 inv, int n, int D, void *out, int type,
                             size_t stride) {
    for (int d0 = 0; d0 < D; d0 += 16) {
        f32x16 r[16];
        for (int i = 0; i < 16; i++) r[i] = load_f32(ot + (size_t)(d0 + i) * QBLOCK) * inv;
        transpose16(r);
        for (int t = 0; t < n; t++) {
            if (type == TL_F32)
                memcpy((float *)out + (size_t)t * stride + d0, &r[t], sizeof r[t]);
            else
                store_bf16((uint16_t *)out + (size_t)t * stride + d0, r[t]);
        }
    }
}

/* The queries of tokens m0 .. m0 + n - 1 for kv head g's query heads, normed and rotated, as
 * rows `rows_in` [group][QBLOCK][D] (zeros past n). `cbuf`, `sbuf`: D floats each. */
static inline __attribute__((always_inline)) void block_queries(
    const struct tl_model *md, const struct tl_step *st, int m0, int n, int g, float *rows_in,
    float *cbuf, float *sbuf, const int D) {
    const int NH = md->num_heads, NKV = md->num_kv_heads, group = NH / NKV;
    const int Q = NH * D, NQKV = Q + 2 * NKV * D, h0 = g * group;
    const int rd = md->rotary_dim, ct = md->cache_type, io = st->io_type;
    const struct tl_layer *L = st->layer;
    const int whole = md->qk_norm == QK_PROJECTION && L->q_norm;
    if (n < QBLOCK) memset(rows_in, 0, sizeof(float) * (size_t)group * D * QBLOCK);
    for (int t = 0; t < n; t++) {
        const void *row = elem_at(st->qkv, io, (size_t)(m0 + t) * NQKV);
        const float *c = NULL, *s = NULL;
        if (L->rope_cos) {
            c = rope_row(L->rope_cos, ct, st->rope_rows[m0 + t], rd, 0, cbuf);
            s = rope_row(L->rope_sin, ct, st->rope_rows[m0 + t], rd, rd / 2, sbuf);
        }
        float qinv = whole ? inv_rms(row, io, Q, md->eps) : 0.0f;
        for (int hh = 0; hh < group; hh++)
            head_in(row, io, h0 + hh, D, L->q_norm, md->qk_norm, qinv, md->eps, c, s, rd,
                    rows_in + ((size_t)hh * QBLOCK + t) * D);
    }
}

/* A block's per-lane key bounds: lane t (token m0 + t; lanes past n copy the last token's)
 * reads keys lo[t] <= j < ctx[t]. */
struct block_bounds {
    int ctx0, end, lo_max; /* the first and last token's context; the last's first key */
    i32x16 ctx, lo;
};

static inline struct block_bounds block_bounds(const struct tl_step *st, int m0, int n) {
    const int window = st->layer->window;
    struct block_bounds b;
    b.ctx0 = st->context_lens[m0];
    b.end = b.ctx0 + n - 1;
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    i32x16 ctx = b.ctx0 + lane;
    b.ctx = (i32x16)((ctx & (ctx <= b.end)) | ((b.end + (i32x16){0}) & (ctx > b.end)));
    b.lo = (i32x16){0};
    if (window > 0) b.lo = (b.ctx - window) & (b.ctx > window);
    b.lo_max = first_key(b.end, window);
    return b;
}

/* One online-softmax step of a head over the KBLOCK keys from j0: scores `s` (one vector of
 * lanes a key) soft-capped, masked, and turned into weights against the running max; the
 * running sum updated. Returns the factor the head's output so far is rescaled by. */
static inline __attribute__((always_inline)) f32x16 block_softmax(const struct tl_model *md, const struct block_bounds *b,
                                   int j0, f32x16 *s, f32x16 *run_max, f32x16 *run_sum) {
    const int masked = j0 + KBLOCK > b->ctx0 || j0 < b->lo_max;
    const f32x16 minus_inf = (f32x16){0} - INFINITY;
    if (md->softcap > 0.0f)
        for (int c = 0; c < KBLOCK; c++) s[c] = tanh16(s[c] / md->softcap) * md->softcap;
    if (masked) /* a masked score is -inf, and its weight 0 */
        for (int c = 0; c < KBLOCK; c++) {
            i32x16 valid = (j0 + c < b->ctx) & (j0 + c >= b->lo);
            s[c] = (f32x16)(((i32x16)s[c] & valid) | ((i32x16)minus_inf & ~valid));
        }
    f32x16 chunk_max = s[0];
    for (int c = 1; c < KBLOCK; c++) chunk_max = vmax(chunk_max, s[c]);
    f32x16 new_max = vmax(*run_max, chunk_max);
    /* a lane with no key yet (its window starts later) keeps max -inf: subtract 0 */
    i32x16 seen = new_max > -INFINITY;
    f32x16 base = (f32x16)((i32x16)new_max & seen);
    f32x16 alpha = exp16(*run_max - base), sum = (f32x16){0};
    if (masked)
        for (int c = 0; c < KBLOCK; c++)
            s[c] = (f32x16)((i32x16)exp16(s[c] - base) & (s[c] > minus_inf));
    else
        for (int c = 0; c < KBLOCK; c++) s[c] = exp16(s[c] - base);
    for (int c = 0; c < KBLOCK; c++) sum += s[c];
    *run_sum = *run_sum * alpha + sum;
    *run_max = new_max;
    return alpha;
}

/* Tokens m0 .. m0 + n - 1 (n <= QBLOCK) of one sequence, whose context lengths run
 * ctx0, ctx0 + 1, ..., against kv head g: the query heads g * group ... normed, rotated and
 * attending over keys [first_key(ctx0), ctx0 + n - 1) from the cache, where the step's K/V
 * already are. `work`: block_work_floats(group, D). */
static inline __attribute__((always_inline)) void attend_block_d(
    const struct tl_model *md, const struct tl_step *st, int m0, int n, int g, float *work,
    const int D) {
    const int NH = md->num_heads, NKV = md->num_kv_heads, group = NH / NKV;
    const int Q = NH * D, B = md->block_size, h0 = g * group;
    const int ct = md->cache_type, io = st->io_type;
    float *qt = work, *ot = qt + (size_t)group * D * QBLOCK;
    float *kbuf = ot + (size_t)group * D * QBLOCK;
    float *vbuf = kbuf + (size_t)KBLOCK * D, *cbuf = vbuf + (size_t)KBLOCK * D;
    /* the queries as rows [head][token][D] in ot's room first, then transposed into qt */
    block_queries(md, st, m0, n, g, ot, cbuf, cbuf + D, D);
    for (int hh = 0; hh < group; hh++) {
        for (int d0 = 0; d0 < D; d0 += 16) {
            f32x16 r[16];
            for (int t = 0; t < QBLOCK; t++)
                r[t] = load_f32(ot + ((size_t)hh * QBLOCK + t) * D + d0) * md->scale;
            transpose16(r);
            for (int i = 0; i < 16; i++)
                memcpy(qt + ((size_t)hh * D + d0 + i) * QBLOCK, &r[i], sizeof r[i]);
        }
    }
    memset(ot, 0, sizeof(float) * (size_t)group * D * QBLOCK);
    const int32_t *table = st->tables + (size_t)st->rows[m0] * st->table_stride;
    const struct block_bounds b = block_bounds(st, m0, n);
    f32x16 run_max[MAX_GROUP], run_sum[MAX_GROUP];
    for (int hh = 0; hh < group; hh++) {
        run_max[hh] = (f32x16){0} - INFINITY;
        run_sum[hh] = (f32x16){0};
    }
    const size_t row = (size_t)NKV * D;
    for (int j0 = first_key(b.ctx0, st->layer->window); j0 < b.end; j0 += KBLOCK) {
        /* the block's keys and values side by side (bfloat16 converted), zeros past the
         * last context: the score loops then broadcast from one base, not 16 pointers */
        for (int c = 0; c < KBLOCK; c++) {
            int j = j0 + c;
            float *kd = kbuf + (size_t)c * D, *vd = vbuf + (size_t)c * D;
            if (j >= b.end) {
                memset(kd, 0, sizeof(float) * (size_t)D);
                memset(vd, 0, sizeof(float) * (size_t)D);
                continue;
            }
            size_t off = ((size_t)table[j / B] * B + (size_t)(j % B)) * row + (size_t)g * D;
            if (ct == TL_F32) {
                copy_row(kd, (const float *)st->k_cache + off, D);
                copy_row(vd, (const float *)st->v_cache + off, D);
                continue;
            }
            const uint16_t *kh = (const uint16_t *)st->k_cache + off;
            const uint16_t *vh = (const uint16_t *)st->v_cache + off;
            for (int i = 0; i < D; i += 16) {
                f32x16 kv = load_bf16(kh + i), vv = load_bf16(vh + i);
                memcpy(kd + i, &kv, sizeof kv);
                memcpy(vd + i, &vv, sizeof vv);
            }
        }
        for (int hh = 0; hh < group; hh++) {
            f32x16 s[KBLOCK]; /* scores, then their weights */
            block_scores(qt + (size_t)hh * D * QBLOCK, kbuf, D, s);
            f32x16 alpha = block_softmax(md, &b, j0, s, &run_max[hh], &run_sum[hh]);
            block_values(ot + (size_t)hh * D * QBLOCK, vbuf, D, alpha, s);
        }
    }
    for (int hh = 0; hh < group; hh++)
        block_out(ot + (size_t)hh * D * QBLOCK, 1.0f / run_sum[hh], n, D,
                  (void *)elem_at(st->out, io, (size_t)m0 * Q + (size_t)(h0 + hh) * D), io,
                  (size_t)Q);
}

#include "tl_narrow_prompt.h"
#include "tl_prompt_amx.h"

/* `attend_block` with head_dim 64 and 128 compiled apart: a constant D makes each key's and
 * value's offset in the block an immediate, where a runtime D needed 16 index registers the
 * score loop reloaded from the stack. A bfloat16 cache goes to the tile unit where there is
 * one (`tl_prompt_amx.h`). */
static void attend_block(const struct tl_model *md, const struct tl_step *st, int m0, int n,
                         int g, float *work) {
#ifdef PROMPT_AMX
    if (md->cache_type == TL_BF16 && md->head_dim % 32 == 0 && amx_on()) {
        if (md->head_dim == 64)
            attend_block_amx64(md, st, m0, n, g, work);
        else if (md->head_dim == 128)
            attend_block_amx(md, st, m0, n, g, work, 128);
        else
            attend_block_amx(md, st, m0, n, g, work, md->head_dim);
        return;
    }
#endif
#ifdef TL_NARROW
    if (md->head_dim == 64)
        nattend_block(md, st, m0, n, g, work, 64);
    else if (md->head_dim == 128)
        nattend_block(md, st, m0, n, g, work, 128);
    else
        nattend_block(md, st, m0, n, g, work, md->head_dim);
    return;
#endif
    if (md->head_dim == 64)
        attend_block_d(md, st, m0, n, g, work, 64);
    else if (md->head_dim == 128)
        attend_block_d(md, st, m0, n, g, work, 128);
    else
        attend_block_d(md, st, m0, n, g, work, md->head_dim);
}

#endif

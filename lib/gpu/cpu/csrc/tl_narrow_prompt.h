/* trillm C kernels: prompt tokens' attention at 8 float lanes (`TL_NARROW`, AVX2).
 *
 * `attend_block_d`'s algorithm (`tl_prompt_attention.h`) with 8 query tokens a vector (one
 * lane each) instead of 16: the queries transposed into qt[head][d][lane], each key block
 * read once for those tokens and every query head of the kv head, scores and online softmax
 * per lane, values into ot[d][lane], an 8 x 8 transpose back to rows. A block of up to QBLOCK
 * (16) tokens runs as two such halves. Why: the 16-lane kernel's score vectors and transposes
 * are 64-byte types, which without AVX-512 live on the stack (`tl_narrow.h`); it ran at 8-10
 * GFLOP/s on one Zen 2 core, behind torch's SDPA (`perf/prompt_attention_bench.py`). */
#ifndef TL_NARROW_PROMPT_H
#define TL_NARROW_PROMPT_H

#ifdef TL_NARROW

#define NQ 8       /* query tokens a vector of lanes holds */
#define NKEYS 8    /* score accumulators a pass of `nblock_scores` holds */
#define NVDIMS 8   /* output dims a pass of `nblock_values` holds */

#define NSWAP(r, i, s, LO, HI)                                                                \
    do {                                                                                      \
        f32x8 a = r[i], b = r[i + s];                                                         \
        r[i] = __builtin_shufflevector(a, b, LO);                                             \
        r[i + s] = __builtin_shufflevector(a, b, HI);                                         \
    } while (0)
#define N4_LO 0, 1, 2, 3, 8, 9, 10, 11
#define N4_HI 4, 5, 6, 7, 12, 13, 14, 15
#define N2_LO 0, 1, 8, 9, 4, 5, 12, 13
#define N2_HI 2, 3, 10, 11, 6, 7, 14, 15
#define N1_LO 0, 8, 2, 10, 4, 12, 6, 14
#define N1_HI 1, 9, 3, 11, 5, 13, 7, 15

/* r[i][j] <- r[j][i] for 8 vectors of 8 (`transpose16`'s block swaps at sizes 4, 2, 1). */
static inline void transpose8(f32x8 *r) {
    for (int i = 0; i < 4; i++) NSWAP(r, i, 4, N4_LO, N4_HI);
    for (int i = 0; i < 8; i += 4)
        for (int k = 0; k < 2; k++) NSWAP(r, i + k, 2, N2_LO, N2_HI);
    for (int i = 0; i < 8; i += 2) NSWAP(r, i, 1, N1_LO, N1_HI);
}

static inline void nblock_scores(const float *qt, const float *kb, int D, f32x8 *s) {
    for (int c0 = 0; c0 < KBLOCK; c0 += NKEYS) {
        f32x8 acc[NKEYS];
        for (int c = 0; c < NKEYS; c++) acc[c] = (f32x8){0};
        for (int d = 0; d < D; d++) {
            const f32x8 q = ld8(qt + (size_t)d * NQ);
            for (int c = 0; c < NKEYS; c++) acc[c] += q * kb[(size_t)(c0 + c) * D + d];
        }
        for (int c = 0; c < NKEYS; c++) s[c0 + c] = acc[c];
    }
}

static inline void nblock_values(float *ot, const float *vb, int D, f32x8 alpha, const f32x8 *p) {
    for (int c0 = 0; c0 < KBLOCK; c0 += NKEYS)
        for (int d = 0; d < D; d += NVDIMS) {
            f32x8 o[NVDIMS];
            for (int i = 0; i < NVDIMS; i++) {
                o[i] = ld8(ot + (size_t)(d + i) * NQ);
                if (c0 == 0) o[i] *= alpha;
            }
            for (int c = 0; c < NKEYS; c++)
                for (int i = 0; i < NVDIMS; i++)
                    o[i] += p[c0 + c] * vb[(size_t)(c0 + c) * D + d + i];
            for (int i = 0; i < NVDIMS; i++) st8(ot + (size_t)(d + i) * NQ, o[i]);
        }
}

/* Lane t (token m0 + t; lanes past n copy the last token's) reads keys lo[t] <= j < ctx[t]. */
struct nblock_bounds {
    int ctx0, end, lo_max;
    i32x8 ctx, lo;
};

static inline struct nblock_bounds nblock_bounds(const struct tl_step *st, int m0, int n) {
    const int window = st->layer->window;
    struct nblock_bounds b;
    b.ctx0 = st->context_lens[m0];
    b.end = b.ctx0 + n - 1;
    const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const i32x8 ctx = b.ctx0 + lane;
    b.ctx = (i32x8)((ctx & (ctx <= b.end)) | ((b.end + (i32x8){0}) & (ctx > b.end)));
    b.lo = (i32x8){0};
    if (window > 0) b.lo = (b.ctx - window) & (b.ctx > window);
    b.lo_max = first_key(b.end, window);
    return b;
}

/* `block_softmax` over 8 lanes. */
static inline f32x8 nblock_softmax(const struct tl_model *md, const struct nblock_bounds *b,
                                   int j0, f32x8 *s, f32x8 *run_max, f32x8 *run_sum) {
    const int masked = j0 + KBLOCK > b->ctx0 || j0 < b->lo_max;
    const f32x8 minus_inf = (f32x8){0} - INFINITY;
    if (md->softcap > 0.0f)
        for (int c = 0; c < KBLOCK; c++) s[c] = tanh8(s[c] / md->softcap) * md->softcap;
    if (masked)
        for (int c = 0; c < KBLOCK; c++) {
            const i32x8 valid = (j0 + c < b->ctx) & (j0 + c >= b->lo);
            s[c] = (f32x8)(((i32x8)s[c] & valid) | ((i32x8)minus_inf & ~valid));
        }
    f32x8 chunk_max = s[0];
    for (int c = 1; c < KBLOCK; c++) chunk_max = vmax8(chunk_max, s[c]);
    const f32x8 new_max = vmax8(*run_max, chunk_max);
    const i32x8 seen = new_max > -INFINITY; /* a lane with no key yet subtracts 0 */
    const f32x8 base = (f32x8)((i32x8)new_max & seen);
    const f32x8 alpha = exp8(*run_max - base);
    f32x8 sum = (f32x8){0};
    for (int c = 0; c < KBLOCK; c++) {
        s[c] = masked ? (f32x8)((i32x8)exp8(s[c] - base) & (s[c] > minus_inf)) : exp8(s[c] - base);
        sum += s[c];
    }
    *run_sum = *run_sum * alpha + sum;
    *run_max = new_max;
    return alpha;
}

/* `attend_block_d` for tokens m0 .. m0 + n - 1, n <= NQ: `work` as there (block_work_floats);
 * the queries' rows go in its second half of group * D * QBLOCK floats. */
static inline __attribute__((always_inline)) void nattend_block_d(
    const struct tl_model *md, const struct tl_step *st, int m0, int n, int g, float *work,
    const int D) {
    const int NH = md->num_heads, NKV = md->num_kv_heads, group = NH / NKV;
    const int Q = NH * D, B = md->block_size, h0 = g * group;
    const int ct = md->cache_type, io = st->io_type;
    float *qt = work, *ot = qt + (size_t)group * D * NQ, *rows = work + (size_t)group * D * QBLOCK;
    float *kbuf = work + 2 * (size_t)group * D * QBLOCK;
    float *vbuf = kbuf + (size_t)KBLOCK * D, *cbuf = vbuf + (size_t)KBLOCK * D;
    block_queries(md, st, m0, n, g, rows, cbuf, cbuf + D, D);
    for (int hh = 0; hh < group; hh++)
        for (int d0 = 0; d0 < D; d0 += 8) {
            f32x8 r[8];
            for (int t = 0; t < NQ; t++)
                r[t] = ld8(rows + ((size_t)hh * QBLOCK + t) * D + d0) * md->scale;
            transpose8(r);
            for (int i = 0; i < 8; i++) st8(qt + ((size_t)hh * D + d0 + i) * NQ, r[i]);
        }
    memset(ot, 0, sizeof(float) * (size_t)group * D * NQ);
    const int32_t *table = st->tables + (size_t)st->rows[m0] * st->table_stride;
    const struct nblock_bounds b = nblock_bounds(st, m0, n);
    f32x8 run_max[MAX_GROUP], run_sum[MAX_GROUP];
    for (int hh = 0; hh < group; hh++) {
        run_max[hh] = (f32x8){0} - INFINITY;
        run_sum[hh] = (f32x8){0};
    }
    const size_t row = (size_t)NKV * D;
    for (int j0 = first_key(b.ctx0, st->layer->window); j0 < b.end; j0 += KBLOCK) {
        for (int c = 0; c < KBLOCK; c++) {
            const int j = j0 + c;
            float *kd = kbuf + (size_t)c * D, *vd = vbuf + (size_t)c * D;
            if (j >= b.end) {
                memset(kd, 0, sizeof(float) * (size_t)D);
                memset(vd, 0, sizeof(float) * (size_t)D);
                continue;
            }
            const size_t off = ((size_t)table[j / B] * B + (size_t)(j % B)) * row + (size_t)g * D;
            for (int i = 0; i < D; i += 8) {
                if (ct == TL_F32) {
                    st8(kd + i, ld8((const float *)st->k_cache + off + i));
                    st8(vd + i, ld8((const float *)st->v_cache + off + i));
                } else {
                    st8(kd + i, ld8_bf16((const uint16_t *)st->k_cache + off + i));
                    st8(vd + i, ld8_bf16((const uint16_t *)st->v_cache + off + i));
                }
            }
        }
        for (int hh = 0; hh < group; hh++) {
            f32x8 s[KBLOCK];
            nblock_scores(qt + (size_t)hh * D * NQ, kbuf, D, s);
            const f32x8 alpha = nblock_softmax(md, &b, j0, s, &run_max[hh], &run_sum[hh]);
            nblock_values(ot + (size_t)hh * D * NQ, vbuf, D, alpha, s);
        }
    }
    for (int hh = 0; hh < group; hh++) {
        const f32x8 inv = 1.0f / run_sum[hh];
        void *out = (void *)elem_at(st->out, io, (size_t)m0 * Q + (size_t)(h0 + hh) * D);
        for (int d0 = 0; d0 < D; d0 += 8) {
            f32x8 r[8];
            for (int i = 0; i < 8; i++) r[i] = ld8(ot + ((size_t)hh * D + d0 + i) * NQ) * inv;
            transpose8(r);
            for (int t = 0; t < n; t++) {
                if (io == TL_F32) {
                    st8((float *)out + (size_t)t * Q + d0, r[t]);
                    continue;
                }
                uint16_t *h = (uint16_t *)out + (size_t)t * Q + d0;
                for (int i = 0; i < 8; i++) h[i] = f32_to_bf16(r[t][i]);
            }
        }
    }
}

/* A block of up to QBLOCK tokens as halves of NQ. */
static inline __attribute__((always_inline)) void nattend_block(
    const struct tl_model *md, const struct tl_step *st, int m0, int n, int g, float *work,
    const int D) {
    for (int t = 0; t < n; t += NQ)
        nattend_block_d(md, st, m0 + t, n - t < NQ ? n - t : NQ, g, work, D);
}

#endif /* TL_NARROW */
#endif

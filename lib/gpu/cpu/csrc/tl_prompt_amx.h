/* trillm C kernels: a prompt block's attention over a bfloat16 cache on AMX tiles.
 *
 * Why: in `attend_block_d` the scores and the weighted values are float32 FMAs, 16
 * multiply-adds an instruction, and they were half of a bfloat16 prefill's attention (perf
 * annotate of 16 x 128 tokens of SmolLM2: 6.7 ms a layer, 45 GFLOP/s on one core).
 * A tile product is 16 x 16 x 32 multiply-adds. The online softmax between them is
 * `block_softmax`, as in the float32 block.
 *
 * The products, for a block of 16 query tokens (lanes) and 16 keys:
 * - scores: S^T [key][lane] = K [key][d] . Q^T: the keys are the A operand, read from the
 *   cache in place (16 rows of one cache block, `NKV * D` elements apart) or, where a key
 *   block crosses a cache block or the context's end, from a copy with zeros past the end;
 *   the queries, scaled and rounded to bfloat16 once per block, are the B operand as pairs
 *   [d / 2][lane] (`qp`). A score tile's row is a key's 16 lanes: the vector layout
 *   `block_softmax` takes.
 * - values: O [lane][d] += P [lane][key] . V [key][d]: the weights transposed to rows and
 *   rounded to bfloat16 (the A operand), the values as key pairs [key / 2][d] (B), 16 dims a
 *   tile; each key block's product is added to the lane's output row after the softmax's
 *   rescale (`alpha`). The output rows come out in token order, with no transpose.
 * Rounding: the queries and the weights to bfloat16, as torch's bfloat16 SDPA holds q and
 * casts the weights before the product with V; sums in float32.
 *
 * Measured (one layer, SmolLM2's shape, one thread, CPU time, against the float32 FMAs over
 * the same bfloat16 cache; perf/prompt_attention_bench.py, 11 rounds alternated): 16 x 128
 * tokens 4.29 against 5.75 ms, one 2048-token prompt 27.9 against 52.1 ms; a 16 x 128 prefill
 * step 849 against 913 ms, its attention 150 against 187 (`--step --dtype bfloat16 --threads 1
 * --cpu-time`). Head dim 64 then keeps each head's sums in tiles over all its keys
 * (`attend_block_amx64`, lazy rescale): against the per-block rescale, 16 x 128 3.80 against
 * 3.98 ms, 1 x 2048 20.2 against 26.4 ms, the step 705 against 724 ms and its attention 118
 * against 138 (the same commands, alternated). What remains is mostly the softmax's exp.
 */
#ifndef TL_PROMPT_AMX_H
#define TL_PROMPT_AMX_H

#include "tl_amx.h"

#ifdef TL_AMX
#define PROMPT_AMX 1

/* Tiles: 0 keys (A), 1 query pairs (B), 2 scores (C), 3 weights (A, 16 keys), 4 value pairs
 * (B, 8 rows), 5 output (C). */
static inline void prompt_amx_configure(void) {
    static const uint8_t rows[6] = {16, 16, 16, 16, 8, 16};
    static const uint16_t colsb[6] = {64, 64, 64, 32, 64, 64};
    amx_load_config(6, rows, colsb);
}

/* Values 2i and 2i + 1 (`a`, `b`: D bfloat16 each, D % 32 == 0) interleaved into `out` [D]
 * words: the tile unit's B operand for weights [lane][key] . values [key][d]. */
static inline void pair_rows(const uint16_t *a, const uint16_t *b, int D, uint32_t *out) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int d = 0; d < D; d += 32) {
        __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
        _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(x, lo, y));
        _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
}

/* The queries' pairs of a block: each row scaled and rounded (its words are its pairs), the
 * 16 rows' words transposed into `qp` [group][D / 2][QBLOCK]. `rows` [group][QBLOCK][D];
 * `bf`: QBLOCK * D bfloat16 of room. */
static inline void query_pairs(const float *rows, int group, int D, float scale, uint16_t *bf,
                               uint32_t *qp) {
    for (int hh = 0; hh < group; hh++) {
        for (int t = 0; t < QBLOCK; t++)
            for (int d = 0; d < D; d += 16)
                store_bf16(bf + (size_t)t * D + d,
                           load_f32(rows + ((size_t)hh * QBLOCK + t) * D + d) * scale);
        for (int p0 = 0; p0 < D / 2; p0 += 16) {
            f32x16 r[16];
            for (int t = 0; t < QBLOCK; t++) memcpy(&r[t], bf + (size_t)t * D + 2 * p0, 64);
            transpose16(r);
            for (int i = 0; i < 16; i++)
                memcpy(qp + ((size_t)hh * (D / 2) + p0 + i) * QBLOCK, &r[i], sizeof r[i]);
        }
    }
}

/* How far a lane's weights may grow past 1 before its output tiles are rescaled: e^8. */
#define LAZY_RESCALE 8.0f

/* `attend_block_amx` for head_dim 64, each head's output kept in four tiles over all its keys
 * (tiles 4-7), so the sums are not stored, rescaled and reloaded after every key block: a
 * lane's weights are taken against a reference max that moves only when a score passes it by
 * more than LAZY_RESCALE (weights then up to e^8, exact enough in float32 sums and bfloat16
 * weights), and only then are the tiles rescaled. 32 keys a step: the weights [lane][32 keys]
 * and the values' 16 key pairs fill whole 16 x 64-byte tiles, as the keys and queries do, so
 * tiles 0 and 1 take both products. Heads one after another (the tiles hold one head). */
static __attribute__((noinline)) void attend_block_amx64(const struct tl_model *md,
                                                          const struct tl_step *st, int m0, int n,
                                                          int g, float *work) {
    enum { D = 64, KSTEP = 2 * KBLOCK };
    const int NH = md->num_heads, NKV = md->num_kv_heads, group = NH / NKV;
    const int Q = NH * D, B = md->block_size, h0 = g * group, io = st->io_type;
    float *rows = work + (size_t)group * D * QBLOCK; /* queries, then outputs [head][lane][D] */
    uint32_t *qp = (uint32_t *)work;
    uint16_t *kb = (uint16_t *)(rows + (size_t)group * D * QBLOCK); /* [KSTEP][D] */
    uint32_t *vp = (uint32_t *)(kb + (size_t)KSTEP * D);            /* [KSTEP / 2][D] */
    float *cbuf = (float *)(vp + (size_t)KSTEP / 2 * D), *sbuf = cbuf + D;
    float *stile = work + block_base_floats(group, D); /* two score tiles */
    uint16_t *ptile = (uint16_t *)(stile + 512);       /* [lane][KSTEP] weights */
    uint32_t *vpairs = (uint32_t *)(stile + 768);      /* [PAIR_KEYS / 2][D], shared */
    block_queries(md, st, m0, n, g, rows, cbuf, sbuf, D);
    query_pairs(rows, group, D, md->scale, kb, qp);
    const int32_t *table = st->tables + (size_t)st->rows[m0] * st->table_stride;
    const struct block_bounds b = block_bounds(st, m0, n);
    const size_t row = (size_t)NKV * D, stride = row * sizeof(uint16_t);
    const uint16_t *kc = (const uint16_t *)st->k_cache, *vc = (const uint16_t *)st->v_cache;
    const f32x16 minus_inf = (f32x16){0} - INFINITY;
    const int first = first_key(b.ctx0, st->layer->window);
    /* the value pairs once for every head where the block's keys fit, else a step's at a time */
    const int steps_end = first + (b.end - first + KSTEP - 1) / KSTEP * KSTEP;
    const int shared = steps_end - first <= PAIR_KEYS;
    uint16_t *zero = (uint16_t *)cbuf; /* a row of zeros, past the context's end */
    memset(zero, 0, sizeof(uint16_t) * D);
    for (int j0 = first; shared && j0 < steps_end; j0 += 2) {
        const uint16_t *pair[2];
        for (int c = 0; c < 2; c++) {
            int j = j0 + c;
            pair[c] = j >= b.end ? zero
                                 : vc + ((size_t)table[j / B] * B + (size_t)(j % B)) * row +
                                       (size_t)g * D;
        }
        pair_rows(pair[0], pair[1], D, vpairs + (size_t)(j0 - first) / 2 * D);
    }
    amx_configure(); /* eight tiles of 16 rows x 64 bytes, as the products' */
    for (int hh = 0; hh < group; hh++) {
        float *out = rows + (size_t)hh * QBLOCK * D;
        f32x16 ref = minus_inf, run_sum = (f32x16){0};
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int j0 = first; j0 < b.end; j0 += KSTEP) {
            const uint16_t *keys[2];
            size_t kstride[2];
            const uint16_t *vr[KSTEP];
            for (int half = 0; half < 2; half++) { /* in place where 16 rows of a cache block */
                int k0 = j0 + half * KBLOCK;
                int whole = k0 + KBLOCK <= b.end && k0 % B + KBLOCK <= B;
                keys[half] = kb + (size_t)half * KBLOCK * D;
                kstride[half] = (size_t)D * sizeof(uint16_t);
                for (int c = 0; c < KBLOCK; c++) {
                    int j = k0 + c;
                    uint16_t *kd = kb + (size_t)(half * KBLOCK + c) * D;
                    if (j >= b.end) {
                        memset(kd, 0, sizeof(uint16_t) * D);
                        vr[half * KBLOCK + c] = kd; /* zeros: weight 0 times zero */
                        continue;
                    }
                    size_t off = ((size_t)table[j / B] * B + (size_t)(j % B)) * row + (size_t)g * D;
                    if (whole && c == 0) {
                        keys[half] = kc + off;
                        kstride[half] = stride;
                    }
                    if (!whole) memcpy(kd, kc + off, sizeof(uint16_t) * D);
                    vr[half * KBLOCK + c] = vc + off;
                }
            }
            const uint32_t *vs = vp;
            if (shared)
                vs = vpairs + (size_t)(j0 - first) / 2 * D;
            else
                for (int c = 0; c < KSTEP; c += 2)
                    pair_rows(vr[c], vr[c + 1], D, vp + (size_t)c / 2 * D);
            f32x16 s[KSTEP];
            const int nk = b.end - j0 > KBLOCK ? KSTEP : KBLOCK; /* a last half step: 16 */
            for (int half = 0; half < nk / KBLOCK; half++) {
                _tile_zero(2);
                _tile_loadd(0, keys[half], kstride[half]);
                _tile_loadd(1, qp + (size_t)hh * (D / 2) * QBLOCK, 64);
                _tile_dpbf16ps(2, 0, 1);
                _tile_loadd(0, keys[half] + 32, kstride[half]);
                _tile_loadd(1, qp + ((size_t)hh * (D / 2) + 16) * QBLOCK, 64);
                _tile_dpbf16ps(2, 0, 1);
                _tile_stored(2, stile + half * 256, 64);
            }
            for (int c = 0; c < nk; c++) s[c] = load_f32(stile + c * 16);
            const int masked = j0 + nk > b.ctx0 || j0 < b.lo_max;
            if (md->softcap > 0.0f)
                for (int c = 0; c < nk; c++) s[c] = tanh16(s[c] / md->softcap) * md->softcap;
            if (masked)
                for (int c = 0; c < nk; c++) {
                    i32x16 valid = (j0 + c < b.ctx) & (j0 + c >= b.lo);
                    s[c] = (f32x16)(((i32x16)s[c] & valid) | ((i32x16)minus_inf & ~valid));
                }
            f32x16 chunk_max = s[0];
            for (int c = 1; c < nk; c++) chunk_max = vmax(chunk_max, s[c]);
            i32x16 moved = chunk_max > ref + LAZY_RESCALE; /* -inf + 8 is -inf: a first key */
            if (hmax((f32x16)((i32x16)((f32x16){0} + 1.0f) & moved)) > 0.0f) {
                f32x16 new_ref = (f32x16)(((i32x16)chunk_max & moved) | ((i32x16)ref & ~moved));
                i32x16 seen = new_ref > -INFINITY;
                f32x16 alpha = exp16(ref - (f32x16)((i32x16)new_ref & seen));
                alpha = (f32x16)((i32x16)alpha & (ref > -INFINITY)); /* from nothing: 0 */
                alpha = (f32x16)(((i32x16)alpha & moved) | ((i32x16)((f32x16){0} + 1.0f) & ~moved));
                run_sum *= alpha;
                _tile_stored(4, out, D * sizeof(float));
                _tile_stored(5, out + 16, D * sizeof(float));
                _tile_stored(6, out + 32, D * sizeof(float));
                _tile_stored(7, out + 48, D * sizeof(float));
                for (int t = 0; t < QBLOCK; t++)
                    for (int d = 0; d < D; d += 16) {
                        f32x16 o = load_f32(out + (size_t)t * D + d) * alpha[t];
                        memcpy(out + (size_t)t * D + d, &o, sizeof o);
                    }
                _tile_loadd(4, out, D * sizeof(float));
                _tile_loadd(5, out + 16, D * sizeof(float));
                _tile_loadd(6, out + 32, D * sizeof(float));
                _tile_loadd(7, out + 48, D * sizeof(float));
                ref = new_ref;
            }
            const f32x16 base = (f32x16)((i32x16)ref & (ref > -INFINITY));
            f32x16 sum = (f32x16){0};
            for (int c = 0; c < nk; c++) {
                s[c] = (f32x16)((i32x16)exp16(s[c] - base) & (s[c] > minus_inf));
                sum += s[c];
            }
            for (int c = nk; c < KSTEP; c++) s[c] = (f32x16){0}; /* keys past the end */
            run_sum += sum;
            transpose16(s); /* s[lane]: keys 0-15's weights; s[16 + lane]: keys 16-31's */
            transpose16(s + KBLOCK);
            for (int t = 0; t < QBLOCK; t++) {
                __m512bh w = _mm512_cvtne2ps_pbh((__m512)s[KBLOCK + t], (__m512)s[t]);
                memcpy(ptile + t * KSTEP, &w, sizeof w);
            }
            _tile_loadd(0, ptile, KSTEP * sizeof(uint16_t));
            _tile_loadd(1, vs, D * sizeof(uint32_t));
            _tile_dpbf16ps(4, 0, 1);
            _tile_loadd(1, vs + 16, D * sizeof(uint32_t));
            _tile_dpbf16ps(5, 0, 1);
            _tile_loadd(1, vs + 32, D * sizeof(uint32_t));
            _tile_dpbf16ps(6, 0, 1);
            _tile_loadd(1, vs + 48, D * sizeof(uint32_t));
            _tile_dpbf16ps(7, 0, 1);
        }
        _tile_stored(4, out, D * sizeof(float));
        _tile_stored(5, out + 16, D * sizeof(float));
        _tile_stored(6, out + 32, D * sizeof(float));
        _tile_stored(7, out + 48, D * sizeof(float));
        const f32x16 inv = 1.0f / run_sum;
        void *dst = (void *)elem_at(st->out, io, (size_t)m0 * Q + (size_t)(h0 + hh) * D);
        for (int t = 0; t < n; t++)
            for (int d = 0; d < D; d += 16) {
                f32x16 v = load_f32(out + (size_t)t * D + d) * inv[t];
                if (io == TL_F32)
                    memcpy((float *)dst + (size_t)t * Q + d, &v, sizeof v);
                else
                    store_bf16((uint16_t *)dst + (size_t)t * Q + d, v);
            }
    }
    _tile_release();
}

static __attribute__((noinline)) void attend_block_amx(
    const struct tl_model *md, const struct tl_step *st, int m0, int n, int g, float *work,
    const int D) {
    const int NH = md->num_heads, NKV = md->num_kv_heads, group = NH / NKV;
    const int Q = NH * D, B = md->block_size, h0 = g * group, io = st->io_type;
    float *rows = work + (size_t)group * D * QBLOCK; /* queries, then outputs [head][lane][D] */
    uint32_t *qp = (uint32_t *)work;                /* [head][D / 2][lane] query pairs */
    uint16_t *kb = (uint16_t *)(rows + (size_t)group * D * QBLOCK); /* [KBLOCK][D] */
    uint32_t *vp = (uint32_t *)(kb + (size_t)KBLOCK * D * 2);       /* [KBLOCK / 2][D] */
    float *cbuf = (float *)(vp + (size_t)KBLOCK * D), *sbuf = cbuf + D;
    float *stile = work + block_base_floats(group, D), *otile = stile + 256;
    uint16_t *ptile = (uint16_t *)(otile + 256);
    block_queries(md, st, m0, n, g, rows, cbuf, sbuf, D);
    query_pairs(rows, group, D, md->scale, kb, qp); /* rounded in the keys' room: free until
                                                     * the first key block */
    memset(rows, 0, sizeof(float) * (size_t)group * D * QBLOCK);
    const int32_t *table = st->tables + (size_t)st->rows[m0] * st->table_stride;
    const struct block_bounds b = block_bounds(st, m0, n);
    f32x16 run_max[MAX_GROUP], run_sum[MAX_GROUP];
    for (int hh = 0; hh < group; hh++) {
        run_max[hh] = (f32x16){0} - INFINITY;
        run_sum[hh] = (f32x16){0};
    }
    const size_t row = (size_t)NKV * D, stride = row * sizeof(uint16_t);
    const uint16_t *kc = (const uint16_t *)st->k_cache, *vc = (const uint16_t *)st->v_cache;
    prompt_amx_configure();
    for (int j0 = first_key(b.ctx0, st->layer->window); j0 < b.end; j0 += KBLOCK) {
        /* keys in place where the 16 are rows of one cache block, all in the context */
        const int whole = j0 + KBLOCK <= b.end && j0 % B + KBLOCK <= B;
        const uint16_t *keys = kb;
        size_t kstride = (size_t)D * sizeof(uint16_t);
        const uint16_t *vr[KBLOCK];
        for (int c = 0; c < KBLOCK; c++) {
            int j = j0 + c;
            if (j >= b.end) {
                memset(kb + (size_t)c * D, 0, sizeof(uint16_t) * (size_t)D);
                vr[c] = kb + (size_t)c * D; /* zeros: a weight 0 times a zero, never a NaN */
                continue;
            }
            size_t off = ((size_t)table[j / B] * B + (size_t)(j % B)) * row + (size_t)g * D;
            if (whole && c == 0) {
                keys = kc + off;
                kstride = stride;
            }
            if (!whole) memcpy(kb + (size_t)c * D, kc + off, sizeof(uint16_t) * (size_t)D);
            vr[c] = vc + off;
        }
        for (int c = 0; c < KBLOCK; c += 2) pair_rows(vr[c], vr[c + 1], D, vp + (size_t)c / 2 * D);
        for (int hh = 0; hh < group; hh++) {
            _tile_zero(2);
            for (int k = 0; k < D; k += 32) {
                _tile_loadd(0, keys + k, kstride);
                _tile_loadd(1, qp + ((size_t)hh * (D / 2) + k / 2) * QBLOCK, 64);
                _tile_dpbf16ps(2, 0, 1);
            }
            _tile_stored(2, stile, 64);
            f32x16 s[KBLOCK];
            for (int c = 0; c < KBLOCK; c++) s[c] = load_f32(stile + c * 16);
            f32x16 alpha = block_softmax(md, &b, j0, s, &run_max[hh], &run_sum[hh]);
            transpose16(s); /* s[lane]: the lane's 16 weights */
            for (int t = 0; t < QBLOCK; t++) store_bf16(ptile + t * 16, s[t]);
            _tile_loadd(3, ptile, 32);
            float *out = rows + (size_t)hh * QBLOCK * D;
            for (int d0 = 0; d0 < D; d0 += 16) {
                _tile_zero(5);
                _tile_loadd(4, vp + d0, (size_t)D * sizeof(uint32_t));
                _tile_dpbf16ps(5, 3, 4);
                _tile_stored(5, otile, 64);
                for (int t = 0; t < QBLOCK; t++) {
                    f32x16 o = load_f32(out + (size_t)t * D + d0) * alpha[t] +
                               load_f32(otile + t * 16);
                    memcpy(out + (size_t)t * D + d0, &o, sizeof o);
                }
            }
        }
    }
    _tile_release();
    for (int hh = 0; hh < group; hh++) {
        const f32x16 inv = 1.0f / run_sum[hh];
        void *dst = (void *)elem_at(st->out, io, (size_t)m0 * Q + (size_t)(h0 + hh) * D);
        for (int t = 0; t < n; t++) {
            const float *o = rows + ((size_t)hh * QBLOCK + t) * D;
            for (int d = 0; d < D; d += 16) {
                f32x16 v = load_f32(o + d) * inv[t];
                if (io == TL_F32)
                    memcpy((float *)dst + (size_t)t * Q + d, &v, sizeof v);
                else
                    store_bf16((uint16_t *)dst + (size_t)t * Q + d, v);
            }
        }
    }
}
#endif

#endif

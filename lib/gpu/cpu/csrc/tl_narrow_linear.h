/* trillm C kernels: `linear_tiles` and `gate_up_tiles` at 8 float lanes (`tl_narrow.h`).
 *
 * The same contract as the 64-byte functions in `tl_linear.h` (which call these where
 * `TL_NARROW` is built): tiles [t0, t1) against every token, a tile at a time against blocks
 * of up to NROWS tokens; the first block reads the tile from memory, the others from L1/L2
 * (a tile of SmolLM2 is 36-96 KB). The sums land in a small float array (`acc`), the
 * epilogue (LoRA delta, bias, store or add, the gate's activation) reads them from there in
 * 8-lane halves. Included by `tl_linear.h` after OUT_STORE / OUT_ADD. */
#ifndef TL_NARROW_LINEAR_H
#define TL_NARROW_LINEAR_H

#ifdef TL_NARROW

/* acc[16] += the LoRA delta of tile `t` for token m: `lora_delta`'s sums (`tl_lora.h`) in two
 * 8-lane halves, a part's sum kept to its own rows where a tile crosses a part's end. */
static inline void nlora_add(const struct tl_lora_rows *lr, int t, int m, float *acc) {
    const int s = lr->slots[m];
    if (s < 0) return;
    const struct tl_lora *lin = lr->lin;
    const int r = lin->ranks[s], R = lr->R, n0 = t * 16;
    if (!r) return;
    const size_t at = ((size_t)s * lin->tiles + t) * R * 16;
    const float *tm = lr->t + (size_t)m * lr->ldt;
    for (int p = 0, start = 0; p < lin->parts; start = lin->part_end[p], p++) {
        const int end = lin->part_end[p];
        if (end <= n0 || start >= n0 + 16) continue;
        const float *tp = tm + p * R;
        f32x8 v[2] = {{0}, {0}};
        for (int w = 0; w < r; w++)
            for (int h = 0; h < 2; h++)
                v[h] += (lr->type == TL_BF16
                             ? ld8_bf16((const uint16_t *)lin->bt + at + (size_t)w * 16 + h * 8)
                             : ld8((const float *)lin->bt + at + (size_t)w * 16 + h * 8)) *
                        tp[w];
        for (int h = 0; h < 2; h++) {
            if (start <= n0 && end >= n0 + 16) {
                st8(acc + h * 8, ld8(acc + h * 8) + v[h]);
                continue;
            }
            for (int i = 0; i < 8; i++)
                if (n0 + h * 8 + i >= start && n0 + h * 8 + i < end) acc[h * 8 + i] += v[h][i];
        }
    }
}

/* From this many tokens a quantized tile is dequantised once and multiplied as float32
 * (`nq4_dequant`); below, the quants are converted inside the token blocks. */
#define NQ_DEQUANT_MIN 8

/* Where tile `t` is read from: the weight itself, or for a quantized weight against
 * NQ_DEQUANT_MIN tokens or more, `deq` (when allocated) filled with its float32 values, as
 * tile 0 of a float32 weight (`*wt`, `*tt`). */
static inline const void *ntile_source(const void *w, int wtype, int K, int t, float *deq,
                                       int *wt, int *tt) {
    *wt = wtype;
    *tt = t;
    if (!deq) return w;
    const uint8_t *bytes = (const uint8_t *)w;
    if (wtype == TL_Q4)
        nq4_dequant(bytes + (size_t)t * (K / 32) * Q4_GROUP, K, deq);
    else
        nq8_dequant(bytes + (size_t)t * (K / 32) * Q8_GROUP, K, deq);
    *wt = TL_F32;
    *tt = 0;
    return deq;
}

/* A tile's float32 room for `ntile_source`, or NULL (dense weights, few tokens, no memory). */
static inline float *ndequant_room(int wtype, int K, int M) {
    if ((wtype != TL_Q4 && wtype != TL_Q8) || M < NQ_DEQUANT_MIN) return NULL;
    return aligned_alloc(32, sizeof(float) * 16 * (size_t)K);
}

static void nlinear_tiles(const void *w, int wtype, int K, int N, const float *bias,
                          const float *x, int ldx, int M, const float *xsum, float *out, int ldo,
                          int mode, float alpha, int t0, int t1,
                          const struct tl_lora_rows *lora) {
    float acc[NROWS * 16] __attribute__((aligned(32)));
    const int G = wtype == TL_Q4 ? K / 32 : 0;
    float *deq = t0 < t1 ? ndequant_room(wtype, K, M) : NULL;
    for (int t = t0; t < t1; t++) {
        const int n0 = t * 16, width = N - n0 < 16 ? N - n0 : 16;
        int wt, tt;
        const void *src = ntile_source(w, wtype, K, t, deq, &wt, &tt);
        for (int m = 0, done; m < M; m += done) {
            const float *xm = x + (size_t)m * ldx, *sm = xsum ? xsum + (size_t)m * G : NULL;
            done = ntile_dot(src, wt, K, tt, xm, ldx, sm, G, M - m, acc);
            for (int i = 0; i < done; i++) {
                float *a = acc + i * 16, *o = out + (size_t)(m + i) * ldo + n0;
                if (lora) nlora_add(lora, t, m + i, a);
                if (width == 16) {
                    for (int h = 0; h < 16; h += 8) {
                        f32x8 v = ld8(a + h);
                        if (bias) v += ld8(bias + n0 + h);
                        if (mode == OUT_ADD) v = ld8(o + h) + alpha * v;
                        st8(o + h, v);
                    }
                    continue;
                }
                for (int r = 0; r < width; r++) {
                    float v = a[r] + (bias ? bias[n0 + r] : 0.0f);
                    o[r] = mode == OUT_ADD ? o[r] + alpha * v : v;
                }
            }
        }
    }
    free(deq);
}

static void ngate_up_tiles(const void *w, int wtype, int K, const float *x, int ldx, int M,
                           const float *xsum, float *act, int I, int j0, int j1, int kind,
                           int interleaved, const struct tl_lora_rows *lora) {
    float g[NROWS * 16] __attribute__((aligned(32))), u[NROWS * 16] __attribute__((aligned(32)));
    const int G = wtype == TL_Q4 ? K / 32 : 0;
    float *deq = j0 < j1 ? ndequant_room(wtype, K, M) : NULL;
    float *deq_up = deq ? ndequant_room(wtype, K, M) : NULL;
    if (!deq_up) { /* both tiles dequantised, or neither */
        free(deq);
        deq = NULL;
    }
    for (int j = j0; j < j1; j++) {
        const int gt = interleaved ? 2 * j : j, ut = interleaved ? 2 * j + 1 : I / 16 + j;
        int gw, gtt, uw, utt;
        const void *gsrc = ntile_source(w, wtype, K, gt, deq, &gw, &gtt);
        const void *usrc = ntile_source(w, wtype, K, ut, deq_up, &uw, &utt);
        for (int m = 0, done; m < M; m += done) {
            const float *xm = x + (size_t)m * ldx, *sm = xsum ? xsum + (size_t)m * G : NULL;
            done = ntile_dot(gsrc, gw, K, gtt, xm, ldx, sm, G, M - m, g);
            ntile_dot(usrc, uw, K, utt, xm, ldx, sm, G, done, u);
            for (int i = 0; i < done; i++) {
                if (lora) {
                    nlora_add(lora, j, m + i, g + i * 16);
                    nlora_add(lora, I / 16 + j, m + i, u + i * 16);
                }
                float *o = act + (size_t)(m + i) * I + j * 16;
                for (int h = 0; h < 16; h += 8)
                    st8(o + h, gated8(ld8(g + i * 16 + h), ld8(u + i * 16 + h), kind));
            }
        }
    }
    free(deq);
    free(deq_up);
}

#endif /* TL_NARROW */
#endif

/* trillm C kernels: LoRA deltas inside the decode step, y += B[s] (A[s] x) per token.
 *
 * Why here: a step with an adapter row ran the torch forward instead of the C step, at twice
 * its time per token (lib/gpu/lora/_lora.py; perf/lora_bench.py). The delta is Punica's shrink and
 * expand, per token by its slot (`slots[m]`, -1: the base model, nothing added):
 *
 *   shrink  t[m, p R + w] = A[s][p R + w] . x[m]        (each part p of a merged linear)
 *   expand  out[m, n]    += sum_w B[s][n, p(n) R + w] t[m, p(n) R + w]
 *
 * The shrink is a few rows (rank r <= R of each part) and every thread computes it for all the
 * step's tokens into its own `t` (as each thread norms every row itself: no barrier). The
 * expand is added to a tile's accumulators before the bias, the residual add and the gate's
 * activation, by the thread that owns the tile. B is kept for it in the tiles' layout
 * (`bt` [slots, tiles, R, 16]: the rows of a 16-row tile side by side, each row's own part's
 * R columns, rank-major), so a tile's delta is r vector multiply-adds and no horizontal sum.
 * A and B are the slot buffers of `_lora_slots.LoraLinear` (float32 or bfloat16, the model's
 * type), filled when an adapter is put in a slot, their addresses given once at bind time.
 */
#ifndef TL_LORA_H
#define TL_LORA_H

#include "tl_vec.h"

#define LORA_MAX_PARTS 3

/* One adapted linear's slot buffers. `ranks[s]`: the rank of slot s's adapter in this linear
 * (0: the adapter has none of its parts, or the slot is free). `part_end[p]`: the output row
 * where part p (q, k, v; gate, up) ends. */
struct tl_lora {
    const void *a;  /* [slots, parts * R, K], each part's A (rows past its rank are zero) */
    const void *bt; /* [slots, tiles, R, 16] */
    const int32_t *ranks;
    int32_t parts, tiles;
    int32_t part_end[LORA_MAX_PARTS];
};

/* A step's view of one linear's adapters: its buffers, each token's slot, and this thread's
 * shrink of the tokens (`t` [M, ldt]). */
struct tl_lora_rows {
    const struct tl_lora *lin;
    const int32_t *slots;
    float *t;
    int R, type, ldt;
};

static inline float dot_bf16(const uint16_t *a, const float *b, int D) {
#ifdef TL_NARROW
    f32x8 acc8 = {0};
    int j = 0;
    for (; j + 8 <= D; j += 8) acc8 += ld8_bf16(a + j) * ld8(b + j);
    float s8 = hsum8(acc8);
    for (; j < D; j++) s8 += bf16_to_f32(a[j]) * b[j];
    return s8;
#endif
    f32x16 acc = {0};
    int i = 0;
    for (; i + 16 <= D; i += 16) acc += load_bf16(a + i) * load_f32(b + i);
    float s = hsum(acc);
    for (; i < D; i++) s += bf16_to_f32(a[i]) * b[i];
    return s;
}

/* This thread's shrink of x [M, K] (stride ldx) for `lin` into `lr->t`; returns `lr` set to
 * `lin`, or NULL when nothing is to be added (no adapter in the step, or a linear without
 * slots). */
static const struct tl_lora_rows *lora_shrink(struct tl_lora_rows *lr, const struct tl_lora *lin,
                                              const float *x, int ldx, int M, int K) {
    if (!lr->slots || !lin || !lin->a) return NULL;
    lr->lin = lin;
    const int R = lr->R;
    for (int m = 0; m < M; m++) {
        const int s = lr->slots[m];
        if (s < 0) continue;
        const int r = lin->ranks[s];
        const float *xm = x + (size_t)m * ldx;
        float *tm = lr->t + (size_t)m * lr->ldt;
        for (int p = 0; p < lin->parts; p++)
            for (int w = 0; w < r; w++) {
                size_t row = ((size_t)s * lin->parts + p) * R + w;
                tm[p * R + w] = lr->type == TL_BF16
                                    ? dot_bf16((const uint16_t *)lin->a + row * K, xm, K)
                                    : dot((const float *)lin->a + row * K, xm, K);
            }
    }
    return lr;
}

/* The expand of token m over output tile `tile` (rows 16 tile ..): 16 lanes to add to the
 * tile's accumulator (zero for a base token). A tile across a part's end (a part of rows not
 * a multiple of 16) takes each part's sum on its own lanes. */
static inline f32x16 lora_delta(const struct tl_lora_rows *lr, int tile, int m) {
    f32x16 d = {0};
    const int s = lr->slots[m];
    if (s < 0) return d;
    const struct tl_lora *lin = lr->lin;
    const int r = lin->ranks[s], R = lr->R, n0 = tile * 16;
    if (!r) return d;
    const size_t at = ((size_t)s * lin->tiles + tile) * R * 16;
    const float *tm = lr->t + (size_t)m * lr->ldt;
    for (int p = 0, start = 0; p < lin->parts; start = lin->part_end[p], p++) {
        const int end = lin->part_end[p];
        if (end <= n0 || start >= n0 + 16) continue;
        const float *tp = tm + p * R;
        f32x16 v = {0};
        if (lr->type == TL_BF16) {
            const uint16_t *b = (const uint16_t *)lin->bt + at;
            for (int w = 0; w < r; w++) v += load_bf16(b + (size_t)w * 16) * tp[w];
        } else {
            const float *b = (const float *)lin->bt + at;
            for (int w = 0; w < r; w++) v += load_f32(b + (size_t)w * 16) * tp[w];
        }
        if (start <= n0 && end >= n0 + 16) {
            d += v;
        } else {
            for (int i = 0; i < 16; i++)
                if (n0 + i >= start && n0 + i < end) d[i] += v[i];
        }
    }
    return d;
}

#endif

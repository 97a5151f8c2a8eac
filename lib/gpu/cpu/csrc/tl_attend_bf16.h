/* trillm C kernels: a decode token's grouped attention over a bfloat16 KV cache with
 * AVX512_BF16's pair dot products (`vdpbf16ps`).
 *
 * Why: `attend_group` widens every cached key and value to float32 through a buffer and runs
 * 16-lane FMAs. At 32 decodes of ~144 tokens' context that attention ran at ~35 GFLOP/s,
 * under the cache's bandwidth: the step's part other than its products grew 2.3, 9.0, 30.6 ms
 * at contexts of ~32, ~144, ~528 (decode_profile.py --split --dtype bfloat16 --batch 32
 * --prompt-len 16 / 128 / 512 --new-tokens 32). Here a key row is read as it lies, 32
 * products an instruction; the values of two keys are interleaved in registers (one unpack
 * per 32 output dims, shared by the group's heads) into the pairs the instruction takes, so
 * the accumulators hold the output dims in the unpack's order, put back once at the end. A
 * chunk is 32 keys: one softmax update a head (max, exp, sum; the rescale skipped where the
 * max holds) for two score vectors. The same runs: 7.2 and 24.3 ms at ~144 and ~528.
 *
 * Rounding: q and the softmax weights p are rounded to bfloat16 before their products, as
 * torch's bfloat16 forward holds q and as its SDPA's P.V reads p; the new token's key and
 * value are read as the cache stores them (rounded), as every later step reads them. Sums are
 * float32. Included by tl_attention.h (it uses `reduce16`, `first_key`, MAX_GROUP).
 */
#ifndef TL_ATTEND_BF16_H
#define TL_ATTEND_BF16_H

#if defined(__AVX512BF16__)
#define TL_DPBF16 1

#define DP_HEADS 8 /* heads a pass over the values keeps in registers: 2 x 8 + 3 */
#define DP_KEYS 32 /* keys a chunk: one softmax update (max, exp, sum) a head per 32 */

/* Floats of `attend_group_bf16`'s work: q and a row of zeros in bfloat16, the softmax
 * weights' pairs, the output sums. */
#define DP_WORK_FLOATS(D) ((MAX_GROUP + 1) * (D) / 2 + MAX_GROUP * DP_KEYS / 2 + MAX_GROUP * (D))

/* A sequence's cache slots in key order, from its block table (`table`, blocks of B): the
 * next key's slot by a step, for the walk over its keys below (against `j / B`,
 * `j % B` at each key no time measured either way: perf/prompt_attention_bench.py). */
struct slot_cursor {
    const int32_t *table;
    int B, block, offset;
};

static inline struct slot_cursor slots_from(const int32_t *table, int B, int j) {
    return (struct slot_cursor){table, B, j / B, j % B};
}

/* The slot of the cursor's key, moving it to the next key. */
static inline size_t next_slot(struct slot_cursor *c) {
    size_t slot = (size_t)c->table[c->block] * c->B + (size_t)c->offset;
    if (++c->offset == c->B) {
        c->offset = 0;
        c->block++;
    }
    return slot;
}

static inline __m512 dp_pairs(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* Output sums `o` (dims in the unpack's order, see above) to dims in order, times `inv`. */
static void dp_unpermute(const float *o, int D, float inv, float *out) {
    for (int d = 0; d < D; d += 32) {
        f32x16 lo = load_f32(o + d), hi = load_f32(o + d + 16);
        f32x16 a = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20,
                                           21, 22, 23) * inv;
        f32x16 b = __builtin_shufflevector(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15,
                                           28, 29, 30, 31) * inv;
        memcpy(out + d, &a, sizeof a);
        memcpy(out + d + 16, &b, sizeof b);
    }
}

/* Fetch the rows of kv head `head` (its element offset in a slot of `row` elements) of the
 * next `n` keys of `keys` in both caches: a row of one head is D of every Hkv * D elements,
 * which the hardware's stream prefetch does not see; into L2 (KV_FETCH_LEVEL). */
static inline void dp_fetch(struct slot_cursor *keys, int n, const uint16_t *kcache,
                            const uint16_t *vcache, size_t row, size_t head, int D) {
    for (int j = 0; j < n; j++) {
        const size_t at = next_slot(keys) * row + head;
        for (int b = 0; b < D; b += 32) {
            __builtin_prefetch(kcache + at + b, 0, KV_FETCH_LEVEL);
            __builtin_prefetch(vcache + at + b, 0, KV_FETCH_LEVEL);
        }
    }
}

/* The scores of 16 keys `kp` against q `qb` (bfloat16, D), times `scale`, soft-capped. */
static inline f32x16 dp_scores(const uint16_t *qb, const uint16_t *const *kp, int D, float scale,
                               float cap) {
    __m512 acc[16];
    for (int c = 0; c < 16; c++) acc[c] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32) {
        const __m512i qv = _mm512_loadu_si512(qb + d);
        for (int c = 0; c < 16; c++) acc[c] = dp_pairs(acc[c], qv, _mm512_loadu_si512(kp[c] + d));
    }
    f32x16 sums[16];
    memcpy(sums, acc, sizeof sums);
    f32x16 scores = reduce16(sums) * scale;
    return cap > 0.0f ? tanh16(scores / cap) * cap : scores;
}

/* `attend_group` (same arguments; D % 32 == 0) over a bfloat16 cache `kc`, `vc`, which
 * already holds the new token's key and value (`attention_tasks` stores them first: read
 * from there, as every later step reads them). `work`: DP_WORK_FLOATS(D). */
static void attend_group_bf16(const float *q, int group, const void *kc, const void *vc,
                              const int32_t *table, int ctx, int window, int B, int Hkv, int g,
                              int D, float scale, float cap, float *out, float *work) {
    uint16_t *qb = (uint16_t *)work, *zeros = qb + (size_t)MAX_GROUP * D;
    uint32_t *pairs = (uint32_t *)(zeros + D); /* [group][16]: p[2r], p[2r + 1], bfloat16 */
    float *o = (float *)(pairs + MAX_GROUP * DP_KEYS / 2);
    float run_max[MAX_GROUP], run_sum[MAX_GROUP], rescale[MAX_GROUP];
    for (int i = 0; i < group * D; i += 16) store_bf16(qb + i, load_f32(q + i));
    memset(zeros, 0, sizeof(uint16_t) * (size_t)D);
    memset(o, 0, sizeof(float) * (size_t)group * D);
    for (int hh = 0; hh < group; hh++) {
        run_max[hh] = -INFINITY;
        run_sum[hh] = 0.0f;
    }
    const uint16_t *kcache = (const uint16_t *)kc, *vcache = (const uint16_t *)vc;
    const size_t row = (size_t)Hkv * D, head = (size_t)g * D;
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const f32x16 minus_inf = (f32x16){0} - INFINITY;
    const int first = first_key(ctx, window);
    struct slot_cursor keys = slots_from(table, B, first);
    struct slot_cursor ahead = slots_from(table, B, first);
    dp_fetch(&ahead, ctx - first < DP_KEYS ? ctx - first : DP_KEYS, kcache, vcache, row, head, D);
    for (int j0 = first; j0 < ctx; j0 += DP_KEYS) {
        const int n = ctx - j0 < DP_KEYS ? ctx - j0 : DP_KEYS;
        const uint16_t *kp[DP_KEYS], *vp[DP_KEYS];
        const int later = ctx - j0 - n; /* the next chunk's rows, fetched while these are used */
        dp_fetch(&ahead, later < DP_KEYS ? later : DP_KEYS, kcache, vcache, row, head, D);
        for (int c = 0; c < n; c++) {
            const size_t at = next_slot(&keys) * row + head;
            kp[c] = kcache + at;
            vp[c] = vcache + at;
        }
        for (int c = n; c < DP_KEYS; c++) kp[c] = vp[c] = zeros; /* past the context: weigh 0 */
        const i32x16 valid0 = lane < n, valid1 = lane + 16 < n;
        for (int hh = 0; hh < group; hh++) {
            const uint16_t *qh = qb + (size_t)hh * D;
            f32x16 s0 = dp_scores(qh, kp, D, scale, cap);
            f32x16 s1 = n > 16 ? dp_scores(qh, kp + 16, D, scale, cap) : minus_inf;
            s0 = (f32x16)(((i32x16)s0 & valid0) | ((i32x16)minus_inf & ~valid0));
            s1 = (f32x16)(((i32x16)s1 & valid1) | ((i32x16)minus_inf & ~valid1));
            const float chunk_max = hmax(vmax(s0, s1));
            const float new_max = chunk_max > run_max[hh] ? chunk_max : run_max[hh];
            rescale[hh] = new_max == run_max[hh] ? 1.0f : expf(run_max[hh] - new_max);
            const f32x16 p0 = (f32x16)((i32x16)exp16(s0 - new_max) & valid0);
            const f32x16 p1 = (f32x16)((i32x16)exp16(s1 - new_max) & valid1);
            run_sum[hh] = run_sum[hh] * rescale[hh] + hsum(p0 + p1);
            run_max[hh] = new_max;
            const __m256i b0 = (__m256i)_mm512_cvtneps_pbh((__m512)p0);
            const __m256i b1 = (__m256i)_mm512_cvtneps_pbh((__m512)p1);
            memcpy(pairs + (size_t)hh * 16, &b0, sizeof b0);
            memcpy(pairs + (size_t)hh * 16 + 8, &b1, sizeof b1);
        }
        const int npairs = (n + 1) / 2;
        for (int h0 = 0; h0 < group; h0 += DP_HEADS) {
            const int heads = group - h0 < DP_HEADS ? group - h0 : DP_HEADS;
            for (int d = 0; d < D; d += 32) {
                __m512 lo[DP_HEADS], hi[DP_HEADS];
                for (int h = 0; h < heads; h++) {
                    const __m512 r = _mm512_set1_ps(rescale[h0 + h]);
                    lo[h] = _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)(h0 + h) * D + d), r);
                    hi[h] = _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)(h0 + h) * D + d + 16), r);
                }
                for (int r = 0; r < npairs; r++) {
                    const __m512i a = _mm512_loadu_si512(vp[2 * r] + d);
                    const __m512i b = _mm512_loadu_si512(vp[2 * r + 1] + d);
                    const __m512i vlo = _mm512_unpacklo_epi16(a, b);
                    const __m512i vhi = _mm512_unpackhi_epi16(a, b);
                    for (int h = 0; h < heads; h++) {
                        const __m512i w = _mm512_set1_epi32((int)pairs[(size_t)(h0 + h) * 16 + r]);
                        lo[h] = dp_pairs(lo[h], w, vlo);
                        hi[h] = dp_pairs(hi[h], w, vhi);
                    }
                }
                for (int h = 0; h < heads; h++) {
                    _mm512_storeu_ps(o + (size_t)(h0 + h) * D + d, lo[h]);
                    _mm512_storeu_ps(o + (size_t)(h0 + h) * D + d + 16, hi[h]);
                }
            }
        }
    }
    for (int hh = 0; hh < group; hh++)
        dp_unpermute(o + (size_t)hh * D, D, 1.0f / run_sum[hh], out + (size_t)hh * D);
}

#endif
#endif

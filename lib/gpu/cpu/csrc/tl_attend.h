/* trillm C kernels: a decode token's attention over the paged KV cache, float32 lanes:
 * `attend` (a query head at a time, any head_dim) and `attend_group` (a kv head's query group,
 * 16 keys at a time, head_dim % 16 == 0). Included by `tl_attention.h` after the cache
 * helpers they read with. */
#ifndef TL_ATTEND_H
#define TL_ATTEND_H

/* One query head against its sequence's `ctx - 1` cached keys and the new key (k, v), or the
 * last `window` of them: online softmax over chunks of 64 keys, scores soft-capped by `cap`.
 * `work`: 64 + 2 * D floats. */
static void attend(const float *q, const float *k, const float *v, const void *kc,
                   const void *vc, int ctype, const int32_t *table, int ctx, int window, int B,
                   int Hkv, int g, int D, float scale, float cap, float *out, float *work) {
    float *scores = work, *kbuf = work + 64, *vbuf = work + 64 + D;
    float run_max = -INFINITY, run_sum = 0.0f;
    for (int i = 0; i < D; i++) out[i] = 0.0f;
    for (int j0 = first_key(ctx, window); j0 < ctx; j0 += 64) {
        int n = ctx - j0 < 64 ? ctx - j0 : 64;
        float chunk_max = -INFINITY;
        for (int c = 0; c < n; c++) {
            int j = j0 + c;
            const float *key = j == ctx - 1 ? k : cache_row(kc, ctype, table, j, B, Hkv, g, D, kbuf);
            scores[c] = cap_score(dot(q, key, D) * scale, cap);
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
/* a thread's attention work: `attention_tasks`' queries, key, value, rotary rows and output
 * rows, and `attend_group`'s (33 D + 64: `attend_group_bf16`'s DP_WORK_FLOATS fits in it) */
#define WORK_FLOATS(D) (64 + (5 + 2 * 16 + 2 * MAX_GROUP) * (D))

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
 * whole group, its 16 scores come out of one `reduce16`, online softmax per head. A sliding
 * layer (`window` > 0) starts at its window's first key, so the keys before it are never
 * read; scores soft-capped by `cap`. D % 16 == 0. `out` [group][D]; `work`: WORK_FLOATS(D). */
static void attend_group(const float *q, int group, const float *k, const float *v,
                         const void *kc, const void *vc, int ctype, const int32_t *table,
                         int ctx, int window, int B, int Hkv, int g, int D, float scale,
                         float cap, float *out, float *work) {
    float *kbuf = work, *vbuf = work + 16 * D, *zeros = work + 32 * D;
    float run_max[MAX_GROUP], run_sum[MAX_GROUP];
    for (int hh = 0; hh < group; hh++) {
        run_max[hh] = -INFINITY;
        run_sum[hh] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)group * D);
    memset(zeros, 0, sizeof(float) * (size_t)D);
    const size_t row = (size_t)Hkv * D, esize = ctype == TL_F32 ? 4 : 2;
    for (int j0 = first_key(ctx, window); j0 < ctx; j0 += 16) {
        int n = ctx - j0 < 16 ? ctx - j0 : 16;
        const float *kp[16], *vp[16];
        /* The next 16 keys' and values' rows, fetched while these are used: a row of head g
         * is D elements of every Hkv * D, so the hardware's stream prefetch does not see it
         * (measured: perf/README.md, decode_profile.py --batch 32). */
        for (int j = j0 + 16; j < j0 + 32 && j < ctx - 1; j++) {
            size_t at = ((size_t)table[j / B] * B + (size_t)(j % B)) * row + (size_t)g * D;
            size_t off = at * esize;
            for (size_t b = 0; b < (size_t)D * esize; b += 64) {
                __builtin_prefetch((const char *)kc + off + b, 0, KV_FETCH_LEVEL);
                __builtin_prefetch((const char *)vc + off + b, 0, KV_FETCH_LEVEL);
            }
        }
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
            if (cap > 0.0f) scores = tanh16(scores / cap) * cap;
            const f32x16 minus_inf = (f32x16){0} - INFINITY;
            scores = (f32x16)(((i32x16)scores & valid) | ((i32x16)minus_inf & ~valid));
            float chunk_max = hmax(scores);
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

#endif

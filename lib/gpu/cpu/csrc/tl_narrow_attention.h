/* trillm C kernels: decode attention at 8 float lanes (`TL_NARROW`, AVX2), `attend_group`'s
 * contract with 8 keys a chunk instead of 16.
 *
 * Why: `attend_group` keeps 16 score accumulators of 64 bytes, which without AVX-512 live on
 * the stack (`tl_narrow.h`). Here a chunk's 8 keys are 8 `ymm` accumulators and their scores
 * come out of one `reduce8`; each key and value row is read once for the whole query group,
 * online softmax per head, as there. Included by `tl_attention.h`. */
#ifndef TL_NARROW_ATTENTION_H
#define TL_NARROW_ATTENTION_H

#ifdef TL_NARROW

/* r[c] = the sum of v[c]'s lanes, for 8 vectors: a tree of 7 shuffle-adds. */
static inline f32x8 reduce8(const f32x8 *v) {
    f32x8 a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

static inline f32x8 tanh8(f32x8 x) { return 1.0f - 2.0f / (exp8(x + x) + 1.0f); }

/* `attend_group` (same arguments, D % 8 == 0) over chunks of 8 keys. */
static void nattend_group(const float *q, int group, const float *k, const float *v,
                          const void *kc, const void *vc, int ctype, const int32_t *table,
                          int ctx, int window, int B, int Hkv, int g, int D, float scale,
                          float cap, float *out, float *work) {
    float *kbuf = work, *vbuf = work + 8 * D, *zeros = work + 16 * D;
    float run_max[MAX_GROUP], run_sum[MAX_GROUP];
    for (int hh = 0; hh < group; hh++) {
        run_max[hh] = -INFINITY;
        run_sum[hh] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)group * D);
    memset(zeros, 0, sizeof(float) * (size_t)D);
    const size_t row = (size_t)Hkv * D, esize = ctype == TL_F32 ? 4 : 2;
    const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const f32x8 minus_inf = (f32x8){0} - INFINITY;
    for (int j0 = first_key(ctx, window); j0 < ctx; j0 += 8) {
        const int n = ctx - j0 < 8 ? ctx - j0 : 8;
        const float *kp[8], *vp[8];
        for (int j = j0 + 8; j < j0 + 16 && j < ctx - 1; j++) { /* the next chunk's rows */
            size_t off = (((size_t)table[j / B] * B + (size_t)(j % B)) * row + (size_t)g * D) * esize;
            for (size_t b = 0; b < (size_t)D * esize; b += 64) {
                __builtin_prefetch((const char *)kc + off + b, 0, KV_FETCH_LEVEL);
                __builtin_prefetch((const char *)vc + off + b, 0, KV_FETCH_LEVEL);
            }
        }
        for (int c = 0; c < 8; c++) { /* keys past the context read zeros, weigh 0 */
            const int j = j0 + c;
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
                    const uint16_t *kh = (const uint16_t *)kc + off, *vh = (const uint16_t *)vc + off;
                    for (int i = 0; i < D; i += 8) {
                        st8(kbuf + c * D + i, ld8_bf16(kh + i));
                        st8(vbuf + c * D + i, ld8_bf16(vh + i));
                    }
                    kp[c] = kbuf + c * D;
                    vp[c] = vbuf + c * D;
                }
            }
        }
        const i32x8 valid = lane < n;
        for (int hh = 0; hh < group; hh++) {
            const float *qh = q + (size_t)hh * D;
            f32x8 acc[8];
            for (int c = 0; c < 8; c++) acc[c] = (f32x8){0};
            for (int i = 0; i < D; i += 8) {
                const f32x8 qv = ld8(qh + i);
                for (int c = 0; c < 8; c++) acc[c] += qv * ld8(kp[c] + i);
            }
            f32x8 scores = reduce8(acc) * scale;
            if (cap > 0.0f) scores = tanh8(scores / cap) * cap;
            scores = (f32x8)(((i32x8)scores & valid) | ((i32x8)minus_inf & ~valid));
            const float chunk_max = hmax8(scores);
            const float new_max = chunk_max > run_max[hh] ? chunk_max : run_max[hh];
            const float rescale = expf(run_max[hh] - new_max);
            const f32x8 p = (f32x8)((i32x8)exp8(scores - new_max) & valid);
            run_sum[hh] = run_sum[hh] * rescale + hsum8(p);
            float *oh = out + (size_t)hh * D;
            for (int i = 0; i < D; i += 8) {
                f32x8 o = ld8(oh + i) * rescale;
                for (int c = 0; c < 8; c++) o += p[c] * ld8(vp[c] + i);
                st8(oh + i, o);
            }
            run_max[hh] = new_max;
        }
    }
    for (int hh = 0; hh < group; hh++) {
        const float inv = 1.0f / run_sum[hh];
        for (int i = 0; i < D; i++) out[(size_t)hh * D + i] *= inv;
    }
}

#endif /* TL_NARROW */
#endif

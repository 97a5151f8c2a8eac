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

/* out[H] = RMSNorm(x + r) by `scale`, and sum_out[H] = x + r; with r NULL, out = RMSNorm(x)
 * and sum_out is not written. */
static void add_rms_norm_row(const float *x, const float *r, const float *scale, int H, float eps,
                             float *out, float *sum_out) {
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

#endif

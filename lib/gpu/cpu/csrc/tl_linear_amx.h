/* trillm C kernels: `linear_tiles` and `gate_up_tiles` over AMX tiles (`tl_amx.h`): the
 * tokens rounded to bfloat16, tile pairs against blocks of 32 tokens, each block's sums
 * finished as the FMA path finishes its accumulators. Included at the end of `tl_linear.h`,
 * which declares both before it dispatches to them. */
#ifndef TL_LINEAR_AMX_H
#define TL_LINEAR_AMX_H

/* `linear_tiles` over AMX tiles (`tl_amx.h`): the tokens rounded to bfloat16 into this
 * thread's `xb` (`amx_rows(M)` x K), then tile pairs against blocks of 32 tokens, each block's
 * sums finished as the FMA path finishes its accumulators (LoRA delta, bias, store or add). */
static void amx_linear_tiles(const uint16_t *w, int K, int N, const float *bias, const float *x,
                             int ldx, int M, float *out, int ldo, int mode, float alpha, int t0,
                             int t1, const struct tl_lora_rows *lora, uint16_t *xb) {
    if (t0 >= t1) return;
    float c[2][AMX_ROWS][16] __attribute__((aligned(64)));
    amx_activations(x, ldx, M, K, xb);
    amx_configure();
    for (int t = t0; t < t1; t += 2) {
        const int pair = t + 1 < t1 ? 2 : 1;
        for (int m = 0; m < M; m += AMX_ROWS) {
            const int rows = M - m < AMX_ROWS ? M - m : AMX_ROWS;
            amx_block(w, K, t, pair, xb + (size_t)m * K, rows, c);
            for (int p = 0; p < pair; p++) {
                const int n0 = (t + p) * 16, width = N - n0 < 16 ? N - n0 : 16;
                const f32x16 b = bias && width == 16 ? load_f32(bias + n0) : (f32x16){0};
                for (int i = 0; i < rows; i++) {
                    f32x16 v = load_f32(c[p][i]);
                    if (lora) v += lora_delta(lora, t + p, m + i);
                    float *o = out + (size_t)(m + i) * ldo + n0;
                    if (width == 16) { /* a whole tile: vector stores (120 linears, M=32,
                                        * 1 thread: 31.0 ms, scalar 32.6) */
                        v += b;
                        if (mode == OUT_ADD) v = load_f32(o) + alpha * v;
                        memcpy(o, &v, sizeof v);
                        continue;
                    }
                    for (int r = 0; r < width; r++) {
                        float y = v[r] + (bias ? bias[n0 + r] : 0.0f);
                        o[r] = mode == OUT_ADD ? o[r] + alpha * y : y;
                    }
                }
            }
        }
    }
}

/* `gate_up_tiles` over AMX tiles: gate tile 2j and up tile 2j + 1 are one pair. */
static void amx_gate_up_tiles(const uint16_t *w, int K, const float *x, int ldx, int M,
                              float *act, int I, int j0, int j1, int kind,
                              const struct tl_lora_rows *lora, uint16_t *xb) {
    if (j0 >= j1) return;
    float c[2][AMX_ROWS][16] __attribute__((aligned(64)));
    amx_activations(x, ldx, M, K, xb);
    amx_configure();
    for (int j = j0; j < j1; j++)
        for (int m = 0; m < M; m += AMX_ROWS) {
            const int rows = M - m < AMX_ROWS ? M - m : AMX_ROWS;
            amx_block(w, K, 2 * j, 2, xb + (size_t)m * K, rows, c);
            for (int i = 0; i < rows; i++) {
                f32x16 g = load_f32(c[0][i]), u = load_f32(c[1][i]);
                if (lora) {
                    g += lora_delta(lora, j, m + i);
                    u += lora_delta(lora, I / 16 + j, m + i);
                }
                f32x16 a = gated16(g, u, kind);
                memcpy(act + (size_t)(m + i) * I + j * 16, &a, sizeof a);
            }
        }
}

#endif

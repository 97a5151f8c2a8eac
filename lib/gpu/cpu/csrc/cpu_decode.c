/* trillm's CPU decode step: every decoder layer of a decoder-only model in one call.
 *
 * Why (lib/gpu/cpu/_cpu_decode.py has the whole story): around the weight reads of a batch-1
 * decode step the torch forward issued some 5,000 ops, 121 of them separate OpenMP regions,
 * and took nearly twice as long as this does (15.75 against 8.24 ms for SmolLM2 fp32). Here
 * the step is one OpenMP parallel region: per layer two RMS norms, three matrix-vector products
 * over the weights in a layout made for them, rotary, the KV cache write and paged attention,
 * with four barriers and no allocation (Llama's layer; what other families add is below).
 *
 * Weights are "tiled": output rows in tiles of 16, each tile stored k-major, so the 16 rows'
 * elements at one k are one 64-byte vector: out[tile] += w[tile][k] * x[k]. There is no
 * horizontal sum and one sequential stream per tile. The gate/up weight interleaves a gate
 * tile and the matching up tile, so SiLU(gate) * up is taken while both are in registers.
 * GGUF's Q4_0 / Q4_1 / Q8_0 weights stay quantized in tiles of the same 16 rows, per group of
 * 32 k (one GGUF block of each row): float16 scales (and minimums), then the quants k-major.
 * A Q4 group computes sum_k q x once per row and applies d and m per group:
 * sum_k (d q + m) x = d sum_k q x + m sum_k x.
 *
 * What the other families add, each where its family puts it (`struct tl_layer` says how a
 * layer asks for it): q/k RMS norms per head or over the projection before rotary (Qwen3,
 * Gemma 3, OLMo 2); norms on the blocks' outputs before the residual add (Gemma's sandwich,
 * OLMo 2, which has no input norms), each one more barrier; GeGLU; soft-capped scores, a
 * scale of the model's own, sliding windows (the keys before a window are not read), layers
 * without rotary or with their own table, partial rotary (rotary rows come from the model's
 * tables, so longrope and its attention factor are the torch path's); a residual multiplier
 * (Granite); mixture-of-experts MLPs (`tl_moe.h`). LoRA adapters, per token by its slot,
 * add their delta after each base product of q/k/v, o, gate/up and down (`tl_lora.h`).
 *
 * Built by lib/gpu/cpu/_native.py with -O3 -march=native -fopenmp; the vector types below become
 * AVX-512, AVX2 or SSE code as the CPU allows. OpenMP is the process's one libgomp (torch's,
 * already loaded), so these threads are torch's threads.
 */
#include "tl_attention.h"
#include "tl_linear.h"
#include "tl_moe.h"
#include "tl_prompt_attention.h"
#include "tl_norm.h"
#include "tl_vec.h"

static int64_t widest_row(const struct tl_model *md) {
    int64_t widest = md->hidden > md->intermediate ? md->hidden : md->intermediate;
    int64_t q = (int64_t)md->num_heads * md->head_dim;
    widest = widest > q ? widest : q;
    return widest > md->expert_intermediate ? widest : md->expert_intermediate;
}

/* Rows of a thread's Q4 group sums: a token's, or an expert pair's (M * top_k). */
static int64_t sum_rows(const struct tl_model *md, int M) {
    return (int64_t)M * (md->top_k > 1 ? md->top_k : 1);
}

/* Floats of a thread's AMX activations (`amx_activations`: bfloat16, two to a float). */
static int64_t amx_floats(const struct tl_model *md, int M) {
    return (int64_t)amx_rows(M) * widest_row(md) / 2 + 16;
}

static int64_t private_floats(const struct tl_model *md, int M) {
    return (int64_t)M * md->hidden + WORK_FLOATS(md->head_dim) +
           sum_rows(md, M) * (widest_row(md) / 32 + 1) +
           (md->num_experts ? route_floats(md, M) : 0) +
           (int64_t)M * LORA_MAX_PARTS * md->lora_rank + amx_floats(md, M);
}

/* Floats of scratch `trillm_decode` needs for M tokens on `threads` threads. */
int64_t trillm_decode_scratch(const struct tl_model *md, int M, int threads) {
    int64_t q = (int64_t)md->num_heads * md->head_dim;
    int64_t kv = (int64_t)md->num_kv_heads * md->head_dim;
    int64_t shared = M * (q + 2 * kv) + M * q + (int64_t)M * md->intermediate +
                     (int64_t)M * md->hidden + moe_floats(md, M);
    return shared + threads * private_floats(md, M);
}

static void thread_slot(int *tid, int *nt) {
#ifdef _OPENMP
    *tid = omp_get_thread_num();
    *nt = omp_get_num_threads();
#else
    *tid = 0;
    *nt = 1;
#endif
}

/* `group_sums` of x into `xsum` when `wtype` is Q4 (each thread its own copy); else NULL. */
static const float *sums_for(int wtype, const float *x, int M, int K, float *xsum) {
    if (wtype != TL_Q4) return NULL;
    group_sums(x, K, M, K, xsum);
    return xsum;
}

/* A block's input: the residual stream normed by `norm` into this thread's `xn`, or the
 * stream itself for a block without an input norm (OLMo 2). */
static const float *block_in(const float *hidden, const float *norm, int M, int H, float eps,
                             float *xn) {
    if (!norm) return hidden;
    for (int m = 0; m < M; m++)
        rms_norm(hidden + (size_t)m * H, norm, H, eps, xn + (size_t)m * H);
    return xn;
}

/* hidden[m] += alpha * norm(y[m]) (y[m] itself when `norm` is NULL) over the columns
 * [c0, c1): a block's output [M, H] joining the residual stream. */
static void residual_add(float *hidden, const float *y, const float *norm, int M, int H,
                         float eps, float alpha, int c0, int c1) {
    for (int m = 0; m < M; m++) {
        const float *ym = y + (size_t)m * H;
        float *hm = hidden + (size_t)m * H;
        if (norm) {
            float inv = 1.0f / sqrtf(dot(ym, ym, H) / (float)H + eps);
            for (int c = c0; c < c1; c++) hm[c] += alpha * (norm[c] * (ym[c] * inv));
        } else {
            for (int c = c0; c < c1; c++) hm[c] += alpha * ym[c];
        }
    }
}

/* All decoder layers for M decode tokens (one per sequence), then the final norm.
 *
 * hidden [M, hidden] float32: the embeddings in, the residual stream throughout; `out`
 * [M, hidden] gets the final-normed states. Token m is rotated by row `rope_rows[m]` of each
 * layer's rotary table (its position, or longrope's shifted row), its K/V go to `slots[m]`,
 * and it attends to the `context_lens[m]` tokens (its own included) whose blocks
 * `tables[m * table_stride ...]` lists. `scratch`: `trillm_decode_scratch` floats.
 *
 * `store_first`: some token reads K/V another token of the step stores (a speculative
 * verify step: a sequence's k + 1 tokens come as k + 1 rows over the same blocks, each to
 * its own position), so every token's K/V are stored before any attends: one more barrier
 * a layer.
 *
 * `lora_slots` [M] (NULL: no token has an adapter): token m's adapter slot, -1 for the base
 * model; its delta joins each linear's product (`tl_lora.h`). */
void trillm_decode(const struct tl_model *md, const struct tl_layer *layers,
                   const float *final_norm, float *hidden, float *out, int M,
                   const int64_t *rope_rows, const int64_t *slots, const int32_t *tables,
                   int table_stride, const int32_t *context_lens, float *scratch, int threads,
                   int store_first, const int32_t *lora_slots) {
    const int H = md->hidden, D = md->head_dim, NH = md->num_heads, NKV = md->num_kv_heads;
    const int I = md->intermediate;
    const int Q = NH * D, KV = NKV * D, NQKV = Q + 2 * KV;
    const float eps = md->eps, alpha = md->residual;
    float *qkv = scratch, *attn = qkv + (size_t)M * NQKV, *act = attn + (size_t)M * Q;
    float *tmp = act + (size_t)M * I, *moe_mem = tmp + (size_t)M * H;
    float *private_base = moe_mem + moe_floats(md, M);
    const size_t private_size = (size_t)private_floats(md, M);
    const struct tl_moe_scratch moe = moe_scratch(md, M, moe_mem);
#pragma omp parallel num_threads(threads)
    {
        int tid, nt;
        thread_slot(&tid, &nt);
        float *xn = private_base + tid * private_size, *work = xn + (size_t)M * H;
        float *xsum = work + WORK_FLOATS(D);
        float *route_mem = xsum + sum_rows(md, M) * (widest_row(md) / 32 + 1);
        float *lora_t = route_mem + (md->num_experts ? route_floats(md, M) : 0);
        uint16_t *xb = (uint16_t *)(lora_t + (size_t)M * LORA_MAX_PARTS * md->lora_rank);
        struct tl_lora_rows lr = {NULL, lora_slots, lora_t, md->lora_rank, md->lora_type,
                                  LORA_MAX_PARTS * md->lora_rank};
        int qkv_t0, qkv_t1, o_t0, o_t1, gu_t0, gu_t1, att0, att1, c0, c1;
        split((NQKV + 15) / 16, tid, nt, &qkv_t0, &qkv_t1);
        split((H + 15) / 16, tid, nt, &o_t0, &o_t1);
        split(I / 16, tid, nt, &gu_t0, &gu_t1);
        split(num_attention_tasks(md, M), tid, nt, &att0, &att1);
        split(H, tid, nt, &c0, &c1);
        for (int l = 0; l < md->num_layers; l++) {
            const struct tl_layer *L = &layers[l];
            const struct tl_lora *lora = lora_slots ? L->lora : NULL; /* [qkv, o, gu, d] */
            const float *x = block_in(hidden, L->ln1, M, H, eps, xn);
            linear_tiles(L->wqkv, L->tqkv, H, NQKV, L->bqkv, x, H, M,
                         sums_for(L->tqkv, x, M, H, xsum), qkv, NQKV, OUT_STORE, 1.0f, qkv_t0,
                         qkv_t1, lora ? lora_shrink(&lr, &lora[0], x, H, M, H) : NULL, xb);
#pragma omp barrier
            const struct tl_step step = {L,      L->k_cache,   L->v_cache, qkv,
                                         rope_rows, slots,     tables,     NULL,
                                         context_lens, table_stride, attn};
            if (store_first) {
                attention_tasks(md, &step, att0, att1, 1, ATT_STORE, work);
#pragma omp barrier
                attention_tasks(md, &step, att0, att1, 1, ATT_ATTEND, work);
            } else {
                attention_tasks(md, &step, att0, att1, 1, ATT_BOTH, work);
            }
#pragma omp barrier
            const float *osum = sums_for(L->to, attn, M, Q, xsum);
            const struct tl_lora_rows *olr = lora ? lora_shrink(&lr, &lora[1], attn, Q, M, Q)
                                                  : NULL;
            if (L->ln_attn_out) { /* normed before it joins the stream: a whole row first */
                linear_tiles(L->wo, L->to, Q, H, L->bo, attn, Q, M, osum, tmp, H, OUT_STORE,
                             1.0f, o_t0, o_t1, olr, xb);
#pragma omp barrier
                residual_add(hidden, tmp, L->ln_attn_out, M, H, eps, alpha, c0, c1);
            } else {
                linear_tiles(L->wo, L->to, Q, H, L->bo, attn, Q, M, osum, hidden, H, OUT_ADD,
                             alpha, o_t0, o_t1, olr, xb);
            }
#pragma omp barrier
            x = block_in(hidden, L->ln2, M, H, eps, xn);
            if (L->router) {
                moe_block(md, L, x, M, moe, route_mem, xsum, tmp, c0, c1, tid, nt);
                if (L->ln_ff_out) { /* its norm reads whole rows; without, each thread adds
                                     * the columns it summed */
#pragma omp barrier
                }
                residual_add(hidden, tmp, L->ln_ff_out, M, H, eps, alpha, c0, c1);
            } else {
                gate_up_tiles(L->wgu, L->tgu, H, x, H, M, sums_for(L->tgu, x, M, H, xsum), act,
                              I, gu_t0, gu_t1, md->act, 1,
                              lora ? lora_shrink(&lr, &lora[2], x, H, M, H) : NULL, xb);
#pragma omp barrier
                const float *dsum = sums_for(L->td, act, M, I, xsum);
                const struct tl_lora_rows *dlr = lora ? lora_shrink(&lr, &lora[3], act, I, M, I)
                                                      : NULL;
                if (L->ln_ff_out) {
                    linear_tiles(L->wd, L->td, I, H, NULL, act, I, M, dsum, tmp, H, OUT_STORE,
                                 1.0f, o_t0, o_t1, dlr, xb);
#pragma omp barrier
                    residual_add(hidden, tmp, L->ln_ff_out, M, H, eps, alpha, c0, c1);
                } else {
                    linear_tiles(L->wd, L->td, I, H, NULL, act, I, M, dsum, hidden, H, OUT_ADD,
                                 alpha, o_t0, o_t1, dlr, xb);
                }
            }
#pragma omp barrier
        }
        int m0, m1;
        split(M, tid, nt, &m0, &m1);
        for (int m = m0; m < m1; m++)
            rms_norm(hidden + (size_t)m * H, final_norm, H, eps, out + (size_t)m * H);
    }
}

/* out[M, N] = x[M, K] . w^T over a tiled weight, on `threads` threads: the LM head, and
 * every linear of a GGUF model kept quantized (`TiledLinear`), prefill included. Returns 0, or
 * -1 if the group sums of a Q4 weight (or an AMX weight's bfloat16 tokens) found no memory. */
int trillm_linear(const void *w, int wtype, int K, int N, const float *x, int M, float *out,
                  int threads) {
    float *xsum = NULL;
    uint16_t *xb = NULL; /* AMX: each thread's tokens in bfloat16 */
    const size_t xb_size = (size_t)amx_rows(M) * K;
    if (wtype == TL_Q4 && !(xsum = malloc(sizeof(float) * ((size_t)M * (K / 32) + 1)))) return -1;
    if (wtype == TL_BF16_AMX && !(xb = malloc(sizeof(uint16_t) * xb_size * threads))) return -1;
#pragma omp parallel num_threads(threads)
    {
        int tid, nt, m0, m1, t0, t1;
        thread_slot(&tid, &nt);
        if (xsum) {
            split(M, tid, nt, &m0, &m1);
            group_sums(x + (size_t)m0 * K, K, m1 - m0, K, xsum + (size_t)m0 * (K / 32));
#pragma omp barrier
        }
        split((N + 15) / 16, tid, nt, &t0, &t1);
        linear_tiles(w, wtype, K, N, NULL, x, K, M, xsum, out, N, OUT_STORE, 1.0f, t0, t1, NULL,
                     xb ? xb + xb_size * tid : NULL);
    }
    free(xsum);
    free(xb);
    return 0;
}

/* 1 when the AMX products (`tl_amx.h`) run here: built for AMX and the kernel granted this
 * process the tile state; else 0, and Python keeps bfloat16 weights in `TL_BF16`. */
int trillm_amx_ready(void) { return amx_on(); }

/* 2 when AMX runs the AMX layout's products (`TL_BF16_AMX`), 1 when AVX512_BF16's
 * `vdpbf16ps` does (`tl_amx.h`), 0 when only plain C reads it: Python keeps `TL_BF16` then. */
int trillm_pair_products(void) { return pair_products(); }

/* A prompt step's attention task: kv head g of tokens m0 .. m0 + n - 1, a block of one
 * sequence (`attend_block`) when n >= BLOCK_MIN, else token m0 alone (`attend_group`); `cost`
 * is its keys times the lanes it computes, to hand out the dearest first. */
struct tl_task {
    int32_t m0, n, g;
    int64_t cost;
};

static int dearer_first(const void *a, const void *b) {
    int64_t ca = ((const struct tl_task *)a)->cost, cb = ((const struct tl_task *)b)->cost;
    return ca < cb ? 1 : ca > cb ? -1 : 0;
}

/* The tasks of M tokens into `tasks` (M * num_kv_heads at most), the dearest first; returns
 * their number. Consecutive tokens of a row of `rows` whose context lengths run on by one
 * (a prompt's) make runs, cut into blocks of QBLOCK from their start; a run's tail shorter
 * than BLOCK_MIN, and a decode token (a run of one), attends token by token. */
static int prompt_tasks(const struct tl_model *md, const int32_t *rows, const int32_t *ctx,
                        int M, int window, struct tl_task *tasks) {
    int count = 0;
    for (int m0 = 0, m1; m0 < M; m0 = m1) {
        for (m1 = m0 + 1; m1 < M && m1 - m0 < QBLOCK && rows[m1] == rows[m0] &&
                          ctx[m1] == ctx[m1 - 1] + 1;
             m1++) {
        }
        int n = m1 - m0, tokens = n >= BLOCK_MIN ? 1 : n;
        for (int t = 0; t < tokens; t++) {
            int first = ctx[m0 + t], last = n >= BLOCK_MIN ? ctx[m1 - 1] : first;
            int64_t keys = last - first_key(first, window);
            for (int g = 0; g < md->num_kv_heads; g++)
                tasks[count++] = (struct tl_task){m0 + t, n >= BLOCK_MIN ? n : 1, g,
                                                  keys * (n >= BLOCK_MIN ? QBLOCK : 4)};
        }
    }
    qsort(tasks, (size_t)count, sizeof *tasks, dearer_first);
    return count;
}

/* One layer's attention for the torch forward's steps (the linears there are oneDNN's):
 * `attention_tasks` over M tokens on `threads` threads, with `layer`'s q/k norms, rotary
 * table and window. `rope_rows`, `slots`, `rows` (NULL: token m is sequence m) and
 * `context_lens` per token, as `struct tl_step` says; `qkv` and `out` of `io_type` (TL_F32,
 * or TL_BF16: the bfloat16 forward's tensors as they are). With `prompts` some token reads keys
 * another token of the step stores: all K/V are stored first, then the prompts attend a
 * block of tokens at a time (`attend_block`, head_dim % 16 == 0) and the decode tokens one
 * by one, the dearest tasks handed out first, each to the next free thread.
 *
 * Why in C for prompts too: torch ran one SDPA per prompt and layer (480 calls in a step of
 * 16 prompts of 128 tokens on SmolLM2: 148-180 ms of 1.3 s, prefill_profile.py --top); this
 * reads each prompt's keys in place, all prompts in one call. */
void trillm_attention(const struct tl_model *md, const struct tl_layer *layer, void *k_cache,
                      void *v_cache, const void *qkv, const int64_t *rope_rows,
                      const int64_t *slots, const int32_t *tables, int table_stride,
                      const int32_t *rows, const int32_t *context_lens, int M, int prompts,
                      void *out, int threads, int io_type) {
    const struct tl_step step = {layer,        k_cache, v_cache, qkv,  rope_rows,
                                 slots,        tables,  rows,    context_lens,
                                 table_stride, out,     io_type};
    const int tasks = num_attention_tasks(md, M), D = md->head_dim;
    const int group = md->num_heads / md->num_kv_heads;
    const int64_t block_floats = block_work_floats(group, D);
    struct tl_task *blocks = NULL;
    float *block_work = NULL;
    int num_blocks = 0;
    if (prompts && rows && D % 16 == 0) { /* without memory, the token-by-token path below */
        blocks = malloc(sizeof *blocks * (size_t)M * md->num_kv_heads);
        block_work = aligned_alloc(64, sizeof(float) * (size_t)(threads * block_floats + 16));
        if (blocks && block_work)
            num_blocks = prompt_tasks(md, rows, context_lens, M, layer->window, blocks);
    }
#pragma omp parallel num_threads(threads)
    {
        int tid, nt, t0, t1;
        thread_slot(&tid, &nt);
        float work[WORK_FLOATS(md->head_dim)];
        if (num_blocks) {
            attention_tasks(md, &step, tid, tasks, nt, ATT_STORE, work);
#pragma omp barrier
            float *mine = block_work + tid * block_floats;
#pragma omp for schedule(dynamic, 1) nowait
            for (int i = 0; i < num_blocks; i++) {
                const struct tl_task *task = &blocks[i];
                if (task->n >= BLOCK_MIN) {
                    attend_block(md, &step, task->m0, task->n, task->g, mine);
                } else {
                    int at = task->m0 * md->num_kv_heads + task->g;
                    attention_tasks(md, &step, at, at + 1, 1, ATT_ATTEND, work);
                }
            }
        } else if (prompts) { /* strided: a prompt's later tokens cost more */
            attention_tasks(md, &step, tid, tasks, nt, ATT_STORE, work);
#pragma omp barrier
            attention_tasks(md, &step, tid, tasks, nt, ATT_ATTEND, work);
        } else {
            split(tasks, tid, nt, &t0, &t1);
            attention_tasks(md, &step, t0, t1, 1, ATT_BOTH, work);
        }
    }
    free(blocks);
    free(block_work);
}

/* out[t, j] = silu(x[t, j]) * x[t, I + j] for a [T, 2I] gate/up projection in [gate | up]
 * order: the torch forward's MLP activation in one pass (torch made a SiLU temporary, then
 * multiplied: two passes over [T, I] and an allocation; lib/gpu/cpu/_cpu_ops.py has the figures). */
void trillm_silu_mul(const float *x, int64_t T, int I, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int j = 0;
#ifdef TL_NARROW
        for (; j + 8 <= I; j += 8) st8(o + j, gated8(ld8(g + j), ld8(u + j), ACT_SILU));
#endif
        for (; j + 16 <= I; j += 16) {
            f32x16 gv = load_f32(g + j);
            f32x16 r = gv / (exp16(-gv) + 1.0f) * load_f32(u + j);
            memcpy(o + j, &r, sizeof r);
        }
        for (; j < I; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* out[t] = RMSNorm(x[t] + residual[t]) by `scale` and residual_out[t] = x[t] + residual[t] for
 * T rows of H floats: the torch forward's residual add and the next block's norm, one pass a
 * row (`tl_norm.h`; lib/gpu/cpu/_cpu_ops.py has the figures). `residual` NULL: out = RMSNorm(x),
 * residual_out unused. `scale` is the norm's (offset + weight). */
void trillm_add_rms_norm(const float *x, const float *residual, const float *scale, int64_t T,
                         int H, float eps, float *out, float *residual_out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; t++)
        add_rms_norm_row(x + t * H, residual ? residual + t * H : NULL, scale, H, eps, out + t * H,
                         residual ? residual_out + t * H : NULL);
}

/* `trillm_add_rms_norm` over bfloat16 rows, in Hugging Face's rounding
 * (`add_rms_norm_row_bf16`): the bfloat16 torch forward's residual adds and norms, which torch
 * ran as seven passes with float32 temporaries. */
void trillm_add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const float *scale,
                              int64_t T, int H, float eps, int cast_first, uint16_t *out,
                              uint16_t *residual_out, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float tmp[H]; /* a row in float32, on the thread's stack: no allocation that can fail */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            add_rms_norm_row_bf16(x + t * H, residual ? residual + t * H : NULL, scale, H, eps,
                                  cast_first, out + t * H, residual ? residual_out + t * H : NULL,
                                  tmp);
    }
}

/* out[T, I] = bf16(bf16(SiLU(gate)) * up) over bfloat16 [T, 2I] in [gate | up] order: torch's
 * two rounded ops (F.silu, then the product) in one pass. */
void trillm_silu_mul_bf16(const uint16_t *x, int64_t T, int I, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * 2 * I, *u = g + I;
        uint16_t *o = out + t * I;
        int j = 0;
        for (; j + 16 <= I; j += 16) {
            f32x16 gv = load_bf16(g + j);
            store_bf16(o + j, round_bf16(gv / (exp16(-gv) + 1.0f)) * load_bf16(u + j));
        }
        for (; j < I; j++) {
            float gv = bf16_to_f32(g[j]);
            float a = bf16_to_f32(f32_to_bf16(gv / (1.0f + expf(-gv))));
            o[j] = f32_to_bf16(a * bf16_to_f32(u[j]));
        }
    }
}

/* trillm C kernels: a mixture-of-experts MLP for decode tokens (Qwen3-MoE, Mixtral).
 *
 * What `_moe.FusedMoE` does, in the decode step's OpenMP region: the router's product over
 * its tiles, a softmax top-k per token (renormalised when the model says so), then the
 * token-expert pairs grouped by expert, so that each chosen expert's gate/up and down tiles
 * are read once for all of its tokens; experts no token chose are never read. The experts'
 * outputs are summed per token in ascending expert order, the order `FusedMoE.forward` adds
 * them in.
 *
 * Scratch (`moe_floats`): the router's logits [M, experts rounded to 16], and per pair (M * k
 * of them) its input row [hidden] and Q4 group sums, its activation [expert_intermediate] and
 * its expert's output [hidden]. Each thread routes every token itself (`route`: the same
 * arithmetic on the same logits, so the same answer), which spares a barrier.
 */
#ifndef TL_MOE_H
#define TL_MOE_H

#include "tl_linear.h"
#include "tl_vec.h"

/* A step's routing: pair p = (token m, its j-th expert) at `pair[m * k + j]` in the grouped
 * order, with `weight[m * k + j]`, j ascending by expert; expert e's pairs are
 * `start[e] .. start[e + 1]`, `token[p]` the token of pair p; `active` the `num_active`
 * experts chosen, ascending. */
struct tl_route {
    int32_t *expert, *pair, *token, *start, *active;
    float *weight, *probs;
    int num_active;
};

/* Floats of a thread's own routing arrays. */
static int64_t route_floats(const struct tl_model *md, int M) {
    int64_t pairs = (int64_t)M * md->top_k, E = md->num_experts;
    return 4 * pairs + 3 * E + 2;
}

static struct tl_route route_in(const struct tl_model *md, int M, float *mem) {
    const int64_t pairs = (int64_t)M * md->top_k, E = md->num_experts;
    struct tl_route r;
    r.expert = (int32_t *)mem;
    r.pair = r.expert + pairs;
    r.token = r.pair + pairs;
    r.weight = (float *)(r.token + pairs);
    r.start = (int32_t *)(r.weight + pairs);
    r.active = r.start + E + 1;
    r.probs = (float *)(r.active + E);
    r.num_active = 0;
    return r;
}

#define TAKEN (-1.0f) /* a probability `route` has chosen already */

/* Each token's top-k experts from the router's logits [M, ld]: softmax in float32, the k
 * largest (the first of equal ones), their probabilities renormalised to sum 1 when asked
 * (`FusedMoE.route`); then the pairs grouped by expert, tokens ascending within. */
static void route(const struct tl_model *md, const float *logits, int ld, int M,
                  struct tl_route *r) {
    const int E = md->num_experts, k = md->top_k;
    float *p = r->probs;
    for (int e = 0; e <= E; e++) r->start[e] = 0;
    for (int m = 0; m < M; m++) {
        const float *l = logits + (size_t)m * ld;
        float top = l[0], sum = 0.0f, kept = 0.0f;
        for (int e = 1; e < E; e++) top = l[e] > top ? l[e] : top;
        for (int e = 0; e < E; e++) sum += p[e] = expf(l[e] - top);
        int32_t *ex = r->expert + (size_t)m * k;
        float *w = r->weight + (size_t)m * k;
        for (int j = 0; j < k; j++) { /* k <= E (FusedMoE checks): one is always left */
            int best = -1;
            for (int e = 0; e < E; e++) /* NaN logits choose the first left, in bounds */
                if (p[e] != TAKEN && (best < 0 || p[e] > p[best])) best = e;
            ex[j] = best;
            w[j] = p[best] / sum;
            kept += w[j];
            p[best] = TAKEN;
        }
        for (int j = 0; j < k; j++) {
            if (md->renormalize) w[j] /= kept;
            r->start[ex[j] + 1]++;
        }
        for (int j = 1; j < k; j++) /* ascending by expert: the order the outputs add in */
            for (int i = j; i > 0 && ex[i - 1] > ex[i]; i--) {
                int32_t e = ex[i];
                float x = w[i];
                ex[i] = ex[i - 1];
                w[i] = w[i - 1];
                ex[i - 1] = e;
                w[i - 1] = x;
            }
    }
    r->num_active = 0;
    for (int e = 0; e < E; e++) {
        if (r->start[e + 1]) r->active[r->num_active++] = e;
        r->start[e + 1] += r->start[e];
    }
    for (int m = 0; m < M; m++) /* start[e] is expert e's cursor here */
        for (int j = 0; j < k; j++) {
            int e = r->expert[(size_t)m * k + j];
            int at = r->start[e]++;
            r->pair[(size_t)m * k + j] = at;
            r->token[at] = m;
        }
    for (int e = E; e > 0; e--) r->start[e] = r->start[e - 1]; /* undo the cursor's advance */
    r->start[0] = 0;
}

/* Floats of shared scratch the MoE block needs for M tokens (0 for a dense model). */
static int64_t moe_floats(const struct tl_model *md, int M) {
    if (!md->num_experts) return 0;
    int64_t pairs = (int64_t)M * md->top_k, H = md->hidden, Ie = md->expert_intermediate;
    int64_t E16 = (md->num_experts + 15) / 16 * 16;
    return M * E16 + pairs * (H + H / 32 + 1 + Ie + H);
}

/* Shared MoE scratch, carved from `moe_floats` floats. */
struct tl_moe_scratch {
    float *logits, *x, *xsum, *act, *y;
};

static struct tl_moe_scratch moe_scratch(const struct tl_model *md, int M, float *mem) {
    const int64_t pairs = (int64_t)M * md->top_k, H = md->hidden;
    const int64_t E16 = (md->num_experts + 15) / 16 * 16;
    struct tl_moe_scratch s;
    s.logits = mem;
    s.x = s.logits + M * E16;
    s.xsum = s.x + pairs * H;
    s.act = s.xsum + pairs * (H / 32 + 1);
    s.y = s.act + pairs * md->expert_intermediate;
    return s;
}

/* The MoE MLP of layer L over M tokens `x` [M, hidden] (each thread's identical copy, or the
 * shared residual stream): out[m] = sum over its experts e (ascending) of w_e * down_e(act(
 * gate_e x) * up_e x), into `out` [M, hidden] for the columns [c0, c1) this thread owns.
 * Every thread calls it (it has barriers). `route_mem`: `route_floats`; `xsum_own`: room for
 * the pairs' activations' Q4 group sums. */
static void moe_block(const struct tl_model *md, const struct tl_layer *L, const float *x,
                      int M, struct tl_moe_scratch s, float *route_mem, float *xsum_own,
                      float *out, int c0, int c1, int tid, int nt) {
    const int H = md->hidden, E = md->num_experts, k = md->top_k, Ie = md->expert_intermediate;
    const int E16 = (E + 15) / 16 * 16, pairs = M * k;
    int t0, t1;
    split(E16 / 16, tid, nt, &t0, &t1);
    linear_tiles(L->router, L->trouter, H, E, NULL, x, H, M, NULL, s.logits, E16, OUT_STORE,
                 1.0f, t0, t1, NULL, NULL); /* experts and router: never AMX tiles */
#pragma omp barrier
    struct tl_route r = route_in(md, M, route_mem);
    route(md, s.logits, E16, M, &r);
    int p0, p1; /* the pairs' input rows (and their group sums for Q4 experts) */
    split(pairs, tid, nt, &p0, &p1);
    for (int p = p0; p < p1; p++) {
        memcpy(s.x + (size_t)p * H, x + (size_t)r.token[p] * H, sizeof(float) * (size_t)H);
        if (L->tegu == TL_Q4) group_sums(s.x + (size_t)p * H, H, 1, H, s.xsum + (size_t)p * (H / 32));
    }
#pragma omp barrier
    const int per = Ie / 16; /* gate/up: the chosen experts' column tiles, split evenly */
    int u0, u1;
    split(r.num_active * per, tid, nt, &u0, &u1);
    for (int a = u0 / per; a < r.num_active && a * per < u1; a++) {
        int e = r.active[a], first = r.start[e], count = r.start[e + 1] - first;
        int j0 = u0 > a * per ? u0 - a * per : 0, j1 = u1 < (a + 1) * per ? u1 - a * per : per;
        const float *sums = L->tegu == TL_Q4 ? s.xsum + (size_t)first * (H / 32) : NULL;
        gate_up_tiles(L->expert_gu[e], L->tegu, H, s.x + (size_t)first * H, H, count, sums,
                      s.act + (size_t)first * Ie, Ie, j0, j1, md->act, L->egu_interleaved, NULL, NULL);
    }
#pragma omp barrier
    if (L->ted == TL_Q4) group_sums(s.act, Ie, pairs, Ie, xsum_own);
    split((H + 15) / 16, tid, nt, &t0, &t1); /* down: every chosen expert's row tiles */
    for (int a = 0; a < r.num_active; a++) {
        int e = r.active[a], first = r.start[e], count = r.start[e + 1] - first;
        const float *sums = L->ted == TL_Q4 ? xsum_own + (size_t)first * (Ie / 32) : NULL;
        linear_tiles(L->expert_down[e], L->ted, Ie, H, NULL, s.act + (size_t)first * Ie, Ie,
                     count, sums, s.y + (size_t)first * H, H, OUT_STORE, 1.0f, t0, t1, NULL, NULL);
    }
#pragma omp barrier
    for (int m = 0; m < M; m++) {
        float *o = out + (size_t)m * H;
        for (int c = c0; c < c1; c++) o[c] = 0.0f;
        for (int j = 0; j < k; j++) {
            const float *y = s.y + (size_t)r.pair[(size_t)m * k + j] * H;
            float w = r.weight[(size_t)m * k + j];
            for (int c = c0; c < c1; c++) o[c] += y[c] * w;
        }
    }
}

#endif

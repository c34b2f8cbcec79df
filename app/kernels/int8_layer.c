/* A decoder layer's work between its int8 matmuls, a few calls a layer (app/int8_layer.py): the norms, the
 * split of their output into 7-bit parts, the scaling back of the matmuls' sums with the residual adds, rotary
 * embeddings and the gated MLP's SiLU. Each row (token) alone, in one fixed order (int8_rows.h). */

#include "int8_rows.h"
#include "fastmath.h"

#include <stdlib.h>

/* out = weight * (x / sqrt(mean(x^2) + eps)), transformers' LlamaRMSNorm in float32. */
static inline void rms_norm_row(const float *x, int64_t d, const float *weight, float eps, float *out) {
    float r = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
    for (int64_t j = 0; j < d; j++) out[j] = weight[j] * (x[j] * r);
}

/* Rows of x normed (weight, eps), then split into parts. */
void norm_split(const float *x, int64_t n, int64_t d, const float *weight, float eps, float act_max, float fine,
                float *parts_f32, int8_t *parts_i8, float *scale) {
    Parts p = {parts_f32, parts_i8, scale, n, act_max, fine};
    FOR_ROWS(i, n, n * d, {
        float normed[d];
        rms_norm_row(x + i * d, d, weight, eps, normed);
        split_row(normed, d, i, &p);
    });
}

/* Rotary embeddings in place on the first `heads` heads (of `dim` values) of each of n rows of `width`:
 * x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[dim/2:], x[:dim/2]), as transformers computes it. */
void rotate(float *y, int64_t n, int64_t width, int64_t heads, int64_t dim, const float *cos, const float *sin) {
    int64_t half = dim / 2;
    FOR_ROWS(i, n, n * heads * dim, {
        for (int64_t h = 0; h < heads; h++) {
            float x[dim];
            float *v = y + i * width + h * dim;
            const float *c = cos + i * dim, *s = sin + i * dim;
            for (int64_t j = 0; j < dim; j++) x[j] = v[j];
            for (int64_t j = 0; j < dim; j++) v[j] = x[j] * c[j] + (j < half ? -x[j + half] : x[j - half]) * s[j];
        }
    });
}

/* Per-head RMS norms in place, before the rotary embeddings (Qwen3's q_norm / k_norm): in each of n rows of
 * `width`, the `heads` heads of `dim` values from head `first` on, each normed over its dim values (weight, eps). */
void norm_heads(float *y, int64_t n, int64_t width, int64_t first, int64_t heads, int64_t dim, const float *weight,
                float eps) {
    FOR_ROWS(i, n, n * heads * dim, {
        for (int64_t h = first; h < first + heads; h++) {
            float *v = y + i * width + h * dim;
            rms_norm_row(v, dim, weight, eps, v);
        }
    });
}

/* hidden += the scaled-back sums (an output projection and the residual add). */
void combine_add(const float *sums_f32, const int32_t *sums_i32, int64_t n, int64_t o, float fine,
                 const float *scale, const float *wscale, const float *bias, float *hidden) {
    Sums s = {sums_f32, sums_i32, n, o, fine, scale, wscale, bias};
    FOR_ROWS(i, n, n * o, {
        float y[o];
        combine_row(&s, i, y);
        for (int64_t c = 0; c < o; c++) hidden[i * o + c] = hidden[i * o + c] + y[c];
    });
}

/* combine_add, then the new hidden rows normed (weight, eps) and split into parts: the attention's output
 * projection, its residual add and the MLP's input norm. */
void combine_add_norm_split(const float *sums_f32, const int32_t *sums_i32, int64_t n, int64_t o, float fine,
                            const float *scale, const float *wscale, const float *bias, float *hidden,
                            const float *weight, float eps, float act_max, float *parts_f32, int8_t *parts_i8,
                            float *parts_scale) {
    combine_add(sums_f32, sums_i32, n, o, fine, scale, wscale, bias, hidden);
    norm_split(hidden, n, o, weight, eps, act_max, fine, parts_f32, parts_i8, parts_scale);
}

/* The gated MLP's middle: from the gate and up projections' sums (2m values a row: gate, then up), silu(gate) *
 * up, split into parts for the down projection. silu(v) = v / (1 + e^-v). */
void combine_silu_split(const float *sums_f32, const int32_t *sums_i32, int64_t n, int64_t o, float fine,
                        const float *scale, const float *wscale, const float *bias, float act_max, float *parts_f32,
                        int8_t *parts_i8, float *parts_scale) {
    Sums s = {sums_f32, sums_i32, n, o, fine, scale, wscale, bias};
    Parts p = {parts_f32, parts_i8, parts_scale, n, act_max, fine};
    int64_t m = o / 2;
    FOR_ROWS(i, n, n * o, {
        float y[o];
        combine_row(&s, i, y);
        for (int64_t j = 0; j < m; j++) y[j] = y[j] / (1.0f + exp_approx(-y[j])) * y[m + j];
        split_row(y, m, i, &p);
    });
}

/* ---- The same layer with its matmuls on the packed kernel (app/int8_mm.c: VNNI, or AMX tiles): the work before
 * attention in one call, the work after it in another, where a layer took ~10 calls from Python (for the inputs
 * app.int8 sends that kernel from Python: few tokens, or any number with AMX; forward_layers: any number). The same functions as above in the same order,
 * so the same bits. */

/* An int8 layer as mm_int8 reads it (app/int8_layer.py builds it from an Int8Linear). */
typedef struct {
    const int8_t *packed;
    const int32_t *colsum;
    const float *wscale, *bias;
    int64_t in, out;
} Linear;

int mm_int8(const int8_t *parts, int64_t m, int64_t k, const int8_t *packed, const int32_t *colsum, int64_t n,
            int32_t *out);

static int mm(const Linear *l, const int8_t *parts, int64_t n, int32_t *sums) {
    return mm_int8(parts, 2 * n, l->in, l->packed, l->colsum, l->out, sums);
}

/* Room for one call: parts of up to `width` values a row, sums of up to `outs`, two sets of scales. */
typedef struct {
    int8_t *parts;
    int32_t *sums;
    float *scale, *scale2;
} Room;

static int room(Room *r, int64_t n, int64_t width, int64_t outs) {
    r->parts = malloc((size_t)(2 * n * width));
    r->sums = malloc(sizeof(int32_t) * (size_t)(2 * n * outs));
    r->scale = malloc(sizeof(float) * (size_t)(2 * n));
    r->scale2 = r->scale ? r->scale + n : NULL;
    return r->parts && r->sums && r->scale ? 0 : -1;
}

static int done(Room *r, int status) {
    free(r->parts), free(r->sums), free(r->scale);
    return status;
}

/* y = rotary(qkv(norm(x))) for n rows of d: the first `rotated` heads of `dim` rotated (queries and keys), the
 * first `heads` of them (queries) normed by q_norm and the rest by k_norm first where q_norm is not NULL (Qwen3;
 * biases, Qwen2's, are the Linear's). Returns 0, or -1 without memory or VNNI. */
int qkv_packed(const float *x, int64_t n, int64_t d, const float *norm, float eps, float act_max, float fine,
               const Linear *qkv, int64_t rotated, int64_t dim, const float *cos, const float *sin,
               int64_t heads, const float *q_norm, const float *k_norm, float head_eps, float *y) {
    Room r;
    if (room(&r, n, d, qkv->out)) return done(&r, -1);
    norm_split(x, n, d, norm, eps, act_max, fine, NULL, r.parts, r.scale);
    if (mm(qkv, r.parts, n, r.sums)) return done(&r, -1);
    combine_rows(NULL, r.sums, n, qkv->out, fine, r.scale, qkv->wscale, qkv->bias, y);
    if (q_norm) {
        norm_heads(y, n, qkv->out, 0, heads, dim, q_norm, head_eps);
        norm_heads(y, n, qkv->out, heads, rotated - heads, dim, k_norm, head_eps);
    }
    rotate(y, n, qkv->out, rotated, dim, cos, sin);
    return done(&r, 0);
}

/* hidden (n rows of d) += o(attention); then hidden += down(silu(gate) * up) of its norm: the rest of the layer.
 * Returns 0, or -1 without memory or VNNI (hidden may then be half updated: the caller's pass fails). */
int finish_packed(const float *attention, int64_t n, float *hidden, const Linear *o, const float *norm, float eps,
                  const Linear *gate_up, const Linear *down, float act_max, float fine) {
    int64_t d = o->out, widest = o->in > down->in ? o->in : down->in;
    Room r;
    if (room(&r, n, widest > d ? widest : d, gate_up->out > d ? gate_up->out : d)) return done(&r, -1);
    split_rows(attention, n, o->in, act_max, fine, NULL, r.parts, r.scale);
    if (mm(o, r.parts, n, r.sums)) return done(&r, -1);
    combine_add_norm_split(NULL, r.sums, n, d, fine, r.scale, o->wscale, o->bias, hidden, norm, eps, act_max, NULL,
                           r.parts, r.scale2);
    if (mm(gate_up, r.parts, n, r.sums)) return done(&r, -1);
    combine_silu_split(NULL, r.sums, n, gate_up->out, fine, r.scale2, gate_up->wscale, gate_up->bias, act_max,
                       NULL, r.parts, r.scale);
    if (mm(down, r.parts, n, r.sums)) return done(&r, -1);
    combine_add(NULL, r.sums, n, d, fine, r.scale, down->wscale, down->bias, hidden);
    return done(&r, 0);
}

/* ---- Every layer of a pass in one call, where each layer's calls would be qkv_packed, attend_batch (every row of
 * the pass attending there) and finish_packed: the same calls in the same order, so the same bits. Python's work
 * between them (views, strides, ~10 ctypes calls a layer) was ~4 ms of a 13.7 ms one-token step, held the GIL, and
 * in a step of 8 rows came to as much again. */

#include "attend_rows.h"

/* A decoder layer as forward_layers reads it (app/int8_layer.LayerC, built once per model). */
typedef struct {
    const float *input_norm;
    float input_eps;
    Linear qkv;
    const float *post_norm;
    float post_eps;
    Linear o, gate_up, down;
    const float *q_norm, *k_norm; /* per-head norms before rotary (Qwen3), or NULL */
    float head_eps;
} Layer;

/* hidden (n rows of d) through `count` layers: heads query heads and groups key/value heads of dim values, the
 * first heads + groups of them rotated (cos, sin: n x dim); tables[l]: layer l's rows for attend_batch (`rows` of
 * them, their keys/values' room reserved). Returns 0; -1 without memory (hidden and the caches may then be part
 * done: the caller's pass fails); -2, nothing done, for shapes these calls do not take. */
int forward_layers(const Layer *layers, int64_t count, float *hidden, int64_t n, int64_t d, int64_t heads,
                   int64_t groups, int64_t dim, float scale, const float *cos, const float *sin,
                   const RowKV *const *tables, int64_t rows, float act_max, float fine) {
    int64_t width = (heads + 2 * groups) * dim; /* a token's queries, keys, values */
    float *y = malloc(sizeof(float) * (size_t)(n * width)), *out = malloc(sizeof(float) * (size_t)(n * heads * dim));
    int status = y && out ? 0 : -1;
    if (!attend_fast(heads, groups, dim)) status = -2;
    for (int64_t l = 0; l < count && !status; l++)
        status = layers[l].qkv.out == width ? 0 : -2;
    for (int64_t l = 0; l < count && !status; l++) {
        const Layer *layer = &layers[l];
        const float *k = y + heads * dim, *v = k + groups * dim;
        status = qkv_packed(hidden, n, d, layer->input_norm, layer->input_eps, act_max, fine, &layer->qkv,
                            heads + groups, dim, cos, sin, heads, layer->q_norm, layer->k_norm, layer->head_eps, y);
        if (!status)
            status = attend_batch(y, dim, width, k, dim, width, v, dim, width, tables[l], rows, heads, groups, dim,
                                  scale, out);
        if (!status)
            status = finish_packed(out, n, hidden, &layer->o, layer->post_norm, layer->post_eps, &layer->gate_up,
                                   &layer->down, act_max, fine);
    }
    free(y), free(out);
    return status;
}

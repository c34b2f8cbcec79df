/* attend_rows.c's interface, which int8_layer.c's forward_layers calls too. */

#pragma once

#include <stdint.h>

/* A row of the pass as attend_batch reads it (app/attend_rows.RowKV). Strides in floats. */
typedef struct {
    int64_t first, n;          /* its tokens in the pass */
    float *keys, *values;      /* its own cache's storage for this layer: groups x room x dim */
    int64_t group_stride, past; /* between key/value heads; positions it held before this pass */
    const float *prefix_keys, *prefix_values; /* a shared prefix's (NULL: none) */
    int64_t prefix_stride, prefix_len;
} RowKV;

int attend_fast(int64_t heads, int64_t groups, int64_t dim);
int attend_batch(const float *q, int64_t q_head, int64_t q_token, const float *k, int64_t k_head, int64_t k_token,
                 const float *v, int64_t v_head, int64_t v_token, const RowKV *rows, int64_t count, int64_t heads,
                 int64_t groups, int64_t dim, float scale, float *out);

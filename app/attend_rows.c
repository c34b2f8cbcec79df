/* One row's few new queries attending to its own cached keys, merged with their attention over a shared prefix
 * (app/ragged.py). Every query is computed alone, in one fixed order of operations, so its bits depend on its
 * own keys only: never on the other queries or rows of the pass (tests/test_int8.py checks it bitwise). */

#include <stdlib.h>

#include "fastmath.h"

/* q: n queries of `heads` heads (element strides q_head, q_token); keys/values: `groups` heads of `past + n`
 * positions (element stride kv_head between heads, dim between positions); query i sees positions up to
 * past + i. Heads share key/value heads in runs of heads / groups. With prefix_out (heads x n x dim) and
 * prefix_lse (heads x n), each query's own part is merged with its prefix part by their log-sum-exps.
 * out: n tokens x heads x dim (the layout the output projection reads). Returns 0, or -1 without memory. */
int attend_row(const float *q, int64_t q_head, int64_t q_token, int64_t n, const float *keys,
               const float *values, int64_t kv_head, int64_t past, int64_t heads, int64_t groups, int64_t dim,
               float scale, const float *prefix_out, const float *prefix_lse, float *restrict out) {
    float *p = malloc(sizeof(float) * (past + n));
    if (!p) return -1;
    int64_t per_group = heads / groups;
    for (int64_t h = 0; h < heads; h++) {
        const float *k = keys + (h / per_group) * kv_head, *v = values + (h / per_group) * kv_head;
        for (int64_t i = 0; i < n; i++) {
            const float *query = q + h * q_head + i * q_token;
            int64_t seen = past + i + 1;
            float m = -INFINITY;
            for (int64_t j = 0; j < seen; j++) {
                p[j] = dot(query, k + j * dim, dim) * scale;
                m = p[j] > m ? p[j] : m;
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < seen; j++) {
                p[j] = exp_approx(p[j] - m);
                sum += p[j];
            }
            float *restrict o = out + (i * heads + h) * dim;
            for (int64_t c = 0; c < dim; c++) o[c] = 0.0f;
            for (int64_t j = 0; j < seen; j++)
                for (int64_t c = 0; c < dim; c++) o[c] += p[j] * v[j * dim + c];
            float own_share = 1.0f / sum;
            if (prefix_out) { /* shares e^own_lse : e^prefix_lse of the whole softmax */
                float own_lse = m + logf(sum), head_lse = prefix_lse[h * n + i];
                float head_share = 1.0f / (1.0f + expf(own_lse - head_lse));
                const float *ho = prefix_out + (h * n + i) * dim;
                own_share *= 1.0f - head_share;
                for (int64_t c = 0; c < dim; c++) o[c] = o[c] * own_share + ho[c] * head_share;
            } else {
                for (int64_t c = 0; c < dim; c++) o[c] *= own_share;
            }
        }
    }
    free(p);
    return 0;
}

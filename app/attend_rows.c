/* Every row of a ragged pass with few new tokens, attending in one call a layer (app/attend_rows.py): each row's
 * new keys/values written into its cache's room, then each new query's attention over the row's shared prefix
 * and its own keys as one softmax, (row, head) pairs shared between the calling thread's OpenMP team. Each pair
 * is one thread's, in one fixed order, so a query's bits depend on its own row only: never on the rows beside it
 * or on the threads (tests/test_attend_rows.py checks both bitwise). */

#include <stdlib.h>

#include "fastmath.h"

/* A row of the pass as attend_batch reads it (app/attend_rows.RowKV). Strides in floats. */
typedef struct {
    int64_t first, n;          /* its tokens in the pass */
    float *keys, *values;      /* its own cache's storage for this layer: groups x room x dim */
    int64_t group_stride, past; /* between key/value heads; positions it held before this pass */
    const float *prefix_keys, *prefix_values; /* a shared prefix's (NULL: none) */
    int64_t prefix_stride, prefix_len;
} RowKV;

/* The maximum of x[0..n) (exact in any order, so vectorized freely). */
static inline float max_of(const float *x, int64_t n) {
    float acc[LANES];
    for (int l = 0; l < LANES; l++) acc[l] = -INFINITY;
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = x[j + l] > acc[l] ? x[j + l] : acc[l];
    float m = -INFINITY;
    for (int l = 0; l < LANES; l++) m = acc[l] > m ? acc[l] : m;
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define GROUP_MAX 8 /* query heads per key/value head the fast path takes */

/* e^x for 16 lanes: exp_approx's arithmetic (fastmath.h), 2^k applied with scalef (exact, as its exponent bits). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 shift = _mm512_set1_ps(ROUND_SHIFT);
    __m512 k = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), shift), shift);
    __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(0.693145751953125f))),
                             _mm512_mul_ps(k, _mm512_set1_ps(1.428606765330187e-06f)));
    __m512 e = _mm512_add_ps(_mm512_set1_ps(1.0f / 720), _mm512_mul_ps(r, _mm512_set1_ps(1.0f / 5040)));
    e = _mm512_add_ps(_mm512_set1_ps(1.0f / 120), _mm512_mul_ps(r, e));
    e = _mm512_add_ps(_mm512_set1_ps(1.0f / 24), _mm512_mul_ps(r, e));
    e = _mm512_add_ps(_mm512_set1_ps(1.0f / 6), _mm512_mul_ps(r, e));
    e = _mm512_add_ps(_mm512_set1_ps(0.5f), _mm512_mul_ps(r, e));
    e = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(r, e));
    e = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(r, e));
    return _mm512_scalef_ps(e, k);
}

/* The `per` query heads of one key/value head (64 values each), one token, over `before` prefix positions and
 * `seen` own ones: each query's scores, softmax and output, reading each key and value once for all of them. */
static void attend_group64(const float *const *query, int per, const RowKV *r, int64_t group, int64_t seen,
                           float scale, float *p, float *const *out) {
    const float *pk = r->prefix_keys ? r->prefix_keys + group * r->prefix_stride : NULL;
    const float *pv = pk ? r->prefix_values + group * r->prefix_stride : NULL;
    const float *k = r->keys + group * r->group_stride, *v = r->values + group * r->group_stride;
    int64_t before = pk ? r->prefix_len : 0, total = before + seen, stride = (total + 15) / 16 * 16;
    __m512 qv[GROUP_MAX][4];
    for (int h = 0; h < per; h++)
        for (int c = 0; c < 4; c++) qv[h][c] = _mm512_loadu_ps(query[h] + 16 * c);
    for (int64_t j = 0; j < total; j++) {
        const float *key = j < before ? pk + j * 64 : k + (j - before) * 64;
        __m512 k0 = _mm512_loadu_ps(key), k1 = _mm512_loadu_ps(key + 16), k2 = _mm512_loadu_ps(key + 32),
               k3 = _mm512_loadu_ps(key + 48);
        for (int h = 0; h < per; h++) {
            __m512 a = _mm512_fmadd_ps(qv[h][1], k1, _mm512_mul_ps(qv[h][0], k0));
            __m512 b = _mm512_fmadd_ps(qv[h][3], k3, _mm512_mul_ps(qv[h][2], k2));
            p[h * stride + j] = _mm512_reduce_add_ps(_mm512_add_ps(a, b)) * scale;
        }
    }
    float share[GROUP_MAX];
    for (int h = 0; h < per; h++) {
        float *ph = p + h * stride;
        float m = max_of(ph, total);
        __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= total; j += 16) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(ph + j), mv));
            _mm512_storeu_ps(ph + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        if (j < total) {
            __mmask16 tail = (__mmask16)((1u << (total - j)) - 1);
            __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, ph + j), mv));
            e = _mm512_maskz_mov_ps(tail, e);
            _mm512_mask_storeu_ps(ph + j, tail, e);
            sum = _mm512_add_ps(sum, e);
        }
        share[h] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    __m512 o[GROUP_MAX][4];
    for (int h = 0; h < per; h++)
        for (int c = 0; c < 4; c++) o[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < total; j++) {
        const float *value = j < before ? pv + j * 64 : v + (j - before) * 64;
        __m512 v0 = _mm512_loadu_ps(value), v1 = _mm512_loadu_ps(value + 16), v2 = _mm512_loadu_ps(value + 32),
               v3 = _mm512_loadu_ps(value + 48);
        for (int h = 0; h < per; h++) {
            __m512 w = _mm512_set1_ps(p[h * stride + j]);
            o[h][0] = _mm512_fmadd_ps(w, v0, o[h][0]);
            o[h][1] = _mm512_fmadd_ps(w, v1, o[h][1]);
            o[h][2] = _mm512_fmadd_ps(w, v2, o[h][2]);
            o[h][3] = _mm512_fmadd_ps(w, v3, o[h][3]);
        }
    }
    for (int h = 0; h < per; h++) {
        __m512 s = _mm512_set1_ps(share[h]);
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(out[h] + 16 * c, _mm512_mul_ps(o[h][c], s));
    }
}
#define FAST_DIM 64
#endif

/* Whether attend_batch computes this geometry: the AVX-512 path, 64-value heads, up to GROUP_MAX query heads a
 * key/value head (elsewhere the rows keep PyTorch's kernels: a portable version measured 38 % slower than them
 * for 8 rows x 3 tokens when built without AVX-512). */
int attend_fast(int64_t heads, int64_t groups, int64_t dim) {
#if defined(__AVX512F__)
    return dim == FAST_DIM && groups > 0 && heads % groups == 0 && heads / groups <= GROUP_MAX;
#else
    (void)heads, (void)groups, (void)dim;
    return 0;
#endif
}

/* The pass's new queries (`heads` heads), keys and values (`groups` heads), `dim` values each, with their element
 * strides between heads and between tokens; out: tokens x heads x dim, written for the rows' tokens. Returns 0,
 * -1 without memory, -2 where attend_fast says no (keys/values are written either way). */
int attend_batch(const float *q, int64_t q_head, int64_t q_token, const float *k, int64_t k_head, int64_t k_token,
                 const float *v, int64_t v_head, int64_t v_token, const RowKV *rows, int64_t count, int64_t heads,
                 int64_t groups, int64_t dim, float scale, float *out) {
    for (int64_t i = 0; i < count; i++) {
        const RowKV *r = &rows[i];
        for (int64_t t = 0; t < r->n; t++)
            for (int64_t g = 0; g < groups; g++) {
                const float *key = k + g * k_head + (r->first + t) * k_token;
                const float *value = v + g * v_head + (r->first + t) * v_token;
                int64_t at = g * r->group_stride + (r->past + t) * dim;
                for (int64_t c = 0; c < dim; c++) {
                    r->keys[at + c] = key[c];
                    r->values[at + c] = value[c];
                }
            }
    }
    int failed = 0, per = (int)(heads / groups);
#if defined(__AVX512F__)
    if (!attend_fast(heads, groups, dim)) return -2;
    int64_t most = 0; /* each task: one key/value head's queries of one new token */
    for (int64_t i = 0; i < count; i++) most = rows[i].n > most ? rows[i].n : most;
#pragma omp parallel for schedule(dynamic) reduction(| : failed)
    for (int64_t task = 0; task < count * groups * most; task++) {
        const RowKV *r = &rows[task / (groups * most)];
        int64_t g = task / most % groups, t = task % most;
        if (t >= r->n) continue;
        int64_t total = (r->prefix_keys ? r->prefix_len : 0) + r->past + t + 1;
        float *p = malloc(sizeof(float) * (size_t)(per * ((total + 15) / 16 * 16)));
        if (!p) {
            failed |= 1;
            continue;
        }
        const float *query[GROUP_MAX];
        float *outs[GROUP_MAX];
        for (int i = 0; i < per; i++) {
            int64_t h = g * per + i;
            query[i] = q + h * q_head + (r->first + t) * q_token;
            outs[i] = out + ((r->first + t) * heads + h) * dim;
        }
        attend_group64(query, per, r, g, r->past + t + 1, scale, p, outs);
        free(p);
    }
    return failed ? -1 : 0;
#else
    (void)q, (void)q_head, (void)q_token, (void)scale, (void)out, (void)per, (void)failed;
    return -2;
#endif
}

/* Every row of a ragged pass with up to 64 new tokens, attending in one call a layer (app/attend_rows.py): each
 * row's new keys/values written into its cache's room, then each new query's attention over the row's shared
 * prefix and its own keys as one softmax, (row, 4 of its tokens, key/value head) tasks shared between the calling
 * thread's OpenMP team. Each query is computed alone in one fixed order, so its bits depend on its own row only:
 * never on the rows beside it, the task it falls in or the threads (tests/test_attend_rows.py checks these
 * bitwise). */

#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "fastmath.h"

/* A row of the pass as attend_batch reads it (app/attend_rows.RowKV). Strides in floats. */
typedef struct {
    int64_t first, n;          /* its tokens in the pass */
    float *keys, *values;      /* its own cache's storage for this layer: groups x room x dim */
    int64_t group_stride, past; /* between key/value heads; positions it held before this pass */
    const float *prefix_keys, *prefix_values; /* a shared prefix's (NULL: none) */
    int64_t prefix_stride, prefix_len;
} RowKV;

#if defined(__AVX512F__)
#include <immintrin.h>
#define GROUP_MAX 8 /* query heads per key/value head the fast path takes */
#define CHUNK_TOKENS 4 /* a task's tokens of one row: a row of many splits between the threads (a query's bits are
                        * its own: the same in any task) */

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

/* q . key's 64 values as 16 lanes of partial sums (each over 4 of the values). */
static inline __m512 partial_dot64(const float *q, const float *key) {
    __m512 a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(key + 16),
                               _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(key)));
    __m512 b = _mm512_fmadd_ps(_mm512_loadu_ps(q + 48), _mm512_loadu_ps(key + 48),
                               _mm512_mul_ps(_mm512_loadu_ps(q + 32), _mm512_loadu_ps(key + 32)));
    return _mm512_add_ps(a, b);
}

/* Lane i: the sum of t[i]'s 16 lanes, for 16 vectors at once (a transpose folded into the adds). Each lane only
 * ever adds t[i]'s own partial sums, in a fixed order: a key's score does not depend on its block's other keys. */
static inline __m512 sum_across16(const __m512 *t) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [t(2i) 0+2, t(2i+1) 0+2, t(2i) 1+3, t(2i+1) 1+3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: t(4i) .. t(4i+3), each over that lane's four values */
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

/* o[x] += the sum of w[x][i] * value[i] over a block's `count` positions, for `tile` queries at once: each query
 * adds position by position as it would alone (the same bits), but the tile's 4 * tile running sums are independent
 * chains (one query's 4 waited on each multiply-add's latency: a third of this kernel's time in a profile) and
 * each value is loaded once for the tile. */
static inline void weigh_values(const float *const *value, int64_t count, const float *const *w, float *const *o,
                                const int tile) {
    __m512 acc[4][4];
    for (int x = 0; x < tile; x++)
        for (int c = 0; c < 4; c++) acc[x][c] = _mm512_loadu_ps(o[x] + 16 * c);
    for (int64_t i = 0; i < count; i++) {
        __m512 v0 = _mm512_loadu_ps(value[i]), v1 = _mm512_loadu_ps(value[i] + 16),
               v2 = _mm512_loadu_ps(value[i] + 32), v3 = _mm512_loadu_ps(value[i] + 48);
        for (int x = 0; x < tile; x++) {
            __m512 wi = _mm512_set1_ps(w[x][i]);
            acc[x][0] = _mm512_fmadd_ps(wi, v0, acc[x][0]);
            acc[x][1] = _mm512_fmadd_ps(wi, v1, acc[x][1]);
            acc[x][2] = _mm512_fmadd_ps(wi, v2, acc[x][2]);
            acc[x][3] = _mm512_fmadd_ps(wi, v3, acc[x][3]);
        }
    }
    for (int x = 0; x < tile; x++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o[x] + 16 * c, acc[x][c]);
}

static inline __mmask16 first(int64_t count) { return count >= 16 ? 0xffff : (__mmask16)((1u << count) - 1); }

/* A row's new tokens t0..t0 + n - 1 for one key/value head: its `per` query heads each, n * per queries. Keys and
 * values are read 16 positions at a time for all of them while the block is in the core's first cache (n tokens
 * read their keys once, not n times). Query (t, h) sees the first `seen[t]` positions (prefix, then own); each
 * score, the softmax and the weighted sum run in one fixed order, the same whatever n or t0. p: n * per * stride
 * floats; out[(t * per + h)]: each query's 64 outputs. */
static void row_group64(const float *const *query, float *const *row_out, int per, const RowKV *r, int64_t t0,
                        int64_t n, int64_t group, float scale, float *p, int64_t stride) {
    const float *pk = r->prefix_keys ? r->prefix_keys + group * r->prefix_stride : NULL;
    const float *pv = pk ? r->prefix_values + group * r->prefix_stride : NULL;
    const float *k = r->keys + group * r->group_stride, *v = r->values + group * r->group_stride;
    int64_t before = pk ? r->prefix_len : 0, seen0 = before + r->past + t0; /* (seen0: by every query here) */
    int64_t queries = n * per, last = seen0 + n;
    __m512 scales = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < last; j0 += 16) {
        const float *key[16];
        for (int i = 0; i < 16; i++) {
            int64_t j = j0 + i < last ? j0 + i : j0; /* (past the end: any key; its lane is not stored) */
            key[i] = j < before ? pk + j * 64 : k + (j - before) * 64;
        }
        for (int64_t x = 0; x < queries; x++) {
            int64_t seen = seen0 + x / per + 1;
            if (j0 >= seen) continue;
            __m512 t[16];
            for (int i = 0; i < 16; i++) t[i] = partial_dot64(query[x], key[i]);
            _mm512_mask_storeu_ps(p + x * stride + j0, first(seen - j0), _mm512_mul_ps(sum_across16(t), scales));
        }
    }
    float share[GROUP_MAX * CHUNK_TOKENS];
    for (int64_t x = 0; x < queries; x++) {
        float *px = p + x * stride;
        int64_t seen = seen0 + x / per + 1;
        __m512 m = _mm512_set1_ps(max_of(px, seen, 0, -INFINITY)), sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < seen; j += 16) {
            __mmask16 lanes = first(seen - j);
            __m512 e = _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, px + j), m)));
            _mm512_mask_storeu_ps(px + j, lanes, e);
            sum = _mm512_add_ps(sum, e);
        }
        share[x] = 1.0f / _mm512_reduce_add_ps(sum);
        for (int c = 0; c < 64; c += 16) _mm512_storeu_ps(row_out[x] + c, _mm512_setzero_ps());
    }
    for (int64_t j0 = 0; j0 < last; j0 += 16) {
        const float *value[16];
        for (int i = 0; i < 16 && j0 + i < last; i++) {
            int64_t j = j0 + i;
            value[i] = j < before ? pv + j * 64 : v + (j - before) * 64;
        }
        for (int64_t t = 0; t < n; t++) { /* a token's `per` queries see the same positions: tiles of up to 4 */
            int64_t seen = seen0 + t + 1, count = seen - j0 < 16 ? seen - j0 : 16;
            for (int64_t x = t * per; count > 0 && x < (t + 1) * per; x += 4) {
                const float *w[4];
                float *o[4];
                int tile = (t + 1) * per - x < 4 ? (int)((t + 1) * per - x) : 4;
                for (int i = 0; i < tile; i++) w[i] = p + (x + i) * stride + j0, o[i] = row_out[x + i];
                switch (tile) {
                case 1: weigh_values(value, count, w, o, 1); break;
                case 2: weigh_values(value, count, w, o, 2); break;
                case 3: weigh_values(value, count, w, o, 3); break;
                default: weigh_values(value, count, w, o, 4); break;
                }
            }
        }
    }
    for (int64_t x = 0; x < queries; x++) {
        __m512 s = _mm512_set1_ps(share[x]);
        float *o = row_out[x];
        for (int c = 0; c < 64; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), s));
    }
}

/* A task's tokens of row r from t0 (up to CHUNK_TOKENS), and the positions its last token sees. */
static inline int64_t chunk_tokens(const RowKV *r, int64_t t0) {
    return r->n - t0 < CHUNK_TOKENS ? r->n - t0 : CHUNK_TOKENS;
}
static inline int64_t chunk_last(const RowKV *r, int64_t t0) {
    return (r->prefix_keys ? r->prefix_len : 0) + r->past + t0 + chunk_tokens(r, t0);
}

/* A task's work: its tokens' queries times the positions they see (its last token's count). */
static inline int64_t task_work(const RowKV *r, int64_t t0) { return chunk_tokens(r, t0) * chunk_last(r, t0); }

/* Row r's tokens t0.. (up to CHUNK_TOKENS) for key/value head g: 0, or 1 without memory for their scores. */
static int run_task(const float *q, int64_t q_head, int64_t q_token, const RowKV *r, int64_t t0, int64_t g,
                    int per, int64_t heads, int64_t dim, float scale, float *out) {
    int64_t n = chunk_tokens(r, t0), stride = (chunk_last(r, t0) + 15) / 16 * 16;
    float *p = malloc(sizeof(float) * (size_t)(n * per * stride));
    if (!p) return 1;
    const float *query[GROUP_MAX * CHUNK_TOKENS];
    float *outs[GROUP_MAX * CHUNK_TOKENS];
    for (int64_t t = 0; t < n; t++)
        for (int i = 0; i < per; i++) {
            int64_t h = g * per + i, token = r->first + t0 + t;
            query[t * per + i] = q + h * q_head + token * q_token;
            outs[t * per + i] = out + (token * heads + h) * dim;
        }
    row_group64(query, outs, per, r, t0, n, g, scale, p, stride);
    free(p);
    return 0;
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
 * -1 without memory, -2 (nothing written) where attend_fast says no. Any number of tokens a row: which rows come
 * here is app/attend_rows.py's choice (BATCH_TOKENS). */
int attend_batch(const float *q, int64_t q_head, int64_t q_token, const float *k, int64_t k_head, int64_t k_token,
                 const float *v, int64_t v_head, int64_t v_token, const RowKV *rows, int64_t count, int64_t heads,
                 int64_t groups, int64_t dim, float scale, float *out) {
#if defined(__AVX512F__)
    if (!attend_fast(heads, groups, dim)) return -2;
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
    int64_t chunks = 0; /* tasks: (key/value head, row, its tokens t0.. in chunks of CHUNK_TOKENS) */
    for (int64_t i = 0; i < count; i++) chunks += (rows[i].n + CHUNK_TOKENS - 1) / CHUNK_TOKENS;
    int64_t *chunk_row = malloc(sizeof(int64_t) * (size_t)(2 * chunks)), *chunk_t0 = chunk_row + chunks;
    if (!chunk_row && chunks) return -1;
    int64_t total = 0; /* the tasks' work: queries x positions seen */
    for (int64_t i = 0, c = 0; i < count; i++)
        for (int64_t t0 = 0; t0 < rows[i].n; t0 += CHUNK_TOKENS, c++) {
            chunk_row[c] = i, chunk_t0[c] = t0;
            total += groups * task_work(&rows[i], t0);
        }
    /* Each thread takes one run of tasks in key/value-head order, of about equal work: a core reads about
     * groups / threads heads' keys and values a layer, not every head's (8 rows x 13 tokens: ~6 % less time than
     * tasks dealt out one by one). */
#pragma omp parallel reduction(| : failed)
    {
        int threads = 1, me = 0;
#ifdef _OPENMP
        threads = omp_get_num_threads(), me = omp_get_thread_num();
#endif
        int64_t done = 0;
        for (int64_t task = 0; task < chunks * groups; task++) {
            const RowKV *r = &rows[chunk_row[task % chunks]];
            int64_t t0 = chunk_t0[task % chunks], work = task_work(r, t0), middle = 2 * done + work;
            done += work;
            if (middle * threads < 2 * total * me || middle * threads >= 2 * total * (me + 1)) continue;
            failed |= run_task(q, q_head, q_token, r, t0, task / chunks, per, heads, dim, scale, out);
        }
    }
    free(chunk_row);
    return failed ? -1 : 0;
#else
    (void)q, (void)q_head, (void)q_token, (void)k, (void)k_head, (void)k_token, (void)v, (void)v_head;
    (void)v_token, (void)rows, (void)count, (void)heads, (void)groups, (void)dim, (void)scale, (void)out;
    return -2;
#endif
}

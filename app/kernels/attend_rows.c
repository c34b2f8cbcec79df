/* Every row of a ragged pass with up to 64 new tokens, attending in one call a layer (app/kernels/attend_rows.py): each
 * row's new keys/values written into its cache's room, then each new query's attention over the row's shared
 * prefix and its own keys (heads of 64 or 128 values), in parts (app/kernels/attend_lanes.h) shared between the
 * calling thread's OpenMP team in two phases: first every row's queries over their shared prefix, in 2 pieces, up
 * to 16 queries a task whatever their rows (one vector lane each), and the own positions of rows with long
 * histories, in pieces of 256; then each row's tokens over its own keys, each query's parts merged into one
 * softmax. Each query is computed in its own lane, its parts at positions fixed by position alone, folded in one
 * order, so its bits depend on its own row only: never on the rows beside it, the task or lane it falls in or the
 * threads (tests/test_attend_rows.py checks these bitwise). */

#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "attend_rows.h"
#include "fastmath.h"

#if defined(__AVX512F__)
#include "attend_lanes.h"
#define GROUP_MAX 8 /* query heads per key/value head the fast path takes */
#define CHUNK_TOKENS(per) (16 / (per)) /* a task's tokens of one row: its queries fill at most one vector's lanes; a
                                       * row of many splits between the threads (a query's bits are its own: the same
                                       * in any task) */

static inline int has_prefix(const RowKV *r) { return r->prefix_keys != NULL && r->prefix_len > 0; }

/* A task's tokens of row r from t0 (up to CHUNK_TOKENS). */
static inline int64_t chunk_tokens(const RowKV *r, int64_t t0, int per) {
    return r->n - t0 < CHUNK_TOKENS(per) ? r->n - t0 : CHUNK_TOKENS(per);
}

#define TASK_BASE 23 /* a position's work for 16 lanes' scores and softmax, in one query's weighted values' */

/* Whether this thread (me of threads) takes the next task of `work`, of a phase's `total`: each takes the tasks
 * whose middle falls in its share, one run in order. */
static inline int mine(int64_t *done, int64_t work, int64_t total, int threads, int me) {
    int64_t middle = 2 * *done + work;
    *done += work;
    return middle * threads >= 2 * total * me && middle * threads < 2 * total * (me + 1);
}

/* A shared prefix is read in up to PIECES pieces (of whole blocks of 16 positions, set by its length alone): one
 * row's 3 tasks a layer (one a key/value head) would leave one of 2 threads idle a third of the time. */
#define PIECES 2
static inline int64_t piece_len(const RowKV *r) { return (r->prefix_len + PIECES * 16 - 1) / (PIECES * 16) * 16; }
static inline int pieces_of(const RowKV *r) { return has_prefix(r) ? (int)((r->prefix_len + piece_len(r) - 1) / piece_len(r)) : 0; }

/* A row's own positions are read in pieces of OWN_PIECE from position 0 (boundaries fixed by position: a query's
 * pieces are the same in any task): a long history would otherwise be one task a key/value head (for one token, 3
 * tasks a layer on 2 threads). */
#define OWN_PIECE 256
static inline int64_t own_pieces(const RowKV *r, int64_t t0, int per) {
    return (r->past + t0 + chunk_tokens(r, t0, per) + OWN_PIECE - 1) / OWN_PIECE;
}

/* A prefix task's work: a piece's positions times (TASK_BASE + its queries). */
static inline int64_t prefix_work(const RowKV *r, int64_t queries) { return piece_len(r) * (TASK_BASE + queries); }

/* An own task's work: its piece's positions times (TASK_BASE + its queries). */
static inline int64_t own_work(const RowKV *r, int64_t t0, int per, int64_t piece) {
    int64_t n = chunk_tokens(r, t0, per), left = r->past + t0 + n - piece * OWN_PIECE;
    return (left < OWN_PIECE ? left : OWN_PIECE) * (TASK_BASE + n * per);
}

/* A pass's shapes and scratch, as the tasks read them. */
typedef struct {
    const float *q;
    int64_t q_head, q_token, heads, dim;
    int per;
    float scale;
    float *out, *parts; /* parts: each (token, head)'s parts, `slots` of PART(dim) floats (o[dim], m, l): its
                         * prefix's pieces (up to PIECES), then its own */
    int64_t slots;
} Pass;

static inline const float *query_of(const Pass *s, int64_t token, int64_t h) {
    return s->q + h * s->q_head + token * s->q_token;
}

/* The parts of `queries` queries (lanes) over `count` positions at k, v (see lanes_part) into o[x]: 0, or 1
 * without memory for their scores. */
static int run_part(const Pass *s, const float *const *query, float *const *o, int queries, int per, const float *k,
                    const float *v, int64_t count, int64_t seen0) {
    float *p = aligned_alloc(64, sizeof(float) * 16 * (size_t)((count + 15) / 16 * 16)), m[16], l[16];
    if (!p) return 1;
    BY_DIM(s->dim, lanes_part, query, queries, per, k, v, count, seen0, s->scale, p, m, l, o);
    for (int x = 0; x < queries; x++) o[x][PART_M(s->dim)] = m[x], o[x][PART_L(s->dim)] = l[x];
    free(p);
    return 0;
}

/* A prefix task: up to 16 (token, head) queries of rows sharing row r's prefix, all of key/value head g, over
 * the prefix's piece `piece`. */
static int prefix_task(const Pass *s, const RowKV *r, int64_t g, int piece, const int64_t *which, int queries) {
    int64_t from = piece * piece_len(r), count = r->prefix_len - from < piece_len(r) ? r->prefix_len - from : piece_len(r);
    const float *query[16] = {0};
    float *o[16] = {0};
    for (int x = 0; x < queries; x++) {
        query[x] = query_of(s, which[x] / s->heads, which[x] % s->heads);
        o[x] = s->parts + (which[x] * s->slots + piece) * PART(s->dim);
    }
    int64_t at = g * r->prefix_stride + s->dim * from;
    return run_part(s, query, o, queries, 1, r->prefix_keys + at, r->prefix_values + at, count, count);
}

/* Row r's tokens t0.. (up to CHUNK_TOKENS), key/value head g: each query's parts merged into its output. */
static void merge_chunk(const Pass *s, const RowKV *r, int64_t t0, int64_t g) {
    int64_t parts = pieces_of(r) + own_pieces(r, t0, s->per);
    for (int64_t t = 0; t < chunk_tokens(r, t0, s->per); t++)
        for (int i = 0; i < s->per; i++) {
            int64_t at = (r->first + t0 + t) * s->heads + g * s->per + i;
            BY_DIM(s->dim, merge, s->parts + at * s->slots * PART(s->dim), parts, s->out + at * s->dim);
        }
}

/* An own task: row r's tokens t0.. (up to CHUNK_TOKENS) for key/value head g over piece `piece` of the row's own
 * positions, into their parts; then, where `merged`, each query's parts merged into its output. */
static int own_task(const Pass *s, const RowKV *r, int64_t t0, int64_t g, int64_t piece, int merged) {
    int per = s->per;
    int64_t n = chunk_tokens(r, t0, per), count = r->past + t0 + n, from = piece * OWN_PIECE;
    int64_t len = count - from < OWN_PIECE ? count - from : OWN_PIECE;
    const float *query[16];
    float *o[16];
    for (int64_t t = 0; t < n; t++)
        for (int i = 0; i < per; i++) {
            int64_t at = (r->first + t0 + t) * s->heads + g * per + i;
            query[t * per + i] = query_of(s, r->first + t0 + t, g * per + i);
            o[t * per + i] = s->parts + (at * s->slots + pieces_of(r) + piece) * PART(s->dim);
        }
    int64_t head = g * r->group_stride + s->dim * from;
    if (run_part(s, query, o, (int)(n * per), per, r->keys + head, r->values + head, len, r->past + t0 - from))
        return 1;
    if (merged) merge_chunk(s, r, t0, g);
    return 0;
}
#endif

/* Whether attend_batch computes this geometry: the AVX-512 path, 64- or 128-value heads, up to GROUP_MAX query heads
 * a key/value head (elsewhere the rows keep PyTorch's kernels: a portable version measured 38 % slower than them
 * for 8 rows x 3 tokens when built without AVX-512). */
int attend_fast(int64_t heads, int64_t groups, int64_t dim) {
#if defined(__AVX512F__)
    return (dim == 64 || dim == 128) && groups > 0 && heads % groups == 0 && heads / groups <= GROUP_MAX;
#else
    (void)heads, (void)groups, (void)dim;
    return 0;
#endif
}

/* The pass's new queries (`heads` heads), keys and values (`groups` heads), `dim` values each, with their element
 * strides between heads and between tokens; out: tokens x heads x dim, written for the rows' tokens. Returns 0,
 * -1 without memory, -2 (nothing written) where attend_fast says no. Any number of tokens a row: which rows come
 * here is app/kernels/attend_rows.py's choice (BATCH_TOKENS). */
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
    int per = (int)(heads / groups), failed = 0;
    int64_t tokens = 0, shared = 0, chunks = 0, owns = 0, most = 0; /* owns: (chunk, key/value head, own piece)s */
    for (int64_t i = 0; i < count; i++) {
        tokens = rows[i].first + rows[i].n > tokens ? rows[i].first + rows[i].n : tokens;
        shared += has_prefix(&rows[i]) ? rows[i].n * heads : 0;
        for (int64_t t0 = 0; t0 < rows[i].n; t0 += CHUNK_TOKENS(per), chunks++) {
            int64_t pieces = own_pieces(&rows[i], t0, per);
            owns += pieces > 1 ? groups * pieces : 0, most = pieces > most ? pieces : most;
        }
    }
    Pass s = {q, q_head, q_token, heads, dim, per, scale, out, NULL, PIECES + most};
    /* Phase 1's tasks: each shared prefix's pieces, its queries (its rows in order, their tokens, the head's query
     * heads) 16 at a time, for each key/value head; then the own pieces of each (row, its tokens t0.. in chunks,
     * key/value head) that has more than one. Phase 2: each chunk's queries merged. */
    int64_t *which = malloc(sizeof(int64_t) * (size_t)((4 * PIECES + 1) * shared + 2 * chunks + count + 3 * owns));
    s.parts = aligned_alloc(64, sizeof(float) * PART(dim) * (size_t)(s.slots * tokens * heads));
    if (!which || !s.parts) {
        free(which), free(s.parts);
        return -1;
    }
    int64_t *leader = which + shared, *task_at = leader + count, *task_end = task_at + PIECES * shared,
            *task_lead = task_end + PIECES * shared, *task_head = task_lead + PIECES * shared,
            *chunk_row = task_head + PIECES * shared, *chunk_t0 = chunk_row + chunks, *own_chunk = chunk_t0 + chunks,
            *own_head = own_chunk + owns, *own_piece = own_head + owns;
    int64_t w = 0, tasks = 0, work = 0;
    for (int64_t i = 0; i < count; i++) {
        const RowKV *r = &rows[i];
        leader[i] = i;
        for (int64_t j = 0; j < i; j++)
            if (leader[j] == j && rows[j].prefix_keys == r->prefix_keys && rows[j].prefix_values == r->prefix_values
                && rows[j].prefix_stride == r->prefix_stride && rows[j].prefix_len == r->prefix_len) {
                leader[i] = j;
                break;
            }
    }
    for (int64_t i = 0; i < count; i++) {
        if (leader[i] != i || !has_prefix(&rows[i])) continue;
        for (int64_t g = 0; g < groups; g++) {
            int64_t start = w;
            for (int64_t j = i; j < count; j++)
                for (int64_t t = 0; leader[j] == i && t < rows[j].n; t++)
                    for (int h = 0; h < per; h++) which[w++] = (rows[j].first + t) * heads + g * per + h;
            for (int piece = 0; piece < pieces_of(&rows[i]); piece++) /* (a piece's tasks together: its keys stay
                                                                         * cached between them) */
                for (int64_t at = start; at < w; at += 16) {
                    task_at[tasks] = at, task_end[tasks] = w - at < 16 ? w : at + 16;
                    task_lead[tasks] = i, task_head[tasks++] = g * PIECES + piece;
                    work += prefix_work(&rows[i], task_end[tasks - 1] - at);
                }
        }
    }
    for (int64_t i = 0, c = 0; i < count; i++)
        for (int64_t t0 = 0; t0 < rows[i].n; t0 += CHUNK_TOKENS(per), c++) chunk_row[c] = i, chunk_t0[c] = t0;
    int64_t late = 0; /* phase 2's work: a chunk of one own piece computes it there and merges at once (no
                       * more parts than before pieces: the usual decoding row), a longer one merges only */
    for (int64_t g = 0, h = 0; g < groups; g++)
        for (int64_t c = 0; c < chunks; c++) {
            const RowKV *r = &rows[chunk_row[c]];
            int64_t t0 = chunk_t0[c], pieces = own_pieces(r, t0, per);
            late += pieces == 1 ? own_work(r, t0, per, 0) : TASK_BASE;
            for (int64_t piece = 0; pieces > 1 && piece < pieces; piece++, h++) {
                own_chunk[h] = c, own_head[h] = g, own_piece[h] = piece;
                work += own_work(r, t0, per, piece);
            }
        }
    /* Each thread takes one run of each phase's tasks, in key/value-head order, of about equal work: a core reads
     * about groups / threads heads' keys and values a layer, not every head's. */
#pragma omp parallel reduction(| : failed)
    {
        int threads = 1, me = 0;
#ifdef _OPENMP
        threads = omp_get_num_threads(), me = omp_get_thread_num();
#endif
        int64_t done = 0;
        for (int64_t task = 0; task < tasks; task++) {
            const RowKV *r = &rows[task_lead[task]];
            int64_t n = task_end[task] - task_at[task];
            if (mine(&done, prefix_work(r, n), work, threads, me))
                failed |= prefix_task(&s, r, task_head[task] / PIECES, (int)(task_head[task] % PIECES),
                                      which + task_at[task], (int)n);
        }
        for (int64_t h = 0; h < owns; h++) {
            const RowKV *r = &rows[chunk_row[own_chunk[h]]];
            int64_t t0 = chunk_t0[own_chunk[h]];
            if (mine(&done, own_work(r, t0, per, own_piece[h]), work, threads, me))
                failed |= own_task(&s, r, t0, own_head[h], own_piece[h], 0);
        }
#pragma omp barrier
        done = 0;
        for (int64_t task = 0; task < chunks * groups; task++) {
            const RowKV *r = &rows[chunk_row[task % chunks]];
            int64_t t0 = chunk_t0[task % chunks], g = task / chunks, one = own_pieces(r, t0, per) == 1;
            if (!mine(&done, one ? own_work(r, t0, per, 0) : TASK_BASE, late, threads, me)) continue;
            if (one)
                failed |= own_task(&s, r, t0, g, 0, 1);
            else
                merge_chunk(&s, r, t0, g);
        }
    }
    free(which), free(s.parts);
    return failed ? -1 : 0;
#else
    (void)q, (void)q_head, (void)q_token, (void)k, (void)k_head, (void)k_token, (void)v, (void)v_head;
    (void)v_token, (void)rows, (void)count, (void)heads, (void)groups, (void)dim, (void)scale, (void)out;
    return -2;
#endif
}

/* Every row of a ragged pass with up to 64 new tokens, attending in one call a layer (app/attend_rows.py): each
 * row's new keys/values written into its cache's room, then each new query's attention over the row's shared
 * prefix and its own keys, shared between the calling thread's OpenMP team in two phases: first every row's
 * queries over their shared prefix, up to 16 queries a task whatever their rows (one vector lane each), then each
 * row's tokens over its own keys, merged with their prefix part. Each query is computed in its own lane in one
 * fixed order, so its bits depend on its own row only: never on the rows beside it, the task or lane it falls in
 * or the threads (tests/test_attend_rows.py checks these bitwise). */
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
#define CHUNK_TOKENS(per) (16 / (per)) /* a task's tokens of one row: its queries fill at most one vector's lanes; a
                                       * row of many splits between the threads (a query's bits are its own: the same
                                       * in any task) */

/* e^x for 16 lanes, as exp_approx (fastmath.h) computes it (x = k ln2 + r, e^r by its Taylor polynomial to r^7),
 * with each multiply-add fused (14 operations, not 24: the softmax's exponentials were a fifth of the kernel's)
 * and 2^k applied with scalef (exact, as its exponent bits). Clamped to [-87, 88]: no subnormal results, whose
 * arithmetic is slow. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 shift = _mm512_set1_ps(ROUND_SHIFT);
    __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shift), shift);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 e = _mm512_fmadd_ps(r, _mm512_set1_ps(1.0f / 5040), _mm512_set1_ps(1.0f / 720));
    e = _mm512_fmadd_ps(r, e, _mm512_set1_ps(1.0f / 120));
    e = _mm512_fmadd_ps(r, e, _mm512_set1_ps(1.0f / 24));
    e = _mm512_fmadd_ps(r, e, _mm512_set1_ps(1.0f / 6));
    e = _mm512_fmadd_ps(r, e, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(r, e, _mm512_set1_ps(1.0f));
    e = _mm512_fmadd_ps(r, e, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(e, k);
}

/* Scores of up to 16 queries (lane x: query x; qt: value d of every query at 16 d) for 16 keys at kb (64 values
 * each, one after another): lane x of acc[i] is q_x[0] k_i[0] + ... + q_x[63] k_i[63] as one chain of multiply-adds
 * in that order, so a pair's bits are the same in any lane, block or task. Keys across lanes need no sum across
 * lanes (that transpose was a third of the old kernel's time). */
static inline void block_scores(const float *qt, const float *kb, const float *next, __m512 *acc) {
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < 64; d++) {
        __m512 q = _mm512_load_ps(qt + 16 * d);
        _mm_prefetch((const char *)(next + 16 * d), _MM_HINT_T0); /* the next block's 64 lines, one an iteration */
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(q, _mm512_set1_ps(kb[64 * i + d]), acc[i]);
    }
}

/* o[x] += p[j][x0 + x] * value j over `count` positions (values 64 apart, p 16 apart), for `tile` queries: each
 * query adds position by position in one order (the same bits in any tile); each value is loaded once for the tile
 * and the tile's 4 * tile running sums are independent chains. */
static inline void weigh_values(const float *value, const float *p, int64_t count, int x0, __m512 (*acc)[4],
                                const int tile) {
    for (int64_t i = 0; i < count; i++) {
        __m512 v0 = _mm512_loadu_ps(value + 64 * i), v1 = _mm512_loadu_ps(value + 64 * i + 16),
               v2 = _mm512_loadu_ps(value + 64 * i + 32), v3 = _mm512_loadu_ps(value + 64 * i + 48);
        for (int x = 0; x < tile; x++) {
            __m512 w = _mm512_set1_ps(p[16 * i + x0 + x]);
            acc[x][0] = _mm512_fmadd_ps(w, v0, acc[x][0]);
            acc[x][1] = _mm512_fmadd_ps(w, v1, acc[x][1]);
            acc[x][2] = _mm512_fmadd_ps(w, v2, acc[x][2]);
            acc[x][3] = _mm512_fmadd_ps(w, v3, acc[x][3]);
        }
    }
}

/* The lanes (of queries t * per + h, t a token) that see position j, where the task's first token sees seen0 + 1
 * positions: every lane up to seen0, then not the tokens before the one at j. */
static inline __mmask16 seen_by(int64_t j, int64_t seen0, int per) {
    int64_t hidden = j > seen0 ? (j - seen0) * per : 0;
    return hidden >= 16 ? 0 : (__mmask16)(0xffffu << hidden);
}

static inline int has_prefix(const RowKV *r) { return r->prefix_keys != NULL && r->prefix_len > 0; }

#define PART 80 /* floats of a query's prefix part: o[64], m, l (a multiple of 16: each part's o stays aligned) */
#define PART_M 64
#define PART_L 65
#define VALUE_BLOCK 64 /* positions whose values (16 KB) every query tile reads while they are in the first cache */

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

/* Attention of up to 16 queries (one lane each: query[x]) over `count` positions of keys k and values v (64
 * floats a position, one after another); lane x sees positions j < seen0 + x / per + 1 (all of them where
 * seen0 >= count: a shared prefix). Per lane: m[x] the largest scaled score, l[x] the sum of e^(s - m), o[x] the
 * sum of e^(s - m) v (not divided: a prefix's part is merged with the row's own, see merge). Each lane runs the
 * same arithmetic in the same order whatever the other lanes hold. p: 16 floats a position (rounded up to 16). */
static void lanes_part(const float *const *query, int queries, int per, const float *k, const float *v,
                       int64_t count, int64_t seen0, float scale, float *p, float *m, float *l, float *const *o) {
    float qt[64 * 16] __attribute__((aligned(64))) = {0}, block[16 * 64];
    for (int x = 0; x < queries; x++)
        for (int d = 0; d < 64; d++) qt[16 * d + x] = query[x][d];
    __m512 scales = _mm512_set1_ps(scale), none = _mm512_set1_ps(-INFINITY), top = none;
    for (int64_t j0 = 0; j0 < count; j0 += 16) {
        const float *kb = k + 64 * j0;
        if (j0 + 16 > count) { /* the last block: its keys then zeros (storage past them is not ours to read) */
            for (int i = 0; i < 16 * 64; i++) block[i] = j0 * 64 + i < count * 64 ? kb[i] : 0.0f;
            kb = block;
        }
        __m512 acc[16];
        block_scores(qt, kb, j0 + 32 <= count ? kb + 1024 : kb, acc);
        for (int i = 0; i < 16 && j0 + i < count; i++) {
            __m512 s = _mm512_mask_blend_ps(seen_by(j0 + i, seen0, per), none, _mm512_mul_ps(acc[i], scales));
            _mm512_store_ps(p + 16 * (j0 + i), s);
            top = _mm512_max_ps(top, s);
        }
    }
    __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t j = 0; j < count; j++) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(p + 16 * j), top));
        e = _mm512_maskz_mov_ps(seen_by(j, seen0, per), e); /* (e^-inf: 0, not exp16's clamped e^-87) */
        _mm512_store_ps(p + 16 * j, e);
        sums[j & 3] = _mm512_add_ps(sums[j & 3], e);
    }
    _mm512_storeu_ps(m, top);
    _mm512_storeu_ps(l, _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3])));
    /* Values a block at a time, every tile of up to 4 queries reading the block while it is in the first cache
     * (tiles of about equal size; a query weighs positions it does not see by 0: exactly its own sums) */
    int tiles = (queries + 3) / 4, tile_of[4], first_of[4];
    __m512 sum[4][4][4];
    for (int t = 0, x0 = 0; t < tiles; t++) {
        first_of[t] = x0, tile_of[t] = (queries - x0) / (tiles - t), x0 += tile_of[t];
        for (int x = 0; x < 4; x++)
            for (int c = 0; c < 4; c++) sum[t][x][c] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < count; j += VALUE_BLOCK)
        for (int t = 0; t < tiles; t++) {
            int x0 = first_of[t];
            int64_t end = seen0 + (x0 + tile_of[t] - 1) / per + 1; /* positions the tile's last query sees */
            int64_t n = (end < count ? end : count) - j;
            n = n < VALUE_BLOCK ? n : VALUE_BLOCK;
            switch (tile_of[t]) {
            case 1: weigh_values(v + 64 * j, p + 16 * j, n, x0, sum[t], 1); break;
            case 2: weigh_values(v + 64 * j, p + 16 * j, n, x0, sum[t], 2); break;
            case 3: weigh_values(v + 64 * j, p + 16 * j, n, x0, sum[t], 3); break;
            default: weigh_values(v + 64 * j, p + 16 * j, n, x0, sum[t], 4); break;
            }
        }
    for (int t = 0; t < tiles; t++)
        for (int x = 0; x < tile_of[t]; x++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o[first_of[t] + x] + 16 * c, sum[t][x][c]);
}

/* Fold part (bm, bl, bo) into the running part (m, l, o) of one query: one softmax over both, as flash attention
 * merges blocks. */
static inline void fold(float *m, float *l, __m512 *o, float bm, float bl, const float *bo) {
    float top = *m > bm ? *m : bm, a = exp_approx(*m - top), b = exp_approx(bm - top);
    __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
    *l = *l * a + bl * b, *m = top;
    for (int c = 0; c < 4; c++) o[c] = _mm512_add_ps(_mm512_mul_ps(o[c], va), _mm512_mul_ps(_mm512_loadu_ps(bo + 16 * c), vb));
}

/* A query's output from its parts (`count` of PART floats at `parts`, in the order of their positions): folded
 * from an empty part (exactly the first), then divided by the softmax's sum. A part whose positions the query does
 * not see (m = -inf, l = 0, o = 0) leaves the fold's bits as they are. */
static void merge(const float *parts, int64_t count, float *out) {
    float running = -INFINITY, total = 0.0f;
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t i = 0; i < count; i++)
        fold(&running, &total, sum, parts[i * PART + PART_M], parts[i * PART + PART_L], parts + i * PART);
    __m512 share = _mm512_set1_ps(1.0f / total);
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(sum[c], share));
}

/* A shared prefix is read in up to PIECES pieces (of whole blocks of 16 positions, set by its length alone): one
 * row's 3 tasks a layer (one a key/value head) would leave one of 2 threads idle a third of the time. */
#define PIECES 2
static inline int64_t piece_len(const RowKV *r) { return (r->prefix_len + 2 * 16 - 1) / (2 * 16) * 16; }
static inline int pieces_of(const RowKV *r) { return has_prefix(r) ? (int)((r->prefix_len + piece_len(r) - 1) / piece_len(r)) : 0; }

/* A row's own positions are read in pieces of OWN_PIECE from position 0 (boundaries fixed by position: a query's
 * pieces are the same in any task): a long history would otherwise be one task a key/value head (for one token, 3
 * tasks a layer on 2 threads). */
#define OWN_PIECE 256
static inline int64_t own_pieces(const RowKV *r, int64_t t0, int per) {
    return (r->past + t0 + chunk_tokens(r, t0, per) + OWN_PIECE - 1) / OWN_PIECE;
}

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
    float *out, *parts; /* parts: each (token, head)'s parts, `slots` of PART floats (o[64], m, l): its prefix's
                         * pieces (up to PIECES), then its own but the last */
    int64_t slots;
} Pass;

static inline const float *query_of(const Pass *s, int64_t token, int64_t h) {
    return s->q + h * s->q_head + token * s->q_token;
}

/* A prefix task: up to 16 (token, head) queries of rows sharing row r's prefix, all of key/value head g, over
 * the prefix's piece `piece`. */
static int prefix_task(const Pass *s, const RowKV *r, int64_t g, int piece, const int64_t *which, int queries) {
    int64_t from = piece * piece_len(r), count = r->prefix_len - from < piece_len(r) ? r->prefix_len - from : piece_len(r);
    float *p = aligned_alloc(64, sizeof(float) * 16 * (size_t)((count + 15) / 16 * 16));
    if (!p) return 1;
    const float *query[16] = {0};
    float *o[16] = {0}, m[16], l[16];
    for (int x = 0; x < queries; x++) {
        query[x] = query_of(s, which[x] / s->heads, which[x] % s->heads);
        o[x] = s->parts + (which[x] * s->slots + piece) * PART;
    }
    int64_t at = g * r->prefix_stride + 64 * from;
    lanes_part(query, queries, 1, r->prefix_keys + at, r->prefix_values + at, count, count, s->scale, p, m, l, o);
    for (int x = 0; x < queries; x++) o[x][PART_M] = m[x], o[x][PART_L] = l[x];
    free(p);
    return 0;
}

/* Row r's tokens t0.. (up to CHUNK_TOKENS), key/value head g: each query's parts merged into its output. */
static void merge_chunk(const Pass *s, const RowKV *r, int64_t t0, int64_t g) {
    int64_t parts = pieces_of(r) + own_pieces(r, t0, s->per);
    for (int64_t t = 0; t < chunk_tokens(r, t0, s->per); t++)
        for (int i = 0; i < s->per; i++) {
            int64_t at = (r->first + t0 + t) * s->heads + g * s->per + i;
            merge(s->parts + at * s->slots * PART, parts, s->out + at * s->dim);
        }
}

/* An own task: row r's tokens t0.. (up to CHUNK_TOKENS) for key/value head g over piece `piece` of the row's own
 * positions, into their parts; then, where `merged`, each query's parts merged into its output. */
static int own_task(const Pass *s, const RowKV *r, int64_t t0, int64_t g, int64_t piece, int merged) {
    int per = s->per;
    int64_t n = chunk_tokens(r, t0, per), count = r->past + t0 + n, from = piece * OWN_PIECE;
    int64_t len = count - from < OWN_PIECE ? count - from : OWN_PIECE;
    float *p = aligned_alloc(64, sizeof(float) * 16 * (size_t)((len + 15) / 16 * 16));
    if (!p) return 1;
    const float *query[16];
    float *o[16], m[16], l[16];
    for (int64_t t = 0; t < n; t++)
        for (int i = 0; i < per; i++) {
            int64_t at = (r->first + t0 + t) * s->heads + g * per + i;
            query[t * per + i] = query_of(s, r->first + t0 + t, g * per + i);
            o[t * per + i] = s->parts + (at * s->slots + pieces_of(r) + piece) * PART;
        }
    int64_t head = g * r->group_stride + 64 * from;
    lanes_part(query, (int)(n * per), per, r->keys + head, r->values + head, len, r->past + t0 - from, s->scale, p,
               m, l, o);
    for (int x = 0; x < n * per; x++) o[x][PART_M] = m[x], o[x][PART_L] = l[x];
    free(p);
    if (merged) merge_chunk(s, r, t0, g);
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
    s.parts = aligned_alloc(64, sizeof(float) * PART * (size_t)(s.slots * tokens * heads));
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
                    work += piece_len(&rows[i]) * (TASK_BASE + (task_end[tasks - 1] - at));
                }
        }
    }
    int64_t late = 0; /* phase 2's work: a chunk of one own piece computes it there and merges at once (no
                       * more parts than before pieces: the usual decoding row), a longer one merges only */
    for (int64_t g = 0, h = 0; g < groups; g++)
        for (int64_t i = 0, c = 0; i < count; i++)
            for (int64_t t0 = 0; t0 < rows[i].n; t0 += CHUNK_TOKENS(per), c++) {
                chunk_row[c] = i, chunk_t0[c] = t0;
                int64_t pieces = own_pieces(&rows[i], t0, per);
                late += pieces == 1 ? own_work(&rows[i], t0, per, 0) : TASK_BASE;
                for (int64_t piece = 0; pieces > 1 && piece < pieces; piece++, h++) {
                    own_chunk[h] = c, own_head[h] = g, own_piece[h] = piece;
                    work += own_work(&rows[i], t0, per, piece);
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
            if (mine(&done, piece_len(r) * (TASK_BASE + n), work, threads, me))
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

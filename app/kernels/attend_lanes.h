/* The vector kernel of app/kernels/attend_rows.c: up to 16 queries' attention, one vector lane each, over positions of
 * keys and values of 64 or 128 values (dim), as parts (largest score, softmax sum, weighted values) that fold into
 * one softmax in a fixed order. Every lane runs the same arithmetic in the same order whatever the other lanes
 * hold, so a query's bits are its own. AVX-512 only (attend_rows.c includes it under __AVX512F__). */

#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fastmath.h"

#define DIM_MAX 128 /* values a head: 64 or 128 */
/* f(..., dim) with dim 64 or 128 as a constant: f and the INLINED functions it calls compiled for each */
#define BY_DIM(dim, f, ...) ((dim) == 64 ? f(__VA_ARGS__, 64) : f(__VA_ARGS__, 128))
#define INLINED static inline __attribute__((always_inline))

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

/* Scores of up to 16 queries (lane x: query x; qt: value d of every query at 16 d) for 16 keys at kb (dim values
 * each, one after another): lane x of acc[i] is q_x[0] k_i[0] + ... + q_x[dim-1] k_i[dim-1] as one chain of
 * multiply-adds in that order, so a pair's bits are the same in any lane, block or task. Keys across lanes need no
 * sum across lanes (that transpose was a third of the old kernel's time). */
INLINED void block_scores(const float *qt, const float *kb, const float *next, __m512 *acc, const int dim) {
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < dim; d++) {
        __m512 q = _mm512_load_ps(qt + 16 * d);
        _mm_prefetch((const char *)(next + 16 * d), _MM_HINT_T0); /* the next block's dim lines, one an iteration */
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(q, _mm512_set1_ps(kb[dim * i + d]), acc[i]);
    }
}

/* o[x] += p[j][x0 + x] * value j over `count` positions (64 values each, `dim` apart; p 16 apart), for `tile`
 * queries: each query adds position by position in one order (the same bits in any tile); each value is loaded once
 * for the tile and the tile's 4 * tile running sums are independent chains. A 128-value head's values take one
 * call a half (8 * tile sums would not fit in the registers); each sum is still one chain over the positions. */
INLINED void weigh_values(const float *value, const float *p, int64_t count, int x0, __m512 (*acc)[4],
                          const int tile, const int dim) {
    for (int64_t i = 0; i < count; i++) {
        __m512 v0 = _mm512_loadu_ps(value + dim * i), v1 = _mm512_loadu_ps(value + dim * i + 16),
               v2 = _mm512_loadu_ps(value + dim * i + 32), v3 = _mm512_loadu_ps(value + dim * i + 48);
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

#define PART(dim) ((dim) + 16) /* floats of a query's part: o[dim], m, l (a multiple of 16: each o stays aligned) */
#define PART_M(dim) (dim)
#define PART_L(dim) ((dim) + 1)
#define VALUE_BLOCK 64 /* positions whose values (16 KB of 64-value halves) every query tile reads while they are in
                        * the first cache */

/* Attention of up to 16 queries (one lane each: query[x]) over `count` positions of keys k and values v (dim
 * floats a position, one after another); lane x sees positions j < seen0 + x / per + 1 (all of them where
 * seen0 >= count: a shared prefix). Per lane: m[x] the largest scaled score, l[x] the sum of e^(s - m), o[x] the
 * sum of e^(s - m) v (not divided: a query's parts are merged into one softmax, see merge). Each lane runs the
 * same arithmetic in the same order whatever the other lanes hold. p: 16 floats a position (rounded up to 16). */
INLINED void lanes_part(const float *const *query, int queries, int per, const float *k, const float *v, int64_t count,
                        int64_t seen0, float scale, float *p, float *m, float *l, float *const *o, const int dim) {
    float qt[DIM_MAX * 16] __attribute__((aligned(64))), block[16 * DIM_MAX];
    memset(qt, 0, sizeof(float) * 16 * dim);
    for (int x = 0; x < queries; x++)
        for (int d = 0; d < dim; d++) qt[16 * d + x] = query[x][d];
    __m512 scales = _mm512_set1_ps(scale), none = _mm512_set1_ps(-INFINITY), top = none;
    for (int64_t j0 = 0; j0 < count; j0 += 16) {
        const float *kb = k + dim * j0;
        if (j0 + 16 > count) { /* the last block: its keys then zeros (storage past them is not ours to read) */
            for (int i = 0; i < 16 * dim; i++) block[i] = j0 * dim + i < count * dim ? kb[i] : 0.0f;
            kb = block;
        }
        __m512 acc[16];
        block_scores(qt, kb, j0 + 32 <= count ? kb + 16 * dim : kb, acc, dim);
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
    /* Values a block and a 64-value half at a time, every tile of up to 4 queries reading the block's half while it
     * is in the first cache (tiles of about equal size; a query weighs positions it does not see by 0: exactly its
     * own sums) */
    int tiles = (queries + 3) / 4, tile_of[4], first_of[4];
    __m512 sum[4][DIM_MAX / 64][4][4];
    for (int t = 0, x0 = 0; t < tiles; t++) {
        first_of[t] = x0, tile_of[t] = (queries - x0) / (tiles - t), x0 += tile_of[t];
        for (int h = 0; h < dim / 64; h++)
            for (int x = 0; x < 4; x++)
                for (int c = 0; c < 4; c++) sum[t][h][x][c] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < count; j += VALUE_BLOCK)
        for (int h = 0; h < dim / 64; h++)
            for (int t = 0; t < tiles; t++) {
                int x0 = first_of[t];
                int64_t end = seen0 + (x0 + tile_of[t] - 1) / per + 1; /* positions the tile's last query sees */
                int64_t n = (end < count ? end : count) - j;
                n = n < VALUE_BLOCK ? n : VALUE_BLOCK;
                const float *half = v + dim * j + 64 * h;
                switch (tile_of[t]) {
                case 1: weigh_values(half, p + 16 * j, n, x0, sum[t][h], 1, dim); break;
                case 2: weigh_values(half, p + 16 * j, n, x0, sum[t][h], 2, dim); break;
                case 3: weigh_values(half, p + 16 * j, n, x0, sum[t][h], 3, dim); break;
                default: weigh_values(half, p + 16 * j, n, x0, sum[t][h], 4, dim); break;
                }
            }
    for (int t = 0; t < tiles; t++)
        for (int h = 0; h < dim / 64; h++)
            for (int x = 0; x < tile_of[t]; x++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(o[first_of[t] + x] + 64 * h + 16 * c, sum[t][h][x][c]);
}

/* Fold part (bm, bl, bo) into the running part (m, l, o) of one query: one softmax over both, as flash attention
 * merges blocks. */
INLINED void fold(float *m, float *l, __m512 *o, float bm, float bl, const float *bo, const int dim) {
    float top = *m > bm ? *m : bm, a = exp_approx(*m - top), b = exp_approx(bm - top);
    __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
    *l = *l * a + bl * b, *m = top;
    for (int c = 0; c < dim / 16; c++)
        o[c] = _mm512_add_ps(_mm512_mul_ps(o[c], va), _mm512_mul_ps(_mm512_loadu_ps(bo + 16 * c), vb));
}

/* A query's output from its parts (`count` of PART(dim) floats at `parts`, in the order of their positions): folded
 * from an empty part (exactly the first), then divided by the softmax's sum. A part whose positions the query does
 * not see (m = -inf, l = 0, o = 0) leaves the fold's bits as they are. */
INLINED void merge(const float *parts, int64_t count, float *out, const int dim) {
    float running = -INFINITY, total = 0.0f;
    __m512 sum[DIM_MAX / 16];
    for (int c = 0; c < dim / 16; c++) sum[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < count; i++)
        fold(&running, &total, sum, parts[i * PART(dim) + PART_M(dim)], parts[i * PART(dim) + PART_L(dim)],
             parts + i * PART(dim), dim);
    __m512 share = _mm512_set1_ps(1.0f / total);
    for (int c = 0; c < dim / 16; c++) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(sum[c], share));
}

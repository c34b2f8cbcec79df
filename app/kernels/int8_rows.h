/* Per-row pieces of the int8 layers' work (app/int8_rows.c, app/int8_layer.c): each computes one row alone, in
 * one fixed order of float32 operations, so a token's bits never depend on the rows beside it or on where its
 * row lies in memory. Built with -ffp-contract=off: no multiply and add fused where the torch versions round
 * twice (the one fused step is written out with fmaf). */

#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "fastmath.h"

/* Rows are computed alone, so many of them are shared between the calling thread's OpenMP team (each row is one
 * thread's, in its one order: the same bits), from PARALLEL_VALUES values on, where the work outweighs starting
 * the team; fewer run as a plain loop (an OpenMP region with a false `if` still cost ~0.4 ms a one-token step). */
#define PARALLEL_VALUES 4096
#define FOR_ROWS(i, n, values, ...)                                                                             \
    do {                                                                                                        \
        if ((n) > 1 && (values) >= PARALLEL_VALUES) {                                                           \
            _Pragma("omp parallel for schedule(static)") for (int64_t i = 0; i < (n); i++) __VA_ARGS__          \
        } else {                                                                                                \
            for (int64_t i = 0; i < (n); i++) __VA_ARGS__                                                       \
        }                                                                                                       \
    } while (0)

/* A float32 of magnitude below 2**22 plus this lies where floats are the integers: (v + R) - R is v rounded to
 * the nearest integer, ties to even (the float adder's own rounding), as torch's version rounds. */
static const float ROUNDER = 12582912.0f; /* 1.5 * 2**23 */

/* Where split rows go: 2n rows of d values (the high parts of rows 0..n-1, then their low parts), as floats
 * holding the integer values (f32) or as int8 (i8), whichever is not NULL; and one scale per row. */
typedef struct {
    float *f32;
    int8_t *i8;
    float *scale;
    int64_t n;
    float act_max, fine;
} Parts;

static inline float row_scale(const float *row, int64_t d, float act_max) {
    float m = max_of(row, d, 1, 0.0f);
    return (m > 1e-12f ? m : 1e-12f) / act_max;
}

/* Row i of the split: x ≈ (high + low / fine) * scale. */
static inline void split_row(const float *row, int64_t d, int64_t i, const Parts *p) {
    float s = row_scale(row, d, p->act_max), fine = p->fine;
    p->scale[i] = s;
    /* (the outputs as local restrict pointers: an int8 store may alias anything, and re-reading p after each one
     * kept this loop scalar) */
    float *restrict high_f = p->f32 ? p->f32 + i * d : NULL, *restrict low_f = p->f32 ? p->f32 + (p->n + i) * d : NULL;
    int8_t *restrict high_i = p->i8 ? p->i8 + i * d : NULL, *restrict low_i = p->i8 ? p->i8 + (p->n + i) * d : NULL;
    if (high_f) {
        for (int64_t j = 0; j < d; j++) {
            float v = row[j] / s;
            float high = (v + ROUNDER) - ROUNDER;
            high_f[j] = high;
            low_f[j] = ((v - high) * fine + ROUNDER) - ROUNDER;
        }
    } else {
        for (int64_t j = 0; j < d; j++) {
            float v = row[j] / s;
            float high = (v + ROUNDER) - ROUNDER;
            high_i[j] = (int8_t)high;
            low_i[j] = (int8_t)(((v - high) * fine + ROUNDER) - ROUNDER);
        }
    }
}

/* The matmul's sums over split rows (2n rows of o, floats or int32), scaled back: y[c] of row i. torch's
 * add(alpha=) multiplies and adds in one fused step, hence fmaf. */
typedef struct {
    const float *f32;
    const int32_t *i32;
    int64_t n, o;
    float fine;
    const float *scale, *wscale, *bias;
} Sums;

static inline void combine_row(const Sums *s, int64_t i, float *restrict y) {
    const float alpha = 1.0f / s->fine, scale = s->scale[i], *restrict wscale = s->wscale;
    int64_t o = s->o, h = i * o, l = (s->n + i) * o;
    if (s->f32) {
        const float *restrict high = s->f32 + h, *restrict low = s->f32 + l;
        for (int64_t c = 0; c < o; c++) y[c] = fmaf(low[c], alpha, high[c]) * scale * wscale[c];
    } else {
        const int32_t *restrict high = s->i32 + h, *restrict low = s->i32 + l;
        for (int64_t c = 0; c < o; c++) y[c] = fmaf((float)low[c], alpha, (float)high[c]) * scale * wscale[c];
    }
    if (s->bias)
        for (int64_t c = 0; c < o; c++) y[c] += s->bias[c];
}

/* int8_rows.c's functions, which int8_layer.c calls too */
void split_rows(const float *x, int64_t n, int64_t d, float act_max, float fine, float *parts_f32,
                int8_t *parts_i8, float *scale);
void combine_rows(const float *both_f32, const int32_t *both_i32, int64_t n, int64_t o, float fine,
                  const float *scale, const float *wscale, const float *bias, float *out);

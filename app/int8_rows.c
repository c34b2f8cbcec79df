/* The per-token work around an int8 matmul (app/int8_rows.py): the same arithmetic as its torch version, one
 * float32 operation at a time in the same order, so the bits are the same (tests/test_int8.py compares them).
 * Built with -ffp-contract=off: the compiler must not fuse a multiply and an add where torch does not. */

#include <math.h>
#include <stdint.h>

/* A float32 of magnitude below 2**22 plus this lies where floats are the integers: (v + R) - R is v rounded to
 * the nearest integer, ties to even (the float adder's own rounding), as torch's version rounds. */
static const float ROUNDER = 12582912.0f; /* 1.5 * 2**23 */

static float row_scale(const float *row, int64_t d, float act_max) {
    float m = 0.0f;
    for (int64_t j = 0; j < d; j++) {
        float a = fabsf(row[j]);
        m = a > m ? a : m;
    }
    return (m > 1e-12f ? m : 1e-12f) / act_max;
}

/* Each of n rows of x (d values) as two parts, high and low (rows 0..n-1, then n..2n-1 of `parts`), with
 * x ≈ (high + low / fine) * scale; one of parts_f32 (the integer values as floats) and parts_i8 is written. */
void split_rows(const float *x, int64_t n, int64_t d, float act_max, float fine, float *parts_f32,
                int8_t *parts_i8, float *scale) {
    for (int64_t i = 0; i < n; i++) {
        const float *row = x + i * d;
        float s = row_scale(row, d, act_max);
        scale[i] = s;
        for (int64_t j = 0; j < d; j++) {
            float v = row[j] / s;
            float high = (v + ROUNDER) - ROUNDER;
            float low = ((v - high) * fine + ROUNDER) - ROUNDER;
            if (parts_f32) {
                parts_f32[i * d + j] = high;
                parts_f32[(n + i) * d + j] = low;
            } else {
                parts_i8[i * d + j] = (int8_t)high;
                parts_i8[(n + i) * d + j] = (int8_t)low;
            }
        }
    }
}

/* out[i][c] = (high + low / fine) * scale[i] * wscale[c] (+ bias[c]) from the matmul's 2n rows of o sums, given
 * as floats (both_f32) or int32 (both_i32). torch's add with alpha multiplies and adds in one fused step. */
void combine_rows(const float *both_f32, const int32_t *both_i32, int64_t n, int64_t o, float fine,
                  const float *scale, const float *wscale, const float *bias, float *out) {
    const float alpha = 1.0f / fine;
    for (int64_t i = 0; i < n; i++) {
        float s = scale[i], *y = out + i * o;
        for (int64_t c = 0; c < o; c++) {
            int64_t h = i * o + c, l = (n + i) * o + c;
            float high = both_f32 ? both_f32[h] : (float)both_i32[h];
            float low = both_f32 ? both_f32[l] : (float)both_i32[l];
            y[c] = fmaf(low, alpha, high) * s * wscale[c];
        }
        if (bias)
            for (int64_t c = 0; c < o; c++) y[c] += bias[c];
    }
}

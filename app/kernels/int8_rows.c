/* The per-token work around an int8 matmul (app/int8_rows.py): the same arithmetic as its torch version, one
 * float32 operation at a time in the same order, so the bits are the same (tests/test_int8.py compares them). */

#include "int8_rows.h"

/* Each of n rows of x (d values) as two parts (see Parts); one of parts_f32 and parts_i8 is written. */
void split_rows(const float *x, int64_t n, int64_t d, float act_max, float fine, float *parts_f32,
                int8_t *parts_i8, float *scale) {
    Parts p = {parts_f32, parts_i8, scale, n, act_max, fine};
    FOR_ROWS(i, n, n * d, { split_row(x + i * d, d, i, &p); });
}

/* out[i][c] = (high + low / fine) * scale[i] * wscale[c] (+ bias[c]) from the matmul's 2n rows of o sums, given
 * as floats (both_f32) or int32 (both_i32). */
void combine_rows(const float *both_f32, const int32_t *both_i32, int64_t n, int64_t o, float fine,
                  const float *scale, const float *wscale, const float *bias, float *out) {
    Sums s = {both_f32, both_i32, n, o, fine, scale, wscale, bias};
    FOR_ROWS(i, n, n * o, { combine_row(&s, i, out + i * o); });
}

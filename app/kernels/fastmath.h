/* Arithmetic shared by the C files: e^x and reductions in a fixed order, in code the compiler vectorizes. */

#pragma once

#include <math.h>
#include <stdint.h>

#define LANES 16 /* partial sums a reduction keeps: one vector register, always summed in the same order */

/* 1.5 * 2**23: a float32 of magnitude below 2**22 plus this lies where floats are the integers */
#define ROUND_SHIFT 12582912.0f

/* e^x to float32's precision (~2 ulp) in plain arithmetic, which the compiler turns into vector code (a call to
 * the C library's expf is one element at a time). x = k ln2 + r, |r| <= ln2 / 2: e^x = 2^k e^r, e^r by its
 * Taylor polynomial to r^7, 2^k written into the exponent bits. Clamped to where 2^k is a normal float. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float k = (x * 1.44269504088896341f + ROUND_SHIFT) - ROUND_SHIFT; /* round(x / ln2) */
    float r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-06f; /* ln2 in two parts */
    float e = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120
                                                                                    + r * (1.0f / 720 + r / 5040))))));
    union { int32_t i; float f; } two = {.i = ((int32_t)k + 127) << 23};
    return e * two.f;
}

/* a . b over d values: LANES running sums, then a tree of halves (vector adds, not LANES - 1 in a row). */
static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    float acc[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= d; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[j + l] * b[j + l];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) acc[l] += acc[l + width];
    float s = acc[0];
    for (; j < d; j++) s += a[j] * b[j];
    return s;
}

/* The largest of x[0..n) (of |x| where `absolute`) and `start`: LANES running maxima, so the loop is vector code
 * (a maximum is exact in any order). A NaN is passed over, as `a > m ? a : m` does. */
static inline float max_of(const float *x, int64_t n, int absolute, float start) {
    float acc[LANES];
    for (int l = 0; l < LANES; l++) acc[l] = start;
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) {
            float a = absolute ? fabsf(x[j + l]) : x[j + l];
            acc[l] = a > acc[l] ? a : acc[l];
        }
    float m = start;
    for (int l = 0; l < LANES; l++) m = acc[l] > m ? acc[l] : m;
    for (; j < n; j++) {
        float a = absolute ? fabsf(x[j]) : x[j];
        m = a > m ? a : m;
    }
    return m;
}

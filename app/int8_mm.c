/* int8 activation parts times int8 weights into int32 sums, with AVX-512 VNNI (app/int8_mm.py).
 *
 * The sums are integers, exact in any order, so they equal torch._int_mm's and fbgemm's bit for bit. vpdpbusd
 * multiplies unsigned by signed bytes: a part p (|p| <= 127) goes in as p ^ 0x80 = p + 128, and 128 times the
 * weight row's sum comes off again. Weights are packed once as [n/16][k/4][16][4] (16 output channels, 4 inner
 * values each per 64-byte load), n padded to a multiple of 32 and k to one of 4 with zeros.
 *
 * Output channels are shared between the threads of the calling thread's OpenMP team (the library links the
 * libgomp torch loaded, so torch's own pool runs them); each channel's sum is one thread's, in one order. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

#define TILE 8 /* activation rows per pass over a block's weights: 2 x 8 accumulators of 16 channels */

int mm_int8_available(void) { return HAVE_VNNI; }

#if HAVE_VNNI
/* Rows r0.. (up to TILE) times a pair of 16-channel blocks (weights w, 2 * 16 * k4 * 4 bytes), into out's
 * columns c.. (`valid` of them real). `flipped` holds the parts as unsigned bytes, k4 * 4 a row. */
static void tile(const uint8_t *flipped, int64_t rows, int64_t k4, const int8_t *w, const int32_t *colsum,
                 int32_t *out, int64_t n, int64_t c, int64_t valid) {
    __m512i lo[TILE], hi[TILE];
    for (int r = 0; r < TILE; r++) lo[r] = hi[r] = _mm512_setzero_si512();
    const int8_t *w1 = w + k4 * 64;
    for (int64_t g = 0; g < k4; g++) {
        __m512i a = _mm512_loadu_si512(w + 64 * g), b = _mm512_loadu_si512(w1 + 64 * g);
        for (int r = 0; r < TILE; r++) {
            if (r < rows) {
                int32_t x;
                memcpy(&x, flipped + (r * k4 + g) * 4, 4);
                __m512i v = _mm512_set1_epi32(x);
                lo[r] = _mm512_dpbusd_epi32(lo[r], v, a);
                hi[r] = _mm512_dpbusd_epi32(hi[r], v, b);
            }
        }
    }
    __m512i off_lo = _mm512_slli_epi32(_mm512_loadu_si512(colsum + c), 7);
    __m512i off_hi = _mm512_slli_epi32(_mm512_loadu_si512(colsum + c + 16), 7);
    __mmask16 m_lo = valid >= 16 ? 0xffff : (__mmask16)((1u << valid) - 1);
    __mmask16 m_hi = valid >= 32 ? 0xffff : valid <= 16 ? 0 : (__mmask16)((1u << (valid - 16)) - 1);
    for (int r = 0; r < rows; r++) {
        _mm512_mask_storeu_epi32(out + r * n + c, m_lo, _mm512_sub_epi32(lo[r], off_lo));
        _mm512_mask_storeu_epi32(out + r * n + c + 16, m_hi, _mm512_sub_epi32(hi[r], off_hi));
    }
}
#endif

/* out[m][n] = parts[m][k] @ weight[n][k]^T, the weight packed as above with its rows' sums in colsum (padded).
 * Returns 0, or -1 without VNNI or memory (the caller then uses torch's kernel). */
int mm_int8(const int8_t *parts, int64_t m, int64_t k, const int8_t *packed, const int32_t *colsum, int64_t n,
            int32_t *out) {
#if HAVE_VNNI
    int64_t k4 = (k + 3) / 4, pairs = (n + 31) / 32;
    uint8_t *flipped = malloc((size_t)(m * k4 * 4));
    if (!flipped) return -1;
    for (int64_t r = 0; r < m; r++) {
        uint8_t *row = flipped + r * k4 * 4;
        for (int64_t j = 0; j < k; j++) row[j] = (uint8_t)parts[r * k + j] ^ 0x80u;
        for (int64_t j = k; j < k4 * 4; j++) row[j] = 0x80u; /* (times zero weights) */
    }
#pragma omp parallel for schedule(static) if (m * n * k >= 65536)
    for (int64_t p = 0; p < pairs; p++)
        for (int64_t r0 = 0; r0 < m; r0 += TILE)
            tile(flipped + r0 * k4 * 4, m - r0 < TILE ? m - r0 : TILE, k4, packed + p * 2 * k4 * 64, colsum,
                 out + r0 * n, n, 32 * p, n - 32 * p);
    free(flipped);
    return 0;
#else
    (void)parts, (void)m, (void)k, (void)packed, (void)colsum, (void)n, (void)out;
    return -1;
#endif
}

/* int8 activation parts times int8 weights into int32 sums, with AVX-512 VNNI (app/int8_mm.py).
 *
 * The sums are integers, exact in any order, so they equal torch._int_mm's and fbgemm's bit for bit. vpdpbusd
 * multiplies unsigned by signed bytes: a part p (|p| <= 127) goes in as p ^ 0x80 = p + 128, and 128 times the
 * weight row's sum comes off again. Weights are packed once as [n/16][k/4][16][4] (16 output channels, 4 inner
 * values each per 64-byte load), n padded to a multiple of 32 and k to one of 4 with zeros.
 *
 * Where the CPU has AMX, inputs of AMX_ROWS rows or more go to its tile unit instead (tdpbusd: the same
 * unsigned-by-signed products, the same packed weights read as its B tiles, 64 inner values a tile): the sums are
 * integers, so the same bits again, at ~2-3x the VNNI loop's rate from 16 rows on (8 tokens).
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

#if HAVE_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define TILE 8 /* activation rows per pass over a block's weights: 2 x 8 accumulators of 16 channels */
#define AMX_ROWS 6 /* activation rows (two a token) from which the tile unit beats the VNNI loop (at 4 rows: even) */
#define AMX_INNER 64 /* inner values per tile */

int mm_int8_available(void) { return HAVE_VNNI; }

#if HAVE_AMX
/* Linux lends a process the tile unit's registers only once asked (arch_prctl): asked once, the answer kept.
 * TEXTENV_AMX=0 keeps the tiles off (the VNNI loop and torch._int_mm instead: the same sums), for a host whose
 * tiles misbehave (llama.cpp's AMX kernels once crashed on one of this kind's machines; see docs/model-and-kernels.md). */
static int amx_allowed(void) {
    static int state; /* 0: not asked yet, 1: allowed, -1: refused (a race asks twice: harmless) */
    int s = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (s == 0) {
        const char *setting = getenv("TEXTENV_AMX");
        s = setting && strcmp(setting, "0") == 0 ? -1
            : syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELAXED);
    }
    return s > 0;
}
#endif

/* Whether inputs of any length run fast here (the tile unit, for inner sizes that are multiples of 64): else
 * app.int8 sends longer inputs from Python to torch._int_mm (~13 % faster there), while a pass of every layer in
 * one C call (app.int8_layer's forward_layers) takes this kernel for any number. */
int mm_int8_amx(void) {
#if HAVE_AMX
    return amx_allowed();
#else
    return 0;
#endif
}

#if HAVE_VNNI
/* The m rows of k parts as unsigned bytes (p ^ 0x80 = p + 128), `rows` rows of `width` (>= m, >= k): the padding
 * 0x80, a zero part. Both kernels read them so; NULL without memory. */
static uint8_t *flipped_rows(const int8_t *parts, int64_t m, int64_t k, int64_t rows, int64_t width) {
    uint8_t *out = malloc((size_t)(rows * width));
    if (!out) return NULL;
    memset(out, 0x80, (size_t)(rows * width));
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < k; j++) out[r * width + j] = (uint8_t)parts[r * k + j] ^ 0x80u;
    return out;
}

/* The masks of a pair's two 16-channel blocks, `valid` of its channels real. */
static inline void pair_masks(int64_t valid, __mmask16 *lo, __mmask16 *hi) {
    *lo = valid >= 16 ? 0xffff : (__mmask16)((1u << valid) - 1);
    *hi = valid >= 32 ? 0xffff : valid <= 16 ? 0 : (__mmask16)((1u << (valid - 16)) - 1);
}

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
    __mmask16 m_lo, m_hi;
    pair_masks(valid, &m_lo, &m_hi);
    for (int r = 0; r < rows; r++) {
        _mm512_mask_storeu_epi32(out + r * n + c, m_lo, _mm512_sub_epi32(lo[r], off_lo));
        _mm512_mask_storeu_epi32(out + r * n + c + 16, m_hi, _mm512_sub_epi32(hi[r], off_hi));
    }
}

#if HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* This thread's tiles, as amx_sums uses them: 8 of 16 rows x 64 bytes (each thread configures its own).
 * ldtilecfg is written here with the whole 64-byte configuration as its operand: GCC 12's _tile_loadconfig
 * declares a read of 8 bytes only, so the compiler may drop the stores of the rest as dead (seen with this
 * function inlined into a loop: rows and column widths never stored, and ldtilecfg faulted: SIGSEGV or SIGILL). */
static void tiles_on(void) {
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    __asm__ volatile("ldtilecfg %0" : : "m"(config));
}

/* Rows r0.. (up to 32) of `a` (the flipped parts, mp rows of k, mp a multiple of 16) times a pair of 16-channel
 * blocks on the tile unit, into sums[block of 16 rows * 2 + channel block][row][channel]: tiles 0-3 sum (2 row
 * blocks x 2 channel blocks), 4-5 hold activation rows, 6-7 weights; the second row block where mp - r0 >= 32. */
static void amx_sums(const uint8_t *a, int64_t mp, int64_t k, const int8_t *w, int64_t r0,
                    int32_t (*sums)[16][16]) {
    const int8_t *w1 = w + k * 16;
    int two = mp - r0 >= 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < k / AMX_INNER; c++) {
        _tile_loadd(6, w + c * 16 * AMX_INNER, 64);
        _tile_loadd(7, w1 + c * 16 * AMX_INNER, 64);
        _tile_loadd(4, a + r0 * k + c * AMX_INNER, k);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        if (two) {
            _tile_loadd(5, a + (r0 + 16) * k + c * AMX_INNER, k);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
        }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    if (two) {
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
    }
}

/* amx_sums, stored as int32 into out's rows r0.. (m rows in all), columns c0.. of n. */
static void amx_tile(const uint8_t *a, int64_t m, int64_t mp, int64_t k, const int8_t *w, const int32_t *colsum,
                     int32_t *out, int64_t n, int64_t c0, int64_t r0) {
    int32_t sums[4][16][16] __attribute__((aligned(64)));
    amx_sums(a, mp, k, w, r0, sums);
    __m512i off_lo = _mm512_slli_epi32(_mm512_loadu_si512(colsum + c0), 7);
    __m512i off_hi = _mm512_slli_epi32(_mm512_loadu_si512(colsum + c0 + 16), 7);
    int64_t rows = m - r0 < 32 ? m - r0 : 32;
    __mmask16 m_lo, m_hi;
    pair_masks(n - c0, &m_lo, &m_hi);
    for (int64_t i = 0; i < rows; i++) {
        int h = (int)(i / 16) * 2, j = (int)(i % 16);
        int32_t *o = out + (r0 + i) * n + c0;
        _mm512_mask_storeu_epi32(o, m_lo, _mm512_sub_epi32(_mm512_load_si512(sums[h][j]), off_lo));
        _mm512_mask_storeu_epi32(o + 16, m_hi, _mm512_sub_epi32(_mm512_load_si512(sums[h + 1][j]), off_hi));
    }
}

static int mm_amx(const int8_t *parts, int64_t m, int64_t k, const int8_t *packed, const int32_t *colsum,
                  int64_t n, int32_t *out) {
    int64_t pairs = (n + 31) / 32, mp = (m + 15) / 16 * 16;
    uint8_t *a = flipped_rows(parts, m, k, mp, k); /* (rows past m: sums computed, never stored) */
    if (!a) return -1;
#pragma omp parallel
    {
        tiles_on();
        /* Each thread its own run of pairs, row blocks outer: a block's activation rows stay in the first cache
         * while the thread's weights (half of a layer's, <= 0.9 MB here) stay in the second. Pairs outer re-read
         * every activation row for each pair, from beyond the second cache for long inputs: a 512-token prefill
         * 243-318 -> 221-242 ms, 8 questions' 120 tokens 79-87 -> 75-79 ms (three rounds alternated). */
        int threads = 1, me = 0;
#ifdef _OPENMP
        threads = omp_get_num_threads(), me = omp_get_thread_num();
#endif
        int64_t first = pairs * me / threads, last = pairs * (me + 1) / threads;
        for (int64_t r0 = 0; r0 < mp; r0 += 32)
            for (int64_t p = first; p < last; p++)
                amx_tile(a, m, mp, k, packed + p * 2 * k * 16, colsum, out, n, 32 * p, r0);
        _tile_release();
    }
    free(a);
    return 0;
}

/* Token t's two parts side by side (rows 2t and 2t + 1: its high part, its low), flipped as flipped_rows does,
 * `rows` rows: a tile's rows then hold both parts of each of its tokens. NULL without memory. */
static uint8_t *flipped_pairs(const int8_t *parts, int64_t tokens, int64_t k, int64_t rows) {
    uint8_t *out = malloc((size_t)(rows * k));
    if (!out) return NULL;
    memset(out, 0x80, (size_t)(rows * k));
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t j = 0; j < k; j++) {
            out[2 * t * k + j] = (uint8_t)parts[t * k + j] ^ 0x80u;
            out[(2 * t + 1) * k + j] = (uint8_t)parts[(tokens + t) * k + j] ^ 0x80u;
        }
    return out;
}

/* Scaling back, as combine_row does it (int8_rows.h: fmaf(low, alpha, high) * scale * wscale, then + bias: the
 * same float operations in the same order): the scaled sums of one token's 16 channels at c. */
static inline __m512 combined(__m512i high, __m512i low, __m512i off, float alpha, float scale, const float *wscale,
                              const float *bias, int64_t c, __mmask16 mask) {
    __m512 h = _mm512_cvtepi32_ps(_mm512_sub_epi32(high, off)), l = _mm512_cvtepi32_ps(_mm512_sub_epi32(low, off));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_fmadd_ps(l, _mm512_set1_ps(alpha), h), _mm512_set1_ps(scale)),
                             _mm512_maskz_loadu_ps(mask, wscale + c));
    return bias ? _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, bias + c)) : y;
}

/* amx_sums over paired rows r0.. (tokens r0 / 2..), scaled back into out's rows of n floats, columns c0.. */
static void amx_tile_combined(const uint8_t *a, int64_t tokens, int64_t mp, int64_t k, const int8_t *w,
                              const int32_t *colsum, float alpha, const float *scale, const float *wscale,
                              const float *bias, float *out, int64_t n, int64_t c0, int64_t r0) {
    int32_t sums[4][16][16] __attribute__((aligned(64)));
    amx_sums(a, mp, k, w, r0, sums);
    __m512i off[2] = {_mm512_slli_epi32(_mm512_loadu_si512(colsum + c0), 7),
                      _mm512_slli_epi32(_mm512_loadu_si512(colsum + c0 + 16), 7)};
    __mmask16 mask[2];
    pair_masks(n - c0, &mask[0], &mask[1]);
    int64_t first = r0 / 2, count = tokens - first < 16 ? tokens - first : 16;
    for (int64_t t = 0; t < count; t++) {
        int h = (int)(2 * t / 16) * 2, j = (int)(2 * t % 16); /* (rows 2t, 2t + 1: the same 16-row block) */
        for (int b = 0; b < 2; b++) {
            __m512i high = _mm512_load_si512(sums[h + b][j]), low = _mm512_load_si512(sums[h + b][j + 1]);
            int64_t c = c0 + 16 * b;
            _mm512_mask_storeu_ps(out + (first + t) * n + c, mask[b],
                                  combined(high, low, off[b], alpha, scale[first + t], wscale, bias, c, mask[b]));
        }
    }
}

static int mm_amx_combined(const int8_t *parts, int64_t tokens, int64_t k, const int8_t *packed,
                           const int32_t *colsum, int64_t n, float fine, const float *scale, const float *wscale,
                           const float *bias, float *out) {
    int64_t pairs = (n + 31) / 32, mp = (2 * tokens + 15) / 16 * 16;
    const float alpha = 1.0f / fine; /* (as combine_row computes it) */
    uint8_t *a = flipped_pairs(parts, tokens, k, mp);
    if (!a) return -1;
#pragma omp parallel
    {
        tiles_on();
        /* (pairs outer, unlike mm_amx: the LM head's weights, 28 MB, fit no cache, and its kept tokens are few, so
         * each pair's weights are read once while the activation rows stay in the first cache) */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t r0 = 0; r0 < mp; r0 += 32)
                amx_tile_combined(a, tokens, mp, k, packed + p * 2 * k * 16, colsum, alpha, scale, wscale, bias, out,
                                  n, 32 * p, r0);
        _tile_release();
    }
    free(a);
    return 0;
}
#endif
#endif

/* out[m][n] = parts[m][k] @ weight[n][k]^T, the weight packed as above with its rows' sums in colsum (padded).
 * Returns 0, or -1 without VNNI or memory (the caller then uses torch's kernel). */
int mm_int8(const int8_t *parts, int64_t m, int64_t k, const int8_t *packed, const int32_t *colsum, int64_t n,
            int32_t *out) {
#if HAVE_AMX
    if (m >= AMX_ROWS && k % AMX_INNER == 0 && amx_allowed()) return mm_amx(parts, m, k, packed, colsum, n, out);
#endif
#if HAVE_VNNI
    int64_t k4 = (k + 3) / 4, pairs = (n + 31) / 32;
    uint8_t *flipped = flipped_rows(parts, m, k, m, k4 * 4); /* (values past k: times zero weights) */
    if (!flipped) return -1;
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

/* out[t][c]: token t's parts (2 * tokens rows of k: the high parts, then the low) times the weight, scaled back as
 * combine_rows does (the same bits), in one pass on the tile unit: the int32 sums never reach memory (the LM head's
 * for 24 tokens were 9.4 MB written and read again a step, ~0.6 ms of combine_rows alone). Returns 0, -1 without
 * memory, or -2 where mm_int8 would not take the tiles (then the caller runs mm_int8 and combine_rows). */
int mm_int8_combined(const int8_t *parts, int64_t tokens, int64_t k, const int8_t *packed, const int32_t *colsum,
                     int64_t n, float fine, const float *scale, const float *wscale, const float *bias, float *out) {
#if HAVE_AMX
    if (2 * tokens >= AMX_ROWS && k % AMX_INNER == 0 && amx_allowed())
        return mm_amx_combined(parts, tokens, k, packed, colsum, n, fine, scale, wscale, bias, out);
#endif
    (void)parts, (void)tokens, (void)k, (void)packed, (void)colsum, (void)n, (void)fine, (void)scale;
    (void)wscale, (void)bias, (void)out;
    return -2;
}

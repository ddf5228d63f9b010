/* Weight-only quantized linear kernels for the native engine (x86-64 AVX2 + FMA, with a
 * portable scalar path for other machines).
 *
 * Weights, row-major over output rows n, in groups of 32 along the input dimension k:
 *   q4: qs uint8 [N, K/2]   (group g of row n: 16 bytes; byte j holds element j in its low
 *                            nibble and element j+16 in its high nibble), d, m float [N, K/32]:
 *                            w = d * q + m,  q in 0..15                       (GGUF Q4_1 order)
 *   q8: qs uint8 [N, K], d, m float [N, K/32]: w = d * q + m, q in 0..255 (asymmetric, so a
 *       Q4_1 group is exact in it: q8 = 17 q4, d8 = d4 / 17; and a Q8_0 one: q8 = q + 128)
 * Activations stay fp32: each group's codes are widened to floats in registers and multiplied
 * with x, so the result equals x @ dequantize(W)^T up to the order of the additions (no
 * activation quantization: measured, int8 activations moved greedy tokens off fp32's).
 * y = (alpha * x * cs) @ W^T (+ residual); cs is a per-column scale (an RMSNorm weight) or NULL.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define GROUP 32
#define ROWS 4     /* activation rows computed per load of a weight group */
#define NCHUNK 16  /* output rows per unit of work handed to a thread */

int tq_has_avx2(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* 16 unsigned bytes -> two vectors of 8 floats */
static inline void widen_u8(__m128i b, __m256 *lo, __m256 *hi) {
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}

/* sum over the 32 elements of one group: w[0..31] . x[0..31] as a vector of 8 partials */
static inline __m256 group_dot(const __m256 w[4], const float *x) {
    __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
    t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), t);
    t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), t);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), t);
}
#endif

/* one group's 32 codes as floats, in element order */
static inline void codes_q4(const uint8_t *b, float *w) {
    for (int j = 0; j < 16; j++) {
        w[j] = (float)(b[j] & 0x0f);
        w[j + 16] = (float)(b[j] >> 4);
    }
}

/* y rows [r0, r0+nr), output rows [n0, n1). xs [M, G] = per-group sums of x (the minimums) */
static void block(int kind, const float *x, const float *xs, int64_t r0, int nr, int64_t K,
                  const void *qs, const float *d, const float *m, int64_t n0, int64_t n1,
                  int64_t N, float *y, const float *res) {
    const int64_t G = K / GROUP;
    for (int64_t n = n0; n < n1; n++) {
        const float *wd = d + n * G;
        float out[ROWS] = {0};
#ifdef __AVX2__
        __m256 acc[ROWS];
        for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            __m256 w[4];
            if (kind == 4) {
                const __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)qs + n * (K / 2) + g * 16));
                const __m128i low = _mm_set1_epi8(0x0f);
                widen_u8(_mm_and_si128(b, low), &w[0], &w[1]);
                widen_u8(_mm_and_si128(_mm_srli_epi16(b, 4), low), &w[2], &w[3]);
            } else {
                const uint8_t *p = (const uint8_t *)qs + n * K + g * GROUP;
                widen_u8(_mm_loadu_si128((const __m128i *)p), &w[0], &w[1]);
                widen_u8(_mm_loadu_si128((const __m128i *)(p + 16)), &w[2], &w[3]);
            }
            const __m256 scale = _mm256_set1_ps(wd[g]);
            for (int r = 0; r < nr; r++) {
                const float *xr = x + (r0 + r) * K + g * GROUP;
                acc[r] = _mm256_fmadd_ps(group_dot(w, xr), scale, acc[r]);
            }
        }
        for (int r = 0; r < nr; r++) out[r] = hsum8(acc[r]);
#else
        float w[GROUP];
        for (int64_t g = 0; g < G; g++) {
            if (kind == 4)
                codes_q4((const uint8_t *)qs + n * (K / 2) + g * 16, w);
            else
                for (int j = 0; j < GROUP; j++) w[j] = (float)((const uint8_t *)qs)[n * K + g * GROUP + j];
            for (int r = 0; r < nr; r++)
                out[r] += wd[g] * dot_f32(w, x + (r0 + r) * K + g * GROUP, GROUP);
        }
#endif
        for (int r = 0; r < nr; r++) out[r] += dot_f32(m + n * G, xs + (r0 + r) * G, G);
        for (int r = 0; r < nr; r++) {
            const int64_t i = (r0 + r) * N + n;
            y[i] = res ? res[i] + out[r] : out[r];
        }
    }
}

static int gemm(int kind, const float *x, int64_t M, int64_t K, float alpha, const float *cs,
                const void *qs, const float *d, const float *m, int64_t N, float *y,
                const float *res, int nt) {
    if (K % GROUP || M < 0 || N < 0) return -1;
    const int64_t G = K / GROUP;
    float *xf = NULL, *xs = NULL;
    if (alpha != 1.f || cs) {
        xf = malloc(sizeof(float) * (size_t)(M * K));
        if (!xf) return -2;
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < K; k++)
                xf[r * K + k] = alpha * (cs ? x[r * K + k] * cs[k] : x[r * K + k]);
        x = xf;
    }
    xs = malloc(sizeof(float) * (size_t)(M * G > 0 ? M * G : 1));
    if (!xs) {
        free(xf);
        return -2;
    }
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.f;
            for (int j = 0; j < GROUP; j++) s += x[r * K + g * GROUP + j];
            xs[r * G + g] = s;
        }
    const int64_t nchunks = (N + NCHUNK - 1) / NCHUNK;
    if (nt < 1) nt = 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t n0 = c * NCHUNK, n1 = n0 + NCHUNK < N ? n0 + NCHUNK : N;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int nr = (int)(M - r0 < ROWS ? M - r0 : ROWS);
            block(kind, x, xs, r0, nr, K, qs, d, m, n0, n1, N, y, res);
        }
    }
    free(xf);
    free(xs);
    return 0;
}

int tq_gemm_q4(const float *x, int64_t M, int64_t K, float alpha, const float *cs,
               const uint8_t *qs, const float *d, const float *m, int64_t N, float *y,
               const float *res, int nt) {
    return gemm(4, x, M, K, alpha, cs, qs, d, m, N, y, res, nt);
}

int tq_gemm_q8(const float *x, int64_t M, int64_t K, float alpha, const float *cs,
               const uint8_t *qs, const float *d, const float *m, int64_t N, float *y,
               const float *res, int nt) {
    return gemm(8, x, M, K, alpha, cs, qs, d, m, N, y, res, nt);
}

/* W [N, K] float from q4 / q8 (large-M products go through the BLAS on it; tests) */
static void dequant(int kind, const void *qs, const float *d, const float *m, int64_t N,
                    int64_t K, float *w, int nt) {
    const int64_t G = K / GROUP;
    if (nt < 1) nt = 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            float *o = w + n * K + g * GROUP;
            const float dg = d[n * G + g], mg = m[n * G + g];
#ifdef __AVX2__
            __m256 c[4];
            if (kind == 4) {
                const __m128i b =
                    _mm_loadu_si128((const __m128i *)((const uint8_t *)qs + n * (K / 2) + g * 16));
                const __m128i low = _mm_set1_epi8(0x0f);
                widen_u8(_mm_and_si128(b, low), &c[0], &c[1]);
                widen_u8(_mm_and_si128(_mm_srli_epi16(b, 4), low), &c[2], &c[3]);
            } else {
                const uint8_t *p = (const uint8_t *)qs + n * K + g * GROUP;
                widen_u8(_mm_loadu_si128((const __m128i *)p), &c[0], &c[1]);
                widen_u8(_mm_loadu_si128((const __m128i *)(p + 16)), &c[2], &c[3]);
            }
            const __m256 vd = _mm256_set1_ps(dg), vm = _mm256_set1_ps(mg);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(c[i], vd, vm));
#else
            if (kind == 4)
                codes_q4((const uint8_t *)qs + n * (K / 2) + g * 16, o);
            else
                for (int j = 0; j < GROUP; j++)
                    o[j] = (float)((const uint8_t *)qs)[n * K + g * GROUP + j];
            for (int j = 0; j < GROUP; j++) o[j] = dg * o[j] + mg;
#endif
        }
}

void tq_dequant_q4(const uint8_t *qs, const float *d, const float *m, int64_t N, int64_t K,
                   float *w, int nt) {
    dequant(4, qs, d, m, N, K, w, nt);
}

void tq_dequant_q8(const uint8_t *qs, const float *d, const float *m, int64_t N, int64_t K,
                   float *w, int nt) {
    dequant(8, qs, d, m, N, K, w, nt);
}

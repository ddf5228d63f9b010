/* exp and silu for the native engine's C kernels (ops.c, quant.c): the same operations in
 * the scalar (exp_s), 8-lane (exp_v, AVX2) and 16-lane (exp_w, AVX-512) forms, so every
 * element rounds alike whichever path computes it. Include after <immintrin.h>. */
#ifndef TANDEM_VMATH_H
#define TANDEM_VMATH_H
#include <math.h>
#include <stdint.h>

/* exp by Cody-Waite reduction and a degree-6 polynomial (Cephes expf coefficients), the
 * same operations in the vector and the scalar path so every element rounds alike. */
#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447504f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define P0 1.9875691500E-4f
#define P1 1.3981999507E-3f
#define P2 8.3334519073E-3f
#define P3 4.1665795894E-2f
#define P4 1.6666665459E-1f
#define P5 5.0000001201E-1f

static inline float exp_s(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    float n = floorf(fmaf(x, LOG2E, 0.5f));
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = fmaf(fmaf(fmaf(fmaf(fmaf(P0, r, P1), r, P2), r, P3), r, P4), r, P5);
    p = fmaf(p * r, r, r) + 1.f;
    union { float f; int32_t i; } u = {.f = p};
    u.i += (int32_t)n << 23;
    return u.f;
}

#ifdef __AVX2__
static inline __m256 exp_v(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(P0), r, _mm256_set1_ps(P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
#endif

#ifdef __AVX512F__
/* exp_v on 16 lanes: the same operations */
static inline __m512 exp_w(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(P0), r, _mm512_set1_ps(P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P5));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}
#endif

/* silu(g) * u = g / (1 + exp(-g)) * u */
static inline float silu_mul_s(float g, float u) { return g / (1.f + exp_s(-g)) * u; }
#ifdef __AVX512F__
static inline __m512 silu_mul_w(__m512 g, __m512 u) {
    const __m512 e = exp_w(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}
#endif
#ifdef __AVX2__
static inline __m256 silu_mul_v(__m256 g, __m256 u) {
    const __m256 e = exp_v(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}
#endif
#endif

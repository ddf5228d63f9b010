/* Weight-only quantized linear kernels for the native engine: AVX-512 (with or without VNNI),
 * AVX2 + FMA, or a portable scalar path, picked at compile time by what the compiler targets.
 *
 * Source weights (the cache / GGUF order), row-major over output rows n, in groups of 32
 * along the input dimension k:
 *   q4: qs uint8 [N, K/2]   (group g of row n: 16 bytes; byte j holds element j in its low
 *                            nibble and element j+16 in its high nibble), d, m float [N, K/32]:
 *                            w = d * q + m,  q in 0..15                       (GGUF Q4_1 order)
 *   q8: qs uint8 [N, K], d, m float [N, K/32]: w = d * q + m, q in 0..255 (asymmetric, so a
 *       Q4_1 group is exact in it: q8 = 17 q4, d8 = d4 / 17; and a Q8_0 one: q8 = q + 128)
 *
 * Packed (what the GEMM reads; tq_pack_*): tiles of TN = 32 output columns, k-major inside a
 * tile, N padded to a multiple of TN with zero weights:
 *   q8: qs [T][K][32] bytes;  q4: qs [T][K][16] bytes, byte j = column j (low nibble) and
 *   column j+16 (high nibble);  d, m: [T][K/32][32] floats.
 *
 * Arithmetic, the same for every row whatever the row count M and wherever the row sits
 * (w = d q + m is never formed; the codes are exact small integers in fp32):
 *   xs[g]  = x[32g] + x[32g+1] + ... + x[32g+31]              (fp32, in that order)
 *   p      = fma(q[k][n], x[k], p)  for the 32 k of group g, from p = 0
 *   acc[n] = fma(d[g][n], p, acc[n]);  acc[n] = fma(m[g][n], xs[g], acc[n])   for g = 0, 1, ...
 *   y[n]   = acc[n] (+ residual)
 * so a request's output is bit-identical alone or batched (batch invariance by
 * construction), and equals x @ dequantize(W)^T up to the order of the fp32 additions.
 * That is the AVX-512 (without VNNI) and scalar builds; the AVX-512 VNNI build rounds the
 * activations to 15 bits per group instead and sums in int32 (vpdpbusd), the AVX2 build to
 * 13 bits (vpmaddubsw) (the integer path below; tq_activation_bits).
 *
 * Up to MR rows (12 with AVX-512: 24 zmm of partial sums; 2 with AVX2): each tile's codes
 * are widened in registers once per k and used by all rows (the mat-vec streams the packed
 * bytes; one row takes two tiles at a time for more independent FMA chains). More rows: a
 * tile's codes are widened once into a per-thread fp32 scratch [K][32] (L2) and the same
 * micro-kernel runs over blocks of MR rows. The accumulators of a block live in L1 (touched
 * once per group). Threads (OpenMP) split the tiles.
 * y = (alpha * x * cs) @ W^T (+ residual); cs is a per-column scale (an RMSNorm weight) or NULL.
 * Two fusions (tq_gemm_*'s last arguments): norm_eps >= 0 divides each row of x by its RMS
 * first (alpha_r = alpha / sqrt(mean(x_r^2) + norm_eps): the RMSNorm, its weight being cs), and
 * glu = 1 takes each tile's 32 columns as 16 gate and 16 up columns (the caller interleaves a
 * gate/up weight so) and writes silu(gate) * up: y is [M, N/2], N a multiple of 32, no residual.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif
#include "vmath.h"

#define GROUP 32
#define TN 32 /* output columns per tile */

#if defined(__AVX512F__)
#define ISA 512
#define VW 16
#define MR 12 /* rows per micro-kernel block: 24 zmm of partial sums */
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_load_ps(p)
#define VLOADU(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_store_ps(p, v)
#define VSTOREU(p, v) _mm512_storeu_ps(p, v)
#define VSET1(s) _mm512_set1_ps(s)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA 256
#define VW 8
#define MR 2
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_load_ps(p)
#define VLOADU(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_store_ps(p, v)
#define VSTOREU(p, v) _mm256_storeu_ps(p, v)
#define VSET1(s) _mm256_set1_ps(s)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#else
#define ISA 0
#define MR 4
#endif

#if ISA
#define NV (TN / VW) /* vectors per tile row */
#endif

#if ISA == 512 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI 1 /* the integer path below, with its own packed layout */
#else
#define VNNI 0
#endif
/* the integer-activation path (activations rounded per group of 32, code x activation byte
 * products summed exactly in integers): AVX-512 VNNI (vpdpbusd) and AVX2 (vpmaddubsw); the
 * AVX2 build compiled with -DTQ_FP32_ACTIVATIONS runs the fp32-activation kernel instead
 * (a measurement baseline, not a build tandem serves) */
#if VNNI || (ISA == 256 && !defined(TQ_FP32_ACTIVATIONS))
#define IPATH 1
#else
#define IPATH 0
#endif

#define INLINE static inline __attribute__((always_inline))
#define GLU (-1) /* a store's column count for a glu tile: 16 outputs silu(gate) * up */

/* o[0:16] = silu(a[0:16]) * a[16:32]: a glu tile's row */
INLINE void glu_store(const float *a, float *o) {
#if defined(__AVX512F__)
    _mm512_storeu_ps(o, silu_mul_w(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16)));
#elif defined(__AVX2__)
    for (int v = 0; v < 2; v++)
        _mm256_storeu_ps(o + 8 * v, silu_mul_v(_mm256_loadu_ps(a + 8 * v), _mm256_loadu_ps(a + 16 + 8 * v)));
#else
    for (int j = 0; j < 16; j++) o[j] = silu_mul_s(a[j], a[16 + j]);
#endif
}

/* the column count tile t stores: GLU for a glu tile, else its valid columns (the last tile
 * of an N that is not a multiple of TN has fewer) */
INLINE int tile_cols(int64_t N, int64_t t, int glu) {
    return glu ? GLU : (int)(N - t * TN < TN ? N - t * TN : TN);
}

/* alpha / RMS of a row of K floats (the RMSNorm factor), or alpha where eps < 0 */
static float row_alpha(const float *x, int64_t K, float alpha, float eps) {
    if (eps < 0.f) return alpha;
    float ss = 0.f;
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        const __m512 v = _mm512_loadu_ps(x + k);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
#endif
    for (; k < K; k++) ss += x[k] * x[k];
    return alpha / sqrtf(ss / (float)K + eps);
}

/* which path this build runs: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (scalar) */
int tq_isa(void) { return ISA; }

/* ------------------------------------------------------------------ packing */

static void pack(int kind, const uint8_t *qs, const float *d, const float *m, int64_t N,
                 int64_t K, uint8_t *pq, float *pd, float *pm) {
    const int64_t G = K / GROUP, T = (N + TN - 1) / TN, tile = K * (kind == 4 ? TN / 2 : TN);
    memset(pq, 0, (size_t)(T * tile));
    memset(pd, 0, sizeof(float) * (size_t)(T * G * TN));
    memset(pm, 0, sizeof(float) * (size_t)(T * G * TN));
    for (int64_t n = 0; n < N; n++) {
        const int64_t t = n / TN, c = n % TN;
        for (int64_t g = 0; g < G; g++) {
#if VNNI /* q4: columns 16.. enter the products as 16 q (the high nibble in place) */
            pd[(t * G + g) * TN + c] = kind == 4 && c >= 16 ? d[n * G + g] * 0.0625f : d[n * G + g];
#else
            pd[(t * G + g) * TN + c] = d[n * G + g];
#endif
            pm[(t * G + g) * TN + c] = m[n * G + g];
        }
        for (int64_t k = 0; k < K; k++) {
            int q;
            if (kind == 4) {
                const uint8_t b = qs[n * (K / 2) + (k / GROUP) * 16 + (k % 16)];
                q = (k % GROUP) < 16 ? (b & 0x0f) : (b >> 4);
            } else {
                q = qs[n * K + k];
            }
#if IPATH /* quads of 4 k: byte 4 (c mod 16) + k mod 4; columns 16.. in the high nibbles
           * (q4) or the next 64 bytes (q8) */
            uint8_t *o = pq + t * tile + (k / 4) * (kind == 4 ? 64 : 128) + 4 * (c % 16) + k % 4;
            if (kind == 8 && c >= 16) o += 64;
#else /* k-major: byte c (q8), or c mod 16 with columns 16.. in the high nibbles (q4) */
            uint8_t *o = pq + t * tile + k * (kind == 4 ? 16 : 32) + (kind == 4 ? c % 16 : c);
#endif
            *o |= (uint8_t)(kind == 4 && c >= 16 ? q << 4 : q);
        }
    }
}

void tq_pack_q4(const uint8_t *qs, const float *d, const float *m, int64_t N, int64_t K,
                uint8_t *pq, float *pd, float *pm) {
    pack(4, qs, d, m, N, K, pq, pd, pm);
}

void tq_pack_q8(const uint8_t *qs, const float *d, const float *m, int64_t N, int64_t K,
                uint8_t *pq, float *pd, float *pm) {
    pack(8, qs, d, m, N, K, pq, pd, pm);
}

/* ------------------------------------------------------------------ micro-kernels */

#if ISA
/* the 32 codes of tile row k as floats, NV vectors in column order */
INLINE void codes(int kind, const uint8_t *q, int64_t k, vec c[NV]) {
    if (kind == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(q + k * 16));
        const __m128i low = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
#if ISA == 512
        c[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
        c[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
#else
        c[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        c[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        c[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        c[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
#endif
    } else {
        const uint8_t *p = q + k * 32;
#if ISA == 512
        c[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
        c[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
#else
        for (int v = 0; v < 4; v++)
            c[v] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * v))));
#endif
    }
}

/* one tile's codes into buf [K][TN] as floats (64-byte aligned) */
static void codes_tile(int kind, const uint8_t *q, int64_t K, float *buf) {
    for (int64_t k = 0; k < K; k++) {
        vec c[NV];
        codes(kind, q, k, c);
        for (int v = 0; v < NV; v++) VSTORE(buf + k * TN + v * VW, c[v]);
    }
}

/* end of group g for R rows: acc = fma(d, p, acc); acc = fma(m, xs, acc); the
 * accumulators live in L1 (acc [R][TN]) so that the registers hold MR rows of partials */
INLINE void close_group(int R, float *acc, vec p[][NV], const float *d, const float *m,
                        const float *xs, int64_t G, int64_t g) {
    for (int r = 0; r < R; r++) {
        const vec sb = VSET1(xs[r * G + g]);
        for (int v = 0; v < NV; v++) {
            vec a = VLOAD(acc + r * TN + v * VW);
            a = VFMA(VLOADU(d + g * TN + v * VW), p[r][v], a);
            VSTORE(acc + r * TN + v * VW, VFMA(VLOADU(m + g * TN + v * VW), sb, a));
        }
    }
}

/* y[r][0:nc] for R rows from their accumulators acc [R][TN] */
INLINE void store_rows(int R, const float *acc, float *y, int64_t ldy, const float *res, int nc) {
    for (int r = 0; r < R; r++) {
        float *yr = y + r * ldy;
        const float *rr = res ? res + r * ldy : NULL;
        if (nc == GLU) {
            glu_store(acc + r * TN, yr);
        } else if (nc == TN) {
            for (int v = 0; v < NV; v++) {
                vec o = VLOAD(acc + r * TN + v * VW);
                if (rr) o = VADD(VLOADU(rr + v * VW), o);
                VSTOREU(yr + v * VW, o);
            }
        } else {
            for (int c = 0; c < nc; c++) yr[c] = rr ? rr[c] + acc[r * TN + c] : acc[r * TN + c];
        }
    }
}

/* R rows x one tile; the codes come widened from registers (buf NULL) or from buf */
INLINE void tile(int R, int kind, const float *buf, const uint8_t *q, const float *d,
                 const float *m, const float *x, const float *xs, int64_t K, float *y,
                 int64_t ldy, const float *res, int nc) {
    const int64_t G = K / GROUP;
    float acc[MR * TN] __attribute__((aligned(64)));
    vec p[MR][NV];
    memset(acc, 0, sizeof(float) * (size_t)(R * TN));
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < R; r++)
            for (int v = 0; v < NV; v++) p[r][v] = VZERO();
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {
            vec c[NV];
            if (buf)
                for (int v = 0; v < NV; v++) c[v] = VLOAD(buf + k * TN + v * VW);
            else
                codes(kind, q, k, c);
            for (int r = 0; r < R; r++) {
                const vec xb = VSET1(x[r * K + k]);
                for (int v = 0; v < NV; v++) p[r][v] = VFMA(c[v], xb, p[r][v]);
            }
        }
        close_group(R, acc, p, d, m, xs, G, g);
    }
    store_rows(R, acc, y, ldy, res, nc);
}

/* one row x two tiles (t, t+1): twice the independent FMA chains of `tile` for the
 * mat-vec; the arithmetic per column is tile's */
INLINE void tile1x2(int kind, const uint8_t *q, const float *d, const float *m, int64_t tq,
                    int64_t td, const float *x, const float *xs, int64_t K, float *y,
                    const float *res, int nc) {
    const int64_t G = K / GROUP;
    float acc[2 * TN] __attribute__((aligned(64))) = {0};
    vec p[2][NV];
    for (int64_t g = 0; g < G; g++) {
        for (int u = 0; u < 2; u++)
            for (int v = 0; v < NV; v++) p[u][v] = VZERO();
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {
            const vec xb = VSET1(x[k]);
            for (int u = 0; u < 2; u++) {
                vec c[NV];
                codes(kind, q + u * tq, k, c);
                for (int v = 0; v < NV; v++) p[u][v] = VFMA(c[v], xb, p[u][v]);
            }
        }
        for (int u = 0; u < 2; u++)
            close_group(1, acc + u * TN, p + u, d + u * td, m + u * td, xs, G, g);
    }
    store_rows(1, acc, y, 0, res, nc == GLU ? GLU : TN);
    store_rows(1, acc + TN, y + (nc == GLU ? TN / 2 : TN), 0, res ? res + TN : NULL, nc);
}

#define MR_REG MR /* up to MR rows widen the codes in registers; more go through buf */
#if ISA == 512
#define CASES(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12)
#else
#define CASES(X) X(1) X(2)
#endif

static void run_tile(int R, int kind, const float *buf, const uint8_t *q, const float *d,
                     const float *m, const float *x, const float *xs, int64_t K, float *y,
                     int64_t ldy, const float *res, int nc) {
    switch (R) {
#define X(n)                                                                   \
    case n:                                                                    \
        if (buf)                                                               \
            tile(n, 0, buf, q, d, m, x, xs, K, y, ldy, res, nc);               \
        else if (n <= MR_REG && kind == 4)                                     \
            tile(n, 4, NULL, q, d, m, x, xs, K, y, ldy, res, nc);              \
        else if (n <= MR_REG)                                                  \
            tile(n, 8, NULL, q, d, m, x, xs, K, y, ldy, res, nc);              \
        break;
        CASES(X)
#undef X
    }
}

#else /* scalar: the same arithmetic, one column at a time */
#define MR_REG 0

static void codes_tile(int kind, const uint8_t *q, int64_t K, float *buf) {
    for (int64_t k = 0; k < K; k++)
        for (int c = 0; c < TN; c++) {
            int code;
            if (kind == 4) {
                const uint8_t b = q[k * 16 + c % 16];
                code = c < 16 ? (b & 0x0f) : (b >> 4);
            } else {
                code = q[k * 32 + c];
            }
            buf[k * TN + c] = (float)code;
        }
}

static void run_tile(int R, int kind, const float *buf, const uint8_t *q, const float *d,
                     const float *m, const float *x, const float *xs, int64_t K, float *y,
                     int64_t ldy, const float *res, int nc) {
    (void)kind, (void)q;
    const int64_t G = K / GROUP;
    float acc[MR][TN], p[MR][TN];
    memset(acc, 0, sizeof acc);
    for (int64_t g = 0; g < G; g++) {
        memset(p, 0, sizeof p);
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++)
            for (int r = 0; r < R; r++) {
                const float xv = x[r * K + k];
                for (int c = 0; c < TN; c++) p[r][c] += buf[k * TN + c] * xv;
            }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < TN; c++) {
                acc[r][c] += d[g * TN + c] * p[r][c];
                acc[r][c] += m[g * TN + c] * xs[r * G + g];
            }
    }
    for (int r = 0; r < R; r++) {
        if (nc == GLU) {
            glu_store(acc[r], y + r * ldy);
            continue;
        }
        for (int c = 0; c < nc; c++)
            y[r * ldy + c] = res ? res[r * ldy + c] + acc[r][c] : acc[r][c];
    }
}
#endif

/* the greedy head's screen (head_greedy below; every build has one) */
#define SBK 64 /* k a screening block (the last one may be 32) */
#define SCREEN_SAFETY 4.0 /* times the rounding bounds of the screen and of the exact kernel */
#define SCREEN_MAX 1e15 /* rows with larger activations skip the screen (no overflow below it) */

int tq_screen_block(void) { return SBK; }

/* ------------------------------------------------------------------ integer path */
#if IPATH
/* Where AVX512-VNNI is present the codes are never widened: each row's activations are
 * rounded to 15-bit integers per group of 32 (scale s = max|x| / 16383, xq = rint(x / s))
 * and split into two signed bytes, xq = 128 xh + xl (xh in -128..127, xl in 0..127), so
 * that vpdpbusd (unsigned code byte x signed activation byte, four per 32-bit lane) sums
 * q . xh and q . xl exactly in int32; then per group
 *   acc[n] = fma(d[g][n] * s, (float)(128 (q . xh) + (q . xl)), acc[n]);
 *   acc[n] = fma(m[g][n], s * (xq[32g] + ... + xq[32g+31]), acc[n]).
 * The integer sums are exact and the float steps are per row, so a row is still
 * bit-identical in any batch. Rounding x to 15 bits per group costs ~2^-15 of a group's
 * largest value per element (measured on SmolLM2: mean KL against fp32 activations
 * 3e-7, every greedy token the same); int8 activations (KL 5e-3) were not good enough.
 * Packed layout (this build's tq_pack_*): a tile is K/4 quads of 4 consecutive k; per
 * quad, byte 4c + i holds column c at k = 4j + i, c in 0..15; q4 keeps columns c + 16 in
 * the high nibbles (64 bytes a quad), q8 has them in the next 64 bytes (128 a quad); `pack`.
 * q4's high nibbles enter the products in place, as 16 q (one AND instead of a shift and an
 * AND a quad: ~1 % of the GEMM at 32 rows), so those columns' packed d is d / 16 (exact); the
 * int32 sums then reach 16 x 15 x 16383 x 32 < 2^31, and their fp32 conversion rounds as
 * q8's (codes to 255) always did. */
#define ROWS_SPLIT 64 /* rows a thread from which threads split rows, not tiles */
#define TILE_CHUNK 16 /* tiles a row block passes at a time in the row split (~220 KB of q4) */
#if VNNI
#define XBITS 15
#define XMAX 16383
#define XSHIFT 7 /* xq = 128 xh + xl */
#define VR 4 /* rows per block: 4 int32 + 2 fp32 sums a row = 24 zmm (6 rows, fp32 sums in L1: +1-2 %) */
#else
#define XBITS 13
#define XMAX 4095
#define XSHIFT 6 /* xq = 64 xh + xl */
#define VR 2 /* rows per block: 4 int16/int32 sums a row + 2 code and 2 activation vectors: 14 ymm */
#endif

int tq_activation_bits(void) { return XBITS; }

#if VNNI

/* acc += vpdpbusd(a, the 4 bytes at p in every lane), in inline asm: the accumulator is
 * updated in place (with the intrinsic, GCC 12 copied every accumulator to another register
 * and back around each product in these loops: 34 moves and stack spills next to 16 products
 * a quad, ~5 % of the GEMM) and the broadcast is folded into the product (1.7 % less GEMM
 * time at 8-32 rows than a separate broadcast, same bits) */
INLINE void dpm(__m512i *acc, __m512i a, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(*acc) : "v"(a), "m"(*(const int32_t *)(const void *)p));
}

/* row r of x (times alpha, its RMS factor where eps >= 0, and cs) as xh, xl [K] bytes,
 * sc [G] scales, xs [G] = s * sum xq */
static void quantize_row(const float *x, int64_t K, float alpha, float eps, const float *cs,
                         int8_t *xh, int8_t *xl, float *sc, float *xs) {
    const __m512 va = _mm512_set1_ps(row_alpha(x, K, alpha, eps));
    const __m512i lim = _mm512_set1_epi32(XMAX), seven = _mm512_set1_epi32(127);
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m512 v[2];
        for (int h = 0; h < 2; h++) {
            const int64_t k = g * GROUP + 16 * h;
            __m512 a = _mm512_loadu_ps(x + k);
            if (cs) a = _mm512_mul_ps(a, _mm512_loadu_ps(cs + k));
            v[h] = _mm512_mul_ps(va, a);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float s = amax / (float)XMAX;
        int32_t sum = 0;
        for (int h = 0; h < 2; h++) {
            __m512i q = _mm512_setzero_si512();
            if (s > 0.f) /* rint (nearest, ties to even) of x / s, kept in -XMAX..XMAX */
                q = _mm512_min_epi32(lim, _mm512_max_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), lim),
                    _mm512_cvtps_epi32(_mm512_div_ps(v[h], _mm512_set1_ps(s)))));
            sum += _mm512_reduce_add_epi32(q);
            _mm_storeu_si128((__m128i *)(xh + g * GROUP + 16 * h), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 7)));
            _mm_storeu_si128((__m128i *)(xl + g * GROUP + 16 * h), _mm512_cvtepi32_epi8(_mm512_and_si512(q, seven)));
        }
        sc[g] = s;
        xs[g] = s * (float)sum;
    }
}

/* R rows x U tiles (tile u at q + u tq, d + u td); same per-row arithmetic for all (R, U) */
INLINE void vblock(int R, int U, int kind, const uint8_t *q, int64_t tq, const float *d,
                   const float *m, int64_t td, const int8_t *xh, const int8_t *xl,
                   const float *sc, const float *xs, int64_t K, float *y, int64_t ldy,
                   const float *res, int nc_last) {
    const int64_t G = K / GROUP, qb = kind == 4 ? 64 : 128;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[VR][2][2];
    for (int r = 0; r < R; r++)
        for (int u = 0; u < U; u++) acc[r][u][0] = acc[r][u][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i ih[VR][2][2], il[VR][2][2];
        for (int r = 0; r < R; r++)
            for (int u = 0; u < U; u++)
                ih[r][u][0] = ih[r][u][1] = il[r][u][0] = il[r][u][1] = _mm512_setzero_si512();
        for (int64_t j = g * (GROUP / 4); j < (g + 1) * (GROUP / 4); j++) {
            for (int u = 0; u < U; u++) {
                const uint8_t *p = q + u * tq + j * qb;
                __m512i c0, c1;
                if (kind == 4) {
                    const __m512i b = _mm512_loadu_si512(p);
                    c0 = _mm512_and_si512(b, low);
                    c1 = _mm512_andnot_si512(low, b);
                } else {
                    c0 = _mm512_loadu_si512(p);
                    c1 = _mm512_loadu_si512(p + 64);
                }
                for (int r = 0; r < R; r++) {
                    const int8_t *ph = xh + r * K + 4 * j, *pl = xl + r * K + 4 * j;
                    dpm(&ih[r][u][0], c0, ph);
                    dpm(&ih[r][u][1], c1, ph);
                    dpm(&il[r][u][0], c0, pl);
                    dpm(&il[r][u][1], c1, pl);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_set1_ps(sc[r * G + g]), sb = _mm512_set1_ps(xs[r * G + g]);
            for (int u = 0; u < U; u++)
                for (int v = 0; v < 2; v++) {
                    const __m512i ih7 = _mm512_slli_epi32(ih[r][u][v], 7);
                    const __m512i isum = _mm512_add_epi32(ih7, il[r][u][v]);
                    const __m512 ds = _mm512_mul_ps(_mm512_loadu_ps(d + u * td + g * TN + 16 * v), s);
                    const __m512 a = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(isum), acc[r][u][v]);
                    acc[r][u][v] = _mm512_fmadd_ps(_mm512_loadu_ps(m + u * td + g * TN + 16 * v), sb, a);
                }
        }
    }
    const int64_t oc = nc_last == GLU ? TN / 2 : TN; /* output columns a tile */
    for (int r = 0; r < R; r++)
        for (int u = 0; u < U; u++) {
            float out[TN] __attribute__((aligned(64)));
            _mm512_store_ps(out, acc[r][u][0]);
            _mm512_store_ps(out + 16, acc[r][u][1]);
            store_rows(1, out, y + r * ldy + u * oc, 0, res ? res + r * ldy + u * TN : NULL,
                       u == U - 1 || nc_last == GLU ? nc_last : TN);
        }
}

#else /* AVX2: vpmaddubsw (unsigned code byte x signed activation byte, pairs summed in int16) */

/* Here the activations are 13-bit integers per group of 32 (s = max|x| / 4095), split as
 * xq = 64 xh + xl, xh in -64..63, xl in 0..63, so that no pair sum of vpmaddubsw saturates:
 * a code (q8: 0..255) times a byte of either plane, two to a lane, stays within 2 x 255 x 64
 * = 32640 < 2^15. q4 codes (0..15) take the products of a whole group (16 a lane: 16 x 15 x
 * 64) in int16 and widen once a group (vpmaddwd by ones); q8 codes widen every quad. Per group
 *   acc[n] = fma(d[g][n] * s, (float)(64 (q . xh) + (q . xl)), acc[n]);
 *   acc[n] = fma(m[g][n], s * (xq[32g] + ... + xq[32g+31]), acc[n]),
 * the VNNI path's arithmetic with 13 bits instead of 15. 8-bit activations (one plane, one
 * vpmaddubsw per 32 products) were measured against the quality gate on SmolLM2 with scales
 * per block of 32: mean KL 4.1e-3, 87 % greedy agreement (the gate: < 1e-4, >= 95 %); 13
 * bits: see quant.py. The packed layout is the VNNI one (quads of 4 k, 16 columns a 64 bytes)
 * with q4's high nibbles shifted down (the codes stay <= 15, so int16 sums do not overflow). */

/* the 4 bytes at p in every 32-bit lane */
INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* 32 int32 (four vectors, in order) as bytes at o (values within -128..127) */
INLINE void store_bytes(__m256i a, __m256i b, __m256i c, __m256i e, int8_t *o) {
    const __m256i ab = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    const __m256i ce = _mm256_permute4x64_epi64(_mm256_packs_epi32(c, e), 0xD8);
    _mm256_storeu_si256((__m256i *)o, _mm256_permute4x64_epi64(_mm256_packs_epi16(ab, ce), 0xD8));
}

INLINE float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

INLINE int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* row r of x (times alpha, its RMS factor where eps >= 0, and cs) as xh, xl [K] bytes,
 * sc [G] scales, xs [G] = s * sum xq */
static void quantize_row(const float *x, int64_t K, float alpha, float eps, const float *cs,
                         int8_t *xh, int8_t *xl, float *sc, float *xs) {
    const __m256 va = _mm256_set1_ps(row_alpha(x, K, alpha, eps));
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lim = _mm256_set1_epi32(XMAX), nlim = _mm256_set1_epi32(-XMAX);
    const __m256i lowm = _mm256_set1_epi32((1 << XSHIFT) - 1);
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m256 v[4];
        for (int h = 0; h < 4; h++) {
            const int64_t k = g * GROUP + 8 * h;
            __m256 a = _mm256_loadu_ps(x + k);
            if (cs) a = _mm256_mul_ps(a, _mm256_loadu_ps(cs + k));
            v[h] = _mm256_mul_ps(va, a);
        }
        const __m256 am = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absm), _mm256_and_ps(v[1], absm)),
                                        _mm256_max_ps(_mm256_and_ps(v[2], absm), _mm256_and_ps(v[3], absm)));
        const float s = hmax8(am) / (float)XMAX;
        __m256i q[4], hi[4], lo[4], sum = _mm256_setzero_si256();
        for (int h = 0; h < 4; h++) {
            q[h] = _mm256_setzero_si256();
            if (s > 0.f) /* rint (nearest, ties to even) of x / s, kept in -XMAX..XMAX */
                q[h] = _mm256_min_epi32(lim, _mm256_max_epi32(nlim, _mm256_cvtps_epi32(_mm256_div_ps(v[h], _mm256_set1_ps(s)))));
            sum = _mm256_add_epi32(sum, q[h]);
            hi[h] = _mm256_srai_epi32(q[h], XSHIFT);
            lo[h] = _mm256_and_si256(q[h], lowm);
        }
        store_bytes(hi[0], hi[1], hi[2], hi[3], xh + g * GROUP);
        store_bytes(lo[0], lo[1], lo[2], lo[3], xl + g * GROUP);
        sc[g] = s;
        xs[g] = s * (float)hsum8i(sum);
    }
}

/* the 32 columns' codes of one packed quad run at `p` as two vectors of bytes: q4's low and
 * high nibbles, or q8's two 32-byte halves (64 bytes apart) */
INLINE void load_codes(int kind, const uint8_t *p, __m256i low, __m256i c[2]) {
    if (kind == 4) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)p);
        c[0] = _mm256_and_si256(b, low);
        c[1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    } else {
        c[0] = _mm256_loadu_si256((const __m256i *)p);
        c[1] = _mm256_loadu_si256((const __m256i *)(p + 64));
    }
}

/* R rows x one tile, half h of the columns (8h.. and 16 + 8h..): q . xh and q . xl per
 * group into the fp32 accumulators acc[r][v] (v: columns 8v..8v+7) */
INLINE void vhalf(int R, int kind, int h, const uint8_t *q, const float *d, const float *m,
                  const int8_t *xh, const int8_t *xl, const float *sc, const float *xs, int64_t K,
                  int64_t g, __m256 acc[][4]) {
    const int64_t G = K / GROUP, qb = kind == 4 ? 64 : 128;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256i ih[VR][2], il[VR][2];
    for (int r = 0; r < R; r++) ih[r][0] = ih[r][1] = il[r][0] = il[r][1] = _mm256_setzero_si256();
    for (int64_t j = g * (GROUP / 4); j < (g + 1) * (GROUP / 4); j++) {
        __m256i c[2];
        load_codes(kind, q + j * qb + 32 * h, low, c);
        for (int r = 0; r < R; r++) {
            const __m256i bh = bcast4(xh + r * K + 4 * j), bl = bcast4(xl + r * K + 4 * j);
            for (int v = 0; v < 2; v++) {
                const __m256i ph = _mm256_maddubs_epi16(c[v], bh), pl = _mm256_maddubs_epi16(c[v], bl);
                if (kind == 4) {
                    ih[r][v] = _mm256_add_epi16(ih[r][v], ph);
                    il[r][v] = _mm256_add_epi16(il[r][v], pl);
                } else {
                    ih[r][v] = _mm256_add_epi32(ih[r][v], _mm256_madd_epi16(ph, ones));
                    il[r][v] = _mm256_add_epi32(il[r][v], _mm256_madd_epi16(pl, ones));
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const __m256 s = _mm256_set1_ps(sc[r * G + g]), sb = _mm256_set1_ps(xs[r * G + g]);
        for (int v = 0; v < 2; v++) {
            const int cv = 2 * v + h; /* columns 8 cv.. */
            __m256i hv = ih[r][v], lv = il[r][v];
            if (kind == 4) hv = _mm256_madd_epi16(hv, ones), lv = _mm256_madd_epi16(lv, ones);
            const __m256i isum = _mm256_add_epi32(_mm256_slli_epi32(hv, XSHIFT), lv);
            const __m256 ds = _mm256_mul_ps(_mm256_loadu_ps(d + g * TN + 8 * cv), s);
            const __m256 a = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(isum), acc[r][cv]);
            acc[r][cv] = _mm256_fmadd_ps(_mm256_loadu_ps(m + g * TN + 8 * cv), sb, a);
        }
    }
}

/* R rows x U tiles (tile u at q + u tq, d + u td); same per-row arithmetic for all (R, U) */
INLINE void vblock(int R, int U, int kind, const uint8_t *q, int64_t tq, const float *d,
                   const float *m, int64_t td, const int8_t *xh, const int8_t *xl,
                   const float *sc, const float *xs, int64_t K, float *y, int64_t ldy,
                   const float *res, int nc_last) {
    const int64_t G = K / GROUP;
    const int64_t oc = nc_last == GLU ? TN / 2 : TN; /* output columns a tile */
    for (int u = 0; u < U; u++) {
        __m256 acc[VR][4];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 4; v++) acc[r][v] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++)
            for (int h = 0; h < 2; h++)
                vhalf(R, kind, h, q + u * tq, d + u * td, m + u * td, xh, xl, sc, xs, K, g, acc);
        for (int r = 0; r < R; r++) {
            float out[TN] __attribute__((aligned(64)));
            for (int v = 0; v < 4; v++) _mm256_store_ps(out + 8 * v, acc[r][v]);
            store_rows(1, out, y + r * ldy + u * oc, 0, res ? res + r * ldy + u * TN : NULL,
                       u == U - 1 || nc_last == GLU ? nc_last : TN);
        }
    }
}
#endif

#if !VNNI
/* Many rows (prefill chunks, batched decode): vpmaddwd on the codes widened to int16 once a
 * tile (per thread, in L1/L2) and the activations as int16 (xq itself, 13 bits): 16 products
 * summed into int32 per instruction and one int32 sum per column a group, where the two byte
 * planes take two vpmaddubsw, their int16 sums and a widening each. Measured on the 2-core
 * EPYC (Zen 3): vpmaddwd + vpaddd 3.65 G pairs/s/core (58 GMAC/s), vpmaddubsw + vpaddw 3.38 G
 * (54 GMAC/s two-plane), vfmadd 5.3 G/s (42 GMAC/s). The integer sum per group is
 * q . xq = 64 (q . xh) + (q . xl), the one vhalf forms, and the float steps after it are
 * vhalf's: the rows are bit-identical to the one-row path's. */
#define WIDE_ROWS 8 /* from this many rows a GEMM widens the codes (fewer: vblock) */
#define WR 6        /* rows per block: WR x 2 int32 sums + 2 code vectors + 1 activation: 15 ymm */

/* a tile's codes (packed quads) as int16 pairs: w [K/2][32 columns][2] (k = 2p, 2p + 1) */
static void widen_tile(int kind, const uint8_t *q, int64_t K, int16_t *w) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i s0 = _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1,
                                        0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
    const __m256i s1 = _mm256_add_epi8(s0, _mm256_setr_epi8(2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0,
                                                            2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0));
    const int64_t qb = kind == 4 ? 64 : 128;
    for (int64_t j = 0; j < K / 4; j++) {
        int16_t *o = w + j * 128; /* k-pairs 2j and 2j + 1 */
        for (int h = 0; h < 2; h++) {
            __m256i c[2]; /* columns 8h.. and 16 + 8h.., 4 k a lane */
            load_codes(kind, q + j * qb + 32 * h, low, c);
            for (int v = 0; v < 2; v++) {
                const int cv = 2 * v + h; /* columns 8 cv.. */
                _mm256_store_si256((__m256i *)(o + 16 * cv), _mm256_shuffle_epi8(c[v], s0));
                _mm256_store_si256((__m256i *)(o + 64 + 16 * cv), _mm256_shuffle_epi8(c[v], s1));
            }
        }
    }
}

/* row r's activations as int16, xq = 64 xh + xl */
static void widen_row(const int8_t *xh, const int8_t *xl, int64_t K, int16_t *xq) {
    for (int64_t k = 0; k < K; k += 16) {
        const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xh + k)));
        const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xl + k)));
        _mm256_storeu_si256((__m256i *)(xq + k), _mm256_add_epi16(_mm256_slli_epi16(hi, XSHIFT), lo));
    }
}

/* a0 += madd(w0, b), a1 += madd(w1, b), b = the int16 pair at x in every lane */
INLINE void wstep(__m256i *a0, __m256i *a1, __m256i w0, __m256i w1, const int16_t *x) {
    __m256i b, t;
    __asm__("vpbroadcastd %[x], %[b]\n\t"
            "vpmaddwd %[b], %[w0], %[t]\n\t"
            "vpaddd %[t], %[a0], %[a0]\n\t"
            "vpmaddwd %[b], %[w1], %[t]\n\t"
            "vpaddd %[t], %[a1], %[a1]"
            : [a0] "+x"(*a0), [a1] "+x"(*a1), [b] "=&x"(b), [t] "=&x"(t)
            : [w0] "x"(w0), [w1] "x"(w1), [x] "m"(*(const int32_t *)(const void *)x));
}

/* R <= WR rows x columns 16 h'.. (vectors 2h', 2h' + 1) of one widened tile: q . xq per
 * group into the fp32 sums acc [R][TN] (in L1) */
INLINE void wpass(int R, int hh, const int16_t *w, const int16_t *xq, int64_t K, const float *d,
                  const float *m, const float *sc, const float *xs, float *acc) {
    const int64_t G = K / GROUP;
    for (int64_t g = 0; g < G; g++) {
        __m256i is[WR][2];
        for (int r = 0; r < R; r++) is[r][0] = is[r][1] = _mm256_setzero_si256();
        for (int64_t p = g * (GROUP / 2); p < (g + 1) * (GROUP / 2); p++) {
            const __m256i w0 = _mm256_load_si256((const __m256i *)(w + p * 64 + 32 * hh));
            const __m256i w1 = _mm256_load_si256((const __m256i *)(w + p * 64 + 32 * hh + 16));
            for (int r = 0; r < R; r++) /* one row's step in asm: GCC hoisted every row's
                                          * broadcast first and spilled the sums */
                wstep(&is[r][0], &is[r][1], w0, w1, xq + r * K + 2 * p);
        }
        for (int r = 0; r < R; r++) {
            const __m256 s = _mm256_set1_ps(sc[r * G + g]), sb = _mm256_set1_ps(xs[r * G + g]);
            for (int v = 0; v < 2; v++) {
                const int cv = 2 * hh + v;
                float *a = acc + r * TN + 8 * cv;
                const __m256 ds = _mm256_mul_ps(_mm256_loadu_ps(d + g * TN + 8 * cv), s);
                const __m256 t = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(is[r][v]), _mm256_load_ps(a));
                _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_loadu_ps(m + g * TN + 8 * cv), sb, t));
            }
        }
    }
}

/* R <= WR rows x one widened tile */
INLINE void wblock(int R, const int16_t *w, const int16_t *xq, int64_t K, const float *d,
                   const float *m, const float *sc, const float *xs, float *y, int64_t ldy,
                   const float *res, int nc) {
    float acc[WR * TN] __attribute__((aligned(64)));
    memset(acc, 0, sizeof(float) * (size_t)(R * TN));
    wpass(R, 0, w, xq, K, d, m, sc, xs, acc);
    wpass(R, 1, w, xq, K, d, m, sc, xs, acc);
    store_rows(R, acc, y, ldy, res, nc);
}

static void wrun(int R, const int16_t *w, const int16_t *xq, int64_t K, const float *d,
                 const float *m, const float *sc, const float *xs, float *y, int64_t ldy,
                 const float *res, int nc) {
    switch (R) {
#define W(n)                                                                   \
    case n:                                                                    \
        wblock(n, w, xq, K, d, m, sc, xs, y, ldy, res, nc);                    \
        break;
        W(1) W(2) W(3) W(4) W(5) W(6) /* R <= WR */
#undef W
    }
}

/* rows [r0, r1) x tiles [t0, t1) through the widened codes (w: K x 32 int16 of scratch),
 * in chunks of rows whose activations stay in L2 (~96 KB) while the tiles pass: a tile is
 * widened again for every chunk (~1 % of the chunk's products) */
static void wide_rows(int kind, const uint8_t *pq, int64_t tq, const float *pd, const float *pm,
                      const int16_t *xq, const float *sc, const float *xs, int64_t K, int64_t N,
                      float *y, int64_t ldy, const float *res, int glu, int64_t r0, int64_t r1,
                      int64_t t0, int64_t t1, int16_t *w) {
    const int64_t G = K / GROUP, oc = glu ? TN / 2 : TN;
    int64_t chunk = (96 * 1024 / (2 * K)) / WR * WR;
    if (chunk < WR) chunk = WR;
    for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
        const int64_t c1 = c0 + chunk < r1 ? c0 + chunk : r1;
        for (int64_t t = t0; t < t1; t++) {
            const int nc = tile_cols(N, t, glu);
            widen_tile(kind, pq + t * tq, K, w);
            for (int64_t r = c0; r < c1; r += WR) {
                const int R = (int)(c1 - r < WR ? c1 - r : WR);
                wrun(R, w, xq + r * K, K, pd + t * G * TN, pm + t * G * TN, sc + r * G, xs + r * G,
                     y + r * ldy + t * oc, ldy, res ? res + r * N + t * TN : NULL, nc);
            }
        }
    }
}
#endif

static void vrun(int R, int U, int kind, const uint8_t *q, int64_t tq, const float *d,
                 const float *m, int64_t td, const int8_t *xh, const int8_t *xl,
                 const float *sc, const float *xs, int64_t K, float *y, int64_t ldy,
                 const float *res, int nc) {
#define V(r, u, k)                                                                           \
    if (R == r && U == u && kind == k) {                                                     \
        vblock(r, u, k, q, tq, d, m, td, xh, xl, sc, xs, K, y, ldy, res, nc);                \
        return;                                                                              \
    }
#define VK(r, u) V(r, u, 4) V(r, u, 8)
    VK(1, 2) VK(1, 1) VK(2, 1) /* R <= VR */
#if VR > 2
    VK(3, 1) VK(4, 1)
#endif
#undef VK
#undef V
}

static int vgemm(int kind, const float *x, int64_t M, int64_t K, float alpha, const float *cs,
                 const uint8_t *pq, const float *pd, const float *pm, int64_t N, float *y,
                 const float *res, int nt, float eps, int glu) {
    const int64_t G = K / GROUP, T = (N + TN - 1) / TN, tq = (K / 4) * (kind == 4 ? 64 : 128);
    const int64_t oc = glu ? TN / 2 : TN, ldy = glu ? N / 2 : N; /* output columns a tile, a row */
    int8_t *xb = malloc((size_t)(2 * M * K) + sizeof(float) * (size_t)(2 * M * G));
    if (!xb) return -2;
    int8_t *xh = xb, *xl = xb + M * K;
    float *sc = (float *)(xb + 2 * M * K), *xs = sc + M * G;
    if (nt < 1) nt = 1;
#pragma omp parallel num_threads(nt) if (nt > 1 && M * K >= 4096)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++)
            quantize_row(x + r * K, K, alpha, eps, cs, xh + r * K, xl + r * K, sc + r * G, xs + r * G);
    }
    /* many rows: threads split the rows (each in the same static blocks as the quantize
     * above, so a thread reads the rows it wrote and writes the output rows the next op's
     * static row split will read: no output line crosses cores), going over the tiles in
     * chunks that stay in L2 while its row blocks pass; fewer rows: threads split the tiles */
    const int by_rows = nt > 1 && M >= ROWS_SPLIT * nt;
    if (!by_rows && nt > T) nt = (int)T;
#if !VNNI
    if (M >= WIDE_ROWS) {
        int16_t *xq = aligned_alloc(64, sizeof(int16_t) * (size_t)(M * K + TN * nt * K));
        if (!xq) {
            free(xb);
            return -2;
        }
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            int16_t *w = xq + M * K; /* this thread's widened tile */
#if defined(_OPENMP)
            w += TN * K * omp_get_thread_num();
#endif
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++) widen_row(xh + r * K, xl + r * K, K, xq + r * K);
            if (by_rows) { /* a block of rows a thread, every tile */
#pragma omp for schedule(static)
                for (int64_t b = 0; b < nt; b++)
                    wide_rows(kind, pq, tq, pd, pm, xq, sc, xs, K, N, y, ldy, res, glu,
                              M * b / nt, M * (b + 1) / nt, 0, T, w);
            } else {
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; t++)
                    wide_rows(kind, pq, tq, pd, pm, xq, sc, xs, K, N, y, ldy, res, glu, 0, M, t,
                              t + 1, w);
            }
        }
        free(xq);
        free(xb);
        return 0;
    }
#endif
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        if (by_rows) {
            const int64_t nb = (M + VR - 1) / VR;
            for (int64_t t0 = 0; t0 < T; t0 += TILE_CHUNK) {
                const int64_t t1 = t0 + TILE_CHUNK < T ? t0 + TILE_CHUNK : T;
#pragma omp for schedule(static) nowait
                for (int64_t b = 0; b < nb; b++) {
                    const int64_t r0 = b * VR;
                    const int R = (int)(M - r0 < VR ? M - r0 : VR);
                    for (int64_t t = t0; t < t1; t++) {
                        const int nc = tile_cols(N, t, glu);
                        vrun(R, 1, kind, pq + t * tq, tq, pd + t * G * TN, pm + t * G * TN, G * TN,
                             xh + r0 * K, xl + r0 * K, sc + r0 * G, xs + r0 * G, K,
                             y + r0 * ldy + t * oc, ldy, res ? res + r0 * N + t * TN : NULL, nc);
                    }
                }
            }
        } else if (M == 1) { /* tiles in pairs (the last alone when T is odd) */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < (T + 1) / 2; p++) {
                const int64_t t = 2 * p, U = t + 1 < T ? 2 : 1;
                const int64_t last = t + U - 1;
                const int nc = tile_cols(N, last, glu);
                vrun(1, (int)U, kind, pq + t * tq, tq, pd + t * G * TN, pm + t * G * TN, G * TN,
                     xh, xl, sc, xs, K, y + t * oc, ldy, res ? res + t * TN : NULL, nc);
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                const int nc = tile_cols(N, t, glu);
                for (int64_t r0 = 0; r0 < M; r0 += VR) {
                    const int R = (int)(M - r0 < VR ? M - r0 : VR);
                    vrun(R, 1, kind, pq + t * tq, tq, pd + t * G * TN, pm + t * G * TN, G * TN,
                         xh + r0 * K, xl + r0 * K, sc + r0 * G, xs + r0 * G, K,
                         y + r0 * ldy + t * oc, ldy, res ? res + r0 * N + t * TN : NULL, nc);
                }
            }
        }
    }
    free(xb);
    return 0;
}

/* ------------------------------------------------------------------ greedy rows (screened) */
/* out[r] = argmax over n of what vgemm writes for row r (bit for bit; the first n on ties),
 * without every column in full. The screen runs on its own copy of the weights, W' = D Q:
 * int8 codes Q (-127..127) with one scale D per column and block of SBK k (the caller's
 * tq_screen_* arrays), against the row's exact activations xa (the 15-bit codes times their
 * group scales) rounded again to 8 bits with one scale S per block, x~ = S h. One block is
 * then one integer sum and one scale step, where the exact kernel takes two byte planes
 * and a scale step per group of 32. For the real sums Y_n = W_n . xa (W the dequantized
 * weight) and H_n = W'_n . x~,
 *   |Y_n - H_n| <= |W_n|_2 |xa - x~|_2 + |W_n - W'_n|_2 |x~|_2       (Cauchy-Schwarz),
 * the fp32 screen sum rounds by at most (B + 2) 2^-24 max|W'_n| |x~|_1 (B blocks), and the
 * exact kernel's fp32 result by at most (2G + 4) 2^-24 mag_n sum_k s (|q_k| + 64), mag_n =
 * max_g (max code |d| + |m|); the two rounding terms are taken SCREEN_SAFETY times. So any
 * column whose H + bound reaches the largest H - bound of the row may be the argmax, and
 * only the tiles holding such columns run in full (vrun, one row: the same arithmetic as in
 * any batch). On SmolLM2's head ~13 tiles of 1536 a row run in full. A row with a value
 * outside +-SCREEN_MAX (NaN and inf included) runs every tile in full. Returns 1 where a
 * result is NaN (the caller takes the full logits instead). */

int tq_screen_layout(void) { return 1; } /* the copy in the packed q8 order (quads of 4 k) */

/* R <= VR rows of one tile of the screening copy: per row, the max over the tile's valid
 * columns of H + bound and of H - bound into tu, tl (stride ldt) */
#if VNNI
INLINE void sblock(int R, const uint8_t *w, const float *D, const int8_t *h, const int32_t *hs,
                   const float *S, int64_t K, const float *rs, const float *cols, int64_t ncols,
                   int nc_last, float *tu, float *tl, int64_t ldt, int *bad) {
    const int64_t B = (K + SBK - 1) / SBK, J = K / 4;
    __m512 acc[VR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        __m512i ai[VR][2]; /* sum_k (Q_k + 128) h_k, then less 128 sum_k h_k: Q . h exactly */
        for (int r = 0; r < R; r++) ai[r][0] = ai[r][1] = _mm512_setzero_si512();
        const int64_t j1 = (b + 1) * (SBK / 4) < J ? (b + 1) * (SBK / 4) : J;
        for (int64_t j = b * (SBK / 4); j < j1; j++) {
            const __m512i w0 = _mm512_loadu_si512(w + j * 128), w1 = _mm512_loadu_si512(w + j * 128 + 64);
            for (int r = 0; r < R; r++) {
                dpm(&ai[r][0], w0, h + r * K + 4 * j);
                dpm(&ai[r][1], w1, h + r * K + 4 * j);
            }
        }
        const __m512 d0 = _mm512_loadu_ps(D + b * TN), d1 = _mm512_loadu_ps(D + b * TN + 16);
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_set1_ps(S[r * B + b]);
            const __m512i off = _mm512_set1_epi32(128 * hs[r * B + b]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_mul_ps(d0, s), _mm512_cvtepi32_ps(_mm512_sub_epi32(ai[r][0], off)), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_mul_ps(d1, s), _mm512_cvtepi32_ps(_mm512_sub_epi32(ai[r][1], off)), acc[r][1]);
        }
    }
    const __mmask16 valid[2] = {(__mmask16)(nc_last >= 16 ? 0xffff : (1u << nc_last) - 1),
                                (__mmask16)(nc_last >= 32 ? 0xffff : nc_last <= 16 ? 0 : (1u << (nc_last - 16)) - 1)};
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < R; r++) {
        __m512 up = ninf, lo = ninf;
        for (int v = 0; v < 2; v++) { /* cols: |W_n|_2, |W_n - W'_n|_2, max|W'_n|, mag_n */
            const float *c = cols + 16 * v;
            __m512 bd = _mm512_mul_ps(_mm512_loadu_ps(c + 3 * ncols), _mm512_set1_ps(rs[4 * r + 3]));
            for (int i = 2; i >= 0; i--)
                bd = _mm512_fmadd_ps(_mm512_loadu_ps(c + i * ncols), _mm512_set1_ps(rs[4 * r + i]), bd);
            const __m512 a = acc[r][v];
            if (_mm512_mask_cmp_ps_mask(valid[v], a, a, _CMP_UNORD_Q)) /* threads share a row */
                __atomic_store_n(&bad[r], 1, __ATOMIC_RELAXED);
            up = _mm512_mask_max_ps(up, valid[v], up, _mm512_add_ps(a, bd));
            lo = _mm512_mask_max_ps(lo, valid[v], lo, _mm512_sub_ps(a, bd));
        }
        tu[r * ldt] = _mm512_reduce_max_ps(up);
        tl[r * ldt] = _mm512_reduce_max_ps(lo);
    }
}

#else
/* the same on AVX2: the copy's codes Q + 128 turn signed (Q, -127..127) and vpmaddubsw takes
 * |Q| times h with Q's sign (no pair sum saturates: 2 x 127 x 127 < 2^15), so the integer sum
 * is Q . h itself (hs unused) */
INLINE void sblock(int R, const uint8_t *w, const float *D, const int8_t *h, const int32_t *hs,
                   const float *S, int64_t K, const float *rs, const float *cols, int64_t ncols,
                   int nc_last, float *tu, float *tl, int64_t ldt, int *bad) {
    (void)hs;
    const int64_t B = (K + SBK - 1) / SBK, J = K / 4;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[VR][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        __m256i ai[VR][4];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 4; v++) ai[r][v] = _mm256_setzero_si256();
        const int64_t j1 = (b + 1) * (SBK / 4) < J ? (b + 1) * (SBK / 4) : J;
        for (int64_t j = b * (SBK / 4); j < j1; j++)
            for (int v = 0; v < 4; v++) {
                const __m256i sq = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + j * 128 + 32 * v)), flip);
                const __m256i aq = _mm256_abs_epi8(sq);
                for (int r = 0; r < R; r++) {
                    const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(bcast4(h + r * K + 4 * j), sq));
                    ai[r][v] = _mm256_add_epi32(ai[r][v], _mm256_madd_epi16(p, ones));
                }
            }
        for (int r = 0; r < R; r++) {
            const __m256 s = _mm256_set1_ps(S[r * B + b]);
            for (int v = 0; v < 4; v++)
                acc[r][v] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(D + b * TN + 8 * v), s),
                                            _mm256_cvtepi32_ps(ai[r][v]), acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++) {
        float a[TN] __attribute__((aligned(64)));
        for (int v = 0; v < 4; v++) _mm256_store_ps(a + 8 * v, acc[r][v]);
        float up = -INFINITY, lo = -INFINITY;
        for (int c = 0; c < nc_last && c < TN; c++) { /* cols: |W_n|_2, |W_n - W'_n|_2, max|W'_n|, mag_n */
            float bd = cols[3 * ncols + c] * rs[4 * r + 3];
            for (int i = 2; i >= 0; i--) bd = fmaf(cols[i * ncols + c], rs[4 * r + i], bd);
            if (a[c] != a[c]) __atomic_store_n(&bad[r], 1, __ATOMIC_RELAXED); /* threads share a row */
            up = fmaxf(up, a[c] + bd);
            lo = fmaxf(lo, a[c] - bd);
        }
        tu[r * ldt] = up;
        tl[r * ldt] = lo;
    }
}
#endif

/* sq, sd: the screening copy (tile t: sq + t K TN codes Q + 128 in the packed q8 order, sd + t B
 * TN scales, B = ceil(K / SBK), column-major within a block); cols:
 * four rows of T TN floats, per column |W_n|_2, |W_n - W'_n|_2, max |W'_n| and mag_n (rounded
 * up; zero in the padding) */
static int head_greedy(int kind, const float *x, int64_t M, int64_t K, float alpha, const float *cs,
                       const uint8_t *pq, const float *pd, const float *pm, int64_t N,
                       const uint8_t *sq, const float *sd, const float *cols, int64_t *out, int nt,
                       float eps) {
    if (K % GROUP || K <= 0 || M < 0 || N <= 0) return -1;
    if (M == 0) return 0;
    const int64_t G = K / GROUP, T = (N + TN - 1) / TN, tq = (K / 4) * (kind == 4 ? 64 : 128);
    const int64_t B = (K + SBK - 1) / SBK, ncols = T * TN;
    const size_t nb = (size_t)(3 * M * K), nf = (size_t)(2 * M * G + M * B + 4 * M + 2 * M * T);
    int8_t *xb = malloc(nb + sizeof(float) * nf + sizeof(int) * (size_t)(2 * M + M * B) + 64);
    if (!xb) return -2;
    int8_t *xh = xb, *xl = xb + M * K;
    int8_t *u = xb + 2 * M * K;
    float *sc = (float *)(((uintptr_t)(xb + nb) + 63) & ~(uintptr_t)63);
    float *xs = sc + M * G, *S = xs + M * G, *rs = S + M * B, *tu = rs + 4 * M, *tl = tu + M * T;
    int *bad = (int *)(tl + M * T), *all = bad + M;
    int32_t *hs = (int32_t *)(all + M); /* per row and block: sum_k h_k */
    if (nt < 1) nt = 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && M * K >= 4096)
    for (int64_t r = 0; r < M; r++) {
        quantize_row(x + r * K, K, alpha, eps, cs, xh + r * K, xl + r * K, sc + r * G, xs + r * G);
        double e2 = 0., t2 = 0., t1 = 0., a1 = 0.;
        int big = 0;
        for (int64_t b = 0; b < B; b++) {
            const int64_t k0 = b * SBK, k1 = k0 + SBK < K ? k0 + SBK : K;
            double amax = 0.;
            for (int64_t k = k0; k < k1; k++) {
                const double xa = (double)sc[r * G + k / GROUP] * (xh[r * K + k] * (1 << XSHIFT) + xl[r * K + k]);
                amax = fmax(amax, fabs(xa));
                if (!(fabs(xa) <= SCREEN_MAX)) big = 1; /* NaN too */
            }
            const float s = (float)(amax / 127.);
            S[r * B + b] = s;
            int32_t hsum = 0;
            for (int64_t k = k0; k < k1; k++) {
                const int32_t q = xh[r * K + k] * (1 << XSHIFT) + xl[r * K + k];
                const double xa = (double)sc[r * G + k / GROUP] * q;
                double h = s > 0.f ? rint(xa / (double)s) : 0.;
                h = h > 127. ? 127. : h < -127. ? -127. : h;
                u[r * K + k] = (int8_t)(int)h;
                hsum += (int32_t)h;
                const double xt = (double)s * h;
                e2 += (xa - xt) * (xa - xt);
                t2 += xt * xt;
                t1 += fabs(xt);
                a1 += (double)sc[r * G + k / GROUP] * ((q < 0 ? -q : q) + 64);
            }
            hs[r * B + b] = hsum;
        }
        const double up = 1. + 1e-6; /* the bound's own fp32 steps, upwards */
        rs[4 * r + 0] = (float)(sqrt(e2) * up);
        rs[4 * r + 1] = (float)(sqrt(t2) * up);
        rs[4 * r + 2] = (float)(SCREEN_SAFETY * (double)(B + 2) * 0x1p-24 * t1 * up);
        rs[4 * r + 3] = (float)(2. * SCREEN_SAFETY * (double)(2 * G + 4) * 0x1p-24 * a1 * up);
        bad[r] = 0;
        all[r] = big;
    }
    int nt1 = nt > T ? (int)T : nt;
#pragma omp parallel for num_threads(nt1) schedule(static) if (nt1 > 1)
    for (int64_t t = 0; t < T; t++) {
        const int nc = tile_cols(N, t, 0);
        for (int64_t r0 = 0; r0 < M; r0 += VR) {
            const int R = (int)(M - r0 < VR ? M - r0 : VR);
#define SB(n)                                                                                   \
    case n:                                                                                     \
        sblock(n, sq + t * K * TN, sd + t * B * TN, u + r0 * K, hs + r0 * B, S + r0 * B, K,      \
               rs + 4 * r0, cols + t * TN, ncols, nc, tu + r0 * T + t, tl + r0 * T + t, T,      \
               bad + r0);                                                                       \
        break;
            #if VR > 2
            switch (R) { SB(1) SB(2) SB(3) default: SB(4) } /* R <= VR */
#else
            switch (R) { SB(1) default: SB(2) } /* R <= VR */
#endif
#undef SB
        }
    }
    int failed = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1 && M > 1) reduction(| : failed)
    for (int64_t r = 0; r < M; r++) {
        float floor = -INFINITY, best = -INFINITY, y[TN] __attribute__((aligned(64)));
        int64_t pick = -1;
        if (all[r]) bad[r] = 0; /* every tile in full: the screen's sums do not count */
        for (int64_t t = 0; t < T && !all[r]; t++) floor = fmaxf(floor, tl[r * T + t]);
        for (int64_t t = 0; t < T && !bad[r]; t++) {
            if (!all[r] && !(tu[r * T + t] >= floor)) continue;
            const int nc = tile_cols(N, t, 0);
            vrun(1, 1, kind, pq + t * tq, tq, pd + t * G * TN, pm + t * G * TN, G * TN, xh + r * K,
                 xl + r * K, sc + r * G, xs + r * G, K, y, TN, NULL, nc);
            for (int c = 0; c < nc; c++) {
                if (y[c] != y[c]) bad[r] = 1;
                if (pick < 0 || y[c] > best) best = y[c], pick = t * TN + c;
            }
        }
        out[r] = pick;
        failed |= bad[r] || pick < 0;
    }
    free(xb);
    return failed ? 1 : 0;
}
#else
int tq_activation_bits(void) { return 32; }
int tq_screen_layout(void) { return 0; }

/* The screen on the fp32 builds (AVX-512 without VNNI, AVX2, scalar): head_greedy's contract
 * and its bound with the terms of the fp32 kernel. The row's exact activations xa are what
 * gemm multiplies (x times alpha, its RMS factor and cs, in fp32) rounded again to 8 bits per
 * block, x~ = S h; the screening copy is k-major here (tile t: sq + t K TN, byte k TN + c,
 * Q + 128), its integer sums exact in int32 and scaled in double (the fp32 bound covers it).
 * The exact fp32 kernel's result per column rounds by at most (2G + GROUP + 4) 2^-24 mag_n
 * |xa|_1 with fused multiply-adds (the 32-term product chain, the group sums, 2G
 * accumulation steps), twice that without (the scalar build); SCREEN_SAFETY times twice it
 * is taken. Candidate tiles run what gemm runs for one row (run_tile: bit-identical). */
static int head_greedy_f(int kind, const float *x, int64_t M, int64_t K, float alpha,
                         const float *cs, const uint8_t *pq, const float *pd, const float *pm,
                         int64_t N, const uint8_t *sq, const float *sd, const float *cols,
                         int64_t *out, int nt, float eps) {
    if (K % GROUP || K <= 0 || M < 0 || N <= 0) return -1;
    if (M == 0) return 0;
    const int64_t G = K / GROUP, T = (N + TN - 1) / TN, tq = K * (kind == 4 ? TN / 2 : TN);
    const int64_t B = (K + SBK - 1) / SBK, ncols = T * TN;
    float *xa = malloc(sizeof(float) * (size_t)(M * K + M * G + M * B + 4 * M + 2 * M * T));
    int8_t *h = malloc((size_t)(M * K));
    int32_t *hs = malloc(sizeof(int32_t) * (size_t)(M * B + 2 * M));
    if (!xa || !h || !hs) {
        free(xa), free(h), free(hs);
        return -2;
    }
    float *xs = xa + M * K, *S = xs + M * G, *rs = S + M * B, *tu = rs + 4 * M, *tl = tu + M * T;
    int32_t *bad = hs + M * B, *all = bad + M;
    if (nt < 1) nt = 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && M * K >= 4096)
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * K;
        float *ar = xa + r * K;
        const float a = row_alpha(xr, K, alpha, eps);
        for (int64_t k = 0; k < K; k++) ar[k] = a * (cs ? xr[k] * cs[k] : xr[k]); /* gemm's xa */
        for (int64_t g = 0; g < G; g++) {
            float s = 0.f;
            for (int j = 0; j < GROUP; j++) s += ar[g * GROUP + j];
            xs[r * G + g] = s;
        }
        double e2 = 0., t2 = 0., t1 = 0., a1 = 0.;
        int big = 0;
        for (int64_t b = 0; b < B; b++) {
            const int64_t k0 = b * SBK, k1 = k0 + SBK < K ? k0 + SBK : K;
            double amax = 0.;
            for (int64_t k = k0; k < k1; k++) {
                amax = fmax(amax, fabs((double)ar[k]));
                if (!(fabs((double)ar[k]) <= SCREEN_MAX)) big = 1; /* NaN too */
            }
            const float s = (float)(amax / 127.);
            S[r * B + b] = s;
            int32_t hsum = 0;
            for (int64_t k = k0; k < k1; k++) {
                double v = s > 0.f ? rint((double)ar[k] / (double)s) : 0.;
                v = v > 127. ? 127. : v < -127. ? -127. : v;
                h[r * K + k] = (int8_t)(int)v;
                hsum += (int32_t)v;
                const double xt = (double)s * v;
                e2 += ((double)ar[k] - xt) * ((double)ar[k] - xt);
                t2 += xt * xt;
                t1 += fabs(xt);
                a1 += fabs((double)ar[k]);
            }
            hs[r * B + b] = hsum;
        }
        const double up = 1. + 1e-6; /* the bound's own steps, upwards */
        rs[4 * r + 0] = (float)(sqrt(e2) * up);
        rs[4 * r + 1] = (float)(sqrt(t2) * up);
        rs[4 * r + 2] = (float)(SCREEN_SAFETY * (double)(B + 2) * 0x1p-24 * t1 * up);
        rs[4 * r + 3] = (float)(2. * SCREEN_SAFETY * (double)(2 * G + GROUP + 4) * 0x1p-24 * a1 * up);
        bad[r] = 0;
        all[r] = big;
    }
    int nt1 = nt > T ? (int)T : nt;
#pragma omp parallel for num_threads(nt1) schedule(static) if (nt1 > 1)
    for (int64_t t = 0; t < T; t++) {
        const int nc = tile_cols(N, t, 0);
        const uint8_t *w = sq + t * K * TN;
        const float *D = sd + t * B * TN, *cl = cols + t * TN;
        for (int64_t r = 0; r < M; r++) {
            const int8_t *hr = h + r * K;
            double acc[TN] = {0};
            for (int64_t b = 0; b < B; b++) {
                const int64_t k0 = b * SBK, k1 = k0 + SBK < K ? k0 + SBK : K;
                int32_t isum[TN] = {0};
                for (int64_t k = k0; k < k1; k++) {
                    const int32_t hk = hr[k];
                    for (int c = 0; c < TN; c++) isum[c] += (int32_t)w[k * TN + c] * hk;
                }
                const float s = S[r * B + b];
                const int32_t off = 128 * hs[r * B + b]; /* (Q + 128) . h less 128 sum h */
                for (int c = 0; c < TN; c++) acc[c] += (double)(D[b * TN + c] * s) * (isum[c] - off);
            }
            double hi = -INFINITY, lo = -INFINITY;
            for (int c = 0; c < nc; c++) { /* cols: |W_n|_2, |W_n - W'_n|_2, max|W'_n|, mag_n */
                double bd = 0.;
                for (int i = 0; i < 4; i++) bd += (double)cl[i * ncols + c] * rs[4 * r + i];
                if (acc[c] != acc[c]) __atomic_store_n(&bad[r], 1, __ATOMIC_RELAXED);
                hi = fmax(hi, acc[c] + bd);
                lo = fmax(lo, acc[c] - bd);
            }
            tu[r * T + t] = (float)hi; /* float: the bound's rounding (up) covers these */
            tl[r * T + t] = (float)lo;
        }
    }
    int failed = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1 && M > 1) reduction(| : failed)
    for (int64_t r = 0; r < M; r++) {
        float floor = -INFINITY, best = -INFINITY, y[TN] __attribute__((aligned(64)));
        int64_t pick = -1;
        float *buf = NULL; /* the scalar build widens a tile's codes first */
        if (!MR_REG && !(buf = malloc(sizeof(float) * (size_t)(K * TN)))) {
            failed = 1;
            continue;
        }
        if (all[r]) bad[r] = 0; /* every tile in full: the screen's sums do not count */
        for (int64_t t = 0; t < T && !all[r]; t++) floor = fmaxf(floor, tl[r * T + t]);
        for (int64_t t = 0; t < T && !bad[r]; t++) {
            if (!all[r] && !(tu[r * T + t] >= floor)) continue;
            const int nc = tile_cols(N, t, 0);
            if (buf) codes_tile(kind, pq + t * tq, K, buf);
            run_tile(1, kind, buf, pq + t * tq, pd + t * G * TN, pm + t * G * TN, xa + r * K,
                     xs + r * G, K, y, TN, NULL, nc);
            for (int c = 0; c < nc; c++) {
                if (y[c] != y[c]) bad[r] = 1;
                if (pick < 0 || y[c] > best) best = y[c], pick = t * TN + c;
            }
        }
        free(buf);
        out[r] = pick;
        failed |= bad[r] || pick < 0;
    }
    free(xa), free(h), free(hs);
    return failed ? 1 : 0;
}
#endif

/* argmax per row of tq_gemm_*'s result (kind 4 or 8), screened through the copy sq, sd, cols
 * (head_greedy on the VNNI build, head_greedy_f on the others; tq_screen_layout says the
 * copy's order) */
int tq_head_greedy(int kind, const float *x, int64_t M, int64_t K, float alpha, const float *cs,
                   const uint8_t *pq, const float *pd, const float *pm, int64_t N, const uint8_t *sq,
                   const float *sd, const float *cols, int64_t *out, int nt, float eps) {
    if (kind != 4 && kind != 8) return -1;
#if IPATH
    return head_greedy(kind, x, M, K, alpha, cs, pq, pd, pm, N, sq, sd, cols, out, nt, eps);
#else
    return head_greedy_f(kind, x, M, K, alpha, cs, pq, pd, pm, N, sq, sd, cols, out, nt, eps);
#endif
}


/* ------------------------------------------------------------------ GEMM */

static int gemm(int kind, const float *x, int64_t M, int64_t K, float alpha, const float *cs,
                const uint8_t *pq, const float *pd, const float *pm, int64_t N, float *y,
                const float *res, int nt, float eps, int glu) {
    if (K % GROUP || K <= 0 || M < 0 || N < 0 || (glu && (N % TN || res))) return -1;
    if (M == 0 || N == 0) return 0;
#if IPATH
    return vgemm(kind, x, M, K, alpha, cs, pq, pd, pm, N, y, res, nt, eps, glu);
#endif
    const int64_t G = K / GROUP, T = (N + TN - 1) / TN, rb = kind == 4 ? TN / 2 : TN;
    const int64_t oc = glu ? TN / 2 : TN, ldy = glu ? N / 2 : N; /* output columns a tile, a row */
    const int scaled = alpha != 1.f || cs || eps >= 0.f;
    float *xf = malloc(sizeof(float) * (size_t)(M * G + (scaled ? M * K : 0)));
    if (!xf) return -2;
    float *xs = xf; /* [M][G]: each group's sum of x (times the group minimum) */
    if (scaled) {
        float *xa = xf + M * G;
        for (int64_t r = 0; r < M; r++) {
            const float ar = row_alpha(x + r * K, K, alpha, eps);
            for (int64_t k = 0; k < K; k++)
                xa[r * K + k] = ar * (cs ? x[r * K + k] * cs[k] : x[r * K + k]);
        }
        x = xa;
    }
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.f;
            for (int j = 0; j < GROUP; j++) s += x[r * K + g * GROUP + j];
            xs[r * G + g] = s;
        }
    if (nt < 1) nt = 1;
    if (nt > T) nt = (int)T;
    int failed = 0;
    const int use_buf = M > MR_REG;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *buf = NULL;
        if (use_buf) {
            buf = aligned_alloc(64, sizeof(float) * (size_t)(K * TN));
            if (!buf) {
#pragma omp atomic write
                failed = 1;
            }
        }
#if ISA
        if (M == 1) { /* tiles in pairs (the last alone when T is odd) */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < (T + 1) / 2; p++) {
                const int64_t t = 2 * p;
                const uint8_t *q = pq + t * K * rb;
                const float *d = pd + t * G * TN, *m = pm + t * G * TN;
                const float *rt = res ? res + t * TN : NULL;
                if (t + 1 < T) {
                    const int nc = tile_cols(N, t + 1, glu);
                    if (kind == 4)
                        tile1x2(4, q, d, m, K * rb, G * TN, x, xs, K, y + t * oc, rt, nc);
                    else
                        tile1x2(8, q, d, m, K * rb, G * TN, x, xs, K, y + t * oc, rt, nc);
                } else {
                    const int nc = tile_cols(N, t, glu);
                    run_tile(1, kind, NULL, q, d, m, x, xs, K, y + t * oc, ldy, rt, nc);
                }
            }
        } else
#endif
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (use_buf && !buf) continue;
            const uint8_t *q = pq + t * K * rb;
            const float *d = pd + t * G * TN, *m = pm + t * G * TN;
            const int nc = tile_cols(N, t, glu);
            float *yt = y + t * oc;
            const float *rt = res ? res + t * TN : NULL;
            if (use_buf) codes_tile(kind, q, K, buf);
            const int step = use_buf ? MR : MR_REG;
            for (int64_t r0 = 0; r0 < M; r0 += step) {
                const int R = (int)(M - r0 < step ? M - r0 : step);
                run_tile(R, kind, buf, q, d, m, x + r0 * K, xs + r0 * G, K, yt + r0 * ldy, ldy,
                         rt ? rt + r0 * N : NULL, nc);
            }
        }
        free(buf);
    }
    free(xf);
    return failed ? -2 : 0;
}

int tq_gemm_q4(const float *x, int64_t M, int64_t K, float alpha, const float *cs,
               const uint8_t *pq, const float *pd, const float *pm, int64_t N, float *y,
               const float *res, int nt, float norm_eps, int glu) {
    return gemm(4, x, M, K, alpha, cs, pq, pd, pm, N, y, res, nt, norm_eps, glu);
}

int tq_gemm_q8(const float *x, int64_t M, int64_t K, float alpha, const float *cs,
               const uint8_t *pq, const float *pd, const float *pm, int64_t N, float *y,
               const float *res, int nt, float norm_eps, int glu) {
    return gemm(8, x, M, K, alpha, cs, pq, pd, pm, N, y, res, nt, norm_eps, glu);
}

/* ------------------------------------------------------------------ issue-rate probe */
/* GMAC/s one core reaches on a register-only loop of the instruction pair the GEMM is built
 * on, timed in thread CPU time (a busy neighbour takes turns, not speed): op 0 the fp32 FMA
 * (8 products each, what the fp32 engine's BLAS runs on), op 1 this build's integer step
 * (AVX2: vpmaddwd + vpaddd, 16 products), op 2 AVX2's two-plane step (vpmaddubsw + vpaddw,
 * 32 byte products = 16 13-bit ones). 0 where the build lacks the instruction. The GEMM's
 * ceiling beside its measured rate (`tandem bench engine --gemm`). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <time.h>
static double thread_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define PROBE(insn, acc)                                                                   \
    __asm__ volatile(insn " %%ymm14, %%ymm15, %%ymm0\n\t" acc " %%ymm0, %%ymm1, %%ymm1\n\t"  \
                     insn " %%ymm14, %%ymm15, %%ymm2\n\t" acc " %%ymm2, %%ymm3, %%ymm3\n\t"  \
                     insn " %%ymm14, %%ymm15, %%ymm4\n\t" acc " %%ymm4, %%ymm5, %%ymm5\n\t"  \
                     insn " %%ymm14, %%ymm15, %%ymm6\n\t" acc " %%ymm6, %%ymm7, %%ymm7\n\t"  \
                     insn " %%ymm14, %%ymm15, %%ymm8\n\t" acc " %%ymm8, %%ymm9, %%ymm9\n\t"  \
                     insn " %%ymm14, %%ymm15, %%ymm10\n\t" acc " %%ymm10, %%ymm11, %%ymm11"  \
                     ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",     \
                         "xmm8", "xmm9", "xmm10", "xmm11")
double tq_issue_gmacs(int op, int64_t iters) {
    const double t0 = thread_s();
    for (int64_t i = 0; i < iters; i++) {
        if (op == 0)
            __asm__ volatile("vfmadd231ps %%ymm14, %%ymm15, %%ymm0\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm1\n\t"
                             "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm3\n\t"
                             "vfmadd231ps %%ymm14, %%ymm15, %%ymm4\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm5\n\t"
                             "vfmadd231ps %%ymm14, %%ymm15, %%ymm6\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm7\n\t"
                             "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm9\n\t"
                             "vfmadd231ps %%ymm14, %%ymm15, %%ymm10\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm11"
                             ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",
                                 "xmm8", "xmm9", "xmm10", "xmm11");
        else if (op == 1)
            PROBE("vpmaddwd", "vpaddd");
        else if (op == 2)
            PROBE("vpmaddubsw", "vpaddw");
        else
            return 0.;
    }
    const double s = thread_s() - t0;
    return s > 0. ? (double)iters * (op == 0 ? 12 * 8 : 6 * 16) / s * 1e-9 : 0.;
}
#undef PROBE
#else
double tq_issue_gmacs(int op, int64_t iters) {
    (void)op, (void)iters;
    return 0.;
}
#endif

/* ------------------------------------------------------------------ source-order dequant */

/* W [N, K] float from source-order q4 / q8 (references in tests; the fp32 embedding) */
static void dequant(int kind, const uint8_t *qs, const float *d, const float *m, int64_t N,
                    int64_t K, float *w, int nt) {
    const int64_t G = K / GROUP;
    if (nt < 1) nt = 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            float *o = w + n * K + g * GROUP;
            const float dg = d[n * G + g], mg = m[n * G + g];
            for (int j = 0; j < GROUP; j++) {
                int q;
                if (kind == 4) {
                    const uint8_t b = qs[n * (K / 2) + g * 16 + j % 16];
                    q = j < 16 ? (b & 0x0f) : (b >> 4);
                } else {
                    q = qs[n * K + g * GROUP + j];
                }
                o[j] = fmaf(dg, (float)q, mg); /* fused in every build: the same w anywhere */
            }
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

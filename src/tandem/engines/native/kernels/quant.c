/* Weight-only quantized linear kernels for the native engine: AVX-512, AVX2 + FMA, or a
 * portable scalar path, picked at compile time by what the compiler targets.
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
 * Arithmetic, the same for every row whatever the row count M and wherever the row sits:
 *   w[k][n] = fma(d, q, m) in fp32 (exactly the GGUF value for Q4_1/Q8_0 blocks)
 *   acc[n]  = fma(w[k][n], x[k], acc[n])  for k = 0, 1, ..., K-1 in that order
 *   y[n]    = acc[n] (+ residual)
 * so a request's output is bit-identical alone or batched (batch invariance by
 * construction), and equals x @ dequantize(W)^T up to the order of the fp32 additions.
 * Activations stay fp32 (measured: int8 activations moved greedy tokens off fp32's).
 *
 * Up to MR_REG rows: each tile's codes are dequantized in registers and used by all rows
 * (the mat-vec streams the packed bytes). More rows: a tile is dequantized once into a
 * per-thread fp32 scratch [K][32] (L2) and a register-blocked micro-kernel (MR rows x 32
 * columns of accumulators, x broadcast) runs over the row blocks. Threads split the tiles.
 * y = (alpha * x * cs) @ W^T (+ residual); cs is a per-column scale (an RMSNorm weight) or NULL.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GROUP 32
#define TN 32 /* output columns per tile */

#if defined(__AVX512F__)
#define ISA 512
#define VW 16
#define MR 12     /* rows per scratch micro-kernel block: 24 zmm accumulators */
#define MR_REG 8  /* rows served by the in-register dequantization */
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
#define MR 3
#define MR_REG 2
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

#define INLINE static inline __attribute__((always_inline))

/* which path this build runs: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (scalar) */
int tq_isa(void) { return ISA; }

/* ------------------------------------------------------------------ packing */

static void pack(int kind, const uint8_t *qs, const float *d, const float *m, int64_t N,
                 int64_t K, uint8_t *pq, float *pd, float *pm) {
    const int64_t G = K / GROUP, T = (N + TN - 1) / TN, rb = kind == 4 ? TN / 2 : TN;
    memset(pq, 0, (size_t)(T * K * rb));
    memset(pd, 0, sizeof(float) * (size_t)(T * G * TN));
    memset(pm, 0, sizeof(float) * (size_t)(T * G * TN));
    for (int64_t n = 0; n < N; n++) {
        const int64_t t = n / TN, c = n % TN;
        for (int64_t g = 0; g < G; g++) {
            pd[(t * G + g) * TN + c] = d[n * G + g];
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
            uint8_t *o = pq + (t * K + k) * rb;
            if (kind == 4)
                o[c % 16] |= (uint8_t)(c < 16 ? q : q << 4);
            else
                o[c] = (uint8_t)q;
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

/* ------------------------------------------------------------------ dequantization */

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

/* tile row k's weights: fma(code, d, m) */
INLINE void weights(int kind, const uint8_t *q, int64_t k, const vec vd[NV], const vec vm[NV],
                    vec w[NV]) {
    codes(kind, q, k, w);
    for (int v = 0; v < NV; v++) w[v] = VFMA(w[v], vd[v], vm[v]);
}

/* one tile into buf [K][TN] (64-byte aligned) */
static void dequant_tile(int kind, const uint8_t *q, const float *d, const float *m, int64_t K,
                         float *buf) {
    const int64_t G = K / GROUP;
    for (int64_t g = 0; g < G; g++) {
        vec vd[NV], vm[NV], w[NV];
        for (int v = 0; v < NV; v++) {
            vd[v] = VLOADU(d + g * TN + v * VW);
            vm[v] = VLOADU(m + g * TN + v * VW);
        }
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {
            weights(kind, q, k, vd, vm, w);
            for (int v = 0; v < NV; v++) VSTORE(buf + k * TN + v * VW, w[v]);
        }
    }
}

/* y[r][0:nc] for R rows from their accumulators */
INLINE void store_rows(int R, vec acc[][NV], float *y, int64_t ldy, const float *res, int nc) {
    for (int r = 0; r < R; r++) {
        float *yr = y + r * ldy;
        const float *rr = res ? res + r * ldy : NULL;
        if (nc == TN) {
            for (int v = 0; v < NV; v++) {
                vec o = acc[r][v];
                if (rr) o = VADD(VLOADU(rr + v * VW), o);
                VSTOREU(yr + v * VW, o);
            }
        } else {
            float tmp[TN] __attribute__((aligned(64)));
            for (int v = 0; v < NV; v++) VSTORE(tmp + v * VW, acc[r][v]);
            for (int c = 0; c < nc; c++) yr[c] = rr ? rr[c] + tmp[c] : tmp[c];
        }
    }
}

/* R rows (R <= MR_REG) x one tile, weights dequantized in registers */
INLINE void tile_reg(int R, int kind, const uint8_t *q, const float *d, const float *m,
                     const float *x, int64_t K, float *y, int64_t ldy, const float *res, int nc) {
    vec acc[MR_REG][NV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = VZERO();
    for (int64_t g = 0; g < K / GROUP; g++) {
        vec vd[NV], vm[NV], w[NV];
        for (int v = 0; v < NV; v++) {
            vd[v] = VLOADU(d + g * TN + v * VW);
            vm[v] = VLOADU(m + g * TN + v * VW);
        }
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {
            weights(kind, q, k, vd, vm, w);
            for (int r = 0; r < R; r++) {
                const vec xb = VSET1(x[r * K + k]);
                for (int v = 0; v < NV; v++) acc[r][v] = VFMA(w[v], xb, acc[r][v]);
            }
        }
    }
    store_rows(R, acc, y, ldy, res, nc);
}

/* R rows (R <= MR) x one tile from the dequantized scratch */
INLINE void tile_buf(int R, const float *buf, const float *x, int64_t K, float *y, int64_t ldy,
                     const float *res, int nc) {
    vec acc[MR][NV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = VZERO();
    for (int64_t k = 0; k < K; k++) {
        vec w[NV];
        for (int v = 0; v < NV; v++) w[v] = VLOAD(buf + k * TN + v * VW);
        for (int r = 0; r < R; r++) {
            const vec xb = VSET1(x[r * K + k]);
            for (int v = 0; v < NV; v++) acc[r][v] = VFMA(w[v], xb, acc[r][v]);
        }
    }
    store_rows(R, acc, y, ldy, res, nc);
}

/* one row x two tiles (t, t+1): four independent accumulator chains instead of two, so the
 * mat-vec is not bound by the FMA latency; the arithmetic per column is tile_reg's */
INLINE void tile_reg1x2(int kind, const uint8_t *q, const float *d, const float *m,
                        int64_t tq, int64_t td, const float *x, int64_t K, float *y,
                        const float *res, int nc) {
    vec acc[2][NV];
    for (int u = 0; u < 2; u++)
        for (int v = 0; v < NV; v++) acc[u][v] = VZERO();
    for (int64_t g = 0; g < K / GROUP; g++) {
        vec vd[2][NV], vm[2][NV], w[2][NV];
        for (int u = 0; u < 2; u++)
            for (int v = 0; v < NV; v++) {
                vd[u][v] = VLOADU(d + u * td + g * TN + v * VW);
                vm[u][v] = VLOADU(m + u * td + g * TN + v * VW);
            }
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {
            const vec xb = VSET1(x[k]);
            for (int u = 0; u < 2; u++) {
                weights(kind, q + u * tq, k, vd[u], vm[u], w[u]);
                for (int v = 0; v < NV; v++) acc[u][v] = VFMA(w[u][v], xb, acc[u][v]);
            }
        }
    }
    store_rows(1, acc, y, 0, res, TN);
    store_rows(1, acc + 1, y + TN, 0, res ? res + TN : NULL, nc);
}

#define CASES_REG(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)
#if ISA == 512
#define CASES_BUF(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12)
#else
#define CASES_BUF(X) X(1) X(2) X(3)
#endif

static void run_reg(int R, int kind, const uint8_t *q, const float *d, const float *m,
                    const float *x, int64_t K, float *y, int64_t ldy, const float *res, int nc) {
    switch (R) {
#define X(n)                                                        \
    case n:                                                         \
        if (n <= MR_REG) {                                          \
            if (kind == 4)                                          \
                tile_reg(n, 4, q, d, m, x, K, y, ldy, res, nc);     \
            else                                                    \
                tile_reg(n, 8, q, d, m, x, K, y, ldy, res, nc);     \
        }                                                           \
        break;
        CASES_REG(X)
#undef X
    }
}

static void run_buf(int R, const float *buf, const float *x, int64_t K, float *y, int64_t ldy,
                    const float *res, int nc) {
    switch (R) {
#define X(n)                                         \
    case n:                                          \
        tile_buf(n, buf, x, K, y, ldy, res, nc);     \
        break;
        CASES_BUF(X)
#undef X
    }
}

#else /* scalar */

static void dequant_tile(int kind, const uint8_t *q, const float *d, const float *m, int64_t K,
                         float *buf) {
    for (int64_t k = 0; k < K; k++) {
        const float *dg = d + (k / GROUP) * TN, *mg = m + (k / GROUP) * TN;
        for (int c = 0; c < TN; c++) {
            int code;
            if (kind == 4) {
                const uint8_t b = q[k * 16 + c % 16];
                code = c < 16 ? (b & 0x0f) : (b >> 4);
            } else {
                code = q[k * 32 + c];
            }
            buf[k * TN + c] = dg[c] * (float)code + mg[c];
        }
    }
}

static void run_buf(int R, const float *buf, const float *x, int64_t K, float *y, int64_t ldy,
                    const float *res, int nc) {
    float acc[MR][TN];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < K; k++)
        for (int r = 0; r < R; r++) {
            const float xv = x[r * K + k];
            for (int c = 0; c < TN; c++) acc[r][c] += buf[k * TN + c] * xv;
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc; c++)
            y[r * ldy + c] = res ? res[r * ldy + c] + acc[r][c] : acc[r][c];
}
#endif

/* ------------------------------------------------------------------ GEMM */

static int gemm(int kind, const float *x, int64_t M, int64_t K, float alpha, const float *cs,
                const uint8_t *pq, const float *pd, const float *pm, int64_t N, float *y,
                const float *res, int nt) {
    if (K % GROUP || K <= 0 || M < 0 || N < 0) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t G = K / GROUP, T = (N + TN - 1) / TN, rb = kind == 4 ? TN / 2 : TN;
    float *xf = NULL;
    if (alpha != 1.f || cs) {
        xf = malloc(sizeof(float) * (size_t)(M * K));
        if (!xf) return -2;
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < K; k++)
                xf[r * K + k] = alpha * (cs ? x[r * K + k] * cs[k] : x[r * K + k]);
        x = xf;
    }
    if (nt < 1) nt = 1;
    if (nt > T) nt = (int)T;
    int failed = 0;
#if ISA
    const int use_buf = M > MR_REG;
#else
    const int use_buf = 1;
#endif
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
                    const int nc = (int)(N - (t + 1) * TN < TN ? N - (t + 1) * TN : TN);
                    if (kind == 4)
                        tile_reg1x2(4, q, d, m, K * rb, G * TN, x, K, y + t * TN, rt, nc);
                    else
                        tile_reg1x2(8, q, d, m, K * rb, G * TN, x, K, y + t * TN, rt, nc);
                } else {
                    const int nc = (int)(N - t * TN < TN ? N - t * TN : TN);
                    run_reg(1, kind, q, d, m, x, K, y + t * TN, N, rt, nc);
                }
            }
        } else
#endif
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (use_buf && !buf) continue;
            const uint8_t *q = pq + t * K * rb;
            const float *d = pd + t * G * TN, *m = pm + t * G * TN;
            const int nc = (int)(N - t * TN < TN ? N - t * TN : TN);
            float *yt = y + t * TN;
            const float *rt = res ? res + t * TN : NULL;
            if (!use_buf) {
#if ISA
                run_reg((int)M, kind, q, d, m, x, K, yt, N, rt, nc);
#endif
                continue;
            }
            dequant_tile(kind, q, d, m, K, buf);
            for (int64_t r0 = 0; r0 < M; r0 += MR) {
                const int R = (int)(M - r0 < MR ? M - r0 : MR);
                run_buf(R, buf, x + r0 * K, K, yt + r0 * N, N, rt ? rt + r0 * N : NULL, nc);
            }
        }
        free(buf);
    }
    free(xf);
    return failed ? -2 : 0;
}

int tq_gemm_q4(const float *x, int64_t M, int64_t K, float alpha, const float *cs,
               const uint8_t *pq, const float *pd, const float *pm, int64_t N, float *y,
               const float *res, int nt) {
    return gemm(4, x, M, K, alpha, cs, pq, pd, pm, N, y, res, nt);
}

int tq_gemm_q8(const float *x, int64_t M, int64_t K, float alpha, const float *cs,
               const uint8_t *pq, const float *pd, const float *pm, int64_t N, float *y,
               const float *res, int nt) {
    return gemm(8, x, M, K, alpha, cs, pq, pd, pm, N, y, res, nt);
}

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
                o[j] = dg * (float)q + mg;
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

/* The native engine's per-layer glue outside the linear layers, fp32, CPU (AVX2 + FMA where
 * the compiler targets it, a scalar path else). Loaded by tandem.engines.native.ops; every
 * function has a torch twin there that CUDA (and a machine without a compiler) runs instead.
 *
 *   to_rope_store        rotate-half RoPE in place on the q and k heads of each row of the
 *                        fused qkv projection, then k and v of each row into its cache slot
 *   to_decode_attention  attention of one query row per sequence over that sequence's K/V,
 *                        read straight from the paged cache through its block table (no
 *                        gather); each thread takes one (sequence, kv head) and its q group
 *   to_prefill_attention causal attention of a prefill chunk's rows over the paged cache,
 *                        blocks of rows sharing each key / value load
 *   to_silu_mul          silu(gate) * up per row of the fused gate_up projection
 *   to_lora_add          y += scale (x A^T) B^T per row of a LoRA adapter (issue 32)
 *   to_rms_scale         1 / RMS of one row (the RMSNorm factor; the weight is folded)
 *
 * Shapes: qkv [T, stride] with q heads at 0, k heads at H*d, v heads at (H+KVH)*d; the cache
 * planes [num_slots, KVH, d] (slot = block * block_size + offset); block tables int64 [D, W].
 * The cache holds kv_t: fp32, or fp16 in the build with -DTO_KV_HALF (half the bytes every
 * attention reads; values are rounded to nearest even, saturating at +-65504, as they are
 * stored, and widened to fp32 as they are loaded: all arithmetic stays fp32).
 * Each row is computed the same way whatever the batch (no cross-row blocking), so a
 * sequence's results do not depend on what it is batched with.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "vmath.h"

#ifdef TO_KV_HALF
#if defined(__AVX2__) && !defined(__F16C__)
#error "an fp16 KV cache with AVX2 needs F16C"
#endif
typedef _Float16 kv_t;
#define KV_MAX 65504.f
static inline kv_t f_kv(float x) { return (kv_t)(x > KV_MAX ? KV_MAX : x < -KV_MAX ? -KV_MAX : x); }
#define KV8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define KV16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
#else
typedef float kv_t;
#define f_kv(x) (x)
#define KV8(p) _mm256_loadu_ps(p)
#define KV16(p) _mm512_loadu_ps(p)
#endif
#define KV_LINE (64 / (int64_t)sizeof(kv_t)) /* cache elements a 64-byte line */

/* the cache slot of position p through a block table: a shift and a mask where bs is a power
 * of two (an integer division per key cost decode attention ~20 % of its time), else / and % */
static inline int64_t slot_of(const int64_t *table, int64_t p, int64_t bs) {
    if ((bs & (bs - 1)) == 0) {
        const int sh = __builtin_ctzll((unsigned long long)bs);
        return (table[p >> sh] << sh) + (p & (bs - 1));
    }
    return table[p / bs] * bs + p % bs;
}

int to_kv_bytes(void) { return (int)sizeof(kv_t); }

/* dst[0:n] = src[0:n] as cache elements (f_kv; NaN stays NaN) */
static inline void store_kv(kv_t *dst, const float *src, int64_t n) {
    int64_t j = 0;
#if defined(TO_KV_HALF) && defined(__F16C__)
    const __m256 hi = _mm256_set1_ps(KV_MAX), lo = _mm256_set1_ps(-KV_MAX);
    for (; j + 8 <= n; j += 8) { /* max/min return their second operand for a NaN: v's */
        const __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(src + j)));
        _mm_storeu_si128((__m128i *)(void *)(dst + j), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; j < n; j++) dst[j] = f_kv(src[j]);
}

int to_has_avx2(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

/* a . b over n floats (b: B elements, widened by LOADB 8 at a time) */
#define DEF_DOT(name, B, LOADB)                                                              \
    static inline float name(const float *a, const B *b, int64_t n) {                        \
        int64_t i = 0;                                                                       \
        float s = 0.f;                                                                       \
        DOT_BODY(LOADB)                                                                      \
        for (; i < n; i++) s += a[i] * (float)b[i];                                          \
        return s;                                                                            \
    }
#ifdef __AVX2__
#define DOT_BODY(LOADB)                                                                      \
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                           \
    for (; i + 16 <= n; i += 16) {                                                           \
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), LOADB(b + i), acc0);                  \
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), LOADB(b + i + 8), acc1);          \
    }                                                                                        \
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), LOADB(b + i), acc0); \
    __m256 acc = _mm256_add_ps(acc0, acc1);                                                  \
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));       \
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                                  \
    h = _mm_add_ss(h, _mm_movehdup_ps(h));                                                   \
    s = _mm_cvtss_f32(h);
#else
#define DOT_BODY(LOADB)
#endif
DEF_DOT(dot, float, _mm256_loadu_ps)
#ifdef TO_KV_HALF
DEF_DOT(dot_kv, kv_t, KV8) /* q . a cached key */
#else
#define dot_kv dot
#endif

static inline void axpy(float *y, float a, const kv_t *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * (float)x[i];
}

void to_rope_store(float *qkv, int64_t T, int64_t stride, int64_t H, int64_t KVH, int64_t d,
                   const int64_t *pos, const float *cos_t, const float *sin_t,
                   const int64_t *slots, kv_t *kc, kv_t *vc, int nt) {
    int64_t half = d / 2, kv = KVH * d;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && T >= 32)
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * stride;
        const float *c = cos_t + pos[t] * d, *s = sin_t + pos[t] * d;
        for (int64_t h = 0; h < H + KVH; h++) {
            float *x = row + h * d;
            for (int64_t i = 0; i < half; i++) {
                float a = x[i], b = x[i + half];
                x[i] = a * c[i] - b * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
        store_kv(kc + slots[t] * kv, row + H * d, kv);
        store_kv(vc + slots[t] * kv, row + (H + KVH) * d, kv);
    }
}

#ifdef __AVX2__
/* Scores of G (<= 3) query heads q[g] against 8 keys, times sv, into out[g * ld : + 8]: one
 * dot per head and key, each key's 8 values widened once for all G heads, and a head's 8
 * dots reduced together (a transposing tree of horizontal adds instead of eight separate
 * reductions). A head's sums do not depend on G. */
static inline __attribute__((always_inline)) void dot8g(int G, const float *q, const kv_t *const *k,
                                                      int64_t d, __m256 sv, float *out, int64_t ld) {
    __m256 acc[3][8];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 8; j++) acc[g][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m256 qv[3];
        for (int g = 0; g < G; g++) qv[g] = _mm256_loadu_ps(q + g * d + i);
        for (int j = 0; j < 8; j++) {
            const __m256 kv = KV8(k[j] + i);
            for (int g = 0; g < G; g++) acc[g][j] = _mm256_fmadd_ps(qv[g], kv, acc[g][j]);
        }
    }
    for (int g = 0; g < G; g++) {
        __m256 a = _mm256_hadd_ps(acc[g][0], acc[g][1]), b = _mm256_hadd_ps(acc[g][2], acc[g][3]);
        __m256 c = _mm256_hadd_ps(acc[g][4], acc[g][5]), e = _mm256_hadd_ps(acc[g][6], acc[g][7]);
        a = _mm256_hadd_ps(a, b);
        c = _mm256_hadd_ps(c, e);
        __m256 lo = _mm256_permute2f128_ps(a, c, 0x20), hi = _mm256_permute2f128_ps(a, c, 0x31);
        _mm256_storeu_ps(out + g * ld, _mm256_mul_ps(_mm256_add_ps(lo, hi), sv));
    }
}
#endif

/* s[i] = exp(s[i] - max) / sum over the row; the vector/scalar split depends only on n. */
static void softmax(float *s, int64_t n) {
    float m = -INFINITY, sum = 0.f;
    int64_t t = 0;
#if defined(__AVX512F__)
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
    m = _mm512_reduce_max_ps(mx);
#endif
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    t = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (; t + 16 <= n; t += 16) {
        const __m512 e = exp_w(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
        _mm512_storeu_ps(s + t, e);
        acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
    __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp_v(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) sum += lanes[j];
#endif
    for (; t < n; t++) sum += (s[t] = exp_s(s[t] - m));
    float inv = 1.f / sum;
    for (t = 0; t < n; t++) s[t] *= inv;
}

#if defined(__AVX512F__)
/* out[g][c : c + 64] = sum over t of p[g][t] v[t][c : c + 64] for G query heads, the G x 4
 * sums held in registers across the whole context, each key's value row widened once for
 * all G heads; in t order, as axpy, so every output element is the same chain of FMAs as on
 * the other paths (weigh_values below, axpy). */
static inline __attribute__((always_inline)) void weigh_values16(
    int G, const float *p, int64_t ctx, int64_t d, const kv_t *vc, int64_t kv, int64_t bs,
    const int64_t *table, float *out) {
    for (int64_t c = 0; c < d; c += 64) {
        __m512 acc[4][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = _mm512_setzero_ps();
        for (int64_t t = 0; t < ctx; t++) {
            const kv_t *v = vc + slot_of(table, t, bs) * kv + c;
            __m512 vv[4];
            for (int j = 0; j < 4; j++) vv[j] = KV16(v + 16 * j);
            for (int g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(p[g * ctx + t]);
                for (int j = 0; j < 4; j++) acc[g][j] = _mm512_fmadd_ps(w, vv[j], acc[g][j]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + g * d + c + 16 * j, acc[g][j]);
    }
}
#endif

#ifdef __AVX2__
/* out[g][c : c + 32] = sum over t of p[g][t] v[t][c : c + 32] for G query heads, the sums
 * held in registers across the whole context (G x 4 vectors); in t order, as axpy. */
static inline __attribute__((always_inline)) void weigh_values(
    int G, const float *p, int64_t ctx, int64_t d, const kv_t *vc, int64_t kv, int64_t bs,
    const int64_t *table, float *out) {
    for (int64_t c = 0; c < d; c += 32) {
        __m256 acc[4][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
        for (int64_t t = 0; t < ctx; t++) {
            const kv_t *v = vc + slot_of(table, t, bs) * kv + c;
            __m256 vv[4];
            for (int j = 0; j < 4; j++) vv[j] = KV8(v + 8 * j);
            for (int g = 0; g < G; g++) {
                const __m256 w = _mm256_set1_ps(p[g * ctx + t]);
                for (int j = 0; j < 4; j++) acc[g][j] = _mm256_fmadd_ps(w, vv[j], acc[g][j]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + g * d + c + 8 * j, acc[g][j]);
    }
}
#endif

/* One sequence, one kv head: its `group` query heads over ctx cached tokens. `ntable` /
 * `nctx` (or NULL): the sequence the thread takes next, whose rows of this kv head are
 * fetched into L2 while this one is scored (its first keys would otherwise come from DRAM
 * with nothing ahead of them). */
static void attend(const float *q, int64_t group, int64_t d, const kv_t *kc, const kv_t *vc,
                   int64_t kv, int64_t bs, const int64_t *table, int64_t ctx, float scale,
                   float *out, float *scores, const int64_t *ntable, int64_t nctx) {
    int64_t t = 0;
#ifdef __AVX2__
    if (d % 8 == 0) {
        const __m256 sv = _mm256_set1_ps(scale);
        for (; t + 8 <= ctx; t += 8) {
            const kv_t *k[8];
            for (int j = 0; j < 8; j++) {
                int64_t p = t + j;
                k[j] = kc + slot_of(table, p, bs) * kv;
                /* the cache is DRAM-resident at large batch: ask for the keys 16 ahead and
                 * this key's values (read after the softmax) while these are scored */
                const int64_t n = p + 16 < ctx ? p + 16 : p;
                const kv_t *kn = kc + slot_of(table, n, bs) * kv;
                const kv_t *vp = vc + slot_of(table, p, bs) * kv;
                for (int64_t i = 0; i < d; i += KV_LINE) {
                    _mm_prefetch((const char *)(kn + i), _MM_HINT_T0);
                    _mm_prefetch((const char *)(vp + i), _MM_HINT_T1);
                }
            }
            if (ntable) /* the next sequence's keys and values, spread over this pass */
                for (int64_t p = t * nctx / ctx; p < (t + 8) * nctx / ctx; p++) {
                    const int64_t slot = slot_of(ntable, p, bs) * kv;
                    for (int64_t i = 0; i < d; i += KV_LINE) {
                        _mm_prefetch((const char *)(kc + slot + i), _MM_HINT_T1);
                        _mm_prefetch((const char *)(vc + slot + i), _MM_HINT_T1);
                    }
                }
            int64_t g = 0;
            for (; g + 3 <= group; g += 3) /* heads three at a time, then the one or two left */
                dot8g(3, q + g * d, k, d, sv, scores + g * ctx + t, ctx);
            if (group - g == 2)
                dot8g(2, q + g * d, k, d, sv, scores + g * ctx + t, ctx);
            else if (group - g == 1)
                dot8g(1, q + g * d, k, d, sv, scores + g * ctx + t, ctx);
        }
    }
#endif
    for (; t < ctx; t++) {
        const kv_t *k = kc + slot_of(table, t, bs) * kv;
        for (int64_t g = 0; g < group; g++) scores[g * ctx + t] = dot_kv(q + g * d, k, d) * scale;
    }
    for (int64_t g = 0; g < group; g++) softmax(scores + g * ctx, ctx);
#if defined(__AVX512F__)
    if (d % 64 == 0 && group <= 4) { /* every key's value row widened once */
        switch (group) {
        case 1: weigh_values16(1, scores, ctx, d, vc, kv, bs, table, out); return;
        case 2: weigh_values16(2, scores, ctx, d, vc, kv, bs, table, out); return;
        case 3: weigh_values16(3, scores, ctx, d, vc, kv, bs, table, out); return;
        default: weigh_values16(4, scores, ctx, d, vc, kv, bs, table, out); return;
        }
    }
#endif
#ifdef __AVX2__
    if (d % 32 == 0 && group <= 4) {
        switch (group) {
        case 1: weigh_values(1, scores, ctx, d, vc, kv, bs, table, out); return;
        case 2: weigh_values(2, scores, ctx, d, vc, kv, bs, table, out); return;
        case 3: weigh_values(3, scores, ctx, d, vc, kv, bs, table, out); return;
        default: weigh_values(4, scores, ctx, d, vc, kv, bs, table, out); return;
        }
    }
#endif
    memset(out, 0, (size_t)(group * d) * sizeof(float));
    for (t = 0; t < ctx; t++) {
        const kv_t *v = vc + slot_of(table, t, bs) * kv;
        for (int64_t g = 0; g < group; g++) axpy(out + g * d, scores[g * ctx + t], v, d);
    }
}

/* a thread's scratch of n floats; NULL (and *failed set) when it cannot be had */
static float *scratch(int64_t n, int *failed) {
    float *p = malloc(sizeof(float) * (size_t)n);
    if (p == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
    return p;
}

int to_decode_attention(const float *q, int64_t q_stride, int64_t D, int64_t H, int64_t KVH,
                        int64_t d, const kv_t *kc, const kv_t *vc, int64_t bs,
                        const int64_t *tables, int64_t W, const int64_t *ctx_lens, float scale,
                        float *out, int nt) {
    int64_t group = H / KVH, items = D * KVH, max_ctx = 0, work = 0;
    for (int64_t i = 0; i < D; i++) {
        max_ctx = ctx_lens[i] > max_ctx ? ctx_lens[i] : max_ctx;
        work += ctx_lens[i];
    }
    /* Many sequences (the cache then comes from DRAM): a thread takes a run of whole
     * sequences, the runs balanced by context length, and fetches each next sequence's
     * rows while it computes one (batch 32, 30 layers: 10.0-10.6 -> 7.1-7.9 ms). Few: a
     * thread takes one (sequence, kv head) at a time. */
    const int per_seq = D >= 2 * (int64_t)nt;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1 && items > 1 && work * KVH * d >= 32768)
    {
        float *scores = scratch(group * max_ctx, &failed);
        if (scores != NULL && per_seq) {
#ifdef _OPENMP
            const int64_t tid = omp_get_thread_num(), n = omp_get_num_threads();
#else
            const int64_t tid = 0, n = 1;
#endif
            /* this thread's run [lo, hi): where the running work crosses tid / n, (tid+1) / n */
            int64_t lo = 0, hi = 0, acc = 0;
            for (int64_t i = 0; i < D; i++) {
                if (acc * n < tid * work) lo = i + 1;
                if (acc * n < (tid + 1) * work) hi = i + 1;
                acc += ctx_lens[i];
            }
            for (int64_t i = lo; i < hi; i++) {
                const int nxt = i + 1 < hi;
                for (int64_t h = 0; h < KVH; h++)
                    attend(q + i * q_stride + h * group * d, group, d, kc + h * d, vc + h * d,
                           KVH * d, bs, tables + i * W, ctx_lens[i], scale,
                           out + (i * H + h * group) * d, scores,
                           nxt ? tables + (i + 1) * W : NULL, nxt ? ctx_lens[i + 1] : 0);
            }
        } else if (scores != NULL) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                const int64_t i = it / KVH, h = it % KVH;
                attend(q + i * q_stride + h * group * d, group, d, kc + h * d, vc + h * d,
                       KVH * d, bs, tables + i * W, ctx_lens[i], scale,
                       out + (i * H + h * group) * d, scores, NULL, 0);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

#ifdef __AVX2__
/* the prefill kernels' vectors: 16 lanes with AVX-512 (half the broadcasts a FLOP), else 8 */
#ifdef __AVX512F__
#define PW 16
typedef __m512 pvec;
#define P_ZERO _mm512_setzero_ps
#define P_LOAD _mm512_loadu_ps
#define P_LOADKV KV16
#define P_STORE _mm512_storeu_ps
#define P_SET1 _mm512_set1_ps
#define P_FMA _mm512_fmadd_ps
#define P_MUL _mm512_mul_ps
#else
#define PW 8
typedef __m256 pvec;
#define P_ZERO _mm256_setzero_ps
#define P_LOAD _mm256_loadu_ps
#define P_LOADKV KV8
#define P_STORE _mm256_storeu_ps
#define P_SET1 _mm256_set1_ps
#define P_FMA _mm256_fmadd_ps
#define P_MUL _mm256_mul_ps
#endif

/* S[v][t0 : t0 + PW] = scale * (q_v . k_t) for the NQ query vectors of a row block against
 * PW keys, k read transposed (kt [d][cp]): one key load feeds NQ FMAs; each dot is summed
 * over i in order, so a row's scores do not depend on the block it sits in. */
static inline __attribute__((always_inline)) void score_block(
    int NQ, const float *const *qv, const float *kt, int64_t cp, int64_t d, int64_t nkw,
    float scale, float *S) {
    const pvec sv = P_SET1(scale);
    for (int64_t t0 = 0; t0 < nkw; t0 += PW) {
        pvec acc[12];
        for (int v = 0; v < NQ; v++) acc[v] = P_ZERO();
        for (int64_t i = 0; i < d; i++) {
            const pvec kw = P_LOAD(kt + i * cp + t0);
            for (int v = 0; v < NQ; v++) acc[v] = P_FMA(P_SET1(qv[v][i]), kw, acc[v]);
        }
        for (int v = 0; v < NQ; v++) P_STORE(S + v * cp + t0, P_MUL(acc[v], sv));
    }
}

/* out_v[c : c + PW] = sum over t < nk of S[v][t] v_t[c : c + PW], in t order (as
 * weigh_values: a row's result is the decode kernel's arithmetic for its weights) */
static inline __attribute__((always_inline)) void weigh_block(
    int NQ, const float *S, int64_t cp, int64_t nk, int64_t d, const kv_t *vc, int64_t kv,
    int64_t bs, const int64_t *table, float *const *ov) {
    enum { TB = 64 }; /* keys a pass: their value rows stay in L1 across the d / PW chunks */
    for (int64_t t0 = 0; t0 < nk; t0 += TB) {
        const int64_t nt = nk - t0 < TB ? nk - t0 : TB;
        const kv_t *vr[TB];
        for (int64_t t = 0; t < nt; t++) {
            const int64_t p = t0 + t;
            vr[t] = vc + slot_of(table, p, bs) * kv;
        }
        for (int64_t c = 0; c < d; c += PW) {
            pvec acc[12];
            for (int v = 0; v < NQ; v++) acc[v] = t0 ? P_LOAD(ov[v] + c) : P_ZERO();
            for (int64_t t = 0; t < nt; t++) {
                const pvec vv = P_LOADKV(vr[t] + c);
                for (int v = 0; v < NQ; v++) acc[v] = P_FMA(P_SET1(S[v * cp + t0 + t]), vv, acc[v]);
            }
            for (int v = 0; v < NQ; v++) P_STORE(ov[v] + c, acc[v]);
        }
    }
}

#define NQ_CASES(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12)
#endif

/* Causal attention of T consecutive rows of one sequence (positions ctx - T .. ctx - 1: a
 * prefill chunk, after a cached prefix or not) over its K/V in the paged cache (this step's
 * rows already stored), through its block table. With AVX2, rows go in blocks of up to
 * 12 / group rows per (kv head): the block's query vectors share every key and value load
 * (K is transposed once a call). Without AVX2, each row goes through the decode kernel. */
int to_prefill_attention(const float *q, int64_t q_stride, int64_t T, int64_t H, int64_t KVH,
                         int64_t d, const kv_t *kc, const kv_t *vc, int64_t bs,
                         const int64_t *table, int64_t ctx, float scale, float *out, int nt) {
    const int64_t group = H / KVH, first = ctx - T, kv = KVH * d;
    if (T <= 0) return 0;
    int failed = 0;
#ifdef __AVX2__
    if (d % PW == 0 && group <= 12) {
        /* kt rows one cache line longer than a multiple of 16 floats: the d rows a score
         * pass reads at once then fall in different L1 sets (a power-of-two stride put
         * them all in one set: 1.2-1.4x slower at 2048 keys) */
        const int64_t rb = 12 / group, nrb = (T + rb - 1) / rb, cp = (ctx + 15) / 16 * 16 + 16;
        float *kt = malloc(sizeof(float) * (size_t)(KVH * d * cp)); /* [KVH][d][cp] */
        if (kt == NULL) return -1;
#pragma omp parallel num_threads(nt) if (nt > 1 && T * ctx * kv >= 65536)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < cp; t++) {
                const kv_t *k = t < ctx ? kc + slot_of(table, t, bs) * kv : NULL;
                for (int64_t j = 0; j < kv; j++) kt[j * cp + t] = k ? (float)k[j] : 0.f;
            }
            float *S = scratch(12 * cp, &failed);
            if (S != NULL) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t u = 0; u < nrb * KVH; u++) {
                    const int64_t b = nrb - 1 - u / KVH, h = u % KVH; /* longest rows first */
                    const int64_t r0 = b * rb, R = T - r0 < rb ? T - r0 : rb;
                    const int64_t nk = first + r0 + R; /* keys the block's last row sees */
                    const int NQ = (int)(R * group);
                    const float *qv[12];
                    float *ov[12];
                    for (int v = 0; v < NQ; v++) {
                        const int64_t r = r0 + v / group, head = h * group + v % group;
                        qv[v] = q + r * q_stride + head * d;
                        ov[v] = out + (r * H + head) * d;
                    }
                    switch (NQ) {
#define X(n)                                                                                \
    case n:                                                                                 \
        score_block(n, qv, kt + h * d * cp, cp, d, (nk + PW - 1) / PW * PW, scale, S);      \
        break;
                        NQ_CASES(X)
#undef X
                    }
                    for (int v = 0; v < NQ; v++) { /* row r sees keys 0 .. first + r */
                        const int64_t n = first + r0 + v / group + 1;
                        softmax(S + v * cp, n);
                        for (int64_t t = n; t < nk; t++) S[v * cp + t] = 0.f;
                    }
                    switch (NQ) {
#define X(n)                                                                                \
    case n:                                                                                 \
        weigh_block(n, S, cp, nk, d, vc + h * d, kv, bs, table, ov);                        \
        break;
                        NQ_CASES(X)
#undef X
                    }
                }
            }
            free(S);
        }
        free(kt);
        return failed ? -1 : 0;
    }
#endif
#pragma omp parallel num_threads(nt) if (nt > 1 && T * ctx * kv >= 65536)
    {
        float *S = scratch(group * ctx, &failed);
        if (S != NULL) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < T * KVH; u++) {
                const int64_t r = T - 1 - u / KVH, h = u % KVH;
                attend(q + r * q_stride + h * group * d, group, d, kc + h * d, vc + h * d, kv,
                       bs, table, first + r + 1, scale, out + (r * H + h * group) * d, S, NULL, 0);
            }
        }
        free(S);
    }
    return failed ? -1 : 0;
}

/* out[t, j] = silu(gu[t, j]) * gu[t, ffn + j]; gu [T, 2 ffn], out [T, ffn]. */
void to_silu_mul(const float *gu, int64_t T, int64_t ffn, float *out, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && T * ffn >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * ffn, *u = g + ffn;
        float *o = out + t * ffn;
        int64_t j = 0;
#ifdef __AVX512F__
        for (; j + 16 <= ffn; j += 16)
            _mm512_storeu_ps(o + j, silu_mul_w(_mm512_loadu_ps(g + j), _mm512_loadu_ps(u + j)));
#endif
#ifdef __AVX2__
        for (; j + 8 <= ffn; j += 8)
            _mm256_storeu_ps(o + j, silu_mul_v(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
#endif
        for (; j < ffn; j++) o[j] = silu_mul_s(g[j], u[j]);
    }
}

double to_rms_scale(const float *x, int64_t n, double eps) {
    double ss = (double)dot(x, x, n);
    return 1.0 / sqrt(ss / (double)n + eps);
}

/* out[t] = x[t] / RMS(x[t]) for each of T rows of n (RMSNorm; its weight is folded). */
void to_rms_rows(const float *x, int64_t T, int64_t n, float eps, float *out, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && T * n >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * n;
        float scale = 1.f / sqrtf(dot(r, r, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) out[t * n + i] = r[i] * scale;
    }
}

/* ------------------------------------------------------------------ LoRA updates */
/* One adapter's low-rank update of one projection of one layer (tandem.engines.native.
 * adapters): a [r, in] (the RMSNorm weight folded into its columns where the projection's
 * input is normalized), b^T [r, out] (lora_alpha / rank folded in); a == NULL: none. */
struct to_lora {
    const float *a, *b;
    int64_t r;
};
#define TO_LORA_MAX_RANK 256 /* the sum of the ranks fused into one projection (3 x 64) */

/* y[t] += (s_t x[t] a^T) b^T for each row t whose slot (row_slot[t] >= 0) has an update of
 * projection p of layer l (slot_w[slot][4 l + p]); s_t = 1 / RMS(x[t]) when eps >= 0 (the
 * RMSNorm the quantized GEMM applies inside), else 1. Each row alone, in the same order
 * whatever the batch (a row's result does not depend on its neighbours): x a^T as one dot
 * product a rank (each a row of a), then 32 outputs at a time summed over the ranks in
 * registers (constant-length loops the compiler vectorizes in every build). */
static void lora_rows(const int32_t *row_slot, const struct to_lora *const *slot_w, int64_t l,
                      int p, const float *x, int64_t ldx, int64_t in, float eps, float *y,
                      int64_t ldy, int64_t out, int64_t T, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && T >= 4)
    for (int64_t t = 0; t < T; t++) {
        if (row_slot[t] < 0) continue;
        const struct to_lora *w = slot_w[row_slot[t]] + 4 * l + p;
        if (!w->a) continue;
        const int64_t R = w->r;
        const float *restrict xr = x + t * ldx, *restrict a = w->a, *restrict b = w->b;
        float *restrict yr = y + t * ldy;
        float u[TO_LORA_MAX_RANK];
        const float s = eps >= 0.f ? 1.f / sqrtf(dot(xr, xr, in) / (float)in + eps) : 1.f;
        for (int64_t r = 0; r < R; r++) u[r] = s * dot(xr, a + r * in, in);
        int64_t j = 0;
        for (; j + 32 <= out; j += 32) { /* 32 outputs in registers across the ranks */
            float acc[32];
            for (int c = 0; c < 32; c++) acc[c] = yr[j + c];
            for (int64_t r = 0; r < R; r++) {
                const float ur = u[r];
                const float *restrict br = b + r * out + j;
                for (int c = 0; c < 32; c++) acc[c] += ur * br[c];
            }
            for (int c = 0; c < 32; c++) yr[j + c] = acc[c];
        }
        for (; j < out; j++) {
            float acc = yr[j];
            for (int64_t r = 0; r < R; r++) acc += u[r] * b[r * out + j];
            yr[j] = acc;
        }
    }
}

/* to_lora_add: lora_rows over T rows for a caller outside the decoder (tests). */
int to_lora_add(const int32_t *row_slot, const struct to_lora *const *slot_w, int64_t l, int p,
                const float *x, int64_t in, float eps, float *y, int64_t out, int64_t T, int nt) {
    for (int64_t t = 0; t < T; t++) {
        if (row_slot[t] < 0) continue;
        const struct to_lora *w = slot_w[row_slot[t]] + 4 * l + p;
        if (w->a && (w->r <= 0 || w->r > TO_LORA_MAX_RANK)) return -1;
    }
    lora_rows(row_slot, slot_w, l, p, x, in, in, eps, y, out, out, T, nt);
    return 0;
}

/* f[t] = silu(gate) * up of g[t] [2 ffn] in the glu layout (per 32 columns 16 gate then
 * their 16 up columns, tandem.engines.native.quant.glu_rows): the same arithmetic as the
 * quantized kernel's own glu store (kernels/quant.c glu_store), so a row gets the same
 * values whether its gate/up projection took a LoRA update through here or not. */
static void glu_rows_act(const float *g, int64_t T, int64_t ffn, float *f, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && T * ffn >= 65536)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t c = 0; c < ffn; c += 16) {
            const float *a = g + t * 2 * ffn + 2 * c;
            float *o = f + t * ffn + c;
#if defined(__AVX512F__)
            _mm512_storeu_ps(o, silu_mul_w(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16)));
#elif defined(__AVX2__)
            for (int v = 0; v < 2; v++)
                _mm256_storeu_ps(o + 8 * v, silu_mul_v(_mm256_loadu_ps(a + 8 * v),
                                                       _mm256_loadu_ps(a + 16 + 8 * v)));
#else
            for (int j = 0; j < 16; j++) o[j] = silu_mul_s(a[j], a[16 + j]);
#endif
        }
    }
}

/* to_glu_act: glu_rows_act for a caller outside the decoder (the layer-by-layer path). */
void to_glu_act(const float *g, int64_t T, int64_t ffn, float *f, int nt) {
    glu_rows_act(g, T, ffn, f, nt);
}

/* Does any row's slot adapt projection p of layer l? */
static int lora_any(const int32_t *row_slot, const struct to_lora *const *slot_w, int64_t l,
                    int p, int64_t T) {
    if (!row_slot) return 0;
    for (int64_t t = 0; t < T; t++)
        if (row_slot[t] >= 0 && slot_w[row_slot[t]][4 * l + p].a) return 1;
    return 0;
}

/* ------------------------------------------------------------------ the whole decoder */
/* A quantized projection as tandem.engines.native.quant passes it to tq_gemm_q4 / _q8
 * (the function is quant's: this library only calls it through the pointer). */
typedef int (*to_gemm_fn)(const float *x, int64_t M, int64_t K, float alpha, const float *cs,
                          const void *pq, const float *pd, const float *pm, int64_t N, float *y,
                          const float *res, int nt, float norm_eps, int glu);
struct to_linear {
    to_gemm_fn fn;
    int64_t n, k;
    const float *cs; /* the RMSNorm weight it applies (NULL: none) */
    const void *qs;
    const float *d, *m;
};
struct to_span { /* a prefill chunk: rows [start, end) of one sequence, ctx_len after them */
    int64_t start, end, ctx_len;
    const int64_t *blocks;
};

/* Every layer of a llama decoder over T rows, with the exact calls (and so the exact
 * arithmetic) tandem.engines.native.model's C path makes layer by layer from Python:
 *   qkv = qkv_proj(RMSNorm(x)); RoPE + K/V store; decode and prefill attention into attn;
 *   h = o_proj(attn) + x; f = silu(gate) * up of gate_up(RMSNorm(h)); x = down(f) + h.
 * lin [L][4]: qkv, o, gate_up (glu), down. x [T, hidden] is the input embedding and the
 * output; h, qkv, attn, f are scratch. LoRA (issue 32): row_slot [T] (NULL: no adapter in
 * the step) is each row's adapter slot (-1: the base), slot_w[slot] that adapter's [L][4]
 * updates (rank <= TO_LORA_MAX_RANK, checked by the caller), each added after its
 * projection's GEMM (lora_rows); a layer whose gate/up some row adapts runs that GEMM without
 * its glu store into g [T, 2 ffn] (scratch; NULL: no adapter adapts gate/up), adds the
 * update there and takes silu * up after (glu_rows_act). The cache: layer l's K plane at
 * cache + l * layer, its V plane plane elements further. 0, or -(4 l + op + 1) for the op that failed. */
int to_decoder(int64_t L, const struct to_linear *lin, float *x, float *h, float *qkv,
               float *attn, float *f, int64_t T, int64_t H, int64_t KVH, int64_t d, float eps,
               float scale, const int64_t *pos, const float *cos_t, const float *sin_t,
               const int64_t *slots, kv_t *cache, int64_t layer, int64_t plane, int64_t bs,
               int64_t nd, const int64_t *tables, int64_t W, const int64_t *lens,
               int64_t nspans, const struct to_span *spans, const int32_t *row_slot,
               const struct to_lora *const *slot_w, float *g, int nt) {
    const int64_t stride = (H + 2 * KVH) * d, hidden = lin[0].k;
    for (int64_t l = 0; l < L; l++) {
        const struct to_linear *w = lin + 4 * l;
        kv_t *kc = cache + l * layer, *vc = kc + plane;
        const int64_t fail = -(4 * l + 1);
        if (w[0].fn(x, T, hidden, 1.f, w[0].cs, w[0].qs, w[0].d, w[0].m, w[0].n, qkv, NULL, nt, eps, 0))
            return (int)fail;
        if (row_slot)
            lora_rows(row_slot, slot_w, l, 0, x, hidden, hidden, eps, qkv, stride, stride, T, nt);
        to_rope_store(qkv, T, stride, H, KVH, d, pos, cos_t, sin_t, slots, kc, vc, nt);
        if (nd && to_decode_attention(qkv, stride, nd, H, KVH, d, kc, vc, bs, tables, W, lens,
                                      scale, attn, nt))
            return (int)(fail - 1);
        for (int64_t s = 0; s < nspans; s++) {
            const struct to_span *p = spans + s;
            if (to_prefill_attention(qkv + p->start * stride, stride, p->end - p->start, H, KVH, d,
                                     kc, vc, bs, p->blocks, p->ctx_len, scale,
                                     attn + p->start * H * d, nt))
                return (int)(fail - 1);
        }
        if (w[1].fn(attn, T, H * d, 1.f, w[1].cs, w[1].qs, w[1].d, w[1].m, w[1].n, h, x, nt, -1.f, 0))
            return (int)(fail - 2);
        if (row_slot)
            lora_rows(row_slot, slot_w, l, 1, attn, H * d, H * d, -1.f, h, hidden, hidden, T, nt);
        if (g && lora_any(row_slot, slot_w, l, 2, T)) { /* the update goes before silu * up */
            if (w[2].fn(h, T, hidden, 1.f, w[2].cs, w[2].qs, w[2].d, w[2].m, w[2].n, g, NULL, nt, eps, 0))
                return (int)(fail - 2);
            lora_rows(row_slot, slot_w, l, 2, h, hidden, hidden, eps, g, w[2].n, w[2].n, T, nt);
            glu_rows_act(g, T, w[2].n / 2, f, nt);
        } else if (w[2].fn(h, T, hidden, 1.f, w[2].cs, w[2].qs, w[2].d, w[2].m, w[2].n, f, NULL, nt,
                           eps, 1))
            return (int)(fail - 2);
        if (w[3].fn(f, T, w[3].k, 1.f, w[3].cs, w[3].qs, w[3].d, w[3].m, w[3].n, x, h, nt, -1.f, 0))
            return (int)(fail - 3);
        if (row_slot)
            lora_rows(row_slot, slot_w, l, 3, f, w[3].k, w[3].k, -1.f, x, hidden, hidden, T, nt);
    }
    return 0;
}

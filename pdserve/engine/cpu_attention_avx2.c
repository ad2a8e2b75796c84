/* Paged attention for CPUs with AVX2 and FMA (no AVX-512), bfloat16 K/V pool: the same entry
 * point and contract as cpu_paged_attention.c (pd_paged_attention_ex), one query at a time.
 *
 * Decode: each sequence's new K/V row is stored at its slot, then its query heads attend over
 * its slots, read straight from the pool. Prefill (write_slots NULL): the caller stored every
 * new row; each new token is a query over its sequence's first seq_lens[b] slots. There is no
 * tiled path here: tile_min and tile_flags are accepted and ignored (calibration measures this
 * kernel against torch's attention per KV length and picks).
 * Numerics as HF's eager bf16 attention and the AVX-512 kernel's per-query path: q.k summed in
 * float32 and rounded to bf16, scaled and softmaxed in float32, probabilities rounded to bf16,
 * p.v summed in float32, output rounded to bf16 (round to nearest even); the order of the
 * float32 sums differs, so results agree with that kernel's within bf16 rounding, not bitwise.
 * Work items are (query, KV heads) pairs over OpenMP threads, as there.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

#define MAX_GROUP 16
#define KB 8  /* keys per score block */

static inline __m256 load8(const bf16 *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* round each float32 lane to bf16 (nearest even, NaN quiet) and back to float32 */
static inline __m256 round8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_set1_ps(__builtin_nanf("")), nan);
}

static inline void store8_bf16(bf16 *dst, __m256 v) {
    __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round8(v)), 16);
    __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extractf128_si256(r, 1));
    _mm_storeu_si128((__m128i *)dst, p);
}

/* lane i = the sum of v[i]'s 8 lanes */
static inline __m256 hsum8x8(const __m256 *v) {
    __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* exp on 8 floats: 2^n * p(r), |r| <= ln2/2, degree-6 polynomial (rel. error ~2e-7) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* softmax of s[0..n) in place (s has room for n rounded up to 8), each p rounded to bf16 */
static void softmax_bf16(float *s, int64_t n) {
    int64_t n8 = (n + 7) & ~(int64_t)7;
    for (int64_t t = n; t < n8; t++) s[t] = -__builtin_inff();
    __m256 mv = _mm256_set1_ps(-__builtin_inff());
    for (int64_t t = 0; t < n8; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    __m256 mb = _mm256_set1_ps(hmax8(mv)), sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n8; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mb));
        if (t + 8 > n)  /* the padding (-inf): exactly 0 */
            e = _mm256_and_ps(e, _mm256_cmp_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(-__builtin_inff()),
                                               _CMP_NEQ_OQ));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    __m256 inv = _mm256_set1_ps(1.0f / hsum8(sum));
    for (int64_t t = 0; t < n8; t += 8)
        _mm256_storeu_ps(s + t, round8(_mm256_mul_ps(_mm256_loadu_ps(s + t), inv)));
}

/* One query (its heads of KV heads [j0, j1)) over len slots. s: scratch of (G * (len + 8))
 * floats plus G * D + KB * D for q and K rows in float32. */
static inline __attribute__((always_inline)) void attend(
        const bf16 *q, const bf16 *knew, const bf16 *vnew, bf16 *kpool, bf16 *vpool,
        const int64_t *slots, int64_t len, int64_t write_slot, bf16 *out, int G, int Hkv,
        const int D, int j0, int j1, float scale, float *s) {
    const int C = D / 8;
    const int64_t row = (len + 7) & ~(int64_t)7;
    float *qf = s + (int64_t)G * row, *kf = qf + G * D;
    if (write_slot >= 0) {  /* < 0: the caller stored it (prefill: all rows before any reads) */
        memcpy(kpool + (write_slot * Hkv + j0) * D, knew + (int64_t)j0 * D, (size_t)(j1 - j0) * D * 2);
        memcpy(vpool + (write_slot * Hkv + j0) * D, vnew + (int64_t)j0 * D, (size_t)(j1 - j0) * D * 2);
    }
    for (int j = j0; j < j1; j++) {
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++)
                _mm256_storeu_ps(qf + g * D + c * 8, load8(q + (int64_t)(j * G + g) * D + c * 8));
        for (int64_t t0 = 0; t0 < len; t0 += KB) {
            int n = len - t0 < KB ? (int)(len - t0) : KB;
            for (int i = 0; i < KB; i++) {  /* rows past n repeat the last; their scores are unused */
                const bf16 *k = kpool + (slots[t0 + (i < n ? i : n - 1)] * Hkv + j) * D;
                for (int c = 0; c < C; c++) _mm256_storeu_ps(kf + i * D + c * 8, load8(k + c * 8));
            }
            for (int g = 0; g < G; g++) {
                __m256 acc[KB];
                for (int i = 0; i < KB; i++) acc[i] = _mm256_setzero_ps();
                for (int c = 0; c < C; c++) {
                    __m256 qc = _mm256_loadu_ps(qf + g * D + c * 8);
                    for (int i = 0; i < KB; i++)
                        acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kf + i * D + c * 8), acc[i]);
                }
                /* q.k rounds to bf16, as in HF, then the scale */
                __m256 sc = _mm256_mul_ps(round8(hsum8x8(acc)), _mm256_set1_ps(scale));
                _mm256_storeu_ps(s + g * row + t0, sc);
            }
        }
        for (int g = 0; g < G; g++) softmax_bf16(s + g * row, len);
        for (int g = 0; g < G; g++) {
            const float *p = s + g * row;
            for (int c0 = 0; c0 < C; c0 += 8) {  /* 64 dims at a time stay in registers */
                int cn = C - c0 < 8 ? C - c0 : 8;
                __m256 o[8];
                for (int c = 0; c < cn; c++) o[c] = _mm256_setzero_ps();
                for (int64_t t = 0; t < len; t++) {
                    const bf16 *v = vpool + (slots[t] * Hkv + j) * D + c0 * 8;
                    __m256 pt = _mm256_set1_ps(p[t]);
                    for (int c = 0; c < cn; c++) o[c] = _mm256_fmadd_ps(pt, load8(v + c * 8), o[c]);
                }
                for (int c = 0; c < cn; c++)
                    store8_bf16(out + (int64_t)(j * G + g) * D + (c0 + c) * 8, o[c]);
            }
        }
    }
}

#define ATTEND_ARGS const bf16 *q, const bf16 *knew, const bf16 *vnew, bf16 *kpool, bf16 *vpool, \
    const int64_t *slots, int64_t len, int64_t write_slot, bf16 *out, int G, int Hkv, int j0, \
    int j1, float scale, float *s
#define ATTEND_PASS q, knew, vnew, kpool, vpool, slots, len, write_slot, out, G, Hkv
static void attend_32(ATTEND_ARGS) { attend(ATTEND_PASS, 32, j0, j1, scale, s); }
static void attend_64(ATTEND_ARGS) { attend(ATTEND_PASS, 64, j0, j1, scale, s); }
static void attend_128(ATTEND_ARGS) { attend(ATTEND_PASS, 128, j0, j1, scale, s); }

/* q [B, Hq, D] (row stride q_stride), k_new/v_new [B, Hkv, D] (strides), pools [slots, Hkv, D];
 * write_slots [B] or NULL; table [rows][table_stride] slots; table_rows [B] or NULL (row b);
 * seq_lens [B]: keys each query reads; out [B, Hq * D]. 0 on success, -1 bad shape, -2 no memory. */
int pd_paged_attention_ex(const bf16 *q, int64_t q_stride, const bf16 *k_new, int64_t k_stride,
                          const bf16 *v_new, int64_t v_stride, bf16 *k_pool, bf16 *v_pool,
                          const int64_t *write_slots, const int64_t *table, int64_t table_stride,
                          const int64_t *table_rows, const int64_t *seq_lens, bf16 *out, int64_t B,
                          int Hq, int Hkv, int D, float scale, int num_threads, int tile_min,
                          int tile_flags) {
    (void)tile_min;
    (void)tile_flags;
    void (*attend_d)(ATTEND_ARGS) = D == 32 ? attend_32 : D == 64 ? attend_64 : D == 128 ? attend_128 : 0;
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_GROUP || !attend_d) return -1;
    if (B <= 0) return 0;
    const int G = Hq / Hkv;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* few queries (one stream): split each by KV head so every thread has work */
    const int S = B >= 4 * (int64_t)num_threads ? 1 : Hkv;
    const int64_t n_items = B * S;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);  /* flush-to-zero, denormals-are-zero: tiny p make denormals */
        size_t words = (size_t)G * (size_t)((max_len + 7) & ~(int64_t)7) + (size_t)(G + KB) * (size_t)D;
        float *s = malloc(sizeof(float) * words);
        if (!s) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < n_items; w++) {
            if (!s) continue;
            int64_t b = w / S;
            int part = (int)(w % S);
            const int64_t *row = table + (table_rows ? table_rows[b] : b) * table_stride;
            attend_d(q + b * q_stride, k_new + b * k_stride, v_new + b * v_stride, k_pool, v_pool,
                     row, seq_lens[b], write_slots ? write_slots[b] : -1, out + b * (int64_t)Hq * D,
                     G, Hkv, part * Hkv / S, (part + 1) * Hkv / S, scale, s);
        }
        free(s);
        _mm_setcsr(csr);
    }
    return failed ? -2 : 0;
}

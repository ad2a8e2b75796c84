/* Paged attention for CPUs with AVX-512 BF16, bfloat16 K/V pool.
 *
 * One call does one layer of a step. Decode: each sequence's new K/V row is stored at its
 * slot, then its query heads attend over its slots, read straight from the pool (no gather
 * copy, no padding). Prefill: the caller stores every new K/V row first, then each new token
 * is a query over its sequence's first position + 1 slots (causal, with or without a cached
 * prefix); queries of one sequence read the same rows, which stay in cache.
 * Numerics follow HF's eager bf16 attention: q.k summed in float32 and rounded to bf16,
 * scaled and softmaxed in float32, probabilities rounded to bf16, p.v summed in float32,
 * output rounded to bf16 (round to nearest even throughout).
 *
 * Work items are sequences (or, with few sequences, their KV heads), spread over OpenMP
 * threads; the library is loaded after torch, so it shares torch's libgomp thread pool.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

#define MAX_GROUP 16   /* query heads per KV head */
#define MAX_CHUNKS 4   /* head_dim / 32: head_dim 32, 64 or 128 */

static inline float bf16_to_f32(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float round_bf16(float f) {
    __m128 v = _mm_set_ss(f);
    __m128bh h = _mm_cvtneps_pbh(v);
    uint16_t r;
    memcpy(&r, &h, 2);
    return bf16_to_f32(r);
}

/* exp on 16 floats: 2^n * p(r), |r| <= ln2/2, degree-6 polynomial (rel. error ~2e-7). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 load_bf16x16(const bf16 *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Softmax of s[0..n) in place, then each probability rounded to bf16. */
static void softmax_bf16(float *s, int64_t n) {
    __m512 mv = _mm512_set1_ps(-__builtin_inff());
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t));
    float m = _mm512_reduce_max_ps(mv);
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    __m512 mb = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
    for (t = 0; t < n; t += 16) {
        __mmask16 k = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), mb));
        e = _mm512_maskz_mov_ps(k, e);
        _mm512_mask_storeu_ps(s + t, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (t = 0; t < n; t += 16) {
        __mmask16 k = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + t), inv);
        __m256bh h = _mm512_cvtneps_pbh(p);  /* round to bf16 and back */
        __m512 r = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32((__m256i)h), 16));
        _mm512_mask_storeu_ps(s + t, k, r);
    }
}

/* 16 vectors -> one vector of their 16 horizontal sums (lane i = sum of v[i]). */
static inline __m512 sum16(const __m512 *v) {
    __m512 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                         _mm512_shuffle_f32x4(z[0], z[1], 0xdd));
}

static inline void prefetch_rows(const bf16 *pool, const int64_t *slots, int64_t from, int64_t to,
                                 int Hkv, int D, int j0, int j1) {
    for (int64_t t = from; t < to; t++) {
        const char *p = (const char *)(pool + (slots[t] * Hkv + j0) * D);
        for (int c = 0; c < (j1 - j0) * D * 2; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
    }
}

/* Prefetch distance in tokens (one block): K two blocks ahead, V one (it is read later). */
#define PF 16

/* Query heads whose p.v sums share one pass over V (their accumulators stay in registers). */
#define PV_HEADS(D) ((D) == 32 ? 4 : (D) == 64 ? 3 : 2)

/* One sequence, KV heads [j0, j1): store its new K/V, then attend with their query heads.
 * s: scratch for (j1 - j0) * G rows of len + 16 scores, then one zero row. D is a constant
 * in each caller (see attend_any), so every per-row loop below is unrolled into registers. */
static inline __attribute__((always_inline)) void attend(
        const bf16 *q, const bf16 *knew, const bf16 *vnew, bf16 *kpool, bf16 *vpool,
        const int64_t *slots, int64_t len, int64_t write_slot, bf16 *out, int G, int Hkv,
        const int D, int j0, int j1, float scale, float *s) {
    const int C = D / 32, VC = D / 16, NG = PV_HEADS(D), H = (j1 - j0) * G;
    const int64_t row = len + 16;
    if (write_slot >= 0) {  /* < 0: the caller stored it (prefill: all rows before any reads) */
        memcpy(kpool + (write_slot * Hkv + j0) * D, knew + (int64_t)j0 * D, (size_t)(j1 - j0) * D * 2);
        memcpy(vpool + (write_slot * Hkv + j0) * D, vnew + (int64_t)j0 * D, (size_t)(j1 - j0) * D * 2);
    }
    prefetch_rows(kpool, slots, 0, len < 2 * PF ? len : 2 * PF, Hkv, D, j0, j1);
    prefetch_rows(vpool, slots, 0, len < PF ? len : PF, Hkv, D, j0, j1);

    /* scores, 16 tokens at a time; the pool is far bigger than cache, so rows of the next
     * block (K, and V for the second pass) are fetched while this one is computed */
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        int64_t n = len - t0 < 16 ? len - t0 : 16;
        if (t0 + 2 * PF < len)
            prefetch_rows(kpool, slots, t0 + 2 * PF, t0 + 3 * PF < len ? t0 + 3 * PF : len, Hkv, D, j0, j1);
        if (t0 + PF < len)
            prefetch_rows(vpool, slots, t0 + PF, t0 + 2 * PF < len ? t0 + 2 * PF : len, Hkv, D, j0, j1);
        const bf16 *krow[16];
        for (int tt = 0; tt < 16; tt++) krow[tt] = kpool + (slots[t0 + (tt < n ? tt : 0)] * Hkv) * D;
        for (int h = 0; h < H; h++) {
            int j = j0 + h / G;
            __m512bh qv[MAX_CHUNKS];
            for (int c = 0; c < C; c++)
                qv[c] = (__m512bh)_mm512_loadu_si512(q + (int64_t)(j * G + h % G) * D + c * 32);
            __m512 acc[16];
            for (int tt = 0; tt < 16; tt++) {  /* rows past n repeat row 0; their scores are unused */
                acc[tt] = _mm512_setzero_ps();
                for (int c = 0; c < C; c++)
                    acc[tt] = _mm512_dpbf16_ps(acc[tt], qv[c],
                                               (__m512bh)_mm512_loadu_si512(krow[tt] + j * D + c * 32));
            }
            __m256bh r = _mm512_cvtneps_pbh(sum16(acc));  /* q.k rounds to bf16, as in HF */
            __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)r), 16));
            _mm512_storeu_ps(s + h * row + t0, _mm512_mul_ps(sc, _mm512_set1_ps(scale)));
        }
    }
    for (int h = 0; h < H; h++) softmax_bf16(s + h * row, len);

    const float *zero = s + (int64_t)H * row;
    memset((float *)zero, 0, sizeof(float) * (size_t)len);
    for (int j = j0; j < j1; j++) {
        for (int g0 = 0; g0 < G; g0 += NG) {  /* NG heads at a time; missing ones read zeros */
            const float *p[4];
            for (int g = 0; g < NG; g++)
                p[g] = g0 + g < G ? s + ((int64_t)(j - j0) * G + g0 + g) * row : zero;
            __m512 o[4][MAX_CHUNKS * 2];
            for (int g = 0; g < NG; g++)
                for (int c = 0; c < VC; c++) o[g][c] = _mm512_setzero_ps();
            for (int64_t t = 0; t < len; t++) {
                const bf16 *v = vpool + (slots[t] * Hkv + j) * D;
                for (int c = 0; c < VC; c++) {
                    __m512 vc = load_bf16x16(v + c * 16);
                    for (int g = 0; g < NG; g++)
                        o[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][t]), vc, o[g][c]);
                }
            }
            for (int g = 0; g < NG && g0 + g < G; g++)
                for (int c = 0; c < VC; c++)
                    _mm256_storeu_si256((__m256i *)(out + (int64_t)(j * G + g0 + g) * D + c * 16),
                                        (__m256i)_mm512_cvtneps_pbh(o[g][c]));
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

/* q [B, Hq, D] (row stride q_stride), k_new/v_new [B, Hkv, D] (row strides), all bf16 with
 * heads contiguous; k_pool/v_pool: the layer's [slots, Hkv, D]; write_slots [B] (NULL: none);
 * table [rows, table_stride] slots in order, query b reading row table_rows[b] (NULL: row b);
 * seq_lens [B]: keys query b attends to (its own included); out [B, Hq*D].
 * A prefill chunk is B queries of a few rows: each attends to its row's first seq_lens[b]
 * slots (causal), with every new K/V stored beforehand.
 * Returns 0, or -1 if the shape is outside what this kernel handles. */
int pd_paged_attention(const bf16 *q, int64_t q_stride, const bf16 *k_new, int64_t k_stride,
                        const bf16 *v_new, int64_t v_stride, bf16 *k_pool, bf16 *v_pool,
                        const int64_t *write_slots, const int64_t *table, int64_t table_stride,
                        const int64_t *table_rows, const int64_t *seq_lens, bf16 *out, int64_t B,
                        int Hq, int Hkv, int D, float scale, int num_threads) {
    void (*attend_d)(ATTEND_ARGS) = D == 32 ? attend_32 : D == 64 ? attend_64 : D == 128 ? attend_128 : 0;
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_GROUP || !attend_d) return -1;
    const int G = Hq / Hkv;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* few sequences (one stream): split each by KV head so every thread has work; many: whole
     * sequences, so each reads its K/V rows end to end */
    const int S = B >= 4 * (int64_t)num_threads ? 1 : Hkv;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        /* tiny probabilities would make denormal products, which cost microcode assists */
        unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);  /* flush-to-zero, denormals-are-zero */
        float *s = malloc(sizeof(float) * (size_t)(Hq + 1) * (size_t)(max_len + 16));
        if (!s) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < B * S; w++) {
            if (!s) continue;
            int64_t b = w / S;
            int part = (int)(w % S);
            int j0 = part * Hkv / S, j1 = (part + 1) * Hkv / S;
            attend_d(q + b * q_stride, k_new + b * k_stride, v_new + b * v_stride, k_pool, v_pool,
                     table + (table_rows ? table_rows[b] : b) * table_stride, seq_lens[b],
                     write_slots ? write_slots[b] : -1, out + b * (int64_t)Hq * D, G, Hkv, j0, j1,
                     scale, s);
        }
        free(s);
        _mm_setcsr(csr);
    }
    return failed ? -2 : 0;
}

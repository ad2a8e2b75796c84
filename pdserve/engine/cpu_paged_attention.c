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
 * Long prefill chunks take a tiled path instead (query blocks x key blocks, see "Prefill
 * over long runs" below), where its cost model says it is faster.
 *
 * Work items are sequences (or, with few sequences, their KV heads) and tiled blocks, spread
 * over OpenMP threads; the library is loaded after torch, so it shares torch's libgomp pool.
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


/* ---- Prefill over long runs of one sequence: query blocks x key blocks ----
 *
 * A run is consecutive queries reading the same table row: one sequence's prefill chunk
 * (AttnBatch.build lays a chunk out so), its K/V stored beforehand, query b attending to the
 * row's first seq_lens[b] slots. It is cut into blocks of QT = 48 / G tokens; a work item is
 * one block with the G query heads of one KV head: R rows (token-major: row = token * G +
 * head; 48, or in a run's last block its rows rounded up to 16 with zero queries), one row
 * per vector lane. For each block of TK = 64 keys:
 *   scores S[key][row] = q.k, a K row's dim pair broadcast against 16 rows' q pairs (dpbf16),
 *     rounded to bf16 as in HF; keys at or past a row's count masked out (-inf);
 *   online softmax, lane-wise: running max m and sum l per row, p = exp((s - m) * scale)
 *     (one 2^x), O rescaled by exp((m_old - m) * scale) where m grew;
 *   p rounded to bf16, paired by key, P[key pair][row];
 *   O[row][:] += P . V, a row's p pair broadcast against V's key-paired vectors (dpbf16;
 *     V is paired once per call for all blocks, pack_v_pairs).
 * At the end O / l, rounded to bf16. Each K and V row is loaded once per block of R rows, not
 * once per query, and the block's scratch (q pairs, scores, P, O: 37 KB at R 48, D 64)
 * stays in L1/L2: ~75% of the dpbf16 peak (the per-query path is bound by re-reading K/V).
 * Rounding: p is rounded to bf16 before normalising (HF rounds p / l), so results differ
 * from HF's in the last bits; they stay within bf16 rounding of the float64 math (as close
 * as HF's). Two-pass mode (tile_flags & 1) computes each row's max and sum first, then the
 * scores again with the normalised p rounded to bf16, HF's rounding points, at 1.5x the
 * work. Blocks are independent: a query's result does not depend on the rest of the batch
 * or on which thread ran its block. */

#ifndef TK
#define TK 64        /* keys per block */
#endif
#define ROW_UNIT 48  /* rows per block (full blocks; fewer in a run's last): 3 vectors */

typedef struct {
    uint32_t *qp;    /* [D/2][R] q dim pairs of each row */
    float *s;        /* [TK][R] scores of one key block */
    uint32_t *pp;    /* [TK/2][R] bf16 probability pairs (keys 2i, 2i+1) */
    float *o;        /* [R][D] output accumulators */
    float *m, *l, *alpha, *bmax;  /* [R] */
    int32_t *cnt;    /* [R] keys each row attends to */
} tile_buf;

static const uint16_t PAIR_IDX[32] = {  /* words a0 b0 a1 b1 ... from [a0..a15 | b0..b15] */
    0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
/* with the even words zeroed: [a | b] (bf16) -> a as float32 (LO_IDX) or b (HI_IDX) */
static const uint16_t LO_IDX[32] = {
    0, 0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15};
static const uint16_t HI_IDX[32] = {
    0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0, 22, 0, 23,
    0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31};

/* 2^y for y <= 0: 2^n * p(f), |f| <= 1/2, degree-5 minimax p with p(0) = 1 exactly
 * (rel. error 1.7e-7); 0 below -150 (underflow). y must be finite (exp2z clamps -inf). */
static inline __m512 exp2f16(__m512 y) {
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.3264671433717012e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.671512991189957e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550733953714371e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022242426872253f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931470036506653f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* exp2f16, also exactly 0 at -inf (a masked score) */
static inline __m512 exp2z(__m512 y) {
    return exp2f16(_mm512_max_ps(y, _mm512_set1_ps(-200.0f)));
}

/* Scores of rows [rc, rc + 16 NC) (NC vectors) for the block's nn keys, 8 at a time. */
static inline __attribute__((always_inline)) void scores_rows(
        const tile_buf *w, const bf16 *const *krow, int nn, int R, const int D, int64_t k0,
        int masked, int rc, const int NC) {
    const int P = D / 2;
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
    const uint32_t *restrict qpairs = w->qp;
    float *restrict S = w->s;
    __m512 mx[3] = {ninf, ninf, ninf};
    __m512i cnt[3];
    for (int c = 0; c < NC; c++) cnt[c] = _mm512_loadu_si512(w->cnt + rc + 16 * c);
    for (int kc = 0; kc < nn; kc += 8) {
        const int32_t *kr[8];
        for (int i = 0; i < 8; i++) kr[i] = (const int32_t *)krow[kc + i];
        __m512 acc[8][3];
        for (int i = 0; i < 8; i++)
            for (int c = 0; c < NC; c++) acc[i][c] = _mm512_setzero_ps();
        for (int p = 0; p < P; p++) {
            const uint32_t *qp = qpairs + (int64_t)p * R + rc;
            __m512bh b[3];
            for (int c = 0; c < NC; c++) b[c] = (__m512bh)_mm512_loadu_si512(qp + 16 * c);
            for (int i = 0; i < 8; i++) {
                __m512bh a = (__m512bh)_mm512_set1_epi32(kr[i][p]);
                for (int c = 0; c < NC; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], b[c], a);
            }
        }
        const __m512i lo = _mm512_loadu_si512(LO_IDX), hi = _mm512_loadu_si512(HI_IDX);
        #pragma GCC unroll 8
        for (int i = 0; i < 8; i += 2) {
            __m512i key0 = _mm512_set1_epi32((int32_t)(k0 + kc + i)), key1 = _mm512_add_epi32(
                key0, _mm512_set1_epi32(1));
            for (int c = 0; c < NC; c++) {  /* q.k rounds to bf16, as in HF: two at a time */
                __m512i h = (__m512i)_mm512_cvtne2ps_pbh(acc[i + 1][c], acc[i][c]);
                __m512 s0 = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, lo, h));
                __m512 s1 = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, hi, h));
                if (masked) {
                    s0 = _mm512_mask_mov_ps(s0, _mm512_cmpge_epi32_mask(key0, cnt[c]), ninf);
                    s1 = _mm512_mask_mov_ps(s1, _mm512_cmpge_epi32_mask(key1, cnt[c]), ninf);
                }
                _mm512_storeu_ps(S + (int64_t)(kc + i) * R + rc + 16 * c, s0);
                _mm512_storeu_ps(S + (int64_t)(kc + i + 1) * R + rc + 16 * c, s1);
                mx[c] = _mm512_max_ps(mx[c], _mm512_max_ps(s0, s1));
            }
        }
    }
    for (int c = 0; c < NC; c++) _mm512_storeu_ps(w->bmax + rc + 16 * c, mx[c]);
}

/* S[k][rows] = q.k rounded to bf16 (unscaled: the softmax scales it), for the block's nn
 * keys (a multiple of 8) and R rows (a multiple of 16); its max per row into bmax. */
static inline __attribute__((always_inline)) void tile_scores(
        const tile_buf *w, const bf16 *const *krow, int nn, int R, const int D, int64_t k0,
        int masked) {
    int rc = 0;
    for (; rc + 48 <= R; rc += 48) scores_rows(w, krow, nn, R, D, k0, masked, rc, 3);
    if (R - rc == 32) scores_rows(w, krow, nn, R, D, k0, masked, rc, 2);
    if (R - rc == 16) scores_rows(w, krow, nn, R, D, k0, masked, rc, 1);
}

enum { TILE_ONLINE, TILE_STATS, TILE_NORMALISED };

/* From the block's scores: update each row's max and sum; unless TILE_STATS, the bf16
 * probability pairs into pp (online: exp((s - m) * scale); normalised: that over l, with the
 * final m and l) and each row's rescale factor into alpha. Returns whether any row's m grew.
 * exp(x * scale) = 2^(x * scale * log2 e): the scale folds into the exponent's one multiply. */
static inline __attribute__((always_inline)) int tile_softmax(
        const tile_buf *w, int nn, int R, int mode, float scale, const int masked) {
    const __m512i idx = _mm512_loadu_si512(PAIR_IDX);
    const __m512 one = _mm512_set1_ps(1.0f), c = _mm512_set1_ps(scale * 1.44269504088896341f);
    const float *restrict S = w->s;
    uint32_t *restrict pp = w->pp;
    int grew = 0;
    for (int rg = 0; rg < R; rg += 16) {
        __m512 mo = _mm512_loadu_ps(w->m + rg), mn = mo, mul = one, ls = _mm512_setzero_ps();
        if (mode == TILE_NORMALISED) {
            mul = _mm512_div_ps(one, _mm512_loadu_ps(w->l + rg));
        } else {
            mn = _mm512_max_ps(mo, _mm512_loadu_ps(w->bmax + rg));
            __m512 al = exp2z(_mm512_mul_ps(_mm512_sub_ps(mo, mn), c));
            grew |= _mm512_cmp_ps_mask(al, one, _CMP_NEQ_UQ) != 0;
            _mm512_storeu_ps(w->alpha + rg, al);
            _mm512_storeu_ps(w->m + rg, mn);
            ls = _mm512_mul_ps(_mm512_loadu_ps(w->l + rg), al);
        }
        const __m512 mc = _mm512_mul_ps(mn, c);  /* exponent (s - m) c = s c - m c */
        for (int kp = 0; kp < nn / 2; kp++) {
            __m512 y0 = _mm512_fmsub_ps(_mm512_loadu_ps(S + (int64_t)(2 * kp) * R + rg), c, mc);
            __m512 y1 = _mm512_fmsub_ps(_mm512_loadu_ps(S + (int64_t)(2 * kp + 1) * R + rg), c, mc);
            /* only a masked block has -inf scores: the others skip the clamp */
            __m512 p0 = masked ? exp2z(y0) : exp2f16(y0), p1 = masked ? exp2z(y1) : exp2f16(y1);
            if (mode == TILE_NORMALISED) {
                p0 = _mm512_mul_ps(p0, mul);
                p1 = _mm512_mul_ps(p1, mul);
            } else {
                ls = _mm512_add_ps(ls, _mm512_add_ps(p0, p1));
            }
            if (mode != TILE_STATS)
                _mm512_storeu_si512(pp + (int64_t)kp * R + rg, _mm512_permutexvar_epi16(
                    idx, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));  /* low half: p0 */
        }
        if (mode != TILE_NORMALISED) _mm512_storeu_ps(w->l + rg, ls);
    }
    return grew;
}

/* V rows [2 kp0, 2 kp1) of KV head j paired by key, dst[i][d] = (V[2i][d], V[2i+1][d])
 * (i from kp0); keys at or past hi (padding) repeat key 0: finite, their p is 0. */
static void pack_v_pairs(uint32_t *dst, const bf16 *vpool, const int64_t *slots, int64_t kp0,
                         int64_t kp1, int64_t hi, int Hkv, int D, int j) {
    const __m512i idx = _mm512_loadu_si512(PAIR_IDX);
    for (int64_t kp = kp0; kp < kp1; kp++) {
        const bf16 *a = vpool + (slots[2 * kp < hi ? 2 * kp : 0] * Hkv + j) * D;
        const bf16 *b = vpool + (slots[2 * kp + 1 < hi ? 2 * kp + 1 : 0] * Hkv + j) * D;
        for (int dv = 0; dv < D / 16; dv++) {
            __m512i x = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + 16 * dv))),
                _mm256_loadu_si256((const __m256i *)(b + 16 * dv)), 1);
            _mm512_storeu_si512(dst + (kp - kp0) * D + 16 * dv, _mm512_permutexvar_epi16(idx, x));
        }
    }
}

/* O[row][:] (rescaled by alpha where m grew) += P . V over the block's nn keys, V paired
 * by key in vp (from the block's first key); R rows a multiple of 16, RT = 256 / D at a
 * time (16 accumulators). */
static inline __attribute__((always_inline)) void tile_pv(
        const tile_buf *w, const uint32_t *vp, int nn, int R, const int D, int rescale) {
    enum { RT_MAX = 8 };
    const int DV = D / 16, RT = 256 / D;
    float *restrict O = w->o;
    const uint32_t *restrict pp = w->pp;
    for (int r0 = 0; r0 < R; r0 += RT) {
        __m512 acc[RT_MAX][MAX_CHUNKS * 2];
        for (int i = 0; i < RT; i++) {
            __m512 al = _mm512_set1_ps(rescale ? w->alpha[r0 + i] : 1.0f);
            for (int dv = 0; dv < DV; dv++) {
                acc[i][dv] = _mm512_loadu_ps(O + (int64_t)(r0 + i) * D + 16 * dv);
                if (rescale) acc[i][dv] = _mm512_mul_ps(acc[i][dv], al);
            }
        }
        for (int kp = 0; kp < nn / 2; kp++) {
            __m512bh vb[MAX_CHUNKS * 2];
            for (int dv = 0; dv < DV; dv++)
                vb[dv] = (__m512bh)_mm512_loadu_si512(vp + (int64_t)kp * D + 16 * dv);
            const int32_t *pr = (const int32_t *)pp + (int64_t)kp * R + r0;
            for (int i = 0; i < RT; i++) {
                __m512bh a = (__m512bh)_mm512_set1_epi32(pr[i]);
                for (int dv = 0; dv < DV; dv++) acc[i][dv] = _mm512_dpbf16_ps(acc[i][dv], vb[dv], a);
            }
        }
        for (int i = 0; i < RT; i++)
            for (int dv = 0; dv < DV; dv++)
                _mm512_storeu_ps(O + (int64_t)(r0 + i) * D + 16 * dv, acc[i][dv]);
    }
}

static inline void prefetch_block(const bf16 *pool, const int64_t *slots, int64_t from, int64_t to,
                                  int Hkv, int D, int j) {
    for (int64_t t = from; t < to; t++) {
        const char *p = (const char *)(pool + (slots[t] * Hkv + j) * D);
        for (int c = 0; c < D * 2; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
    }
}

/* One work item: queries [0, nt) of a run (q, lens, out already offset to its first query),
 * with the query heads of KV head j, over the run's table row slots; vpk: that head's V
 * rows of the run paired by key (pack_v_pairs). */
static inline __attribute__((always_inline)) void attend_block(
        const bf16 *q, int64_t q_stride, const bf16 *kpool, const uint32_t *vpk,
        const int64_t *slots, const int64_t *lens, int nt, bf16 *out, int G, int Hkv, const int D,
        int j, float scale, int two_pass, const tile_buf *w) {
    const int P = D / 2, Hq = G * Hkv, R = (nt * G + 15) & ~15;  /* rows, in whole vectors */
    int64_t lo = INT64_MAX, hi = 0;
    for (int r = 0; r < R; r++) {
        int tt = r / G, g = r % G;
        uint32_t *dst = w->qp + r;
        if (tt < nt) {
            const uint32_t *src = (const uint32_t *)(q + tt * q_stride + (int64_t)(j * G + g) * D);
            for (int p = 0; p < P; p++) dst[(int64_t)p * R] = src[p];
            w->cnt[r] = (int32_t)lens[tt];
            lo = lens[tt] < lo ? lens[tt] : lo;
            hi = lens[tt] > hi ? lens[tt] : hi;
        } else {  /* padding: a zero query over key 0 onwards, finite and discarded */
            for (int p = 0; p < P; p++) dst[(int64_t)p * R] = 0;
            w->cnt[r] = 1;
        }
        w->m[r] = -1e30f;
        w->l[r] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * (size_t)R * D);
    const bf16 *krow[TK];
    for (int pass = 0; pass < (two_pass ? 2 : 1); pass++) {
        int mode = !two_pass ? TILE_ONLINE : pass == 0 ? TILE_STATS : TILE_NORMALISED;
        prefetch_block(kpool, slots, 0, hi < TK ? hi : TK, Hkv, D, j);
        for (int64_t k0 = 0; k0 < hi; k0 += TK) {
            int n = hi - k0 < TK ? (int)(hi - k0) : TK, nn = (n + 7) & ~7;
            for (int i = 0; i < nn; i++)  /* keys past n repeat key k0: finite, masked out */
                krow[i] = kpool + (slots[k0 + (i < n ? i : 0)] * Hkv + j) * D;
            if (k0 + TK < hi)
                prefetch_block(kpool, slots, k0 + TK, k0 + 2 * TK < hi ? k0 + 2 * TK : hi, Hkv, D, j);
            int masked = k0 + nn > lo;
            tile_scores(w, krow, nn, R, D, k0, masked);
            int grew = masked ? tile_softmax(w, nn, R, mode, scale, 1)
                              : tile_softmax(w, nn, R, mode, scale, 0);
            if (mode == TILE_STATS) continue;
            tile_pv(w, vpk + k0 / 2 * D, nn, R, D, mode == TILE_ONLINE && grew);
        }
    }
    for (int r = 0; r < nt * G; r++) {
        int tt = r / G, g = r % G;
        __m512 inv = _mm512_set1_ps(two_pass ? 1.0f : 1.0f / w->l[r]);
        bf16 *o = out + (int64_t)tt * Hq * D + (int64_t)(j * G + g) * D;
        for (int dv = 0; dv < D / 16; dv++)
            _mm256_storeu_si256((__m256i *)(o + 16 * dv), (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(_mm512_loadu_ps(w->o + (int64_t)r * D + 16 * dv), inv)));
    }
}

#define BLOCK_ARGS const bf16 *q, int64_t q_stride, const bf16 *kpool, const uint32_t *vpk, \
    const int64_t *slots, const int64_t *lens, int nt, bf16 *out, int G, int Hkv, int j, \
    float scale, int two_pass, const tile_buf *w
#define BLOCK_PASS q, q_stride, kpool, vpk, slots, lens, nt, out, G, Hkv
static void block_32(BLOCK_ARGS) { attend_block(BLOCK_PASS, 32, j, scale, two_pass, w); }
static void block_64(BLOCK_ARGS) { attend_block(BLOCK_PASS, 64, j, scale, two_pass, w); }
static void block_128(BLOCK_ARGS) { attend_block(BLOCK_PASS, 128, j, scale, two_pass, w); }

static int tile_buf_alloc(tile_buf *w, int R, int D) {
    size_t sizes[] = {sizeof(uint32_t) * (size_t)(D / 2) * R, sizeof(float) * (size_t)TK * R,
                      sizeof(uint32_t) * (size_t)(TK / 2) * R, sizeof(float) * (size_t)R * D,
                      sizeof(float) * (size_t)R * 5};
    size_t total = 0;
    for (int i = 0; i < 5; i++) total += (sizes[i] + 63) & ~(size_t)63;
    char *p = aligned_alloc(64, total);
    if (!p) return 0;
    void **dst[] = {(void **)&w->qp, (void **)&w->s, (void **)&w->pp, (void **)&w->o, (void **)&w->m};
    for (int i = 0; i < 5; i++) {
        *dst[i] = p;
        p += (sizes[i] + 63) & ~(size_t)63;
    }
    w->l = w->m + R;
    w->alpha = w->l + R;
    w->bmax = w->alpha + R;
    w->cnt = (int32_t *)(w->bmax + R);
    return 1;
}

/* A work item: nt > 0: a block of nt queries from b of run `run`, with KV head j0 (tiled);
 * nt == 0: query b alone with KV heads [j0, j1) (the per-query path). */
typedef struct {
    int64_t b, cost;
    int32_t nt, j0, j1, run;
} work_item;

/* A tiled run: queries [b, b + n) on one table row, at most hi keys each; vp: its V rows
 * paired by key, [Hkv][pairs][D] (pairs = hi rounded up to TK, halved). */
typedef struct {
    int64_t b, n, hi, pairs;
    uint32_t *vp;
} tile_run;

#define PACK_PAIRS 128  /* key pairs per V packing task */

static int by_cost_desc(const void *a, const void *b) {
    int64_t x = ((const work_item *)a)->cost, y = ((const work_item *)b)->cost;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Whether run [b, e) takes the tiled path: at least tile_min queries and, unless forced,
 * a lower estimated time than per query. Per query: rows x keys of work, spread evenly over
 * the threads. Tiled: rows (padded to whole blocks) x keys, at half the cost (a tiled pair
 * takes 0.45-0.55 of a per-query one, measured: pdserve bench kernels), spread over the
 * threads in whole items (blocks x KV heads: a run of one block keeps 2 of 3 threads busy),
 * plus a fixed cost per thread (the pairing of V and its barrier). So decode rows and short
 * chunks over no prefix stay per query (about 24 tokens is even), while a few tokens after a
 * long prefix already tile (3-4 on one thread, 8 on two). */
#define TILE_GAIN 2.0
#define TILE_FIXED 256.0  /* per thread, in per-query work units (rows x keys) */
#define TILE_MIN_DEFAULT 2
#define TILE_FORCE 8  /* tile_flags bit: tile every run of tile_min queries */

static int tile_run_here(const int64_t *seq_lens, int64_t b, int64_t e, int QT, int G, int Hkv,
                         int threads, int tile_min, int force) {
    if (e - b < tile_min) return 0;
    if (force) return 1;
    double per_query = 0, tiled = 0;
    int64_t items = 0;
    for (int64_t i = b; i < e; i++) per_query += (double)seq_lens[i] * G;
    for (int64_t b0 = b; b0 < e; b0 += QT, items += Hkv) {
        int64_t top = 0, nt = e - b0 < QT ? e - b0 : QT;
        for (int64_t i = b0; i < b0 + nt; i++) top = seq_lens[i] > top ? seq_lens[i] : top;
        tiled += (double)top * ((nt * G + 15) & ~15);
    }
    double rounds = (double)((items + threads - 1) / threads);  /* items per busiest thread */
    return tiled / TILE_GAIN * rounds / (double)items + TILE_FIXED * threads < per_query / threads;
}

/* q [B, Hq, D] (row stride q_stride), k_new/v_new [B, Hkv, D] (row strides), all bf16 with
 * heads contiguous; k_pool/v_pool: the layer's [slots, Hkv, D]; write_slots [B] (NULL: none);
 * table [rows, table_stride] slots in order, query b reading row table_rows[b] (NULL: row b);
 * seq_lens [B]: keys query b attends to (its own included); out [B, Hq*D].
 * A prefill chunk is B queries of a few rows: each attends to its row's first seq_lens[b]
 * slots (causal), with every new K/V stored beforehand (write_slots NULL). Consecutive
 * queries on one row (a run: one sequence's chunk) take the tiled path above where it is
 * faster (tile_run_here; runs under tile_min queries never, <= 0: the default); the rest
 * (decode, short chunks) one query at a time. tile_flags: bit 0 two-pass softmax; bits 1-2:
 * rows per block in units of 48, minus 1; bit 3 (TILE_FORCE): tile every run of tile_min.
 * Returns 0, or -1 if the shape is outside what this kernel handles, -2 if out of memory. */
int pd_paged_attention_ex(const bf16 *q, int64_t q_stride, const bf16 *k_new, int64_t k_stride,
                          const bf16 *v_new, int64_t v_stride, bf16 *k_pool, bf16 *v_pool,
                          const int64_t *write_slots, const int64_t *table, int64_t table_stride,
                          const int64_t *table_rows, const int64_t *seq_lens, bf16 *out, int64_t B,
                          int Hq, int Hkv, int D, float scale, int num_threads, int tile_min,
                          int tile_flags) {
    void (*attend_d)(ATTEND_ARGS) = D == 32 ? attend_32 : D == 64 ? attend_64 : D == 128 ? attend_128 : 0;
    void (*block_d)(BLOCK_ARGS) = D == 32 ? block_32 : D == 64 ? block_64 : block_128;
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_GROUP || !attend_d) return -1;
    if (B <= 0) return 0;
    const int G = Hq / Hkv, two_pass = tile_flags & 1;
    const int units = 1 + ((tile_flags >> 1) & 3);
    const int QT = ROW_UNIT * units / G;  /* query tokens per block (G <= 16: at least 3) */
    const int R = (QT * G + 15) & ~15;  /* rows of a full block */
    if (tile_min <= 0) tile_min = TILE_MIN_DEFAULT;
    const int tiling = write_slots == NULL && table_rows != NULL, force = tile_flags & TILE_FORCE;

    /* runs long enough become tiled items, the rest per-query ones */
    int64_t n_short = 0, n_tiled = 0, n_runs = 0, n_pack = 0, max_len = 0, vp_words = 0;
    for (int64_t b = 0, e; b < B; b = e) {
        for (e = b + 1; tiling && e < B && table_rows[e] == table_rows[b]; e++) {}
        if (tiling && tile_run_here(seq_lens, b, e, QT, G, Hkv, num_threads, tile_min, force)) {
            int64_t hi = 0;
            for (int64_t i = b; i < e; i++) hi = seq_lens[i] > hi ? seq_lens[i] : hi;
            int64_t pairs = (hi + TK - 1) / TK * TK / 2;
            n_runs++;
            n_tiled += (e - b + QT - 1) / QT * Hkv;
            n_pack += (pairs + PACK_PAIRS - 1) / PACK_PAIRS * Hkv;
            vp_words += pairs * Hkv * D;
        } else {
            n_short += e - b;
            for (int64_t i = b; i < e; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
        }
    }
    /* few queries (one stream): split each by KV head so every thread has work; many, or
     * tiled items beside them: whole queries, so each reads its K/V rows end to end */
    const int S = n_short >= 4 * (int64_t)num_threads || n_tiled > 0 ? 1 : Hkv;
    int64_t n_items = n_tiled + n_short * S, at = 0, r = 0;
    work_item *items = malloc(sizeof(work_item) * (size_t)n_items);
    tile_run *runs = n_runs ? malloc(sizeof(tile_run) * (size_t)n_runs) : NULL;
    uint32_t *vp_all = n_runs ? aligned_alloc(64, ((size_t)vp_words * 4 + 63) & ~(size_t)63) : NULL;
    if (!items || (n_runs && (!runs || !vp_all))) {
        free(items);
        free(runs);
        free(vp_all);
        return -2;
    }
    for (int pick = 0; pick < 2; pick++)  /* tiled items first, then the per-query ones */
        for (int64_t b = 0, e; b < B; b = e) {
            for (e = b + 1; tiling && e < B && table_rows[e] == table_rows[b]; e++) {}
            int tiled = tiling && tile_run_here(seq_lens, b, e, QT, G, Hkv, num_threads, tile_min, force);
            if (tiled && pick == 0) {
                int64_t hi = 0;
                for (int64_t i = b; i < e; i++) hi = seq_lens[i] > hi ? seq_lens[i] : hi;
                tile_run *run = runs + r;
                *run = (tile_run){b, e - b, hi, (hi + TK - 1) / TK * TK / 2, vp_all};
                vp_all += run->pairs * Hkv * D;
                for (int64_t b0 = b; b0 < e; b0 += QT) {
                    int nt = e - b0 < QT ? (int)(e - b0) : QT;
                    int64_t top = 0;
                    for (int i = 0; i < nt; i++) top = seq_lens[b0 + i] > top ? seq_lens[b0 + i] : top;
                    for (int j = 0; j < Hkv; j++) items[at++] = (work_item){b0, top, nt, j, j + 1, (int32_t)r};
                }
                r++;
            } else if (!tiled && pick == 1) {
                for (int64_t i = b; i < e; i++)
                    for (int part = 0; part < S; part++)
                        items[at++] = (work_item){i, 0, 0, part * Hkv / S, (part + 1) * Hkv / S, -1};
            }
        }
    /* the causal triangle: later blocks read more keys; largest first balances the threads */
    qsort(items, (size_t)n_tiled, sizeof(work_item), by_cost_desc);

    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        /* tiny probabilities would make denormal products, which cost microcode assists */
        unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);  /* flush-to-zero, denormals-are-zero */
        float *s = NULL;
        tile_buf tb = {0};
        int ok = 1;
        if (n_short) ok = (s = malloc(sizeof(float) * (size_t)(Hq + 1) * (size_t)(max_len + 16))) != NULL;
        if (n_tiled && ok) ok = tile_buf_alloc(&tb, R, D);
        if (!ok) {
            #pragma omp atomic write
            failed = 1;
        }
        /* each run's V rows paired by key, once, for all its blocks (then a barrier) */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n_pack; t++) {
            int64_t u = t, ri = 0;
            for (; ri < n_runs; ri++) {
                int64_t tasks = (runs[ri].pairs + PACK_PAIRS - 1) / PACK_PAIRS * Hkv;
                if (u < tasks) break;
                u -= tasks;
            }
            const tile_run *run = runs + ri;
            int64_t chunks = (run->pairs + PACK_PAIRS - 1) / PACK_PAIRS;
            int j = (int)(u / chunks);
            int64_t kp0 = u % chunks * PACK_PAIRS;
            int64_t kp1 = kp0 + PACK_PAIRS < run->pairs ? kp0 + PACK_PAIRS : run->pairs;
            const int64_t *row = table + table_rows[run->b] * table_stride;
            pack_v_pairs(run->vp + ((int64_t)j * run->pairs + kp0) * D, v_pool, row, kp0, kp1,
                         run->hi, Hkv, D, j);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < n_items; w++) {
            if (!ok) continue;
            const work_item *it = items + w;
            int64_t b = it->b;
            const int64_t *row = table + (table_rows ? table_rows[b] : b) * table_stride;
            if (it->nt) {
                const tile_run *run = runs + it->run;
                block_d(q + b * q_stride, q_stride, k_pool, run->vp + (int64_t)it->j0 * run->pairs * D,
                        row, seq_lens + b, it->nt, out + b * (int64_t)Hq * D, G, Hkv, it->j0,
                        scale, two_pass, &tb);
            } else {
                attend_d(q + b * q_stride, k_new + b * k_stride, v_new + b * v_stride, k_pool, v_pool,
                         row, seq_lens[b], write_slots ? write_slots[b] : -1,
                         out + b * (int64_t)Hq * D, G, Hkv, it->j0, it->j1, scale, s);
            }
        }
        free(s);
        free(tb.qp);
        _mm_setcsr(csr);
    }
    free(items);
    if (n_runs) free(runs[0].vp);
    free(runs);
    return failed ? -2 : 0;
}

/* The interface before tiling: the default threshold, online softmax. */
int pd_paged_attention(const bf16 *q, int64_t q_stride, const bf16 *k_new, int64_t k_stride,
                        const bf16 *v_new, int64_t v_stride, bf16 *k_pool, bf16 *v_pool,
                        const int64_t *write_slots, const int64_t *table, int64_t table_stride,
                        const int64_t *table_rows, const int64_t *seq_lens, bf16 *out, int64_t B,
                        int Hq, int Hkv, int D, float scale, int num_threads) {
    return pd_paged_attention_ex(q, q_stride, k_new, k_stride, v_new, v_stride, k_pool, v_pool,
                                 write_slots, table, table_stride, table_rows, seq_lens, out, B,
                                 Hq, Hkv, D, scale, num_threads, 0, 0);
}

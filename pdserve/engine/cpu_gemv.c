/* bfloat16 weight matmuls of a few rows (y = x @ W.T + b, M <= 4: decode of one to four
 * sequences) for CPUs with AVX-512 BF16, on the weight as stored ([N, K], rows contiguous).
 *
 * At a few rows a matmul only streams its weight from memory once, so the kernel is built to
 * stream: each thread takes one contiguous block of weight rows (one sequential read, which
 * the hardware prefetcher follows), 8 rows at a time, and every 32-element load of a weight
 * row meets all M rows of x in vdpbf16ps (pairs of bf16 products summed into float32 lanes).
 * A dot product's 16 lanes are summed, the bias added in float32, and the output rounded once
 * to bfloat16 (nearest even, NaN kept), as torch's bf16 matmul does. K needs no alignment
 * (the tail is a masked load).
 *
 * Why not oneDNN here: on a 2-core Zen 5 VM, SmolLM2-135M's 121 decode matmuls (268 MB of
 * weights) took 9.7 ms through oneDNN's packed bf16 path and 7.5 ms through this kernel, against
 * 6.5 ms to merely read the bytes (docs/benchmarks.md). More rows stay on oneDNN.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

typedef uint16_t bf16;

#define MAX_ROWS 4
#define MAX_BLOCK 8 /* weight rows per register block (fewer at 3-4 rows: 32 registers) */

static inline bf16 round_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline __m512bh load_bh(const bf16 *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

/* y[r][n + i] for i < NB (constant) and every x row r < M (constant): acc[r][i] is x row r
 * against weight row n + i. Inlined with constants so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void
block(const int M, const int NB, const bf16 *x, int64_t ldx, const bf16 *wn, int64_t ldw, int64_t K,
      const bf16 *bias, bf16 *y, int64_t ldy, int64_t n) {
    __m512 acc[MAX_ROWS][MAX_BLOCK];
    for (int r = 0; r < M; r++)
        for (int i = 0; i < NB; i++)
            acc[r][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh xv[MAX_ROWS];
        for (int r = 0; r < M; r++)
            xv[r] = (__m512bh)_mm512_loadu_si512(x + r * ldx + k);
        for (int i = 0; i < NB; i++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(wn + i * ldw + k);
            for (int r = 0; r < M; r++)
                acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv, xv[r]);
        }
    }
    if (k < K) {
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh xv[MAX_ROWS];
        for (int r = 0; r < M; r++)
            xv[r] = load_bh(x + r * ldx + k, m);
        for (int i = 0; i < NB; i++) {
            __m512bh wv = load_bh(wn + i * ldw + k, m);
            for (int r = 0; r < M; r++)
                acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv, xv[r]);
        }
    }
    for (int r = 0; r < M; r++)
        for (int i = 0; i < NB; i++) {
            float s = _mm512_reduce_add_ps(acc[r][i]);
            if (bias) {
                uint32_t u = (uint32_t)bias[n + i] << 16;
                float b;
                __builtin_memcpy(&b, &u, 4);
                s += b;
            }
            y[r * ldy + n + i] = round_bf16(s);
        }
}

/* rows [n0, n1) of y: blocks of NB weight rows, then the rest one row at a time */
static inline __attribute__((always_inline)) void
rows(const int M, const int NB, const bf16 *x, int64_t ldx, const bf16 *w, int64_t ldw, int64_t K,
     const bf16 *bias, bf16 *y, int64_t ldy, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + NB <= n1; n += NB)
        block(M, NB, x, ldx, w + n * ldw, ldw, K, bias, y, ldy, n);
    for (; n < n1; n++)
        block(M, 1, x, ldx, w + n * ldw, ldw, K, bias, y, ldy, n);
}

/* x [M, K] (row stride ldx), W [N, K] (row stride ldw), bias [N] or NULL -> y [M, N] (row
 * stride ldy). Returns 0, or 1 for arguments it does not take. */
int pd_gemv_bf16(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, int64_t N, int64_t K, int64_t ldw,
                 const bf16 *bias, bf16 *y, int64_t ldy, int nthreads) {
    if (M < 1 || M > MAX_ROWS || N < 1 || K < 1 || ldx < K || ldw < K || ldy < N || nthreads < 1)
        return 1;
    int64_t per = (N + nthreads - 1) / nthreads;
    per = (per + MAX_BLOCK - 1) / MAX_BLOCK * MAX_BLOCK;
    int teams = (int)((N + per - 1) / per);
#pragma omp parallel num_threads(teams)
    {
        int64_t n0 = omp_get_thread_num() * per;
        int64_t n1 = n0 + per < N ? n0 + per : N;
        if (n0 < n1) {
            switch (M) {
            case 1: rows(1, 8, x, ldx, w, ldw, K, bias, y, ldy, n0, n1); break;
            case 2: rows(2, 8, x, ldx, w, ldw, K, bias, y, ldy, n0, n1); break;
            case 3: rows(3, 6, x, ldx, w, ldw, K, bias, y, ldy, n0, n1); break;
            default: rows(4, 4, x, ldx, w, ldw, K, bias, y, ldy, n0, n1); break;
            }
        }
    }
    return 0;
}

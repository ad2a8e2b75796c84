/* bfloat16 weight matmuls (y = x @ W.T + b) for CPUs with AVX2 and FMA, where torch has no fast
 * bfloat16 matmul (oneDNN's needs AVX-512): the weights stay bfloat16 (half the bytes of a
 * float32 copy: decode is bound by reading them), products are summed in float32 and the
 * output is rounded once to bfloat16, as torch's own bfloat16 matmul does.
 *
 * Layout: W [N, K] is packed once into panels of 16 output columns, each K rows of 16 bf16
 * (pd_pack_bf16), so a panel is one sequential stream. Within a panel row the columns are
 * stored in the order 0-3, 8-11, 4-7, 12-15: one 256-bit load then unpacks (interleaving with
 * zero, per 128-bit lane) into float32 columns 0-7 and 8-15.
 *
 * Every output is one float32 fused multiply-add chain over k = 0..K-1, then + bias, then
 * rounded: the same bits whatever the number of rows, the row's place in the batch or the
 * thread count (batch-invariant). Register blocks: 6 rows x 16 columns, or fewer rows x 32-64
 * columns, so that there are always enough independent chains to hide the FMA latency.
 * Threads take (row chunk, panel group) items as they come; a chunk's float32 rows stay in L2.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

#define NR 16            /* columns per panel */
#define L2_ROWS_BYTES (192 * 1024)

static const int PANEL_ORDER[NR] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

/* W [N, K] (row stride ldw) -> panels [ceil(N / 16)][K][16], columns past N zero. */
int pd_pack_bf16(const bf16 *w, int64_t N, int64_t K, int64_t ldw, bf16 *out) {
    if (N <= 0 || K <= 0 || ldw < K)
        return 1;
    int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        bf16 *dst = out + p * K * NR;
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < NR; j++) {
                int64_t n = p * NR + PANEL_ORDER[j];
                dst[k * NR + j] = n < N ? w[n * ldw + k] : 0;
            }
    }
    return 0;
}

static inline void load_panel_row(const bf16 *b, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_loadu_si256((const __m256i *)b);
    __m256i z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h));
}

/* float32 -> bf16 bits, round to nearest even, NaN -> quiet NaN (as c10 does) */
static inline __m256i round_bits(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

/* 16 float32 (columns 0-7 in lo, 8-15 in hi) + bias -> bf16, the first n of them stored */
static inline void store16(bf16 *y, __m256 lo, __m256 hi, const float *bias, int n) {
    if (bias) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    }
    __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bits(lo), round_bits(hi)), 0xd8);
    if (n == NR) {
        _mm256_storeu_si256((__m256i *)y, p);
    } else {
        bf16 tmp[NR];
        _mm256_storeu_si256((__m256i *)tmp, p);
        memcpy(y, tmp, (size_t)n * sizeof(bf16));
    }
}

/* MR rows x NP panels: a [MR][lda] float32, b the first panel (panels K * 16 apart), y [MR][ldy]
 * at the first panel's column; ncols valid columns from there. MR * NP <= 6. */
static inline __attribute__((always_inline)) void block(
        const int MR, const int NP, const float *a, int64_t lda, const bf16 *b, int64_t K,
        const float *bias, bf16 *y, int64_t ldy, int64_t ncols) {
    __m256 acc[6][2];
    for (int i = 0; i < MR * NP; i++)
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        for (int p = 0; p < NP; p++) {
            __m256 lo, hi;
            load_panel_row(b + (p * K + k) * NR, &lo, &hi);
            for (int m = 0; m < MR; m++) {
                __m256 x = _mm256_broadcast_ss(a + m * lda + k);
                acc[m * NP + p][0] = _mm256_fmadd_ps(x, lo, acc[m * NP + p][0]);
                acc[m * NP + p][1] = _mm256_fmadd_ps(x, hi, acc[m * NP + p][1]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < NP; p++) {
            int64_t n = ncols - p * NR;
            if (n <= 0)
                break;
            store16(y + m * ldy + p * NR, acc[m * NP + p][0], acc[m * NP + p][1],
                    bias ? bias + p * NR : NULL, n < NR ? (int)n : NR);
        }
}

/* rows [0, M) of panels [p0, p1): blocks of up to 6 rows; 1-2 rows take several panels at once */
static void rows_panels(const float *a, int64_t lda, int64_t M, const bf16 *wp, int64_t N, int64_t K,
                        const float *bias, bf16 *y, int64_t ldy, int64_t p0, int64_t p1) {
    int64_t m = 0;
    for (; m + 6 <= M; m += 6)
        for (int64_t p = p0; p < p1; p++)
            block(6, 1, a + m * lda, lda, wp + p * K * NR, K, bias ? bias + p * NR : NULL,
                  y + m * ldy + p * NR, ldy, N - p * NR);
    int64_t left = M - m;
    const float *am = a + m * lda;
    bf16 *ym = y + m * ldy;
    int64_t p = p0;
#define TAIL(R, P)                                                                           \
    do {                                                                                       \
        for (; p + (P) <= p1; p += (P))                                                        \
            block(R, P, am, lda, wp + p * K * NR, K, bias ? bias + p * NR : NULL,              \
                  ym + p * NR, ldy, N - p * NR);                                               \
        for (; p < p1; p++)                                                                    \
            block(R, 1, am, lda, wp + p * K * NR, K, bias ? bias + p * NR : NULL,              \
                  ym + p * NR, ldy, N - p * NR);                                               \
    } while (0)
    switch (left) {
    case 1: TAIL(1, 4); break;
    case 2: TAIL(2, 3); break;
    case 3: TAIL(3, 2); break;
    case 4: TAIL(4, 1); break;
    case 5: TAIL(5, 1); break;
    default: break;
    }
#undef TAIL
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W.T + bias, W packed by pd_pack_bf16.
 * bias: N bf16 or NULL. Returns 0, or 1 on bad arguments / 2 when out of memory. */
int pd_linear_bf16(const bf16 *x, int64_t M, int64_t ldx, const bf16 *wp, int64_t N, int64_t K,
                   const bf16 *bias, bf16 *y, int64_t ldy, int nthreads) {
    if (M < 0 || N <= 0 || K <= 0 || ldx < K || ldy < N)
        return 1;
    if (M == 0)
        return 0;
    int64_t panels = (N + NR - 1) / NR;
    int64_t lda = (K + 15) & ~(int64_t)15;
    float *a = aligned_alloc(64, (size_t)(M * lda * 4 + 64));
    float *bf = bias ? aligned_alloc(64, (size_t)(panels * NR * 4)) : NULL;
    if (!a || (bias && !bf)) {
        free(a);
        free(bf);
        return 2;
    }
    if (bias)
        for (int64_t n = 0; n < panels * NR; n++) {
            uint32_t u = n < N ? (uint32_t)bias[n] << 16 : 0;
            memcpy(bf + n, &u, 4);
        }
    /* rows per chunk: their float32 copy stays in L2 while the thread's panels stream by */
    int64_t chunk = L2_ROWS_BYTES / (lda * 4);
    chunk = chunk < 6 ? 6 : chunk / 6 * 6;
    if (nthreads < 1)
        nthreads = 1;
    if (nthreads > panels)
        nthreads = (int)panels;
    /* panels per item: about 4 items per thread per row chunk, 1 to 16 panels each */
    int64_t group = panels / (4 * (int64_t)nthreads);
    group = group < 1 ? 1 : group > 16 ? 16 : group;
    const int64_t groups = (panels + group - 1) / group;
    const int64_t n_items = (M + chunk - 1) / chunk * groups;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const bf16 *src = x + m * ldx;
            float *dst = a + m * lda;
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) {
                __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + k)));
                _mm256_store_ps(dst + k, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
            }
            for (; k < K; k++) {
                uint32_t u = (uint32_t)src[k] << 16;
                memcpy(dst + k, &u, 4);
            }
        }
        /* items: (row chunk, group of panels), row chunk major so both threads share a chunk's
         * rows in L2; taken dynamically, so a thread the OS preempted (a busy neighbour) holds
         * back only its current item, not a fixed half of the work */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_items; it++) {
            int64_t m0 = it / groups * chunk, p0 = it % groups * group;
            int64_t rows = M - m0 < chunk ? M - m0 : chunk;
            int64_t p1 = p0 + group < panels ? p0 + group : panels;
            rows_panels(a + m0 * lda, lda, rows, wp, N, K, bf, y + m0 * ldy, ldy, p0, p1);
        }
    }
    free(a);
    free(bf);
    return 0;
}

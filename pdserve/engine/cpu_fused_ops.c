/* Fused elementwise ops of the decoder for CPUs with AVX-512 BF16 or AVX2, bfloat16 tensors
 * (built for one or the other: the same math, 16 or 8 lanes, so the same bits).
 *
 * Each op replaces a chain of small torch ops in model.py (rms_norm, residual add + rms_norm,
 * RoPE) with one pass over the rows, and rounds where torch rounds, in the
 * same way (float32 math, round to nearest even to bfloat16):
 *   - rms_norm: the float32 sum of squares is added up in the order torch's CPU sum kernel
 *     uses (ATen SumKernel.cpp as built for AVX2, which is what runs on AVX-512 CPUs too:
 *     8-lane vectors, 4 interleaved accumulators, cascade levels, then the scalar tail and
 *     the 8 lanes), then mean = sum / N, r = 1 / sqrt(mean + eps), y = bf16(x * r),
 *     out = bf16(w * y);
 *   - rope: every product, sum and difference rounded to bf16 as apply_rope's bf16 ops do.
 * Rounding to bf16 is done in integer ops like c10's round_to_nearest_even, not with
 * VCVTNEPS2BF16, which flushes subnormals to zero where torch keeps them.
 * Build with -ffp-contract=off: a fused multiply-add where torch rounds twice would change bits.
 *
 * Rows go to OpenMP threads only when there is enough work (T * N > PAR_MIN); the library is
 * loaded after torch, so it shares torch's libgomp thread pool.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

#define PAR_MIN 65536

static inline float bf16_to_f32(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even as torch does it in software (c10::round_to_nearest_even): unlike
 * VCVTNEPS2BF16, subnormals are kept, not flushed to zero. NaN -> quiet NaN. */
static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f)
        return 0x7fc0;
    return (bf16)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#ifdef __AVX512F__
static inline __m512 load16(const bf16 *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load16_mask(const bf16 *p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* float32 bits rounded to nearest even at bit 16, low half cleared (NaN -> quiet NaN) */
static inline __m512i round_bits(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
}

static inline __m256i to_bf16(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits(v), 16));
}

static inline void store16(bf16 *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, to_bf16(v)); }

static inline void store16_mask(bf16 *p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, to_bf16(v));
}

/* v rounded to bf16 and widened back to float32 */
static inline __m512 rnd(__m512 v) { return _mm512_castsi512_ps(round_bits(v)); }

static inline __mmask16 tail_mask(int64_t n) { return (__mmask16)((1u << n) - 1); }

#else
/* AVX2 (no AVX-512): the same helpers, 8 lanes; tails go element by element */
static inline __m256 load8(const bf16 *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* float32 bits rounded to nearest even at bit 16, low half cleared (NaN -> quiet NaN) */
static inline __m256i round_bits8(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
}

static inline void store8(bf16 *p, __m256 v) {
    __m256i r = _mm256_srli_epi32(round_bits8(v), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extractf128_si256(r, 1)));
}

/* v rounded to bf16 and widened back to float32 */
static inline __m256 rnd8(__m256 v) { return _mm256_castsi256_ps(round_bits8(v)); }

#endif

/* ---- rms_norm ---------------------------------------------------------------------------- */

static inline __m256 sq8(const bf16 *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_mul_ps(v, v);
}

static int64_t ceil_log2(int64_t x) {
    if (x <= 2)
        return 1;
    return 64 - __builtin_clzll((uint64_t)(x - 1));
}

/* Sum of x[i]^2 (each square rounded to float32) in the order of ATen's vectorized_inner_sum
 * -> row_sum -> multi_row_sum over a contiguous float32 row of n >= 8 elements, as built for
 * AVX2 (8-float vectors): torch registers no AVX-512 sum kernel, so that is what runs. */
static float sum_squares(const bf16 *x, int64_t n) {
    const int64_t nv = n / 8;           /* whole 8-float vectors */
    const int64_t size = nv / 4;        /* rows of the (-1, 4) view of those vectors */
    int64_t lp = ceil_log2(size) / 4;
    if (lp < 4)
        lp = 4;
    const int64_t step = (int64_t)1 << lp, mask = step - 1;
    __m256 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 4; k++)
            acc[j][k] = _mm256_setzero_ps();
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                acc[0][k] = _mm256_add_ps(acc[0][k], sq8(x + (4 * i + k) * 8));
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if ((i & (mask << (j * lp))) != 0)
                break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < 4; k++)
            acc[0][k] = _mm256_add_ps(acc[0][k], sq8(x + (4 * i + k) * 8));
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++)
            acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    for (int64_t v = size * 4; v < nv; v++)
        acc[0][0] = _mm256_add_ps(acc[0][0], sq8(x + v * 8));
    for (int k = 1; k < 4; k++)
        acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
    float total = 0.0f;
    for (int64_t k = nv * 8; k < n; k++) {
        float f = bf16_to_f32(x[k]);
        total += f * f;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc[0][0]);
    for (int k = 0; k < 8; k++)
        total += lanes[k];
    return total;
}

/* Rows shorter than one vector: ATen's scalar_inner_sum, row_sum with 4 scalar accumulators. */
static float sum_squares_short(const bf16 *x, int64_t n) {
    float ps[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t size = n / 4;
    for (int64_t i = 0; i < size; i++)
        for (int k = 0; k < 4; k++) {
            float f = bf16_to_f32(x[4 * i + k]);
            ps[k] += f * f;
        }
    for (int64_t i = size * 4; i < n; i++) {
        float f = bf16_to_f32(x[i]);
        ps[0] += f * f;
    }
    return ps[0] + ps[1] + ps[2] + ps[3];
}

static void norm_row(const bf16 *x, const bf16 *w, bf16 *out, int64_t n, float eps) {
    float ss = n >= 8 ? sum_squares(x, n) : sum_squares_short(x, n);
    float mean = ss / (float)n;
    float r = 1.0f / sqrtf(mean + eps);
#ifdef __AVX512F__
    __m512 rv = _mm512_set1_ps(r);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 y = rnd(_mm512_mul_ps(load16(x + i), rv));
        store16(out + i, _mm512_mul_ps(load16(w + i), y));
    }
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        __m512 y = rnd(_mm512_mul_ps(load16_mask(x + i, m), rv));
        store16_mask(out + i, m, _mm512_mul_ps(load16_mask(w + i, m), y));
    }
#else
    __m256 rv = _mm256_set1_ps(r);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 y = rnd8(_mm256_mul_ps(load8(x + i), rv));
        store8(out + i, _mm256_mul_ps(load8(w + i), y));
    }
    for (; i < n; i++)
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(x[i]) * r));
#endif
}

/* out[t] = rms_norm(x[t]) * w; out contiguous [T, N]. */
int pd_rms_norm(const bf16 *x, int64_t x_stride, const bf16 *w, bf16 *out, int64_t T, int64_t N,
                float eps, int nthreads) {
    if (T < 0 || N <= 0)
        return 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * N > PAR_MIN && nthreads > 1)
    for (int64_t t = 0; t < T; t++)
        norm_row(x + t * x_stride, w, out + t * N, N, eps);
    return 0;
}

/* x[t] += d[t] in place (bf16), then out[t] = rms_norm(x[t]) * w. */
int pd_add_rms_norm(bf16 *x, int64_t x_stride, const bf16 *d, int64_t d_stride, const bf16 *w,
                    bf16 *out, int64_t T, int64_t N, float eps, int nthreads) {
    if (T < 0 || N <= 0)
        return 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * N > PAR_MIN && nthreads > 1)
    for (int64_t t = 0; t < T; t++) {
        bf16 *xr = x + t * x_stride;
        const bf16 *dr = d + t * d_stride;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= N; i += 16)
            store16(xr + i, _mm512_add_ps(load16(xr + i), load16(dr + i)));
        if (i < N) {
            __mmask16 m = tail_mask(N - i);
            store16_mask(xr + i, m, _mm512_add_ps(load16_mask(xr + i, m), load16_mask(dr + i, m)));
        }
#else
        for (; i + 8 <= N; i += 8)
            store8(xr + i, _mm256_add_ps(load8(xr + i), load8(dr + i)));
        for (; i < N; i++)
            xr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(dr[i]));
#endif
        norm_row(xr, w, out + t * N, N, eps);
    }
    return 0;
}

/* ---- rope -------------------------------------------------------------------------------- */

/* out[t, h] = rotate(qk[t, h]) by cos[t], sin[t] [D/2]; qk rows at qk_stride, heads contiguous
 * (stride D) within a row; out contiguous [T, H, D]. */
int pd_rope(const bf16 *qk, int64_t qk_stride, const bf16 *cos_, int64_t cos_stride,
            const bf16 *sin_, int64_t sin_stride, bf16 *out, int64_t T, int64_t H, int64_t D,
            int nthreads) {
    if (T < 0 || H <= 0 || D <= 0 || D % 2)
        return 1;
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * H * D > PAR_MIN && nthreads > 1)
    for (int64_t t = 0; t < T; t++) {
        const bf16 *c = cos_ + t * cos_stride, *s = sin_ + t * sin_stride;
        for (int64_t h = 0; h < H; h++) {
            const bf16 *x1 = qk + t * qk_stride + h * D, *x2 = x1 + half;
            bf16 *o1 = out + (t * H + h) * D, *o2 = o1 + half;
#ifdef __AVX512F__
            for (int64_t i = 0; i < half; i += 16) {
                __mmask16 m = half - i >= 16 ? (__mmask16)0xffff : tail_mask(half - i);
                __m512 a = load16_mask(x1 + i, m), b = load16_mask(x2 + i, m);
                __m512 cv = load16_mask(c + i, m), sv = load16_mask(s + i, m);
                __m512 r1 = rnd(_mm512_sub_ps(rnd(_mm512_mul_ps(a, cv)), rnd(_mm512_mul_ps(b, sv))));
                __m512 r2 = _mm512_add_ps(rnd(_mm512_mul_ps(b, cv)), rnd(_mm512_mul_ps(a, sv)));
                store16_mask(o1 + i, m, r1);
                store16_mask(o2 + i, m, r2);
            }
#else
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 a = load8(x1 + i), b = load8(x2 + i), cv = load8(c + i), sv = load8(s + i);
                __m256 r1 = rnd8(_mm256_sub_ps(rnd8(_mm256_mul_ps(a, cv)), rnd8(_mm256_mul_ps(b, sv))));
                __m256 r2 = _mm256_add_ps(rnd8(_mm256_mul_ps(b, cv)), rnd8(_mm256_mul_ps(a, sv)));
                store8(o1 + i, r1);
                store8(o2 + i, r2);
            }
            for (; i < half; i++) {
                float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
                float cv = bf16_to_f32(c[i]), sv = bf16_to_f32(s[i]);
                o1[i] = f32_to_bf16(round_bf16(a * cv) - round_bf16(b * sv));
                o2[i] = f32_to_bf16(round_bf16(b * cv) + round_bf16(a * sv));
            }
#endif
        }
    }
    return 0;
}

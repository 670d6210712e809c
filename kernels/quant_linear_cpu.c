/* Weight-only quantized linear layers for CPUs, the native half of plait.kernels.quant_cpu.
 *
 *   out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])     x, out float32; w in blocks of 32
 *
 * Two weight layouts, both planar (one array per field), a block being 32 consecutive
 * weights of one output row:
 *   Q8  (kind 0): qs int8 [N, K], scales float32 [N, K/32];  w = q * scale
 *                 (GGUF Q8_0's math with a float32 scale)
 *   Q4  (kind 1): qs uint8 [N, K/2], scales, mins float32 [N, K/32];  w = q * scale + min,
 *                 q in 0..15; byte j of a block's 16 holds weight j in its low nibble
 *                 and weight j + 16 in its high nibble (GGUF Q4_0/Q4_1's order)
 *
 * Each block is dequantized to float32 once (rounded as the Python reference does:
 * one multiply, or one fused multiply-add for Q4) and multiplied against up to MT rows
 * of x held in registers, so a weight is read once per MT rows; the activations stay
 * float32 (no activation quantization), except for one row of x on AVX-512 VNNI
 * (ISA_AVX512VNNI, below: 16-bit activation blocks and integer dot products, where the
 * float32 path was bound by decoding weights). Output rows are split over OpenMP threads.
 *
 * Paths: AVX-512F (and AVX-512 VNNI for one row), AVX2+FMA (compiled per function with
 * target attributes, so one library serves any x86-64 CPU) and portable C. The caller
 * picks the path from the CPU's flags (plait.kernels.quant_cpu.choose_isa); a path the
 * library was not compiled with (a non-x86 compiler) returns -2.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PLAIT_X86 1
#include "vexp.h"
#endif

#define QBLOCK 32
#define MT 4  /* rows of x per pass over a weight row */
#define RT 4  /* weight rows per tile (independent accumulator chains) */
#define PANEL_MIN_ROWS 16 /* AVX-512: from this many rows of x, panels (measured: README) */

enum { KIND_Q8 = 0, KIND_Q4 = 1 };
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512VNNI = 3 };

/* ---- portable C ---------------------------------------------------------------- */

static inline void dequant_block_c(int kind, const uint8_t *qs, float scale, float min, float *w) {
    if (kind == KIND_Q8) {
        const int8_t *q = (const int8_t *)qs;
        for (int j = 0; j < QBLOCK; j++) w[j] = (float)q[j] * scale;
    } else {
        for (int j = 0; j < QBLOCK / 2; j++) {
            w[j] = (float)(qs[j] & 0x0F) * scale + min;
            w[j + 16] = (float)(qs[j] >> 4) * scale + min;
        }
    }
}

static void row_portable(int kind, const float *x, int64_t mt, int64_t K, const uint8_t *qs, const float *sc,
                         const float *mn, float *acc) {
    float w[QBLOCK];
    const int64_t nb = K / QBLOCK, bb = kind == KIND_Q8 ? QBLOCK : QBLOCK / 2;
    for (int64_t m = 0; m < mt; m++) acc[m] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        dequant_block_c(kind, qs + b * bb, sc[b], mn ? mn[b] : 0.0f, w);
        for (int64_t m = 0; m < mt; m++) {
            const float *xr = x + m * K + b * QBLOCK;
            float s = 0.0f;
            for (int j = 0; j < QBLOCK; j++) s += w[j] * xr[j];
            acc[m] += s;
        }
    }
}

#ifdef PLAIT_X86
/* While a tile runs, the next tile's RT rows at block b: a cache line of weights every
 * 64 bytes of blocks, scales and minimums every 16 blocks (plain SSE prefetches). */
static inline void prefetch_next_tile(const uint8_t *qs, int64_t row_bytes, const float *sc, const float *mn,
                                      int64_t nb, int64_t b, int64_t block_bytes) {
    if (b % (64 / block_bytes) == 0)
        for (int r = 0; r < RT; r++) _mm_prefetch((const char *)(qs + (RT + r) * row_bytes + b * block_bytes), _MM_HINT_T0);
    if (b % 16 == 0)
        for (int r = 0; r < RT; r++) {
            _mm_prefetch((const char *)(sc + (RT + r) * nb + b), _MM_HINT_T0);
            if (mn) _mm_prefetch((const char *)(mn + (RT + r) * nb + b), _MM_HINT_T0);
        }
}

#endif

/* ---- AVX2 + FMA ---------------------------------------------------------------- */
#ifdef PLAIT_X86
__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* block b of a row as 4 x 8 float32 weights */
__attribute__((target("avx2,fma"))) static inline void decode_avx2(int kind, const uint8_t *qs, int64_t b, float scale,
                                                                   float min, __m256 *w) {
    const __m256 s = _mm256_set1_ps(scale);
    if (kind == KIND_Q8) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(qs + b * QBLOCK));
        const __m128i q2 = _mm_loadu_si128((const __m128i *)(qs + b * QBLOCK + 16));
        w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s);
        w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), s);
        w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q2)), s);
        w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q2, 8))), s);
    } else {
        const __m256 mv = _mm256_set1_ps(min);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(qs + b * (QBLOCK / 2)));
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), s, mv);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), s, mv);
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), s, mv);
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), s, mv);
    }
}

/* a + one block of weights (4 x 8) times its 32 activations, in the block's order */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 dot_block_avx2(const __m256 *w, const float *xr,
                                                                                    __m256 a) {
    a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a);
    a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a);
    a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a);
}

__attribute__((target("avx2,fma"))) static void row_avx2(int kind, const float *x, int64_t mt, int64_t K,
                                                         const uint8_t *qs, const float *sc, const float *mn,
                                                         float *out) {
    __m256 acc[MT];
    for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps();
    const int64_t nb = K / QBLOCK;
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        decode_avx2(kind, qs, b, sc[b], mn ? mn[b] : 0.0f, w);
        for (int m = 0; m < MT; m++) {
            if (m >= mt) break;
            const float *xr = x + m * K + b * QBLOCK;
            acc[m] = dot_block_avx2(w, xr, acc[m]);
        }
    }
    for (int m = 0; m < mt; m++) out[m] = hsum256(acc[m]);
}

/* ---- AVX-512F ------------------------------------------------------------------ */
/* block b of a row as 2 x 16 float32 weights */
__attribute__((target("avx512f"), always_inline)) static inline void decode_avx512(int kind, const uint8_t *qs, int64_t b, float scale,
                                                                    float min, __m512 *w0, __m512 *w1) {
    const __m512 s = _mm512_set1_ps(scale);
    if (kind == KIND_Q8) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(qs + b * QBLOCK));
        const __m128i q2 = _mm_loadu_si128((const __m128i *)(qs + b * QBLOCK + 16));
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q2)), s);
    } else {
        const __m512 mv = _mm512_set1_ps(min);
        /* one zero-extension of the 16 bytes, then the nibbles apart in 32-bit lanes */
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + b * (QBLOCK / 2))));
        *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F))), s, mv);
        *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, mv);
    }
}

/* whole rows to float32 */
__attribute__((target("avx512f"))) static void dequant_row_avx512(int kind, const uint8_t *qs, const float *sc,
                                                                  const float *mn, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++) {
        __m512 w0, w1;
        decode_avx512(kind, qs, b, sc[b], mn ? mn[b] : 0.0f, &w0, &w1);
        _mm512_storeu_ps(w + b * QBLOCK, w0);
        _mm512_storeu_ps(w + b * QBLOCK + 16, w1);
    }
}

__attribute__((target("avx2,fma"))) static void dequant_row_avx2(int kind, const uint8_t *qs, const float *sc,
                                                                 const float *mn, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[4];
        decode_avx2(kind, qs, b, sc[b], mn ? mn[b] : 0.0f, v);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(w + b * QBLOCK + 8 * i, v[i]);
    }
}

__attribute__((target("avx512f"))) static void row_avx512(int kind, const float *x, int64_t mt, int64_t K,
                                                          const uint8_t *qs, const float *sc, const float *mn,
                                                          float *out) {
    __m512 acc[MT];
    for (int m = 0; m < MT; m++) acc[m] = _mm512_setzero_ps();
    const int64_t nb = K / QBLOCK;
    for (int64_t b = 0; b < nb; b++) {
        __m512 w0, w1;
        decode_avx512(kind, qs, b, sc[b], mn ? mn[b] : 0.0f, &w0, &w1);
        for (int m = 0; m < MT; m++) {
            if (m >= mt) break;
            const float *xr = x + m * K + b * QBLOCK;
            acc[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[m]));
        }
    }
    for (int m = 0; m < mt; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}

/* one weight row x one row of x with four accumulators (two blocks at a time, each
 * block's halves apart): the chains a single accumulator serialises, without a tile's
 * extra streams; another summation order than row_avx512 */
__attribute__((target("avx512f"))) static float row1_avx512(int kind, const float *x, int64_t K, const uint8_t *qs,
                                                           const float *sc, const float *mn) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const int64_t nb = K / QBLOCK;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        __m512 w0, w1, w2, w3;
        decode_avx512(kind, qs, b, sc[b], mn ? mn[b] : 0.0f, &w0, &w1);
        decode_avx512(kind, qs, b + 1, sc[b + 1], mn ? mn[b + 1] : 0.0f, &w2, &w3);
        const float *xr = x + b * QBLOCK;
        a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a0);
        a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), a1);
        a2 = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xr + 32), a2);
        a3 = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xr + 48), a3);
    }
    if (b < nb) {
        __m512 w0, w1;
        decode_avx512(kind, qs, b, sc[b], mn ? mn[b] : 0.0f, &w0, &w1);
        a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + b * QBLOCK), a0);
        a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + b * QBLOCK + 16), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

/* Many rows of x (prefill chunks): each tile's RT weight rows are dequantized once into
 * a float32 panel that stays in L1 (PANEL_K columns at a time), then every group of MT x
 * rows multiplies against the panel with RT x MT accumulators: the decode work is then
 * shared by all M rows instead of repeated per group of MT, and the loop is float32 FMAs
 * fed from L1. Same products as the tile (w dequantized as decode_avx512 does), summed
 * per PANEL_K columns and then across them. */
#define PANEL_K 2048
#define SX_MAX 1024 /* blocks of one x row whose sums row1f_q4_avx512 takes (K <= 32768) */
#define PANEL_M 256
__attribute__((target("avx512f"))) static void panel_avx512(int kind, const float *x, int64_t M, int64_t K,
                                                            const uint8_t *qs, int64_t row_bytes, const float *sc,
                                                            const float *mn, float *out, int64_t ldo, const float *bias) {
    float panel[RT * PANEL_K] __attribute__((aligned(64)));
    const int64_t nb = K / QBLOCK;
    for (int64_t k0 = 0; k0 < K; k0 += PANEL_K) {
        const int64_t kc = K - k0 < PANEL_K ? K - k0 : PANEL_K, b0 = k0 / QBLOCK, nbc = kc / QBLOCK;
        for (int r = 0; r < RT; r++)
            dequant_row_avx512(kind, qs + r * row_bytes + (kind == KIND_Q8 ? k0 : k0 / 2), sc + r * nb + b0,
                               mn ? mn + r * nb + b0 : NULL, nbc, panel + r * kc);
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int64_t mt = M - m0 < MT ? M - m0 : MT;
            __m512 acc[RT][MT];
            for (int r = 0; r < RT; r++)
                for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nbc; b++) {
                __m512 w[RT][2]; /* 8 + 16 accumulators + 2 of x: within the 32 registers */
                for (int r = 0; r < RT; r++) {
                    w[r][0] = _mm512_load_ps(panel + r * kc + b * QBLOCK);
                    w[r][1] = _mm512_load_ps(panel + r * kc + b * QBLOCK + 16);
                }
                for (int m = 0; m < MT; m++) {
                    if (m >= mt) break;
                    const float *xr = x + (m0 + m) * K + k0 + b * QBLOCK;
                    const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
                    for (int r = 0; r < RT; r++) acc[r][m] = _mm512_fmadd_ps(w[r][1], x1, _mm512_fmadd_ps(w[r][0], x0, acc[r][m]));
                }
            }
            for (int r = 0; r < RT; r++)
                for (int64_t m = 0; m < mt; m++) {
                    float *o = out + (m0 + m) * ldo + r;
                    const float v = _mm512_reduce_add_ps(acc[r][m]);
                    *o = k0 == 0 ? v + (bias ? bias[r] : 0.0f) : *o + v;
                }
        }
    }
}

/* Q4, one row of x, the scale and minimum factored out of the block's sum:
 * sum_j (q_j d + m) x_j = d (sum_j q_j x_j) + m (sum_j x_j), with sx[b] = the sum of
 * block b of x computed once per call: per block one FMA by d instead of dequantizing
 * 32 weights (two FMAs and a broadcast of m). Other rounding than the reference's
 * dequantized weights (within float32 sums' error; tests). */
__attribute__((target("avx512f"))) static float row1f_q4_avx512(const float *x, const float *sx, int64_t K,
                                                               const uint8_t *qs, const float *sc, const float *mn) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    const __m512i low = _mm512_set1_epi32(0x0F);
    const int64_t nb = K / QBLOCK;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + b * 16)));
        const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + b * 16 + 16)));
        const float *xr = x + b * QBLOCK;
        __m512 t0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v0, low)), _mm512_loadu_ps(xr));
        __m512 t1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v1, low)), _mm512_loadu_ps(xr + 32));
        t0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4)), _mm512_loadu_ps(xr + 16), t0);
        t1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v1, 4)), _mm512_loadu_ps(xr + 48), t1);
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(sc[b]), t0, a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(sc[b + 1]), t1, a1);
    }
    if (b < nb) {
        const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + b * 16)));
        const float *xr = x + b * QBLOCK;
        __m512 t0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v0, low)), _mm512_loadu_ps(xr));
        t0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4)), _mm512_loadu_ps(xr + 16), t0);
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(sc[b]), t0, a0);
    }
    __m512 m = _mm512_setzero_ps();
    for (int64_t c = 0; c < nb; c += 16) {
        const __mmask16 k = nb - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - c)) - 1);
        m = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, mn + c), _mm512_maskz_loadu_ps(k, sx + c), m);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), m));
}

/* ---- one row of x on AVX-512 VNNI or AVX2: 16-bit activations, integer dot products ---
 *
 * Decode at batch 1 spends its time in the loops above decoding weights to float32 (an
 * integer widening, a conversion and a multiply-add per weight): measured here, the
 * float32 one-row kernel streamed ~65% of what a plain read of the same bytes does. On
 * VNNI (and on AVX2, below, with vpmaddwd) the weights stay integers: x's row is
 * quantized once per call to 16 bits per block of 32 (s = max|x| / 32639, xi = rint(x / s), |x - s xi| <= s / 2: 2^-16 of the block's
 * largest value, 256x finer than llama.cpp's 8-bit activations) and
 *   Q4: xi = 256 hi + lo (hi, lo int8), sum q xi = 256 dot(q, hi) + dot(q, lo), two
 *       vpdpbusd (u8 x s8) over 64 weights; the minimum times the block's float sum;
 *   Q8: sum q xi with vpdpwssd (int16 pairs);
 * each block's integer sum then times (weight scale x activation scale) in float32. The
 * integer sums are exact; the activation rounding is the error (README: accuracy). */
/* the paths whose one-row steps take 16-bit activation blocks: measured faster there
 * (README); plain AVX-512 (no VNNI) was level with its float32 row loop, so keeps it */
#define X16_ONE_ROW(isa) ((isa) == ISA_AVX512VNNI || (isa) == ISA_AVX2)
/* blocks this small (but not zero) would need 1/s past float32's range: the row keeps
 * the float32 path, as rows with inf or NaN do */
#define X16_TINY 1e-30f
#define X16_PAIR 64 /* bytes of hi (or lo) per two blocks: [A0..15 B0..15 A16..31 B16..31] */

typedef struct {
    int8_t *hi, *lo; /* Q4: [ceil(nb / 2) * X16_PAIR] each, the pair layout */
    int16_t *xi;     /* Q8: [nb * 32] */
    float *s, *t;    /* [nb]: activation scale, block sum of x */
} x16_row;

/* block b's activation scale from its largest |x| and its sum, both paths' one rule: 0,
 * or -1 where the block is not finite or tiny (the row keeps the float32 path); *inv the
 * multiplier to its 16-bit steps */
static inline int x16_block(x16_row *r, int64_t b, float amax, float sum, float *inv) {
    if (!(amax <= 3.0e38f) || !(fabsf(sum) <= 3.0e38f) || (amax > 0.0f && amax < X16_TINY)) return -1;
    const float s = amax / 32639.0f;
    r->s[b] = s;
    r->t[b] = sum;
    *inv = s > 0.0f ? 1.0f / s : 0.0f;
    return 0;
}

/* returns 0, or -1 where a block is not finite or tiny (the caller keeps the float32 path) */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static int x16_prepare(int kind, const float *x, int64_t K,
                                                                             x16_row *r) {
    const int64_t nb = K / QBLOCK;
    const __m512i lim = _mm512_set1_epi32(32639), nlim = _mm512_set1_epi32(-32639), half = _mm512_set1_epi32(128);
    for (int64_t b = 0; b < nb; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + b * QBLOCK), x1 = _mm512_loadu_ps(x + b * QBLOCK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1)); /* NaN stays NaN here, not in max */
        float inv;
        if (x16_block(r, b, amax, sum, &inv)) return -1;
        const __m512 iv = _mm512_set1_ps(inv);
        __m512i v[2] = {_mm512_cvtps_epi32(_mm512_mul_ps(x0, iv)), _mm512_cvtps_epi32(_mm512_mul_ps(x1, iv))};
        for (int i = 0; i < 2; i++) v[i] = _mm512_max_epi32(_mm512_min_epi32(v[i], lim), nlim);
        if (kind == KIND_Q8) {
            _mm256_storeu_si256((__m256i *)(r->xi + b * QBLOCK), _mm512_cvtepi32_epi16(v[0]));
            _mm256_storeu_si256((__m256i *)(r->xi + b * QBLOCK + 16), _mm512_cvtepi32_epi16(v[1]));
            continue;
        }
        int8_t *h = r->hi + (b / 2) * X16_PAIR + (b & 1) * 16, *l = r->lo + (b / 2) * X16_PAIR + (b & 1) * 16;
        for (int i = 0; i < 2; i++) { /* weights 0..15 at +0, 16..31 at +32 */
            const __m512i hv = _mm512_srai_epi32(_mm512_add_epi32(v[i], half), 8);
            const __m512i lv = _mm512_sub_epi32(v[i], _mm512_slli_epi32(hv, 8));
            _mm_storeu_si128((__m128i *)(h + 32 * i), _mm512_cvtepi32_epi8(hv));
            _mm_storeu_si128((__m128i *)(l + 32 * i), _mm512_cvtepi32_epi8(lv));
        }
    }
    if (kind == KIND_Q4 && nb % 2) /* the last pair's second block: zeros */
        for (int i = 0; i < 2; i++) {
            memset(r->hi + (nb / 2) * X16_PAIR + 16 + 32 * i, 0, 16);
            memset(r->lo + (nb / 2) * X16_PAIR + 16 + 32 * i, 0, 16);
        }
    return 0;
}

/* blocks b, b+1 of a Q4 row (w: their 32 bytes, the second block's zeros past an odd
 * end) against x's pair: the lanes' integer sums, 4 lanes per half block */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline __m512i
pair_q4_x16(__m512i w, const int8_t *hi, const int8_t *lo) {
    w = _mm512_mask_srli_epi16(w, (__mmask32)0xFFFF0000u, w, 4); /* upper half: the high nibbles */
    w = _mm512_and_si512(w, _mm512_set1_epi8(0x0F));
    const __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512((const void *)hi));
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(a, 8), w, _mm512_loadu_si512((const void *)lo));
}

/* the pair's lanes scaled: blocks b | b+1 | b | b+1 in groups of 4 lanes */
__attribute__((target("avx512f"), always_inline)) static inline __m512 pair_scale(const float *sc, const float *s,
                                                                                  int64_t b) {
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m128 c = _mm_mul_ps(_mm_castpd_ps(_mm_load_sd((const double *)(sc + b))),
                                _mm_castpd_ps(_mm_load_sd((const double *)(s + b))));
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(c));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static float row1_q4_x16(const x16_row *r, int64_t K,
                                                                                         const uint8_t *qs,
                                                                                         const float *sc,
                                                                                         const float *mn) {
    const int64_t nb = K / QBLOCK;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    int64_t b = 0;
    for (; b + 3 < nb; b += 4) { /* two pairs, two accumulator chains */
        const __m512i i0 = pair_q4_x16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + b * 16))),
                                       r->hi + (b / 2) * X16_PAIR, r->lo + (b / 2) * X16_PAIR);
        const __m512i i1 = pair_q4_x16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + b * 16 + 32))),
                                       r->hi + (b / 2 + 1) * X16_PAIR, r->lo + (b / 2 + 1) * X16_PAIR);
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), pair_scale(sc, r->s, b), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), pair_scale(sc, r->s, b + 2), a1);
    }
    for (; b < nb; b += 2) { /* a last pair, or a last single block (its partner zeros) */
        const int two = b + 1 < nb;
        const __m256i raw = _mm256_maskz_loadu_epi8(two ? 0xFFFFFFFFu : 0xFFFFu, (const void *)(qs + b * 16));
        const __m512i i0 = pair_q4_x16(_mm512_broadcast_i64x4(raw), r->hi + (b / 2) * X16_PAIR, r->lo + (b / 2) * X16_PAIR);
        const __m512 c = two ? pair_scale(sc, r->s, b) : _mm512_set1_ps(sc[b] * r->s[b]); /* B's lanes are 0 */
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), c, a0);
    }
    __m512 m = _mm512_setzero_ps();
    for (int64_t c = 0; c < nb; c += 16) {
        const __mmask16 k = nb - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - c)) - 1);
        m = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, mn + c), _mm512_maskz_loadu_ps(k, r->t + c), m);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), m));
}

/* a + Q8 block b (its 32 weights widened to int16 against xi, vpdpwssd) times its scales */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline __m512
block_q8_x16(const x16_row *r, const int8_t *qs, const float *sc, int64_t b, __m512 a) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qs + b * QBLOCK)));
    const __m512i i = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512((const void *)(r->xi + b * QBLOCK)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(sc[b] * r->s[b]), a);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static float row1_q8_x16(const x16_row *r, int64_t K,
                                                                                         const int8_t *qs,
                                                                                         const float *sc) {
    const int64_t nb = K / QBLOCK;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) { /* two blocks, two accumulator chains */
        a0 = block_q8_x16(r, qs, sc, b, a0);
        a1 = block_q8_x16(r, qs, sc, b + 1, a1);
    }
    if (b < nb) a0 = block_q8_x16(r, qs, sc, b, a0);
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

/* The same 16-bit activation blocks on AVX2 (no VNNI): x16_row.xi for both kinds,
 * vpmaddwd of int16 weights (Q4's nibbles or Q8's bytes widened) with xi, per block. */
__attribute__((target("avx2,fma"))) static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

__attribute__((target("avx2,fma"))) static int x16_prepare_avx2(const float *x, int64_t K, x16_row *r) {
    const int64_t nb = K / QBLOCK;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i lim = _mm256_set1_epi32(32639), nlim = _mm256_set1_epi32(-32639);
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + b * QBLOCK + 8 * i);
        const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                       _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
        const float amax = hmax256(a), sum = hsum256(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        float inv;
        if (x16_block(r, b, amax, sum, &inv)) return -1;
        const __m256 iv = _mm256_set1_ps(inv);
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv)), lim), nlim);
        /* packs works per 128-bit lane: the 64-bit quarters back in order */
        _mm256_storeu_si256((__m256i *)(r->xi + b * QBLOCK), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
        _mm256_storeu_si256((__m256i *)(r->xi + b * QBLOCK + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
    }
    return 0;
}

/* a + block b (its 32 weights widened to int16, two halves of 16, against xi) times its scales */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 block_x16_avx2(int kind, const x16_row *r,
                                                                                    const uint8_t *qs, const float *sc,
                                                                                    int64_t b, __m256 a) {
    const int16_t *xi = r->xi;
    __m256i w0, w1;
    if (kind == KIND_Q8) {
        w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + b * QBLOCK)));
        w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + b * QBLOCK + 16)));
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(qs + b * (QBLOCK / 2))), m4 = _mm_set1_epi8(0x0F);
        w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m4));
        w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
    }
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xi + b * QBLOCK));
    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xi + b * QBLOCK + 16));
    const __m256i i = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(sc[b] * r->s[b]), a);
}

__attribute__((target("avx2,fma"))) static float row1_x16_avx2(int kind, const x16_row *r, int64_t K,
                                                               const uint8_t *qs, const float *sc, const float *mn) {
    const int64_t nb = K / QBLOCK;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) { /* two blocks, two accumulator chains */
        a0 = block_x16_avx2(kind, r, qs, sc, b, a0);
        a1 = block_x16_avx2(kind, r, qs, sc, b + 1, a1);
    }
    if (b < nb) a0 = block_x16_avx2(kind, r, qs, sc, b, a0);
    float m = 0.0f;
    if (kind == KIND_Q4) {
        __m256 mv = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 8 <= nb; c += 8) mv = _mm256_fmadd_ps(_mm256_loadu_ps(mn + c), _mm256_loadu_ps(r->t + c), mv);
        m = hsum256(mv);
        for (; c < nb; c++) m += mn[c] * r->t[c];
    }
    return hsum256(_mm256_add_ps(a0, a1)) + m;
}

/* out [1, N] for one row of x on 16-bit activation blocks (AVX-512 VNNI, or AVX2); 1
 * where a block is not finite or tiny or scratch memory is short (the caller then runs the
 * float32 path), else 0 */
static int linear1_x16(int kind, int isa, const float *x, int64_t K, const uint8_t *qs, const float *scales,
                       const float *mins, int64_t N, const float *bias, float *out, int nthreads) {
    const int64_t nb = K / QBLOCK, pairs = (nb + 1) / 2, row_bytes = kind == KIND_Q8 ? K : K / 2;
    const int pair_layout = isa == ISA_AVX512VNNI && kind == KIND_Q4;
    const size_t ints = pair_layout ? (size_t)pairs * X16_PAIR * 2 : (size_t)nb * QBLOCK * 2;
    uint8_t *mem = (uint8_t *)malloc(ints + 2 * sizeof(float) * (size_t)nb + 64);
    if (!mem) return 1;
    x16_row r;
    r.hi = (int8_t *)mem, r.lo = r.hi + pairs * X16_PAIR, r.xi = (int16_t *)mem;
    r.s = (float *)(mem + ((ints + 63) & ~(size_t)63)), r.t = r.s + nb;
    if (isa == ISA_AVX512VNNI ? x16_prepare(kind, x, K, &r) : x16_prepare_avx2(x, K, &r)) {
        free(mem);
        return 1;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *q = qs + n * row_bytes;
        const float *sc = scales + n * nb, *mn = kind == KIND_Q4 ? mins + n * nb : NULL;
        float v;
        if (isa != ISA_AVX512VNNI)
            v = row1_x16_avx2(kind, &r, K, q, sc, mn);
        else if (kind == KIND_Q4)
            v = row1_q4_x16(&r, K, q, sc, mn);
        else
            v = row1_q8_x16(&r, K, (const int8_t *)q, sc);
        out[n] = v + (bias ? bias[n] : 0.0f);
    }
    free(mem);
    return 0;
}

/* Tiles of RT weight rows x up to MT rows of x: RT independent accumulator chains per x
 * row (one chain per weight row is latency-bound on the FMA), each block dequantized
 * once for all x rows, the same products in the same order as row_avx512 (so the same
 * bits). While a tile runs, the next tile's rows are prefetched: RT rows far apart in
 * memory are RT streams, more than the hardware prefetcher follows for long rows. */
__attribute__((target("avx512f"), always_inline)) static inline void tile_avx512_n(
    int kind, const float *x, int64_t mt, int64_t K, const uint8_t *qs, int64_t row_bytes, const float *sc,
    const float *mn, int prefetch, float out[RT][MT], const int MTC /* a constant: MT or 1 */) {
    __m512 acc[RT][MT];
    for (int r = 0; r < RT; r++)
        for (int m = 0; m < MTC; m++) acc[r][m] = _mm512_setzero_ps();
    const int64_t nb = K / QBLOCK, bb = kind == KIND_Q8 ? QBLOCK : QBLOCK / 2;
    for (int64_t b = 0; b < nb; b++) {
        if (prefetch) prefetch_next_tile(qs, row_bytes, sc, mn, nb, b, bb);
        for (int r = 0; r < RT; r++) {
            __m512 w0, w1;
            decode_avx512(kind, qs + r * row_bytes, b, sc[r * nb + b], mn ? mn[r * nb + b] : 0.0f, &w0, &w1);
            for (int m = 0; m < MTC; m++) {
                if (m >= mt) break;
                const float *xr = x + m * K + b * QBLOCK;
                acc[r][m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][m]));
            }
        }
    }
    for (int r = 0; r < RT; r++)
        for (int m = 0; m < mt; m++) out[r][m] = _mm512_reduce_add_ps(acc[r][m]);
}

/* specialized for one row of x (decode at batch 1: all RT x 1 accumulators in registers) */
__attribute__((target("avx512f"))) static void tile_avx512(int kind, const float *x, int64_t mt, int64_t K,
                                                           const uint8_t *qs, int64_t row_bytes, const float *sc,
                                                           const float *mn, int prefetch, float out[RT][MT]) {
    /* constant kind and row count: the branches leave the block loop */
    if (kind == KIND_Q4 && mt == 1)
        tile_avx512_n(KIND_Q4, x, 1, K, qs, row_bytes, sc, mn, prefetch, out, 1);
    else if (kind == KIND_Q4)
        tile_avx512_n(KIND_Q4, x, mt, K, qs, row_bytes, sc, mn, prefetch, out, MT);
    else if (mt == 1)
        tile_avx512_n(KIND_Q8, x, 1, K, qs, row_bytes, sc, NULL, prefetch, out, 1);
    else
        tile_avx512_n(KIND_Q8, x, mt, K, qs, row_bytes, sc, NULL, prefetch, out, MT);
}

/* AVX2 (16 vector registers): tiles for one row of x only; with more rows, row_avx2's
 * four x rows per weight row already give four chains (measured: README) */
__attribute__((target("avx2,fma"))) static void tile_avx2(int kind, const float *x, int64_t K, const uint8_t *qs,
                                                         int64_t row_bytes, const float *sc, const float *mn,
                                                         int prefetch, float out[RT]) {
    const int64_t nb = K / QBLOCK, bb = kind == KIND_Q8 ? QBLOCK : QBLOCK / 2;
    __m256 acc[RT];
    for (int r = 0; r < RT; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (prefetch) prefetch_next_tile(qs, row_bytes, sc, mn, nb, b, bb);
        const float *xr = x + b * QBLOCK;
        for (int r = 0; r < RT; r++) {
            __m256 w[4];
            decode_avx2(kind, qs + r * row_bytes, b, sc[r * nb + b], mn ? mn[r * nb + b] : 0.0f, w);
            acc[r] = dot_block_avx2(w, xr, acc[r]);
        }
    }
    for (int r = 0; r < RT; r++) out[r] = hsum256(acc[r]);
}
#endif

/* out [M, N] = x [M, K] @ dequant(w)^T (+ bias). Returns 0, -1 for a bad shape or kind,
 * -2 for a path this build lacks. */
int plait_quant_linear_f32(int kind, int isa, const float *x, int64_t M, int64_t K, const void *qs_,
                           const float *scales, const float *mins, int64_t N, const float *bias, float *out,
                           int nthreads) {
    const uint8_t *qs = (const uint8_t *)qs_;
    if (K % QBLOCK || M < 0 || N < 0 || (kind != KIND_Q8 && kind != KIND_Q4) || (kind == KIND_Q4 && !mins) ||
        isa < ISA_PORTABLE || isa > ISA_AVX512VNNI)
        return -1;
#ifndef PLAIT_X86
    if (isa != ISA_PORTABLE) return -2;
#endif
    const int64_t nb = K / QBLOCK, row_bytes = kind == KIND_Q8 ? K : K / 2;
    if (nthreads < 1) nthreads = 1;
#ifdef PLAIT_X86
    if (X16_ONE_ROW(isa) && M == 1 && linear1_x16(kind, isa, x, K, qs, scales, mins, N, bias, out, nthreads) == 0)
        return 0;
    if (isa != ISA_PORTABLE) {
        /* Measured (README): AVX-512 with one row of x row by row with four accumulators
         * (row1_avx512: a tile's four rows are four streams, slower there), else in
         * tiles, from PANEL_MIN_ROWS rows in panels; AVX2 in tiles with one row of x, else row
         * by row (four x rows). The rows after the tiles, one at a time, below. */
        const int panels = isa >= ISA_AVX512 && M >= PANEL_MIN_ROWS;
        const int tiled = panels || (isa >= ISA_AVX512 ? M > 1 : M == 1);
        const int64_t tiles = tiled ? N / RT : 0;
        /* panels: x in blocks of PANEL_M rows, which stay in L2 while every tile passes over them */
        for (int64_t m0 = 0; panels && m0 < M; m0 += PANEL_M) {
            const int64_t mb = M - m0 < PANEL_M ? M - m0 : PANEL_M;
#pragma omp parallel for num_threads(nthreads) schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t n = t * RT;
                panel_avx512(kind, x + m0 * K, mb, K, qs + n * row_bytes, row_bytes, scales + n * nb,
                             kind == KIND_Q4 ? mins + n * nb : NULL, out + m0 * N + n, N, bias ? bias + n : NULL);
            }
        }
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t t = 0; t < (panels ? 0 : tiles); t++) {
            const int64_t n = t * RT;
            const uint8_t *q = qs + n * row_bytes;
            const float *sc = scales + n * nb, *mn = kind == KIND_Q4 ? mins + n * nb : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += MT) {
                const int64_t mt = M - m0 < MT ? M - m0 : MT;
                float acc[RT][MT];
                const int prefetch = m0 == 0 && t + 1 < tiles;
                if (isa >= ISA_AVX512) {
                    tile_avx512(kind, x + m0 * K, mt, K, q, row_bytes, sc, mn, prefetch, acc);
                } else {
                    float one[RT];
                    tile_avx2(kind, x, K, q, row_bytes, sc, mn, prefetch, one);
                    for (int r = 0; r < RT; r++) acc[r][0] = one[r];
                }
                for (int r = 0; r < RT; r++)
                    for (int64_t m = 0; m < mt; m++) out[(m0 + m) * N + n + r] = acc[r][m] + (bias ? bias[n + r] : 0.0f);
            }
        }
        float sx[SX_MAX]; /* one row of x, Q4: its block sums (row1f_q4_avx512) */
        const int factored = isa >= ISA_AVX512 && M == 1 && kind == KIND_Q4 && nb <= SX_MAX;
        if (factored)
            for (int64_t b = 0; b < nb; b++) {
                float t = 0.0f;
                for (int j = 0; j < QBLOCK; j++) t += x[b * QBLOCK + j];
                sx[b] = t;
            }
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t n = tiles * RT; n < N; n++) { /* the rows after the tiles, one at a time */
            const uint8_t *q = qs + n * row_bytes;
            const float *sc = scales + n * nb, *mn = kind == KIND_Q4 ? mins + n * nb : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += MT) {
                const int64_t mt = M - m0 < MT ? M - m0 : MT;
                float acc[MT];
                if (factored)
                    acc[0] = row1f_q4_avx512(x, sx, K, q, sc, mn);
                else if (isa >= ISA_AVX512 && M == 1)
                    acc[0] = row1_avx512(kind, x, K, q, sc, mn);
                else if (isa >= ISA_AVX512)
                    row_avx512(kind, x + m0 * K, mt, K, q, sc, mn, acc);
                else
                    row_avx2(kind, x + m0 * K, mt, K, q, sc, mn, acc);
                for (int64_t m = 0; m < mt; m++) out[(m0 + m) * N + n] = acc[m] + (bias ? bias[n] : 0.0f);
            }
        }
        return 0;
    }
#endif
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *q = qs + n * row_bytes;
        const float *sc = scales + n * nb, *mn = kind == KIND_Q4 ? mins + n * nb : NULL;
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int64_t mt = M - m0 < MT ? M - m0 : MT;
            float acc[MT];
            row_portable(kind, x + m0 * K, mt, K, q, sc, mn, acc);
            for (int64_t m = 0; m < mt; m++) out[(m0 + m) * N + n] = acc[m] + b;
        }
    }
    return 0;
}

/* w [N, K] float32 = dequant(blocks), for GEMMs with many rows (run by the caller's BLAS). */
int plait_quant_dequant_f32(int kind, int isa, const void *qs_, const float *scales, const float *mins, int64_t N,
                            int64_t K, float *w, int nthreads) {
    const uint8_t *qs = (const uint8_t *)qs_;
    if (K % QBLOCK || N < 0 || (kind != KIND_Q8 && kind != KIND_Q4) || (kind == KIND_Q4 && !mins)) return -1;
#ifndef PLAIT_X86
    if (isa != ISA_PORTABLE) return -2;
#endif
    const int64_t nb = K / QBLOCK, row_bytes = kind == KIND_Q8 ? K : K / 2, bb = kind == KIND_Q8 ? QBLOCK : QBLOCK / 2;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *q = qs + n * row_bytes;
        const float *sc = scales + n * nb, *mn = kind == KIND_Q4 ? mins + n * nb : NULL;
#ifdef PLAIT_X86
        if (isa >= ISA_AVX512) {
            dequant_row_avx512(kind, q, sc, mn, nb, w + n * K);
            continue;
        }
        if (isa == ISA_AVX2) {
            dequant_row_avx2(kind, q, sc, mn, nb, w + n * K);
            continue;
        }
#endif
        for (int64_t b = 0; b < nb; b++) dequant_block_c(kind, q + b * bb, sc[b], mn ? mn[b] : 0.0f, w + n * K + b * QBLOCK);
    }
    return 0;
}

/* ---- a whole decode step of a quantized decoder (plait.runtime.models.fused_decode) ----
 *
 * One call runs every layer of a Llama-family decoder for B tokens: decode tokens and
 * the tokens of prefill chunks alike, each with its own position, pool slot, page-table
 * row and context length (a chunk's token attends to its request's tokens up to its own
 * position: its K/V and those of the chunk's earlier tokens are stored before any row
 * attends). Per layer: RMSNorm with the residual add, the fused q/k/v projection (+
 * bias), rotary (HF's rotate_half layout, cos | sin rows looked up by position), the K/V
 * store into the pool's slots, attention through the caller's function
 * (plait_paged_decode_f32 of the native attention library, one query row per token),
 * the output projection, the MLP (fused gate/up, SiLU(gate) * up, down) and the final
 * norm. The projections run on the quantized kernels above or, for float32 weights, on
 * the native GEMM through the step's function pointer; the small per-token work
 * (norms, rotary, SiLU) on the calling thread, in threads for larger batches. What it
 * saves is the per-operation dispatch of ~25 torch and ctypes calls per layer, most of a
 * batch-1 step's time outside the GEMMs (README). */

/* a projection of the fused path that is not quantized: float32 packed for the native
 * GEMM (plait.kernels.gemm_cpu.pack), multiplied by the step's gemm function */
#define KIND_F32_PACKED 100

typedef int (*plait_gemm_fn)(int, int64_t, int64_t, int64_t, const float *, int64_t, const float *, float *, int64_t,
                             int, int);

typedef struct {
    int kind;            /* KIND_Q8 / KIND_Q4 / KIND_F32_PACKED (qs: the packed panels) */
    int64_t N, K;        /* out, in features */
    const void *qs;
    const float *scales, *mins, *bias; /* mins: Q4 only; bias may be NULL */
} plait_qweight;

typedef struct {
    plait_qweight qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* [hidden] */
    float *k_buf, *v_buf;                /* [slots, KVH, D] this layer's pool */
} plait_qlayer;

typedef int (*plait_attn_fn)(const float *, int64_t, const float *, const float *, const int32_t *, int64_t,
                             const int64_t *, const int64_t *, const int64_t *, float *, int64_t, int64_t, int64_t,
                             int64_t, float, int);

typedef struct {
    int64_t B, hidden, H, KVH, D, inter;
    float eps, scale;
    const float *cos_sin;        /* [rows, D]: cos (D/2) | sin (D/2) */
    const int64_t *positions;    /* [B] rows of cos_sin */
    const int64_t *slots;        /* [B] pool slot of each new token */
    const int32_t *table;        /* page table [rows, table_stride] */
    int64_t table_stride;
    const int64_t *req_rows, *seq_lens; /* [B] */
    const float *final_norm;
    /* scratch, [B, n] each */
    float *x, *residual, *xn, *qkv, *attn, *gu, *act;
    float *out;                  /* [B, hidden]: final norm of the last residual */
    /* KIND_F32_PACKED weights: plait_gemm_f32 of the native GEMM library, its ISA code,
     * and the row count from which it prefetches (plait.kernels.gemm_cpu) */
    plait_gemm_fn gemm;
    int64_t gemm_isa, gemm_prefetch_rows;
} plait_decode_step;

static int qlinear(const plait_qweight *w, int isa, const plait_decode_step *s, const float *x, int64_t M, float *out,
                   int nthreads) {
    if (w->kind != KIND_F32_PACKED)
        return plait_quant_linear_f32(w->kind, isa, x, M, w->K, w->qs, w->scales, w->mins, w->N, w->bias, out, nthreads);
    if (!s->gemm) return -1;
    const int rc = s->gemm((int)s->gemm_isa, M, w->N, w->K, x, w->K, (const float *)w->qs, out, w->N, nthreads,
                           M >= s->gemm_prefetch_rows);
    if (rc == 0 && w->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < w->N; n++) out[m * w->N + n] += w->bias[n];
    return rc;
}

/* residual = x + residual (add) or x (!add); out = rmsnorm(residual) * w, per row */
static void add_rmsnorm(const float *x, float *residual, int add, const float *w, float eps, int64_t B, int64_t D,
                        float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (B >= 8)
    for (int64_t b = 0; b < B; b++) {
        const float *xr = x + b * D;
        float *r = residual + b * D, *o = out + b * D;
        double ss = 0.0;
        for (int64_t i = 0; i < D; i++) {
            const float v = add ? xr[i] + r[i] : xr[i];
            r[i] = v;
            ss += (double)v * v;
        }
        const float inv = 1.0f / sqrtf((float)(ss / D) + eps);
        for (int64_t i = 0; i < D; i++) o[i] = w[i] * (r[i] * inv);
    }
}

/* The MLP's activation a = silu(g) * u over one row of I values, the vector paths on
 * vexp.h's exp: the scalar libm expf per value was ~4 % of a float32 fused step with a
 * prompt chunk (40 rows x 1536 x 30 layers per step). */
#ifdef PLAIT_X86
__attribute__((target("avx512f"))) static void silu_mul_avx512(const float *g, const float *u, float *a, int64_t I) {
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = vexp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)); /* exp(-g) */
        _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                              _mm512_loadu_ps(u + i)));
    }
    for (; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
__attribute__((target("avx2,fma"))) static void silu_mul_avx2(const float *g, const float *u, float *a, int64_t I) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = vexp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                              _mm256_loadu_ps(u + i)));
    }
    for (; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
#endif

static void silu_mul(int isa, const float *g, const float *u, float *a, int64_t I) {
#ifdef PLAIT_X86
    if (isa >= ISA_AVX512) {
        silu_mul_avx512(g, u, a, I);
        return;
    }
    if (isa == ISA_AVX2) {
        silu_mul_avx2(g, u, a, I);
        return;
    }
#else
    (void)isa;
#endif
    for (int64_t i = 0; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

int plait_fused_decode_f32(int isa, const plait_qlayer *layers, int64_t n_layers, const plait_decode_step *s,
                           plait_attn_fn attend, int nthreads) {
    const int64_t B = s->B, hid = s->hidden, H = s->H, KVH = s->KVH, D = s->D, I = s->inter, half = D / 2;
    const int64_t nqkv = (H + 2 * KVH) * D;
    if (B < 1 || D % 2) return -1;
    for (int64_t l = 0; l < n_layers; l++) {
        const plait_qlayer *L = &layers[l];
        if (L->qkv.N != nqkv || L->qkv.K != hid || L->o.N != hid || L->o.K != H * D || L->gate_up.N != 2 * I ||
            L->gate_up.K != hid || L->down.N != hid || L->down.K != I)
            return -1;
    }
    int rc = 0;
    for (int64_t l = 0; l < n_layers && rc == 0; l++) {
        const plait_qlayer *L = &layers[l];
        add_rmsnorm(s->x, s->residual, l > 0, L->input_norm, s->eps, B, hid, s->xn, nthreads);
        if ((rc = qlinear(&L->qkv, isa, s, s->xn, B, s->qkv, nthreads))) break;
        for (int64_t b = 0; b < B; b++) {
            float *row = s->qkv + b * nqkv;
            const float *cs = s->cos_sin + s->positions[b] * D;
            for (int64_t h = 0; h < H + KVH; h++) { /* q heads then k heads */
                float *v = row + h * D;
                for (int64_t j = 0; j < half; j++) {
                    const float a = v[j], c = v[j + half];
                    v[j] = a * cs[j] + c * -cs[half + j];
                    v[j + half] = c * cs[j] + a * cs[half + j];
                }
            }
            memcpy(L->k_buf + s->slots[b] * KVH * D, row + H * D, (size_t)(KVH * D) * sizeof(float));
            memcpy(L->v_buf + s->slots[b] * KVH * D, row + (H + KVH) * D, (size_t)(KVH * D) * sizeof(float));
        }
        if ((rc = attend(s->qkv, nqkv, L->k_buf, L->v_buf, s->table, s->table_stride, s->req_rows, s->seq_lens, NULL,
                         s->attn, B, H, KVH, D, s->scale, nthreads)))
            break;
        if ((rc = qlinear(&L->o, isa, s, s->attn, B, s->x, nthreads))) break;
        add_rmsnorm(s->x, s->residual, 1, L->post_norm, s->eps, B, hid, s->xn, nthreads);
        if ((rc = qlinear(&L->gate_up, isa, s, s->xn, B, s->gu, nthreads))) break;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (B >= 4)
        for (int64_t b = 0; b < B; b++) {
            const float *g = s->gu + b * 2 * I;
            silu_mul(isa, g, g + I, s->act + b * I, I);
        }
        if ((rc = qlinear(&L->down, isa, s, s->act, B, s->x, nthreads))) break;
    }
    if (rc == 0) add_rmsnorm(s->x, s->residual, n_layers > 0, s->final_norm, s->eps, B, hid, s->out, nthreads);
    return rc;
}

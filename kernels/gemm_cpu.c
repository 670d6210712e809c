/* float32 GEMM for CPUs with the weight read overlapped with the arithmetic, the native
 * half of plait.kernels.gemm_cpu.
 *
 *   out[m, n] = sum_k x[m, k] * w[n, k]     x [M, K] (row stride ldx), out [M, N] (row stride ldo)
 *
 * (a bias is added by the caller)
 *
 * The weight is packed once at load into panels of 16 output columns, each panel
 * contiguous over K ([panels][K][16], zero-padded to a multiple of GROUP panels): a panel
 * row is one 64-byte line. A group of GROUP panels (32 columns) is multiplied against
 * tiles of rows of x held in registers (AVX-512: 12 rows x 32 columns, 24 accumulators;
 * AVX2: 6 rows x 16 columns, 12), one broadcast of x per row and k, so a weight line is
 * read once per tile from L2 and once per call from memory.
 *
 * Why not oneDNN's GEMM alone: at the row counts of serving (a decode batch, a decode
 * batch plus a prefill chunk: 8-128 rows) a GEMM over weights that do not stay in cache
 * costs the weight read plus the arithmetic; its hardware prefetch restarts at every 4 KB
 * page and the two do not overlap. Here, while a group's tiles run, the next group's
 * weight lines are software-prefetched into L2, spread evenly over the tiles of the first
 * block of rows, so the read of the next group overlaps the arithmetic on this one
 * (README: measured against oneDNN per row count).
 *
 * Rows are taken in blocks that stay in L2 (ROW_BLOCK_BYTES of x); groups are split over
 * OpenMP threads. Sums run over k in order, one accumulator per output: a result differs
 * from MKL's or oneDNN's in the last bits only.
 *
 * Paths: AVX-512F and AVX2+FMA, compiled per function with target attributes so one
 * library serves any x86-64 CPU; the caller picks one from the CPU's flags. A path the
 * library was not compiled with (a non-x86 compiler) returns -2.
 */
#include <stdint.h>
#include <stddef.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PLAIT_X86 1
#endif

#define PANEL 16 /* output columns per panel */
#define GROUP 2  /* panels per group (the packed layout's padding unit) */
#define MR512 12 /* AVX-512 tile rows */
#define MR256 6  /* AVX2 tile rows */
#define ROW_BLOCK_BYTES 1048576 /* x rows per block: this many bytes of x (half an L2 of 2 MB; 256 KB was ~8% slower at 2048 rows) */

enum { ISA_AVX2 = 1, ISA_AVX512 = 2 };

/* Prefetch lines [*next, upto) of the next group into L2. */
static inline void prefetch_lines(const char *base, int64_t *next, int64_t upto) {
#ifdef PLAIT_X86
    for (; *next < upto; (*next)++) _mm_prefetch(base + *next * 64, _MM_HINT_T1);
#else
    (void)base, (void)next, (void)upto;
#endif
}

#ifdef PLAIT_X86
/* rows (<= MR512, a constant after inlining) x GROUP*PANEL columns. pf: the next group's
 * lines [pf_lo, pf_hi) to prefetch during this tile (pf NULL: none). */
__attribute__((target("avx512f"), always_inline)) static inline void tile512(
    const int rows, const float *x, int64_t ldx, const float *w, int64_t K, float *y, int64_t ldy,
    int ncols, const char *pf, int64_t pf_lo, int64_t pf_hi) {
    __m512 a[MR512][GROUP];
#pragma GCC unroll 12
    for (int r = 0; r < MR512; r++)
#pragma GCC unroll 2
        for (int j = 0; j < GROUP; j++) a[r][j] = _mm512_setzero_ps();
    int64_t next = pf_lo;
    const int64_t K8 = K & ~(int64_t)7;
    int64_t k = 0;
    for (; k < K8; k += 8) {
        if (pf) prefetch_lines(pf, &next, pf_lo + (pf_hi - pf_lo) * (k + 8) / K);
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) {
            __m512 v[GROUP];
#pragma GCC unroll 2
            for (int j = 0; j < GROUP; j++) v[j] = _mm512_load_ps(w + (j * K + k + u) * PANEL);
#pragma GCC unroll 12
            for (int r = 0; r < MR512; r++) {
                if (r < rows) {
                    const __m512 b = _mm512_set1_ps(x[r * ldx + k + u]);
#pragma GCC unroll 2
                    for (int j = 0; j < GROUP; j++) a[r][j] = _mm512_fmadd_ps(b, v[j], a[r][j]);
                }
            }
        }
    }
    for (; k < K; k++) {
        __m512 v[GROUP];
#pragma GCC unroll 2
        for (int j = 0; j < GROUP; j++) v[j] = _mm512_load_ps(w + (j * K + k) * PANEL);
#pragma GCC unroll 12
        for (int r = 0; r < MR512; r++) {
            if (r < rows) {
                const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 2
                for (int j = 0; j < GROUP; j++) a[r][j] = _mm512_fmadd_ps(b, v[j], a[r][j]);
            }
        }
    }
    if (pf) prefetch_lines(pf, &next, pf_hi);
    /* (every loop over the accumulators unrolled: they stay in registers) */
#pragma GCC unroll 12
    for (int r = 0; r < MR512; r++) {
        if (r < rows) {
#pragma GCC unroll 2
            for (int j = 0; j < GROUP; j++) {
                const int n = ncols - PANEL * j;
                if (n >= PANEL)
                    _mm512_storeu_ps(y + r * ldy + PANEL * j, a[r][j]);
                else if (n > 0)
                    _mm512_mask_storeu_ps(y + r * ldy + PANEL * j, (__mmask16)((1u << n) - 1), a[r][j]);
            }
        }
    }
}

__attribute__((target("avx512f"))) static void tile512_any(int rows, const float *x, int64_t ldx, const float *w,
                                                           int64_t K, float *y, int64_t ldy,
                                                           int ncols, const char *pf, int64_t lo, int64_t hi) {
    /* a constant row count per case: the row loops unroll and the accumulators stay in registers */
#define T512(R) case R: tile512(R, x, ldx, w, K, y, ldy, ncols, pf, lo, hi); break;
    switch (rows) { T512(1) T512(2) T512(3) T512(4) T512(5) T512(6) T512(7) T512(8) T512(9) T512(10) T512(11) T512(12) }
#undef T512
}

/* rows (<= MR256) x one panel (two 8-float vectors) */
__attribute__((target("avx2,fma"), always_inline)) static inline void tile256(
    const int rows, const float *x, int64_t ldx, const float *w, int64_t K, float *y, int64_t ldy,
    int ncols, const char *pf, int64_t pf_lo, int64_t pf_hi) {
    __m256 a[MR256][2];
#pragma GCC unroll 6
    for (int r = 0; r < MR256; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    int64_t next = pf_lo;
    const int64_t K8 = K & ~(int64_t)7;
    int64_t k = 0;
    for (; k < K8; k += 8) {
        if (pf) prefetch_lines(pf, &next, pf_lo + (pf_hi - pf_lo) * (k + 8) / K);
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) {
            const __m256 v0 = _mm256_load_ps(w + (k + u) * PANEL), v1 = _mm256_load_ps(w + (k + u) * PANEL + 8);
#pragma GCC unroll 6
            for (int r = 0; r < MR256; r++) {
                if (r < rows) {
                    const __m256 b = _mm256_broadcast_ss(x + r * ldx + k + u);
                    a[r][0] = _mm256_fmadd_ps(b, v0, a[r][0]);
                    a[r][1] = _mm256_fmadd_ps(b, v1, a[r][1]);
                }
            }
        }
    }
    for (; k < K; k++) {
        const __m256 v0 = _mm256_load_ps(w + k * PANEL), v1 = _mm256_load_ps(w + k * PANEL + 8);
#pragma GCC unroll 6
        for (int r = 0; r < MR256; r++) {
            if (r < rows) {
                const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
                a[r][0] = _mm256_fmadd_ps(b, v0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(b, v1, a[r][1]);
            }
        }
    }
    if (pf) prefetch_lines(pf, &next, pf_hi);
#pragma GCC unroll 6
    for (int r = 0; r < MR256; r++) {
        if (r < rows) {
            float *yr = y + r * ldy;
            if (ncols >= PANEL) {
                _mm256_storeu_ps(yr, a[r][0]);
                _mm256_storeu_ps(yr + 8, a[r][1]);
            } else {
                float tmp[PANEL];
                _mm256_storeu_ps(tmp, a[r][0]);
                _mm256_storeu_ps(tmp + 8, a[r][1]);
                for (int c = 0; c < ncols; c++) yr[c] = tmp[c];
            }
        }
    }
}

__attribute__((target("avx2,fma"))) static void tile256_any(int rows, const float *x, int64_t ldx, const float *w,
                                                            int64_t K, float *y, int64_t ldy,
                                                            int ncols, const char *pf, int64_t lo, int64_t hi) {
#define T256(R) case R: tile256(R, x, ldx, w, K, y, ldy, ncols, pf, lo, hi); break;
    switch (rows) { T256(1) T256(2) T256(3) T256(4) T256(5) T256(6) }
#undef T256
}
#endif

/* out [M, ldo] = x [M, ldx] @ W^T for W packed by plait.kernels.gemm_cpu.pack
 * ([ceil(N / 32) * 2][K][16]). prefetch: software-prefetch the next group's weights.
 * Returns 0, -1 for a bad argument, -2 for a path this build lacks. */
int plait_gemm_f32(int isa, int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *w,
                   float *out, int64_t ldo, int nthreads, int prefetch) {
    if (M < 0 || N <= 0 || K <= 0 || ldx < K || ldo < N || (isa != ISA_AVX2 && isa != ISA_AVX512)) return -1;
    if ((uintptr_t)w % 64) return -1; /* aligned panel loads */
#ifndef PLAIT_X86
    (void)x, (void)out, (void)nthreads, (void)prefetch;
    return -2;
#else
    if (M == 0) return 0;
    if (nthreads < 1) nthreads = 1;
    const int64_t groups = (N + GROUP * PANEL - 1) / (GROUP * PANEL);
    const int mr = isa == ISA_AVX512 ? MR512 : MR256;
    int64_t block = ROW_BLOCK_BYTES / (K * (int64_t)sizeof(float)) / mr * mr;
    if (block < mr) block = mr;
    const int64_t group_floats = GROUP * K * PANEL, group_lines = group_floats * (int64_t)sizeof(float) / 64;
#pragma omp parallel num_threads(nthreads)
    for (int64_t m0 = 0; m0 < M; m0 += block) {
        const int64_t m1 = m0 + block < M ? m0 + block : M;
        const int64_t tiles = (m1 - m0 + mr - 1) / mr;
        /* every thread takes the same groups for every block (static): its weights stay warm */
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < groups; g++) {
            const float *wg = w + g * group_floats;
            const int64_t n0 = g * GROUP * PANEL;
            const int ncols = (int)(N - n0 < GROUP * PANEL ? N - n0 : GROUP * PANEL);
            /* the next group's lines, spread over this group's passes in the first row block */
            const char *pf = prefetch && m0 == 0 && g + 1 < groups ? (const char *)(wg + group_floats) : NULL;
            if (isa == ISA_AVX512) {
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t m = m0 + t * mr;
                    const int rows = (int)(m1 - m < mr ? m1 - m : mr);
                    tile512_any(rows, x + m * ldx, ldx, wg, K, out + m * ldo + n0, ldo, ncols, pf,
                                group_lines * t / tiles, group_lines * (t + 1) / tiles);
                }
            } else {
                for (int j = 0; j < GROUP; j++) {
                    const int nc = ncols - PANEL * j;
                    if (nc <= 0) break;
                    for (int64_t t = 0; t < tiles; t++) {
                        const int64_t m = m0 + t * mr, pass = j * tiles + t;
                        const int rows = (int)(m1 - m < mr ? m1 - m : mr);
                        tile256_any(rows, x + m * ldx, ldx, wg + j * K * PANEL, K, out + m * ldo + n0 + PANEL * j, ldo, nc < PANEL ? nc : PANEL, pf,
                                    group_lines * pass / (GROUP * tiles), group_lines * (pass + 1) / (GROUP * tiles));
                    }
                }
            }
        }
    }
    return 0;
#endif
}

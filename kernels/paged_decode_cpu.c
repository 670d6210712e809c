/* Paged decode attention for CPUs (float32), the native half of plait.kernels.cpu_attention.
 *
 * One query token per request attends to the request's whole context, read in place
 * from the paged K/V pool through the page table: no gathered copy of the K/V is made.
 * Work items are requests, or (request, KV head) pairs when there are too few requests
 * for the threads, spread over OpenMP threads; an item scores its query heads against
 * BLOCK keys at a time and folds the block into an online softmax, so every K and V row
 * is read once. Pages are scattered in memory, so the reads of the key PREFETCH_AHEAD
 * positions on are started early.
 *
 * Where the compiler targets AVX-512 and the head dim is a multiple of 16, items run an
 * intrinsics path (one horizontal sum per score, exp on 16 lanes, V accumulated in
 * registers); elsewhere the portable C path (one KV head per item), which compilers
 * vectorize less well. On the 2-core development machine the AVX-512 path reads the
 * K/V at ~30 GB/s, 2.5x the torch backend's gather + SDPA.
 *
 * Built by plait.kernels.cpu_attention with the system's C compiler and loaded with
 * ctypes; shapes are checked on the Python side.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vexp.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BLOCK 64       /* keys scored before each online-softmax update */
#define MAX_GROUP 16   /* query heads per KV head */
#define MAX_DIM 256    /* head dim */
#define PREFETCH_AHEAD 32  /* keys: two 16-token pages */
#define MAX_ITEM_HEADS 64  /* query heads of one AVX-512 item (all of a request's, when it takes them all) */

/* exp(x) for x <= 0 without a libm call: x = n ln2 + r
 * with |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial (relative error < 1e-7),
 * 2^n by building the float's exponent bits. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f;  /* ln2, split for an exact product */
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Online-softmax update of one query head's block of scores: turns sg[0..n) into
 * exp(score - new max) in place, updates the running max and sum, and returns the
 * factor the accumulated output must be scaled by. */
static inline float softmax_block(float *sg_, int64_t n, float *m, float *l) {
    float *sg = __builtin_assume_aligned(sg_, 64);  /* rows of the callers' aligned score blocks */
    float block_max = sg[0];
#pragma omp simd reduction(max : block_max)
    for (int64_t j = 1; j < n; ++j) block_max = sg[j] > block_max ? sg[j] : block_max;
    const float new_m = block_max > *m ? block_max : *m;
    const float correction = *m == -INFINITY ? 0.0f : exp_nonpositive(*m - new_m);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
        const float p = exp_nonpositive(sg[j] - new_m);
        sg[j] = p;
        sum += p;
    }
    *l = *l * correction + sum;
    *m = new_m;
    return correction;
}

/* One (request, KV head) item, portable C. q: the group's queries [group, D];
 * k/v: the buffers offset to this KV head, rows row_stride apart; out: [group, D]. */
static void attend_generic(const float *q, const float *k, const float *v, int64_t row_stride, const int32_t *slots,
                           int64_t len, int64_t group, int64_t D, float scale, float *out) {
    float qs[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM], s[MAX_GROUP * BLOCK] __attribute__((aligned(64)));
    float m[MAX_GROUP], l[MAX_GROUP];
    for (int64_t g = 0; g < group; ++g) {
        for (int64_t d = 0; d < D; ++d) {
            qs[g * D + d] = q[g * D + d] * scale;
            acc[g * D + d] = 0.0f;
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < len; j0 += BLOCK) {
        const int64_t n = len - j0 < BLOCK ? len - j0 : BLOCK;
        for (int64_t j = 0; j < n; ++j) {
            const float *kr = k + (int64_t)slots[j0 + j] * row_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float *qg = qs + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; ++d) dot += qg[d] * kr[d];
                s[g * BLOCK + j] = dot;
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            const float correction = softmax_block(s + g * BLOCK, n, m + g, l + g);
            float *ag = acc + g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] *= correction;
        }
        for (int64_t j = 0; j < n; ++j) {
            const float *vr = v + (int64_t)slots[j0 + j] * row_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float p = s[g * BLOCK + j];
                float *ag = acc + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ag[d] += p * vr[d];
            }
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.0f / l[g];
        for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
    }
}

#if defined(__AVX512F__)
/* softmax_block on 16 lanes at a time; lanes past n are masked off. */
static inline float softmax_block16(float *sg, int64_t n, float *m, float *l) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, sg + j));
    }
    const float block_max = _mm512_reduce_max_ps(vmax);
    const float new_m = block_max > *m ? block_max : *m;
    const float correction = *m == -INFINITY ? 0.0f : exp_nonpositive(*m - new_m);
    const __m512 vm = _mm512_set1_ps(new_m);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512 p = vexp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + j), vm));
        _mm512_mask_storeu_ps(sg + j, k, p);
        vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(k, p));
    }
    *l = *l * correction + _mm512_reduce_add_ps(vsum);
    *m = new_m;
    return correction;
}

/* One query row's accumulators acc[0..nv) scaled by its softmax correction, then
 * p_j * V_j added for the n keys at slots (probabilities p), and stored back. */
static inline __attribute__((always_inline)) void pv_accumulate512(__m512 *acc, float correction, const float *p,
                                                                   const float *v, const int32_t *slots, int64_t n,
                                                                   int64_t row_stride, int64_t nv) {
    __m512 a[MAX_DIM / 16];
    const __m512 c = _mm512_set1_ps(correction);
    for (int64_t i = 0; i < nv; ++i) a[i] = _mm512_mul_ps(acc[i], c);
    for (int64_t j = 0; j < n; ++j) {
        const float *vr = v + (int64_t)slots[j] * row_stride;
        const __m512 pj = _mm512_set1_ps(p[j]);
        for (int64_t i = 0; i < nv; ++i) a[i] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16 * i), a[i]);
    }
    for (int64_t i = 0; i < nv; ++i) acc[i] = a[i];
}

/* out [nq, D] = the accumulators over each row's softmax sum. */
static inline __attribute__((always_inline)) void finish512(const __m512 *acc, const float *l, int64_t nq, int64_t nv,
                                                            float *out) {
    for (int64_t r = 0; r < nq; ++r) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(out + r * nv * 16 + 16 * i, _mm512_mul_ps(acc[r * nv + i], inv));
    }
}

/* The same work with AVX-512 intrinsics, for `nh` consecutive KV heads at once (each
 * key's rows for all of them are read together); D a multiple of 16 (a constant where
 * inlined for the common head dims, so the loops over D unroll and the accumulators
 * stay in registers). q and out: [nh * group, D]; k, v offset to the first KV head.
 * row_len: NULL (every row sees `len` keys) or each row's own count (<= len, >= 1): the
 * query rows of consecutive tokens of one prompt chunk, each seeing the keys up to its
 * own position (a masked key's weight is exp(-87 - max) ~ 1e-38 of the row's sum). */
static inline __attribute__((always_inline)) void attend_avx512(
    const float *q, const float *k, const float *v, int64_t row_stride, const int32_t *slots, int64_t len,
    int64_t nh, int64_t group, const int64_t D, float scale, float *out, const int64_t *row_len) {
    const int64_t nv = D / 16, nq = nh * group;
    __m512 qv[MAX_ITEM_HEADS * MAX_DIM / 16], acc[MAX_ITEM_HEADS * MAX_DIM / 16];
    float s[MAX_ITEM_HEADS * BLOCK] __attribute__((aligned(64)));
    float m[MAX_ITEM_HEADS], l[MAX_ITEM_HEADS], corr[MAX_ITEM_HEADS];
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < nq; ++r) {
        for (int64_t i = 0; i < nv; ++i) {
            qv[r * nv + i] = _mm512_mul_ps(_mm512_loadu_ps(q + r * D + 16 * i), vscale);
            acc[r * nv + i] = _mm512_setzero_ps();
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < len; j0 += BLOCK) {
        const int64_t n = len - j0 < BLOCK ? len - j0 : BLOCK;
        for (int64_t j = 0; j < n; ++j) {
            const float *krow = k + (int64_t)slots[j0 + j] * row_stride;
            if (j0 + j + PREFETCH_AHEAD < len) {
                /* pages are scattered: start the memory reads of a key two pages ahead */
                const int64_t ahead = (int64_t)slots[j0 + j + PREFETCH_AHEAD] * row_stride;
                for (int64_t o = 0; o < nh * D; o += 16) {
                    _mm_prefetch((const char *)(k + ahead + o), _MM_HINT_T0);
                    _mm_prefetch((const char *)(v + ahead + o), _MM_HINT_T0);
                }
            }
            for (int64_t h = 0; h < nh; ++h) {
                __m512 kv[MAX_DIM / 16];
                for (int64_t i = 0; i < nv; ++i) kv[i] = _mm512_loadu_ps(krow + h * D + 16 * i);
                for (int64_t g = 0; g < group; ++g) {
                    const __m512 *qr = qv + (h * group + g) * nv;
                    __m512 a = _mm512_mul_ps(qr[0], kv[0]);
                    for (int64_t i = 1; i < nv; ++i) a = _mm512_fmadd_ps(qr[i], kv[i], a);
                    const int64_t r = h * group + g;
                    s[r * BLOCK + j] = row_len && j0 + j >= row_len[r] ? -INFINITY : _mm512_reduce_add_ps(a);
                }
            }
        }
        for (int64_t r = 0; r < nq; ++r) corr[r] = softmax_block16(s + r * BLOCK, n, m + r, l + r);
        for (int64_t r = 0; r < nq; ++r)
            pv_accumulate512(acc + r * nv, corr[r], s + r * BLOCK, v + r / group * D, slots + j0, n, row_stride, nv);
    }
    finish512(acc, l, nq, nv, out);
}
#endif

int plait_paged_decode_f32(
    const float *q,            /* [B, H, D]; heads and dims contiguous */
    int64_t q_row_stride,      /* elements between two requests' queries */
    const float *k_buf,        /* [slots, KVH, D] */
    const float *v_buf,        /* [slots, KVH, D] */
    const int32_t *table,      /* page table [rows, table_stride]: position -> slot */
    int64_t table_stride,
    const int64_t *rows,       /* [B] page-table row of each request */
    const int64_t *seq_lens,   /* [B] context length, the new token included */
    const int64_t *starts,     /* [B] first visible position (sliding window), or NULL: 0 */
    float *out,                /* [B, H, D] */
    int64_t B, int64_t H, int64_t KVH, int64_t D, float scale, int num_threads) {
    if (KVH <= 0 || H % KVH != 0 || H / KVH > MAX_GROUP || D > MAX_DIM) return 1;
    const int64_t group = H / KVH, row_stride = KVH * D;

    /* With enough requests to keep the threads busy, an item is one request with all
     * its KV heads (AVX-512 path): each key's K and V rows are then read whole, KVH * D
     * contiguous floats, which the memory system streams better than one head's slice
     * at a time. Otherwise an item is one (request, KV head) pair. */
    int64_t heads_per_item = 1;
#if defined(__AVX512F__)
    if (D % 16 == 0 && H <= MAX_ITEM_HEADS && B >= 4 * (int64_t)num_threads) heads_per_item = KVH;
#endif
    const int64_t per_req = KVH / heads_per_item;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < B * per_req; ++item) {
        const int64_t b = item / per_req, h = item % per_req * heads_per_item;
        const float *qh = q + b * q_row_stride + h * group * D;
        const float *k = k_buf + h * D, *v = v_buf + h * D;
        const int64_t first = starts ? starts[b] : 0, len = seq_lens[b] - first;
        const int32_t *slots = table + rows[b] * table_stride + first;
        float *oh = out + (b * H + h * group) * D;
#if defined(__AVX512F__)
        if (D == 64) {
            attend_avx512(qh, k, v, row_stride, slots, len, heads_per_item, group, 64, scale, oh, NULL);
            continue;
        }
        if (D == 128) {
            attend_avx512(qh, k, v, row_stride, slots, len, heads_per_item, group, 128, scale, oh, NULL);
            continue;
        }
        if (D % 16 == 0) {
            attend_avx512(qh, k, v, row_stride, slots, len, heads_per_item, group, D, scale, oh, NULL);
            continue;
        }
#endif
        attend_generic(qh, k, v, row_stride, slots, len, group, D, scale, oh);
    }
    return 0;
}


/* Steps of the portable chunk tile (attend_tile_generic). tile_start: the rows' queries
 * scaled into qs, their accumulators zeroed, their online-softmax state reset. */
static inline void tile_start(const float *q, int64_t nq, int64_t D, float scale, float *qs, float *acc, float *m,
                              float *l) {
    for (int64_t r = 0; r < nq; ++r) {
        for (int64_t d = 0; d < D; ++d) {
            qs[r * D + d] = q[r * D + d] * scale;
            acc[r * D + d] = 0.0f;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
}

/* kt [D][16]: the K rows of the keys at slots[0..nb) transposed, zeros past nb. */
static inline void transpose_keys(const float *k, int64_t row_stride, const int32_t *slots, int64_t nb, int64_t D,
                                  float *kt) {
    for (int64_t jj = 0; jj < 16; ++jj) {
        const float *kr = jj < nb ? k + (int64_t)slots[jj] * row_stride : NULL;
        for (int64_t d = 0; d < D; ++d) kt[d * 16 + jj] = kr ? kr[d] : 0.0f;
    }
}

/* A row's scores of keys j0.. past its own row_len: -inf; returns how many it sees. */
static inline int64_t mask_row(float *sr, int64_t row_len, int64_t j0, int64_t n) {
    const int64_t seen = row_len - j0 < 0 ? 0 : (row_len - j0 < n ? row_len - j0 : n);
    for (int64_t j = seen; j < n; ++j) sr[j] = -INFINITY;
    return seen;
}

#if defined(__AVX512F__)
/* The rows of one tile of a chunk against one KV head (nq <= MAX_ITEM_HEADS rows, each
 * seeing row_len[r] keys) with the rows in the vector lanes: the queries are transposed
 * once per tile into qt [D][W] (W = 16 * RV, RV <= 4 row vectors), and the score of a key
 * for 16 rows is one vector, sum over d of broadcast(k[d]) * qt[d]. Four keys at a time
 * make 4 * RV independent accumulators (enough in flight for the FMA units' latency), the
 * keys are read in place (no transposed copy per 16 keys), and the online softmax runs
 * down the lanes (a row's max and sum are vertical: no horizontal reductions). P V then
 * takes R rows at a time, each V row loaded once for the R of them (R * D / 16
 * accumulators). On the 2-core Xeon, 16 tokens x 3 query heads at context 1800, one
 * thread: 978 -> 650 us per layer against the transposed-keys tile this replaced (whose
 * four chained accumulators ran at the FMA latency, and whose key transposition per 16
 * keys was ~20 % of its time). */
static inline __attribute__((always_inline)) void tile_pv512(float *acc, const float *corr, const float *s, int64_t W,
                                                             const float *v, const int32_t *slots, int64_t n,
                                                             int64_t row_stride, int64_t nq, const int64_t D) {
    const int64_t nv = D / 16;
    enum { R = 3 };
    int64_t r0 = 0;
    if (nv <= 4)
        for (; r0 + R <= nq; r0 += R) {
            __m512 a[R][4];
            for (int t = 0; t < R; ++t) {
                const __m512 c = _mm512_set1_ps(corr[r0 + t]);
                for (int64_t i = 0; i < nv; ++i) a[t][i] = _mm512_mul_ps(_mm512_load_ps(acc + (r0 + t) * D + 16 * i), c);
            }
            for (int64_t j = 0; j < n; ++j) {
                const float *vr = v + (int64_t)slots[j] * row_stride;
                const float *pj = s + j * W + r0;
                const __m512 p0 = _mm512_set1_ps(pj[0]), p1 = _mm512_set1_ps(pj[1]), p2 = _mm512_set1_ps(pj[2]);
                for (int64_t i = 0; i < nv; ++i) {
                    const __m512 vv = _mm512_loadu_ps(vr + 16 * i);
                    a[0][i] = _mm512_fmadd_ps(p0, vv, a[0][i]);
                    a[1][i] = _mm512_fmadd_ps(p1, vv, a[1][i]);
                    a[2][i] = _mm512_fmadd_ps(p2, vv, a[2][i]);
                }
            }
            for (int t = 0; t < R; ++t)
                for (int64_t i = 0; i < nv; ++i) _mm512_store_ps(acc + (r0 + t) * D + 16 * i, a[t][i]);
        }
    for (; r0 < nq; ++r0) { /* one row at a time: the rest, or wide heads */
        __m512 a[MAX_DIM / 16];
        const __m512 c = _mm512_set1_ps(corr[r0]);
        for (int64_t i = 0; i < nv; ++i) a[i] = _mm512_mul_ps(_mm512_load_ps(acc + r0 * D + 16 * i), c);
        for (int64_t j = 0; j < n; ++j) {
            const float *vr = v + (int64_t)slots[j] * row_stride;
            const __m512 pj = _mm512_set1_ps(s[j * W + r0]);
            for (int64_t i = 0; i < nv; ++i) a[i] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16 * i), a[i]);
        }
        for (int64_t i = 0; i < nv; ++i) _mm512_store_ps(acc + r0 * D + 16 * i, a[i]);
    }
}

/* s [key][16 * RV]: the scores of the n keys at slots for the RV row vectors of qt. */
static inline __attribute__((always_inline)) void tile_scores512(const float *qt, const float *k, int64_t row_stride,
                                                                 const int32_t *sl, int64_t n, const int64_t D,
                                                                 const int64_t RV, float *s) {
    const int64_t W = 16 * RV;
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = k + (int64_t)sl[j] * row_stride, *k1 = k + (int64_t)sl[j + 1] * row_stride;
        const float *k2 = k + (int64_t)sl[j + 2] * row_stride, *k3 = k + (int64_t)sl[j + 3] * row_stride;
        __m512 a0[4], a1[4], a2[4], a3[4];
        for (int64_t u = 0; u < RV; ++u) a0[u] = a1[u] = a2[u] = a3[u] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
            const __m512 b0 = _mm512_set1_ps(k0[d]), b1 = _mm512_set1_ps(k1[d]);
            const __m512 b2 = _mm512_set1_ps(k2[d]), b3 = _mm512_set1_ps(k3[d]);
            for (int64_t u = 0; u < RV; ++u) {
                const __m512 qv = _mm512_load_ps(qt + d * W + 16 * u);
                a0[u] = _mm512_fmadd_ps(b0, qv, a0[u]);
                a1[u] = _mm512_fmadd_ps(b1, qv, a1[u]);
                a2[u] = _mm512_fmadd_ps(b2, qv, a2[u]);
                a3[u] = _mm512_fmadd_ps(b3, qv, a3[u]);
            }
        }
        for (int64_t u = 0; u < RV; ++u) {
            _mm512_store_ps(s + j * W + 16 * u, a0[u]);
            _mm512_store_ps(s + (j + 1) * W + 16 * u, a1[u]);
            _mm512_store_ps(s + (j + 2) * W + 16 * u, a2[u]);
            _mm512_store_ps(s + (j + 3) * W + 16 * u, a3[u]);
        }
    }
    for (; j < n; ++j) {
        const float *k0 = k + (int64_t)sl[j] * row_stride;
        __m512 a0[4];
        for (int64_t u = 0; u < RV; ++u) a0[u] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
            const __m512 b0 = _mm512_set1_ps(k0[d]);
            for (int64_t u = 0; u < RV; ++u) a0[u] = _mm512_fmadd_ps(b0, _mm512_load_ps(qt + d * W + 16 * u), a0[u]);
        }
        for (int64_t u = 0; u < RV; ++u) _mm512_store_ps(s + j * W + 16 * u, a0[u]);
    }
}

static inline __attribute__((always_inline)) void attend_tile_avx512(
    const float *q, const float *k, const float *v, int64_t row_stride, const int32_t *slots, int64_t j_begin,
    int64_t len, int64_t nq, const int64_t D, float scale, float *out, const int64_t *row_len, float *m_out,
    float *l_out) {
    const int64_t RV = (nq + 15) / 16, W = 16 * RV;
    float qt[MAX_DIM * MAX_ITEM_HEADS] __attribute__((aligned(64)));  /* [D][W] */
    float s[BLOCK * MAX_ITEM_HEADS] __attribute__((aligned(64)));     /* [key][W]: scores, then weights */
    float acc[MAX_ITEM_HEADS * MAX_DIM] __attribute__((aligned(64))); /* [nq][D] */
    float corr[MAX_ITEM_HEADS] __attribute__((aligned(64)));
    __m512 m[4], l[4];
    __m512i rl[4];
    for (int64_t d = 0; d < D; ++d)
        for (int64_t r = 0; r < W; ++r) qt[d * W + r] = r < nq ? q[r * D + d] * scale : 0.0f;
    for (int64_t r = 0; r < nq * D; ++r) acc[r] = 0.0f;
    for (int64_t u = 0; u < RV; ++u) {
        int32_t lens[16];
        for (int64_t t = 0; t < 16; ++t) lens[t] = (int32_t)(16 * u + t < nq ? row_len[16 * u + t] : len);
        rl[u] = _mm512_loadu_si512(lens); /* padding lanes see every key: finite, unused */
        m[u] = _mm512_set1_ps(-INFINITY);
        l[u] = _mm512_setzero_ps();
    }
    for (int64_t j0 = j_begin; j0 < len; j0 += BLOCK) {
        const int64_t n = len - j0 < BLOCK ? len - j0 : BLOCK;
        const int32_t *sl = slots + j0;
        switch (RV) { /* a constant row-vector count: the accumulators stay in registers */
        case 1: tile_scores512(qt, k, row_stride, sl, n, D, 1, s); break;
        case 2: tile_scores512(qt, k, row_stride, sl, n, D, 2, s); break;
        case 3: tile_scores512(qt, k, row_stride, sl, n, D, 3, s); break;
        default: tile_scores512(qt, k, row_stride, sl, n, D, 4, s); break;
        }
        int64_t j;
        /* online softmax down the lanes; a key past a row's own position weighs exactly 0 */
        for (int64_t u = 0; u < RV; ++u) {
            __m512 bm = _mm512_set1_ps(-INFINITY);
            for (j = 0; j < n; ++j) {
                const __mmask16 seen = _mm512_cmpgt_epi32_mask(rl[u], _mm512_set1_epi32((int32_t)(j0 + j)));
                bm = _mm512_mask_max_ps(bm, seen, bm, _mm512_load_ps(s + j * W + 16 * u));
            }
            const __m512 new_m = _mm512_max_ps(m[u], bm); /* finite: every row sees key 0 */
            const __m512 c = vexp16(_mm512_sub_ps(m[u], new_m)); /* first block: ~0 times zeros */
            __m512 sum = _mm512_setzero_ps();
            for (j = 0; j < n; ++j) {
                const __mmask16 seen = _mm512_cmpgt_epi32_mask(rl[u], _mm512_set1_epi32((int32_t)(j0 + j)));
                const __m512 p = _mm512_maskz_mov_ps(
                    seen, vexp16(_mm512_sub_ps(_mm512_load_ps(s + j * W + 16 * u), new_m)));
                _mm512_store_ps(s + j * W + 16 * u, p);
                sum = _mm512_add_ps(sum, p);
            }
            l[u] = _mm512_fmadd_ps(l[u], c, sum);
            m[u] = new_m;
            _mm512_store_ps(corr + 16 * u, c);
        }
        tile_pv512(acc, corr, s, W, v, sl, n, row_stride, nq, D);
    }
    if (m_out) { /* a part of the keys: its unnormalized sums and softmax state, merged by the caller */
        float mm[MAX_ITEM_HEADS] __attribute__((aligned(64))), ll[MAX_ITEM_HEADS] __attribute__((aligned(64)));
        for (int64_t u = 0; u < RV; ++u) {
            _mm512_store_ps(mm + 16 * u, m[u]);
            _mm512_store_ps(ll + 16 * u, l[u]);
        }
        memcpy(m_out, mm, (size_t)nq * sizeof(float));
        memcpy(l_out, ll, (size_t)nq * sizeof(float));
        memcpy(out, acc, (size_t)(nq * D) * sizeof(float));
        return;
    }
    float inv[MAX_ITEM_HEADS] __attribute__((aligned(64)));
    for (int64_t u = 0; u < RV; ++u) _mm512_store_ps(inv + 16 * u, _mm512_div_ps(_mm512_set1_ps(1.0f), l[u]));
    for (int64_t r = 0; r < nq; ++r)
        for (int64_t d = 0; d < D; ++d) out[r * D + d] = acc[r * D + d] * inv[r];
}
#endif
/* A chunk tile in portable C (other CPUs, head dims the intrinsic tiles do not take):
 * the keys transposed 16 at a time, 16 scores of a row per inner loop, which compilers
 * vectorize for the CPU they target. */
static void attend_tile_generic(const float *q, const float *k, const float *v, int64_t row_stride,
                                const int32_t *slots, int64_t len, int64_t nq, int64_t D, float scale, float *out,
                                const int64_t *row_len) {
    float qs[MAX_ITEM_HEADS * MAX_DIM], acc[MAX_ITEM_HEADS * MAX_DIM];
    float kt[MAX_DIM * 16] __attribute__((aligned(64)));
    float s[MAX_ITEM_HEADS * BLOCK] __attribute__((aligned(64)));
    float m[MAX_ITEM_HEADS], l[MAX_ITEM_HEADS];
    tile_start(q, nq, D, scale, qs, acc, m, l);
    for (int64_t j0 = 0; j0 < len; j0 += BLOCK) {
        const int64_t n = len - j0 < BLOCK ? len - j0 : BLOCK;
        for (int64_t jb = 0; jb < n; jb += 16) {
            const int64_t nb = n - jb < 16 ? n - jb : 16;
            transpose_keys(k, row_stride, slots + j0 + jb, nb, D, kt);
            for (int64_t r = 0; r < nq; ++r) {
                float a[16] __attribute__((aligned(64))) = {0};
                for (int64_t d = 0; d < D; ++d) {
                    const float qd = qs[r * D + d];
                    const float *kd = kt + d * 16;
#pragma omp simd aligned(kd, a : 64)
                    for (int64_t jj = 0; jj < 16; ++jj) a[jj] += qd * kd[jj];
                }
                for (int64_t jj = 0; jj < nb; ++jj) s[r * BLOCK + jb + jj] = a[jj];
            }
        }
        for (int64_t r = 0; r < nq; ++r) {
            const int64_t nr = mask_row(s + r * BLOCK, row_len[r], j0, n); /* keys past the row's own weigh 0 */
            const float correction = softmax_block(s + r * BLOCK, n, m + r, l + r);
            float *ar = acc + r * D;
            for (int64_t d = 0; d < D; ++d) ar[d] *= correction;
            for (int64_t j = 0; j < nr; ++j) {
                const float *vr = v + (int64_t)slots[j0 + j] * row_stride;
                const float p = s[r * BLOCK + j];
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ar[d] += p * vr[d];
            }
        }
    }
    for (int64_t r = 0; r < nq; ++r) {
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; ++d) out[r * D + d] = acc[r * D + d] * inv;
    }
}


#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* s [key][W]: two keys' scores for UC row vectors (of 8 rows) from qt [D][W], starting
 * at row vector u0; 2 * UC <= 12 accumulators of AVX2's 16 registers. */
static inline __attribute__((always_inline)) void tile_scores256(const float *qt, int64_t W, int64_t u0,
                                                                 const int UC, const float *k0, const float *k1,
                                                                 int64_t D, float *s0, float *s1) {
    __m256 a0[6], a1[6];
    for (int u = 0; u < UC; ++u) a0[u] = a1[u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        const __m256 b0 = _mm256_broadcast_ss(k0 + d), b1 = _mm256_broadcast_ss(k1 + d);
        for (int u = 0; u < UC; ++u) {
            const __m256 qv = _mm256_load_ps(qt + d * W + 8 * (u0 + u));
            a0[u] = _mm256_fmadd_ps(b0, qv, a0[u]);
            a1[u] = _mm256_fmadd_ps(b1, qv, a1[u]);
        }
    }
    for (int u = 0; u < UC; ++u) {
        _mm256_store_ps(s0 + 8 * (u0 + u), a0[u]);
        _mm256_store_ps(s1 + 8 * (u0 + u), a1[u]);
    }
}

/* The AVX-512 tile's design on AVX2 + FMA (8 lanes, 16 registers): the rows in the
 * lanes (queries transposed once per tile), two keys' scores per pass over d for up to
 * 48 rows, the online softmax down the lanes, and P V three rows at a time over 32-wide
 * slices of the head dim (12 accumulators). D a multiple of 8. */
static void attend_tile_avx2(const float *q, const float *k, const float *v, int64_t row_stride, const int32_t *slots,
                             int64_t j_begin, int64_t len, int64_t nq, int64_t D, float scale, float *out,
                             const int64_t *row_len, float *m_out, float *l_out) {
    const int64_t RV = (nq + 7) / 8, W = 8 * RV;
    float qt[MAX_DIM * MAX_ITEM_HEADS] __attribute__((aligned(32)));  /* [D][W] */
    float s[BLOCK * MAX_ITEM_HEADS] __attribute__((aligned(32)));     /* [key][W] */
    float acc[MAX_ITEM_HEADS * MAX_DIM] __attribute__((aligned(32))); /* [nq][D] */
    float m[MAX_ITEM_HEADS] __attribute__((aligned(32))), l[MAX_ITEM_HEADS] __attribute__((aligned(32)));
    float corr[MAX_ITEM_HEADS] __attribute__((aligned(32)));
    int32_t rl[MAX_ITEM_HEADS] __attribute__((aligned(32)));
    for (int64_t d = 0; d < D; ++d)
        for (int64_t r = 0; r < W; ++r) qt[d * W + r] = r < nq ? q[r * D + d] * scale : 0.0f;
    for (int64_t r = 0; r < nq * D; ++r) acc[r] = 0.0f;
    for (int64_t r = 0; r < W; ++r) {
        rl[r] = (int32_t)(r < nq ? row_len[r] : len); /* padding lanes see every key: finite, unused */
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int64_t j0 = j_begin; j0 < len; j0 += BLOCK) {
        const int64_t n = len - j0 < BLOCK ? len - j0 : BLOCK;
        const int32_t *sl = slots + j0;
        for (int64_t j = 0; j < n; j += 2) {
            const float *k0 = k + (int64_t)sl[j] * row_stride;
            const float *k1 = j + 1 < n ? k + (int64_t)sl[j + 1] * row_stride : k0; /* a last odd key: twice */
            float *s0 = s + j * W, *s1 = j + 1 < n ? s + (j + 1) * W : s + BLOCK * W - W;
            for (int64_t u0 = 0; u0 < RV; u0 += 6) {
                switch (RV - u0 < 6 ? RV - u0 : 6) { /* a constant count: the accumulators stay in registers */
                case 1: tile_scores256(qt, W, u0, 1, k0, k1, D, s0, s1); break;
                case 2: tile_scores256(qt, W, u0, 2, k0, k1, D, s0, s1); break;
                case 3: tile_scores256(qt, W, u0, 3, k0, k1, D, s0, s1); break;
                case 4: tile_scores256(qt, W, u0, 4, k0, k1, D, s0, s1); break;
                case 5: tile_scores256(qt, W, u0, 5, k0, k1, D, s0, s1); break;
                default: tile_scores256(qt, W, u0, 6, k0, k1, D, s0, s1); break;
                }
            }
        }
        /* online softmax down the lanes; a key past a row's own position weighs exactly 0 */
        for (int64_t u = 0; u < RV; ++u) {
            const __m256i rlu = _mm256_load_si256((const __m256i *)(rl + 8 * u));
            const __m256 ninf = _mm256_set1_ps(-INFINITY);
            __m256 bm = ninf;
            for (int64_t j = 0; j < n; ++j) {
                const __m256 seen = _mm256_castsi256_ps(_mm256_cmpgt_epi32(rlu, _mm256_set1_epi32((int32_t)(j0 + j))));
                bm = _mm256_max_ps(bm, _mm256_blendv_ps(ninf, _mm256_load_ps(s + j * W + 8 * u), seen));
            }
            const __m256 mu = _mm256_load_ps(m + 8 * u);
            const __m256 new_m = _mm256_max_ps(mu, bm); /* finite: every row sees key 0 */
            const __m256 c = vexp8(_mm256_sub_ps(mu, new_m));
            __m256 sum = _mm256_setzero_ps();
            for (int64_t j = 0; j < n; ++j) {
                const __m256 seen = _mm256_castsi256_ps(_mm256_cmpgt_epi32(rlu, _mm256_set1_epi32((int32_t)(j0 + j))));
                const __m256 p = _mm256_and_ps(
                    seen, vexp8(_mm256_sub_ps(_mm256_load_ps(s + j * W + 8 * u), new_m)));
                _mm256_store_ps(s + j * W + 8 * u, p);
                sum = _mm256_add_ps(sum, p);
            }
            _mm256_store_ps(l + 8 * u, _mm256_fmadd_ps(_mm256_load_ps(l + 8 * u), c, sum));
            _mm256_store_ps(m + 8 * u, new_m);
            _mm256_store_ps(corr + 8 * u, c);
        }
        /* P V: three rows per V load, 32 floats of the head dim at a time */
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            const int64_t nvc = D - d0 >= 32 ? 4 : (D - d0) / 8;
            int64_t r0 = 0;
            if (nvc == 4)
                for (; r0 + 3 <= nq; r0 += 3) {
                    __m256 a[3][4];
                    for (int t = 0; t < 3; ++t) {
                        const __m256 cv = _mm256_set1_ps(corr[r0 + t]);
                        for (int i = 0; i < 4; ++i)
                            a[t][i] = _mm256_mul_ps(_mm256_load_ps(acc + (r0 + t) * D + d0 + 8 * i), cv);
                    }
                    for (int64_t j = 0; j < n; ++j) {
                        const float *vr = v + (int64_t)sl[j] * row_stride + d0;
                        const float *pj = s + j * W + r0;
                        const __m256 p0 = _mm256_broadcast_ss(pj), p1 = _mm256_broadcast_ss(pj + 1);
                        const __m256 p2 = _mm256_broadcast_ss(pj + 2);
                        for (int i = 0; i < 4; ++i) {
                            const __m256 vv = _mm256_loadu_ps(vr + 8 * i);
                            a[0][i] = _mm256_fmadd_ps(p0, vv, a[0][i]);
                            a[1][i] = _mm256_fmadd_ps(p1, vv, a[1][i]);
                            a[2][i] = _mm256_fmadd_ps(p2, vv, a[2][i]);
                        }
                    }
                    for (int t = 0; t < 3; ++t)
                        for (int i = 0; i < 4; ++i) _mm256_store_ps(acc + (r0 + t) * D + d0 + 8 * i, a[t][i]);
                }
            for (; r0 < nq; ++r0) /* the rest of the rows, or a slice narrower than 32 */
                for (int64_t i = 0; i < nvc; ++i) {
                    __m256 a0 = _mm256_mul_ps(_mm256_load_ps(acc + r0 * D + d0 + 8 * i), _mm256_set1_ps(corr[r0]));
                    for (int64_t j = 0; j < n; ++j)
                        a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + j * W + r0),
                                             _mm256_loadu_ps(v + (int64_t)sl[j] * row_stride + d0 + 8 * i), a0);
                    _mm256_store_ps(acc + r0 * D + d0 + 8 * i, a0);
                }
        }
    }
    if (m_out) { /* a part of the keys: its unnormalized sums and softmax state, merged by the caller */
        memcpy(m_out, m, (size_t)nq * sizeof(float));
        memcpy(l_out, l, (size_t)nq * sizeof(float));
        memcpy(out, acc, (size_t)(nq * D) * sizeof(float));
        return;
    }
    for (int64_t r = 0; r < nq; ++r) {
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; ++d) out[r * D + d] = acc[r * D + d] * inv;
    }
}
#define HAVE_TILE_AVX2 1
#endif

/* Attention for a step's tokens of prompt chunks and decodes alike (the fused forward's
 * attention, kernels/quant_linear_cpu.c), with plait_paged_decode_f32's arguments: one
 * query row per token, `rows[b]` its request's page-table row, `seq_lens[b]` the keys it
 * sees (its position + 1). Consecutive tokens of one request at consecutive positions
 * (a chunk) are taken TILE at a time against one KV head:
 * each key of the request's context is then read once per tile instead of once per
 * token, the tile's rows masked past their own positions (the AVX-512 tile where the
 * compiler targets it and D is a multiple of 16, the AVX2 one where it targets AVX2 + FMA
 * and D is a multiple of 8, else the portable tile). Single tokens
 * (decodes) go to one call of plait_paged_decode_f32. */
#define TILE 16 /* chunk tokens per item (TILE * group <= MAX_ITEM_HEADS) */
#define MAX_PARTS 4 /* key ranges an item is split into to balance threads */
#define MIN_PART_KEYS 256
/* whether a tile of head dim D can be split into key ranges (the AVX-512 and AVX2 tiles) */
#if defined(__AVX512F__)
#define SPLITS(D) ((D) % 16 == 0)
#elif defined(HAVE_TILE_AVX2)
#define SPLITS(D) ((D) % 8 == 0)
#else
#define SPLITS(D) 0
#endif

int plait_paged_extend_f32(const float *q, int64_t q_row_stride, const float *k_buf, const float *v_buf,
                           const int32_t *table, int64_t table_stride, const int64_t *rows, const int64_t *seq_lens,
                           const int64_t *starts, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                           float scale, int num_threads) {
    if (KVH <= 0 || H % KVH != 0 || H / KVH > MAX_GROUP || D > MAX_DIM) return 1;
    const int64_t group = H / KVH;
    int64_t tile_max = MAX_ITEM_HEADS / group < TILE ? MAX_ITEM_HEADS / group : TILE;
    if (starts != NULL || tile_max < 2)
        return plait_paged_decode_f32(q, q_row_stride, k_buf, v_buf, table, table_stride, rows, seq_lens, starts, out,
                                      B, H, KVH, D, scale, num_threads);
    /* tiles: [first token, count); single tokens (decodes) gathered for one decode call */
    int64_t *idx = malloc((size_t)(5 * B) * sizeof(int64_t));
    if (!idx) return 2;
    int64_t *tile_first = idx, *tile_n = idx + B, *singles = idx + 2 * B, *rd = idx + 3 * B, *ld = idx + 4 * B;
    int64_t n_tiles = 0, n_singles = 0;
    for (int64_t b = 0; b < B;) {
        int64_t n = 1;
        while (b + n < B && n < tile_max && rows[b + n] == rows[b] && seq_lens[b + n] == seq_lens[b] + n) n++;
        if (n == 1) {
            singles[n_singles++] = b;
        } else {
            tile_first[n_tiles] = b;
            tile_n[n_tiles++] = n;
        }
        b += n;
    }
    if (n_tiles == 0) { /* a decode-only step: the decode kernel on the rows as they are, no copies */
        free(idx);
        return plait_paged_decode_f32(q, q_row_stride, k_buf, v_buf, table, table_stride, rows, seq_lens, NULL, out,
                                      B, H, KVH, D, scale, num_threads);
    }
    /* the single tokens' queries and outputs, gathered (n_singles rows, not B) */
    float *qd = malloc((size_t)(2 * (n_singles ? n_singles : 1) * H * D) * sizeof(float));
    if (!qd) {
        free(idx);
        return 2;
    }
    float *od = qd + n_singles * H * D;
    const int64_t row_stride = KVH * D;
    int rc = 0;
    /* Parts: with fewer items than keep the threads equally busy (a 16-token chunk of a
     * model with 3 KV heads is 3 items for 2 threads: one thread idle half the time), each
     * item's keys are split into `parts` ranges of whole blocks, computed as separate
     * units and merged (the AVX-512 and AVX2 tiles). On the 2-core Xeon, 16 tokens at
     * context 1800, 2 threads: 494 -> 348 us per layer (AVX-512). A range costs its keys plus a fixed start (the tile's query transpose)
     * and the merge, so ranges stay >= MIN_PART_KEYS keys. */
    const int64_t units1 = n_tiles * KVH;
    int64_t parts = 1;
    if (SPLITS(D) && num_threads > 1) {
        int64_t shortest = seq_lens[tile_first[0] + tile_n[0] - 1];
        for (int64_t t = 1; t < n_tiles; ++t) {
            const int64_t len_t = seq_lens[tile_first[t] + tile_n[t] - 1];
            if (len_t < shortest) shortest = len_t;
        }
        double best = (double)((units1 + num_threads - 1) / num_threads); /* makespan in items */
        for (int64_t pp = 2; pp <= MAX_PARTS && shortest / pp >= MIN_PART_KEYS; ++pp) {
            const double span = (double)((units1 * pp + num_threads - 1) / num_threads) / (double)pp;
            if (span < best - 1e-9) {
                best = span;
                parts = pp;
            }
        }
    }
    float *partial = NULL; /* [unit][rows][D] sums, then [unit][rows] maxima and [unit][rows] sums */
    const int64_t prow = MAX_ITEM_HEADS;
    if (parts > 1) {
        partial = malloc((size_t)(units1 * parts * prow * (D + 2)) * sizeof(float));
        if (!partial) parts = 1;
    }
    const int64_t units = units1 * parts;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < units; ++unit) {
            const int64_t item = unit / parts, part = unit % parts;
            const int64_t t = item / KVH, h = item % KVH, b0 = tile_first[t], n = tile_n[t];
            float qt[MAX_ITEM_HEADS * MAX_DIM] __attribute__((aligned(64)));
            float ot[MAX_ITEM_HEADS * MAX_DIM] __attribute__((aligned(64)));
            int64_t row_len[MAX_ITEM_HEADS];
            for (int64_t i = 0; i < n; ++i)
                for (int64_t g = 0; g < group; ++g) {
                    memcpy(qt + (i * group + g) * D, q + (b0 + i) * q_row_stride + (h * group + g) * D,
                           (size_t)D * sizeof(float));
                    row_len[i * group + g] = seq_lens[b0 + i];
                }
            const int32_t *slots = table + rows[b0] * table_stride;
            const int64_t len = seq_lens[b0 + n - 1];
            if (SPLITS(D) && parts > 1) {
                /* keys [lo, hi) in whole blocks; the last range ends at len */
                const int64_t blocks = (len + BLOCK - 1) / BLOCK;
                const int64_t lo = blocks * part / parts * BLOCK;
                const int64_t hi = part == parts - 1 ? len : blocks * (part + 1) / parts * BLOCK;
                float *pa = partial + unit * prow * D, *pm = partial + units * prow * D + unit * prow;
                float *pl = partial + units * prow * (D + 1) + unit * prow;
#if defined(__AVX512F__)
                if (D == 64)
                    attend_tile_avx512(qt, k_buf + h * D, v_buf + h * D, row_stride, slots, lo, hi, n * group, 64,
                                       scale, pa, row_len, pm, pl);
                else
                    attend_tile_avx512(qt, k_buf + h * D, v_buf + h * D, row_stride, slots, lo, hi, n * group, D,
                                       scale, pa, row_len, pm, pl);
#elif defined(HAVE_TILE_AVX2)
                attend_tile_avx2(qt, k_buf + h * D, v_buf + h * D, row_stride, slots, lo, hi, n * group, D, scale,
                                 pa, row_len, pm, pl);
#else
                (void)pa, (void)pm, (void)pl, (void)lo, (void)hi; /* no tile that splits: never reached */
#endif
                continue;
            }
#if defined(__AVX512F__)
            if (D == 64)
                attend_tile_avx512(qt, k_buf + h * D, v_buf + h * D, row_stride, slots, 0, len, n * group, 64, scale,
                                   ot, row_len, NULL, NULL);
            else if (D % 16 == 0)
                attend_tile_avx512(qt, k_buf + h * D, v_buf + h * D, row_stride, slots, 0, len, n * group, D, scale,
                                   ot, row_len, NULL, NULL);
            else
#endif
#if defined(HAVE_TILE_AVX2)
            if (D % 8 == 0)
                attend_tile_avx2(qt, k_buf + h * D, v_buf + h * D, row_stride, slots, 0, len, n * group, D, scale, ot,
                                 row_len, NULL, NULL);
            else
#endif
                attend_tile_generic(qt, k_buf + h * D, v_buf + h * D, row_stride, slots, len, n * group, D, scale, ot,
                                    row_len);
            for (int64_t i = 0; i < n; ++i)
                memcpy(out + ((b0 + i) * H + h * group) * D, ot + i * group * D, (size_t)(group * D) * sizeof(float));
        }
        if (parts > 1) {
            /* merge each item's ranges: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p */
#pragma omp for schedule(static) nowait
            for (int64_t item = 0; item < units1; ++item) {
                const int64_t t = item / KVH, h = item % KVH, b0 = tile_first[t], nq = tile_n[t] * group;
                const float *pm = partial + units * prow * D, *pl = partial + units * prow * (D + 1);
                for (int64_t r = 0; r < nq; ++r) {
                    float big = -INFINITY, sum = 0.0f, w[MAX_PARTS];
                    for (int64_t p = 0; p < parts; ++p) {
                        const float mp = pm[(item * parts + p) * prow + r];
                        if (mp > big) big = mp;
                    }
                    for (int64_t p = 0; p < parts; ++p) {
                        const float mp = pm[(item * parts + p) * prow + r];
                        w[p] = mp == -INFINITY ? 0.0f : expf(mp - big);
                        sum += w[p] * pl[(item * parts + p) * prow + r];
                    }
                    const int64_t i = r / group, g = r % group;
                    float *o = out + ((b0 + i) * H + h * group + g) * D;
                    for (int64_t d = 0; d < D; ++d) {
                        float x = 0.0f;
                        for (int64_t p = 0; p < parts; ++p) x += w[p] * partial[((item * parts + p) * prow + r) * D + d];
                        o[d] = x / sum;
                    }
                }
            }
        }
    }
    free(partial);
    if (n_singles) {
        /* the single tokens (decodes) in one call of the decode kernel (its items, its threads) */
        for (int64_t i = 0; i < n_singles; ++i) {
            memcpy(qd + i * H * D, q + singles[i] * q_row_stride, (size_t)(H * D) * sizeof(float));
            rd[i] = rows[singles[i]];
            ld[i] = seq_lens[singles[i]];
        }
        rc = plait_paged_decode_f32(qd, H * D, k_buf, v_buf, table, table_stride, rd, ld, NULL, od, n_singles, H, KVH,
                                    D, scale, num_threads);
        for (int64_t i = 0; i < n_singles; ++i)
            memcpy(out + singles[i] * H * D, od + i * H * D, (size_t)(H * D) * sizeof(float));
    }
    free(idx);
    free(qd);
    return rc;
}

/* Whether plait_paged_extend_f32's tiles run on vector intrinsics in this build (AVX-512
 * or AVX2 + FMA): 1, or 0 where they take the portable C tile, which compilers vectorize
 * poorly (on the Xeon built for haswell without the AVX2 tile: 4x slower than one token
 * at a time). The fused forward takes prompt chunks only where this is 1. */
int plait_paged_extend_vectorized(void) {
#if defined(__AVX512F__) || defined(HAVE_TILE_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* pdstack's CPU kernels: block-quantised linear layers and paged decode attention.
 *
 * Built on first use by kernels/cpu/native.py (cc -O3 -march=native -fopenmp -shared) and called through
 * ctypes with raw pointers: no Python object crosses this file. The OpenMP runtime is the one torch already
 * loaded (libgomp.so.1 by soname), so these kernels and torch's own ops share one thread pool.
 *
 * Quantised weights, W: [N, K] (out x in features), K a multiple of 32, in blocks of 32 along K; d, m: [N, K/32]
 * f16, as GGUF stores them. Q4_1: w = d * q + m, q in 0..15 (4 bits); Q8_0: w = d * q, q in -127..127, stored
 * as q + 128. Activations are quantised per block of 32 of each row to 16-bit integers (x ~ dx * xq, dx =
 * max|x| / 32767: within ~1e-5 of the block's largest value, so products keep fp32's next-token choices), and
 *   y[b, n] = sum_j d[n, j] * dx[b, j] * dot(q[n, j], xq[b, j]) + sum_j m'[n, j] * s[b, j]
 * Q4_1: m' = m and s = sum of the block's fp32 x (exact); Q8_0: m' = d and s = -128 * dx * sum(xq) (the +128
 * bias of the stored codes taken back out).
 *
 * Layout: a row's blocks go in groups of 16 (G = nb / 16 of them), then the R = nb % 16 blocks left in pairs and
 * an odd last one alone. In a group, 512-bit vector v (0..15) of activations holds, in its 16-bit word 2k + s,
 * element 2v + s of the group's block k: one vpdpwssd over vector v of the weights and of the activations adds
 * two products of every block into that block's own int32 lane, so after 16 of them lane k holds block k's whole
 * dot, and one convert and one fused multiply-add by [d x dx] of 16 blocks scale them all (the float work is a
 * sixteenth of a per-block scale). The weights' bytes give those vectors directly:
 *   Q4_1 group (256 bytes): chunk t (0..7) of 32 bytes holds vector 2t in its low nibbles and 2t + 1 in its high
 *        ones; the blocks left are GGUF's own order (bytes 16j..16j+15: low nibble element i, high i + 16).
 *   Q8_0 group (512 bytes): 32 bytes per vector v; a pair left is [b0[0:16], b1[0:16], b0[16:32], b1[16:32]], a
 *        lone last block in element order.
 * The activations left after the groups are laid out in pairs like Q8_0's (a pair's low halves, then its high
 * halves), with their dx per pair as [dx0 x 8, dx1 x 8]; a group's dx are its 16 blocks' in order.
 * kernels/cpu/quant.py packs the weights (and unpacks them for its tests) in this layout.
 *
 * Paged KV cache (the engine's layout): k, v: [num_pages, BLOCK, Hkv, D] f32; block_table [B, max_pages] i32;
 * query head h reads KV head h / (Hq / Hkv).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PDRT_VNNI 1
#include <immintrin.h>
#else
#define PDRT_VNNI 0
#endif

#define QK 32
#define GB 16          /* blocks per group */
typedef _Float16 f16;  /* storage only: converted to f32 on load (F16C) */
#define NR 4           /* weight rows per micro-tile */
#define MR 2           /* activation rows per micro-tile */

enum { PRE_NONE = 0, PRE_RMSNORM = 1, PRE_SWIGLU = 2 };
enum { FMT_Q4_1 = 0, FMT_Q8_0 = 1 };

int pdrt_simd_level(void) { return PDRT_VNNI ? 2 : 0; }  /* 2: AVX-512 VNNI, 0: portable C */

/* Element offset of element i (0..31) of block j among nb blocks stored in pairs (a lone last block in order). */
static inline int64_t paired(int64_t nb, int64_t j, int i) {
    if ((j | 1) >= nb) return j * QK + i;
    return (j & ~1) * QK + (i >= 16) * 32 + (j & 1) * 16 + (i & 15);
}

/* Element offset of element i of block j in an activation row (and a Q8_0 weight row) of nb blocks. */
static inline int64_t act_offset(int64_t nb, int64_t j, int i) {
    const int64_t grouped = nb / GB * GB;
    if (j < grouped) return (j / GB) * GB * QK + (i / 2) * 32 + (j % GB) * 2 + (i & 1);
    return grouped * QK + paired(nb - grouped, j - grouped, i);
}

/* Byte offset and nibble (0 low, 1 high) of element i of block j in a Q4_1 weight row of nb blocks. */
static inline int64_t q4_offset(int64_t nb, int64_t j, int i, int *high) {
    const int64_t grouped = nb / GB * GB;
    if (j < grouped) {
        *high = (i / 2) & 1;
        return (j / GB) * 256 + (i / 4) * 32 + (j % GB) * 2 + (i & 1);
    }
    *high = i >= 16;
    return grouped * 16 + (j - grouped) * 16 + (i & 15);
}

/* Per activation row: dxe [dxe_len] = a group's 16 dx in order, then per pair left [dx0 x 8, dx1 x 8], then a lone
 * block's dx. */
static inline int64_t dxe_len(int64_t nb) {
    const int64_t grouped = nb / GB * GB;
    return grouped + 16 * ((nb - grouped) / 2) + 1;
}

/* ------------------------------------------------------------------ activations */

/* One row of x (K floats) after its pre-op, quantised to 16-bit integers (see above); tmp: K floats. */
static void quantize_row(const float *x, int64_t K, int pre, const float *norm_w, float eps, int fmt,
                         int16_t *xq, float *dxe, float *s, float *tmp) {
    const float *src = x;
    const int64_t nb = K / QK, grouped = nb / GB * GB;
    if (pre == PRE_RMSNORM) {
        double ss = 0.0;
        for (int64_t i = 0; i < K; i++) ss += (double)x[i] * x[i];
        float inv = 1.0f / sqrtf((float)(ss / K) + eps);
        for (int64_t i = 0; i < K; i++) tmp[i] = x[i] * inv * norm_w[i];
        src = tmp;
    } else if (pre == PRE_SWIGLU) {  /* x: [2K] = [gate | up] -> silu(gate) * up */
        for (int64_t i = 0; i < K; i++) {
            float g = x[i];
            tmp[i] = g / (1.0f + expf(-g)) * x[K + i];
        }
        src = tmp;
    }
    for (int64_t j = 0; j < nb; j++) {
        const float *b = src + j * QK;
        float amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < QK; i++) {
            float a = fabsf(b[i]);
            amax = a > amax ? a : amax;
            sum += b[i];
        }
        float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int64_t isum = 0;
        for (int i = 0; i < QK; i++) {
            int q = (int)lrintf(b[i] * id);
            xq[act_offset(nb, j, i)] = (int16_t)q;
            isum += q;
        }
        const int64_t jr = j - grouped, nr = nb - grouped;
        if (j < grouped) {
            dxe[j] = d;
        } else if ((jr | 1) < nr) {
            for (int l = 0; l < 8; l++) dxe[grouped + (jr / 2) * 16 + (jr & 1) * 8 + l] = d;
        } else {
            dxe[grouped + 16 * (nr / 2)] = d;
        }
        s[j] = fmt == FMT_Q4_1 ? sum : -128.0f * d * (float)isum;
    }
}

/* ------------------------------------------------------------------ the micro-kernel */

#if PDRT_VNNI
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The m' term of a row for one activation row (see the header), plus what the accumulators hold. */
static inline float row_total(float lanes_sum, const f16 *mrow, const float *srow, int64_t nb) {
    __m256 t = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= nb; j += 8)
        t = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mrow + j))), _mm256_loadu_ps(srow + j), t);
    float v = lanes_sum + hsum8(t);
    for (; j < nb; j++) v += (float)mrow[j] * srow[j];
    return v;
}

/* Weight vectors 2t and 2t + 1 of a group (see the header), one 16-bit word per element. */
static inline void group_vectors(const uint8_t *g, int fmt, int t, __m512i *a, __m512i *b) {
    if (fmt == FMT_Q4_1) {
        const __m256i nib = _mm256_set1_epi8(0x0F);
        __m256i v = _mm256_loadu_si256((const __m256i *)(g + t * 32));
        *a = _mm512_cvtepu8_epi16(_mm256_and_si256(v, nib));
        *b = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
    } else {
        *a = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(g + 2 * t * 32)));
        *b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(g + (2 * t + 1) * 32)));
    }
}

/* A pair of blocks left after the groups, as its low and high halves widened to 16 bits. */
static inline void pair_vectors(const uint8_t *w, int fmt, __m512i *lo, __m512i *hi) {
    if (fmt == FMT_Q4_1) {
        const __m256i nib = _mm256_set1_epi8(0x0F);
        __m256i v = _mm256_loadu_si256((const __m256i *)w);
        *lo = _mm512_cvtepu8_epi16(_mm256_and_si256(v, nib));
        *hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
    } else {
        *lo = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)w));
        *hi = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 32)));
    }
}

/* A lone last block, element order, widened to 16 bits. */
static inline __m512i lone_vector(const uint8_t *w, int fmt) {
    if (fmt == FMT_Q8_0) return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)w));
    __m128i v = _mm_loadu_si128((const __m128i *)w);
    return _mm512_cvtepu8_epi16(_mm256_and_si256(
        _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1), _mm256_set1_epi8(0x0F)));
}

/* y[r, n0 + c] (+)= row n0 + c of W times activation row r, for c < nr (<= NR), r < mr (<= MR). */
static inline __attribute__((always_inline)) void tile(const uint8_t *wq, const f16 *d, const f16 *m,
        int64_t K, int64_t n0, const int nr, const int16_t *xq, const float *dxe, const float *s, const int mr,
        float *y, int64_t ldy, int accumulate, int fmt) {
    const int64_t nb = K / QK, ng = nb / GB, grouped = ng * GB, dxl = dxe_len(nb);
    const int64_t row_bytes = fmt == FMT_Q4_1 ? K / 2 : K, group_bytes = fmt == FMT_Q4_1 ? 256 : 512;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[NR][MR];
    for (int c = 0; c < nr; c++)
        for (int r = 0; r < mr; r++) acc[c][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {  /* 16 blocks: 16 vpdpwssd per (row, activation row), one scaling */
        __m512i dot[NR][MR];
        for (int c = 0; c < nr; c++)
            for (int r = 0; r < mr; r++) dot[c][r] = zero;
        for (int t = 0; t < 8; t++) {
            for (int c = 0; c < nr; c++) {
                __m512i a, b;
                group_vectors(wq + (n0 + c) * row_bytes + g * group_bytes, fmt, t, &a, &b);
                for (int r = 0; r < mr; r++) {
                    const int16_t *xv = xq + r * K + g * GB * QK + 2 * t * 32;
                    dot[c][r] = _mm512_dpwssd_epi32(dot[c][r], a, _mm512_loadu_si512(xv));
                    dot[c][r] = _mm512_dpwssd_epi32(dot[c][r], b, _mm512_loadu_si512(xv + 32));
                }
            }
        }
        for (int c = 0; c < nr; c++) {
            __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + (n0 + c) * nb + g * GB)));
            for (int r = 0; r < mr; r++)
                acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[c][r]),
                                            _mm512_mul_ps(dw, _mm512_loadu_ps(dxe + r * dxl + g * GB)), acc[c][r]);
        }
    }
    const int64_t nrem = nb - grouped, np = nrem / 2;
    const uint8_t *rem = wq + grouped * (fmt == FMT_Q4_1 ? 16 : 32);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int64_t p = 0; p < np; p++) {  /* pairs left: one scaling per pair */
        for (int c = 0; c < nr; c++) {
            __m512i lo, hi;
            pair_vectors(rem + (n0 + c) * row_bytes + p * (fmt == FMT_Q4_1 ? 32 : 64), fmt, &lo, &hi);
            uint32_t two;  /* the pair's two f16 scales -> [d0 x 8, d1 x 8] */
            memcpy(&two, d + (n0 + c) * nb + grouped + 2 * p, sizeof two);
            __m512 dv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)two))));
            for (int r = 0; r < mr; r++) {
                const int16_t *xr = xq + r * K + grouped * QK + p * 64;
                __m512i pi = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, lo, _mm512_loadu_si512(xr)), hi,
                                                 _mm512_loadu_si512(xr + 32));
                acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pi),
                                            _mm512_mul_ps(dv, _mm512_loadu_ps(dxe + r * dxl + grouped + p * 16)), acc[c][r]);
            }
        }
    }
    if (nrem & 1) {  /* a lone last block */
        const int64_t j = nb - 1;
        for (int c = 0; c < nr; c++) {
            __m512i wv = lone_vector(rem + (n0 + c) * row_bytes + (nrem - 1) * (fmt == FMT_Q4_1 ? 16 : 32), fmt);
            float dj = (float)d[(n0 + c) * nb + j];
            for (int r = 0; r < mr; r++) {
                __m512i pi = _mm512_dpwssd_epi32(zero, wv, _mm512_loadu_si512(xq + r * K + j * QK));
                acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pi), _mm512_set1_ps(dj * dxe[r * dxl + grouped + 16 * np]),
                                            acc[c][r]);
            }
        }
    }
    const f16 *mm = fmt == FMT_Q4_1 ? m : d;
    for (int c = 0; c < nr; c++)
        for (int r = 0; r < mr; r++) {
            float *out = y + r * ldy + n0 + c;
            float v = row_total(_mm512_reduce_add_ps(acc[c][r]), mm + (n0 + c) * nb, s + r * nb, nb);
            *out = accumulate ? *out + v : v;
        }
}
#else
/* Weight code (0..15 for Q4_1, 0..255 for Q8_0) of element i of block j in a row. */
static inline int weight_code(const uint8_t *row, int64_t nb, int64_t j, int i, int fmt) {
    if (fmt == FMT_Q8_0) return row[act_offset(nb, j, i)];
    int high;
    uint8_t byte = row[q4_offset(nb, j, i, &high)];
    return high ? byte >> 4 : byte & 15;
}

static inline float block_dx(const float *dxe, int64_t nb, int64_t j) {
    const int64_t grouped = nb / GB * GB, jr = j - grouped, nr = nb - grouped;
    if (j < grouped) return dxe[j];
    return (jr | 1) < nr ? dxe[grouped + (jr / 2) * 16 + (jr & 1) * 8] : dxe[grouped + 16 * (nr / 2)];
}

static inline void tile(const uint8_t *wq, const f16 *d, const f16 *m, int64_t K, int64_t n0, const int nr,
        const int16_t *xq, const float *dxe, const float *s, const int mr, float *y, int64_t ldy, int accumulate,
        int fmt) {
    const int64_t nb = K / QK, row_bytes = fmt == FMT_Q4_1 ? K / 2 : K, dxl = dxe_len(nb);
    const f16 *mm = fmt == FMT_Q4_1 ? m : d;
    for (int c = 0; c < nr; c++) {
        const uint8_t *row = wq + (n0 + c) * row_bytes;
        for (int r = 0; r < mr; r++) {
            float v = 0.0f;
            for (int64_t j = 0; j < nb; j++) {
                int64_t dot = 0;
                for (int i = 0; i < QK; i++) dot += (int64_t)weight_code(row, nb, j, i, fmt) * xq[r * K + act_offset(nb, j, i)];
                v += (float)d[(n0 + c) * nb + j] * block_dx(dxe + r * dxl, nb, j) * (float)dot
                     + (float)mm[(n0 + c) * nb + j] * s[r * nb + j];
            }
            float *out = y + r * ldy + n0 + c;
            *out = accumulate ? *out + v : v;
        }
    }
}
#endif

/* Rows [n_lo, n_hi) of y for activation rows [r0, r0 + mr). */
static void rows_range(const uint8_t *wq, const f16 *d, const f16 *m, int64_t K, int64_t n_lo, int64_t n_hi,
                       const int16_t *xq, const float *dxe, const float *s, int64_t r0, int mr, float *y,
                       int64_t ldy, int accumulate, int fmt) {
    const int64_t nb = K / QK;
    const int16_t *xr = xq + r0 * K;
    const float *dxr = dxe + r0 * dxe_len(nb), *sr = s + r0 * nb;
    float *yr = y + r0 * ldy;
    int64_t n = n_lo;
#define PDRT_TILES(NRV) if (mr == 1) tile(wq, d, m, K, n, NRV, xr, dxr, sr, 1, yr, ldy, accumulate, fmt); \
                        else tile(wq, d, m, K, n, NRV, xr, dxr, sr, 2, yr, ldy, accumulate, fmt);
    const int64_t row_bytes = fmt == FMT_Q4_1 ? K / 2 : K, ahead = 2 * NR;
    for (; n + NR <= n_hi; n += NR) {
        /* Weight rows are read once per call, straight from DRAM: fetch the tile two tiles ahead (its quants and
         * scales), so its lines are in flight while this tile computes. */
        if (r0 == 0 && n + ahead + NR <= n_hi) {
            const char *w = (const char *)(wq + (n + ahead) * row_bytes);
            for (int64_t off = 0; off < NR * row_bytes; off += 64) __builtin_prefetch(w + off, 0, 0);
            const char *dd = (const char *)(d + (n + ahead) * nb), *mm = (const char *)(m ? m + (n + ahead) * nb : 0);
            for (int64_t off = 0; off < NR * nb * 2; off += 64) {
                __builtin_prefetch(dd + off, 0, 0);
                if (mm) __builtin_prefetch(mm + off, 0, 0);
            }
        }
        PDRT_TILES(NR)
    }
    for (; n < n_hi; n++) { PDRT_TILES(1) }
#undef PDRT_TILES
}

/* y[M, N] (+)= pre(x)[M, K] @ W^T for a Q4_1 or Q8_0 W (see the header). x rows are ldx floats apart (for
 * PRE_SWIGLU a row holds [gate K | up K]); y rows ldy apart. pre: PRE_NONE | PRE_RMSNORM (norm_w [K], eps) |
 * PRE_SWIGLU. accumulate: add into y (the residual) instead of overwriting it. Returns 0, or -1 when out of
 * memory (nothing written). */
int pdrt_quant_linear(const float *x, int64_t M, int64_t ldx, int64_t K, int pre, const float *norm_w, float eps,
                      const uint8_t *wq, const f16 *d, const f16 *m, int64_t N, int fmt,
                      float *y, int64_t ldy, int accumulate, int nthreads) {
    const int64_t nb = K / QK, dxl = dxe_len(nb);
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)(M * K));
    float *dxe = malloc(sizeof(float) * (size_t)(M * (dxl + nb + K)));
    if (!xq || !dxe) { free(xq); free(dxe); return -1; }
    float *s = dxe + M * dxl, *tmp = s + M * nb;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 1)
    for (int64_t r = 0; r < M; r++)
        quantize_row(x + r * ldx, K, pre, norm_w, eps, fmt, xq + r * K, dxe + r * dxl, s + r * nb, tmp + r * K);
    /* Split N into chunks of whole tiles; each chunk runs every activation tile over its weight rows, so a
     * chunk's weights are read from memory once and stay in cache across the activation tiles. */
    const int64_t chunk = NR * 8, nchunks = (N + chunk - 1) / chunk;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t lo = c * chunk, hi = lo + chunk < N ? lo + chunk : N;
        for (int64_t r0 = 0; r0 < M; r0 += MR)
            rows_range(wq, d, m, K, lo, hi, xq, dxe, s, r0, (int)(M - r0 < MR ? M - r0 : MR), y, ldy, accumulate,
                       fmt);
    }
    free(xq);
    free(dxe);
    return 0;
}

/* W back to f32, out: [N, K] (the prefill path: many activation rows go through a BLAS matmul instead). */
void pdrt_dequantize(const uint8_t *wq, const f16 *d, const f16 *m, int64_t N, int64_t K, int fmt, float *out,
                     int nthreads) {
    const int64_t nb = K / QK;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t j = 0; j < nb; j++) {
            float dd = (float)d[n * nb + j], *o = out + n * K + j * QK;
            if (fmt == FMT_Q8_0) {
                const uint8_t *q = wq + n * K;
                for (int i = 0; i < QK; i++) o[i] = dd * (float)((int)q[act_offset(nb, j, i)] - 128);
            } else {
                const uint8_t *q = wq + n * (K / 2);
                float mm = (float)m[n * nb + j];
                for (int i = 0; i < QK; i++) {
                    int high;
                    uint8_t byte = q[q4_offset(nb, j, i, &high)];
                    o[i] = dd * (float)(high ? byte >> 4 : byte & 15) + mm;
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ decode attention */

/* RoPE (rotate-half, sin sign-folded as the model keeps it: out[i] = x[i] cos[i] + x[(i - D/2) mod D] sin[i])
 * on q and k of each row of qkv [B, (Hq + 2 Hkv) * D] in place, element i with i + D/2 (any even D), then k and
 * v stored at each row's slot. */
void pdrt_rope_store_kv(float *qkv, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, const int64_t *positions,
                        const float *cos_tab, const float *sin_tab, const int64_t *slots, float *k_cache,
                        float *v_cache) {
    const int64_t row = (Hq + 2 * Hkv) * D, half = D / 2;
    for (int64_t b = 0; b < B; b++) {
        float *r = qkv + b * row;
        const float *c = cos_tab + positions[b] * D, *sn = sin_tab + positions[b] * D;
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            float *x = r + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] + b * sn[i];
                x[i + half] = b * c[i + half] + a * sn[i + half];
            }
        }
        memcpy(k_cache + slots[b] * Hkv * D, r + Hq * D, sizeof(float) * (size_t)(Hkv * D));
        memcpy(v_cache + slots[b] * Hkv * D, r + (Hq + Hkv) * D, sizeof(float) * (size_t)(Hkv * D));
    }
}

#define GMAX 16   /* query heads per KV head handled at once */
#define TCHUNK 16 /* tokens scored before one online-softmax update */

static inline float dot_f32(const float *a, const float *b, int64_t n) {
#if PDRT_VNNI
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float v = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) v += a[i] * b[i];
    return v;
#else
    float v = 0.0f;
    for (int64_t i = 0; i < n; i++) v += a[i] * b[i];
    return v;
#endif
}

static inline void axpy_f32(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

#if PDRT_VNNI
/* e^x for x <= 0-ish scores: 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its Taylor series to degree 7
 * (relative error < 1e-8 before rounding; inputs below -87.3 give ~1e-38, callers zero masked lanes). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5252733804059841e-5f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381609e-4f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* Attention state of one query head over a span: acc [D] (unnormalised softmax-weighted V), running max and sum.
 * A work item is one sequence's span and walks it in chunks of TCHUNK tokens; each chunk updates every KV head's
 * G query heads from the chunk's K and V rows, which hold all KV heads of a token side by side: the item reads
 * its pages front to back. q is pre-scaled by the softmax scale. */

#if PDRT_VNNI
/* One chunk, one KV head, DV = D / 16 (a constant after inlining); with REG the G query heads and accumulators
 * live in registers for the chunk (G <= 4 and DV <= 4), else they are read from L1 per token. */
static inline __attribute__((always_inline)) void chunk_vec(const float *q, const int G, const int DV,
        const float **kr, const float **vr, int n, float *acc, float *mx, float *sum) {
    const int64_t D = 16 * DV;
    const int reg = G <= 4 && DV <= 4;
    float sc[GMAX][TCHUNK] __attribute__((aligned(64)));
    __m512 qv[4][4];
    if (reg)
        for (int g = 0; g < G; g++)
            for (int v = 0; v < DV; v++) qv[g][v] = _mm512_loadu_ps(q + g * D + 16 * v);
    for (int t = 0; t < n; t++) {
        __m512 kv[8];
        for (int v = 0; v < DV; v++) kv[v] = _mm512_loadu_ps(kr[t] + 16 * v);
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_setzero_ps();
            for (int v = 0; v < DV; v++)
                a = _mm512_fmadd_ps(reg ? qv[g][v] : _mm512_loadu_ps(q + g * D + 16 * v), kv[v], a);
            sc[g][t] = _mm512_reduce_add_ps(a);
        }
    }
    const __mmask16 live = (__mmask16)((1u << n) - 1u);
    for (int g = 0; g < G; g++) {
        __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, sc[g]);
        float nmax = _mm512_reduce_max_ps(sv);
        nmax = nmax > mx[g] ? nmax : mx[g];
        float corr = expf(mx[g] - nmax);  /* 0 on the first chunk: exp(-inf) */
        __m512 pv = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(nmax))));
        _mm512_store_ps(sc[g], pv);
        sum[g] = sum[g] * corr + _mm512_reduce_add_ps(pv);
        mx[g] = nmax;
        if (corr != 1.0f)
            for (int v = 0; v < DV; v++)
                _mm512_storeu_ps(acc + g * D + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * v), _mm512_set1_ps(corr)));
    }
    __m512 av[4][4];
    if (reg)
        for (int g = 0; g < G; g++)
            for (int v = 0; v < DV; v++) av[g][v] = _mm512_loadu_ps(acc + g * D + 16 * v);
    for (int t = 0; t < n; t++) {
        __m512 vv[8];
        for (int v = 0; v < DV; v++) vv[v] = _mm512_loadu_ps(vr[t] + 16 * v);
        for (int g = 0; g < G; g++) {
            __m512 pt = _mm512_set1_ps(sc[g][t]);
            for (int v = 0; v < DV; v++) {
                if (reg) av[g][v] = _mm512_fmadd_ps(pt, vv[v], av[g][v]);
                else _mm512_storeu_ps(acc + g * D + 16 * v, _mm512_fmadd_ps(pt, vv[v], _mm512_loadu_ps(acc + g * D + 16 * v)));
            }
        }
    }
    if (reg)
        for (int g = 0; g < G; g++)
            for (int v = 0; v < DV; v++) _mm512_storeu_ps(acc + g * D + 16 * v, av[g][v]);
}
#endif

/* The same for any D and G, plain C. */
static void chunk_plain(const float *q, int64_t G, int64_t D, const float **kr, const float **vr, int n, float *acc,
                        float *mx, float *sum) {
    for (int64_t g = 0; g < G; g++) {
        float sc[TCHUNK], cmax = -INFINITY;
        for (int t = 0; t < n; t++) {
            sc[t] = dot_f32(q + g * D, kr[t], D);
            cmax = sc[t] > cmax ? sc[t] : cmax;
        }
        float nmax = cmax > mx[g] ? cmax : mx[g];
        float corr = expf(mx[g] - nmax);
        float *a = acc + g * D;
        for (int64_t i = 0; i < D; i++) a[i] *= corr;
        float ssum = sum[g] * corr;
        for (int t = 0; t < n; t++) {
            float p = expf(sc[t] - nmax);
            ssum += p;
            axpy_f32(a, p, vr[t], D);
        }
        mx[g] = nmax;
        sum[g] = ssum;
    }
}

/* One chunk of n tokens for one KV head: dispatch on (G, D) to a constant-shaped vector body where one exists. */
static inline void attend_chunk(const float *q, int64_t G, int64_t D, const float **kr, const float **vr, int n,
                                float *acc, float *mx, float *sum) {
#if PDRT_VNNI
#define PDRT_CHUNK(GV, DVV) chunk_vec(q, GV, DVV, kr, vr, n, acc, mx, sum)
    if (D == 64 && G == 3) { PDRT_CHUNK(3, 4); return; }
    if (D == 64 && G == 1) { PDRT_CHUNK(1, 4); return; }
    if (D == 64 && G == 2) { PDRT_CHUNK(2, 4); return; }
    if (D == 64 && G == 4) { PDRT_CHUNK(4, 4); return; }
    if (D == 128 && G <= GMAX) { PDRT_CHUNK((int)G, 8); return; }
    if (D == 64 && G <= GMAX) { PDRT_CHUNK((int)G, 4); return; }
#undef PDRT_CHUNK
#endif
    chunk_plain(q, G, D, kr, vr, n, acc, mx, sum);
}

/* Sequence b's tokens [t0, t1), every query head: state [Hq] of (acc [D], then max and sum after all heads' accs).
 * qs: [Hq, D] scratch for the pre-scaled queries. */
static void attend_span(const float *q, int64_t Hq, int64_t Hkv, int64_t D, const float *k_cache,
                        const float *v_cache, const int32_t *pages, int64_t BLOCK, int64_t t0, int64_t t1, float scale,
                        float *acc, float *mx, float *sum, float *qs) {
    const int64_t G = Hq / Hkv;
    for (int64_t i = 0; i < Hq * D; i++) qs[i] = q[i] * scale;
    for (int64_t h = 0; h < Hq; h++) { mx[h] = -INFINITY; sum[h] = 0.0f; }
    memset(acc, 0, sizeof(float) * (size_t)(Hq * D));
    for (int64_t c0 = t0; c0 < t1; c0 += TCHUNK) {
        const int n = (int)(t1 - c0 < TCHUNK ? t1 - c0 : TCHUNK);
        const float *rows[TCHUNK];
        for (int t = 0; t < n; t++) {
            int64_t tok = c0 + t;
            rows[t] = k_cache + ((int64_t)pages[tok / BLOCK] * BLOCK + tok % BLOCK) * Hkv * D;
        }
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            const float *kr[TCHUNK], *vr[TCHUNK];
            for (int t = 0; t < n; t++) {
                kr[t] = rows[t] + kvh * D;
                vr[t] = v_cache + (rows[t] - k_cache) + kvh * D;
            }
            attend_chunk(qs + kvh * G * D, G, D, kr, vr, n, acc + kvh * G * D, mx + kvh * G, sum + kvh * G);
        }
    }
}

/* Decode attention over the paged cache: q [B, Hq, D] with rows ldq floats apart (q may sit inside qkv) ->
 * out [B, Hq * D]. Work items are (sequence, span): each sequence's context is cut into spans of at least
 * min_span tokens while there are fewer items than 2 * nthreads; spans are merged by their max and sum
 * (flash-decoding). Returns 0, or -1 when out of memory (nothing written) or when Hq / Hkv exceeds GMAX. */
int pdrt_paged_attention(const float *q, int64_t ldq, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                         const float *k_cache, const float *v_cache, int64_t BLOCK, const int32_t *block_table,
                         int64_t max_pages, const int32_t *seq_lens, float scale, float *out, int nthreads,
                         int64_t min_span) {
    if (Hq / Hkv > GMAX) return -1;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int64_t spans = 1;
    while (B * spans < 2 * nthreads && max_len / (spans * 2) >= min_span) spans *= 2;
    const int64_t items = B * spans, per = Hq * (D + 2);
    float *part = malloc(sizeof(float) * (size_t)(items * per + (int64_t)nthreads * Hq * D));
    if (!part) return -1;
    float *qscratch = part + items * per;
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        int64_t b = it / spans, sp = it % spans;
        int64_t len = seq_lens[b], step = (len + spans - 1) / spans;
        int64_t t0 = sp * step, t1 = t0 + step < len ? t0 + step : len;
        float *p = part + it * per;
        if (t0 >= t1) {  /* an empty span (a sequence shorter than its spans): skipped by the merge */
            for (int64_t h = 0; h < Hq; h++) p[Hq * D + h] = -INFINITY;  /* the mark; nothing else is read */
            continue;
        }
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        attend_span(q + b * ldq, Hq, Hkv, D, k_cache, v_cache, block_table + b * max_pages, BLOCK, t0, t1, scale,
                    p, p + Hq * D, p + Hq * D + Hq, qscratch + tid * Hq * D);
    }
    for (int64_t b = 0; b < B; b++) {
        const float *p0 = part + b * spans * per;
        for (int64_t h = 0; h < Hq; h++) {
            float gmax = -INFINITY, total = 0.0f;
            for (int64_t sp = 0; sp < spans; sp++) {
                float v = p0[sp * per + Hq * D + h];
                gmax = v > gmax ? v : gmax;
            }
            float *o = out + (b * Hq + h) * D;
            memset(o, 0, sizeof(float) * (size_t)D);
            for (int64_t sp = 0; sp < spans; sp++) {
                const float *p = p0 + sp * per;
                /* an empty span's accumulator was never written (malloc's leftovers, NaN as often as not): a weight
                 * of 0 would still carry a NaN into the sum, so the span is skipped, not weighted */
                if (p[Hq * D + h] == -INFINITY) continue;
                float w = expf(p[Hq * D + h] - gmax);
                total += w * p[Hq * D + Hq + h];
                axpy_f32(o, w, p + h * D, D);
            }
            float inv = 1.0f / total;
            for (int64_t i = 0; i < D; i++) o[i] *= inv;
        }
    }
    free(part);
    return 0;
}

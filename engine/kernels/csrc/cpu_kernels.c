/* kvtrace's CPU kernels, fp32.
 *
 * Built once per machine with -march=native by engine/cpu_kernels.py and called through ctypes
 * (which releases the GIL). Parallel loops run on torch's own OpenMP runtime: torch has already
 * loaded libgomp.so.1, and the loader resolves this library's libgomp.so.1 to that same copy.
 *
 * - kvt_linear: y = x W^T + b on weights packed once into panels of NR output columns,
 *   [panels][K][NR], so each thread streams whole panels in order. Decode batches are bound by how
 *   fast the weights are read: at 1-8 rows this reads them 1.3-1.6x faster than oneDNN's fp32 GEMM
 *   here (`python -m benchmarks kernels`), and large batches run at the same FLOP rate. Each output
 *   is one sum over k in order, so a row's result does not depend on the other rows in the batch.
 * - kvt_paged_decode_attention: one query token per sequence against its cached K/V, read in
 *   place through the block table (no gather copy, no mask).
 * - kvt_rms_norm (with the residual add), kvt_silu_mul, kvt_rope_and_cache (RoPE on q and k and
 *   the KV cache write): one pass over each row where torch runs a chain of ops.
 * Without AVX-512 only kvt_supported() is built, and it returns 0.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#define NR 32   /* output columns per panel: two AVX-512 vectors */
#define MR 8    /* rows computed together: 2 * MR accumulators stay in registers */

int kvt_supported(void) { return 1; }

int64_t kvt_packed_numel(int64_t n, int64_t k) { return (n + NR - 1) / NR * k * NR; }

/* w: [n, k] row-major (torch's [out, in]); p: [panels][k][NR], zero-padded past n. */
void kvt_pack_weight(const float *w, float *p, int64_t n, int64_t k) {
    const int64_t panels = (n + NR - 1) / NR;
    #pragma omp parallel for schedule(static)
    for (int64_t pi = 0; pi < panels; pi++) {
        float *dst = p + pi * k * NR;
        for (int64_t j = 0; j < NR; j++) {
            const int64_t col = pi * NR + j;
            for (int64_t kk = 0; kk < k; kk++)
                dst[kk * NR + j] = col < n ? w[col * k + kk] : 0.0f;
        }
    }
}

/* rows x[0:mr] against one panel; writes y[0:mr][0:ncols] (+ bias) */
static inline __attribute__((always_inline)) void panel_rows(
        const float *restrict x, int64_t k, const float *restrict panel, float *restrict y, int64_t ldy,
        int64_t ncols, const float *restrict bias, const int mr) {
    __m512 acc0[MR], acc1[MR];
    for (int m = 0; m < mr; m++) {
        acc0[m] = _mm512_setzero_ps();
        acc1[m] = _mm512_setzero_ps();
    }
    for (int64_t kk = 0; kk < k; kk++) {
        const float *wk = panel + kk * NR;
        /* the hardware prefetcher alone leaves ~25 % of the bandwidth unused at small batches */
        _mm_prefetch((const char *)(wk + 8 * NR), _MM_HINT_T0);
        _mm_prefetch((const char *)(wk + 8 * NR + 16), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
        for (int m = 0; m < mr; m++) {
            const __m512 xv = _mm512_set1_ps(x[m * k + kk]);
            acc0[m] = _mm512_fmadd_ps(xv, w0, acc0[m]);
            acc1[m] = _mm512_fmadd_ps(xv, w1, acc1[m]);
        }
    }
    for (int m = 0; m < mr; m++) {
        float out[NR];
        _mm512_storeu_ps(out, acc0[m]);
        _mm512_storeu_ps(out + 16, acc1[m]);
        float *row = y + m * ldy;
        for (int64_t j = 0; j < ncols; j++) row[j] = bias ? out[j] + bias[j] : out[j];
    }
}

/* x: [m, k] contiguous; p from kvt_pack_weight; bias: [n] or NULL; y: [m, n] contiguous */
void kvt_linear(const float *x, int64_t m, int64_t k, const float *p, int64_t n, const float *bias, float *y) {
    const int64_t panels = (n + NR - 1) / NR;
    #pragma omp parallel for schedule(static)
    for (int64_t pi = 0; pi < panels; pi++) {
        const float *panel = p + pi * k * NR;
        const int64_t c0 = pi * NR, ncols = n - c0 < NR ? n - c0 : NR;
        const float *b = bias ? bias + c0 : NULL;
        int64_t m0 = 0;
        for (; m0 + MR <= m; m0 += MR) panel_rows(x + m0 * k, k, panel, y + m0 * n + c0, n, ncols, b, MR);
        const float *xr = x + m0 * k;
        float *yr = y + m0 * n + c0;
        switch (m - m0) {  /* a constant row count per case, so each loop is unrolled into registers */
            case 1: panel_rows(xr, k, panel, yr, n, ncols, b, 1); break;
            case 2: panel_rows(xr, k, panel, yr, n, ncols, b, 2); break;
            case 3: panel_rows(xr, k, panel, yr, n, ncols, b, 3); break;
            case 4: panel_rows(xr, k, panel, yr, n, ncols, b, 4); break;
            case 5: panel_rows(xr, k, panel, yr, n, ncols, b, 5); break;
            case 6: panel_rows(xr, k, panel, yr, n, ncols, b, 6); break;
            case 7: panel_rows(xr, k, panel, yr, n, ncols, b, 7); break;
            default: break;
        }
    }
}

/* e^x, Cephes' expf polynomial (~2 ulp); below -87 it gives ~1e-38 rather than 0, above 88 inf */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* ask for a row a few positions ahead: the other KV heads' columns between one head's rows break
 * the hardware prefetcher's streams */
#ifndef KVT_AHEAD
#define KVT_AHEAD 8
#endif
static inline void prefetch_row(const float *row, int64_t n) {
    for (int64_t d = 0; d < n; d += 16) _mm_prefetch((const char *)(row + d), _MM_HINT_T0);
}

static inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    if (d < n) {
        const __mmask16 m = tail_mask(n - d);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* acc[0:n] += weight * v[0:n] */
static inline void axpy(float *acc, __m512 weight, const float *v, int64_t n) {
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(weight, _mm512_loadu_ps(v + d), _mm512_loadu_ps(acc + d)));
    if (d < n) {
        const __mmask16 m = tail_mask(n - d);
        _mm512_mask_storeu_ps(acc + d, m, _mm512_fmadd_ps(weight, _mm512_maskz_loadu_ps(m, v + d),
                                                          _mm512_maskz_loadu_ps(m, acc + d)));
    }
}

/* scores[0:len] <- softmax numerators e^(s - max); returns their sum */
static inline float exp_shifted(float *scores, int64_t len) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = tail_mask(len - t);
        top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, scores + t));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = tail_mask(len - t);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), shift));
        _mm512_mask_storeu_ps(scores + t, m, e);
        total = _mm512_mask_add_ps(total, m, total, e);
    }
    return _mm512_reduce_add_ps(total);
}

/* q: row s of the batch at q + s * q_stride, laid out [num_heads, head_dim] (query head h reads
 *    KV head h / group, group = num_heads / num_kv_heads);
 * k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
 * block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs] positions attended (this token's
 * own K/V already written);
 * sliding_window: 0 for full attention; else the query (at position len - 1) attends only the last
 *    sliding_window positions, (len - 1 - sliding_window, len - 1], and the blocks before them are not read;
 * out: [num_seqs, num_heads * head_dim]. Returns 0; 1 if a scratch buffer could not be had; 2 if a
 * sequence has no positions (the caller's mistake: a decode attends at least to itself).
 * One task per (sequence, KV head): its group of query heads reads each K and V row once. */
int kvt_paged_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                               const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                               int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, int64_t sliding_window, float scale, float *out) {
    const int64_t group = num_heads / num_kv_heads, row_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * row_stride;
    /* A task reads all KV heads of a position (one contiguous row, so the prefetcher streams whole
     * blocks) unless there are too few sequences to keep every thread busy: then one KV head each. */
    const int64_t heads_per_task = num_seqs >= 2 * omp_get_max_threads() ? num_kv_heads : 1;
    const int64_t tasks_per_seq = num_kv_heads / heads_per_task, rows = heads_per_task * group;
    int failed = 0;
    #pragma omp parallel reduction(|: failed)
    {
        float *scores = NULL;   /* [rows, len]: one row per query head of the task */
        float *acc = malloc(sizeof(float) * rows * head_dim);
        float *inv_total = malloc(sizeof(float) * rows);
        int64_t capacity = 0;
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < num_seqs * tasks_per_seq; task++) {
            const int64_t s = task / tasks_per_seq, first_kv_head = task % tasks_per_seq * heads_per_task;
            const int64_t context_len = context_lens[s], *table = block_tables + s * max_blocks;
            const float *qs = q + s * q_stride + first_kv_head * group * head_dim;   /* [rows, head_dim] */
            if (context_len <= 0) { failed |= 2; continue; }
            /* the positions attended: [first, context_len), len of them */
            const int64_t first = sliding_window > 0 && context_len > sliding_window ? context_len - sliding_window : 0;
            const int64_t len = context_len - first;
            if (rows * len > capacity) {
                free(scores);
                capacity = rows * len;
                scores = malloc(sizeof(float) * capacity);
            }
            if (scores == NULL || acc == NULL || inv_total == NULL) { failed |= 1; capacity = 0; continue; }
            /* block by block: a position's row is table[b] * block_size + i, with no division per position */
            const float *k_rows = k_cache + first_kv_head * head_dim, *v_rows = v_cache + first_kv_head * head_dim;
            for (int64_t b = first / block_size, i0 = first % block_size, t = 0; t < len; b++, i0 = 0) {
                const float *kt = k_rows + table[b] * block_stride + i0 * row_stride;
                for (int64_t i = i0; i < block_size && t < len; i++, t++, kt += row_stride) {
                    prefetch_row(kt + KVT_AHEAD * row_stride, heads_per_task * head_dim);
                    for (int64_t r = 0; r < rows; r++)
                        scores[r * len + t] = dot(qs + r * head_dim, kt + r / group * head_dim, head_dim) * scale;
                }
            }
            for (int64_t r = 0; r < rows; r++) inv_total[r] = 1.0f / exp_shifted(scores + r * len, len);
            for (int64_t i = 0; i < rows * head_dim; i++) acc[i] = 0.0f;
            for (int64_t b = first / block_size, i0 = first % block_size, t = 0; t < len; b++, i0 = 0) {
                const float *vt = v_rows + table[b] * block_stride + i0 * row_stride;
                for (int64_t i = i0; i < block_size && t < len; i++, t++, vt += row_stride) {
                    prefetch_row(vt + KVT_AHEAD * row_stride, heads_per_task * head_dim);
                    for (int64_t r = 0; r < rows; r++)
                        axpy(acc + r * head_dim, _mm512_set1_ps(scores[r * len + t]), vt + r / group * head_dim,
                             head_dim);
                }
            }
            float *os = out + s * num_heads * head_dim + first_kv_head * group * head_dim;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t d = 0; d < head_dim; d++) os[r * head_dim + d] = acc[r * head_dim + d] * inv_total[r];
        }
        free(scores);
        free(acc);
        free(inv_total);
    }
    return failed & 1 ? 1 : failed;
}

/* ---- element-wise: one pass over each row instead of a chain of torch ops -------------------- */

/* x: [rows, dim], updated in place to x + residual when residual is given (the residual stream);
 * out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight */
void kvt_rms_norm(float *x, const float *residual, const float *weight, float eps, int64_t rows, int64_t dim,
                  float *out) {
    #pragma omp parallel for schedule(static) if (rows >= 32)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim, *orow = out + r * dim;
        const float *res = residual ? residual + r * dim : NULL;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
            const __mmask16 m = tail_mask(dim - d);
            __m512 v = _mm512_maskz_loadu_ps(m, xr + d);
            if (res) {
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, res + d));
                _mm512_mask_storeu_ps(xr + d, m, v);
            }
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps));
        for (int64_t d = 0; d < dim; d += 16) {
            const __mmask16 m = tail_mask(dim - d);
            const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + d), inv);
            _mm512_mask_storeu_ps(orow + d, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, weight + d)));
        }
    }
}

/* gate_up: [rows, 2 * inter] (gate then up, as the fused projection writes them);
 * out: [rows, inter] = silu(gate) * up, silu(g) = g / (1 + e^-g) */
void kvt_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out) {
    #pragma omp parallel for schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t d = 0; d < inter; d += 16) {
            const __mmask16 m = tail_mask(inter - d);
            const __m512 gv = _mm512_maskz_loadu_ps(m, g + d);
            const __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
            _mm512_mask_storeu_ps(o + d, m, _mm512_mul_ps(_mm512_div_ps(gv, denom), _mm512_maskz_loadu_ps(m, u + d)));
        }
    }
}

/* RoPE on q and k, and this step's K and V into the cache, in one pass over the fused projection.
 * qkv: [rows, (num_heads + 2 * num_kv_heads) * head_dim]; positions, slots: [rows];
 * cos, sin_signed: [max_positions, head_dim] (sin with its first half negated), so that
 * rope(x) = x * cos + [x2, x1] * sin_signed; caches: [num_slots, num_kv_heads, head_dim];
 * qk: [rows, num_heads + num_kv_heads, head_dim] receives the rotated q and k. */
void kvt_rope_and_cache(const float *qkv, int64_t rows, const int64_t *positions, const float *cos,
                        const float *sin_signed, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        const int64_t *slots, float *k_cache, float *v_cache, float *qk) {
    const int64_t half = head_dim / 2, rotated = num_heads + num_kv_heads, width = (rotated + num_kv_heads) * head_dim;
    #pragma omp parallel for schedule(static) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *src = qkv + r * width, *c = cos + positions[r] * head_dim, *sn = sin_signed + positions[r] * head_dim;
        float *dst = qk + r * rotated * head_dim;
        for (int64_t h = 0; h < rotated; h++) {
            const float *x = src + h * head_dim;
            float *y = dst + h * head_dim;
            for (int64_t d = 0; d < half; d += 16) {  /* first half: partner x[d + half] */
                const __mmask16 m = tail_mask(half - d);
                const __m512 out = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + d + half), _mm512_maskz_loadu_ps(m, sn + d));
                _mm512_mask_storeu_ps(y + d, m, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + d),
                                                                _mm512_maskz_loadu_ps(m, c + d), out));
            }
            for (int64_t d = half; d < head_dim; d += 16) {  /* second half: partner x[d - half] */
                const __mmask16 m = tail_mask(head_dim - d);
                const __m512 out = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + d - half), _mm512_maskz_loadu_ps(m, sn + d));
                _mm512_mask_storeu_ps(y + d, m, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + d),
                                                                _mm512_maskz_loadu_ps(m, c + d), out));
            }
        }
        float *kc = k_cache + slots[r] * num_kv_heads * head_dim, *vc = v_cache + slots[r] * num_kv_heads * head_dim;
        const float *k_rot = dst + num_heads * head_dim, *v = src + rotated * head_dim;
        for (int64_t i = 0; i < num_kv_heads * head_dim; i++) {
            kc[i] = k_rot[i];
            vc[i] = v[i];
        }
    }
}

#else  /* no AVX-512: the engine keeps its torch path */
int kvt_supported(void) { return 0; }
#endif

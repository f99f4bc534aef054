/* Causal self-attention for bf16 on CPUs with AMX: forward and backward, one head
 * at a time per thread. The CPU kernel behind frugality.models.cpu_attention.
 *
 * Why: PyTorch's CPU flash attention runs at about 95 GFLOP/s forward and 35-60 backward
 * on a 2-core Xeon (heads of 512 x 64: many small products per head). Here every product
 * is one loop of AMX tile products (32 x 32 float32 blocks of the result held in tiles)
 * over operands laid out once per head, and a head's whole working set (scores of a block
 * of 64 query rows against the keys before them, the re-laid-out K, V, Q, dO) stays in L2.
 *
 * Numerics follow the flash kernels: scores, softmax and its gradient in float32 (from
 * bf16 inputs, accumulated in float32); the probabilities and dS rounded to bf16 (nearest
 * even) as inputs of the products that take them; dK and dV accumulated in float32 over
 * all query blocks and rounded once. Causal: query i sees keys 0..i; blocks skip the keys
 * past their last row. `lse` is the natural log-sum-exp of each query row's scaled scores.
 * With `rotary_dim` > 0, q and k are rotated (rotary embedding, tables as the caller keeps
 * them) in float32 as each head is laid out, rounded once; dq and dk are unrotated in
 * float32 before their one rounding.
 *
 * Layouts: q, k, v, out, dout, dq, dk, dv are bf16 (batch, heads, seq, dim) tensors with
 * any batch, head and row strides and contiguous rows (`st`: three strides per tensor), so
 * that views into a fused QKV projection and outputs laid out (batch, seq, heads, dim)
 * need no copies; lse is (batch, heads, seq) float32, contiguous. seq % 32 == 0 and
 * dim % 32 == 0 (the caller checks and otherwise uses torch's kernel). Without AMX, or
 * when Linux refuses it, both functions return -1 and do nothing.
 *
 * The product's layout: C[M][N] (float32) += A[M][K] B[K][N], A bf16 row-major, B in
 * "pair" layout: Bp[k/2][n][2] = (B[k][n], B[k+1][n]), the layout AMX's bf16 product takes
 * its second operand in. (AVX512-BF16's vdpbf16ps takes the same, but measured here it
 * ran at 55 GFLOP/s a core against AMX's 350-430: no faster than float32 FMA.)
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16_math.h"
#include "transpose.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include "amx.h"

#define MB 64 /* query rows per block */

/* C[M][N] (+)= A[M][K] Bp with AMX; M, N, K multiples of 32. ldb counts the bf16 elements
 * of one pair row (2 x its columns). Blocks of 32 x 32, tiles kept in registers over K. */
static void product(const uint16_t *A, int64_t lda, const uint16_t *Bp, int64_t ldb,
                    float *C, int64_t ldc, int64_t M, int64_t N, int64_t K, int accumulate) {
    for (int64_t n = 0; n < N; n += 32)
        for (int64_t m = 0; m < M; m += 32) {
            float *c = C + m * ldc + n;
            if (accumulate) load_block(c, ldc);
            else zero_block();
            for (int64_t k = 0; k < K; k += 32)
                block_step(A + m * lda + k, A + (m + 16) * lda + k, lda * 2, Bp + (k / 2) * ldb + 2 * n,
                           Bp + (k / 2) * ldb + 2 * (n + 16), ldb * 2);
            store_block(c, ldc);
        }
}

/* Pair layout of X^T for X [rows][cols] bf16: out[c/2][r][2] = (X[r][c], X[r][c+1]) --
 * a transpose of X read as 32-bit words. */
static void pairs_of_columns(const uint16_t *X, int64_t ld, int64_t rows, int64_t cols, uint16_t *out) {
    transpose32((const uint32_t *)X, ld / 2, rows, cols / 2, (uint32_t *)out);
}

/* Pair layout of X [rows][cols] itself: out[r/2][c][2] = (X[r][c], X[r+1][c]). */
static void pairs_of_rows(const uint16_t *X, int64_t ld, int64_t rows, int64_t cols, uint16_t *out) {
    for (int64_t r = 0; r < rows; r += 2)
        for (int64_t c = 0; c < cols; c += 16) _mm512_storeu_si512(out + r * cols + 2 * c, pair_row16(X + r * ld + c, ld));
}

/* out[c * ld_out + r] = X[r * ld + c] */
static void transpose(const uint16_t *X, int64_t ld, int64_t rows, int64_t cols, uint16_t *out, int64_t ld_out) {
    transpose_tile16(X, ld, out, ld_out, 0, rows, 0, cols);
}

/* The first n of 16 lanes (none for n <= 0). Rows and rotary halves are written with
 * explicit 16-lane vectors: gcc vectorises loops of unknown length only in steps of 16 and
 * runs their remainders (all of a Pythia rotary half of 8) one element at a time. */
static inline __mmask16 first(int64_t n) { return n <= 0 ? 0 : n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) { return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p)); }

static inline void store_bf16(uint16_t *p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

/* a (lanes) and b rounded to bf16 and interleaved into 16 columns of a pair row. */
static inline void store_pair16(uint16_t *out, __m512 a, __m512 b) {
    _mm512_storeu_si512(out, interleave_halves((__m512i)_mm512_cvtne2ps_pbh(b, a)));
}

/* Rotary embedding, rotate-half form, on one row of `dim` channels at position t: tables
 * cos, sin [t][dim] float32 with cos = 1, sin = 0 past the rotary channels and the sign of
 * the first half folded into sin, so that y = x cos + swap(x) sin, where swap exchanges
 * channel i < half with i + half (half = rotary_dim / 2) and leaves the rest. */
static inline void rotate_row(const uint16_t *restrict x, const float *restrict cos, const float *restrict sin,
                              int64_t half, int64_t dim, uint16_t *restrict y) {
    for (int64_t i = 0; i < half; i += 16) {
        __mmask16 m = first(half - i);
        __m512 a = load_bf16(x + i, m), b = load_bf16(x + i + half, m);
        store_bf16(y + i, m, _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m, cos + i),
                                             _mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, sin + i))));
        store_bf16(y + i + half, m, _mm512_fmadd_ps(b, _mm512_maskz_loadu_ps(m, cos + i + half),
                                                    _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, sin + i + half))));
    }
    memcpy(y + 2 * half, x + 2 * half, (size_t)(dim - 2 * half) * 2);
}

/* Its backward for a float32 gradient row g: dx = g cos + swap(g sin), rounded to bf16. */
static inline void unrotate_row(const float *restrict g, const float *restrict cos, const float *restrict sin,
                                int64_t half, int64_t dim, uint16_t *restrict dx) {
    for (int64_t i = 0; i < half; i += 16) {
        __mmask16 m = first(half - i);
        __m512 a = _mm512_maskz_loadu_ps(m, g + i), b = _mm512_maskz_loadu_ps(m, g + i + half);
        store_bf16(dx + i, m, _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m, cos + i),
                                              _mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, sin + i + half))));
        store_bf16(dx + i + half, m, _mm512_fmadd_ps(b, _mm512_maskz_loadu_ps(m, cos + i + half),
                                                     _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, sin + i))));
    }
    for (int64_t i = 2 * half; i < dim; i += 16) {
        __mmask16 m = first(dim - i);
        store_bf16(dx + i, m, _mm512_maskz_loadu_ps(m, g + i));
    }
}

/* The head's q or k rows, rotated when half > 0 (into `scratch`, returned with row stride
 * dim), else as they are (returned with their own stride, in *ld). */
static const uint16_t *rotated(const uint16_t *X, int64_t *ld, int64_t seq, int64_t dim, const float *cos,
                               const float *sin, int64_t half, uint16_t *scratch) {
    if (half == 0) return X;
    for (int64_t t = 0; t < seq; t++) rotate_row(X + t * *ld, cos + t * dim, sin + t * dim, half, dim, scratch + t * dim);
    *ld = dim;
    return scratch;
}

/* Element (b, h, t, d) of tensor i lies at its pointer + b * st[3i] + h * st[3i+1] + t * st[3i+2] + d. */
static inline int64_t offset(const int64_t *st, int i, int64_t b, int64_t h) { return b * st[3 * i] + h * st[3 * i + 1]; }

/* One head's inputs: q and k rotated (into qr and kr) when rotary applies, v as it is,
 * each with its row stride. */
typedef struct {
    const uint16_t *q, *k, *v;
    int64_t lq, lk, lv;
} head_inputs;

static head_inputs head(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *st, int64_t b,
                        int64_t h, int64_t seq, int64_t dim, const float *cos, const float *sin, int64_t half,
                        uint16_t *qr, uint16_t *kr) {
    head_inputs in = {.lq = st[2], .lk = st[5], .lv = st[8]};
    in.q = rotated(q + offset(st, 0, b, h), &in.lq, seq, dim, cos, sin, half, qr);
    in.k = rotated(k + offset(st, 1, b, h), &in.lk, seq, dim, cos, sin, half, kr);
    in.v = v + offset(st, 2, b, h);
    return in;
}

int64_t attention_forward_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                               float *lse, int64_t batch, int64_t heads, int64_t seq, int64_t dim,
                               const int64_t *st /* q, k, v, out */, const float *cos, const float *sin,
                               int64_t rotary_dim, float scale, int threads) {
    if (!amx_permitted()) return -1;
    int64_t no_memory = 0, lo = st[11], half = rotary_dim / 2;
#pragma omp parallel num_threads(threads) reduction(+ : no_memory)
    {
        configure_tiles();
        uint16_t *kp = scratch(seq * dim * 2), *vp = scratch(seq * dim * 2), *p = scratch(MB * seq * 2);
        uint16_t *qr = scratch(seq * dim * 2), *kr = scratch(seq * dim * 2);
        float *s = scratch(MB * seq * 4), *o = scratch(MB * dim * 4);
        float inv_sum[MB];
        int ok = kp && vp && p && qr && kr && s && o;
        no_memory += !ok;
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < batch * heads; bh++) {
            if (!ok) continue;
            int64_t b = bh / heads, h = bh % heads;
            head_inputs in = head(q, k, v, st, b, h, seq, dim, cos, sin, half, qr, kr);
            const uint16_t *Q = in.q, *K = in.k, *V = in.v;
            int64_t lq = in.lq, lk = in.lk, lv = in.lv;
            uint16_t *Out = out + offset(st, 3, b, h);
            pairs_of_columns(K, lk, seq, dim, kp); /* K^T's pairs: S = Q K^T */
            pairs_of_rows(V, lv, seq, dim, vp);    /* V's pairs: O = P V */
            for (int64_t i0 = 0; i0 < seq; i0 += MB) {
                int64_t rows = seq - i0 < MB ? seq - i0 : MB, keys = i0 + rows;
                product(Q + i0 * lq, lq, kp, 2 * seq, s, seq, rows, keys, dim, 0);
                for (int64_t r = 0; r < rows; r++) { /* P, unnormalised, in bf16; zeros past the causal edge */
                    const float *x = s + r * seq;
                    int64_t seen = i0 + r + 1;
                    __m512 high = _mm512_set1_ps(-INFINITY), sums = _mm512_setzero_ps();
                    for (int64_t j = 0; j < seen; j += 16) high = _mm512_max_ps(high, _mm512_mask_loadu_ps(high, first(seen - j), x + j));
                    float max = _mm512_reduce_max_ps(high) * scale;
                    for (int64_t j = 0; j < keys; j += 16) {
                        __m512 e = _mm512_setzero_ps();
                        if (j < seen)
                            e = _mm512_maskz_mov_ps(first(seen - j), exp_nonpositive16(_mm512_fmsub_ps(
                                _mm512_loadu_ps(x + j), _mm512_set1_ps(scale), _mm512_set1_ps(max))));
                        sums = _mm512_add_ps(sums, e);
                        store_bf16(p + r * seq + j, 0xFFFF, e);
                    }
                    float sum = _mm512_reduce_add_ps(sums);
                    lse[bh * seq + i0 + r] = max + logf(sum);
                    inv_sum[r] = 1.0f / sum;
                }
                product(p, seq, vp, 2 * dim, o, dim, rows, dim, keys, 0);
                for (int64_t r = 0; r < rows; r++) store_row(o + r * dim, inv_sum[r], dim, Out + (i0 + r) * lo);
            }
        }
        _tile_release();
        free(kp), free(vp), free(p), free(qr), free(kr), free(s), free(o);
    }
    return no_memory ? -2 : 0;
}

int64_t attention_backward_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                                const float *lse, const uint16_t *dout, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                                int64_t batch, int64_t heads, int64_t seq, int64_t dim,
                                const int64_t *st /* q, k, v, out, dout, dq, dk, dv */, const float *cos,
                                const float *sin, int64_t rotary_dim, float scale, int threads) {
    if (!amx_permitted()) return -1;
    int64_t no_memory = 0, lo = st[11], ldo = st[14], half = rotary_dim / 2;
    int64_t ldq = st[17], ldk = st[20], ldv = st[23];
    size_t plane = seq * dim;
#pragma omp parallel num_threads(threads) reduction(+ : no_memory)
    {
        configure_tiles();
        uint16_t *kp = scratch(plane * 2), *vp = scratch(plane * 2), *k_rows = scratch(plane * 2);
        uint16_t *qt = scratch(plane * 2), *dot = scratch(plane * 2);
        uint16_t *pp = scratch(MB * seq * 2), *dsp = scratch(MB * seq * 2), *ds = scratch(MB * seq * 2);
        float *dkt = scratch(plane * 4), *dvt = scratch(plane * 4), *delta = scratch(seq * 4);
        float *s = scratch(MB * seq * 4), *dp = scratch(MB * seq * 4), *acc = scratch(MB * dim * 4);
        uint16_t *qr = scratch(plane * 2), *kr = scratch(plane * 2);
        float *dk_rows = scratch(plane * 4);
        int ok = kp && vp && k_rows && qt && dot && pp && dsp && ds && dkt && dvt && delta && s && dp && acc
                 && qr && kr && dk_rows;
        no_memory += !ok;
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < batch * heads; bh++) {
            if (!ok) continue;
            int64_t b = bh / heads, h = bh % heads;
            head_inputs in = head(q, k, v, st, b, h, seq, dim, cos, sin, half, qr, kr);
            const uint16_t *Q = in.q, *K = in.k, *V = in.v;
            int64_t lq = in.lq, lk = in.lk, lv = in.lv;
            const uint16_t *O = out + offset(st, 3, b, h), *dO = dout + offset(st, 4, b, h);
            uint16_t *dQ = dq + offset(st, 5, b, h), *dK = dk + offset(st, 6, b, h), *dV = dv + offset(st, 7, b, h);
            const float *L = lse + bh * seq;
            pairs_of_columns(K, lk, seq, dim, kp);  /* S = Q K^T */
            pairs_of_columns(V, lv, seq, dim, vp);  /* dP = dO V^T */
            pairs_of_rows(K, lk, seq, dim, k_rows); /* dQ = dS K */
            transpose(Q, lq, seq, dim, qt, seq);    /* dK^T = Q^T dS */
            transpose(dO, ldo, seq, dim, dot, seq); /* dV^T = dO^T P */
            memset(dkt, 0, plane * 4);
            memset(dvt, 0, plane * 4);
            for (int64_t i = 0; i < seq; i++) { /* softmax backward's row term: sum_d dO O */
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t d = 0; d < dim; d++) sum += bf16_to_f32(dO[i * ldo + d]) * bf16_to_f32(O[i * lo + d]);
                delta[i] = sum;
            }
            for (int64_t i0 = 0; i0 < seq; i0 += MB) {
                int64_t rows = seq - i0 < MB ? seq - i0 : MB, keys = i0 + rows;
                product(Q + i0 * lq, lq, kp, 2 * seq, s, seq, rows, keys, dim, 0);
                product(dO + i0 * ldo, ldo, vp, 2 * seq, dp, seq, rows, keys, dim, 0);
                /* P and dS = P (dP - delta) scale, zero past the causal edge: dS's rows in
                 * bf16, and both in pair layout, two rows at a time */
                for (int64_t r = 0; r < rows; r += 2) {
                    __m512 lse_a = _mm512_set1_ps(L[i0 + r]), lse_b = _mm512_set1_ps(L[i0 + r + 1]);
                    __m512 delta_a = _mm512_set1_ps(delta[i0 + r]), delta_b = _mm512_set1_ps(delta[i0 + r + 1]);
                    __m512 vscale = _mm512_set1_ps(scale);
                    int64_t seen = i0 + r + 1; /* row r's; row r + 1 sees one more */
                    for (int64_t j = 0; j < keys; j += 16) {
                        __m512 pa = _mm512_setzero_ps(), pb = pa, dsa = pa, dsb = pa;
                        if (j <= seen) {
                            int64_t at = r * seq + j;
                            pa = _mm512_maskz_mov_ps(first(seen - j), exp_nonpositive16(
                                _mm512_fmsub_ps(_mm512_loadu_ps(s + at), vscale, lse_a)));
                            pb = _mm512_maskz_mov_ps(first(seen + 1 - j), exp_nonpositive16(
                                _mm512_fmsub_ps(_mm512_loadu_ps(s + at + seq), vscale, lse_b)));
                            dsa = _mm512_maskz_mul_ps(first(seen - j), _mm512_mul_ps(pa, _mm512_sub_ps(_mm512_loadu_ps(dp + at), delta_a)), vscale);
                            dsb = _mm512_maskz_mul_ps(first(seen + 1 - j), _mm512_mul_ps(pb, _mm512_sub_ps(_mm512_loadu_ps(dp + at + seq), delta_b)), vscale);
                        }
                        store_bf16(ds + r * seq + j, 0xFFFF, dsa);
                        store_bf16(ds + (r + 1) * seq + j, 0xFFFF, dsb);
                        store_pair16(pp + r * seq + 2 * j, pa, pb);
                        store_pair16(dsp + r * seq + 2 * j, dsa, dsb);
                    }
                }
                product(ds, seq, k_rows, 2 * dim, acc, dim, rows, dim, keys, 0);
                for (int64_t r = 0; r < rows; r++) {
                    int64_t t = i0 + r;
                    if (half) unrotate_row(acc + r * dim, cos + t * dim, sin + t * dim, half, dim, dQ + t * ldq);
                    else store_row(acc + r * dim, 1.0f, dim, dQ + t * ldq);
                }
                product(dot + i0, seq, pp, 2 * seq, dvt, seq, dim, keys, rows, 1);
                product(qt + i0, seq, dsp, 2 * seq, dkt, seq, dim, keys, rows, 1);
            }
            /* dK^T and dV^T rounded to bf16 (into the layouts' scratch, free now), then laid
             * out as rows; with rotary, dK^T is laid out as float32 rows first and unrotated */
            if (half) {
                transpose32((const uint32_t *)dkt, seq, dim, seq, (uint32_t *)dk_rows);
                for (int64_t t = 0; t < seq; t++)
                    unrotate_row(dk_rows + t * dim, cos + t * dim, sin + t * dim, half, dim, dK + t * ldk);
            } else {
                store_row(dkt, 1.0f, plane, qt);
                transpose(qt, seq, dim, seq, dK, ldk);
            }
            store_row(dvt, 1.0f, plane, dot);
            transpose(dot, seq, dim, seq, dV, ldv);
        }
        _tile_release();
        free(kp), free(vp), free(k_rows), free(qt), free(dot), free(pp), free(dsp), free(ds);
        free(dkt), free(dvt), free(delta), free(s), free(dp), free(acc), free(qr), free(kr), free(dk_rows);
    }
    return no_memory ? -2 : 0;
}

#else /* no AMX: the caller uses torch's kernel */

int64_t attention_forward_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                               float *lse, int64_t batch, int64_t heads, int64_t seq, int64_t dim,
                               const int64_t *st, const float *cos, const float *sin, int64_t rotary_dim,
                               float scale, int threads) {
    return -1;
}

int64_t attention_backward_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                                const float *lse, const uint16_t *dout, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                                int64_t batch, int64_t heads, int64_t seq, int64_t dim,
                                const int64_t *st, const float *cos, const float *sin, int64_t rotary_dim,
                               float scale, int threads) {
    return -1;
}
#endif

/* The forward products of linear layers in bf16 on CPUs with AMX (and input gradients,
 * which the models use only past KMAX, through matmul_long_bf16):
 * out[m][n] = sum_k A[m][k] B[k][n] (+ bias[n]), float32 accumulation over all of K in
 * tiles, plus the bias, rounded once to bf16 (nearest even).
 *
 * Why: oneDNN ran these products at 400-700 GFLOP/s on a 2-core Xeon where a loop of AMX
 * tile products from L2 ran at 900-1000 (same process, same minute). Each 32 x 32 block
 * ends with an epilogue (tile stores, bias, rounding, 32 row stores) of about a quarter of
 * the block's time at K = 512 if done in turn; AMX works alongside the vector units, so
 * here the epilogue of block i is spread over the k loop of block i + 1.
 *
 * B is a layer's weight, as W[n][k] (the forward product x W^T: `b_rows_n` = 1) or as
 * W[k][n] (the input gradient dY W: `b_rows_n` = 0). Each thread takes panels of B's
 * columns, packs its panel once into contiguous 1 KB tile blocks in the pair layout AMX's
 * B operand takes (4-byte transposes from W[n][k], two rows interleaved from W[k][n]), and
 * runs every 32-row block of A past it while it sits in L2 (panels of up to 1 MB, their
 * number a multiple of the threads). A's tiles are loaded straight from its rows.
 *
 * M, N, K multiples of 32, K at most KMAX; rows of A, W and out contiguous, `lda`, `ldw`,
 * `ldo` elements apart. Returns 0, -1 without AMX (or when Linux refuses it), -2 when out
 * of memory, -3 when K is too large.
 */
#include <stdint.h>
#include <stdlib.h>

#include "transpose.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include "amx.h"

#define KMAX 4096
#define PANEL_BYTES (1 << 20) /* a packed panel of B: L2 is 2 MB a core */
#define PANEL_MAX 1024

/* Panel of W[n][k] (rows n0.. of `width`): block (n/16, k/32) row j holds (W[n][k + 2j],
 * W[n][k + 2j + 1]) for its 16 n: a 16 x 16 transpose of 4-byte pairs. */
static void pack_rows_n(const uint16_t *w, int64_t ldw, int64_t n0, int64_t width, int64_t K, uint16_t *out) {
    int64_t kb = K / 32;
    for (int64_t n = 0; n < width; n += 16)
        for (int64_t k = 0; k < K; k += 32)
            transpose32((const uint32_t *)(w + (n0 + n) * ldw + k), ldw / 2, 16, 16,
                        (uint32_t *)BLOCK(out, kb, n / 16, k / 32));
}

/* Panel of W[k][n] (columns n0.. of `width`): rows k and k + 1 interleaved. */
static void pack_rows_k(const uint16_t *w, int64_t ldw, int64_t n0, int64_t width, int64_t K, uint16_t *out) {
    int64_t kb = K / 32;
    for (int64_t k = 0; k < K; k += 2)
        for (int64_t n = 0; n < width; n += 16)
            _mm512_storeu_si512(BLOCK(out, kb, n / 16, k / 32) + ((k % 32) / 2) * 32,
                                pair_row16(w + k * ldw + n0 + n, ldw));
}

/* A finished 32 x 32 float32 block on its way to bf16 rows of out, `row` rows done. */
typedef struct {
    const float *c;
    uint16_t *out;
    int64_t ldo;
    __m512 bias_lo, bias_hi;
    int row;
} epilogue;

static inline void finish_rows(epilogue *e, int upto) {
    for (; e->row < upto; e->row++) {
        const float *c = e->c + e->row * 32;
        _mm512_storeu_si512(e->out + e->row * e->ldo,
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + 16), e->bias_hi),
                                                         _mm512_add_ps(_mm512_loadu_ps(c), e->bias_lo)));
    }
}

/* Columns per panel: up to PANEL_BYTES of packed B, the panels a multiple of the threads. */
static int64_t panel_width(int64_t N, int64_t K, int threads) {
    int64_t most = PANEL_BYTES / (2 * K) / 32 * 32;
    most = most > PANEL_MAX ? PANEL_MAX : most < 32 ? 32 : most;
    int64_t panels = (N + most - 1) / most;
    panels = (panels + threads - 1) / threads * threads;
    return ((N + panels - 1) / panels + 31) / 32 * 32;
}

int64_t matmul_bf16(const uint16_t *a, int64_t lda, const uint16_t *w, int64_t ldw, int b_rows_n,
                    const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t M, int64_t N, int64_t K,
                    int threads) {
    if (!amx_permitted()) return -1;
    if (K > KMAX) return -3;
    int64_t kb = K / 32, panel = panel_width(N, K, threads), no_memory = 0;
    int per_step = (int)((32 + kb - 1) / kb); /* epilogue rows per k step */
#pragma omp parallel num_threads(threads) reduction(+ : no_memory)
    {
        configure_tiles();
        uint16_t *wb = scratch((size_t)panel * K * 2);
        float *cbuf = scratch(2 * 32 * 32 * 4), *bias32 = scratch(panel * 4);
        int ok = wb && cbuf && bias32, half = 0;
        no_memory += !ok;
        epilogue done = {.c = cbuf, .row = 32};
#pragma omp for schedule(dynamic)
        for (int64_t n0 = 0; n0 < N; n0 += panel) {
            if (!ok) continue;
            int64_t width = N - n0 < panel ? N - n0 : panel;
            if (b_rows_n) pack_rows_n(w, ldw, n0, width, K, wb);
            else pack_rows_k(w, ldw, n0, width, K, wb);
            for (int64_t n = 0; n < width; n += 16)
                _mm512_storeu_ps(bias32 + n, bias ? bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(bias + n0 + n)))
                                                  : _mm512_setzero_ps());
            for (int64_t m = 0; m < M; m += 32)
                for (int64_t n = 0; n < width; n += 32) {
                    const uint16_t *a0 = a + m * lda, *a1 = a0 + 16 * lda;
                    zero_block();
                    for (int64_t k = 0; k < kb; k++) {
                        block_step(a0 + k * 32, a1 + k * 32, lda * 2, BLOCK(wb, kb, n / 16, k),
                                   BLOCK(wb, kb, n / 16 + 1, k), 64);
                        finish_rows(&done, done.row + per_step < 32 ? done.row + per_step : 32);
                    }
                    finish_rows(&done, 32);
                    float *c = cbuf + half * 32 * 32; /* two buffers: this block's and the one being finished */
                    half ^= 1;
                    store_block(c, 32);
                    done = (epilogue){.c = c, .out = out + m * ldo + n0 + n, .ldo = ldo,
                                      .bias_lo = _mm512_loadu_ps(bias32 + n), .bias_hi = _mm512_loadu_ps(bias32 + n + 16)};
                }
        }
        finish_rows(&done, 32);
        _tile_release();
        free(wb), free(cbuf), free(bias32);
    }
    return no_memory ? -2 : 0;
}

/* The input gradient of a wide layer (K past KMAX: the output layer's 50k outputs):
 * out[m][n] = sum_k A[m][k] W[k][n]. W is packed once into the pair layout (KC-row chunks
 * of contiguous tile blocks, all N columns); each thread takes groups of MG rows of A and
 * accumulates their float32 result (MG x N) over chunks of KC columns of A, each packed
 * into tile blocks first (A's rows may lie 100 KB apart: strided tile loads would touch
 * 16 pages each). Per chunk, a 32-row slab of A (32 KB) stays in L1 while the chunk of W
 * (L2) runs past it. */
#define MG 256  /* rows of A per group: their float32 result, MG x N, stays in L2 */
#define KC 512  /* columns of A per chunk: a 32-row slab of them (32 KB) stays in L1 */

int64_t matmul_long_bf16(const uint16_t *a, int64_t lda, const uint16_t *w, int64_t ldw, uint16_t *out,
                         int64_t ldo, int64_t M, int64_t N, int64_t K, int threads) {
    if (!amx_permitted()) return -1;
    uint16_t *wp = scratch((size_t)K * N * 2);
    if (!wp) return -2;
    int64_t chunks = (K + KC - 1) / KC, no_memory = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t k0 = c * KC, kc = K - k0 < KC ? K - k0 : KC;
        pack_rows_k(w + k0 * ldw, ldw, 0, N, kc, wp + k0 * N);
    }
#pragma omp parallel num_threads(threads) reduction(+ : no_memory)
    {
        configure_tiles();
        uint16_t *ap = scratch((size_t)MG * KC * 2);
        float *acc = scratch((size_t)MG * N * 4);
        int ok = ap && acc;
        no_memory += !ok;
#pragma omp for schedule(dynamic)
        for (int64_t m0 = 0; m0 < M; m0 += MG) {
            if (!ok) continue;
            int64_t rows = M - m0 < MG ? M - m0 : MG;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                int64_t kc = K - k0 < KC ? K - k0 : KC, kb = kc / 32;
                const uint16_t *wc = wp + k0 * N; /* this chunk of W: blocks (n/16, k/32), kb per 16 columns */
                for (int64_t m = 0; m < rows; m += 16)
                    for (int64_t k = 0; k < kc; k += 32)
                        for (int r = 0; r < 16; r++)
                            _mm512_storeu_si512(BLOCK(ap, kb, m / 16, k / 32) + r * 32,
                                                _mm512_loadu_si512(a + (m0 + m + r) * lda + k0 + k));
                for (int64_t m = 0; m < rows; m += 32)
                    for (int64_t n = 0; n < N; n += 32) {
                        float *c = acc + m * N + n;
                        if (k0 == 0) zero_block();
                        else load_block(c, N);
                        for (int64_t k = 0; k < kb; k++)
                            block_step(BLOCK(ap, kb, m / 16, k), BLOCK(ap, kb, m / 16 + 1, k), 64,
                                       BLOCK(wc, kb, n / 16, k), BLOCK(wc, kb, n / 16 + 1, k), 64);
                        store_block(c, N);
                    }
            }
            for (int64_t r = 0; r < rows; r++) store_row(acc + r * N, 1.0f, N, out + (m0 + r) * ldo);
        }
        _tile_release();
        free(ap), free(acc);
    }
    free(wp);
    return no_memory ? -2 : 0;
}

#else /* no AMX: the caller uses torch's product */

int64_t matmul_bf16(const uint16_t *a, int64_t lda, const uint16_t *w, int64_t ldw, int b_rows_n,
                    const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t M, int64_t N, int64_t K,
                    int threads) {
    return -1;
}

int64_t matmul_long_bf16(const uint16_t *a, int64_t lda, const uint16_t *w, int64_t ldw, uint16_t *out,
                         int64_t ldo, int64_t M, int64_t N, int64_t K, int threads) {
    return -1;
}
#endif

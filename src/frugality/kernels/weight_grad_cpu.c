/* The weight gradient of a linear layer in bf16 on CPUs with AMX, written in the weight's
 * own layout: dW[n][d] = sum_t G[t][n] X[t][d] for G (tokens x outputs) and X (tokens x
 * inputs), float32 accumulation, rounded once to bf16 (nearest even).
 *
 * Why: oneDNN runs this product (reduction over the tokens, both operands token-major)
 * at 350-490 GFLOP/s on a 2-core Xeon where it runs the forward products at 600-900,
 * and for the output layer's 50k x 512 gradient it was faster only with both operands and
 * the result transposed. Here the product is computed as dW^T = X^T G: X^T, laid out once
 * in AMX's A-operand order, is the small operand; G is packed a panel of PANEL outputs at
 * a time in the pair layout AMX's B operand takes (two token rows interleaved: contiguous
 * reads, no transposing); each 32 x 32 block of dW^T is accumulated in tiles over all
 * tokens, transposed in L1 and rounded once into dW's rows. Both operands are packed in
 * contiguous 1 KB tile blocks: strided tile loads put each of a tile's 16 rows in another
 * 4 KB page, and the TLB misses halved the speed.
 *
 * With `db` (else NULL), also the bias gradient db[n] = sum_t G[t][n], summed in float32
 * as G is packed and rounded once.
 *
 * T, D, N multiples of 32; rows of G and X contiguous, `ldg`, `ldx` elements apart.
 * Returns 0, -1 without AMX (or when Linux refuses it), -2 when out of memory.
 */
#include <stdint.h>
#include <stdlib.h>

#include "transpose.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include "amx.h"

#define PANEL 256   /* outputs per panel: a packed panel is PANEL x T bf16 (1 MB at 2048 tokens), in L2 */
#define PREFETCH 8  /* token-row pairs ahead: G's rows can be far apart (100 KB in the output layer) */

/* Pair layout, blocked: block (col/16, row/32) of `rows` x `cols` bf16 matrix M holds
 * M[r][c], M[r+1][c] interleaved for 16 row pairs and 16 columns. Contiguous reads of two
 * rows at a time; rows of `width` columns starting at column c0. The column sums (the
 * bias gradient, when M is a layer's output gradient) come with the same reads, in
 * float32 into `sums`. */
static void pack_pairs(const uint16_t *m, int64_t ld, int64_t rows, int64_t c0, int64_t width, uint16_t *out,
                       float *sums) {
    for (int64_t c = 0; c < width; c++) sums[c] = 0.0f;
    int64_t kb = rows / 32;
    for (int64_t r = 0; r < rows; r += 2) {
        if (r + PREFETCH + 1 < rows) /* beyond what the hardware prefetcher follows */
            for (int64_t c = 0; c < width; c += 32) {
                _mm_prefetch((const char *)(m + (r + PREFETCH) * ld + c0 + c), _MM_HINT_T0);
                _mm_prefetch((const char *)(m + (r + PREFETCH + 1) * ld + c0 + c), _MM_HINT_T0);
            }
        for (int64_t c = 0; c < width; c += 16) {
            const uint16_t *top = m + r * ld + c0 + c;
            _mm512_storeu_si512(BLOCK(out, kb, c / 16, r / 32) + ((r % 32) / 2) * 32, pair_row16(top, ld));
            __m512 sum = _mm512_add_ps(_mm512_loadu_ps(sums + c), bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)top)));
            _mm512_storeu_ps(sums + c, _mm512_add_ps(sum, bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(top + ld)))));
        }
    }
}

/* A finished 32 x 32 block of dW^T (c[d][n], float32) on its way into dW's rows, `row`
 * of them (n) done: four at a time, transposed in registers and rounded. It is finished a
 * few rows at a time during the next block's tile products, which the tile unit runs
 * alongside. */
typedef struct {
    const float *c;
    uint16_t *dw; /* dW[n][d] of the block's first n and d */
    int64_t ld;
    int row;
} epilogue;

static inline void finish_rows(epilogue *e, int upto) {
    float t[4 * 32];
    for (; e->row < upto; e->row += 4) {
        for (int i = 0; i < 32; i += 4) block4x32((const uint32_t *)(e->c + i * 32 + e->row), 32, (uint32_t *)(t + i), 32);
        for (int j = 0; j < 4; j++) store_row(t + j * 32, 1.0f, 32, e->dw + (e->row + j) * e->ld);
    }
}

int64_t weight_grad_bf16(const uint16_t *g, int64_t ldg, const uint16_t *x, int64_t ldx, uint16_t *dw,
                         uint16_t *db, int64_t T, int64_t N, int64_t D, int threads) {
    if (!amx_permitted()) return -1;
    int64_t kb = T / 32; /* 32-token blocks */
    /* xb: X^T blocked, the A operand: block (d/16, t/32) = X[t..t+32][d..d+16]^T */
    uint16_t *xb = scratch((size_t)T * D * 2);
    if (!xb) return -2;
#pragma omp parallel for schedule(static) num_threads(threads) collapse(2)
    for (int64_t t = 0; t < T; t += 32)
        for (int64_t d = 0; d < D; d += 16)
            transpose_tile16(x + t * ldx + d, ldx, BLOCK(xb, kb, d / 16, t / 32), 32, 0, 32, 0, 16);
    int64_t no_memory = 0;
#pragma omp parallel num_threads(threads) reduction(+ : no_memory)
    {
        configure_tiles();
        uint16_t *gb = scratch((size_t)PANEL * T * 2);
        float *cbuf = scratch(2 * 32 * 32 * 4), *sums = scratch(PANEL * 4);
        int ok = gb && cbuf && sums, half = 0;
        no_memory += !ok;
        epilogue done = {.c = cbuf, .row = 32};
        int64_t every = kb >= 8 ? kb / 8 : 1; /* k steps per four rows of the epilogue */
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
            if (!ok) continue;
            int64_t width = N - n0 < PANEL ? N - n0 : PANEL;
            pack_pairs(g, ldg, T, n0, width, gb, sums); /* the B operand: G's panel in pair layout */
            if (db) store_row(sums, 1.0f, width, db + n0);
            for (int64_t d = 0; d < D; d += 32)
                for (int64_t n = 0; n < width; n += 32) {
                    zero_block();
                    for (int64_t k = 0; k < kb; k++) {
                        block_step(BLOCK(xb, kb, d / 16, k), BLOCK(xb, kb, d / 16 + 1, k), 64, BLOCK(gb, kb, n / 16, k),
                                   BLOCK(gb, kb, n / 16 + 1, k), 64);
                        if (k % every == every - 1 && done.row < 32) finish_rows(&done, done.row + 4);
                    }
                    finish_rows(&done, 32);
                    float *c = cbuf + half * 32 * 32; /* two buffers: this block's and the one being finished */
                    half ^= 1;
                    store_block(c, 32);
                    done = (epilogue){.c = c, .dw = dw + (n0 + n) * D + d, .ld = D};
                }
        }
        finish_rows(&done, 32);
        _tile_release();
        free(gb), free(cbuf), free(sums);
    }
    free(xb);
    return no_memory ? -2 : 0;
}

#else /* no AMX: the caller uses torch's product */

int64_t weight_grad_bf16(const uint16_t *g, int64_t ldg, const uint16_t *x, int64_t ldx, uint16_t *dw,
                         uint16_t *db, int64_t T, int64_t N, int64_t D, int threads) {
    return -1;
}
#endif

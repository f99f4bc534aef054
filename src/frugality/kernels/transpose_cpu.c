/* Out-of-place transpose of a 2-byte matrix (bf16 or fp16: bits are moved, not converted).
 *
 * Why: oneDNN's AMX matrix product runs the output layer's products up to 1.7x faster when
 * the large operand is laid out the other way round, but torch's own transposing copy of
 * 2-byte types moves one element at a time (about 85 ms for 50k x 512 on a 2-core Xeon,
 * more than the product saves). Here 8 x 8 blocks are transposed in SSE2 registers, within
 * 256 x 256 tiles that keep both sides in L2: about 20 ms (a plain copy takes 8).
 */
#include <stdint.h>

#include "transpose.h"

#define TI 256 /* source rows per tile */
#define TJ 256 /* source columns per tile */

/* dst[j * ld_dst + i] = src[i * ld_src + j] for i < rows, j < cols. */
void transpose_2byte(const uint16_t *restrict src, int64_t rows, int64_t cols, int64_t ld_src,
                     uint16_t *restrict dst, int64_t ld_dst, int threads) {
    int64_t row_tiles = (rows + TI - 1) / TI, col_tiles = (cols + TJ - 1) / TJ;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < row_tiles * col_tiles; t++) {
        int64_t i0 = (t / col_tiles) * TI, j0 = (t % col_tiles) * TJ;
        int64_t i1 = i0 + TI < rows ? i0 + TI : rows;
        int64_t j1 = j0 + TJ < cols ? j0 + TJ : cols;
        transpose_tile16(src, ld_src, dst, ld_dst, i0, i1, j0, j1);
    }
}

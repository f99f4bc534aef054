/* AMX plumbing shared by the C kernels that use Intel's tile matrix unit
 * (attention_cpu.c, weight_grad_cpu.c, matmul_cpu.c): the OS permission, the tile
 * configuration, the packed tile-block address, the 2 x 2 tile block of C (zero, load,
 * store, one step of K), bf16 <-> float32 rows, the pair interleave of AMX's B operand,
 * aligned scratch. Included only where __AMX_BF16__, __AMX_TILE__ and __AVX512BF16__ are
 * defined. */
#ifndef FRUGALITY_AMX_H
#define FRUGALITY_AMX_H
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out AMX's register state only on request (once per process). */
static int amx_permitted(void) {
    static int state = 0; /* 0 not asked yet, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* Eight tiles of 16 rows x 64 bytes: 0-3 a 32 x 32 float32 block of C, 4-5 two 16 x 32
 * bf16 blocks of A, 6-7 two 16-pair x 16 blocks of B. Per thread; released after use, so
 * oneDNN (which configures its own before each product) finds the state as it expects. */
static void configure_tiles(void) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
}

/* The 1 KB tile block (i16, k32) of an operand packed in contiguous blocks: 16 rows of its
 * outer dimension x 32 of K (or 16 pairs of K x 16 columns x 2), `row_blocks_k` blocks per
 * 16 rows. Contiguous blocks keep a tile load within one page. */
#define BLOCK(base, row_blocks_k, i16, k32) ((base) + (((i16) * (row_blocks_k) + (k32)) << 9))

/* The 32 x 32 float32 block of C in tiles 0-3 (rows 16 apart, `ld` floats a row): zeroed,
 * loaded, stored. */
static inline void zero_block(void) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }

static inline void load_block(const float *c, int64_t ld) {
    _tile_loadd(0, c, ld * 4); _tile_loadd(1, c + 16, ld * 4);
    _tile_loadd(2, c + 16 * ld, ld * 4); _tile_loadd(3, c + 16 * ld + 16, ld * 4);
}

static inline void store_block(float *c, int64_t ld) {
    _tile_stored(0, c, ld * 4); _tile_stored(1, c + 16, ld * 4);
    _tile_stored(2, c + 16 * ld, ld * 4); _tile_stored(3, c + 16 * ld + 16, ld * 4);
}

/* One step of K (32) for the block: A's two 16-row tiles a0, a1 (rows `a_stride` bytes
 * apart) against B's two 16-column pair tiles b0, b1 (`b_stride`). */
static inline void block_step(const void *a0, const void *a1, int64_t a_stride, const void *b0, const void *b1,
                              int64_t b_stride) {
    _tile_loadd(4, a0, a_stride); _tile_loadd(5, a1, a_stride);
    _tile_loadd(6, b0, b_stride); _tile_loadd(7, b1, b_stride);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
}

/* n float32 values (n % 16 == 0) times `scale`, rounded to bf16 (nearest even). */
static inline void store_row(const float *a, float scale, int64_t n, uint16_t *out) {
    for (int64_t j = 0; j < n; j += 16)
        _mm256_storeu_si256((__m256i *)(out + j),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(a + j), _mm512_set1_ps(scale))));
}

/* 16 bf16 values to float32 (exact: the bits move up by 16). */
static inline __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* (a0..a15, b0..b15) -> (a0, b0, a1, b1, ..., a15, b15): 16-bit elements of two rows
 * interleaved into one pair row of the layout AMX's bf16 product takes its B operand in. */
static inline __m512i interleave_halves(__m512i ab) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, ab);
}

/* Columns c..c+16 of rows `top` and `top + ld` as one pair row: (top[c], top[ld + c], ...). */
static inline __m512i pair_row16(const uint16_t *top, int64_t ld) {
    __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)top)),
                                    _mm256_loadu_si256((const __m256i *)(top + ld)), 1);
    return interleave_halves(ab);
}

static void *scratch(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }
#endif

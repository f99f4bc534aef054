/* Transposes of 2- and 4-byte matrices in SIMD registers (bits are moved, not converted),
 * shared by the C kernels. Single-threaded; callers split the work. */
#ifndef FRUGALITY_TRANSPOSE_H
#define FRUGALITY_TRANSPOSE_H
#include <stdint.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* One 8 x 8 block: d[j * ld + i] = s[i * ls + j]. */
static inline void block8(const uint16_t *restrict s, int64_t ls, uint16_t *restrict d, int64_t ld) {
#ifdef __SSE2__
    __m128i r0 = _mm_loadu_si128((const __m128i *)(s + 0 * ls)), r1 = _mm_loadu_si128((const __m128i *)(s + 1 * ls));
    __m128i r2 = _mm_loadu_si128((const __m128i *)(s + 2 * ls)), r3 = _mm_loadu_si128((const __m128i *)(s + 3 * ls));
    __m128i r4 = _mm_loadu_si128((const __m128i *)(s + 4 * ls)), r5 = _mm_loadu_si128((const __m128i *)(s + 5 * ls));
    __m128i r6 = _mm_loadu_si128((const __m128i *)(s + 6 * ls)), r7 = _mm_loadu_si128((const __m128i *)(s + 7 * ls));
    __m128i a0 = _mm_unpacklo_epi16(r0, r1), a1 = _mm_unpackhi_epi16(r0, r1);
    __m128i a2 = _mm_unpacklo_epi16(r2, r3), a3 = _mm_unpackhi_epi16(r2, r3);
    __m128i a4 = _mm_unpacklo_epi16(r4, r5), a5 = _mm_unpackhi_epi16(r4, r5);
    __m128i a6 = _mm_unpacklo_epi16(r6, r7), a7 = _mm_unpackhi_epi16(r6, r7);
    __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    _mm_storeu_si128((__m128i *)(d + 0 * ld), _mm_unpacklo_epi64(b0, b4));
    _mm_storeu_si128((__m128i *)(d + 1 * ld), _mm_unpackhi_epi64(b0, b4));
    _mm_storeu_si128((__m128i *)(d + 2 * ld), _mm_unpacklo_epi64(b1, b5));
    _mm_storeu_si128((__m128i *)(d + 3 * ld), _mm_unpackhi_epi64(b1, b5));
    _mm_storeu_si128((__m128i *)(d + 4 * ld), _mm_unpacklo_epi64(b2, b6));
    _mm_storeu_si128((__m128i *)(d + 5 * ld), _mm_unpackhi_epi64(b2, b6));
    _mm_storeu_si128((__m128i *)(d + 6 * ld), _mm_unpacklo_epi64(b3, b7));
    _mm_storeu_si128((__m128i *)(d + 7 * ld), _mm_unpackhi_epi64(b3, b7));
#else
    for (int i = 0; i < 8; i++) for (int j = 0; j < 8; j++) d[j * ld + i] = s[i * ls + j];
#endif
}

/* One 4 x 4 block of 4-byte elements: d[j * ld + i] = s[i * ls + j]. */
static inline void block4x32(const uint32_t *restrict s, int64_t ls, uint32_t *restrict d, int64_t ld) {
#ifdef __SSE2__
    __m128i r0 = _mm_loadu_si128((const __m128i *)(s + 0 * ls)), r1 = _mm_loadu_si128((const __m128i *)(s + 1 * ls));
    __m128i r2 = _mm_loadu_si128((const __m128i *)(s + 2 * ls)), r3 = _mm_loadu_si128((const __m128i *)(s + 3 * ls));
    __m128i a0 = _mm_unpacklo_epi32(r0, r1), a1 = _mm_unpackhi_epi32(r0, r1);
    __m128i a2 = _mm_unpacklo_epi32(r2, r3), a3 = _mm_unpackhi_epi32(r2, r3);
    _mm_storeu_si128((__m128i *)(d + 0 * ld), _mm_unpacklo_epi64(a0, a2));
    _mm_storeu_si128((__m128i *)(d + 1 * ld), _mm_unpackhi_epi64(a0, a2));
    _mm_storeu_si128((__m128i *)(d + 2 * ld), _mm_unpacklo_epi64(a1, a3));
    _mm_storeu_si128((__m128i *)(d + 3 * ld), _mm_unpackhi_epi64(a1, a3));
#else
    for (int i = 0; i < 4; i++) for (int j = 0; j < 4; j++) d[j * ld + i] = s[i * ls + j];
#endif
}

/* dst[j * ld_dst + i] = src[i * ld_src + j] for the 2-byte elements i in [i0, i1),
 * j in [j0, j1): 8 x 8 blocks, then the edges one by one. */
static void transpose_tile16(const uint16_t *restrict src, int64_t ld_src, uint16_t *restrict dst,
                             int64_t ld_dst, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    int64_t i8 = i0 + (i1 - i0) / 8 * 8, j8 = j0 + (j1 - j0) / 8 * 8;
    for (int64_t i = i0; i < i8; i += 8)
        for (int64_t j = j0; j < j8; j += 8)
            block8(src + i * ld_src + j, ld_src, dst + j * ld_dst + i, ld_dst);
    for (int64_t i = i0; i < i1; i++)  /* the edges: rows past i8, columns past j8 */
        for (int64_t j = (i < i8 ? j8 : j0); j < j1; j++) dst[j * ld_dst + i] = src[i * ld_src + j];
}

/* dst[j * rows + i] = src[i * ld_src + j] for 4-byte elements, in 4 x 4 blocks; rows and
 * cols multiples of 4. */
static void transpose32(const uint32_t *restrict src, int64_t ld_src, int64_t rows, int64_t cols,
                        uint32_t *restrict dst) {
    for (int64_t i = 0; i < rows; i += 4)
        for (int64_t j = 0; j < cols; j += 4) block4x32(src + i * ld_src + j, ld_src, dst + j * rows + i, rows);
}
#endif

/* Helpers shared by the C kernels: bf16 <-> float32 conversion and a vectorisable exp. */
#ifndef FRUGALITY_BF16_MATH_H
#define FRUGALITY_BF16_MATH_H
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round-to-nearest-even, as c10::BFloat16 */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint16_t rounded = (uint16_t)((bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : rounded;
}

/* The Cephes single-precision exp: exp(x) = 2^k exp(r), k = round(x / ln 2), r = x - k ln 2
 * (ln 2 in two parts), exp(r) = 1 + r + r^2 (P0 + P1 r + ... + P5 r^5). Every vector form
 * of it in these kernels takes its constants from here. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HIGH 0.693359375f
#define EXP_LN2_LOW (-2.12194440e-4f)
#define EXP_P5 1.9875691500e-4f
#define EXP_P4 1.3981999507e-3f
#define EXP_P3 8.3334519073e-3f
#define EXP_P2 4.1665795894e-2f
#define EXP_P1 1.6666665459e-1f
#define EXP_P0 5.0000001201e-1f
#define EXP_LOWEST (-87.3f) /* exp of it is about the smallest normal float */
/* exp(r) of the reduced argument, for a float or a GCC vector of them (the same operations
 * in the same order: the scalar and vector forms agree bit for bit) */
#define EXP_REDUCED(r)                                                                                 \
    ((((((EXP_P5 * (r) + EXP_P4) * (r) + EXP_P3) * (r) + EXP_P2) * (r) + EXP_P1) * (r) + EXP_P0) * (r) * \
         (r) +                                                                                         \
     (r) + 1.0f)

/* exp(x) for x <= 0 (callers subtract a maximum first; small positive x is fine too):
 * the Cephes single-precision polynomial (relative error about 1e-7, like libm's expf),
 * branch-free so that loops over it vectorise, which libm's expf does not without
 * -ffast-math. */
static inline float exp_nonpositive(float x) {
    x = x < EXP_LOWEST ? EXP_LOWEST : x;
    float k = rintf(x * EXP_LOG2E);
    float r = x - k * EXP_LN2_HIGH;
    r = r - k * EXP_LN2_LOW;
    float p = EXP_REDUCED(r);
    int32_t e = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}

#ifdef __AVX512F__
#include <immintrin.h>
/* exp_nonpositive on 16 lanes, written out: gcc vectorises the scalar form only in loops
 * whose length it can see, and leaves the remainders of short rows scalar. */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LOWEST));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(EXP_LN2_HIGH), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(EXP_LN2_LOW), r);
    __m512 p = _mm512_set1_ps(EXP_P5);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P0));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);  /* p * 2^k */
}
#endif
#endif

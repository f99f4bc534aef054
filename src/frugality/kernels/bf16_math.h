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

/* exp(x) for x <= 0 (callers subtract a maximum first; small positive x is fine too):
 * the Cephes single-precision polynomial (relative error about 1e-7, like libm's expf),
 * branch-free so that loops over it vectorise, which libm's expf does not without
 * -ffast-math. */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;  /* exp(-87.3) is about the smallest normal float */
    float k = rintf(x * 1.44269504088896341f);
    float r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
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
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);  /* p * 2^k */
}
#endif
#endif

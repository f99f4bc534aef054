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
#endif

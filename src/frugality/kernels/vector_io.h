/* Vectors and single elements of bf16 or float32 tensors, as float32: the loads and stores
 * of the kernels that take either dtype (layer_norm_cpu.c, int8_linear_cpu.c). bf16 is
 * widened exactly and rounded once on the way out, nearest even. */
#ifndef FRUGALITY_VECTOR_IO_H
#define FRUGALITY_VECTOR_IO_H
#include <stdint.h>
#include <string.h>

#include "bf16_math.h"
#include "vector_lanes.h"

static inline vec loadv(const void *base, int64_t at, int bf16) {
    vec x;
    if (bf16) {
        vech h;
        memcpy(&h, (const uint16_t *)base + at, sizeof h);
        const veci bits = __builtin_convertvector(h, veci) << 16;
        memcpy(&x, &bits, sizeof x);
    } else {
        memcpy(&x, (const float *)base + at, sizeof x);
    }
    return x;
}

typedef uint32_t vecu __attribute__((vector_size(4 * LANES)));

static inline void storev(void *base, int64_t at, vec x, int bf16) {
    if (bf16) { /* nearest even (unsigned: no overflow). A NaN stays a NaN but for payloads
                 * with their 16 low bits all but clear (none that arithmetic makes): a select
                 * for those cost the layer-norm kernel 3-6% */
        vecu bits;
        memcpy(&bits, &x, sizeof bits);
        const vech h = __builtin_convertvector((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16, vech);
        memcpy((uint16_t *)base + at, &h, sizeof h);
    } else {
        memcpy((float *)base + at, &x, sizeof x);
    }
}

static inline float load1(const void *base, int64_t at, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[at]) : ((const float *)base)[at];
}

static inline void store1(void *base, int64_t at, float x, int bf16) {
    if (bf16)
        ((uint16_t *)base)[at] = f32_to_bf16(x);
    else
        ((float *)base)[at] = x;
}
#endif

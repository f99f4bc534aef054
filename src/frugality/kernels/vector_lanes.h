/* GCC's generic vectors at the CPU's width, for the kernels written with them: AVX-512's 16
 * lanes where the CPU has them, AVX2's 8 elsewhere (wider generic vectors than the CPU's were
 * lowered through memory: 20x slower). */
#ifndef FRUGALITY_VECTOR_LANES_H
#define FRUGALITY_VECTOR_LANES_H
#include <stdint.h>

#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(4 * LANES)));
typedef int32_t veci __attribute__((vector_size(4 * LANES)));
typedef uint16_t vech __attribute__((vector_size(2 * LANES)));
#endif

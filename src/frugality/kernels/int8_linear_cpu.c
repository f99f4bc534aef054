/* The passes around an int8 linear layer's product on CPUs, behind
 * frugality.precision.int8: each row of activations quantized to int8 with a scale of its
 * own (before oneDNN's int8 x int8 -> int32 product), and the int32 products scaled back,
 * with the bias, to the activations' dtype (after it).
 *
 *   scale[r] = max(max_c |x[r, c]|, 1e-8) / 127
 *   q[r, c] = clamp(round_half_even(x[r, c] / scale[r]), -127, 127)
 *   out[r, c] = (float)acc[r, c] * scale[r] * col_scale[c] + bias[c]
 *
 * Why: done by torch these are a handful of passes over each layer's activations (or one
 * pass compiled by Inductor, behind a guard check of tens of microseconds at every call:
 * 24 calls a MiniLM forward); here each is one pass, and bf16 activations are read and
 * written as bf16 (half the bytes of float32).
 *
 * x: (rows, cols) contiguous, bf16 or float32; q: (rows, cols) int8; scales: (rows) float32.
 * acc: (rows, cols) int32; col_scales, bias: (cols) float32; out: (rows, cols) contiguous,
 * bf16 or float32. The same float32 operations in the same order as the torch expressions
 * (built without fused multiply-adds): the same int8 rows and float32 outputs; bf16 outputs
 * are those rounded once (nearest even). A row with a NaN gets a NaN scale, so NaN outputs,
 * as torch's (its int8 values there are 0).
 */
#include <stdint.h>
#include <string.h>

#include "vector_io.h" /* loadv, storev, load1, store1: bf16 or float32 */

typedef int8_t vecb __attribute__((vector_size(LANES)));

/* (at and above this many elements a pass is shared between threads; below it the threads'
 * start costs more than they save) */
#define PARALLEL_ELEMENTS 32768
/* 1.5 * 2^23: added to and taken from |v| < 2^22 it rounds v to an integer, half to even
 * (the default rounding mode), as torch.round does */
#define ROUNDER 12582912.0f

static inline vec selectv(veci pick, vec a, vec b) { return (vec)(((veci)a & pick) | ((veci)b & ~pick)); }

/* |x|, and x's sign bits (their |x| given back with sign | magnitude) */
static inline vec absv(vec x) { return (vec)((veci)x & 0x7FFFFFFF); }
static inline veci signv(vec x) { return (veci)x & (int32_t)0x80000000u; }

static inline float quantize1(float x, float scale) {
    float v = x / scale;
    if (v != v) return 0.0f; /* (NaN: its row's scale is NaN too, and so are its outputs) */
    v = v < 0 ? -((-v + ROUNDER) - ROUNDER) : (v + ROUNDER) - ROUNDER;
    return v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
}

int64_t quantize_rows(const void *x, int64_t rows, int64_t cols, int bf16, int8_t *q, float *scales, int threads) {
    const vec zero = {0}, top = zero + 127.0f, bottom = zero - 127.0f, rounder = zero + ROUNDER;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t first = r * cols, whole = cols - cols % LANES;
        vec highs = zero;
        for (int64_t c = 0; c < whole; c += LANES) {
            const vec magnitude = absv(loadv(x, first + c, bf16));
            /* (a NaN, once met, is kept: as torch's amax gives it) */
            highs = selectv((highs == highs) & ~(magnitude <= highs), magnitude, highs);
        }
        float high = 0.0f;
        for (int l = 0; l < LANES; l++) high = high == high && !(highs[l] <= high) ? highs[l] : high;
        for (int64_t c = whole; c < cols; c++) {
            const float a = load1(x, first + c, bf16), magnitude = a < 0 ? -a : a;
            high = high == high && !(magnitude <= high) ? magnitude : high;
        }
        const float scale = (high < 1e-8f ? 1e-8f : high) / 127.0f; /* (NaN stays NaN) */
        scales[r] = scale;
        const vec scalev = zero + scale;
        for (int64_t c = 0; c < whole; c += LANES) {
            vec v = loadv(x, first + c, bf16) / scalev;
            /* (the rounding on magnitudes: |v| + 1.5 * 2^23 keeps its exponent, so it rounds to
             * an integer, half to even, whatever the sign) */
            const vec rounded = (absv(v) + rounder) - rounder;
            v = (vec)((veci)rounded | signv(v));
            v = selectv(v > top, top, v);
            v = selectv(v < bottom, bottom, v);
            v = selectv(v == v, v, zero); /* (NaN: 0, as quantize1) */
            const vecb b = __builtin_convertvector(__builtin_convertvector(v, veci), vecb);
            memcpy(q + first + c, &b, sizeof b);
        }
        for (int64_t c = whole; c < cols; c++) q[first + c] = (int8_t)quantize1(load1(x, first + c, bf16), scale);
    }
    return 0;
}

int64_t dequantize_rows(const int32_t *acc, int64_t rows, int64_t cols, const float *scales, const float *col_scales,
                        const float *bias, void *out, int bf16, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t first = r * cols, whole = cols - cols % LANES;
        const vec scale = (vec){0} + scales[r];
        for (int64_t c = 0; c < whole; c += LANES) {
            veci a;
            vec s, b;
            memcpy(&a, acc + first + c, sizeof a);
            memcpy(&s, col_scales + c, sizeof s);
            memcpy(&b, bias + c, sizeof b);
            storev(out, first + c, __builtin_convertvector(a, vec) * scale * s + b, bf16);
        }
        for (int64_t c = whole; c < cols; c++) {
            store1(out, first + c, (float)acc[first + c] * scales[r] * col_scales[c] + bias[c], bf16);
        }
    }
    return 0;
}

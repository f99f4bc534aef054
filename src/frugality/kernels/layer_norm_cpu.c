/* A residual add and LayerNorm at inference on CPUs, row by row: behind
 * frugality.kernels.layer_norm (BERT's post-LN blocks and its embeddings' norm).
 *
 *   out = LayerNorm(x + r) = ((x + r) - mean) / sqrt(var + eps) * weight + bias
 *
 * Why: PyTorch's CPU LayerNorm, and the add before it, pay their fixed costs per row and per
 * call; an encoder's narrow rows (32 features) never amortise them: a one-layer width-32
 * BERT spent 46 ms of 280 in LayerNorm and 9 ms in the adds on 20,000 texts (one thread,
 * bf16, Zen 4). Here a row is summed, normalised and written in one pass over registers.
 *
 * x, out: (rows, width), contiguous; r: NULL, or rows r_stride elements apart (width: one
 * per row; 0: one row added to every row); weight, bias: (width); all of one dtype (bf16 or
 * float32). In bf16 the sum x + r is rounded to bf16 first, as the torch expression
 * `norm(x + r)` rounds it; then float32 arithmetic: the mean, then the biased variance about
 * it (two passes, the second correcting the mean; torch's moments are Welford's), each
 * output rounded once (nearest even). torch's results up to float32 rounding; a row of equal
 * values gives the bias, as torch's. NaN inputs give NaN or unspecified outputs. Returns 0,
 * or -2 where scratch could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

#include "bf16_math.h"
#include "vector_io.h" /* loadv, storev, load1, store1: bf16 or float32 */

/* x rounded to bf16 (nearest even) and widened back: what a bf16 tensor holds */
static inline vec roundv(vec x) {
    const veci high = (veci){0} + (int32_t)0xFFFF0000u;
    veci bits;
    memcpy(&bits, &x, sizeof bits);
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & high;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* the lanes' sum (a chain of LANES scalar adds was most of a narrow row's time) */
static inline float sumv(vec x) {
#ifdef __AVX512F__
    __m512 v;
    memcpy(&v, &x, sizeof v);
    return _mm512_reduce_add_ps(v);
#else
    __m256 v;
    memcpy(&v, &x, sizeof v);
    const __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 eighth = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_add_ss(eighth, _mm_movehdup_ps(eighth)));
#endif
}

/* COUNT rows from `first` (row index times width), side by side: their sums, means and
 * variances are independent chains the CPU runs at once (a row at a time waited on each
 * row's reductions, square root and division: 36 ns a row of 32). s: COUNT * width floats. */
static inline __attribute__((always_inline)) void norm_rows(const void *x, const void *r, int64_t r_first,
                                                            int64_t r_stride, const void *weight,
                                                            const void *bias, void *out, int64_t first,
                                                            int64_t width, float eps, int bf16, float *s,
                                                            const int count) {
    const int64_t whole = width / LANES * LANES;
    const float per = 1.0f / (float)width;
    float mean[8], rstd[8];
    for (int g = 0; g < count; g++) {
        const int64_t at = first + g * width, r_at = r_first + g * r_stride;
        float *sg = s + g * width;
        vec acc = (vec){0};
        float tail = 0.0f;
        for (int64_t c = 0; c < whole; c += LANES) {
            vec v = loadv(x, at + c, bf16);
            if (r != NULL) v = bf16 ? roundv(v + loadv(r, r_at + c, bf16)) : v + loadv(r, r_at + c, bf16);
            memcpy(sg + c, &v, sizeof v);
            acc += v;
        }
        for (int64_t c = whole; c < width; c++) {
            float v = load1(x, at + c, bf16);
            if (r != NULL) {
                v += load1(r, r_at + c, bf16);
                if (bf16) v = bf16_to_f32(f32_to_bf16(v));
            }
            sg[c] = v;
            tail += v;
        }
        mean[g] = (sumv(acc) + tail) * per; /* (rounding corrected below) */
    }
    for (int g = 0; g < count; g++) {
        const float *sg = s + g * width;
        /* the deviations' squares and their sum, which corrects the mean's rounding (the
         * corrected two-pass form: a row of equal values gets a zero variance, and its
         * output the bias, as torch's Welford moments give) */
        vec dev = (vec){0}, lin = (vec){0};
        float tail = 0.0f, lin_tail = 0.0f;
        for (int64_t c = 0; c < whole; c += LANES) {
            vec v;
            memcpy(&v, sg + c, sizeof v);
            v -= mean[g];
            lin += v;
            dev += v * v;
        }
        for (int64_t c = whole; c < width; c++) {
            const float d = sg[c] - mean[g];
            lin_tail += d;
            tail += d * d;
        }
        const float l = sumv(lin) + lin_tail;
        mean[g] += l / (float)width; /* (divided: exact where the deviations are equal) */
        const float variance = (sumv(dev) + tail - l * l * per) * per;
        rstd[g] = 1.0f / sqrtf((variance > 0.0f ? variance : 0.0f) + eps);
    }
    for (int g = 0; g < count; g++) {
        const int64_t at = first + g * width;
        const float *sg = s + g * width;
        const float scale = rstd[g];
        for (int64_t c = 0; c < whole; c += LANES) {
            vec v;
            memcpy(&v, sg + c, sizeof v);
            storev(out, at + c, ((v - mean[g]) * scale) * loadv(weight, c, bf16) + loadv(bias, c, bf16), bf16);
        }
        for (int64_t c = whole; c < width; c++)
            store1(out, at + c, ((sg[c] - mean[g]) * scale) * load1(weight, c, bf16) + load1(bias, c, bf16), bf16);
    }
}

int64_t add_layer_norm(const void *x, const void *r, int64_t r_stride, const void *weight, const void *bias, void *out,
                       int64_t rows, int64_t width, float eps, int bf16, int threads) {
    /* small calls on one thread: a parallel region's start costs more than their rows */
    if (rows * width < 32768) threads = 1;
    const int64_t blocks = (rows + 7) / 8;
    int failed = 0;
    /* (one thread: no parallel region at all, whose entry alone cost about a microsecond) */
#pragma omp parallel if (threads > 1) num_threads(threads) reduction(| : failed)
    {
        float *s = malloc(sizeof(float) * (size_t)(8 * width));
        if (s == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t block = 0; block < blocks; block++) {
            if (s == NULL) continue;
            const int64_t row = block * 8;
            if (row + 8 <= rows) {
                norm_rows(x, r, row * r_stride, r_stride, weight, bias, out, row * width, width, eps, bf16, s, 8);
            } else {
                for (int64_t one = row; one < rows; one++)
                    norm_rows(x, r, one * r_stride, r_stride, weight, bias, out, one * width, width, eps, bf16, s, 1);
            }
        }
        free(s);
    }
    return failed ? -2 : 0;
}

/* Softmax cross-entropy over rows of logits, and its gradient written over the logits:
 * the CPU kernel behind frugality.models.loss.
 *
 * Each row (one token's logits over the vocabulary) is read once into a float32 buffer
 * the size of one row (50k entries: 200 KB, in a core's L2), and everything else happens
 * there: the maximum, exp and sum, the loss, and — when a gradient is wanted —
 * (softmax - onehot(target)) * scale, written back over the row in the logits' dtype
 * (round-to-nearest-even for bf16). Memory traffic is one read and one write of the
 * logits; the torch-ops path needs about eight passes over them.
 *
 * exp is the Cephes single-precision polynomial (relative error about 1e-7, like libm's
 * expf) written branch-free so that the loop vectorises; libm's expf does not without
 * -ffast-math. A row holding NaN or an infinite maximum gets a NaN loss and a NaN
 * gradient, as the textbook formula would, so a diverged run is seen as one.
 */
#include <stdlib.h>

#include "bf16_math.h"

/* The row in `x` (float32, `cols` long): returns its loss, and leaves exp(x - max) / sum
 * times `scale` in `x` when `want_grad`, with `scale` subtracted at the target. */
static float row_loss(float *x, int64_t cols, int64_t target, float scale, int want_grad) {
    float max = -INFINITY;
    int bad = 0;
#pragma omp simd reduction(max : max) reduction(| : bad)
    for (int64_t j = 0; j < cols; j++) {
        max = x[j] > max ? x[j] : max;
        bad |= x[j] != x[j];
    }
    if (bad || isinf(max)) {
        for (int64_t j = 0; j < cols; j++) x[j] = NAN;
        return NAN;
    }
    float target_logit = x[target];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < cols; j++) {
        x[j] = exp_nonpositive(x[j] - max);
        sum += x[j];
    }
    if (want_grad) {
        float factor = scale / sum;
#pragma omp simd
        for (int64_t j = 0; j < cols; j++) x[j] *= factor;
        x[target] -= scale;
    }
    return logf(sum) + max - target_logit;
}

static void load_bf16(float *restrict x, const uint16_t *restrict row, int64_t cols) {
    for (int64_t j = 0; j < cols; j++) x[j] = bf16_to_f32(row[j]);
}
static void store_bf16(uint16_t *restrict row, const float *restrict x, int64_t cols) {
    for (int64_t j = 0; j < cols; j++) row[j] = f32_to_bf16(x[j]);
}
static void load_f32(float *restrict x, const float *restrict row, int64_t cols) {
    memcpy(x, row, (size_t)cols * sizeof(float));
}
static void store_f32(float *restrict row, const float *restrict x, int64_t cols) {
    memcpy(row, x, (size_t)cols * sizeof(float));
}

/* For each of `rows` rows (`ld` elements apart): losses[i] = the row's cross-entropy
 * against targets[i]; with `want_grad`, the row is overwritten by the loss gradient times
 * `scale`. Returns the number of targets outside [0, cols) (those rows are left alone,
 * their loss NaN), or -1 if a row buffer could not be allocated; the caller raises. */
#define CROSS_ENTROPY(NAME, T, LOAD, STORE)                                                  \
    int64_t NAME(T *logits, int64_t rows, int64_t cols, int64_t ld, const int64_t *targets, \
                 float scale, int want_grad, float *losses, int threads) {                  \
        int64_t bad_targets = 0, no_memory = 0;                                             \
        _Pragma("omp parallel num_threads(threads) reduction(+ : bad_targets, no_memory)") { \
            float *x = malloc((size_t)cols * sizeof(float));                                \
            no_memory += x == NULL;                                                         \
            _Pragma("omp for schedule(static)")                                             \
            for (int64_t i = 0; i < rows; i++) {                                            \
                int64_t target = targets[i];                                                \
                if (x == NULL || target < 0 || target >= cols) {                            \
                    bad_targets += x != NULL;                                               \
                    losses[i] = NAN;                                                        \
                    continue;                                                               \
                }                                                                           \
                LOAD(x, logits + i * ld, cols);                                             \
                losses[i] = row_loss(x, cols, target, scale, want_grad);                    \
                if (want_grad) STORE(logits + i * ld, x, cols);                             \
            }                                                                               \
            free(x);                                                                        \
        }                                                                                   \
        return no_memory ? -1 : bad_targets;                                                \
    }

CROSS_ENTROPY(cross_entropy_bf16, uint16_t, load_bf16, store_bf16)
CROSS_ENTROPY(cross_entropy_f32, float, load_f32, store_f32)

/* Softmax cross-entropy over rows of logits, and its gradient written over the logits:
 * the CPU kernel behind frugality.kernels.output_loss.
 *
 * Each row (one token's logits over the vocabulary) is read once into a float32 buffer
 * the size of one row (50k entries: 200 KB, in a core's L2), and everything else happens
 * there, in three passes: the maximum, exp and sum, the loss, and — when a gradient is wanted —
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

/* One row of logits (`cols` long, in its own dtype T): returns its loss, computed in the
 * float32 buffer `x`; when `want_grad`, overwrites the row with exp(x - max) / sum * scale,
 * `scale` subtracted at the target. Three passes: load and maximum, exp and sum, scale and
 * store. */
#define ROW_LOSS(NAME, T, TO_F32, FROM_F32)                                                      \
    static float NAME(T *restrict row, float *restrict x, int64_t cols, int64_t target, float scale, \
                      int want_grad) {                                                         \
        float max = -INFINITY;                                                                 \
        int bad = 0;                                                                           \
        _Pragma("omp simd reduction(max : max) reduction(| : bad)")                            \
        for (int64_t j = 0; j < cols; j++) {                                                   \
            x[j] = TO_F32(row[j]);                                                             \
            max = x[j] > max ? x[j] : max;                                                     \
            bad |= x[j] != x[j];                                                               \
        }                                                                                      \
        if (bad || isinf(max)) {                                                               \
            if (want_grad)                                                                     \
                for (int64_t j = 0; j < cols; j++) row[j] = FROM_F32(NAN);                     \
            return NAN;                                                                        \
        }                                                                                      \
        float target_logit = x[target];                                                        \
        float sum = 0.0f;                                                                      \
        _Pragma("omp simd reduction(+ : sum)")                                                 \
        for (int64_t j = 0; j < cols; j++) {                                                   \
            x[j] = exp_nonpositive(x[j] - max);                                                \
            sum += x[j];                                                                       \
        }                                                                                      \
        if (want_grad) {                                                                       \
            float factor = scale / sum;                                                        \
            _Pragma("omp simd")                                                                \
            for (int64_t j = 0; j < cols; j++) row[j] = FROM_F32(x[j] * factor);              \
            row[target] = FROM_F32(x[target] * factor - scale);                                \
        }                                                                                      \
        return logf(sum) + max - target_logit;                                                 \
    }

#define SAME(v) (v)
ROW_LOSS(row_loss_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
ROW_LOSS(row_loss_f32, float, SAME, SAME)

/* For each of `rows` rows (`ld` elements apart): losses[i] = the row's cross-entropy
 * against targets[i]; with `want_grad`, the row is overwritten by the loss gradient times
 * `scale`. Returns the number of targets outside [0, cols) (those rows are left alone,
 * their loss NaN), or -1 if a row buffer could not be allocated; the caller raises. */
#define CROSS_ENTROPY(NAME, T, ROW_LOSS_FN)                                                  \
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
                losses[i] = ROW_LOSS_FN(logits + i * ld, x, cols, target, scale, want_grad); \
            }                                                                               \
            free(x);                                                                        \
        }                                                                                   \
        return no_memory ? -1 : bad_targets;                                                \
    }

CROSS_ENTROPY(cross_entropy_bf16, uint16_t, row_loss_bf16)
CROSS_ENTROPY(cross_entropy_f32, float, row_loss_f32)

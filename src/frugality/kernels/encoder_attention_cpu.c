/* Bidirectional attention of an encoder's short texts on CPUs: one (text, head) a task,
 * behind frugality.kernels.encoder_attention.
 *
 * Why: PyTorch's CPU attention (its flash kernel, or the math path's batched products)
 * pays a few microseconds of set-up per head, whatever the head's size: at an embedding
 * job's batches (64 texts of about 30 tokens, 12 heads of 32) that was about 3 ms a layer
 * for about 0.1 GFLOP, a fifth of a MiniLM call; with 4 heads of 8 it was half of a
 * one-layer model's time. Here a head's queries (times the scale), keys (transposed) and
 * values are widened once into float32 scratch, and each query's scores, softmax and
 * weighted sum run in 16-lane vectors held in registers (GCC's vector extensions: AVX-512
 * where the CPU has it, two AVX2 halves elsewhere).
 *
 * q, k, v: element (b, t, h, c) at b * batch_stride + t * token_stride + h * dim + c (the
 * packed projection's rows hold q, k and v one after another; separate projections are
 * three tensors of the same strides). keep: (batch, seq) bytes, nonzero where a key is a
 * real token. out: (batch, seq, heads, dim), contiguous. Every query gets its row,
 * padding positions too (as SDPA gives them); a text with no key kept gets zeros (SDPA:
 * NaN). float32 arithmetic; bf16 inputs widened, outputs rounded once (nearest even).
 * dim at most 256. Returns 0, -2 where scratch could not be allocated, -3 for a dim over 256.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_math.h"

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
#define ROWS 4  /* queries scored together: ROWS x 2 accumulators, enough chains to hide an FMA's latency */
#define MAX_DIM 256

static inline v16 splat(float x) { return (v16){0} + x; }

static inline v16 load16(const float *p) {
    v16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store16(float *p, v16 x) { memcpy(p, &x, sizeof x); }

/* where `pick` (a comparison's lanes: all ones or zero) a's lane, else b's */
static inline v16 select16(v16i pick, v16 a, v16 b) { return (v16)(((v16i)a & pick) | ((v16i)b & ~pick)); }

static inline float max16(v16 x) {
    for (int half = 8; half >= 1; half /= 2) {
        const v16i swap = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        const v16 y = __builtin_shuffle(x, swap ^ half);
        x = select16(x > y, x, y);
    }
    return x[0];
}

static inline float sum16(v16 x) {
    for (int half = 8; half >= 1; half /= 2) {
        const v16i swap = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        x += __builtin_shuffle(x, swap ^ half);
    }
    return x[0];
}

/* exp_nonpositive (bf16_math.h) on 16 lanes: the same Cephes polynomial */
static inline v16 exp16(v16 x) {
    const v16i under = x < -87.3f; /* exp underflows there: 0 (and -inf, masked keys, too) */
    x = select16(under, splat(-87.3f), x);
    const v16 magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v16 k = (x * 1.44269504088896341f + magic) - magic;
    v16 r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    v16 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16i e = (__builtin_convertvector(k, v16i) + 127) << 23;
    v16 scale;
    memcpy(&scale, &e, sizeof scale);
    return select16(under, splat(0.0f), p * scale);
}

/* count (at most 16) lanes of x stored at out + at, as float32 or rounded to bf16 (nearest
 * even, as f32_to_bf16; no NaN reaches here from finite inputs) */
static inline void put16(void *out, int64_t at, v16 x, int count, int bf16) {
    if (bf16) {
        const v16i bits = (v16i)x;
        const v16h h = __builtin_convertvector((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, v16h);
        memcpy((uint16_t *)out + at, &h, 2 * (size_t)count);
    } else {
        memcpy((float *)out + at, &x, 4 * (size_t)count);
    }
}

/* n elements from base + at, as float32 (times scale), into dst */
static inline void widen(float *dst, const void *base, int64_t at, int64_t n, float scale, int bf16) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + at;
        for (int64_t c = 0; c < n; c++) dst[c] = bf16_to_f32(src[c]) * scale;
    } else {
        const float *src = (const float *)base + at;
        for (int64_t c = 0; c < n; c++) dst[c] = src[c] * scale;
    }
}

/* One (text, head): qs (rows of dpad) scaled queries, kt (dim, kstride) keys transposed
 * (zero past n), vs (n, dpad) values, s (ROWS, kstride) scores; n keys kept, scored in
 * width = n rounded up to 16. ROWS queries at a time, 32 keys or features at a time. */
static void head(const float *qs, const float *kt, const float *vs, float *s, int64_t seq, int64_t n,
                 int64_t width, int64_t kstride, int64_t dim, int64_t dpad, void *out, int64_t out_stride,
                 int bf16) {
    v16 tail = splat(0.0f); /* -inf on the last vector's lanes past n */
    for (int l = (int)(n % 16); l < 16 && n % 16; l++) tail[l] = -INFINITY;
    for (int64_t i0 = 0; i0 < seq; i0 += ROWS) {
        for (int64_t j0 = 0; j0 < width; j0 += 32) {
            const int two = j0 + 16 < width;
            v16 a[ROWS][2];
            for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = splat(0.0f);
            for (int64_t c = 0; c < dim; c++) {
                const v16 k0 = load16(kt + c * kstride + j0), k1 = two ? load16(kt + c * kstride + j0 + 16) : k0;
                for (int r = 0; r < ROWS; r++) {
                    const v16 qc = splat(qs[(i0 + r) * dpad + c]);
                    a[r][0] += qc * k0;
                    a[r][1] += qc * k1;
                }
            }
            for (int r = 0; r < ROWS; r++) {
                store16(s + r * kstride + j0, j0 + 16 >= width ? a[r][0] + tail : a[r][0]);
                if (two) store16(s + r * kstride + j0 + 16, j0 + 32 >= width ? a[r][1] + tail : a[r][1]);
            }
        }
        float inverse[ROWS];
        for (int r = 0; r < ROWS; r++) {
            float *sr = s + r * kstride;
            v16 top = splat(-INFINITY);
            for (int64_t j = 0; j < width; j += 16) {
                const v16 x = load16(sr + j);
                top = select16(x > top, x, top);
            }
            const float high = max16(top);
            v16 sums = splat(0.0f);
            for (int64_t j = 0; j < width; j += 16) {
                const v16 e = exp16(load16(sr + j) - high);
                store16(sr + j, e);
                sums += e;
            }
            inverse[r] = n ? 1.0f / sum16(sums) : 0.0f;
        }
        const int rows = seq - i0 < ROWS ? (int)(seq - i0) : ROWS;
        for (int64_t c0 = 0; c0 < dpad; c0 += 32) {
            const int two = c0 + 16 < dpad;
            v16 a[ROWS][2];
            for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = splat(0.0f);
            for (int64_t j = 0; j < n; j++) {
                const v16 v0 = load16(vs + j * dpad + c0), v1 = two ? load16(vs + j * dpad + c0 + 16) : v0;
                for (int r = 0; r < ROWS; r++) {
                    const v16 p = splat(s[r * kstride + j]);
                    a[r][0] += p * v0;
                    a[r][1] += p * v1;
                }
            }
            for (int r = 0; r < rows; r++) {
                const int64_t at = (i0 + r) * out_stride + c0;
                const int64_t left = dim - c0;
                put16(out, at, a[r][0] * inverse[r], left < 16 ? (int)left : 16, bf16);
                if (two && left > 16) put16(out, at + 16, a[r][1] * inverse[r], left < 32 ? (int)(left - 16) : 16, bf16);
            }
        }
    }
}

int64_t encoder_attention_forward(const void *q, const void *k, const void *v, const uint8_t *keep, void *out,
                          int64_t batch, int64_t seq, int64_t heads, int64_t dim, int64_t batch_stride,
                          int64_t token_stride, float scale, int bf16, int threads) {
    if (dim > MAX_DIM) return -3;
    const int64_t width = (seq + 15) / 16 * 16, dpad = (dim + 15) / 16 * 16;
    const int64_t rows = (seq + ROWS - 1) / ROWS * ROWS;
    const size_t floats = (size_t)(rows * dpad + dim * width + width * dpad + ROWS * width);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *qs = aligned_alloc(64, sizeof(float) * floats);
        if (qs == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < batch * heads; task++) {
            if (qs == NULL) continue;
            float *kt = qs + rows * dpad, *vs = kt + dim * width, *s = vs + width * dpad;
            memset(qs + seq * dpad, 0, sizeof(float) * (size_t)((rows - seq) * dpad)); /* the last group's spare rows */
            const int64_t b = task / heads, h = task % heads, first = b * batch_stride + h * dim;
            int64_t n = 0; /* keys kept, packed to the front */
            float row[MAX_DIM];
            for (int64_t t = 0; t < seq; t++) {
                const int64_t at = first + t * token_stride;
                widen(qs + t * dpad, q, at, dim, scale, bf16);
                if (!keep[b * seq + t]) continue;
                widen(row, k, at, dim, 1.0f, bf16);
                for (int64_t c = 0; c < dim; c++) kt[c * width + n] = row[c];
                widen(vs + n * dpad, v, at, dim, 1.0f, bf16);
                for (int64_t c = dim; c < dpad; c++) vs[n * dpad + c] = 0.0f;
                n++;
            }
            const int64_t padded = (n + 15) / 16 * 16;
            for (int64_t c = 0; c < dim; c++)
                for (int64_t j = n; j < padded; j++) kt[c * width + j] = 0.0f;
            const int64_t out_stride = heads * dim;
            void *dst = bf16 ? (void *)((uint16_t *)out + (b * seq * heads + h) * dim)
                             : (void *)((float *)out + (b * seq * heads + h) * dim);
            /* the key vectors scored: n's, not seq's (a text's padding is never looked at) */
            head(qs, kt, vs, s, seq, n, padded, width, dim, dpad, dst, out_stride, bf16);
        }
        free(qs);
    }
    return failed ? -2 : 0;
}

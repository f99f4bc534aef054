/* Bidirectional attention of an encoder's short texts on CPUs: one (text, head) a task,
 * behind frugality.kernels.encoder_attention.
 *
 * Why: PyTorch's CPU attention (its flash kernel, or the math path's batched products)
 * pays a few microseconds of set-up per head, whatever the head's size: at an embedding
 * job's batches (64 texts of about 30 tokens, 12 heads of 32) that was about 3 ms a layer
 * for about 0.1 GFLOP, a fifth of a MiniLM call; with 4 heads of 8 it was half of a
 * one-layer model's time. Here a head's queries (times the scale), keys (transposed) and
 * values are widened once into float32 scratch, and each query's scores, softmax and
 * weighted sum run in vectors held in registers (GCC's vector extensions: AVX-512's 16
 * lanes where the CPU has them, AVX2's 8 elsewhere). Heads of up to 16 dimensions run the
 * other way round, their queries across the lanes (`head_small`).
 *
 * q, k, v: element (b, t, h, c) at b * batch_stride + t * token_stride + h * dim + c (the
 * packed projection's rows hold q, k and v one after another; separate projections are
 * three tensors of the same strides). keep: (batch, seq) bytes, nonzero where a key is a
 * real token. out: (batch, seq, heads, dim), contiguous. An unpadded batch
 * (`encoder_attention_unpadded`: the rows of its texts' tokens one after another, as an
 * encoder's layers skip padding) is taken as it is, `starts` saying where each text begins:
 * no padding put back around attention and taken out after. Every query gets its row,
 * padding positions too (as SDPA gives them); a text with no key kept gets zeros (SDPA:
 * NaN). float32 arithmetic; bf16 inputs widened, outputs rounded once (nearest even).
 * dim at most 256. Returns 0, -2 where scratch could not be allocated, -3 for a dim over 256.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_math.h"
#include "vector_lanes.h" /* vec, veci, vech: LANES floats, ints, bf16s */

#define ROWS 6  /* queries scored together: ROWS x 2 accumulators (6: 1.05-1.2x 4 at most shapes, both widths) */
#define MAX_DIM 256
#define SMALL_DIM 16 /* head sizes up to this take `head_small` */

static inline vec splat(float x) { return (vec){0} + x; }

static inline vec loadv(const float *p) {
    vec x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void storev(float *p, vec x) { memcpy(p, &x, sizeof x); }

/* where `pick` (a comparison's lanes: all ones or zero) a's lane, else b's */
static inline vec selectv(veci pick, vec a, vec b) { return (vec)(((veci)a & pick) | ((veci)b & ~pick)); }

static inline float maxv(vec x) {
    for (int half = LANES / 2; half >= 1; half /= 2) {
        veci swap;
        for (int l = 0; l < LANES; l++) swap[l] = l;
        const vec y = __builtin_shuffle(x, swap ^ half);
        x = selectv(x > y, x, y);
    }
    return x[0];
}

static inline float sumv(vec x) {
    for (int half = LANES / 2; half >= 1; half /= 2) {
        veci swap;
        for (int l = 0; l < LANES; l++) swap[l] = l;
        x += __builtin_shuffle(x, swap ^ half);
    }
    return x[0];
}

/* exp_nonpositive (bf16_math.h) on a vector: the same Cephes polynomial */
static inline vec expv(vec x) {
    const veci under = x < EXP_LOWEST; /* exp underflows there: 0 (and -inf, masked keys, too) */
    x = selectv(under, splat(EXP_LOWEST), x);
    const vec magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vec k = (x * EXP_LOG2E + magic) - magic;
    vec r = x - k * EXP_LN2_HIGH;
    r = r - k * EXP_LN2_LOW;
    vec p = EXP_REDUCED(r);
    veci e = (__builtin_convertvector(k, veci) + 127) << 23;
    vec scale;
    memcpy(&scale, &e, sizeof scale);
    return selectv(under, splat(0.0f), p * scale);
}

/* count (at most LANES) lanes of x stored at out + at, as float32 or rounded to bf16 (nearest
 * even, as f32_to_bf16; no NaN reaches here from finite inputs) */
static inline void putv(void *out, int64_t at, vec x, int count, int bf16) {
    if (bf16) {
        const veci bits = (veci)x;
        const vech h = __builtin_convertvector((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, vech);
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

/* a[r] += b[r * bstride + i] * (x[i * xstride], x[i * xstride + LANES]) over i < count, for ROWS
 * rows: both products' register tiles (scores: queries times transposed keys; the weighted
 * sum: scores times values). `two` false: the second vector is not wanted (its sums unused). */
static inline __attribute__((always_inline)) void tile(vec a[ROWS][2], const float *b, int64_t bstride,
                                                       const float *x, int64_t xstride, int64_t count, int two) {
    for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = splat(0.0f);
    for (int64_t i = 0; i < count; i++) {
        const vec x0 = loadv(x + i * xstride), x1 = two ? loadv(x + i * xstride + LANES) : x0;
        for (int r = 0; r < ROWS; r++) {
            const vec br = splat(b[r * bstride + i]);
            a[r][0] += br * x0;
            a[r][1] += br * x1;
        }
    }
}

/* One (text, head): qs (rows of dpad) scaled queries, kt (dim, kstride) keys transposed
 * (zero past n), vs (n, dpad) values, s (ROWS, kstride) scores; n keys kept, scored in
 * width = n rounded up to LANES. ROWS queries at a time, 2 * LANES keys or features at a time. */
static void head(const float *qs, const float *kt, const float *vs, float *s, int64_t seq, int64_t n,
                 int64_t width, int64_t kstride, int64_t dim, int64_t dpad, void *out, int64_t out_stride,
                 int bf16) {
    vec tail = splat(0.0f); /* -inf on the last vector's lanes past n */
    for (int l = (int)(n % LANES); l < LANES && n % LANES; l++) tail[l] = -INFINITY;
    for (int64_t i0 = 0; i0 < seq; i0 += ROWS) {
        for (int64_t j0 = 0; j0 < width; j0 += 2 * LANES) {
            const int two = j0 + LANES < width;
            vec a[ROWS][2];
            tile(a, qs + i0 * dpad, dpad, kt + j0, kstride, dim, two);
            for (int r = 0; r < ROWS; r++) {
                storev(s + r * kstride + j0, j0 + LANES >= width ? a[r][0] + tail : a[r][0]);
                if (two) storev(s + r * kstride + j0 + LANES, j0 + 2 * LANES >= width ? a[r][1] + tail : a[r][1]);
            }
        }
        float inverse[ROWS];
        for (int r = 0; r < ROWS; r++) {
            float *sr = s + r * kstride;
            vec top = splat(-INFINITY);
            for (int64_t j = 0; j < width; j += LANES) {
                const vec x = loadv(sr + j);
                top = selectv(x > top, x, top);
            }
            const float high = maxv(top);
            vec sums = splat(0.0f);
            for (int64_t j = 0; j < width; j += LANES) {
                const vec e = expv(loadv(sr + j) - high);
                storev(sr + j, e);
                sums += e;
            }
            inverse[r] = n ? 1.0f / sumv(sums) : 0.0f;
        }
        const int rows = seq - i0 < ROWS ? (int)(seq - i0) : ROWS;
        for (int64_t c0 = 0; c0 < dpad; c0 += 2 * LANES) {
            const int two = c0 + LANES < dpad;
            vec a[ROWS][2];
            tile(a, s, kstride, vs + c0, dpad, n, two);
            for (int r = 0; r < rows; r++) {
                const int64_t at = (i0 + r) * out_stride + c0;
                const int64_t left = dim - c0;
                putv(out, at, a[r][0] * inverse[r], left < LANES ? (int)left : LANES, bf16);
                if (two && left > LANES)
                    putv(out, at + LANES, a[r][1] * inverse[r], left < 2 * LANES ? (int)(left - LANES) : LANES, bf16);
            }
        }
    }
}

/* One (text, head) of a head size at most SMALL_DIM, queries across a vector's lanes:
 * qt (dim, seq rounded up to LANES) scaled queries transposed, kr and vr (n, dim) the kept
 * keys' and values' rows, s (n vectors) scores. A key's score for LANES queries is dim
 * multiply-adds of broadcast key features, the softmax's maximum and sum are lane-wise (no
 * reductions across lanes), the weighted sum dim vectors in registers. For 4 heads of 8
 * this ran 2.1x the row-tiled `head` (64 texts of 30 tokens, bf16, Zen 4: 0.298 -> 0.143 ms;
 * its 16-lane tiles were half empty and each of its rows paid two sums across lanes). */
static inline __attribute__((always_inline)) void head_small(const float *qt, const float *kr, const float *vr,
                                                             vec *s, int64_t seq, int64_t seq_lanes, int64_t n,
                                                             const int64_t dim, void *out, int64_t out_stride,
                                                             int bf16) {
    float tile[SMALL_DIM][LANES];
    for (int64_t i0 = 0; i0 < seq; i0 += LANES) {
        vec q[SMALL_DIM], acc[SMALL_DIM];
        for (int64_t c = 0; c < dim; c++) {
            q[c] = loadv(qt + c * seq_lanes + i0);
            acc[c] = splat(0.0f);
        }
        vec top = splat(-INFINITY), sums = splat(0.0f);
        for (int64_t j = 0; j < n; j++) {
            vec score = splat(0.0f);
            for (int64_t c = 0; c < dim; c++) score += q[c] * kr[j * dim + c];
            s[j] = score;
            top = selectv(score > top, score, top);
        }
        for (int64_t j = 0; j < n; j++) {
            const vec e = expv(s[j] - top);
            sums += e;
            for (int64_t c = 0; c < dim; c++) acc[c] += e * vr[j * dim + c];
        }
        /* a text with no key kept: zeros, as `head` gives */
        const vec inverse = n ? splat(1.0f) / sums : splat(0.0f);
        for (int64_t c = 0; c < dim; c++) storev(tile[c], acc[c] * inverse);
        /* the (dim, LANES) tile turned into query rows, each rounded and written as a whole
         * (an element at a time this was a third of the head's time at 4 heads of 8) */
        float rowtile[LANES][SMALL_DIM];
        for (int64_t c = 0; c < dim; c++)
            for (int i = 0; i < LANES; i++) rowtile[i][c] = tile[c][i];
        const int64_t rows = seq - i0 < LANES ? seq - i0 : LANES;
        for (int64_t i = 0; i < rows; i++) {
            const int64_t at = (i0 + i) * out_stride;
            if (bf16) {
                uint16_t *dst = (uint16_t *)out + at;
                for (int64_t c = 0; c < dim; c++) {
                    uint32_t bits;
                    memcpy(&bits, &rowtile[i][c], 4);
                    dst[c] = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
                }
            } else {
                memcpy((float *)out + at, rowtile[i], sizeof(float) * (size_t)dim);
            }
        }
    }
}

/* One (text, head) of a head size at most SMALL_DIM: its queries (scaled), kept keys and
 * values widened into scratch (queries transposed), then head_small. `first`: the head's
 * first element of the text's first token. The scratch: dim * seq_lanes + 2 * part + seq * LANES
 * floats, 64-byte aligned. */
static inline __attribute__((always_inline)) void small_task(const void *q, const void *k, const void *v,
                                                             const uint8_t *keep, int64_t first,
                                                             int64_t token_stride, int64_t seq, const int64_t dim,
                                                             float scale, int bf16, float *scratch, void *dst,
                                                             int64_t out_stride) {
    const int64_t seq_lanes = (seq + LANES - 1) / LANES * LANES, part = (seq * dim + 15) / 16 * 16;
    float *qt = scratch, *kr = qt + dim * seq_lanes, *vr = kr + part;
    vec *s = (vec *)(vr + part); /* (aligned: every part whole vectors) */
    for (int64_t c = 0; c < dim; c++) /* the last group's spare lanes: zeros, not garbage */
        for (int64_t t = seq; t < seq_lanes; t++) qt[c * seq_lanes + t] = 0.0f;
    int64_t n = 0; /* keys kept, packed to the front */
    float row[SMALL_DIM];
    for (int64_t t = 0; t < seq; t++) {
        const int64_t at = first + t * token_stride;
        widen(row, q, at, dim, scale, bf16);
        for (int64_t c = 0; c < dim; c++) qt[c * seq_lanes + t] = row[c];
        widen(kr + n * dim, k, at, dim, 1.0f, bf16);
        widen(vr + n * dim, v, at, dim, 1.0f, bf16);
        n += keep[t] != 0; /* (written either way, kept only where the key is: no branch) */
    }
    head_small(qt, kr, vr, s, seq, seq_lanes, n, dim, dst, out_stride, bf16);
}

/* small_task with the common head sizes known to the compiler (its loops then unrolled,
 * its vectors in registers) */
static void small_task_any(const void *q, const void *k, const void *v, const uint8_t *keep, int64_t first,
                           int64_t token_stride, int64_t seq, int64_t dim, float scale, int bf16, float *scratch,
                           void *dst, int64_t out_stride) {
    if (dim == 8)
        small_task(q, k, v, keep, first, token_stride, seq, 8, scale, bf16, scratch, dst, out_stride);
    else if (dim == 16)
        small_task(q, k, v, keep, first, token_stride, seq, 16, scale, bf16, scratch, dst, out_stride);
    else if (dim == 4)
        small_task(q, k, v, keep, first, token_stride, seq, 4, scale, bf16, scratch, dst, out_stride);
    else
        small_task(q, k, v, keep, first, token_stride, seq, dim, scale, bf16, scratch, dst, out_stride);
}

/* The texts' tasks. starts NULL: text b's tokens are rows b * seq ... of keep and out,
 * its first element at b * batch_stride; else text b is rows starts[b] to starts[b + 1] of
 * all three (an unpadded batch's), its first element at starts[b] * token_stride, and seq
 * its longest. */
static int64_t attend_texts(const void *q, const void *k, const void *v, const uint8_t *keep, void *out,
                            int64_t batch, int64_t seq, const int64_t *starts, int64_t heads, int64_t dim,
                            int64_t batch_stride, int64_t token_stride, float scale, int bf16, int threads) {
    if (dim > MAX_DIM) return -3;
    const int64_t width = (seq + LANES - 1) / LANES * LANES, dpad = (dim + LANES - 1) / LANES * LANES;
    const int64_t rows = (seq + ROWS - 1) / ROWS * ROWS;
    /* (rounded up to whole 64-byte lines: aligned_alloc's size is a multiple of its alignment) */
    const int64_t seq_lanes = width; /* (seq rounded up to LANES) */
    const int64_t tiled = rows * dpad + dim * width + width * dpad + ROWS * width;
    const int64_t part = (seq * dim + 15) / 16 * 16; /* head_small's keys' or values' rows (whole lines) */
    const int64_t lanes = dim * seq_lanes + 2 * part + seq * LANES; /* head_small's */
    const size_t floats = ((size_t)(tiled > lanes ? tiled : lanes) + 15) / 16 * 16;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *qs = aligned_alloc(64, sizeof(float) * floats);
        if (qs == NULL) failed = 1;
        /* (static: dynamic shares, tried for an unpadded batch's unequal texts, gained nothing
         * steady at 8-64 texts and cost a lone text's 12 tasks up to a fifth) */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < batch * heads; task++) {
            if (qs == NULL) continue;
            const int64_t b = task / heads, h = task % heads;
            const int64_t row0 = starts ? starts[b] : b * seq; /* the text's first row of keep and out */
            const int64_t len = starts ? starts[b + 1] - row0 : seq;
            const int64_t first = (starts ? row0 * token_stride : b * batch_stride) + h * dim;
            const int64_t out_stride = heads * dim;
            void *dst = bf16 ? (void *)((uint16_t *)out + (row0 * heads + h) * dim)
                             : (void *)((float *)out + (row0 * heads + h) * dim);
            if (len == 0) continue;
            int64_t n = 0; /* keys kept, packed to the front */
            float row[MAX_DIM];
            if (dim <= SMALL_DIM) {
                small_task_any(q, k, v, keep + row0, first, token_stride, len, dim, scale, bf16, qs, dst,
                               out_stride);
                continue;
            }
            /* the last group's spare query rows: zeros, not another text's or garbage */
            memset(qs + len * dpad, 0, sizeof(float) * (size_t)(((len + ROWS - 1) / ROWS * ROWS - len) * dpad));
            float *kt = qs + rows * dpad, *vs = kt + dim * width, *s = vs + width * dpad;
            for (int64_t t = 0; t < len; t++) {
                const int64_t at = first + t * token_stride;
                widen(qs + t * dpad, q, at, dim, scale, bf16);
                if (!keep[row0 + t]) continue;
                widen(row, k, at, dim, 1.0f, bf16);
                for (int64_t c = 0; c < dim; c++) kt[c * width + n] = row[c];
                widen(vs + n * dpad, v, at, dim, 1.0f, bf16);
                for (int64_t c = dim; c < dpad; c++) vs[n * dpad + c] = 0.0f;
                n++;
            }
            const int64_t padded = (n + LANES - 1) / LANES * LANES;
            for (int64_t c = 0; c < dim; c++)
                for (int64_t j = n; j < padded; j++) kt[c * width + j] = 0.0f;
            /* the key vectors scored: n's, not len's (a text's padding is never looked at) */
            head(qs, kt, vs, s, len, n, padded, width, dim, dpad, dst, out_stride, bf16);
        }
        free(qs);
    }
    return failed ? -2 : 0;
}

int64_t encoder_attention_forward(const void *q, const void *k, const void *v, const uint8_t *keep, void *out,
                                  int64_t batch, int64_t seq, int64_t heads, int64_t dim, int64_t batch_stride,
                                  int64_t token_stride, float scale, int bf16, int threads) {
    return attend_texts(q, k, v, keep, out, batch, seq, NULL, heads, dim, batch_stride, token_stride, scale, bf16,
                        threads);
}

/* An unpadded batch of `rows` rows: q, k, v rows of token_stride elements, text b's tokens
 * rows starts[b] to starts[b + 1] (starts: batch + 1 offsets, from 0 to rows, none
 * decreasing); keep a byte a row; out (rows, heads, dim), contiguous. Returns as
 * encoder_attention_forward, or -4 where starts is not so (nothing read or written). */
int64_t encoder_attention_unpadded(const void *q, const void *k, const void *v, const uint8_t *keep, void *out,
                                   const int64_t *starts, int64_t batch, int64_t rows, int64_t heads, int64_t dim,
                                   int64_t token_stride, float scale, int bf16, int threads) {
    int64_t longest = 0;
    if (batch < 0 || starts[0] != 0 || starts[batch] != rows) return -4;
    for (int64_t b = 0; b < batch; b++) {
        if (starts[b + 1] < starts[b] || starts[b + 1] > rows) return -4; /* (compared before subtracting) */
        const int64_t len = starts[b + 1] - starts[b];
        longest = len > longest ? len : longest;
    }
    if (longest == 0) return 0; /* (no row: nothing to attend, no scratch to ask for) */
    return attend_texts(q, k, v, keep, out, batch, longest, starts, heads, dim, 0, token_stride, scale, bf16,
                        threads);
}

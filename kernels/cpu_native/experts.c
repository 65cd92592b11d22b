/* The expert layer of a decode step on the CPU, fp32: gate_up GEMM -> SiLU(gate) * up -> down GEMM
 * -> routed weight -> sum over the top-k, for every routed row at once (the torch twin and
 * reference: kernels/cpu_experts.py, kernels/reference.py's fused_experts_torch).
 *
 * Legend: T tokens, D hidden, E local experts, F expert intermediate, K top-k, R = T * K routed rows.
 *
 * At a decode step each expert sees a few rows, so torch runs one small GEMM per expert and pays
 * its dispatch each time. Here the rows are sorted by expert once, the experts are shared out over
 * torch's OpenMP threads, and each expert runs its rows four at a time through a register-blocked
 * dot-product kernel over its weights as stored ([2F, D] and [D, F], rows contiguous): a tile of 4
 * rows x 4 weight rows keeps 16 vector accumulators, so every weight row read from memory serves
 * four rows. Each routed row's weighted output goes to its own slot of a [R, D] buffer and a last
 * pass sums the K slots of each token, so no two threads ever write one row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VL 16 /* floats per vector */
typedef float vec __attribute__((vector_size(VL * sizeof(float))));

static inline vec load(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef float half_vec __attribute__((vector_size(VL / 2 * sizeof(float))));
typedef float quarter_vec __attribute__((vector_size(VL / 4 * sizeof(float))));

/* The sum of a vector's lanes by halving it (vector adds, not sixteen scalar ones). */
static inline float hsum(vec v)
{
    half_vec h[2];
    memcpy(h, &v, sizeof v);
    const half_vec a = h[0] + h[1];
    quarter_vec q[2];
    memcpy(q, &a, sizeof a);
    const quarter_vec b = q[0] + q[1];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* out[i * ldo + j] = dot(a[i], b[j]) over n floats, for i < na <= 4 rows of a and j < 4 rows of b
 * (rows past na repeat the last one; their results are not stored). */
static void dot_4x4(const float *const a[4], int na, const float *b, int64_t ldb, int64_t n, float *out,
                    int64_t ldo)
{
    vec acc[4][4];
    memset(acc, 0, sizeof acc);
    const float *b0 = b, *b1 = b + ldb, *b2 = b + 2 * ldb, *b3 = b + 3 * ldb;
    int64_t k = 0;
    for (; k + VL <= n; k += VL) {
        const vec w0 = load(b0 + k), w1 = load(b1 + k), w2 = load(b2 + k), w3 = load(b3 + k);
        for (int i = 0; i < 4; i++) {
            const vec x = load(a[i] + k);
            acc[i][0] += x * w0;
            acc[i][1] += x * w1;
            acc[i][2] += x * w2;
            acc[i][3] += x * w3;
        }
    }
    for (int i = 0; i < na; i++) {
        for (int j = 0; j < 4; j++) {
            float s = hsum(acc[i][j]);
            for (int64_t kk = k; kk < n; kk++)
                s += a[i][kk] * b[j * ldb + kk];
            out[i * ldo + j] = s;
        }
    }
}

/* out[i * ldo + j] = dot(a[i], b[j]) for j < nb (any count), i < na <= 4. */
static void dot_rows(const float *const a[4], int na, const float *b, int64_t ldb, int64_t nb, int64_t n,
                     float *out, int64_t ldo)
{
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4)
        dot_4x4(a, na, b + j * ldb, ldb, n, out + j, ldo);
    for (; j < nb; j++)
        for (int i = 0; i < na; i++) {
            float s = 0.0f;
            for (int64_t kk = 0; kk < n; kk++)
                s += a[i][kk] * b[j * ldb + kk];
            out[i * ldo + j] = s;
        }
}

/* ids: [R] int32 local expert of each routed row (-1: not on this rank); weights: [R] fp32.
 * x: [T, D] (row stride x_stride); w13: [E, 2F, D], w2: [E, D, F], contiguous; out: [T, D]
 * contiguous, overwritten. Returns 0, or -1 when its buffers could not be allocated (out untouched:
 * the caller runs the torch path). */
int moe_experts_f32(const float *x, int64_t x_stride, const float *w13, const float *w2, const int32_t *ids,
                     const float *weights, int64_t T, int64_t K, int64_t E, int64_t D, int64_t F, float *out)
{
    const int64_t R = T * K;
    int64_t *order = malloc((size_t)(R > 0 ? R : 1) * sizeof *order);
    int64_t *start = calloc((size_t)E + 1, sizeof *start);
    int64_t *cursor = malloc((size_t)E * sizeof *cursor);
    float *slots = calloc((size_t)(R > 0 ? R * D : 1), sizeof *slots); /* rows elsewhere stay 0 */
    int failed = order == NULL || start == NULL || cursor == NULL || slots == NULL;
    if (failed) {
        free(order);
        free(start);
        free(cursor);
        free(slots);
        return -1;
    }
    for (int64_t r = 0; r < R; r++)
        if (ids[r] >= 0)
            start[ids[r] + 1]++;
    for (int64_t e = 0; e < E; e++)
        start[e + 1] += start[e];
    memcpy(cursor, start, (size_t)E * sizeof *cursor);
    for (int64_t r = 0; r < R; r++)
        if (ids[r] >= 0)
            order[cursor[ids[r]]++] = r;
    free(cursor);

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; e++) {
        const float *gate_up = w13 + e * 2 * F * D, *down = w2 + e * D * F;
        float *h = malloc((size_t)(4 * 2 * F) * sizeof *h), *act = malloc((size_t)(4 * F) * sizeof *act);
        float *y = malloc((size_t)(4 * D) * sizeof *y);
        const int64_t end = h != NULL && act != NULL && y != NULL ? start[e + 1] : start[e];
        if (end != start[e + 1]) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t i0 = start[e]; i0 < end; i0 += 4) {
            const int na = end - i0 < 4 ? (int)(end - i0) : 4;
            const float *rows[4], *acts[4];
            for (int i = 0; i < 4; i++) {
                rows[i] = x + (order[i0 + (i < na ? i : na - 1)] / K) * x_stride;
                acts[i] = act + (i < na ? i : na - 1) * F;
            }
            dot_rows(rows, na, gate_up, D, 2 * F, D, h, 2 * F);
            for (int i = 0; i < na; i++)
                for (int64_t f = 0; f < F; f++) {
                    const float g = h[i * 2 * F + f];
                    act[i * F + f] = g / (1.0f + expf(-g)) * h[i * 2 * F + F + f];
                }
            dot_rows(acts, na, down, F, D, F, y, D);
            for (int i = 0; i < na; i++) {
                const int64_t r = order[i0 + i];
                const float w = weights[r];
                float *slot = slots + r * D;
                for (int64_t c = 0; c < D; c++)
                    slot[c] = w * y[i * D + c];
            }
        }
        free(h);
        free(act);
        free(y);
    }

    if (failed) {
        free(order);
        free(start);
        free(slots);
        return -1;
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * D;
        memcpy(o, slots + t * K * D, (size_t)D * sizeof *o);
        for (int64_t k = 1; k < K; k++) {
            const float *s = slots + (t * K + k) * D;
            for (int64_t c = 0; c < D; c++)
                o[c] += s[c];
        }
    }
    free(order);
    free(start);
    free(slots);
    return 0;
}

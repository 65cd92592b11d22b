/* Decode attention over the paged KV cache on the CPU, fp32: one query token per sequence, read
 * through its block table without gathering the context first (the torch twin and reference:
 * kernels/cpu_attention.py's decode path, kernels/attention.py's paged_attention_torch).
 *
 * Legend: B decode sequences, H query heads, G KV heads (HG = H / G query heads share one),
 * d head dim, N cache blocks, S block size, W block-table width.
 *
 * Cache layout [2, N, S, G, d] (k then v), contiguous. One work item per sequence, spread over
 * torch's OpenMP threads: its query heads walk its visible keys block by block with an online
 * softmax (scores of a block, their maximum, the running sum and output rescaled once per block). Keys visible to sequence b: positions first[b] .. len[b] - 1 (first is 0,
 * or the start of the query's chunk under chunked-local attention). A sequence with len 0 gets zeros.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

/* -ffast-math assumes no infinities: "nothing seen yet" is -FLT_MAX, whose exp difference is 0. */
#define NONE_SEEN (-FLT_MAX)

/* Prefetch one block's keys or values (S tokens of all G heads: contiguous) into the cache. */
static inline void prefetch_block(const float *blk, int64_t floats)
{
    for (int64_t i = 0; i < floats; i += 16)
        __builtin_prefetch(blk + i, 0, 3);
}

/* One sequence: all H query heads over its visible keys, a block of S keys at a time (for each KV
 * head g, the scores of its HG query heads, their exps in one vectorised loop, then the values);
 * the next block is prefetched meanwhile. A block holds every KV head's keys of its tokens side by
 * side, so one sequence's heads together read each block once, front to back. */
static void decode_sequence(const float *qb, int64_t q_stride_h, const float *kv, const int32_t *table,
                            int64_t L, int64_t first, int64_t S, int64_t G, int64_t HG, int64_t d,
                            int64_t v_offset, float scale, float *ob, int64_t o_stride_h)
{
    const int64_t H = G * HG, tok = G * d, blk_floats = S * tok;
    float m[H], l[H], acc[H * d], s[S], p[S];
    for (int64_t h = 0; h < H; h++) {
        m[h] = NONE_SEEN;
        l[h] = 0.0f;
        for (int64_t k = 0; k < d; k++)
            acc[h * d + k] = 0.0f;
    }
    for (int64_t pos0 = first / S * S; pos0 < L; pos0 += S) {
        const float *kblk = kv + (int64_t)table[pos0 / S] * blk_floats;
        const float *vblk = kblk + v_offset;
        if (pos0 + S < L) {
            const float *next = kv + (int64_t)table[pos0 / S + 1] * blk_floats;
            prefetch_block(next, blk_floats);
            prefetch_block(next + v_offset, blk_floats);
        }
        const int64_t t0 = first > pos0 ? first - pos0 : 0;
        const int64_t t1 = L - pos0 < S ? L - pos0 : S;
        for (int64_t h = 0; h < H; h++) {
            const int64_t g = h / HG;
            const float *qh = qb + h * q_stride_h;
            float *ah = acc + h * d;
            float bmax = NONE_SEEN;
            for (int64_t t = t0; t < t1; t++) {
                const float *kt = kblk + t * tok + g * d;
                float dot = 0.0f;
                for (int64_t k = 0; k < d; k++)
                    dot += qh[k] * kt[k];
                s[t] = dot * scale;
                bmax = s[t] > bmax ? s[t] : bmax;
            }
            const float mnew = bmax > m[h] ? bmax : m[h];
            const float alpha = expf(m[h] - mnew); /* 0 while nothing was seen */
            float psum = 0.0f;
#pragma omp simd reduction(+:psum)
            for (int64_t t = t0; t < t1; t++) {
                p[t] = expf(s[t] - mnew);
                psum += p[t];
            }
            l[h] = l[h] * alpha + psum;
            for (int64_t k = 0; k < d; k++)
                ah[k] *= alpha;
            for (int64_t t = t0; t < t1; t++) {
                const float *vt = vblk + t * tok + g * d;
                const float pt = p[t];
                for (int64_t k = 0; k < d; k++)
                    ah[k] += pt * vt[k];
            }
            m[h] = mnew;
        }
    }
    for (int64_t h = 0; h < H; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t k = 0; k < d; k++)
            ob[h * o_stride_h + k] = acc[h * d + k] * inv;
    }
}

void moe_paged_decode_f32(const float *q, int64_t q_stride_t, int64_t q_stride_h,
                          const float *kv, int64_t N, int64_t S, int64_t G, int64_t d,
                          const int32_t *tables, int64_t table_stride,
                          const int32_t *lens, const int32_t *firsts, const int64_t *rows,
                          int64_t B, int64_t H, float scale,
                          float *out, int64_t o_stride_t, int64_t o_stride_h)
{
    const int64_t v_offset = N * S * G * d; /* v after k */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++)
        decode_sequence(q + rows[b] * q_stride_t, q_stride_h, kv, tables + b * table_stride, lens[b], firsts[b],
                        S, G, H / G, d, v_offset, scale, out + rows[b] * o_stride_t, o_stride_h);
}

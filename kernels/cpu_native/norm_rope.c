/* RMSNorm (with the residual add) and rotary embeddings (optionally after a per-head RMSNorm, as
 * Qwen3's q/k norm) on the CPU, fp32; their torch twins and references: models/layers/norm.py's
 * RMSNorm and models/layers/rotary.py's RotaryEmbedding. One pass over each row instead of the
 * torch compositions' five to eight elementwise ops, each of which reads and writes the whole
 * activation (at a prefill of 8192 x 256 floats, 8 MB apiece).
 *
 * Legend: T rows (tokens), D row width, H heads of a token, d head dim, R rotary dims (R <= d).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* out[t] = w * norm(x[t] (+ res[t])); with res, sum[t] = x[t] + res[t] (the new residual).
 * x, res, sum, out: [T, D] with row strides; res and sum NULL without the residual add. */
void moe_rms_norm_f32(const float *x, int64_t x_stride, const float *res, int64_t res_stride, float *sum,
                      int64_t sum_stride, const float *w, float *out, int64_t out_stride, int64_t T, int64_t D,
                      float eps)
{
#pragma omp parallel for schedule(static) if (T * D >= 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * x_stride;
        float *ot = out + t * out_stride;
        float ss = 0.0f;
        if (res != NULL) {
            const float *rt = res + t * res_stride;
            float *st = sum + t * sum_stride;
            for (int64_t i = 0; i < D; i++) {
                const float v = xt[i] + rt[i];
                st[i] = v;
                ss += v * v;
            }
            xt = st;
        } else {
            for (int64_t i = 0; i < D; i++)
                ss += xt[i] * xt[i];
        }
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++)
            ot[i] = w[i] * (xt[i] * inv);
    }
}

/* Heads [T, H, d] (strides st, sh; unit along d) normalised per head with weight nw when nw is
 * not NULL, then the first R dims rotated at position pos[t]: NeoX halves (neox = 1) or
 * interleaved pairs; cos/sin: [max_position, R / 2]. Written to out [T, H, d] (contiguous). */
static void rope_heads(const float *x, int64_t st, int64_t sh, int64_t T, int64_t H, int64_t d, int64_t R,
                       const int64_t *pos, const float *cos_t, const float *sin_t, int neox,
                       const float *nw, float eps, float *out)
{
    const int64_t half = R / 2;
#pragma omp parallel for schedule(static) if (T * H * d >= 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + pos[t] * half, *s = sin_t + pos[t] * half;
        for (int64_t h = 0; h < H; h++) {
            const float *xh = x + t * st + h * sh;
            float *oh = out + (t * H + h) * d;
            float buf[d];
            if (nw != NULL) {
                float ss = 0.0f;
                for (int64_t i = 0; i < d; i++)
                    ss += xh[i] * xh[i];
                const float inv = 1.0f / sqrtf(ss / (float)d + eps);
                for (int64_t i = 0; i < d; i++)
                    buf[i] = nw[i] * (xh[i] * inv);
            } else {
                for (int64_t i = 0; i < d; i++)
                    buf[i] = xh[i];
            }
            if (neox) {
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = buf[i], x2 = buf[i + half];
                    oh[i] = x1 * c[i] - x2 * s[i];
                    oh[i + half] = x2 * c[i] + x1 * s[i];
                }
            } else {
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = buf[2 * i], x2 = buf[2 * i + 1];
                    oh[2 * i] = x1 * c[i] - x2 * s[i];
                    oh[2 * i + 1] = x2 * c[i] + x1 * s[i];
                }
            }
            for (int64_t i = R; i < d; i++)
                oh[i] = buf[i];
        }
    }
}

/* q [T, Hq, d] and k [T, Hk, d] (strides as above) through rope_heads, into q_out / k_out. */
void moe_rope_f32(const float *q, int64_t q_st, int64_t q_sh, const float *k, int64_t k_st, int64_t k_sh,
                  int64_t T, int64_t Hq, int64_t Hk, int64_t d, int64_t R, const int64_t *pos,
                  const float *cos_t, const float *sin_t, int neox, const float *q_w, const float *k_w, float eps,
                  float *q_out, float *k_out)
{
    rope_heads(q, q_st, q_sh, T, Hq, d, R, pos, cos_t, sin_t, neox, q_w, eps, q_out);
    rope_heads(k, k_st, k_sh, T, Hk, d, R, pos, cos_t, sin_t, neox, k_w, eps, k_out);
}

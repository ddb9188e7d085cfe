// Plain-loop causal attention: (b, h, t) rows in parallel in the forward,
// (b, h) pairs in parallel in the backward (their gradients touch disjoint
// columns of dqkv; within a pair, query rows go in order).
#include "kernels/cpu/layers/attention.h"

#include <cmath>
#include <vector>

#include "kernels/cpu/layers/tiles.h"

namespace strata::layers {
namespace {

using detail::ForEachIndex;

float Dot(const float* a, const float* b, size_t n) {
  float s = 0;
  for (size_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Softmax of q_t against keys 0..t into att_row[0..T), then out_t = Σ att·v.
void ForwardRow(float* out_t, float* att_row, const float* qkv_b, size_t t, size_t T, size_t C, size_t h,
                size_t hs) {
  const size_t C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const float* q = qkv_b + t * C3 + h * hs;
  float maxv = -INFINITY;
  for (size_t t2 = 0; t2 <= t; ++t2) {
    const float v = Dot(q, qkv_b + t2 * C3 + C + h * hs, hs) * scale;
    att_row[t2] = v;
    if (v > maxv) maxv = v;
  }
  double sum = 0;
  for (size_t t2 = 0; t2 <= t; ++t2) {
    att_row[t2] = std::exp(att_row[t2] - maxv);
    sum += att_row[t2];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (size_t t2 = 0; t2 <= t; ++t2) att_row[t2] *= inv;
  for (size_t t2 = t + 1; t2 < T; ++t2) att_row[t2] = 0.0f;
  for (size_t i = 0; i < hs; ++i) out_t[i] = 0.0f;
  for (size_t t2 = 0; t2 <= t; ++t2) {
    const float* v = qkv_b + t2 * C3 + 2 * C + h * hs;
    const float a = att_row[t2];
    for (size_t i = 0; i < hs; ++i) out_t[i] += a * v[i];
  }
}

}  // namespace

void AttentionForward(float* out, float* att, const float* qkv, size_t B, size_t T, size_t C, size_t NH) {
  const size_t hs = C / NH;
  // index = (b * NH + h) * T + t
  ForEachIndex(B * NH * T, 16, [&](size_t idx) {
    const size_t t = idx % T, h = (idx / T) % NH, b = idx / (T * NH);
    ForwardRow(out + (b * T + t) * C + h * hs, att + idx * T, qkv + b * T * 3 * C, t, T, C, h, hs);
  });
}

void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att, size_t B, size_t T,
                       size_t C, size_t NH) {
  const size_t hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  ForEachIndex(B * NH, 1, [&](size_t bh) {
    const size_t b = bh / NH, h = bh % NH;
    const float* qkv_b = qkv + b * T * C3;
    float* dqkv_b = dqkv + b * T * C3;
    std::vector<float> datt(T);
    for (size_t t = 0; t < T; ++t) {
      const float* att_row = att + (bh * T + t) * T;
      const float* dy = dout + (b * T + t) * C + h * hs;
      // datt[t2] = dy · v_t2; dv_t2 += att[t2] · dy
      double dot = 0;  // Σ att · datt, the softmax Jacobian's shared term
      for (size_t t2 = 0; t2 <= t; ++t2) {
        const float* v = qkv_b + t2 * C3 + 2 * C + h * hs;
        float* dv = dqkv_b + t2 * C3 + 2 * C + h * hs;
        datt[t2] = Dot(dy, v, hs);
        dot += att_row[t2] * datt[t2];
        for (size_t i = 0; i < hs; ++i) dv[i] += att_row[t2] * dy[i];
      }
      // dpre[t2] = att[t2] · (datt[t2] - dot); dq_t += dpre·k_t2·scale; dk_t2 += dpre·q_t·scale
      const float* q = qkv_b + t * C3 + h * hs;
      float* dq = dqkv_b + t * C3 + h * hs;
      const float dotf = static_cast<float>(dot);
      for (size_t t2 = 0; t2 <= t; ++t2) {
        const float dpre = att_row[t2] * (datt[t2] - dotf) * scale;
        const float* k = qkv_b + t2 * C3 + C + h * hs;
        float* dk = dqkv_b + t2 * C3 + C + h * hs;
        for (size_t i = 0; i < hs; ++i) {
          dq[i] += dpre * k[i];
          dk[i] += dpre * q[i];
        }
      }
    }
  });
}

}  // namespace strata::layers

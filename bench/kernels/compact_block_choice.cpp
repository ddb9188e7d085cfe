// Why kernels/cpu/compact.h quantizes moments the way it does: the error of
// the Adam update m/sqrt(v) read back from int8/u8 codes, for block sizes
// 32..256 and three compandings of m (linear, 2x/(1+|x|), sqrt) and two of v
// (sqrt(v) linear, sqrt(sqrt(v))), on the moments of a 300-step AdamW run over
// 2^18 elements whose curvatures and gradient noise spread over 4 decades.
// A model in plain C++ (the kernel's block size is a compile-time constant);
// it rounds codes to nearest like the kernel's exact rule up to ties.
//   ./build/bench/kernels/compact_block_choice
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  const size_t n = 1 << 18;
  std::mt19937_64 rng(1);
  std::normal_distribution<float> N(0, 1);
  std::uniform_real_distribution<float> U(0, 1);
  std::vector<float> w(n), h(n), sig(n), m(n, 0), v(n, 0), ws(n);
  for (size_t i = 0; i < n; ++i) {
    // per-element curvature and noise over 4 decades, correlated in runs of 16 (like rows)
    h[i] = std::pow(10.f, -2 + 4 * U(rng));
    sig[i] = std::pow(10.f, -3 + 3 * U(rng));
    w[i] = N(rng);
    ws[i] = N(rng);
  }
  const float b1 = 0.9f, b2 = 0.999f, lr = 1e-3f, eps = 1e-8f;
  int steps = 300;
  for (int t = 1; t <= steps; ++t) {
    for (size_t i = 0; i < n; ++i) {
      float g = h[i] * (w[i] - ws[i]) + sig[i] * N(rng);
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      float bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
      w[i] -= lr / bc1 * m[i] / (std::sqrt(v[i] / bc2) + eps);
    }
  }
  float bc1 = 1 - std::pow(b1, steps), bc2 = 1 - std::pow(b2, steps);
  for (int B : {32, 64, 128, 256}) {
    for (int mc = 0; mc < 3; ++mc)
      for (int vc = 0; vc < 2; ++vc) {
        double em = 0, nm = 0, ev = 0, nv = 0, eu = 0, nu = 0;
        size_t vzero_mnz = 0;
        double medrel = 0;
        std::vector<float> rel;
        for (size_t b0 = 0; b0 < n; b0 += B) {
          float am = 0, av = 0;
          for (int j = 0; j < B; ++j) {
            am = std::max(am, std::fabs(m[b0 + j]));
            av = std::max(av, std::sqrt(v[b0 + j]));
          }
          for (int j = 0; j < B; ++j) {
            size_t i = b0 + j;
            float x = m[i] / am, mq;
            if (mc == 0) {
              float q = std::nearbyint(127 * x);
              mq = q / 127 * am;
            } else if (mc == 1) {
              float c = 2 * x / (1 + std::fabs(x));
              float q = std::nearbyint(127 * c) / 127;
              mq = q / (2 - std::fabs(q)) * am;
            } else {
              float q = std::nearbyint(127 * std::sqrt(std::fabs(x))) / 127;
              mq = std::copysign(q * q, x) * am;
            }
            float r = std::sqrt(v[i]) / av, vq;
            if (vc == 0) {
              float q = std::nearbyint(255 * r) / 255 * av;
              vq = q * q;
            } else {
              float q = std::nearbyint(255 * std::sqrt(r)) / 255;
              vq = q * q * q * q * av * av;
            }
            if (vq == 0 && mq != 0) {
              ++vzero_mnz;
            }
            if (vq == 0) mq = 0;
            em += (mq - m[i]) * (double)(mq - m[i]);
            nm += m[i] * (double)m[i];
            ev += (std::sqrt(vq) - std::sqrt(v[i])) * (double)(std::sqrt(vq) - std::sqrt(v[i]));
            nv += v[i];
            float u = m[i] / bc1 / (std::sqrt(v[i] / bc2) + eps), uq = mq / bc1 / (std::sqrt(vq / bc2) + eps);
            eu += (uq - u) * (double)(uq - u);
            nu += u * (double)u;
            rel.push_back(std::fabs(uq - u) / (std::fabs(u) + 1e-30f));
          }
        }
        std::nth_element(rel.begin(), rel.begin() + rel.size() / 2, rel.end());
        medrel = rel[rel.size() / 2];
        std::nth_element(rel.begin(), rel.begin() + rel.size() * 99 / 100, rel.end());
        printf(
            "B=%3d m=%-6s v=%-6s  relrms m %.4f sqrtv %.4f update %.4f  median|du/u| %.4f p99 %.4f  "
            "vzero&m!=0 %zu\n",
            B,
            mc == 0   ? "linear"
            : mc == 1 ? "2x/1+x"
                      : "sqrt",
            vc == 0 ? "sqrt" : "4throot", std::sqrt(em / nm), std::sqrt(ev / nv), std::sqrt(eu / nu), medrel,
            rel[rel.size() * 99 / 100], vzero_mnz);
      }
  }
}

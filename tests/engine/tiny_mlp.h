// A residual MLP in plain loops, trained through the Engine: the model the
// engine tests build themselves. Layer l (one engine group) holds
// W_l (D x D) and b_l (D): h_{l+1} = h_l + relu(h_l W_l + b_l);
// loss = 0.5 * mean over the batch of |h_L - y|^2.
#pragma once

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "base/dtype.h"
#include "engine/engine.h"

namespace strata::testing {

struct TinyMlp {
  int layers = 4, dim = 48, batch = 8;
  // Each rank's loss is normalized by the whole batch instead of its own
  // rows: with strata.grad_reduce "sum", exact for splits that are uneven.
  bool whole_batch_norm = false;
  // `hole`: one row of W (from the last, by layer) and b's second half (from
  // its middle on, by layer) of every layer's gradient are zeroed before
  // the hand. `in_parts`: each layer's gradient goes in parts (GradsPart,
  // GradsEnd) rather than one Grads call — b's first half, then W's first
  // rows as two halves of them given twice (added), then the rest of W but
  // that row; what no part gives is zeros (give `hole` to the whole hand
  // compared with). The first hand in parts also checks that a second group's parts
  // are refused while it is open, where the engine says so (several ranks).
  // `lend` (with in_parts): the parts are lent (GradsPart with lend), W's
  // first rows given once, whole; their buffers stay alive in `lent` until
  // the next TrainStep, which the caller makes after the engine's step.
  bool hole = false, in_parts = false, lend = false;
  mutable std::vector<std::vector<float>> lent;  // (TrainStep is const: the engine is what it changes)
  std::vector<std::vector<float>> init;  // per layer: W then b
  std::vector<float> x, y;

  explicit TinyMlp(int layers_ = 4, int dim_ = 48, uint64_t seed = 1) : layers(layers_), dim(dim_) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const float s = 0.5f / std::sqrt(static_cast<float>(dim));
    init.resize(static_cast<size_t>(layers));
    for (auto& v : init) {
      v.resize(static_cast<size_t>(dim * dim + dim));
      for (auto& e : v) e = nd(rng) * s;
    }
    x.resize(static_cast<size_t>(batch * dim));
    y.resize(x.size());
    for (auto& e : x) e = nd(rng);
    for (size_t i = 0; i < y.size(); ++i) y[i] = std::sin(x[i]) * 0.5f;
  }

  Status Register(Engine& e) const {
    for (int l = 0; l < layers; ++l) {
      const float* p = init[static_cast<size_t>(l)].data();
      auto w = e.AddParam(l, "layer" + std::to_string(l) + ".w", static_cast<uint64_t>(dim * dim), p);
      if (!w.ok()) return w.status();
      auto b = e.AddParam(l, "layer" + std::to_string(l) + ".b", static_cast<uint64_t>(dim), p + dim * dim);
      if (!b.ok()) return b.status();
    }
    return Status::Ok();
  }

  // Parameters of one group, as fp32, from the fetched compute-dtype buffer.
  std::vector<float> Widen(const void* p, DType dt) const {
    std::vector<float> out(static_cast<size_t>(dim * dim + dim));
    for (size_t i = 0; i < out.size(); ++i) {
      if (dt == DType::kF32) out[i] = static_cast<const float*>(p)[i];
      else if (dt == DType::kBF16) out[i] = BF16ToF32(static_cast<const uint16_t*>(p)[i]);
      else out[i] = F16ToF32(static_cast<const uint16_t*>(p)[i]);
    }
    return out;
  }

  // One forward and backward pass. `extra_fetches` are fetched and released
  // first (a step that departs from the recorded trace: numerics must not
  // change). Returns the loss; grads go to the engine times `loss_scale`.
  // With several ranks, rank r of w computes on rows [r*batch/w, (r+1)*batch/w)
  // and its loss is the mean over its own rows, as under torch DDP: with
  // strata.grad_reduce "mean" (the default) the engine's mean over the ranks
  // is the whole batch's gradient when the rows split evenly.
  Result<double> TrainStep(Engine& e, const std::vector<int>* extra_fetches = nullptr,
                           double loss_scale = 1.0, int part = 0, int parts = 1) const {
    const DType dt = e.compute_dtype();
    if (extra_fetches)
      for (int g : *extra_fetches) {
        auto p = e.Fetch(g);
        if (!p.ok()) return p.status();
        if (Status st = e.Release(g); !st.ok()) return st;
      }
    const size_t D = static_cast<size_t>(dim);
    const size_t row0 = static_cast<size_t>(part * batch / parts);  // uneven splits cover every row
    const size_t B = static_cast<size_t>((part + 1) * batch / parts) - row0;
    const float norm = static_cast<float>(whole_batch_norm ? batch : B);
    std::vector<std::vector<float>> h(static_cast<size_t>(layers) + 1), pre(static_cast<size_t>(layers));
    h[0].assign(x.begin() + static_cast<long>(row0 * D), x.begin() + static_cast<long>((row0 + B) * D));
    for (int l = 0; l < layers; ++l) {  // forward
      auto p = e.Fetch(l);
      if (!p.ok()) return p.status();
      const std::vector<float> w = Widen(*p, dt);
      if (Status st = e.Release(l); !st.ok()) return st;
      auto& z = pre[static_cast<size_t>(l)];
      z.assign(B * D, 0.0f);
      h[static_cast<size_t>(l) + 1] = h[static_cast<size_t>(l)];
      for (size_t r = 0; r < B; ++r)
        for (size_t j = 0; j < D; ++j) {
          float acc = w[D * D + j];
          for (size_t k = 0; k < D; ++k) acc += h[static_cast<size_t>(l)][r * D + k] * w[k * D + j];
          z[r * D + j] = acc;
          h[static_cast<size_t>(l) + 1][r * D + j] += acc > 0 ? acc : 0;
        }
    }
    double loss = 0;
    std::vector<float> dh(B * D);
    for (size_t i = 0; i < B * D; ++i) {
      const float d = h[static_cast<size_t>(layers)][i] - y[row0 * D + i];
      loss += 0.5 * d * d / static_cast<double>(norm);
      dh[i] = d / norm;
    }
    std::vector<std::vector<float>> own(static_cast<size_t>(layers));
    if (lend) lent.assign(static_cast<size_t>(layers), {});  // the last step's: the engine has stepped
    std::vector<std::vector<float>>& grads = lend ? lent : own;
    for (int l = layers - 1; l >= 0; --l) {
      auto p = e.Fetch(l);
      if (!p.ok()) return p.status();
      const std::vector<float> w = Widen(*p, dt);
      if (Status st = e.Release(l); !st.ok()) return st;
      auto& g = grads[static_cast<size_t>(l)];
      g.assign(D * D + D, 0.0f);
      std::vector<float> dprev = dh;
      for (size_t r = 0; r < B; ++r)
        for (size_t j = 0; j < D; ++j) {
          if (pre[static_cast<size_t>(l)][r * D + j] <= 0) continue;
          const float dz = dh[r * D + j];
          g[D * D + j] += dz;
          for (size_t k = 0; k < D; ++k) {
            g[k * D + j] += h[static_cast<size_t>(l)][r * D + k] * dz;
            dprev[r * D + k] += w[k * D + j] * dz;
          }
        }
      for (auto& v : g) v *= static_cast<float>(loss_scale);
      dh.swap(dprev);
      if (e.group_frozen(l)) continue;  // a frozen layer (FreezeGroup) takes no gradients
      // The holes differ by layer, so that a packed buffer that held another
      // layer's gradient has values there that nothing but zeroing clears.
      const uint64_t hole_row = D - 1 - static_cast<uint64_t>(l) % (D / 2), b_given = D / 2 + static_cast<uint64_t>(l) % (D / 2);
      if (hole || in_parts) {  // W's row hole_row, and b past b_given
        std::fill(g.begin() + static_cast<std::ptrdiff_t>(hole_row * D),
                  g.begin() + static_cast<std::ptrdiff_t>(hole_row * D + D), 0.0f);
        std::fill(g.begin() + static_cast<std::ptrdiff_t>(D * D + b_given), g.end(), 0.0f);
      }
      if (!in_parts) {
        if (Status st = e.Grads(l, g.data(), DType::kF32); !st.ok()) return st;
        continue;
      }
      const uint64_t half_rows = (D - 1) / 2 * D;
      std::vector<float> halves(g.begin(), g.begin() + static_cast<std::ptrdiff_t>(half_rows));
      for (float& v : halves) v *= 0.5f;
      if (Status st = e.GradsPart(l, D * D, b_given, g.data() + D * D, DType::kF32, lend); !st.ok()) return st;
      if (lend) {
        if (Status st = e.GradsPart(l, 0, half_rows, g.data(), DType::kF32, lend); !st.ok()) return st;
      } else if (Status st = e.GradsPart(l, 0, half_rows, halves.data(), DType::kF32); !st.ok()) {
        return st;
      }
      if (l == layers - 1 && l > 0 && !e.group_frozen(l - 1) && e.world_size() > 1) {
        const Status other = e.GradsPart(l - 1, 0, 1, g.data(), DType::kF32);
        if (other.ok() || other.message().find("one group's parts at a time") == std::string::npos)
          return InternalError("a second group's parts while group " + std::to_string(l) +
                               "'s are open: expected the refusal, got: " + other.ToString());
      }
      if (!lend)
        if (Status st = e.GradsPart(l, 0, half_rows, halves.data(), DType::kF32); !st.ok()) return st;
      if (Status st = e.GradsPart(l, half_rows, hole_row * D - half_rows, g.data() + half_rows, DType::kF32, lend);
          !st.ok())
        return st;
      if (Status st = e.GradsPart(l, hole_row * D + D, D * D - hole_row * D - D, g.data() + hole_row * D + D,
                                  DType::kF32, lend);
          !st.ok())
        return st;
      if (Status st = e.GradsEnd(l); !st.ok()) return st;
    }
    return loss;
  }
};

}  // namespace strata::testing

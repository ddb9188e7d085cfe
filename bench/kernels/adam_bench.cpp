// Adam step throughput against its memory bound and torch, in one run:
// params/s of every ISA path, the bound of the same seven streams, torch's
// AdamW(foreach=True), the fused variants against the bound of their own
// streams, and the compact-state step (kernels/cpu/compact.h) against a
// streaming loop over its own 12.5 bytes a parameter, on the same threads. Ratios are medians of pairs measured back to back (kernel right
// after its bound, kernel right after torch): bandwidth here drifts 2x.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "bench/kernels/memory_bound.h"
#include "bench/kernels/torch_coprocess.h"
#include "kernels/cpu/adam.h"
#include "kernels/cpu/compact.h"
#include "kernels/cpu/parallel.h"

namespace strata::bench {
namespace {

using kernels::CpuIsa;

struct Args {
  size_t n = size_t{64} << 20;
  int rounds = 9;
  int steps = 3;  // steps per timed sample
  std::string python = "/usr/bin/python3";
  std::string worker;
};

struct Arrays {
  explicit Arrays(size_t n)
      : p(n), m(n), v(n), g(n), g16(n), copy(n), hi(n), lo(n), mq(n), vq(n),
        ms(kernels::CompactScaleCount(n)), vs(kernels::CompactScaleCount(n)) {}
  std::vector<float> p, m, v, g;
  std::vector<uint16_t> g16, copy;
  // The compact state (kernels/cpu/compact.h).
  std::vector<uint16_t> hi;
  std::vector<int8_t> lo, mq;
  std::vector<uint8_t> vq;
  std::vector<float> ms, vs;
  kernels::CompactState compact() {
    return {hi.data(), lo.data(), mq.data(), ms.data(), vq.data(), vs.data()};
  }
};

// Bytes the compact step moves a parameter with a bf16 gradient and no
// copy-out (a bf16 P is the state's w_hi): read 2 + 5 + 8/32, write 5 + 8/32.
constexpr double kCompactBytesPerParam = 12.5;

// A fused variant: which streams beyond the base seven it moves.
struct Variant {
  const char* name;
  bool bf16_grad;
  bool copy;
  double grad_scale;
  int bytes_per_param;
};

double Median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t k = x.size() / 2;
  return x.size() % 2 ? x[k] : 0.5 * (x[k - 1] + x[k]);
}

template <typename F>
double SecondsPerStep(int steps, F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
}

void Check(const Status& st) {
  if (st.ok()) return;
  std::fprintf(stderr, "adam_bench: %s\n", st.ToString().c_str());
  std::exit(1);
}

class Bench {
 public:
  Bench(const Args& args) : args_(args), a_(args.n) {}

  void FirstTouch() {  // parallel, so pages land where the kernels' threads run
    kernels::ParallelForTiles(args_.n, kernels::kElementTile, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        a_.p[i] = 0.5f + 1e-7f * static_cast<float>(i % 1000);
        a_.m[i] = a_.v[i] = 0.0f;
        a_.g[i] = 1e-3f * (static_cast<float>(i % 977) / 977.0f - 0.5f);
        a_.g16[i] = F32ToBF16(a_.g[i]);
        a_.copy[i] = 0;
      }
    });
    // Moments of a step's worth, so that the codes are not all zero.
    std::vector<float> m(args_.n), v(args_.n);
    kernels::ParallelForTiles(args_.n, kernels::kElementTile, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) m[i] = a_.g[i], v[i] = a_.g[i] * a_.g[i];
    });
    Check(kernels::CompactPack(args_.n, a_.p.data(), m.data(), v.data(), a_.compact()));
  }

  // The streaming loop over the compact step's own streams.
  double CompactBound() {
    const CompactBoundRangeFn fn =
        kernels::CpuSupports(CpuIsa::kAvx2) ? SelectCompactBoundAvx2() : SelectCompactBoundPlain();
    const kernels::CompactState c = a_.compact();
    const CompactBoundArrays b{c, a_.g16.data()};
    return SecondsPerStep(args_.steps, [&] {
      kernels::ParallelForTiles(args_.n, kernels::kElementTile,
                                [&](size_t lo, size_t hi) { fn(b, lo, hi); });
    });
  }

  // fp32 -> compact on one path (checkpoint conversion, ReadState, a build
  // with values): reads w, m, v, writes the compact state, in place of it.
  double CompactPack(CpuIsa isa) {
    return SecondsPerStep(1, [&] {
      Check(kernels::CompactPackOn(isa, args_.n, a_.p.data(), a_.m.data(), a_.v.data(), a_.compact()));
    });
  }

  // The compact AdamW step: bf16 gradient with a scale, P = w_hi (no copy-out).
  double Compact(CpuIsa isa, int steps) {
    return SecondsPerStep(steps, [&] {
      kernels::AdamOptions opt;
      opt.lr = 1e-3 * (1.0 + 0.1 * (step_ % 7));
      opt.weight_decay = 0.01;
      opt.step = ++step_;
      opt.grad_scale = 1.0 / 1024;
      opt.grad_dtype = DType::kBF16;
      Check(kernels::CompactAdamStepOn(isa, opt, args_.n, a_.compact(), a_.g16.data(), nullptr));
    });
  }

  double Bound(const Variant& v) {
    const BoundRangeFn fn = kernels::CpuSupports(CpuIsa::kAvx2)
                                ? SelectBoundAvx2(v.bf16_grad, v.copy)
                                : SelectBoundPlain(v.bf16_grad, v.copy);
    const BoundArrays b{a_.p.data(), a_.m.data(), a_.v.data(),
                        v.bf16_grad ? static_cast<const void*>(a_.g16.data()) : a_.g.data(),
                        v.copy ? a_.copy.data() : nullptr};
    return SecondsPerStep(args_.steps, [&] {
      kernels::ParallelForTiles(args_.n, kernels::kElementTile,
                                [&](size_t lo, size_t hi) { fn(b, lo, hi); });
    });
  }

  double Kernel(CpuIsa isa, const Variant& v, int steps) {
    return SecondsPerStep(steps, [&] {
      kernels::AdamOptions opt;
      opt.lr = 1e-3 * (1.0 + 0.1 * (step_ % 7));  // changes every step, as in training
      opt.weight_decay = 0.01;
      opt.step = ++step_;
      opt.grad_scale = v.grad_scale;
      opt.grad_dtype = v.bf16_grad ? DType::kBF16 : DType::kF32;
      const void* g = v.bf16_grad ? static_cast<const void*>(a_.g16.data()) : a_.g.data();
      const Status st = kernels::AdamStepOn(isa, opt, args_.n, a_.p.data(), a_.m.data(),
                                            a_.v.data(), g, v.copy ? a_.copy.data() : nullptr);
      if (!st.ok()) {
        std::fprintf(stderr, "adam_bench: %s\n", st.ToString().c_str());
        std::exit(1);
      }
    });
  }

 private:
  const Args& args_;
  Arrays a_;
  int64_t step_ = 0;
};

double Gps(size_t n, double seconds) { return static_cast<double>(n) / seconds / 1e9; }

int Run(const Args& args) {
  const int threads = kernels::CpuKernelThreads();
  std::printf("adam_vs_peers: n=%zu params, threads=%d (affinity), rounds=%d x %d steps\n",
              args.n, threads, args.rounds, args.steps);
  Bench bench(args);
  bench.FirstTouch();
  TorchCoprocess torch;
  bool have_torch = false;
  if (!args.worker.empty()) {
    const Status st = torch.Start(args.python, args.worker, args.n, threads);
    have_torch = st.ok();
    std::printf("torch: %s\n", have_torch ? torch.banner().c_str() : st.ToString().c_str());
  }
  std::vector<CpuIsa> paths;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (kernels::CpuSupports(isa)) paths.push_back(isa);
  const CpuIsa best = paths.back();
  const Variant base{"adamw f32 grad", false, false, 1.0, 28};
  const std::vector<Variant> fused = {
      {"scale+copy_bf16", false, true, 1.0 / 1024, 30},
      {"grad_bf16+scale", true, false, 1.0 / 1024, 26},
      {"grad_bf16+scale+copy_bf16", true, true, 1.0 / 1024, 28},
  };
  // Per path: kernel seconds and bound/kernel ratios; then fused; then torch.
  std::vector<std::vector<double>> path_t(paths.size()), path_r(paths.size());
  std::vector<double> bound_t, torch_t, torch_r;
  std::vector<std::vector<double>> fused_t(fused.size()), fused_b(fused.size()), fused_r(fused.size());
  // The compact step on each SIMD path (the scalar one is far from any bound).
  std::vector<CpuIsa> simd(paths.begin() + 1, paths.end());
  if (simd.empty()) simd.push_back(CpuIsa::kScalar);
  std::vector<std::vector<double>> compact_t(simd.size()), compact_b(simd.size()), compact_r(simd.size());
  bench.Kernel(best, base, 1);  // warm-up
  for (int r = 0; r < args.rounds; ++r) {
    for (size_t k = 0; k < paths.size(); ++k) {
      // The scalar path is slow; time it in a few rounds only.
      if (paths[k] == CpuIsa::kScalar && r >= 2) continue;
      const double tb = bench.Bound(base);
      const double tk = bench.Kernel(paths[k], base, paths[k] == CpuIsa::kScalar ? 1 : args.steps);
      bound_t.push_back(tb);
      path_t[k].push_back(tk);
      path_r[k].push_back(tb / tk);
    }
    for (size_t f = 0; f < fused.size(); ++f) {
      const double tb = bench.Bound(fused[f]);
      const double tk = bench.Kernel(best, fused[f], args.steps);
      fused_b[f].push_back(tb);
      fused_t[f].push_back(tk);
      fused_r[f].push_back(tb / tk);
    }
    for (size_t k = 0; k < simd.size(); ++k) {
      const double tb = bench.CompactBound();
      const double tk = bench.Compact(simd[k], args.steps);
      compact_b[k].push_back(tb);
      compact_t[k].push_back(tk);
      compact_r[k].push_back(tb / tk);
    }
    if (have_torch) {
      Result<double> tt = torch.TimeSteps(args.steps);
      if (!tt.ok()) {
        std::printf("torch: %s\n", tt.status().ToString().c_str());
        have_torch = false;
        continue;
      }
      const double tk = bench.Kernel(best, base, args.steps);
      torch_t.push_back(*tt);
      torch_r.push_back(*tt / tk);
    }
  }
  const double bound_gps = Gps(args.n, Median(bound_t));
  for (size_t k = 0; k < paths.size(); ++k)
    std::printf("path %-7s %7.3f G params/s  bound_ratio %.3f (median of %zu pairs)\n",
                kernels::CpuIsaName(paths[k]), Gps(args.n, Median(path_t[k])), Median(path_r[k]),
                path_r[k].size());
  std::printf("bound          %7.3f G params/s  (%d B/param: %.1f GB/s)\n", bound_gps, base.bytes_per_param,
              bound_gps * base.bytes_per_param);
  if (have_torch)
    std::printf("torch AdamW(foreach=True) %7.3f G params/s  torch_ratio %.2f\n",
                Gps(args.n, Median(torch_t)), Median(torch_r));
  for (size_t f = 0; f < fused.size(); ++f)
    std::printf("fused %-26s (%d B/param) %s %7.3f G params/s, bound %7.3f, bound_ratio %.3f\n",
                fused[f].name, fused[f].bytes_per_param, kernels::CpuIsaName(best),
                Gps(args.n, Median(fused_t[f])), Gps(args.n, Median(fused_b[f])),
                Median(fused_r[f]));
  for (size_t k = 0; k < simd.size(); ++k) {
    const double bound_gps = Gps(args.n, Median(compact_b[k]));
    std::printf("compact %-7s (%.1f B/param) %7.3f G params/s, streaming loop %7.3f G params/s "
                "(%.1f GB/s), compact_bound_ratio %.3f\n",
                kernels::CpuIsaName(simd[k]), kCompactBytesPerParam, Gps(args.n, Median(compact_t[k])),
                bound_gps, bound_gps * kCompactBytesPerParam, Median(compact_r[k]));
  }
  // The conversion: scalar reference against the SIMD path, a few rounds.
  if (simd.back() != CpuIsa::kScalar) {
    std::vector<double> pack_s, pack_v;
    for (int r = 0; r < 3; ++r) {
      pack_s.push_back(bench.CompactPack(CpuIsa::kScalar));
      pack_v.push_back(bench.CompactPack(simd.back()));
    }
    std::printf("compact pack (fp32 -> compact) scalar %7.3f G params/s, %s %7.3f G params/s (%.2fx)\n",
                Gps(args.n, Median(pack_s)), kernels::CpuIsaName(simd.back()), Gps(args.n, Median(pack_v)),
                Median(pack_s) / Median(pack_v));
  }
  const size_t bi = paths.size() - 1;
  std::printf("adam_vs_peers bound_ratio=%.3f torch_ratio=%s compact_bound_ratio=%.3f\n",
              Median(path_r[bi]),
              have_torch ? std::to_string(Median(torch_r)).substr(0, 5).c_str() : "nan",
              Median(compact_r.back()));
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  strata::bench::Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      if (a != flag || i + 1 >= argc) return nullptr;
      return argv[++i];
    };
    if (const char* v = value("--n")) args.n = std::strtoull(v, nullptr, 10);
    else if (const char* v2 = value("--rounds")) args.rounds = std::atoi(v2);
    else if (const char* v3 = value("--steps")) args.steps = std::atoi(v3);
    else if (const char* v4 = value("--python")) args.python = v4;
    else if (const char* v5 = value("--torch-worker")) args.worker = v5;
    else {
      std::fprintf(stderr,
                   "usage: adam_bench [--n N] [--rounds R] [--steps S] [--python PY] "
                   "[--torch-worker torch_adamw_worker.py]\n");
      return 2;
    }
  }
  return strata::bench::Run(args);
}

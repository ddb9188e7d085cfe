// CUDA compact Adam/AdamW and Lion against the CPU scalar reference
// (CompactAdamStepOn/CompactLionStepOn(kScalar)), bitwise after every step:
// every half, correction, code and scale, and the copy-out. Sizes around the
// block of 32 (partial last blocks), a large one and one past the grid's
// reach (grid-stride); f32/bf16/f16 gradients, every copy-out, weight decay
// on and off, lr changing each step, tiny, huge and NaN gradients; masters at
// the split's edges (subnormals, a binade crossing, bf16 overflow, ±inf, NaN)
// and blocks of every kind side by side (all zero, below kCompactMinScale,
// subnormal v, NaN). NaN payloads are the GPU's own (both sides NaN is
// equal). Both first-moment formulas (MomentUpdate), both lerp branches.
// Exits 77 with "skipped: no GPU (...)" when there is none.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "kernels/cpu/compact.h"
#include "kernels/cuda/adam_cuda.h"
#include "kernels/cuda/compact_cuda.h"
#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace strata::kernels::test {
namespace {

// The six arrays of n elements on the host.
struct HostState {
  explicit HostState(size_t n)
      : hi(n), lo(n), mq(n), vq(n), ms(CompactScaleCount(n)), vs(CompactScaleCount(n)) {}
  CompactState state() { return {hi.data(), lo.data(), mq.data(), ms.data(), vq.data(), vs.data()}; }
  std::vector<uint16_t> hi;
  std::vector<int8_t> lo, mq;
  std::vector<uint8_t> vq;
  std::vector<float> ms, vs;
};

// ... and on the device.
struct DeviceState {
  explicit DeviceState(size_t n)
      : hi(2 * n), lo(n), mq(n), ms(4 * CompactScaleCount(n)), vq(n), vs(4 * CompactScaleCount(n)) {}
  CompactState state() const {
    return {hi.as<uint16_t>(), lo.as<int8_t>(), mq.as<int8_t>(), ms.as<float>(), vq.as<uint8_t>(), vs.as<float>()};
  }
  void Put(const HostState& h) {
    hi.Put(h.hi.data()), lo.Put(h.lo.data()), mq.Put(h.mq.data());
    ms.Put(h.ms.data()), vq.Put(h.vq.data()), vs.Put(h.vs.data());
  }
  void Get(HostState& h) const {
    hi.Get(h.hi.data()), lo.Get(h.lo.data()), mq.Get(h.mq.data());
    ms.Get(h.ms.data()), vq.Get(h.vq.data()), vs.Get(h.vs.data());
  }
  DeviceBuffer hi, lo, mq, ms, vq, vs;
};

bool IsBF16NaN(uint16_t h) { return (h & 0x7fffu) > 0x7f80u; }

// Empty when a and b hold the same bits (a NaN half or scale equals any NaN),
// else the first array and element that differ.
std::string Diff(const HostState& a, const HostState& b) {
  const size_t n = a.hi.size();
  for (size_t i = 0; i < n; ++i) {
    const std::string at = "[" + std::to_string(i) + "]";
    if (a.hi[i] != b.hi[i] && !(IsBF16NaN(a.hi[i]) && IsBF16NaN(b.hi[i])))
      return "w_hi" + at + " cpu " + std::to_string(a.hi[i]) + " gpu " + std::to_string(b.hi[i]);
    if (a.lo[i] != b.lo[i]) return "w_lo" + at + " cpu " + std::to_string(a.lo[i]) + " gpu " + std::to_string(b.lo[i]);
    if (a.mq[i] != b.mq[i]) return "m_code" + at + " cpu " + std::to_string(a.mq[i]) + " gpu " + std::to_string(b.mq[i]);
    if (a.vq[i] != b.vq[i]) return "v_code" + at + " cpu " + std::to_string(a.vq[i]) + " gpu " + std::to_string(b.vq[i]);
  }
  const long m = FirstDiff(a.ms.data(), b.ms.data(), a.ms.size());
  const long v = FirstDiff(a.vs.data(), b.vs.data(), a.vs.size());
  if (m >= 0) return "m_scale[" + std::to_string(m) + "]";
  if (v >= 0) return "v_scale[" + std::to_string(v) + "]";
  return "";
}

enum class Opt { kAdamW, kAdam, kLion };
enum class Init { kRandom, kEdge, kMixed };

DType CopyDType(int copy) { return copy == 1 ? DType::kBF16 : copy == 2 ? DType::kF16 : DType::kF32; }

struct Case {
  Opt opt = Opt::kAdamW;
  DType grad = DType::kF32;
  int copy = 0;  // 0 none, 1 bf16, 2 f16, 3 f32
  double wd = 0.0;
  size_t n = 1;
  Init init = Init::kRandom;
  float mag = 1.0f;
  double lr = 1e-3;
  int steps = 8;
  size_t shift = 0;  // kMixed: which kind of block comes first
  MomentUpdate moment = MomentUpdate::kMulAdd;  // Adam, AdamW
  double beta1 = 0.9;                           // Adam, AdamW
  std::string Name() const {
    static const char* kOpt[] = {"adamw", "adam", "lion"};
    static const char* kInit[] = {"random", "edge", "mixed"};
    return std::string(kOpt[int(opt)]) + " grad=" + DTypeName(grad) +
           " copy=" + (copy ? DTypeName(CopyDType(copy)) : "none") + " wd=" + std::to_string(wd) +
           " n=" + std::to_string(n) + " init=" + kInit[int(init)] + " mag=" + std::to_string(mag) +
           " lr=" + std::to_string(lr) + " shift=" + std::to_string(shift) +
           " moment_update=" + MomentUpdateName(moment) + " beta1=" + std::to_string(beta1);
  }
};

// The fp32 state packed into the first step's compact state, and a fixed
// gradient pattern (kEdge, kMixed; kRandom draws new gradients each step).
struct Start {
  std::vector<float> w, m, v, g;
};

Start RandomStart(size_t n, Rng& rng) {
  Start s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n), {}};
  for (size_t i = 0; i < n; ++i) {
    s.w[i] = rng.Spread();
    s.m[i] = i % 11 == 0 ? 0.0f : 0.01f * rng.Spread();
    const float g = rng.Spread();
    s.v[i] = i % 13 == 0 ? 0.0f : 1e-3f * g * g;
  }
  return s;
}

// compact_paths_test's EdgeMastersThroughTheStep: every third correction
// around zero, the subnormals, a binade crossing and bf16's overflow, both
// signs, then ±inf, NaN, ±0; moments zero.
Start EdgeStart(Rng& rng) {
  Start s;
  for (uint32_t high : {0x0000u, 0x0080u, 0x3f7fu, 0x7f7fu})
    for (uint32_t sign : {0u, 0x80000000u})
      for (uint32_t low = 0; low < 0x10000u; low += 3) s.w.push_back(BitsF32(sign | (high << 16) | low));
  for (float x : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::nanf(""), 0.0f, -0.0f})
    s.w.push_back(x);
  s.m.assign(s.w.size(), 0.0f);
  s.v.assign(s.w.size(), 0.0f);
  for (size_t i = 0; i < s.w.size(); ++i) s.g.push_back(rng.Spread());
  return s;
}

// compact_paths_test's MixedBlocksInOneGroup: blocks of six kinds in turn (a
// NaN gradient, all zero, m below kCompactMinScale, subnormal v, masters past
// bf16's range, live ones).
Start MixedStart(size_t n, size_t shift, Rng& rng) {
  Start s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  for (size_t i = 0; i < n; ++i) {
    const size_t kind = (i / kCompactBlock + shift) % 6;
    s.w[i] = rng.Spread();
    s.m[i] = 0.01f * rng.Spread();
    s.v[i] = 1e-3f * rng.Spread() * rng.Spread();
    s.g[i] = rng.Spread();
    if (kind == 1 && i % kCompactBlock == 3) s.g[i] = std::nanf("");
    if (kind == 2) s.m[i] = s.v[i] = s.g[i] = 0.0f;
    if (kind == 3) s.m[i] = 1e-32f * rng.Spread(), s.g[i] = 1e-33f * rng.Spread();
    if (kind == 4) s.v[i] = 1e-44f * static_cast<float>(i % 3), s.g[i] = 1e-22f * rng.Spread();
    if (kind == 5 && i % 7 == 0) s.w[i] = BitsF32(0x7f7fff80u);
  }
  return s;
}

// Gradients of step t: the fixed pattern, or random with exact zeros (every
// 7th) and, at the last step, a NaN at element 37 (a NaN block).
void FillGrads(const Case& k, const Start& st, Rng& rng, int t, std::vector<uint8_t>& g) {
  for (size_t i = 0; i < k.n; ++i) {
    float x = st.g.empty() ? rng.Spread() * k.mag : st.g[i] * k.mag;
    if (st.g.empty() && (i + static_cast<size_t>(t)) % 7 == 0) x = 0.0f;
    if (st.g.empty() && t == k.steps && i == 37) x = std::nanf("");
    StoreAs(k.grad, g.data(), i, x);
  }
}

bool SameCopy(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, int copy, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float fa, fb;
    if (copy == 3) {
      std::memcpy(&fa, a.data() + 4 * i, 4);
      std::memcpy(&fb, b.data() + 4 * i, 4);
      if (!SameFloat(fa, fb)) return false;
      continue;
    }
    uint16_t ha, hb;
    std::memcpy(&ha, a.data() + 2 * i, 2);
    std::memcpy(&hb, b.data() + 2 * i, 2);
    fa = copy == 2 ? F16ToF32(ha) : BF16ToF32(ha);
    fb = copy == 2 ? F16ToF32(hb) : BF16ToF32(hb);
    if (ha != hb && !(std::isnan(fa) && std::isnan(fb))) return false;
  }
  return true;
}

// Runs both for k.steps steps from the same state, comparing after each.
void Compare(const Case& k) {
  const size_t n = k.n;
  Rng rng(n * 7 + static_cast<uint64_t>(k.grad) * 11 + static_cast<uint64_t>(k.copy) * 3 +
          static_cast<uint64_t>(k.opt) * 101 + k.shift);
  const Start st = k.init == Init::kEdge ? EdgeStart(rng) : k.init == Init::kMixed ? MixedStart(n, k.shift, rng)
                                                                                   : RandomStart(n, rng);
  if (!Expect(st.w.size() == n, k.Name() + " start size")) return;
  HostState cpu(n), gpu(n);
  if (!Expect(CompactPack(n, st.w.data(), st.m.data(), st.v.data(), cpu.state()).ok(), k.Name() + " pack")) return;
  DeviceState dev(n);
  dev.Put(cpu);
  const size_t cb = k.copy ? DTypeSize(CopyDType(k.copy)) : 0;
  std::vector<uint8_t> g(n * DTypeSize(k.grad)), c_cpu(n * 4), c_gpu(n * 4);
  DeviceBuffer dg(g.size()), dc(n * 4);
  for (int t = 1; t <= k.steps; ++t) {
    FillGrads(k, st, rng, t, g);
    dg.Put(g.data());
    const double lr = k.init == Init::kRandom ? k.lr * (1.0 + 0.5 * std::sin(t)) : k.lr;
    const double scale = k.init == Init::kRandom && t % 3 ? 1.0 / (1024.0 + t) : 1.0;
    const DType copy_dtype = CopyDType(k.copy);
    void* host_copy = k.copy ? c_cpu.data() : nullptr;
    void* dev_copy = k.copy ? dc.ptr : nullptr;
    Status ref, out;
    if (k.opt == Opt::kLion) {
      const LionOptions o{lr, 0.9, 0.99, k.wd, scale, k.grad, copy_dtype};
      ref = CompactLionStepOn(CpuIsa::kScalar, o, n, cpu.state(), g.data(), host_copy);
      // The v arrays go in too: the twin must leave them as they are.
      out = CompactLionStepCuda(o, n, dev.state(), dg.ptr, dev_copy, nullptr);
    } else {
      AdamOptions o;
      o.mode = k.opt == Opt::kAdamW ? AdamMode::kAdamW : AdamMode::kAdam;
      o.lr = lr;
      o.weight_decay = k.wd;
      o.eps = t % 2 ? 1e-8 : 1e-6;
      o.step = t;
      o.grad_scale = scale;
      o.grad_dtype = k.grad;
      o.param_copy_dtype = copy_dtype;
      o.moment_update = k.moment;
      o.beta1 = k.beta1;
      ref = CompactAdamStepOn(CpuIsa::kScalar, o, n, cpu.state(), g.data(), host_copy);
      out = CompactAdamStepCuda(o, n, dev.state(), dg.ptr, dev_copy, nullptr);
    }
    if (!Expect(ref.ok() && out.ok(), k.Name() + " status " + ref.ToString() + " / " + out.ToString())) return;
    CHECK_CUDA(cudaDeviceSynchronize());
    dev.Get(gpu);
    const std::string diff = Diff(cpu, gpu);
    if (!Expect(diff.empty(), k.Name() + " step " + std::to_string(t) + ": " + diff)) return;
    if (cb) {
      dc.Get(c_gpu.data());
      if (!Expect(SameCopy(c_cpu, c_gpu, k.copy, n), k.Name() + " step " + std::to_string(t) + ": copy")) return;
    }
  }
}

// Invalid options and null arrays are refused before any launch, as on the CPU.
void CompareRefusals() {
  const CompactState none{};
  AdamOptions ao;
  ao.beta1 = 1.0;
  Expect(!CompactAdamStepCuda(ao, 1, none, nullptr, nullptr, nullptr).ok(), "adam beta1 = 1 refused");
  LionOptions lo;
  lo.beta2 = -0.5;
  Expect(!CompactLionStepCuda(lo, 1, none, nullptr, nullptr, nullptr).ok(), "lion beta2 < 0 refused");
  Expect(CompactAdamStepCuda(AdamOptions{}, 0, none, nullptr, nullptr, nullptr).ok(), "adam n = 0 is a no-op");
  Expect(CompactLionStepCuda(LionOptions{}, 0, none, nullptr, nullptr, nullptr).ok(), "lion n = 0 is a no-op");
  Expect(!CompactAdamStepCuda(AdamOptions{}, 4, none, nullptr, nullptr, nullptr).ok(), "adam null refused");
  Expect(!CompactLionStepCuda(LionOptions{}, 4, none, nullptr, nullptr, nullptr).ok(), "lion null refused");
}

void RandomCases() {
  for (Opt opt : {Opt::kAdamW, Opt::kAdam, Opt::kLion})
    for (DType g : {DType::kF32, DType::kBF16, DType::kF16})
      for (int copy = 0; copy < 4; ++copy)
        for (double wd : {0.0, opt == Opt::kLion ? 0.1 : 0.01})
          for (size_t n : {size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{1000}, size_t{65536 + 7}}) {
            Case k;
            k.opt = opt, k.grad = g, k.copy = copy, k.wd = wd, k.n = n;
            if (opt == Opt::kLion) k.lr = 1e-4;
            Compare(k);
            if (n != 1000) continue;  // magnitudes at one size: blocks below kCompactMinScale, near the top
            for (float mag : {g == DType::kF16 ? 1e-6f : 1e-30f, g == DType::kF16 ? 3e3f : 1e15f}) {
              k.mag = mag;
              Compare(k);
            }
          }
}

void EdgeAndMixedCases() {
  // Steps of a few fp32 ULPs at the subnormals, at 1 and at 2^127.
  for (Opt opt : {Opt::kAdamW, Opt::kAdam, Opt::kLion})
    for (double lr : {1e-44, 1e-6, 3e33}) {
      Case k;
      k.opt = opt, k.init = Init::kEdge, k.lr = lr, k.steps = 3, k.wd = opt == Opt::kAdamW ? 0.0 : 0.01;
      k.n = 4 * 2 * ((0x10000 + 2) / 3) + 5;
      Compare(k);
    }
  for (Opt opt : {Opt::kAdamW, Opt::kLion})
    for (size_t n : {8 * kCompactBlock, 13 * kCompactBlock + 5, 27 * kCompactBlock + 31})
      for (size_t shift = 0; shift < 6; ++shift) {
        Case k;
        k.opt = opt, k.init = Init::kMixed, k.n = n, k.shift = shift, k.steps = 4;
        Compare(k);
      }
}

// The lerp first moment, each weight branch (beta1 0.9: w = 0.1; 0.3: w = 0.7).
void LerpCases() {
  for (Opt opt : {Opt::kAdamW, Opt::kAdam})
    for (DType g : {DType::kF32, DType::kBF16, DType::kF16})
      for (int copy = 0; copy < 4; ++copy)
        for (double beta1 : {0.9, 0.3})
          for (size_t n : {size_t{1}, size_t{33}, size_t{1000}, size_t{65536 + 7}}) {
            Case k;
            k.opt = opt, k.grad = g, k.copy = copy, k.wd = 0.01, k.n = n;
            k.moment = MomentUpdate::kLerp, k.beta1 = beta1;
            Compare(k);
          }
}

// Past what one grid covers (65536 blocks of 8 warps): the grid-stride loop.
void GridStrideCase() {
  Case k;
  k.opt = Opt::kAdamW, k.grad = DType::kBF16, k.copy = 1, k.wd = 0.01, k.steps = 2;
  k.n = (size_t{65536} * 8 + 3) * kCompactBlock + 17;
  Compare(k);
}

}  // namespace
}  // namespace strata::kernels::test

int main() {
  using namespace strata::kernels;
  const strata::Result<int> gpus = CudaDeviceCount();
  if (!gpus.ok() || gpus.value() == 0) {
    std::fprintf(stderr, "skipped: no GPU (%s)\n",
                 gpus.ok() ? "cudaGetDeviceCount found 0 devices" : gpus.status().message().c_str());
    std::printf("skipped: no GPU\n");
    return 77;
  }
  test::CompareRefusals();
  test::RandomCases();
  test::EdgeAndMixedCases();
  test::LerpCases();
  test::GridStrideCase();
  std::printf("%s: %d failures\n", test::g_failures ? "FAIL" : "ok", test::g_failures);
  return test::g_failures ? 1 : 0;
}

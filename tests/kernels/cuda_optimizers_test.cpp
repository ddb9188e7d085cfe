// CUDA Lion and Adagrad against the CPU scalar reference, bitwise: sizes
// around warp and block widths and one past a million (grid-stride), 60 steps
// with an lr that changes each step, all gradient dtypes and copy-outs, tiny
// and huge gradients, exact zeros (Lion's sign(0) = 0), Adagrad with and
// without weight decay and lr_decay. Exits 77 with "skipped: no GPU (...)"
// when cudaGetDeviceCount fails or finds none.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "kernels/cpu/adagrad.h"
#include "kernels/cpu/lion.h"
#include "kernels/cuda/optimizers_cuda.h"
#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace strata::kernels::test {
namespace {

// One case: the optimizer, the gradients' dtype and size, the copy-out (0
// none, 1 bf16, 2 f16), and the gradients' magnitude.
struct Case {
  bool lion = true;
  DType grad = DType::kF32;
  int copy = 0;
  float mag = 1.0f;
  size_t n = 1;
  double weight_decay = 0.0;
  std::string Name() const {
    return std::string(lion ? "lion" : "adagrad") + " grad=" + DTypeName(grad) +
           " copy=" + std::to_string(copy) + " mag=" + std::to_string(mag) +
           " wd=" + std::to_string(weight_decay) + " n=" + std::to_string(n);
  }
};

// Gradients of step t: random, with every 7th element an exact zero (every
// 13th a negative zero) so that Lion's c is 0 where the moment is too.
void FillGrads(const Case& k, Rng& rng, int t, std::vector<uint8_t>& g) {
  for (size_t i = 0; i < k.n; ++i) {
    float x = rng.Spread() * k.mag;
    if ((i + static_cast<size_t>(t)) % 7 == 0) x = 0.0f;
    if ((i + static_cast<size_t>(t)) % 13 == 0) x = -0.0f;
    StoreAs(k.grad, g.data(), i, x);
  }
}

// Runs both paths for `steps` steps; p, s (Lion's exp_avg or Adagrad's
// state_sum) and the copy must agree bit for bit at the end.
void Compare(const Case& k, int steps) {
  const size_t n = k.n;
  std::vector<float> p(n), s(n, 0.0f), dp(n), ds(n);
  std::vector<uint8_t> g(n * DTypeSize(k.grad)), c(n * 2), dc(n * 2);
  Rng rng(n * 3 + static_cast<int>(k.grad) * 11 + static_cast<uint64_t>(k.copy) + (k.lion ? 0 : 101));
  for (float& x : p) x = rng.Spread();
  DeviceBuffer bp(n * 4), bs(n * 4), bg(g.size()), bc(n * 2);
  bp.Put(p.data());
  bs.Put(s.data());
  const DType copy_dtype = k.copy == 2 ? DType::kF16 : DType::kBF16;
  for (int t = 1; t <= steps; ++t) {
    const double lr = 1e-3 * (1.0 + 0.5 * std::sin(t));
    const double scale = t % 3 ? 1.0 / 1024 : 1.0;
    FillGrads(k, rng, t, g);
    bg.Put(g.data());
    void* host_copy = k.copy ? c.data() : nullptr;
    void* dev_copy = k.copy ? bc.ptr : nullptr;
    Status ref, dev;
    if (k.lion) {
      const LionOptions o{lr, 0.9, 0.99, k.weight_decay, scale, k.grad, copy_dtype};
      ref = LionStepOn(CpuIsa::kScalar, o, n, p.data(), s.data(), g.data(), host_copy);
      dev = LionStepCuda(o, n, static_cast<float*>(bp.ptr), static_cast<float*>(bs.ptr), bg.ptr, dev_copy,
                         nullptr);
    } else {
      AdagradOptions o;
      o.lr = lr * 10;
      o.lr_decay = 0.01;
      o.weight_decay = k.weight_decay;
      o.eps = t % 2 ? 1e-10 : 1e-8;
      o.step = t;
      o.grad_scale = scale;
      o.grad_dtype = k.grad;
      o.param_copy_dtype = copy_dtype;
      ref = AdagradStepOn(CpuIsa::kScalar, o, n, p.data(), s.data(), g.data(), host_copy);
      dev = AdagradStepCuda(o, n, static_cast<float*>(bp.ptr), static_cast<float*>(bs.ptr), bg.ptr, dev_copy,
                            nullptr);
    }
    Expect(ref.ok() && dev.ok(), k.Name() + " status " + ref.ToString() + " / " + dev.ToString());
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  bp.Get(dp.data());
  bs.Get(ds.data());
  Expect(FirstDiff(p.data(), dp.data(), n) == -1, k.Name() + " param");
  Expect(FirstDiff(s.data(), ds.data(), n) == -1, k.Name() + (k.lion ? " exp_avg" : " state_sum"));
  if (k.copy) {
    bc.Get(dc.data());
    // NaN payloads may differ between the CPU and the GPU; everything else is exact.
    bool same = true;
    for (size_t i = 0; i < n && same; ++i) {
      const uint16_t a = reinterpret_cast<const uint16_t*>(c.data())[i];
      const uint16_t b = reinterpret_cast<const uint16_t*>(dc.data())[i];
      const float fa = copy_dtype == DType::kF16 ? F16ToF32(a) : BF16ToF32(a);
      const float fb = copy_dtype == DType::kF16 ? F16ToF32(b) : BF16ToF32(b);
      same = a == b || (std::isnan(fa) && std::isnan(fb));
    }
    Expect(same, k.Name() + " param copy");
  }
}

// Invalid options are refused before any launch, as on the CPU.
void CompareRefusals() {
  LionOptions lo;
  lo.beta1 = 1.0;
  Expect(!LionStepCuda(lo, 1, nullptr, nullptr, nullptr, nullptr, nullptr).ok(), "lion beta1 = 1 refused");
  AdagradOptions ao;
  ao.step = 0;
  Expect(!AdagradStepCuda(ao, 1, nullptr, nullptr, nullptr, nullptr, nullptr).ok(), "adagrad step 0 refused");
  Expect(LionStepCuda(LionOptions{}, 0, nullptr, nullptr, nullptr, nullptr, nullptr).ok(),
         "lion n = 0 is a no-op");
  Expect(!LionStepCuda(LionOptions{}, 4, nullptr, nullptr, nullptr, nullptr, nullptr).ok(),
         "lion null refused");
}

}  // namespace
}  // namespace strata::kernels::test

int main() {
  using namespace strata::kernels;
  using strata::DType;
  const strata::Result<int> gpus = CudaDeviceCount();
  if (!gpus.ok() || gpus.value() == 0) {
    std::fprintf(stderr, "skipped: no GPU (%s)\n",
                 gpus.ok() ? "cudaGetDeviceCount found 0 devices" : gpus.status().message().c_str());
    std::printf("skipped: no GPU\n");
    return 77;
  }
  for (bool lion : {true, false})
    for (DType g : {DType::kF32, DType::kBF16, DType::kF16})
      for (int copy = 0; copy < 3; ++copy)
        for (float mag : {1.0f, g == DType::kF16 ? 1e-6f : 1e-30f, g == DType::kF16 ? 3e3f : 1e30f})
          for (double wd : {0.0, 0.1})
            for (size_t n : {1, 31, 32, 33, 255, 256, 257, 1025, (1 << 20) + 3}) {
              // The large size (many blocks, grid-stride) for one copy-out per dtype.
              if (n > 4096 && (mag != 1.0f || copy != static_cast<int>(g) || wd == 0.0)) continue;
              test::Case k;
              k.lion = lion;
              k.grad = g;
              k.copy = copy;
              k.mag = mag;
              k.n = n;
              k.weight_decay = wd;
              test::Compare(k, n > 4096 ? 20 : 60);
            }
  test::CompareRefusals();
  std::printf("%s: %d failures\n", test::g_failures ? "FAIL" : "ok", test::g_failures);
  return test::g_failures ? 1 : 0;
}

// CUDA Adam/AdamW and casts against the CPU scalar reference, bitwise: sizes
// around warp and block widths, 100 steps with an lr that changes each step,
// tiny and huge gradients, all gradient dtypes and copy-outs, both first-moment
// formulas (MomentUpdate; lerp with each weight branch). Exits 77 with
// "skipped: no GPU (...)" when cudaGetDeviceCount fails or finds none.
#include <cuda_runtime.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "kernels/cpu/adam.h"
#include "kernels/cpu/cast.h"
#include "kernels/cuda/adam_cuda.h"
#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace strata::kernels::test {
namespace {

void CompareAdam(AdamMode mode, DType grad, int copy, float mag, size_t n,
                 MomentUpdate moment = MomentUpdate::kMulAdd, double beta1 = 0.9, int steps = 100) {
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), dp(n), dm(n), dv(n);
  std::vector<uint8_t> g(n * DTypeSize(grad)), c(n * 2), dc(n * 2);
  Rng rng(n + static_cast<int>(grad) * 7 + copy);
  for (float& x : p) x = rng.Spread();
  DeviceBuffer bp(n * 4), bm(n * 4), bv(n * 4), bg(g.size()), bc(n * 2);
  bp.Put(p.data());
  bm.Put(m.data());
  bv.Put(v.data());
  const std::string name = std::string(mode == AdamMode::kAdamW ? "adamw" : "adam") +
                           " grad=" + DTypeName(grad) + " copy=" + std::to_string(copy) +
                           " mag=" + std::to_string(mag) + " n=" + std::to_string(n) +
                           " moment_update=" + MomentUpdateName(moment) + " beta1=" + std::to_string(beta1);
  for (int t = 1; t <= steps; ++t) {
    AdamOptions opt;
    opt.mode = mode;
    opt.lr = 1e-3 * (1.0 + 0.5 * std::sin(t));
    opt.weight_decay = 0.01;
    opt.step = t;
    opt.grad_scale = t % 3 ? 1.0 / 1024 : 1.0;
    opt.grad_dtype = grad;
    opt.param_copy_dtype = copy == 2 ? DType::kF16 : DType::kBF16;
    opt.moment_update = moment;
    opt.beta1 = beta1;
    for (size_t i = 0; i < n; ++i) StoreAs(grad, g.data(), i, rng.Spread() * mag);
    bg.Put(g.data());
    const Status ref = AdamStepOn(CpuIsa::kScalar, opt, n, p.data(), m.data(), v.data(),
                                  g.data(), copy ? c.data() : nullptr);
    const Status dev = AdamStepCuda(opt, n, static_cast<float*>(bp.ptr), static_cast<float*>(bm.ptr),
                                    static_cast<float*>(bv.ptr), bg.ptr, copy ? bc.ptr : nullptr, nullptr);
    Expect(ref.ok() && dev.ok(), name + " status " + dev.ToString());
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  bp.Get(dp.data());
  bm.Get(dm.data());
  bv.Get(dv.data());
  Expect(FirstDiff(p.data(), dp.data(), n) == -1, name + " param");
  Expect(FirstDiff(m.data(), dm.data(), n) == -1, name + " exp_avg");
  Expect(FirstDiff(v.data(), dv.data(), n) == -1, name + " exp_avg_sq");
  if (copy) {
    bc.Get(dc.data());
    Expect(std::memcmp(c.data(), dc.data(), n * 2) == 0, name + " param copy");
  }
}

// A stream query that finds work still running leaves "not ready" as the
// thread's last error, which a launch's check (cudaGetLastError) read as its
// own: "AdamStepCuda launch: device not ready" after the engine's NCCL
// polls, and the engine broke. Launches after such a query are OK.
void LaunchesAfterANotReadyQuery() {
  cudaStream_t busy;
  CHECK_CUDA(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
  CHECK_CUDA(cudaLaunchHostFunc(busy, [](void*) { usleep(300 * 1000); }, nullptr));
  Expect(cudaStreamQuery(busy) == cudaErrorNotReady, "a stream held by a 300 ms host function is not ready");
  std::printf("after a not-ready query the thread's last error is %s\n", cudaGetErrorName(cudaPeekAtLastError()));
  const size_t n = 1000;
  std::vector<float> host(n, 0.5f);
  DeviceBuffer p(n * 4), m(n * 4), v(n * 4), g(n * 4), c(n * 2);
  p.Put(host.data());
  m.Put(host.data());
  v.Put(host.data());
  g.Put(host.data());
  AdamOptions opt;
  opt.step = 1;
  const Status adam = AdamStepCuda(opt, n, p.as<float>(), m.as<float>(), v.as<float>(), g.ptr, nullptr, nullptr);
  Expect(adam.ok(), "AdamStepCuda after a not-ready query: " + adam.ToString());
  const Status cast = CastCuda(DType::kF32, g.ptr, DType::kBF16, c.ptr, n, nullptr);
  Expect(cast.ok(), "CastCuda after a not-ready query: " + cast.ToString());
  CHECK_CUDA(cudaStreamSynchronize(busy));
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaStreamDestroy(busy));
}

void CompareCasts() {
  const size_t n = (size_t{1} << 24) + 3;
  std::vector<uint32_t> bits(n);
  Rng rng(5);
  for (size_t i = 0; i < n; ++i) bits[i] = i < 65536 ? static_cast<uint32_t>(i) << 16 : static_cast<uint32_t>(rng.Next());
  for (DType s : {DType::kF32, DType::kBF16, DType::kF16})
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
      const size_t count = s == DType::kF32 ? n : 65536;  // 16-bit sources: every pattern
      std::vector<uint8_t> src(count * DTypeSize(s)), want(count * DTypeSize(d)), got(want.size());
      for (size_t i = 0; i < count; ++i) {
        if (s == DType::kF32) std::memcpy(&src[i * 4], &bits[i], 4);
        else reinterpret_cast<uint16_t*>(src.data())[i] = static_cast<uint16_t>(i);
      }
      Expect(CastOn(CpuIsa::kScalar, s, src.data(), d, want.data(), count).ok(), "cpu cast");
      DeviceBuffer bs(src.size()), bd(got.size());
      bs.Put(src.data());
      Expect(CastCuda(s, bs.ptr, d, bd.ptr, count, nullptr).ok(), "cuda cast status");
      CHECK_CUDA(cudaDeviceSynchronize());
      bd.Get(got.data());
      bool same = true;
      for (size_t i = 0; i < count && same; ++i) {
        if (d == DType::kF32) {
          float a, b;
          std::memcpy(&a, &want[i * 4], 4);
          std::memcpy(&b, &got[i * 4], 4);
          same = F32Bits(a) == F32Bits(b);
        } else {
          same = reinterpret_cast<uint16_t*>(want.data())[i] == reinterpret_cast<uint16_t*>(got.data())[i];
        }
      }
      Expect(same, std::string("cast ") + DTypeName(s) + "->" + DTypeName(d));
    }
}

}  // namespace
}  // namespace strata::kernels::test

int main() {
  using namespace strata::kernels;
  const strata::Result<int> gpus = CudaDeviceCount();
  if (!gpus.ok() || gpus.value() == 0) {
    std::printf("skipped: no GPU (%s)\n",
                gpus.ok() ? "cudaGetDeviceCount found 0 devices" : gpus.status().message().c_str());
    return 77;
  }
  for (AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam})
    for (strata::DType g : {strata::DType::kF32, strata::DType::kBF16, strata::DType::kF16})
      for (int copy = 0; copy < 3; ++copy)
        for (float mag : {1.0f, g == strata::DType::kF16 ? 1e-6f : 1e-30f, g == strata::DType::kF16 ? 3e3f : 1e30f})
          for (size_t n : {1, 31, 32, 33, 255, 256, 257, 1025, (1 << 20) + 3}) {
            // The large size (many blocks, grid-stride) for one copy-out per dtype.
            if (n > 4096 && (mag != 1.0f || copy != static_cast<int>(g))) continue;
            test::CompareAdam(mode, g, copy, mag, n);
          }
  // lerp, each weight branch: every dtype and copy-out, sizes around warp and block.
  for (AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam})
    for (strata::DType g : {strata::DType::kF32, strata::DType::kBF16, strata::DType::kF16})
      for (int copy = 0; copy < 3; ++copy)
        for (double beta1 : {0.9, 0.3})
          for (size_t n : {1, 33, 257, 1025, (1 << 20) + 3}) {
            if (n > 4096 && copy != static_cast<int>(g)) continue;
            test::CompareAdam(mode, g, copy, 1.0f, n, MomentUpdate::kLerp, beta1);
          }
  // Past one grid's worth of threads (65536 blocks of 256): the grid-stride
  // loop's second pass, a few steps.
  test::CompareAdam(AdamMode::kAdamW, strata::DType::kF32, 0, 1.0f, size_t{65536} * 256 + 33,
                    MomentUpdate::kMulAdd, 0.9, 3);
  test::LaunchesAfterANotReadyQuery();
  test::CompareCasts();
  std::printf("%s: %d failures\n", test::g_failures ? "FAIL" : "ok", test::g_failures);
  return test::g_failures ? 1 : 0;
}

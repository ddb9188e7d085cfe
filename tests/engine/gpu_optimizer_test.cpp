// On a GPU: W, M, V homed on the device and updated there in place by the
// CUDA twins (strata.gpu_optimizer "auto") give bitwise the W, M, V and P of
// the CPU path — the same engine with "off" (device -> host staging -> CPU
// kernel -> back) and an engine without the GPU (force_no_gpu: the device
// tier a host arena) — for Adam, AdamW, Lion and Adagrad with bf16 compute,
// P homed on the device, the host or NVMe; also fp32 and fp16 compute, bf16 gradient
// accumulation and overlap_step; compact state (Adam, AdamW, Lion) with P on
// the device. Exits 77 ("skipped: no GPU (...)" on
// stderr) without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "tests/engine/tiny_mlp.h"
#include "tests/util/temp_dir.h"
#include "tiers/gpu.h"

namespace strata {
namespace {

using testing::TinyMlp;

struct Case {
  std::string optimizer = "adamw";
  std::string param = "none";  // offload_param.device: "none" (P on the device), "cpu" or "nvme"
  std::string dtype = "bf16";  // compute: bf16, fp16 or fp32
  std::string grad_accum = "fp32";
  std::string format = "fp32";  // strata.state_format
  bool overlap = false;
  std::string Name() const {
    return optimizer + " P:" + param + " " + dtype + " G:" + grad_accum + " " + format + (overlap ? " overlap" : "");
  }
};

// clang-format off
std::string Json(const Case& s, const std::string& gpu_optimizer, const std::string& dir) {
  return std::string("{") + (s.dtype == "fp32" ? "" : "\"" + s.dtype + "\": {\"enabled\": true},") + R"(
    "optimizer": {"type": ")" + s.optimizer + R"(", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "data_types": {"grad_accum_dtype": ")" + s.grad_accum + R"("},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"},
                          "offload_param": {"device": ")" + s.param + R"(", "nvme_path": ")" + dir + R"("}},
    "strata": {"device_budget": "256MiB", "host_budget": "256MiB", "gpu_optimizer": ")" + gpu_optimizer + R"(",
               "state_format": ")" + s.format + R"("}})";
}
// clang-format on

struct Run {
  bool ok = false;
  std::vector<std::vector<float>> w, m, v;
  std::vector<std::vector<uint8_t>> p;  // each group's fetched parameters (compute dtype)
  EngineStats stats;
};

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// Gradients that depend on the weights (so a wrong update shows in later
// steps) and on the step.
std::vector<float> GradsOf(const std::vector<float>& w, int step) {
  std::vector<float> g(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    const float x = static_cast<float>(i);
    g[i] = (w[i] - 0.05f * std::sin(x)) + 0.01f * std::cos(0.7f * x + static_cast<float>(step));
  }
  return g;
}

void TrainInto(const Case& s, const std::string& setting, bool gpu, Run* out) {
  testing::TempDir dir;
  EngineOptions eo;
  eo.force_no_gpu = !gpu;
  eo.overlap_step = s.overlap;
  auto config = ParseConfig(Json(s, setting, dir.path()));
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  auto e = Engine::Create(*config, eo);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& eng = **e;
  const TinyMlp model(3, 40);
  ASSERT_TRUE(model.Register(eng).ok());
  ASSERT_TRUE(eng.Build().ok());
  const int groups = eng.num_groups();
  void* dev = nullptr;
  if (gpu) {
    CUDA_OK(cudaMalloc(&dev, 1 << 20));
  }
  for (int t = 1; t <= 5; ++t) {
    StepOptions so;
    so.lr = 0.01 * (1.0 + 0.25 * t);  // changes every step
    std::vector<std::vector<float>> grads;
    for (int g = 0; g < groups; ++g) {  // before the step's first grads call
      std::vector<float> w(eng.group_numel(g));
      ASSERT_TRUE(eng.ReadMaster(g, w.data()).ok());
      grads.push_back(GradsOf(w, t));
    }
    if (s.overlap) {
      ASSERT_TRUE(eng.PrepareStep(so).ok());
    }
    for (int g = groups - 1; g >= 0; --g) {  // as backward does
      const std::vector<float>& h = grads[static_cast<size_t>(g)];
      const void* src = h.data();
      if (gpu) {  // the engine takes device pointers when its device tier is a GPU
        // From pageable memory cudaMemcpy may return before its DMA lands,
        // and the engine reads on its own (non-blocking) stream: Engine::Grads
        // takes gradients that are complete (engine.h), so wait for them.
        CUDA_OK(cudaMemcpy(dev, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaDeviceSynchronize());
        src = dev;
      }
      const Status st = eng.Grads(g, src, DType::kF32);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
    auto r = eng.Step(so);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_FALSE(r->skipped);
  }
  if (dev) {
    CUDA_OK(cudaFree(dev));
  }
  const bool adam = s.optimizer == "adam" || s.optimizer == "adamw";
  for (int g = 0; g < groups; ++g) {
    const uint64_t n = eng.group_numel(g);
    out->w.emplace_back(n);
    out->m.emplace_back(n);
    out->v.emplace_back(adam ? n : 0);
    ASSERT_TRUE(eng.ReadMaster(g, out->w.back().data()).ok());
    ASSERT_TRUE(eng.ReadState(g, Engine::OptimizerState::kExpAvg, out->m.back().data()).ok());
    if (adam) {
      ASSERT_TRUE(eng.ReadState(g, Engine::OptimizerState::kExpAvgSq, out->v.back().data()).ok());
    }
    auto p = eng.Fetch(g);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    out->p.emplace_back(n * DTypeSize(eng.compute_dtype()));
    if (gpu) {
      CUDA_OK(cudaMemcpy(out->p.back().data(), *p, out->p.back().size(), cudaMemcpyDeviceToHost));
    } else {
      std::memcpy(out->p.back().data(), *p, out->p.back().size());
    }
    ASSERT_TRUE(eng.Release(g).ok());
  }
  out->stats = eng.stats();
  out->ok = true;
}

Run Train(const Case& s, const std::string& setting, bool gpu) {
  Run r;
  TrainInto(s, setting, gpu, &r);
  return r;
}

void ExpectSame(const Run& a, const Run& b, const std::string& what) {
  ASSERT_TRUE(a.ok && b.ok) << what;
  ASSERT_EQ(a.w.size(), b.w.size()) << what;
  for (size_t g = 0; g < a.w.size(); ++g) {
    EXPECT_EQ(std::memcmp(a.w[g].data(), b.w[g].data(), a.w[g].size() * 4), 0)
        << what << ": W of group " << g;
    EXPECT_EQ(std::memcmp(a.m[g].data(), b.m[g].data(), a.m[g].size() * 4), 0)
        << what << ": M of group " << g;
    EXPECT_EQ(std::memcmp(a.v[g].data(), b.v[g].data(), a.v[g].size() * 4), 0)
        << what << ": V of group " << g;
    EXPECT_EQ(a.p[g], b.p[g]) << what << ": P of group " << g;
  }
}

// The three runs agree bit for bit, and "auto" moved no W, M, V to the host
// during the steps (only gradients and the final reads), unlike "off".
void CheckSetup(const Case& s) {
  const Run on_gpu = Train(s, "auto", true);
  const Run off = Train(s, "off", true);
  const Run host_arena = Train(s, "auto", false);
  ExpectSame(on_gpu, host_arena, s.Name() + ": GPU optimizer vs no GPU");
  ExpectSame(off, host_arena, s.Name() + ": CPU optimizer on the GPU's state vs no GPU");
  EXPECT_LT(on_gpu.stats.device_to_host, off.stats.device_to_host) << s.Name();
  EXPECT_LE(on_gpu.stats.device.peak, on_gpu.stats.device.budget) << s.Name();
  EXPECT_LE(on_gpu.stats.host.peak, on_gpu.stats.host.budget) << s.Name();
}

TEST(GpuOptimizer, EveryOptimizerBf16WithPOnTheDevice) {
  for (const char* o : {"adam", "adamw", "lion", "adagrad"}) {
    Case s;
    s.optimizer = o;
    CheckSetup(s);
  }
}

TEST(GpuOptimizer, EveryOptimizerBf16WithPOnTheHost) {
  for (const char* o : {"adam", "adamw", "lion", "adagrad"}) {
    Case s;
    s.optimizer = o;
    s.param = "cpu";
    CheckSetup(s);
  }
}

TEST(GpuOptimizer, AdamWAndLionBf16WithPOnNvme) {
  for (const char* o : {"adamw", "lion"}) {
    Case s;
    s.optimizer = o;
    s.param = "nvme";
    CheckSetup(s);
  }
}

TEST(GpuOptimizer, Fp32ComputeCopiesW) {
  for (const char* param : {"none", "cpu", "nvme"}) {
    Case s;
    s.dtype = "fp32";
    s.param = param;
    CheckSetup(s);
  }
}

TEST(GpuOptimizer, Fp16ComputeWritesAnF16Copy) {
  for (const char* param : {"none", "cpu"}) {
    Case s;
    s.dtype = "fp16";
    s.param = param;
    CheckSetup(s);
  }
}

TEST(GpuOptimizer, Bf16GradientAccumulation) {
  for (const char* o : {"adam", "lion"}) {
    Case s;
    s.optimizer = o;
    s.grad_accum = "bf16";
    CheckSetup(s);
  }
}

// Compact state with P homed on the device: P's slice, W, M, V updated in
// place by the compact CUDA twins, bitwise the CPU compact kernels.
TEST(GpuOptimizer, CompactStateWithPOnTheDevice) {
  for (const char* o : {"adam", "adamw", "lion"}) {
    Case s;
    s.optimizer = o;
    s.format = "compact";
    CheckSetup(s);
  }
  Case s;
  s.format = "compact";
  s.grad_accum = "bf16";
  s.overlap = true;
  CheckSetup(s);
}

TEST(GpuOptimizer, OverlappedStep) {
  Case s;
  s.overlap = true;
  CheckSetup(s);
  s.optimizer = "adagrad";
  s.param = "cpu";
  CheckSetup(s);
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  std::string why;
  if (strata::gpu::DeviceCount(&why) == 0) {
    std::fprintf(stderr, "skipped: no GPU (%s)\n", why.c_str());
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

// The engine over NCCL on one GPU (world size 1, a communicator given):
// gradients handed in as device pointers are cast and packed on the device,
// reduced by NCCL in small buckets on the communication thread
// (overlap_comm), and accumulated into G. After 5 steps the master weights
// are bitwise those of the same run on the CPU without a communicator, for
// fp32 and bf16 gradients at stages 0 and 2. Skipped (77) without NCCL in
// the build or without a GPU.
// Under strata-launch --nproc 2 (two GPUs; tools/gpu-check.sh), each rank
// trains on its own GPU (LOCAL_RANK) with gradients of its own, NCCL
// reducing them; rank 0 checks the weights against one CPU engine that
// takes both ranks' gradients as two accumulation calls (a sum of two is
// the same single rounding either way), bitwise.
// With `overlap` (overlap_step, gradient clipping that triggers on odd
// steps): each group is updated speculatively on the GPU rank as its NCCL
// reduction lands, committed or replayed at the step; bitwise the CPU
// engine without overlap.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "engine/engine.h"
#include "io/net/comm.h"
#include "io/net/launch_env.h"
#include "kernels/cpu/cast.h"
#if STRATA_HAVE_NCCL
#include <cuda_runtime.h>
#endif

using namespace strata;

#if STRATA_HAVE_NCCL
namespace {

int failures = 0;
bool Ok(const Status& s, const char* what) {
  if (s.ok()) return true;
  std::fprintf(stderr, "FAILED: %s: %s\n", what, s.ToString().c_str());
  ++failures;
  return false;
}
bool Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "FAILED: %s: %s\n", what, cudaGetErrorString(e));
  ++failures;
  return false;
}

const uint64_t kSizes[] = {5000, 777};

// Trains 5 steps; returns the master weights of every group, or empty.
// `ranks`: 0 for one rank; else this process is rank `rank` of 2 whose
// engine makes its own communicator (NCCL), or (ranks_on_cpu) the CPU
// reference taking both ranks' gradients.
std::vector<float> Train(int stage, DType gdtype, net::Communicator* comm, int rank = -1, bool both = false,
                         bool overlap = false) {
  const bool gpu = comm != nullptr || rank >= 0;
  const std::string cfg_text = R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
      "gradient_clipping": 1.0,
      "zero_optimization": {"stage": )" + std::to_string(stage) + R"(, "reduce_bucket_size": 1000,
                            "overlap_comm": true},
      "strata": {"device_budget": "256MiB", "host_budget": "256MiB"}})";
  auto cfg = ParseConfig(cfg_text);
  if (!Ok(cfg.status(), "config")) return {};
  EngineOptions eo;
  eo.world_size = rank >= 0 ? 0 : 1;  // 0: the launcher's ranks
  eo.comm = comm;
  eo.force_no_gpu = !gpu;
  eo.grad_accumulation_steps = both ? 2 : 1;
  eo.overlap_step = overlap;
  auto e = Engine::Create(*cfg, eo);
  if (!Ok(e.status(), gpu ? "create (nccl)" : "create (cpu)")) return {};
  Engine& eng = **e;
  for (int g = 0; g < 2; ++g) {
    std::vector<float> init(kSizes[g]);
    for (uint64_t i = 0; i < kSizes[g]; ++i) init[i] = 0.001f * static_cast<float>((i * 37 + g) % 101) - 0.05f;
    if (!Ok(eng.AddParam(g, "w" + std::to_string(g), kSizes[g], init.data()).status(), "add_param")) return {};
  }
  if (!Ok(eng.Build(), "build")) return {};
  void* dgrad = nullptr;
  if (gpu && !Cuda(cudaMalloc(&dgrad, 5000 * 4), "cudaMalloc")) return {};
  std::vector<float> p(5000), g32(5000);
  std::vector<char> g(5000 * 4);
  for (int s = 0; s < 5 && failures == 0; ++s) {
    StepOptions so;
    so.max_grad_norm = s % 2 ? 1e-3 : 1e6;  // clipping on odd steps: those replay
    if (overlap && !Ok(eng.PrepareStep(so), "prepare_step")) return {};
    for (int grp = 1; grp >= 0; --grp) {
      const uint64_t n = kSizes[grp];
      auto ptr = eng.Fetch(grp);
      if (!Ok(ptr.status(), "fetch")) return {};
      if (gpu) {
        if (!Cuda(cudaMemcpy(p.data(), *ptr, n * 4, cudaMemcpyDeviceToHost), "copy P")) return {};
      } else {
        std::memcpy(p.data(), *ptr, n * 4);
      }
      if (!Ok(eng.Release(grp), "release")) return {};
      for (int r = rank < 0 ? 0 : rank; r <= (both ? 1 : (rank < 0 ? 0 : rank)); ++r) {
        for (uint64_t i = 0; i < n; ++i)
          g32[i] = (0.5f + 0.25f * static_cast<float>(r)) * p[i] - 0.01f * static_cast<float>((i + s + r) % 13);
        if (!Ok(kernels::Cast(DType::kF32, g32.data(), gdtype, g.data(), n), "cast")) return {};
        const void* src = g.data();
        if (gpu) {
          // Engine::Grads takes complete gradients: a pageable cudaMemcpy may
          // return before its DMA lands.
          if (!Cuda(cudaMemcpy(dgrad, g.data(), n * DTypeSize(gdtype), cudaMemcpyHostToDevice), "copy grads") ||
              !Cuda(cudaDeviceSynchronize(), "sync grads"))
            return {};
          src = dgrad;
        }
        if (!Ok(eng.Grads(grp, src, gdtype), "grads")) return {};
      }
    }
    if (!Ok(eng.Step(so).status(), "step")) return {};
  }
  if (overlap) {
    const EngineStats st = eng.stats();
    if (st.committed_steps != 3 || st.replayed_steps != 2) {
      std::fprintf(stderr, "FAILED: overlap: %llu committed and %llu replayed steps; want 3 and 2\n",
                   static_cast<unsigned long long>(st.committed_steps), static_cast<unsigned long long>(st.replayed_steps));
      ++failures;
    }
  }
  if (dgrad) cudaFree(dgrad);
  std::vector<float> out;
  for (int grp = 0; grp < 2; ++grp) {
    std::vector<float> w(kSizes[grp]);
    if (!Ok(eng.ReadMaster(grp, w.data()), "read_master")) return {};
    out.insert(out.end(), w.begin(), w.end());
  }
  return out;
}

}  // namespace
#endif

int main() {
#if !STRATA_HAVE_NCCL
  std::fprintf(stderr, "skipped: this build has no NCCL\n");
  return 77;
#else
  if (!net::NcclAvailable()) {
    std::fprintf(stderr, "skipped: no GPU\n");
    return 77;
  }
  if (const char* ws = std::getenv("WORLD_SIZE"); ws && std::atoi(ws) > 1) {
    auto info = net::RankInfoFromEnv();
    if (!Ok(info.status(), "rank variables")) return 1;
    if (info->world_size != 2) {
      std::fprintf(stderr, "FAILED: run it on 2 ranks, not %d\n", info->world_size);
      return 1;
    }
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
      std::fprintf(stderr, "skipped: %d GPU(s); two ranks need two\n", gpus);
      return 77;
    }
    if (!Cuda(cudaSetDevice(info->local_rank), "cudaSetDevice")) return 1;
    const std::vector<float> mine = Train(2, DType::kBF16, nullptr, info->rank);
    if (info->rank == 0) {
      const std::vector<float> cpu = Train(2, DType::kBF16, nullptr, -1, /*both=*/true);
      const bool same = !mine.empty() && mine.size() == cpu.size() &&
                        std::memcmp(mine.data(), cpu.data(), mine.size() * 4) == 0;
      std::printf("%s: 2 GPUs, stage 2, NCCL == one CPU engine taking both ranks' gradients, bitwise\n",
                  same ? "ok" : "FAILED");
      if (!same) ++failures;
    }
    return failures ? 1 : 0;
  }
  net::CommOptions o;
  o.backend = "nccl";
  o.timeout_s = 60;
  auto comm = net::MakeCommunicator(o);
  if (!Ok(comm.status(), "nccl communicator")) return 1;
  for (int stage : {0, 2})
    for (DType dt : {DType::kF32, DType::kBF16}) {
      const std::vector<float> gpu = Train(stage, dt, comm->get());
      const std::vector<float> cpu = Train(stage, dt, nullptr);
      const bool same = !gpu.empty() && gpu.size() == cpu.size() &&
                        std::memcmp(gpu.data(), cpu.data(), gpu.size() * 4) == 0;
      std::printf("%s: stage %d, %s gradients: NCCL engine == CPU engine, bitwise\n", same ? "ok" : "FAILED", stage,
                  DTypeName(dt));
      if (!same) ++failures;
    }
  for (int stage : {0, 2}) {
    const std::vector<float> gpu = Train(stage, DType::kBF16, comm->get(), -1, false, /*overlap=*/true);
    const std::vector<float> cpu = Train(stage, DType::kBF16, nullptr);
    const bool same = !gpu.empty() && gpu.size() == cpu.size() &&
                      std::memcmp(gpu.data(), cpu.data(), gpu.size() * 4) == 0;
    std::printf("%s: stage %d, overlap_step with clipping on odd steps: NCCL engine == CPU engine, bitwise\n",
                same ? "ok" : "FAILED", stage);
    if (!same) ++failures;
  }
  std::printf("nccl engine: %d failures\n", failures);
  return failures ? 1 : 0;
#endif
}

// The optimizer on the GPU for W, M, V homed on the device: the choice (made
// once, at build), the device scratch it reserves there, and one group's
// update in place — G copied in, the CUDA twin of the CPU kernel, P written
// on the device or copied home. The pipeline around it is optimizer_driver.cpp.
#include "engine/step/gpu_update.h"

#include <algorithm>
#include <cstring>

#include "base/align.h"
#include "base/log.h"
#include "base/sizes.h"
#include "engine/engine_impl.h"
#include "engine/layout/staging_plan.h"
#include "engine/step/step_checks.h"
#include "kernels/cpu/step_scalars.h"
#include "tiers/gpu.h"
#if STRATA_HAVE_CUDA
#include "kernels/cuda/compact_cuda.h"
#include "kernels/cuda/optimizers_cuda.h"
#endif

namespace strata {

namespace {

#if STRATA_HAVE_CUDA
constexpr bool kCudaBuilt = true;
#else
constexpr bool kCudaBuilt = false;
#endif

constexpr uint64_t kDeviceGrain = 256;  // the device tier's allocation granularity

bool IsOptimizerState(int s) {
  return s == int(StateKind::kW) || s == int(StateKind::kM) || s == int(StateKind::kV);
}

}  // namespace

StepKernelOptions MakeStepKernelOptions(const std::string& type, bool adamw, const StepHyper& h, DType grad,
                                        DType copy) {
  StepKernelOptions o;
  o.type = type;
  kernels::AdamOptions& a = o.adam;
  a.lr = h.lr;
  a.beta1 = h.beta1;
  a.beta2 = h.beta2;
  a.eps = h.eps;
  a.weight_decay = h.weight_decay;
  a.step = h.step;
  a.mode = adamw ? kernels::AdamMode::kAdamW : kernels::AdamMode::kAdam;
  a.grad_scale = h.grad_scale;
  a.grad_dtype = grad;
  a.param_copy_dtype = copy;
  o.lion = kernels::LionOptions{h.lr, h.beta1, h.beta2, h.weight_decay, h.grad_scale, grad, copy};
  kernels::AdagradOptions& d = o.adagrad;
  d.lr = h.lr;
  d.weight_decay = h.weight_decay;
  d.eps = h.eps;
  d.step = h.step;
  d.grad_scale = h.grad_scale;
  d.grad_dtype = grad;
  d.param_copy_dtype = copy;
  return o;
}

Status ValidateStepKernelOptions(const StepKernelOptions& o) {
  if (o.type == "lion") return kernels::ValidateLionOptions(o.lion);
  if (o.type == "adagrad") return kernels::ValidateAdagradOptions(o.adagrad);
  return kernels::ValidateAdamOptions(o.adam);
}

GpuUpdateChoice ChooseGpuUpdate(const GpuUpdateFacts& f) {
  if (!f.device_on_gpu) return {false, "no GPU (the device tier is a host arena, updated in place)", false};
  for (int s = 0; s < kNumStates; ++s)
    if (IsOptimizerState(s) && f.used[static_cast<size_t>(s)] &&
        f.home[static_cast<size_t>(s)] != TierKind::kDevice)
      return {false, "the optimizer state is not homed on the device", false};
  if (f.setting == "off") return {false, "strata.gpu_optimizer is \"off\"", false};
  if (!f.cuda_built) return {false, "this build has no CUDA kernels", true};
  // Compact: P's slice is the master's bf16 half, a state the step rewrites;
  // the GPU updates it in place only (no staging of it through the scratch).
  if (f.compact && f.home[int(StateKind::kP)] != TierKind::kDevice)
    return {false,
            "compact state (strata.state_format \"compact\") is updated on the GPU only with P (the master's "
            "bf16 half) homed on the device too (offload_param \"none\")",
            true};
  if (f.compact && f.optimizer != "adam" && f.optimizer != "adamw" && f.optimizer != "lion")
    return {false, "optimizer.type \"" + f.optimizer + "\" has no compact CUDA kernel", true};
  if (f.optimizer != "adam" && f.optimizer != "adamw" && f.optimizer != "lion" && f.optimizer != "adagrad")
    return {false, "optimizer.type \"" + f.optimizer + "\" has no CUDA kernel", true};
  return {true, "", false};
}

bool OptimizerStateOnDevice(const std::array<StateBlock, kNumStates>& blocks) {
  bool any = false;
  for (int s = 0; s < kNumStates; ++s) {
    const StateBlock& b = blocks[static_cast<size_t>(s)];
    if (!IsOptimizerState(s) || b.alloc.charged == 0) continue;
    if (b.home != TierKind::kDevice) return false;
    any = true;
  }
  return any;
}

GpuScratchPlan PlanGpuScratch(uint64_t largest_shard_numel, DType grad, DType compute, bool p_on_device) {
  GpuScratchPlan p;
  p.g_bytes = largest_shard_numel * DTypeSize(grad);
  p.p_offset = AlignUp(p.g_bytes, kDeviceGrain);
  if (!p_on_device && compute != DType::kF32) p.p_bytes = largest_shard_numel * DTypeSize(compute);
  p.total = p.p_offset + AlignUp(p.p_bytes, kDeviceGrain);
  return p;
}

bool GpuScratchFits(uint64_t budget_left, const GpuScratchPlan& plan, uint64_t p_copy_reserve) {
  return plan.total > 0 && plan.total <= budget_left && p_copy_reserve <= budget_left - plan.total;
}

Status StepKernelCpu(const StepKernelOptions& o, uint64_t n, float* w, float* m, float* v, const void* g,
                     void* param_copy) {
  if (o.type == "lion") return kernels::LionStep(o.lion, n, w, m, g, param_copy);
  if (o.type == "adagrad") return kernels::AdagradStep(o.adagrad, n, w, m, g, param_copy);
  return kernels::AdamStep(o.adam, n, w, m, v, g, param_copy);
}

Status StepKernelCuda(const StepKernelOptions& o, uint64_t n, float* w, float* m, float* v, const void* g,
                      void* param_copy, void* stream) {
#if STRATA_HAVE_CUDA
  if (o.type == "lion") return kernels::LionStepCuda(o.lion, n, w, m, g, param_copy, stream);
  if (o.type == "adagrad") return kernels::AdagradStepCuda(o.adagrad, n, w, m, g, param_copy, stream);
  return kernels::AdamStepCuda(o.adam, n, w, m, v, g, param_copy, stream);
#else
  (void)o, (void)n, (void)w, (void)m, (void)v, (void)g, (void)param_copy, (void)stream;
  return UnsupportedError("the optimizer on the GPU: this build of Strata has no CUDA");
#endif
}

Status CompactStepKernelCpu(const StepKernelOptions& o, uint64_t n, const kernels::CompactState& s, const void* g) {
  if (o.type == "lion") return kernels::CompactLionStep(o.lion, n, s, g, nullptr);
  return kernels::CompactAdamStep(o.adam, n, s, g, nullptr);
}

Status CompactStepKernelCuda(const StepKernelOptions& o, uint64_t n, const kernels::CompactState& s, const void* g,
                             void* stream) {
#if STRATA_HAVE_CUDA
  if (o.type == "lion") return kernels::CompactLionStepCuda(o.lion, n, s, g, nullptr, stream);
  return kernels::CompactAdamStepCuda(o.adam, n, s, g, nullptr, stream);
#else
  (void)o, (void)n, (void)s, (void)g, (void)stream;
  return UnsupportedError("the compact optimizer on the GPU: this build of Strata has no CUDA");
#endif
}

Status DeviceCopyF32(const float* src, float* dst, uint64_t n, void* stream) {
#if STRATA_HAVE_CUDA
  return kernels::CastCuda(DType::kF32, src, DType::kF32, dst, n, stream);
#else
  (void)src, (void)dst, (void)n, (void)stream;
  return UnsupportedError("device copy: this build of Strata has no CUDA");
#endif
}

// At build, once the home blocks are allocated: the choice, logged once when
// a GPU holds the state and the CPU updates it anyway; then the scratch
// (from the device budget, never past it) and the kernels' stream.
void Engine::Impl::SetUpGpuUpdate() {
  GpuUpdateFacts f;
  f.setting = config_.strata.gpu_optimizer;
  const bool twin = options_.gpu_optimizer_twin && !device_->on_gpu();  // tests: the CPU stands in
  f.cuda_built = kCudaBuilt || twin;
  f.device_on_gpu = device_->on_gpu() || twin;
  f.compact = lay_.compact;
  f.optimizer = config_.optimizer.type;
  for (int s = 0; s < kNumStates; ++s) {
    f.home[static_cast<size_t>(s)] = lay_.home[s];
    f.used[static_cast<size_t>(s)] = lay_.StateUsed(s);
  }
  const GpuUpdateChoice c = ChooseGpuUpdate(f);
  if (!lay_.any_trainable()) return;  // every group frozen: the step updates nothing
  if (!c.gpu) {
    if (c.warn)
      WarnOnce("gpu-optimizer " + c.why, "step: W, M, V are on the GPU and updated on the CPU: " + c.why);
    return;
  }
  const bool p_on_device = lay_.home[int(StateKind::kP)] == TierKind::kDevice;
  // The groups the step updates (frozen ones never reach it).
  const GpuScratchPlan plan = PlanGpuScratch(lay_.LargestTrainable(false), lay_.gdtype, lay_.dtype, p_on_device);
  uint64_t reserve = 0;  // a fetch's device copy of the largest group, when P lives elsewhere
  for (int g = 0; !p_on_device && g < lay_.part.num_groups(); ++g)
    reserve = std::max(reserve, AlignUp(lay_.PBytes(g), kDeviceGrain));
  const uint64_t used = device_->used(), left = device_->budget() > used ? device_->budget() - used : 0;
  auto fall_back = [&](const std::string& why) {
    const std::string what =
        "step: W, M, V are on the GPU and updated on the CPU (copied to host staging and back): ";
    WarnOnce("gpu-optimizer-scratch", what + why);
  };
  if (!GpuScratchFits(left, plan, reserve)) {
    // Exact bytes too: a shortfall may be smaller than FormatBytes' rounding.
    auto bytes = [](uint64_t n) { return FormatBytes(n) + " (" + std::to_string(n) + " bytes)"; };
    fall_back("strata.device_budget " + FormatBytes(device_->budget()) + " leaves " + bytes(left) +
              " after the state homed there; the GPU update needs " + bytes(plan.total) +
              " of scratch (one shard's gradients" + (plan.p_bytes ? " and parameters" : "") + ")" +
              (reserve ? " beside " + bytes(reserve) + " for the largest group's parameters" : ""));
    return;
  }
  auto a = device_->Allocate(plan.total);
  if (!a.ok()) return fall_back("its scratch: " + a.status().ToString());
  Result<gpu::Stream> stream = gpu::Stream{nullptr};
  if (!twin) stream = gpu::StreamCreate();
  if (!stream.ok()) {
    device_->Free(*a);
    return fall_back("its stream: " + stream.status().ToString());
  }
  gpu_scratch_ = *a;
  gpu_scratch_plan_ = plan;
  gpu_stream_ = *stream;
  gpu_update_ = true;
}

void Engine::Impl::TearDownGpuUpdate() {
  if (gpu_scratch_.charged) device_->Free(gpu_scratch_);
  gpu_scratch_ = {};
  if (gpu_stream_) gpu::StreamDestroy(gpu_stream_).IgnoreError();  // fails only on a broken context
  gpu_stream_ = nullptr;
  gpu_update_ = false;
}

bool Engine::Impl::UpdatesOnGpu(int g) const {
  const auto& blocks = blocks_[static_cast<size_t>(g)];
  // Compact: P's slice (the bf16 half) is updated in place with W, M, V.
  return gpu_update_ && OptimizerStateOnDevice(blocks) &&
         (!lay_.compact || blocks[int(StateKind::kP)].home == TierKind::kDevice);
}

// W, M, V (and a device-homed P) are device pointers in `at`; G and any P
// homed elsewhere are host memory (in place, or a staging slot). Host waits
// order the streams: the kernels' stream is not the tier's copy streams.
Status Engine::Impl::UpdateOnGpu(int g, float* const at[kNumStates], const StepKernelOptions& ko,
                                 GpuUpdateOutcome* outcome) {
  *outcome = GpuUpdateOutcome::kUntouched;
  STRATA_RETURN_IF_ERROR(ValidateStepKernelOptions(ko));  // refused as the CPU kernel would: nothing changed
  const uint64_t len = lay_.part.group(g).shard_numel;
  char* scratch = static_cast<char*>(gpu_scratch_.ptr);
  const std::string where = "the optimizer on the GPU, group " + std::to_string(g);
  const uint64_t g_bytes = len * DTypeSize(lay_.gdtype);
  STRATA_ASSIGN_OR_RETURN(CopyTicket in, device_->CopyIn(scratch, at[int(StateKind::kG)], g_bytes));
  // The kernel reads the scratch on its own stream: the copy must have landed.
  STRATA_RETURN_IF_ERROR(in->Wait().WithContext(where + ": copying G in"));
  stats_->AddMoved(TierKind::kHost, TierKind::kDevice, g_bytes);

  if (lay_.compact) return UpdateCompactOnGpu(g, at, ko, outcome);
  const bool p_on_device = blocks_[static_cast<size_t>(g)][int(StateKind::kP)].home == TierKind::kDevice;
  const bool copy_f32 = lay_.dtype == DType::kF32;
  float* W = at[int(StateKind::kW)];
  char* p_dev = p_on_device ? reinterpret_cast<char*>(at[int(StateKind::kP)]) + lay_.PSliceOffset(g)
                            : scratch + gpu_scratch_plan_.p_offset;
  *outcome = GpuUpdateOutcome::kPartial;  // from the launch on, W, M, V may be neither old nor new
  float* M = at[int(StateKind::kM)];
  float* V = at[int(StateKind::kV)];
  void* copy = copy_f32 ? nullptr : p_dev;
  Status st;
  if (device_->on_gpu()) {
    st = StepKernelCuda(ko, len, W, M, V, scratch, copy, gpu_stream_);
    if (st.ok() && copy_f32 && p_on_device)
      st = DeviceCopyF32(W, reinterpret_cast<float*>(p_dev), len, gpu_stream_);
    // The kernels' own errors surface here; once it is OK, W, M, V are new.
    if (st.ok()) st = gpu::StreamSynchronize(gpu_stream_);
  } else {  // gpu_optimizer_twin: the host arena, the CPU kernels
    st = StepKernelCpu(ko, len, W, M, V, scratch, copy);
    if (st.ok() && copy_f32 && p_on_device) std::memcpy(p_dev, W, len * 4);
  }
  STRATA_RETURN_IF_ERROR(st.WithContext(where));
  *outcome = GpuUpdateOutcome::kUpdated;
  if (p_on_device) return Status::Ok();

  // P lives on the host (or NVMe, through the slot the caller then stores).
  const uint64_t p_bytes = len * DTypeSize(lay_.dtype);
  const void* p_src = copy_f32 ? static_cast<const void*>(W) : p_dev;
  char* p_host = reinterpret_cast<char*>(at[int(StateKind::kP)]) + lay_.PSliceOffset(g);
  STRATA_ASSIGN_OR_RETURN(CopyTicket out, device_->CopyOut(p_host, p_src, p_bytes));
  STRATA_RETURN_IF_ERROR(out->Wait().WithContext(where + ": copying P out"));
  stats_->AddMoved(TierKind::kDevice, TierKind::kHost, p_bytes);
  return Status::Ok();
}

// Compact, G in the scratch already: P's slice, W, M, V are all homed on the
// device (UpdatesOnGpu) and updated there in place; nothing goes home after.
Status Engine::Impl::UpdateCompactOnGpu(int g, float* const at[kNumStates], const StepKernelOptions& ko,
                                        GpuUpdateOutcome* outcome) {
  const uint64_t len = lay_.part.group(g).shard_numel;
  const kernels::CompactState cs =
      CompactAt(g, at[int(StateKind::kP)], at[int(StateKind::kW)], at[int(StateKind::kM)], at[int(StateKind::kV)]);
  *outcome = GpuUpdateOutcome::kPartial;  // from the launch on, P's slice, W, M, V may be neither old nor new
  Status st;
  if (device_->on_gpu()) {
    st = CompactStepKernelCuda(ko, len, cs, gpu_scratch_.ptr, gpu_stream_);
    // The kernel's own errors surface here; once it is OK, the state is new.
    if (st.ok()) st = gpu::StreamSynchronize(gpu_stream_);
  } else {  // gpu_optimizer_twin: the host arena, the CPU compact kernels
    st = CompactStepKernelCpu(ko, len, cs, gpu_scratch_.ptr);
  }
  STRATA_RETURN_IF_ERROR(st.WithContext("the compact optimizer on the GPU, group " + std::to_string(g)));
  *outcome = GpuUpdateOutcome::kUpdated;
  return Status::Ok();
}

}  // namespace strata

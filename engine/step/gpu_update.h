// The optimizer on the GPU for state homed on the device: which groups the
// step updates there (in place, by the CUDA twins of the CPU kernels, bitwise
// the same), the device scratch it needs, and the step's kernel options that
// both devices share. The decisions are plain functions of facts, so that
// machines without a GPU test them. Internal to engine/.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "engine/layout/block_io.h"
#include "kernels/cpu/adagrad.h"
#include "kernels/cpu/adam.h"
#include "kernels/cpu/compact.h"
#include "kernels/cpu/lion.h"

namespace strata {

// Whether the CUDA kernels are linked (STRATA_HAVE_CUDA), and the device
// tier's allocation granularity (the scratch's offsets and sizes).
#if STRATA_HAVE_CUDA
inline constexpr bool kCudaBuilt = true;
#else
inline constexpr bool kCudaBuilt = false;
#endif
inline constexpr uint64_t kDeviceGrain = 256;

// One step's options for each optimizer's kernel, built once per step and
// given to the CPU kernels and their CUDA twins alike.
struct StepKernelOptions {
  std::string type;  // optimizer.type: adam, adamw, lion, adagrad
  kernels::AdamOptions adam;
  kernels::LionOptions lion;
  kernels::AdagradOptions adagrad;
};
struct StepHyper {
  double lr, beta1, beta2, eps, weight_decay, grad_scale;
  int64_t step;
};
// optimizer.params.moment_update as the kernels' option (the step sets
// StepKernelOptions::adam.moment_update from it, for the CPU and GPU updates
// alike). The config has refused any other name; one that got past it anyway
// maps to a value that ValidateAdamOptions refuses, never to a silent default.
inline kernels::MomentUpdate MomentUpdateOf(const std::string& name) {
  const Result<kernels::MomentUpdate> u = kernels::ParseMomentUpdate(name);
  return u.ok() ? u.value() : static_cast<kernels::MomentUpdate>(0xff);
}
// `adamw`: decoupled weight decay (type adamw, or adam with adam_w_mode);
// `copy`: the dtype of the parameter copy the kernels write (bf16 or f16).
StepKernelOptions MakeStepKernelOptions(const std::string& type, bool adamw, const StepHyper& h, DType grad,
                                        DType copy);

// The kernel's own refusal of `o` (kernels/cpu/step_scalars.h), asked before
// anything is launched: a bad option must leave the state untouched.
Status ValidateStepKernelOptions(const StepKernelOptions& o);

// What decides, for the whole engine, whether device-homed state may be
// updated on the GPU.
struct GpuUpdateFacts {
  std::string setting;         // strata.gpu_optimizer: "auto" or "off"
  bool cuda_built = false;     // the CUDA kernels are linked (STRATA_HAVE_CUDA)
  bool device_on_gpu = false;  // the device tier is a GPU, not a host arena
  bool compact = false;        // strata.state_format "compact"
  std::string optimizer;       // optimizer.type
  std::array<TierKind, kNumStates> home{};
  std::array<bool, kNumStates> used{};  // the states the optimizer keeps
};
struct GpuUpdateChoice {
  bool gpu = false;
  // When !gpu: why the CPU updates the state, and whether that is worth a
  // warning (a GPU holds the state and could have updated it).
  std::string why;
  bool warn = false;
};
GpuUpdateChoice ChooseGpuUpdate(const GpuUpdateFacts& f);

// Whether a group's W, M, V (those it keeps, by alloc.charged) are all
// homed on the device tier: the group the step updates on the GPU.
bool OptimizerStateOnDevice(const std::array<StateBlock, kNumStates>& blocks);

// The device scratch of the GPU update: one shard's G (its home is the host
// or NVMe) and, when P is not homed on the device and the compute dtype is
// bf16/fp16, the shard's new P before it is copied home (fp32 P is copied
// from W). Offsets and sizes at the device tier's 256-byte granularity.
struct GpuScratchPlan {
  uint64_t g_bytes = 0;
  uint64_t p_offset = 0, p_bytes = 0;  // p_bytes 0: none
  uint64_t total = 0;
};
GpuScratchPlan PlanGpuScratch(uint64_t largest_shard_numel, DType grad, DType compute, bool p_on_device);
// Whether the scratch fits in `budget_left` (device budget minus what the
// home blocks took) while keeping `p_copy_reserve` free: the largest group's
// device copy of P, which a fetch needs when P is not homed on the device.
bool GpuScratchFits(uint64_t budget_left, const GpuScratchPlan& plan, uint64_t p_copy_reserve);

// The CPU kernel of `o.type` (W, M, V fp32; M is Lion's exp_avg or
// Adagrad's state_sum; V null unless Adam), param_copy null or n of the copy
// dtype, in place, in parallel.
Status StepKernelCpu(const StepKernelOptions& o, uint64_t n, float* w, float* m, float* v, const void* g,
                     void* param_copy);
// The CUDA kernel of `o.type` on device pointers, enqueued on `stream`
// (param_copy: null or n of the copy dtype). UNSUPPORTED in a build without
// CUDA. Returns after the launch; the caller synchronizes the stream.
Status StepKernelCuda(const StepKernelOptions& o, uint64_t n, float* w, float* m, float* v, const void* g,
                      void* param_copy, void* stream);
// The compact kernels of `o.type` (lion, else Adam/AdamW; kernels/cpu/compact.h)
// over the arrays of `s` (P's slice is s.w_hi: no copy-out), in place: on
// the CPU in parallel, or their CUDA twins on device pointers enqueued on
// `stream` (UNSUPPORTED in a build without CUDA; the caller synchronizes).
Status CompactStepKernelCpu(const StepKernelOptions& o, uint64_t n, const kernels::CompactState& s, const void* g);
Status CompactStepKernelCuda(const StepKernelOptions& o, uint64_t n, const kernels::CompactState& s, const void* g,
                             void* stream);
// f32 -> f32 copy of n floats between device pointers, on `stream`.
Status DeviceCopyF32(const float* src, float* dst, uint64_t n, void* stream);

}  // namespace strata

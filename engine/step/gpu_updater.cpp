// GpuUpdater (gpu_updater.h): the choice at build, the scratch, and one
// group's update on the GPU. The pipeline around it is pipeline.cpp.
#include "engine/step/gpu_updater.h"

#include <algorithm>
#include <cstring>

#include "base/align.h"
#include "base/log.h"
#include "base/sizes.h"

namespace strata {


// At build, once the home blocks are allocated: the choice, logged once when
// a GPU holds the state and the CPU updates it anyway; then the scratch
// (from the device budget, never past it) and the kernels' stream.
void GpuUpdater::SetUp() {
  GpuUpdateFacts f;
  f.setting = layout_.config->strata.gpu_optimizer;
  const bool twin = twin_ && !device_.on_gpu();  // tests: the CPU stands in
  f.cuda_built = kCudaBuilt || twin;
  f.device_on_gpu = device_.on_gpu() || twin;
  f.compact = layout_.compact;
  f.optimizer = layout_.config->optimizer.type;
  for (int s = 0; s < kNumStates; ++s) {
    f.home[static_cast<size_t>(s)] = layout_.home[s];
    f.used[static_cast<size_t>(s)] = layout_.StateUsed(s);
  }
  const GpuUpdateChoice c = ChooseGpuUpdate(f);
  if (!layout_.any_trainable()) return;  // every group frozen: the step updates nothing
  if (!c.gpu) {
    if (c.warn)
      WarnOnce("gpu-optimizer " + c.why, "step: W, M, V are on the GPU and updated on the CPU: " + c.why);
    return;
  }
  const bool p_on_device = layout_.home[int(StateKind::kP)] == TierKind::kDevice;
  // The groups the step updates (frozen ones never reach it).
  const GpuScratchPlan plan = PlanGpuScratch(layout_.LargestTrainable(Layout::Size::kShard), layout_.gdtype, layout_.dtype, p_on_device);
  uint64_t reserve = 0;  // a fetch's device copy of the largest group, when P lives elsewhere
  for (int g = 0; !p_on_device && g < layout_.part.num_groups(); ++g)
    reserve = std::max(reserve, AlignUp(layout_.PBytes(g), kDeviceGrain));
  const uint64_t used = device_.used(), left = device_.budget() > used ? device_.budget() - used : 0;
  auto fall_back = [&](const std::string& why) {
    const std::string what =
        "step: W, M, V are on the GPU and updated on the CPU (copied to host staging and back): ";
    WarnOnce("gpu-optimizer-scratch", what + why);
  };
  if (!GpuScratchFits(left, plan, reserve)) {
    // Exact bytes too: a shortfall may be smaller than FormatBytes' rounding.
    auto bytes = [](uint64_t n) { return FormatBytes(n) + " (" + std::to_string(n) + " bytes)"; };
    fall_back("strata.device_budget " + FormatBytes(device_.budget()) + " leaves " + bytes(left) +
              " after the state homed there; the GPU update needs " + bytes(plan.total) +
              " of scratch (one shard's gradients" + (plan.p_bytes ? " and parameters" : "") + ")" +
              (reserve ? " beside " + bytes(reserve) + " for the largest group's parameters" : ""));
    return;
  }
  auto a = device_.Allocate(plan.total);
  if (!a.ok()) return fall_back("its scratch: " + a.status().ToString());
  Result<gpu::Stream> stream = gpu::Stream{nullptr};
  if (!twin) stream = gpu::StreamCreate();
  if (!stream.ok()) {
    device_.Free(*a);
    return fall_back("its stream: " + stream.status().ToString());
  }
  scratch_ = *a;
  plan_ = plan;
  stream_ = *stream;
  on_ = true;
}

void GpuUpdater::TearDown() {
  if (scratch_.charged) device_.Free(scratch_);
  scratch_ = {};
  if (stream_) gpu::StreamDestroy(stream_).IgnoreError();  // fails only on a broken context
  stream_ = nullptr;
  on_ = false;
}

bool GpuUpdater::UpdatesOnGpu(int g) const {
  const auto& blocks = blocks_[static_cast<size_t>(g)];
  // Compact: P's slice (the bf16 half) is updated in place with W, M, V.
  return on_ && OptimizerStateOnDevice(blocks) &&
         (!layout_.compact || blocks[int(StateKind::kP)].home == TierKind::kDevice);
}

// W, M, V (and a device-homed P) are device pointers in `at`; G and any P
// homed elsewhere are host memory (in place, or a staging slot). Host waits
// order the streams: the kernels' stream is not the tier's copy streams.
Status GpuUpdater::Update(int g, float* const at[kNumStates], const StepKernelOptions& ko,
                          GpuUpdateOutcome* outcome) {
  *outcome = GpuUpdateOutcome::kUntouched;
  STRATA_RETURN_IF_ERROR(ValidateStepKernelOptions(ko));  // refused as the CPU kernel would: nothing changed
  const uint64_t len = layout_.part.group(g).shard_numel;
  char* scratch = static_cast<char*>(scratch_.ptr);
  const std::string where = "the optimizer on the GPU, group " + std::to_string(g);
  const uint64_t g_bytes = len * DTypeSize(layout_.gdtype);
  STRATA_ASSIGN_OR_RETURN(CopyTicket in, device_.CopyIn(scratch, at[int(StateKind::kG)], g_bytes));
  // The kernel reads the scratch on its own stream: the copy must have landed.
  STRATA_RETURN_IF_ERROR(in->Wait().WithContext(where + ": copying G in"));
  stats_.AddMoved(TierKind::kHost, TierKind::kDevice, g_bytes);

  if (layout_.compact) return UpdateCompact(g, at, ko, outcome);
  const bool p_on_device = blocks_[static_cast<size_t>(g)][int(StateKind::kP)].home == TierKind::kDevice;
  const bool copy_f32 = layout_.dtype == DType::kF32;
  float* W = at[int(StateKind::kW)];
  char* p_dev = p_on_device ? reinterpret_cast<char*>(at[int(StateKind::kP)]) + layout_.PSliceOffset(g)
                            : scratch + plan_.p_offset;
  *outcome = GpuUpdateOutcome::kPartial;  // from the launch on, W, M, V may be neither old nor new
  float* M = at[int(StateKind::kM)];
  float* V = at[int(StateKind::kV)];
  void* copy = copy_f32 ? nullptr : p_dev;
  Status st;
  if (device_.on_gpu()) {
    st = StepKernelCuda(ko, len, W, M, V, scratch, copy, stream_);
    if (st.ok() && copy_f32 && p_on_device)
      st = DeviceCopyF32(W, reinterpret_cast<float*>(p_dev), len, stream_);
    // The kernels' own errors surface here; once it is OK, W, M, V are new.
    // On an error the stream is waited for all the same: a kernel that did
    // launch still reads the scratch and writes W, M, V, which a load (on
    // the tier's copy stream) or the scratch's next user must not meet.
    Status drained = gpu::StreamSynchronize(stream_);
    if (st.ok()) st = drained;
  } else {  // gpu_optimizer_twin: the host arena, the CPU kernels
    st = StepKernelCpu(ko, len, W, M, V, scratch, copy);
    if (st.ok() && copy_f32 && p_on_device) std::memcpy(p_dev, W, len * 4);
  }
  STRATA_RETURN_IF_ERROR(st.WithContext(where));
  *outcome = GpuUpdateOutcome::kUpdated;
  if (p_on_device) return Status::Ok();

  // P lives on the host (or NVMe, through the slot the caller then stores).
  const uint64_t p_bytes = len * DTypeSize(layout_.dtype);
  const void* p_src = copy_f32 ? static_cast<const void*>(W) : p_dev;
  char* p_host = reinterpret_cast<char*>(at[int(StateKind::kP)]) + layout_.PSliceOffset(g);
  STRATA_ASSIGN_OR_RETURN(CopyTicket out, device_.CopyOut(p_host, p_src, p_bytes));
  STRATA_RETURN_IF_ERROR(out->Wait().WithContext(where + ": copying P out"));
  stats_.AddMoved(TierKind::kDevice, TierKind::kHost, p_bytes);
  return Status::Ok();
}

// Compact, G in the scratch already: P's slice, W, M, V are all homed on the
// device (UpdatesOnGpu) and updated there in place; nothing goes home after.
Status GpuUpdater::UpdateCompact(int g, float* const at[kNumStates], const StepKernelOptions& ko,
                                 GpuUpdateOutcome* outcome) {
  const uint64_t len = layout_.part.group(g).shard_numel;
  const kernels::CompactState cs =
      shards_.CompactAt(g, at[int(StateKind::kP)], at[int(StateKind::kW)], at[int(StateKind::kM)], at[int(StateKind::kV)]);
  *outcome = GpuUpdateOutcome::kPartial;  // from the launch on, P's slice, W, M, V may be neither old nor new
  Status st;
  if (device_.on_gpu()) {
    st = CompactStepKernelCuda(ko, len, cs, scratch_.ptr, stream_);
    // The kernel's own errors surface here; once it is OK, the state is new.
    // Waited for on an error too (see Update).
    Status drained = gpu::StreamSynchronize(stream_);
    if (st.ok()) st = drained;
  } else {  // gpu_optimizer_twin: the host arena, the CPU compact kernels
    st = CompactStepKernelCpu(ko, len, cs, scratch_.ptr);
  }
  STRATA_RETURN_IF_ERROR(st.WithContext("the compact optimizer on the GPU, group " + std::to_string(g)));
  *outcome = GpuUpdateOutcome::kUpdated;
  return Status::Ok();
}

}  // namespace strata

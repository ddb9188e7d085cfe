// strata-train's GPU model: the CUDA layers (kernels/cuda/layers) over the
// groups the engine fetches to the device in its compute dtype, gradients
// handed back as fp32 device pointers, everything on one stream. Activations
// (each block's input, kept for the recomputing backward) stay on the device,
// outside the engine's device budget, which governs parameters and state.
#pragma once

#include <memory>
#include <string>

#include "kernels/cpu/layers/gpt_config.h"
#include "tools/train/gpt.h"

namespace strata::train {

// "" when a GPU can be used; otherwise why not (a build without CUDA,
// cudaGetDeviceCount failing — e.g. "driver version is insufficient" — or
// finding none).
std::string GpuUnavailableReason();

// The GPU model for batches of B x T tokens; device memory is taken at the
// first step (the compute dtype is the engine's).
std::unique_ptr<GptModel> MakeGptCuda(const layers::GptConfig& cfg, int B, int T);

}  // namespace strata::train

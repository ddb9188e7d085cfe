// Softmax cross-entropy over the vocabulary on the GPU, fused with its
// gradient: the CPU layer's contract (kernels/cpu/layers/cross_entropy.h) on
// device pointers, with the exponentials summed in fp32 (the CPU uses fp64).
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/status.h"
#include "kernels/cuda/layers/context.h"

namespace strata::layers {

// losses[r] = logsumexp(logits[r]) - logits[r][targets[r]] for each row r of
// logits (N, V). When dlogits (N, V) is not null it is set (=) to
// (softmax(logits[r]) - onehot(target)) · dloss; it may equal logits.
// REQUIRES: targets in [0, V), checked by the caller on the host; a row whose
// target is out of range gets a NaN loss (and NaN gradients).
Status CrossEntropyForwardBackwardCuda(const CudaLayerContext& ctx, float* losses, float* dlogits,
                                       const float* logits, const int32_t* targets, size_t N, size_t V,
                                       float dloss);

}  // namespace strata::layers

// Softmax cross-entropy over the vocabulary, fused with its gradient.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::layers {

// For each row r of logits (N, V) with target targets[r] in [0, V):
// losses[r] = logsumexp(logits[r]) - logits[r][target]. When dlogits (N, V) is
// not null it is set (=, not +=) to (softmax(logits[r]) - onehot(target)) · dloss,
// the gradient of dloss · Σ losses; dlogits may equal logits (in place).
// Exponentials are summed in fp64. A target out of range aborts.
void CrossEntropyForwardBackward(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                                 size_t N, size_t V, float dloss);

}  // namespace strata::layers

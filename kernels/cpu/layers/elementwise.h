// Element-wise layers: GELU (tanh approximation, as GPT-2) and the residual add.
#pragma once

#include <cstddef>

namespace strata::layers {

// out (n) = 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))). out may equal inp.
void GeluForward(float* out, const float* inp, size_t n);
// Accumulates (+=): dinp (n) += gelu'(inp) · dout. dinp must not overlap dout.
void GeluBackward(float* dinp, const float* inp, const float* dout, size_t n);

// out (n) = a + b. out may equal a or b.
void ResidualForward(float* out, const float* a, const float* b, size_t n);
// Accumulates (+=): da += dout, db += dout. da or db may be null.
void ResidualBackward(float* da, float* db, const float* dout, size_t n);

}  // namespace strata::layers

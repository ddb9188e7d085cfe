// Linear layer on the CPU: out = inp · Wᵀ + b with W stored (OC, C) row-major
// (PyTorch's nn.Linear layout), through OpenBLAS's cblas_sgemm.
//
// Determinism: OpenBLAS is set to one thread (process-wide, openblas_set_num_threads(1)
// at the first call; parallelism comes from oneTBB instead) and each sgemm
// covers a fixed tile of output rows, so every output is computed by the same
// sgemm call with the same arguments whatever the thread count.
#pragma once

#include <cstddef>

namespace strata::layers {

// out (N, OC) = inp (N, C) · weight (OC, C)ᵀ + bias (OC). bias may be null.
// N is B*T. out must not overlap inp.
void MatmulForward(float* out, const float* inp, const float* weight, const float* bias, size_t N, size_t C,
                   size_t OC);

// Accumulates (+=): dinp (N, C) += dout (N, OC) · weight (OC, C);
// dweight (OC, C) += doutᵀ · inp; dbias (OC) += Σ_rows dout (rows in order).
// dinp and dbias may be null (not wanted).
void MatmulBackward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                    const float* weight, size_t N, size_t C, size_t OC);

// Sets OpenBLAS to one thread if not done yet. Every matmul calls it; exposed
// for tests that call cblas directly.
void PinBlasToOneThread();

}  // namespace strata::layers

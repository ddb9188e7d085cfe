// Private to the CUDA layers: parameter gradients that sum over every row —
// LayerNorm's weight and bias, a linear layer's bias — without atomics, so
// that they come out bitwise the same run after run. Rows are cut into a fixed
// number of chunks (it depends on N alone); one pass sums each chunk's rows in
// order, a second adds the chunks' sums in order.
#pragma once

#include <cstddef>

#include "base/status.h"
#include "kernels/cuda/layers/context.h"

namespace strata::layers::cuda_detail {

size_t ColumnGradScratchBytes(size_t C);

// Accumulates (+=) over rows r of dout (N, C):
//   dweight[c] += Σ_r (inp[r, c] - mean[r]) · rstd[r] · dout[r, c]   (LayerNorm weight)
//   dbias[c]   += Σ_r dout[r, c]
// With inp null only dbias (dweight, mean, rstd unused): a linear layer's bias.
Status ColumnGrads(const CudaLayerContext& ctx, float* dweight, float* dbias, const float* dout,
                   const float* inp, const float* mean, const float* rstd, size_t N, size_t C,
                   CudaScratch scratch);

}  // namespace strata::layers::cuda_detail

// Private to the CUDA layers: launch shapes and warp reductions.
//
// Element-wise kernels loop grid-stride over size_t indices, so any size fits
// in a grid capped at kMaxBlocks. Row-wise kernels give each row one warp
// (kWarpsPerBlock rows per block) and loop grid-stride over rows the same way;
// the loop condition is the same for all 32 lanes of a warp, so the full-mask
// shuffles below always see the whole warp.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace strata::layers::cuda_detail {

inline constexpr int kThreads = 256;  // threads per block of element-wise and row-wise kernels
inline constexpr int kWarpsPerBlock = kThreads / 32;
inline constexpr size_t kMaxBlocks = 65535;  // any grid.x up to 2^31-1 is legal; more only adds blocks

// Blocks for `n` items at `per_block` items a block, at most kMaxBlocks (>= 1).
inline unsigned BlocksFor(size_t n, size_t per_block) {
  const size_t blocks = (n + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks));
}

__device__ __forceinline__ size_t GlobalThread() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t GridThreads() { return static_cast<size_t>(gridDim.x) * blockDim.x; }

// The first row of this warp and the stride between a warp's rows.
__device__ __forceinline__ size_t WarpRow() {
  return static_cast<size_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
}
__device__ __forceinline__ size_t WarpRowStride() {
  return static_cast<size_t>(gridDim.x) * (blockDim.x / 32);
}
__device__ __forceinline__ unsigned Lane() { return threadIdx.x % 32; }

// Butterfly reductions: every lane ends with the result of all 32.
__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

}  // namespace strata::layers::cuda_detail

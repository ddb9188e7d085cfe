// Column sums in two passes (chunk partials, then chunks in order).
#include <string>

#include "kernels/cuda/layers/column_grads.h"
#include "kernels/cuda/layers/launch.cuh"
#include "kernels/cuda/layers/status_cuda.h"

namespace strata::layers::cuda_detail {
namespace {

constexpr size_t kMaxChunks = 64;  // row chunks: blockIdx.y of the partial pass
constexpr int kColumns = 32;       // columns per block: one warp wide, so loads coalesce
constexpr int kRowLanes = 8;       // threads down the rows of each column

// Chunks for N rows: one per 32 rows up to kMaxChunks (rows per chunk = ceil(N / chunks)).
size_t ChunksFor(size_t N) {
  const size_t chunks = (N + 31) / 32;
  return chunks == 0 ? 1 : (chunks < kMaxChunks ? chunks : kMaxChunks);
}

// Block (kColumns, kRowLanes), grid (column tiles, chunks). Thread (x, y) sums
// rows y, y + kRowLanes, ... of its chunk in column c; the kRowLanes partials
// are then added in order of y. partial_w, partial_b: (chunks, C).
__global__ void ColumnPartialsKernel(float* partial_w, float* partial_b, const float* dout, const float* inp,
                                     const float* mean, const float* rstd, size_t N, size_t C,
                                     size_t rows_per_chunk) {
  __shared__ float sum_w[kRowLanes][kColumns];
  __shared__ float sum_b[kRowLanes][kColumns];
  const size_t c = static_cast<size_t>(blockIdx.x) * kColumns + threadIdx.x;
  const size_t chunk = blockIdx.y;
  const size_t r0 = chunk * rows_per_chunk;
  const size_t r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
  float w = 0.0f, b = 0.0f;
  if (c < C) {
    for (size_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      const float dy = dout[r * C + c];
      b += dy;
      if (inp != nullptr) w += (inp[r * C + c] - mean[r]) * rstd[r] * dy;
    }
  }
  sum_w[threadIdx.y][threadIdx.x] = w;
  sum_b[threadIdx.y][threadIdx.x] = b;
  __syncthreads();  // every row lane's partial is in shared memory before row lane 0 adds them
  if (threadIdx.y != 0 || c >= C) return;
  float tw = 0.0f, tb = 0.0f;
  for (int y = 0; y < kRowLanes; ++y) {
    tw += sum_w[y][threadIdx.x];
    tb += sum_b[y][threadIdx.x];
  }
  partial_b[chunk * C + c] = tb;
  if (inp != nullptr) partial_w[chunk * C + c] = tw;
}

// dweight[c] += Σ_chunk partial_w[chunk, c], dbias likewise, chunks in order.
__global__ void ColumnFinishKernel(float* dweight, float* dbias, const float* partial_w,
                                   const float* partial_b, size_t chunks, size_t C) {
  for (size_t c = GlobalThread(); c < C; c += GridThreads()) {
    float tw = 0.0f, tb = 0.0f;
    for (size_t k = 0; k < chunks; ++k) {
      tb += partial_b[k * C + c];
      if (dweight != nullptr) tw += partial_w[k * C + c];
    }
    dbias[c] += tb;
    if (dweight != nullptr) dweight[c] += tw;
  }
}

}  // namespace

size_t ColumnGradScratchBytes(size_t C) { return AlignScratch(2 * kMaxChunks * C * sizeof(float)); }

Status ColumnGrads(const CudaLayerContext& ctx, float* dweight, float* dbias, const float* dout,
                   const float* inp, const float* mean, const float* rstd, size_t N, size_t C,
                   CudaScratch scratch) {
  if (N == 0 || C == 0) return Status::Ok();
  if (scratch.bytes < ColumnGradScratchBytes(C))
    return InvalidError("ColumnGrads: scratch of " + std::to_string(scratch.bytes) + " bytes, needs " +
                        std::to_string(ColumnGradScratchBytes(C)));
  const size_t tiles = (C + kColumns - 1) / kColumns;
  if (tiles > 0x7fffffffu)
    return InvalidError("ColumnGrads: C " + std::to_string(C) + " too large for one grid");
  const size_t chunks = ChunksFor(N);
  const size_t rows_per_chunk = (N + chunks - 1) / chunks;
  float* partial_w = static_cast<float*>(scratch.ptr);
  float* partial_b = partial_w + kMaxChunks * C;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(chunks));
  const dim3 block(kColumns, kRowLanes);
  ColumnPartialsKernel<<<grid, block, 0, ctx.stream>>>(partial_w, partial_b, dout, inp, mean, rstd, N, C,
                                                       rows_per_chunk);
  STRATA_LAUNCH_OK("ColumnPartialsKernel");
  ColumnFinishKernel<<<BlocksFor(C, kThreads), kThreads, 0, ctx.stream>>>(
      inp != nullptr ? dweight : nullptr, dbias, partial_w, partial_b, chunks, C);
  STRATA_LAUNCH_OK("ColumnFinishKernel");
  return Status::Ok();
}

}  // namespace strata::layers::cuda_detail

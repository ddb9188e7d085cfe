// Attention as: split qkv into per-head q, k, v (B, NH, T, hs); scores
// q·kᵀ·scale by a batched GEMM into att; causal softmax in place; y = att·v by
// a batched GEMM; merge heads into out. The backward runs the same GEMMs on
// the gradients (datt = dy·vᵀ, dv = attᵀ·dy, softmax backward in place,
// dq = dpre·k, dk = dpreᵀ·q) and adds dq, dk, dv into dqkv.
//
// Per head, row-major (T, hs) is column-major hs x T (x' below), and
// row-major att (T, T) is column-major att' = attᵀ:
//   att'  = k'ᵀ · q'      att[t][t2] = q_t · k_t2        (scaled by alpha)
//   y'    = v' · att'     y = att · v
//   dv'   = dy' · att'ᵀ   dv = attᵀ · dy
#include <cmath>
#include <string>

#include "kernels/cuda/layers/attention.h"
#include "kernels/cuda/layers/gemm.h"
#include "kernels/cuda/layers/launch.cuh"
#include "kernels/cuda/layers/status_cuda.h"

namespace strata::layers {
namespace {

using cuda_detail::BlocksFor;
using cuda_detail::GemmShape;
using cuda_detail::GlobalThread;
using cuda_detail::GridThreads;
using cuda_detail::kThreads;
using cuda_detail::kWarpsPerBlock;
using cuda_detail::Lane;
using cuda_detail::WarpMax;
using cuda_detail::WarpRow;
using cuda_detail::WarpRowStride;
using cuda_detail::WarpSum;

struct Dims {
  size_t B, T, C, NH, hs;
  size_t heads() const { return B * NH; }
  size_t elems() const { return B * T * C; }  // of one (B, NH, T, hs) tensor
};

// Element i of a (B, NH, T, hs) tensor sits in row b·T + t, column h·hs + e
// of the (B, T, ·) tensors.
struct RowCol {
  size_t row, col;
};
__device__ __forceinline__ RowCol HeadElement(size_t i, size_t T, size_t NH, size_t hs) {
  const size_t e = i % hs, t = (i / hs) % T, h = (i / (hs * T)) % NH, b = i / (hs * T * NH);
  return RowCol{b * T + t, h * hs + e};
}

// dst (B, NH, T, hs)[i] = src[row · src_stride + offset + col].
__global__ void GatherHeadsKernel(float* dst, const float* src, size_t src_stride, size_t offset, size_t n,
                                  size_t T, size_t NH, size_t hs) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) {
    const RowCol rc = HeadElement(i, T, NH, hs);
    dst[i] = src[rc.row * src_stride + offset + rc.col];
  }
}

// dst[row · dst_stride + offset + col] = (or +=) src (B, NH, T, hs)[i].
__global__ void ScatterHeadsKernel(float* dst, const float* src, size_t dst_stride, size_t offset,
                                   bool accumulate, size_t n, size_t T, size_t NH, size_t hs) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) {
    const RowCol rc = HeadElement(i, T, NH, hs);
    float* d = dst + rc.row * dst_stride + offset + rc.col;
    *d = accumulate ? *d + src[i] : src[i];
  }
}

// In place on att (B·NH·T rows of T): row (bh, t) becomes the softmax of its
// first t + 1 entries, zeros after. One warp per row; each lane touches only
// the columns lane, lane + 32, ..., so the passes need no sync between them.
__global__ void CausalSoftmaxKernel(float* att, size_t rows, size_t T) {
  for (size_t idx = WarpRow(); idx < rows; idx += WarpRowStride()) {
    float* row = att + idx * T;
    const size_t t = idx % T;
    float maxv = -INFINITY;
    for (size_t t2 = Lane(); t2 <= t; t2 += 32) maxv = fmaxf(maxv, row[t2]);
    maxv = WarpMax(maxv);
    float sum = 0.0f;
    for (size_t t2 = Lane(); t2 <= t; t2 += 32) {
      const float e = expf(row[t2] - maxv);
      row[t2] = e;
      sum += e;
    }
    const float inv = 1.0f / WarpSum(sum);  // >= 1: the diagonal's term is exp(0) or more
    for (size_t t2 = Lane(); t2 < T; t2 += 32) row[t2] = t2 <= t ? row[t2] * inv : 0.0f;
  }
}

// In place on datt: dpre[t2] = att[t2] · (datt[t2] - Σ_j att[j] · datt[j]) · scale
// for t2 <= t, 0 after (the softmax's Jacobian, then the scores' scale).
__global__ void CausalSoftmaxBackwardKernel(float* datt, const float* att, size_t rows, size_t T,
                                            float scale) {
  for (size_t idx = WarpRow(); idx < rows; idx += WarpRowStride()) {
    float* drow = datt + idx * T;
    const float* arow = att + idx * T;
    const size_t t = idx % T;
    float dot = 0.0f;
    for (size_t t2 = Lane(); t2 <= t; t2 += 32) dot += arow[t2] * drow[t2];
    dot = WarpSum(dot);
    for (size_t t2 = Lane(); t2 < T; t2 += 32)
      drow[t2] = t2 <= t ? arow[t2] * (drow[t2] - dot) * scale : 0.0f;
  }
}

Status Gather(const CudaLayerContext& ctx, const Dims& d, float* dst, const float* src, size_t stride,
              size_t offset) {
  GatherHeadsKernel<<<BlocksFor(d.elems(), kThreads), kThreads, 0, ctx.stream>>>(dst, src, stride, offset,
                                                                                 d.elems(), d.T, d.NH, d.hs);
  STRATA_LAUNCH_OK("GatherHeadsKernel");
  return Status::Ok();
}

Status Scatter(const CudaLayerContext& ctx, const Dims& d, float* dst, const float* src, size_t stride,
               size_t offset, bool accumulate) {
  ScatterHeadsKernel<<<BlocksFor(d.elems(), kThreads), kThreads, 0, ctx.stream>>>(
      dst, src, stride, offset, accumulate, d.elems(), d.T, d.NH, d.hs);
  STRATA_LAUNCH_OK("ScatterHeadsKernel");
  return Status::Ok();
}

cublasComputeType_t ComputeFor(DType dtype) {
  return dtype == DType::kF32 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32;
}

// Per head, row-major: s[t][t2] = alpha · b_t · a_t2 with a, b (T, hs) and s (T, T).
Status ScoresGemm(const CudaLayerContext& ctx, const Dims& d, float alpha, const float* a, const float* b,
                  float* s, DType dtype) {
  const GemmShape shape{CUBLAS_OP_T, CUBLAS_OP_N, d.T, d.T, d.hs, d.hs, d.hs, d.T};
  return cuda_detail::GemmStridedBatched(ctx, shape, alpha, a, d.T * d.hs, b, d.T * d.hs, CUDA_R_32F, 0.0f, s,
                                         d.T * d.T, d.heads(), ComputeFor(dtype));
}

// Per head: out (T, hs) = p (T, T) · x (T, hs), all row-major (= x' · p').
Status ProbsTimesGemm(const CudaLayerContext& ctx, const Dims& d, const float* p, const float* x, float* out,
                      DType dtype) {
  const GemmShape shape{CUBLAS_OP_N, CUBLAS_OP_N, d.hs, d.T, d.T, d.hs, d.T, d.hs};
  return cuda_detail::GemmStridedBatched(ctx, shape, 1.0f, x, d.T * d.hs, p, d.T * d.T, CUDA_R_32F, 0.0f, out,
                                         d.T * d.hs, d.heads(), ComputeFor(dtype));
}

// Per head: out (T, hs) = pᵀ (T, T) · x (T, hs), all row-major (= x' · p'ᵀ).
Status ProbsTransposedTimesGemm(const CudaLayerContext& ctx, const Dims& d, const float* p, const float* x,
                                float* out, DType dtype) {
  const GemmShape shape{CUBLAS_OP_N, CUBLAS_OP_T, d.hs, d.T, d.T, d.hs, d.T, d.hs};
  return cuda_detail::GemmStridedBatched(ctx, shape, 1.0f, x, d.T * d.hs, p, d.T * d.T, CUDA_R_32F, 0.0f, out,
                                         d.T * d.hs, d.heads(), ComputeFor(dtype));
}

Status Softmax(const CudaLayerContext& ctx, const Dims& d, float* att) {
  const size_t rows = d.heads() * d.T;
  CausalSoftmaxKernel<<<BlocksFor(rows, kWarpsPerBlock), kThreads, 0, ctx.stream>>>(att, rows, d.T);
  STRATA_LAUNCH_OK("CausalSoftmaxKernel");
  return Status::Ok();
}

Status SoftmaxBackward(const CudaLayerContext& ctx, const Dims& d, float* datt, const float* att,
                       float scale) {
  const size_t rows = d.heads() * d.T;
  CausalSoftmaxBackwardKernel<<<BlocksFor(rows, kWarpsPerBlock), kThreads, 0, ctx.stream>>>(datt, att, rows,
                                                                                            d.T, scale);
  STRATA_LAUNCH_OK("CausalSoftmaxBackwardKernel");
  return Status::Ok();
}

// Scratch: seven (B, NH, T, hs) tensors, then one (B, NH, T, T).
struct Pieces {
  float *q, *k, *v, *y_or_dy, *dq, *dk, *dv, *datt;
};

Pieces Cut(const Dims& d, CudaScratch s) {
  float* p = static_cast<float*>(s.ptr);
  const size_t n = d.elems();
  float* datt = reinterpret_cast<float*>(static_cast<char*>(s.ptr) + AlignScratch(7 * n * sizeof(float)));
  return Pieces{p, p + n, p + 2 * n, p + 3 * n, p + 4 * n, p + 5 * n, p + 6 * n, datt};
}

Status Check(const char* fn, const Dims& d, CudaScratch s) {
  if (d.NH == 0 || d.C % d.NH != 0)
    return InvalidError(std::string(fn) + ": C " + std::to_string(d.C) + " is not a multiple of NH " +
                        std::to_string(d.NH));
  const size_t need = AttentionScratchBytes(d.B, d.T, d.C, d.NH);
  if (s.bytes >= need) return Status::Ok();
  return InvalidError(std::string(fn) + ": scratch of " + std::to_string(s.bytes) + " bytes, needs " +
                      std::to_string(need));
}

float ScoreScale(const Dims& d) { return 1.0f / std::sqrt(static_cast<float>(d.hs)); }

}  // namespace

size_t AttentionScratchBytes(size_t B, size_t T, size_t C, size_t NH) {
  return AlignScratch(7 * B * T * C * sizeof(float)) + AlignScratch(B * NH * T * T * sizeof(float));
}

Status AttentionForwardCuda(const CudaLayerContext& ctx, float* out, float* att, const float* qkv, size_t B,
                            size_t T, size_t C, size_t NH, DType dtype, CudaScratch scratch) {
  const Dims d{B, T, C, NH, NH ? C / NH : 0};
  STRATA_RETURN_IF_ERROR(Check("AttentionForwardCuda", d, scratch));
  if (d.elems() == 0) return Status::Ok();
  const Pieces p = Cut(d, scratch);
  STRATA_RETURN_IF_ERROR(Gather(ctx, d, p.q, qkv, 3 * C, 0));
  STRATA_RETURN_IF_ERROR(Gather(ctx, d, p.k, qkv, 3 * C, C));
  STRATA_RETURN_IF_ERROR(Gather(ctx, d, p.v, qkv, 3 * C, 2 * C));
  STRATA_RETURN_IF_ERROR(ScoresGemm(ctx, d, ScoreScale(d), p.k, p.q, att, dtype));
  STRATA_RETURN_IF_ERROR(Softmax(ctx, d, att));
  STRATA_RETURN_IF_ERROR(ProbsTimesGemm(ctx, d, att, p.v, p.y_or_dy, dtype));
  return Scatter(ctx, d, out, p.y_or_dy, C, 0, false);
}

Status AttentionBackwardCuda(const CudaLayerContext& ctx, float* dqkv, const float* dout, const float* qkv,
                             const float* att, size_t B, size_t T, size_t C, size_t NH, DType dtype,
                             CudaScratch scratch) {
  const Dims d{B, T, C, NH, NH ? C / NH : 0};
  STRATA_RETURN_IF_ERROR(Check("AttentionBackwardCuda", d, scratch));
  if (d.elems() == 0) return Status::Ok();
  const Pieces p = Cut(d, scratch);
  STRATA_RETURN_IF_ERROR(Gather(ctx, d, p.q, qkv, 3 * C, 0));
  STRATA_RETURN_IF_ERROR(Gather(ctx, d, p.k, qkv, 3 * C, C));
  STRATA_RETURN_IF_ERROR(Gather(ctx, d, p.v, qkv, 3 * C, 2 * C));
  STRATA_RETURN_IF_ERROR(Gather(ctx, d, p.y_or_dy, dout, C, 0));
  // datt[t][t2] = dy_t · v_t2 (the scores GEMM with dy for q and v for k).
  STRATA_RETURN_IF_ERROR(ScoresGemm(ctx, d, 1.0f, p.v, p.y_or_dy, p.datt, dtype));
  STRATA_RETURN_IF_ERROR(ProbsTransposedTimesGemm(ctx, d, att, p.y_or_dy, p.dv, dtype));
  STRATA_RETURN_IF_ERROR(SoftmaxBackward(ctx, d, p.datt, att, ScoreScale(d)));
  STRATA_RETURN_IF_ERROR(ProbsTimesGemm(ctx, d, p.datt, p.k, p.dq, dtype));
  STRATA_RETURN_IF_ERROR(ProbsTransposedTimesGemm(ctx, d, p.datt, p.q, p.dk, dtype));
  STRATA_RETURN_IF_ERROR(Scatter(ctx, d, dqkv, p.dq, 3 * C, 0, true));
  STRATA_RETURN_IF_ERROR(Scatter(ctx, d, dqkv, p.dk, 3 * C, C, true));
  return Scatter(ctx, d, dqkv, p.dv, 3 * C, 2 * C, true);
}

}  // namespace strata::layers

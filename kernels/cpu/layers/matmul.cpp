// cblas_sgemm over fixed tiles of output rows; bias add and bias gradient by hand.
#include "kernels/cpu/layers/matmul.h"

#include <cblas.h>

#include <climits>

#include "base/check.h"
#include "kernels/cpu/layers/tiles.h"

namespace strata::layers {
namespace {

using detail::ForEachTile;
using detail::kChannelTile;

// Output rows of one sgemm: big enough for OpenBLAS's packing to pay off,
// small enough that B*T rows make tiles for every thread.
constexpr size_t kGemmRows = 64;

int Dim(size_t n) {
  STRATA_CHECK_MSG(n <= static_cast<size_t>(INT_MAX), "matmul dimension exceeds the BLAS int range");
  return static_cast<int>(n);
}

}  // namespace

void PinBlasToOneThread() {
  // The OpenBLAS thread count is a process global; a function-local static runs
  // the call exactly once even when the first matmuls start on several threads.
  static const bool pinned = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)pinned;
}

void MatmulForward(float* out, const float* inp, const float* weight, const float* bias, size_t N, size_t C,
                   size_t OC) {
  PinBlasToOneThread();
  ForEachTile(N, kGemmRows, [&](size_t r0, size_t r1) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Dim(r1 - r0), Dim(OC), Dim(C), 1.0f, inp + r0 * C,
                Dim(C), weight, Dim(C), 0.0f, out + r0 * OC, Dim(OC));
    if (bias == nullptr) return;
    for (size_t r = r0; r < r1; ++r) {
      float* row = out + r * OC;
      for (size_t o = 0; o < OC; ++o) row[o] += bias[o];
    }
  });
}

void MatmulBackward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                    const float* weight, size_t N, size_t C, size_t OC) {
  PinBlasToOneThread();
  if (dinp != nullptr) {
    // dinp rows [r0, r1) += dout rows [r0, r1) · weight
    ForEachTile(N, kGemmRows, [&](size_t r0, size_t r1) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Dim(r1 - r0), Dim(C), Dim(OC), 1.0f,
                  dout + r0 * OC, Dim(OC), weight, Dim(C), 1.0f, dinp + r0 * C, Dim(C));
    });
  }
  // dweight rows [o0, o1) += dout[:, o0:o1]ᵀ · inp: the sum over all N rows is one sgemm.
  ForEachTile(OC, kGemmRows, [&](size_t o0, size_t o1) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Dim(o1 - o0), Dim(C), Dim(N), 1.0f, dout + o0,
                Dim(OC), inp, Dim(C), 1.0f, dweight + o0 * C, Dim(C));
  });
  if (dbias == nullptr) return;
  ForEachTile(OC, kChannelTile, [&](size_t o0, size_t o1) {
    for (size_t r = 0; r < N; ++r) {
      const float* row = dout + r * OC;
      for (size_t o = o0; o < o1; ++o) dbias[o] += row[o];
    }
  });
}

}  // namespace strata::layers

// dtype <-> fp32 copies over fixed element tiles.
#include "kernels/cpu/layers/convert.h"

#include <cstdint>
#include <cstring>

#include "kernels/cpu/layers/tiles.h"

namespace strata::layers {

using detail::ForEachTile;
using detail::kElementTile;

void ToF32(DType dtype, const void* in, float* out, size_t n) {
  if (dtype == DType::kF32) {
    std::memcpy(out, in, n * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(in);
  ForEachTile(n, kElementTile, [&](size_t i0, size_t i1) {
    if (dtype == DType::kBF16) {
      for (size_t i = i0; i < i1; ++i) out[i] = BF16ToF32(h[i]);
    } else {
      for (size_t i = i0; i < i1; ++i) out[i] = F16ToF32(h[i]);
    }
  });
}

void FromF32(DType dtype, const float* in, void* out, size_t n) {
  if (dtype == DType::kF32) {
    std::memcpy(out, in, n * sizeof(float));
    return;
  }
  uint16_t* h = static_cast<uint16_t*>(out);
  ForEachTile(n, kElementTile, [&](size_t i0, size_t i1) {
    if (dtype == DType::kBF16) {
      for (size_t i = i0; i < i1; ++i) h[i] = F32ToBF16(in[i]);
    } else {
      for (size_t i = i0; i < i1; ++i) h[i] = F32ToF16(in[i]);
    }
  });
}

}  // namespace strata::layers

// Internal: maps a runtime variant (gradient dtype, copy-out, flag) to the
// matching instantiation Kernel<G, C, F>::Run. Included by each path's file;
// Kernel lives in that file's anonymous namespace, so every instantiation has
// internal linkage and stays compiled with that file's ISA flags.
#pragma once

#include "kernels/cpu/range_kernels.h"

namespace strata::kernels::internal {
namespace {

template <template <DType, CopyOut, bool> class Kernel, DType G, CopyOut C>
auto PickFlag(bool flag) {
  return flag ? &Kernel<G, C, true>::Run : &Kernel<G, C, false>::Run;
}

template <template <DType, CopyOut, bool> class Kernel, DType G>
auto PickCopy(CopyOut copy, bool flag) {
  switch (copy) {
    case CopyOut::kBF16: return PickFlag<Kernel, G, CopyOut::kBF16>(flag);
    case CopyOut::kF16: return PickFlag<Kernel, G, CopyOut::kF16>(flag);
    case CopyOut::kNone: break;
  }
  return PickFlag<Kernel, G, CopyOut::kNone>(flag);
}

template <template <DType, CopyOut, bool> class Kernel>
auto PickVariant(DType grad, CopyOut copy, bool flag) {
  switch (grad) {
    case DType::kBF16: return PickCopy<Kernel, DType::kBF16>(copy, flag);
    case DType::kF16: return PickCopy<Kernel, DType::kF16>(copy, flag);
    case DType::kF32: break;
  }
  return PickCopy<Kernel, DType::kF32>(copy, flag);
}

}  // namespace
}  // namespace strata::kernels::internal

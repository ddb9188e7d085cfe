// Internal: maps a runtime variant (dtype, copy-out, flag) to the matching
// template instantiation. Included by each path's file; the kernels live in
// that file's anonymous namespace, so every instantiation has internal
// linkage and stays compiled with that file's ISA flags.
#pragma once

#include <type_traits>

#include "kernels/cpu/compact_kernels.h"
#include "kernels/cpu/range_kernels.h"

namespace strata::kernels::internal {
namespace {

template <DType D>
struct DTypeTag {
  static constexpr DType value = D;
};

// The one switch over dtypes: f(DTypeTag<d>{}) for the runtime d, e.g.
//   WithDType(d, [](auto t) { return &Kernel<decltype(t)::value>; })
template <typename F>
auto WithDType(DType d, F&& f) {
  switch (d) {
    case DType::kBF16: return f(DTypeTag<DType::kBF16>{});
    case DType::kF16: return f(DTypeTag<DType::kF16>{});
    case DType::kF32: break;
  }
  return f(DTypeTag<DType::kF32>{});
}

// Optimizers: Kernel<G, C, F>::Run for (gradient dtype, copy-out, flag).
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
  return WithDType(grad, [&](auto g) { return PickCopy<Kernel, decltype(g)::value>(copy, flag); });
}

// Adam: Kernel<G, C, L2, Lerp>::Run for (gradient dtype, copy-out, two flags).
template <template <DType, CopyOut, bool, bool> class Kernel>
auto PickVariant(DType grad, CopyOut copy, bool flag, bool flag2) {
  return WithDType(grad, [&](auto g) {
    constexpr DType G = decltype(g)::value;
    auto pick = [&](auto c) {
      constexpr CopyOut C = decltype(c)::value;
      if (flag) return flag2 ? &Kernel<G, C, true, true>::Run : &Kernel<G, C, true, false>::Run;
      return flag2 ? &Kernel<G, C, false, true>::Run : &Kernel<G, C, false, false>::Run;
    };
    switch (copy) {
      case CopyOut::kBF16: return pick(std::integral_constant<CopyOut, CopyOut::kBF16>{});
      case CopyOut::kF16: return pick(std::integral_constant<CopyOut, CopyOut::kF16>{});
      case CopyOut::kNone: break;
    }
    return pick(std::integral_constant<CopyOut, CopyOut::kNone>{});
  });
}

// The compact state's kernels: Kernel<G, C>::Run (Lion) and
// Kernel<G, C, L2, Lerp>::Run (Adam) for (gradient dtype, CompactCopy).
template <CompactCopy C>
struct CompactCopyTag {
  static constexpr CompactCopy value = C;
};

template <typename F>
auto WithCompactCopy(CompactCopy c, F&& f) {
  switch (c) {
    case CompactCopy::kBF16: return f(CompactCopyTag<CompactCopy::kBF16>{});
    case CompactCopy::kF16: return f(CompactCopyTag<CompactCopy::kF16>{});
    case CompactCopy::kF32: return f(CompactCopyTag<CompactCopy::kF32>{});
    case CompactCopy::kNone: break;
  }
  return f(CompactCopyTag<CompactCopy::kNone>{});
}

template <template <DType, CompactCopy> class Kernel>
CompactLionRangeFn PickCompactLion(DType grad, CompactCopy copy) {
  return WithDType(grad, [&](auto g) {
    return WithCompactCopy(copy, [](auto c) -> CompactLionRangeFn {
      return &Kernel<decltype(g)::value, decltype(c)::value>::Run;
    });
  });
}

template <template <DType, CompactCopy, bool, bool> class Kernel>
CompactAdamRangeFn PickCompactAdam(DType grad, CompactCopy copy, bool l2, bool lerp) {
  return WithDType(grad, [&](auto g) {
    return WithCompactCopy(copy, [&](auto c) -> CompactAdamRangeFn {
      constexpr DType G = decltype(g)::value;
      constexpr CompactCopy C = decltype(c)::value;
      if (l2) return lerp ? &Kernel<G, C, true, true>::Run : &Kernel<G, C, true, false>::Run;
      return lerp ? &Kernel<G, C, false, true>::Run : &Kernel<G, C, false, false>::Run;
    });
  });
}

}  // namespace
}  // namespace strata::kernels::internal

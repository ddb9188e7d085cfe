// Private to the layer kernels: fixed tiles run in parallel on oneTBB. A tile's
// bounds depend on the problem size alone and each tile writes outputs no other
// tile writes, with any reduction inside one tile in a fixed order; so results
// are bitwise the same whatever the thread count or the scheduling.
#pragma once

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>

#include <algorithm>
#include <cstddef>

namespace strata::layers::detail {

// Calls fn(begin, end) for each tile [k*tile, min(n, (k+1)*tile)), tiles in parallel.
template <typename Fn>
void ForEachTile(size_t n, size_t tile, const Fn& fn) {
  const size_t tiles = (n + tile - 1) / tile;
  if (tiles <= 1) {
    if (n > 0) fn(size_t{0}, n);
    return;
  }
  tbb::parallel_for(
      tbb::blocked_range<size_t>(0, tiles, 1),
      [&](const tbb::blocked_range<size_t>& r) {
        for (size_t k = r.begin(); k < r.end(); ++k) fn(k * tile, std::min(n, (k + 1) * tile));
      },
      tbb::simple_partitioner());
}

// Calls fn(i) for each i in [0, n), in parallel, `grain` indices per task.
template <typename Fn>
void ForEachIndex(size_t n, size_t grain, const Fn& fn) {
  ForEachTile(n, grain, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) fn(i);
  });
}

// Rows per tile of row-wise kernels (layernorm, softmax, matmul rows).
inline constexpr size_t kRowTile = 32;
// Channels per tile of kernels that reduce over rows (bias and norm grads).
inline constexpr size_t kChannelTile = 64;
// Elements per tile of element-wise kernels.
inline constexpr size_t kElementTile = 16384;

}  // namespace strata::layers::detail

// Best-fit extent allocation with coalescing.
#include "tiers/extent_allocator.h"

#include <algorithm>

#include "base/align.h"
#include "base/check.h"

namespace strata {

ExtentAllocator::ExtentAllocator(uint64_t capacity, uint64_t align)
    : capacity_(AlignDown(capacity, align)), align_(align), free_bytes_(capacity_) {
  if (capacity_ > 0) free_[0] = capacity_;
}

uint64_t ExtentAllocator::Allocate(uint64_t len) {
  len = RoundUpTo(len, align_);
  // Best fit, the lowest offset among equals: a rewrite of a small block
  // takes the hole another small block's old version left, and the holes
  // the large blocks leave stay whole for their next rewrite (first fit
  // nibbled at them, and a rewrite of the largest block then found none).
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it)
    if (it->second >= len && (best == free_.end() || it->second < best->second)) {
      best = it;
      if (it->second == len) break;
    }
  if (best == free_.end()) return UINT64_MAX;
  const uint64_t off = best->first, rest = best->second - len;
  free_.erase(best);
  if (rest) free_[off + len] = rest;
  free_bytes_ -= len;
  return off;
}

void ExtentAllocator::Free(uint64_t offset, uint64_t len) {
  len = RoundUpTo(len, align_);
  STRATA_CHECK(offset + len <= capacity_);
  auto next = free_.lower_bound(offset);
  STRATA_CHECK_MSG(next == free_.end() || next->first >= offset + len, "double free of an extent");
  uint64_t start = offset, end = offset + len;
  if (next != free_.end() && next->first == end) {
    end += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    STRATA_CHECK_MSG(prev->first + prev->second <= offset, "double free of an extent");
    if (prev->first + prev->second == start) {
      start = prev->first;
      free_.erase(prev);
    }
  }
  free_[start] = end - start;
  free_bytes_ += len;
}

void ExtentAllocator::Grow(uint64_t capacity) {
  capacity = AlignDown(capacity, align_);
  if (capacity <= capacity_) return;
  uint64_t start = capacity_;
  if (!free_.empty()) {
    auto last = std::prev(free_.end());
    if (last->first + last->second == capacity_) {
      start = last->first;
      free_.erase(last);
    }
  }
  free_[start] = capacity - start;
  free_bytes_ += capacity - capacity_;
  capacity_ = capacity;
}

uint64_t ExtentAllocator::largest_free() const {
  uint64_t best = 0;
  for (const auto& [off, len] : free_) best = std::max(best, len);
  return best;
}

}  // namespace strata

// Best-fit extent allocation with coalescing.
#include "tiers/extent_allocator.h"

#include <algorithm>
#include <iterator>

#include "base/align.h"
#include "base/check.h"

namespace strata {

ExtentAllocator::ExtentAllocator(uint64_t capacity, uint64_t align)
    : capacity_(AlignDown(capacity, align)), align_(align), free_bytes_(capacity_) {
  if (capacity_ > 0) Insert(0, capacity_);
}

void ExtentAllocator::Insert(uint64_t off, uint64_t len) {
  free_[off] = len;
  by_size_.emplace(len, off);
}

std::map<uint64_t, uint64_t>::iterator ExtentAllocator::Erase(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  return free_.erase(it);
}

uint64_t ExtentAllocator::Allocate(uint64_t len) {
  len = RoundUpTo(len, align_);
  // Best fit, the lowest offset among equals: a rewrite of a small block
  // takes the hole another small block's old version left, and the holes
  // the large blocks leave stay whole for their next rewrite (first fit
  // nibbled at them, and a rewrite of the largest block then found none).
  // One lookup in the size index, whatever the number of holes.
  auto best = by_size_.lower_bound({len, 0});
  if (best == by_size_.end()) return UINT64_MAX;
  const uint64_t off = best->second, rest = best->first - len;
  Erase(free_.find(off));
  if (rest) Insert(off + len, rest);
  free_bytes_ -= len;
  return off;
}

std::vector<std::pair<uint64_t, uint64_t>> ExtentAllocator::AllocateScattered(uint64_t len) {
  len = RoundUpTo(len, align_);
  std::vector<std::pair<uint64_t, uint64_t>> out;
  if (len == 0 || len > free_bytes_) return out;
  for (uint64_t left = len; left > 0;) {
    // The remainder best fit when one hole holds it, else the largest hole whole.
    auto fit = by_size_.lower_bound({left, 0});
    const uint64_t take = fit != by_size_.end() ? left : by_size_.rbegin()->first;
    const uint64_t off = Allocate(take);
    STRATA_CHECK_MSG(off != UINT64_MAX, "a scattered extent found less free space than it counted");
    out.emplace_back(off, take);
    left -= take;
  }
  return out;
}

void ExtentAllocator::Free(uint64_t offset, uint64_t len) {
  len = RoundUpTo(len, align_);
  STRATA_CHECK(offset + len <= capacity_);
  auto next = free_.lower_bound(offset);
  STRATA_CHECK_MSG(next == free_.end() || next->first >= offset + len, "double free of an extent");
  uint64_t start = offset, end = offset + len;
  if (next != free_.end() && next->first == end) {
    end += next->second;
    next = Erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    STRATA_CHECK_MSG(prev->first + prev->second <= offset, "double free of an extent");
    if (prev->first + prev->second == start) {
      start = prev->first;
      Erase(prev);
    }
  }
  Insert(start, end - start);
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
      Erase(last);
    }
  }
  Insert(start, capacity - start);
  free_bytes_ += capacity - capacity_;
  capacity_ = capacity;
}

uint64_t ExtentAllocator::largest_free() const { return by_size_.empty() ? 0 : by_size_.rbegin()->first; }

}  // namespace strata

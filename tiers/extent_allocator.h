// ExtentAllocator: best-fit ranges inside a swap file's reserved space, with
// coalescing on free. Not thread-safe (NvmeTier holds the lock).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace strata {

class ExtentAllocator {
 public:
  ExtentAllocator(uint64_t capacity, uint64_t align);
  // Returns the offset of `len` bytes (rounded up to the alignment), or
  // UINT64_MAX when no free range is large enough.
  uint64_t Allocate(uint64_t len);
  // `len` bytes (rounded up to the alignment) in as few free ranges as the
  // holes allow, the largest first (the last piece best fit): (offset,
  // length) pairs, in the order they take the bytes; empty (nothing taken)
  // when all the free ranges together are too small. Each piece is freed
  // on its own.
  std::vector<std::pair<uint64_t, uint64_t>> AllocateScattered(uint64_t len);
  // REQUIRES: [offset, offset+len) was allocated with this len.
  void Free(uint64_t offset, uint64_t len);
  // Extends the range to `capacity` (aligned down); the new end is free,
  // joined to a free range that ends where the old capacity did. A smaller
  // capacity changes nothing.
  void Grow(uint64_t capacity);
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free() const;
  // The free ranges, offset -> length, in order.
  const std::map<uint64_t, uint64_t>& free_ranges() const { return free_; }

 private:
  void Insert(uint64_t off, uint64_t len);  // a free range, in both indexes
  std::map<uint64_t, uint64_t>::iterator Erase(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t capacity_, align_, free_bytes_;
  std::map<uint64_t, uint64_t> free_;  // offset -> length, disjoint, never adjacent
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // (length, offset) of every range in free_: best fit in O(log n)
};

}  // namespace strata

// Partition: parameter groups flattened, padded and cut into world-size
// shards. A shard holds a multiple of kShardAlign elements, so every state
// of every shard (bf16 P: 4 KiB, fp32 W/M/V/G: 8 KiB per 2048 elements)
// starts and ends on an O_DIRECT block and a SIMD register.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace strata {

struct TensorSlot {
  std::string name;
  uint64_t offset = 0;  // elements from the group's start
  uint64_t numel = 0;
};

struct GroupLayout {
  std::vector<TensorSlot> tensors;
  uint64_t numel = 0;        // sum of the tensors
  uint64_t padded = 0;       // numel rounded up to world_size * kShardAlign
  uint64_t shard_numel = 0;  // padded / world_size
  // Elements of this group's shard `rank` that are real (not padding).
  uint64_t RealInShard(int rank) const;
};

class Partition {
 public:
  static constexpr uint64_t kShardAlign = 2048;

  // REQUIRES: numel > 0, group >= 0. Returns the tensor's offset in the group.
  Result<uint64_t> Add(int group, const std::string& name, uint64_t numel);
  // Groups must be numbered 0..n-1 without gaps. Sets padding and shards.
  Status Finalize(int world_size);

  int num_groups() const { return static_cast<int>(groups_.size()); }
  const GroupLayout& group(int g) const { return groups_[static_cast<size_t>(g)]; }
  uint64_t largest_group_numel() const;
  uint64_t largest_shard_numel() const;
  uint64_t total_numel() const;

 private:
  std::vector<GroupLayout> groups_;
  bool finalized_ = false;
};

}  // namespace strata

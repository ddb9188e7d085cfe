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
  // Registered with a shape (AddShaped): `shape` holds its dims (empty for a
  // scalar), whose product is numel. Registered by numel alone: no shape
  // (a flat tensor of numel elements).
  bool shaped = false;
  std::vector<uint64_t> shape;
  // Other names of the same values (a tied weight's second module):
  // recorded in checkpoints so that strata-export writes it under each.
  std::vector<std::string> aliases;
};

// The most dims a registered shape may have.
inline constexpr size_t kMaxShapeDims = 32;
// The most aliases (other names) one tensor may have: the checkpoint
// manifest's limit (checked equal where both are seen: checkpoint.cpp).
inline constexpr size_t kMaxTensorAliases = 64;

// "[3, 4]" ("[]" for a scalar): shapes in messages.
std::string ShapeString(const std::vector<uint64_t>& shape);

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
  static constexpr uint64_t kMaxElements = 1ull << 40;  // per tensor, and per group

  // REQUIRES: numel > 0, group >= 0, the group's elements within
  // kMaxElements, and a name that is not empty, is UTF-8 (it is written into
  // checkpoint manifests, JSON) and is not a name or alias in the group
  // already. Returns the tensor's offset in the group.
  Result<uint64_t> Add(int group, const std::string& name, uint64_t numel);
  // Add with a shape: every dim at least 1, at most kMaxShapeDims dims, and a
  // product within Add's limit (checked without overflow). Errors name `name`.
  Result<uint64_t> AddShaped(int group, const std::string& name, const std::vector<uint64_t>& shape);
  // `alias` names tensor `of` of `group` too. Refused when `of` is not there,
  // `alias` is empty, not UTF-8, or already a name or alias in the group, or
  // `of` has kMaxTensorAliases aliases already.
  Status AddAlias(int group, const std::string& alias, const std::string& of);
  // Groups must be numbered 0..n-1 without gaps. Sets padding and shards.
  Status Finalize(int world_size);

  int num_groups() const { return static_cast<int>(groups_.size()); }
  const GroupLayout& group(int g) const { return groups_[static_cast<size_t>(g)]; }
  uint64_t largest_group_numel() const;
  uint64_t largest_shard_numel() const;
  uint64_t total_numel() const;
  // After a failed build: parameters may be added again (Finalize recomputes
  // every layout from the tensors).
  void Reopen() { finalized_ = false; }
  // Undoes the last Add to `group`, for a caller whose own part of adding it
  // failed after (keeping its initial values): the name is free again, and a
  // group that Add created and that is empty now is gone.
  void DropLast(int group);

 private:
  std::vector<GroupLayout> groups_;
  bool finalized_ = false;
};

}  // namespace strata

// What strata-export needs from a Strata checkpoint: for every group, its
// tensors (name, offset, numel within the group, shape) and where each rank's W
// shard lies (a frozen group's: its P shard, in the compute dtype) (file,
// offset, bytes, XXH3), in rank order. Read from
// DIR/TAG/manifest.json and checked against the data files' sizes; the
// manifest is JSON from disk, so any surprise in it is a CORRUPT error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"

namespace strata::exporter {

struct TensorRef {
  std::string name;
  uint64_t offset = 0;  // elements from the group's start
  uint64_t numel = 0;
  std::vector<uint64_t> shape;  // the registered shape (product: numel), else {numel}
  std::vector<std::string> aliases;  // other names written with the same values
};

// Shard r's W block of a group (a frozen group's P block), written by rank
// r: it covers elements [r * shard_numel, (r + 1) * shard_numel) of the
// padded group.
struct ShardRef {
  std::string path;      // the rank's data file
  uint64_t offset = 0;   // bytes into the file
  uint64_t bytes = 0;    // shard_numel * 4 (fp32); compact: 2 * shard_numel of bf16 halves, then the corrections,
                         // padded; frozen: shard_numel elements of CheckpointPlan::p_dtype
  std::string xxh3;      // 16 hex digits, as the manifest writes it
};

struct GroupRef {
  uint64_t numel = 0, padded = 0, shard_numel = 0;
  std::vector<TensorRef> tensors;  // sorted by offset, disjoint, inside [0, numel)
  std::vector<ShardRef> shards;    // one per shard, in rank order
  bool frozen = false;             // its shards are P blocks (parameters in p_dtype), not W
};

struct CheckpointPlan {
  std::string folder;  // DIR/TAG
  std::string tag;
  int world_size = 1;  // ranks that saved it
  int shards = 1;      // "shard_world": data files, one per shard (1 at stage 0)
  int64_t step = 0;
  // strata.state_format of the saved state: W blocks of "compact" hold the
  // master's bf16 half then its int8 corrections (kernels/cpu/compact.h).
  bool compact = false;
  DType p_dtype = DType::kF32;  // frozen groups' P blocks: the checkpoint's compute dtype
  std::vector<GroupRef> groups;
};

// `path` is a checkpoint folder (holding manifest.json) or a checkpoint
// directory (holding `latest`, which names the folder).
Result<CheckpointPlan> ReadCheckpointPlan(const std::string& path);

}  // namespace strata::exporter

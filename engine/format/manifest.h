// The checkpoint manifest (DIR/TAG/manifest.json): its fields, its own
// checksum, and the checks that every field addressing data is consistent,
// so that a flipped bit is CORRUPT instead of a wrong step count, loss scale
// or block offset. Needs no engine: the engine's load, strata-export and the
// manifest fuzzer share it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace strata::manifest {

inline constexpr int kFormatVersion = 1;
// The saved states, in the order the manifest names them ("W", "M", "V").
inline constexpr int kNumSaved = 3;
// A frozen group's block ("P"): its parameters in compute_dtype, shard_numel
// elements, the only block such a group has. Block::state values run over
// 0..kNumBlockStates-1.
inline constexpr int kSavedP = 3;
inline constexpr int kNumBlockStates = 4;
const char* SavedStateName(int s);  // "W", "M", "V", "P"

struct Tensor {
  std::string name;
  uint64_t offset = 0, numel = 0;  // in elements, within the group
  // The shape it was registered with ("shape": dims whose product is numel,
  // each at least 1; [] a scalar). A tensor registered by numel alone, and
  // every tensor of a manifest written before shapes were kept, has none.
  bool shaped = false;
  std::vector<uint64_t> shape;
  // Its other names ("aliases": a tied weight's), each unique in the group.
  std::vector<std::string> aliases;
};
// The most aliases of one tensor.
inline constexpr size_t kMaxAliases = 64;
// The most dims of a tensor's shape (the engine's kMaxShapeDims).
inline constexpr size_t kMaxDims = 32;
// The largest trainer blob a checkpoint holds (strata_checkpoint_save's).
inline constexpr uint64_t kMaxBlobBytes = 1ull << 32;

struct Group {
  uint64_t numel = 0, padded = 0, shard_numel = 0;
  std::vector<Tensor> tensors;
  // "frozen": true (Engine::FreezeGroup): every file holds one "P" block of
  // the group and nothing else; absent (every group of older manifests): false.
  bool frozen = false;
  // "steps": the group's own update count (an engine that skips groups
  // without gradients: its bias correction counts from it); -1 when absent
  // (the group follows the manifest's step).
  int64_t steps = -1;
};

struct Block {
  uint64_t group = 0;
  int state = 0;  // 0 W, 1 M, 2 V, 3 P (kSavedP: a frozen group's)
  uint64_t offset = 0, bytes = 0, xxh3 = 0;
};

// One shard's data file. `hash_of_blocks`: a snapshot (a link of a swap
// file), whose `xxh3` is over its blocks' checksums; else over its first
// `bytes` bytes, which its blocks tile.
struct File {
  std::string name;
  int rank = 0;
  uint64_t bytes = 0, xxh3 = 0;
  bool hash_of_blocks = false;
  std::vector<Block> blocks;
};

struct Manifest {
  std::string tag;
  int world_size = 1, shard_world = 1, stage = 0;
  std::string compute_dtype, optimizer;
  // strata.state_format of the saved blocks: "fp32" (also when the key is
  // absent: manifests written before it existed) or "compact".
  std::string state_format = "fp32";
  int64_t step = 0;
  uint64_t save_seq = 0;  // order of saves in the folder (0: written before it existed)
  double loss_scale = 1;
  int hysteresis_left = 0;
  int64_t clean_steps = 0;
  std::vector<Group> groups;
  std::vector<File> files;  // files[k] is shard k's
  std::string blob_file;
  uint64_t blob_bytes = 0, blob_xxh3 = 0;
  bool sealed = false;  // carried its own checksum, and it matched
  uint32_t saved_states = 0;  // bit s: every file holds state s of every group that is not frozen (0: all are)
};

// The manifest's text: `json` (a JSON object) with "manifest_xxh3", the XXH3
// of its canonical form (compact, keys sorted) without that key, added.
std::string Seal(const std::string& json_text);

// Parses and checks a manifest. `path` names it in errors. Everything is
// checked that can be without the data files: its checksum (a manifest
// without one was written before manifests carried it: accepted, `sealed`
// false; one that does not match is CORRUPT), every field's type and range,
// and that the layout is self-consistent (frozen groups hold "P" blocks of
// shard_numel elements of compute_dtype and nothing else, the others no
// "P"; tensors tile their groups, a
// tensor's shape has at most kMaxDims dims, each at least 1, whose product is its numel, shards
// their padded groups, one file per shard (files[k] is shard k's after the
// parse, in whatever order the manifest lists them), each file holds the
// same states of every group, blocks of the right size that do not overlap
// and lie within the file's `bytes`). Every error is CORRUPT and names
// `path` and the field.
Result<Manifest> Parse(std::string_view text, const std::string& path);

// Checks the manifest against the data files in `folder`: each is a regular
// file at least as long as its `bytes` (which its blocks lie within). CORRUPT
// names the file. (The trainer's blob is the engine's to check.)
Status CheckFiles(const Manifest& m, const std::string& folder);

std::string Hex(uint64_t v);  // 16 lower-case hex digits

// The arrays a saved block of state s (0 W, 1 M, 2 V) of an n-element shard
// holds, in order, each of `unit`-byte entries for every `per` elements
// (the last entry may cover fewer), starting `offset` bytes into the block:
//   fp32:     one array of 4-byte floats;
//   compact:  W: the master's bf16 half (2 bytes), then its int8 corrections;
//             M, V: their 8-bit codes, then a float scale per 32 elements
//             (kernels/cpu/compact.h); each block ends in zeros up to a
//             multiple of 4096 bytes (O_DIRECT). n is a multiple of 32.
struct SavedArray {
  uint64_t offset = 0, unit = 0, per = 1;
};
int SavedArrays(bool compact, int s, uint64_t n, SavedArray out[2]);  // returns how many (1 or 2)
uint64_t SavedBlockBytes(bool compact, int s, uint64_t n);  // padding included (s: W, M, V)
inline constexpr uint64_t kCompactBlockAlign = 4096;

}  // namespace strata::manifest

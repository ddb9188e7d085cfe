// Group layout and shard arithmetic.
#include "engine/layout/partition.h"

#include <algorithm>

#include "base/align.h"
#include "base/text.h"

namespace strata {

uint64_t GroupLayout::RealInShard(int rank) const {
  const uint64_t lo = static_cast<uint64_t>(rank) * shard_numel;
  if (lo >= numel) return 0;
  return std::min(shard_numel, numel - lo);
}

// A tensor's name or alias is written into checkpoint manifests (JSON): it
// must be UTF-8, and not empty (the manifest reader refuses both). Checked
// here, when it is given, not at the first save.
static Status CheckName(const char* call, const std::string& name) {
  if (name.empty()) return InvalidError(std::string(call) + ": an empty name");
  if (!IsUtf8(name))
    return InvalidError(std::string(call) + " '" + ForMessage(name) +
                        "': the name is not UTF-8 (names are written into checkpoint manifests, JSON)");
  return Status::Ok();
}

Result<uint64_t> Partition::Add(int group, const std::string& name, uint64_t numel) {
  STRATA_RETURN_IF_ERROR(CheckName("add_param", name));  // first: the messages below show it
  if (finalized_) return StateError("add_param '" + name + "': the engine is already built");
  if (group < 0 || group > 1'000'000)
    return InvalidError("add_param '" + name + "': group " + std::to_string(group) + " is not in 0..1000000");
  if (numel == 0) return InvalidError("add_param '" + name + "': zero elements");
  if (numel > kMaxElements)
    return InvalidError("add_param '" + name + "': " + std::to_string(numel) + " elements is too many");
  if (static_cast<size_t>(group) >= groups_.size()) groups_.resize(static_cast<size_t>(group) + 1);
  GroupLayout& g = groups_[static_cast<size_t>(group)];
  for (const auto& t : g.tensors) {
    if (t.name == name) return InvalidError("add_param '" + name + "': name already used in group " + std::to_string(group));
    if (std::find(t.aliases.begin(), t.aliases.end(), name) != t.aliases.end())
      return InvalidError("add_param '" + name + "': name already used in group " + std::to_string(group) +
                          ", as an alias of '" + t.name + "'");
  }
  if (numel > kMaxElements - g.numel)
    return InvalidError("add_param '" + name + "': group " + std::to_string(group) + " would have " +
                        std::to_string(g.numel + numel) + " elements; a group holds at most " +
                        std::to_string(kMaxElements));
  const uint64_t offset = g.numel;
  g.tensors.push_back({name, offset, numel, false, {}, {}});
  g.numel += numel;
  return offset;
}

void Partition::DropLast(int group) {
  GroupLayout& g = groups_[static_cast<size_t>(group)];
  g.numel -= g.tensors.back().numel;
  g.tensors.pop_back();
  while (!groups_.empty() && groups_.back().tensors.empty()) groups_.pop_back();
}

std::string ShapeString(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Result<uint64_t> Partition::AddShaped(int group, const std::string& name,
                                      const std::vector<uint64_t>& shape) {
  STRATA_RETURN_IF_ERROR(CheckName("add_param", name));  // first: the messages below show it
  const std::string what = "add_param '" + name + "': shape " + ShapeString(shape);
  if (shape.size() > kMaxShapeDims)
    return InvalidError(what + " has " + std::to_string(shape.size()) + " dims; at most " +
                        std::to_string(kMaxShapeDims) + " are allowed");
  uint64_t numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0)
      return InvalidError(what + ": dim " + std::to_string(i) +
                          " is 0 (a tensor with no elements cannot be registered)");
    if (shape[i] > kMaxElements / numel)
      return InvalidError(what + " has more than " + std::to_string(kMaxElements) + " elements");
    numel *= shape[i];
  }
  STRATA_ASSIGN_OR_RETURN(uint64_t offset, Add(group, name, numel));
  TensorSlot& t = groups_[static_cast<size_t>(group)].tensors.back();
  t.shaped = true;
  t.shape = shape;
  return offset;
}

Status Partition::AddAlias(int group, const std::string& alias, const std::string& of) {
  STRATA_RETURN_IF_ERROR(CheckName("add_alias", alias));  // first: the messages below show it
  const std::string what = "add_alias '" + alias + "' of '" + ForMessage(of) + "'";
  if (finalized_) return StateError(what + ": the engine is already built");
  if (group < 0 || static_cast<size_t>(group) >= groups_.size())
    return InvalidError(what + ": group " + std::to_string(group) + " has no tensors");
  GroupLayout& g = groups_[static_cast<size_t>(group)];
  TensorSlot* target = nullptr;
  for (auto& t : g.tensors) {
    if (t.name == alias || std::find(t.aliases.begin(), t.aliases.end(), alias) != t.aliases.end())
      return InvalidError(what + ": the name is already used in group " + std::to_string(group));
    if (t.name == of) target = &t;
  }
  if (!target) return InvalidError(what + ": group " + std::to_string(group) + " has no tensor '" + of + "'");
  if (target->aliases.size() >= kMaxTensorAliases)
    return InvalidError(what + ": '" + of + "' has " + std::to_string(kMaxTensorAliases) +
                        " aliases already, the most a tensor may have");
  target->aliases.push_back(alias);
  return Status::Ok();
}

Status Partition::Finalize(int world_size) {
  if (world_size < 1) return InvalidError("world size " + std::to_string(world_size) + " must be at least 1");
  if (groups_.empty()) return StateError("build: no parameters were added");
  for (size_t i = 0; i < groups_.size(); ++i)
    if (groups_[i].numel == 0)
      return StateError("build: group " + std::to_string(i) + " has no parameters (groups are numbered 0..n-1 without gaps)");
  const uint64_t unit = kShardAlign * static_cast<uint64_t>(world_size);
  for (auto& g : groups_) {
    g.padded = RoundUpTo(g.numel, unit);
    g.shard_numel = g.padded / static_cast<uint64_t>(world_size);
  }
  finalized_ = true;
  return Status::Ok();
}

uint64_t Partition::largest_group_numel() const {
  uint64_t m = 0;
  for (const auto& g : groups_) m = std::max(m, g.numel);
  return m;
}

uint64_t Partition::largest_shard_numel() const {
  uint64_t m = 0;
  for (const auto& g : groups_) m = std::max(m, g.shard_numel);
  return m;
}

uint64_t Partition::total_numel() const {
  uint64_t s = 0;
  for (const auto& g : groups_) s += g.numel;
  return s;
}

}  // namespace strata

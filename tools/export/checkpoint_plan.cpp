// Reads a checkpoint's manifest into a CheckpointPlan (see checkpoint_plan.h).
#include "tools/export/checkpoint_plan.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

namespace strata::exporter {

using Json = nlohmann::json;

namespace {

constexpr uint64_t kManifestLimit = 256ull << 20;

Result<std::string> ReadText(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return IoError("strata-export: cannot read " + path + " (" + std::strerror(errno) + ")");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (s.size() > kManifestLimit) return CorruptError("strata-export: " + path + " is implausibly large");
  return s;
}

bool IsFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// DIR/TAG holds manifest.json; DIR holds `latest` naming TAG.
Result<std::string> ResolveFolder(const std::string& path) {
  if (IsFile(path + "/manifest.json")) return path;
  if (!IsFile(path + "/latest"))
    return InvalidError("strata-export: " + path + " holds neither manifest.json (a checkpoint) nor latest (a checkpoint directory)");
  STRATA_ASSIGN_OR_RETURN(std::string tag, ReadText(path + "/latest"));
  while (!tag.empty() && (tag.back() == '\n' || tag.back() == ' ')) tag.pop_back();
  if (tag.empty() || tag.find('/') != std::string::npos || tag[0] == '.')
    return CorruptError("strata-export: " + path + "/latest names an invalid tag '" + tag + "'");
  return path + "/" + tag;
}

// Tensors must tile the group's real elements without overlap.
Status CheckTensors(GroupRef& g, size_t gi) {
  std::sort(g.tensors.begin(), g.tensors.end(), [](const TensorRef& a, const TensorRef& b) { return a.offset < b.offset; });
  uint64_t end = 0;
  for (const TensorRef& t : g.tensors) {
    if (t.numel == 0 || t.offset < end || t.offset + t.numel > g.numel)
      return CorruptError("tensor '" + t.name + "' of group " + std::to_string(gi) + " lies outside its group or overlaps another");
    end = t.offset + t.numel;
  }
  if (g.padded < g.numel || g.shard_numel == 0)
    return CorruptError("group " + std::to_string(gi) + " has an impossible layout");
  return Status::Ok();
}

// The W block of every group in one rank's file entry.
Status AddRankFile(const Json& fj, const std::string& folder, CheckpointPlan& plan) {
  const int rank = fj.at("rank").get<int>();
  const std::string name = fj.at("name").get<std::string>();
  if (name.empty() || name.find('/') != std::string::npos) return CorruptError("a data file named '" + name + "'");
  const std::string path = folder + "/" + name;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return IoError("cannot stat " + path + ": " + std::strerror(errno));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < fj.at("bytes").get<uint64_t>())
    return CorruptError(path + " is truncated: " + std::to_string(size) + " bytes, the manifest says " +
                        fj.at("bytes").dump());
  for (const Json& bj : fj.at("blocks")) {
    if (bj.at("state").get<std::string>() != "W") continue;
    const uint64_t g = bj.at("group").get<uint64_t>();
    if (g >= plan.groups.size()) return CorruptError(path + ": a block of group " + std::to_string(g) + ", which does not exist");
    GroupRef& gr = plan.groups[g];
    ShardRef s{path, bj.at("offset").get<uint64_t>(), bj.at("bytes").get<uint64_t>(), bj.at("xxh3").get<std::string>()};
    if (s.bytes != gr.shard_numel * 4) return CorruptError(path + ": the W block of group " + std::to_string(g) + " has the wrong size");
    if (s.offset + s.bytes > size || s.offset + s.bytes < s.offset)
      return CorruptError(path + " is truncated: the W block of group " + std::to_string(g) + " ends past its end");
    if (!gr.shards[static_cast<size_t>(rank)].path.empty())
      return CorruptError(path + ": two W blocks for group " + std::to_string(g));
    gr.shards[static_cast<size_t>(rank)] = std::move(s);
  }
  return Status::Ok();
}

Status Fill(const Json& m, CheckpointPlan& plan) {
  if (m.at("format") != "strata-checkpoint" || m.at("version").get<int>() != 1)
    return CorruptError("not a version 1 strata checkpoint");
  plan.world_size = m.at("world_size").get<int>();
  plan.shards = m.value("shard_world", plan.world_size);  // stage 0: one whole copy
  plan.step = m.value("step", int64_t{0});
  plan.tag = m.value("tag", std::string());
  if (plan.shards < 1 || plan.shards > (1 << 20)) return CorruptError("shard_world " + std::to_string(plan.shards));
  const auto ws = static_cast<uint64_t>(plan.shards);
  std::set<std::string> names;
  for (const Json& gj : m.at("groups")) {
    GroupRef g;
    g.numel = gj.at("numel").get<uint64_t>();
    g.padded = gj.at("padded").get<uint64_t>();
    g.shard_numel = gj.at("shard_numel").get<uint64_t>();
    for (const Json& tj : gj.at("tensors")) {
      g.tensors.push_back({tj.at("name").get<std::string>(), tj.at("offset").get<uint64_t>(), tj.at("numel").get<uint64_t>()});
      if (!names.insert(g.tensors.back().name).second)
        return InvalidError("tensor name '" + g.tensors.back().name + "' is used twice; safetensors needs unique names");
    }
    if (g.shard_numel * ws != g.padded) return CorruptError("group " + std::to_string(plan.groups.size()) + ": padded != shard_numel * shard_world");
    STRATA_RETURN_IF_ERROR(CheckTensors(g, plan.groups.size()));
    g.shards.resize(ws);
    plan.groups.push_back(std::move(g));
  }
  std::set<int> ranks;
  for (const Json& fj : m.at("files")) {
    const int r = fj.at("rank").get<int>();
    if (r < 0 || r >= plan.shards || !ranks.insert(r).second) return CorruptError("files list rank " + std::to_string(r) + " out of range or twice");
    STRATA_RETURN_IF_ERROR(AddRankFile(fj, plan.folder, plan));
  }
  for (size_t g = 0; g < plan.groups.size(); ++g)
    for (size_t r = 0; r < ws; ++r)
      if (plan.groups[g].shards[r].path.empty())
        return CorruptError("no W block of group " + std::to_string(g) + " for rank " + std::to_string(r) + " (a data file is missing from the manifest)");
  return Status::Ok();
}

}  // namespace

Result<CheckpointPlan> ReadCheckpointPlan(const std::string& path) {
  CheckpointPlan plan;
  STRATA_ASSIGN_OR_RETURN(plan.folder, ResolveFolder(path));
  const std::string mpath = plan.folder + "/manifest.json";
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(mpath));
  Status st;
  try {
    st = Fill(Json::parse(text), plan);
  } catch (const std::exception& e) {
    st = CorruptError(std::string("malformed manifest: ") + e.what());
  }
  if (!st.ok()) return st.WithContext("strata-export: " + mpath);
  return plan;
}

}  // namespace strata::exporter

// Reads a checkpoint's manifest into a CheckpointPlan (see checkpoint_plan.h).
#include "tools/export/checkpoint_plan.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include "engine/checkpoint/checkpoint_files.h"
#include "engine/format/manifest.h"

namespace strata::exporter {

namespace {

constexpr uint64_t kManifestLimit = 256ull << 20;

bool IsFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// DIR/TAG holds manifest.json; DIR holds checkpoints, of which the newest
// is taken as the engine's load takes it (ckpt::FindNewest): by save order,
// not by `latest` alone, which is one behind after a save killed between its
// rename and latest's update.
Result<std::string> ResolveFolder(const std::string& path) {
  if (IsFile(path + "/manifest.json")) return path;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return InvalidError("strata-export: " + path + " is not a folder (a checkpoint, or a folder of checkpoints)");
  std::string tag;
  manifest::Manifest m;
  Status found = ckpt::FindNewest(path, "strata-export", &tag, &m);
  if (found.code() == Code::kNotFound)
    return InvalidError("strata-export: " + path +
                        " holds neither manifest.json (a checkpoint) nor a checkpoint folder (a checkpoint directory)");
  STRATA_RETURN_IF_ERROR(found);
  return path + "/" + tag;
}

// The plan from a parsed manifest (engine/manifest checked its checksum and
// layout: tensors tile their groups, one file per shard in rank order, each
// holding a W block of every group (a P block of a frozen one) within its bytes).
Status Fill(const manifest::Manifest& m, CheckpointPlan& plan) {
  STRATA_RETURN_IF_ERROR(manifest::CheckFiles(m, plan.folder));
  plan.world_size = m.world_size;
  plan.shards = m.shard_world;
  plan.step = m.step;
  plan.tag = m.tag;
  plan.compact = m.state_format == "compact";
  for (const manifest::Group& mg : m.groups)
    if (mg.frozen) {  // the manifest's parse checked that it names an element type
      STRATA_ASSIGN_OR_RETURN(plan.p_dtype, ParseDType(m.compute_dtype));
      break;
    }
  std::set<std::string> names;
  for (const manifest::Group& mg : m.groups) {
    GroupRef g;
    g.numel = mg.numel;
    g.padded = mg.padded;
    g.shard_numel = mg.shard_numel;
    for (const manifest::Tensor& t : mg.tensors) {
      if (!names.insert(t.name).second)
        return InvalidError("tensor name '" + t.name + "' is used twice; safetensors needs unique names");
      for (const std::string& a : t.aliases)
        if (!names.insert(a).second)
          return InvalidError("tensor name '" + a + "' (an alias of '" + t.name +
                              "') is used twice; safetensors needs unique names");
      // A tensor saved without a shape (registered by numel, or by an older
      // engine) is exported flat. The manifest's parse checked a shape's product.
      g.tensors.push_back(
          {t.name, t.offset, t.numel, t.shaped ? t.shape : std::vector<uint64_t>{t.numel}, t.aliases});
    }
    g.shards.resize(static_cast<size_t>(m.shard_world));
    g.frozen = mg.frozen;
    plan.groups.push_back(std::move(g));
  }
  for (const manifest::File& f : m.files)
    for (const manifest::Block& b : f.blocks)
      if (b.state == 0 || b.state == manifest::kSavedP)  // W (a frozen group: P)
        plan.groups[b.group].shards[static_cast<size_t>(f.rank)] =
            ShardRef{plan.folder + "/" + f.name, b.offset, b.bytes, manifest::Hex(b.xxh3)};
  return Status::Ok();
}

}  // namespace

Result<CheckpointPlan> ReadCheckpointPlan(const std::string& path) {
  CheckpointPlan plan;
  STRATA_ASSIGN_OR_RETURN(plan.folder, ResolveFolder(path));
  const std::string mpath = plan.folder + "/manifest.json";
  auto read = ckpt::ReadSmallFile(mpath, kManifestLimit);  // a regular file within the limit, checked first
  if (!read.ok()) return read.status().WithContext("strata-export");
  const std::string text = std::move(read).value();
  auto m = manifest::Parse(text, mpath);
  if (!m.ok()) return m.status().WithContext("strata-export");
  Status st = Fill(*m, plan);
  if (!st.ok()) return st.WithContext("strata-export: " + mpath);
  return plan;
}

}  // namespace strata::exporter

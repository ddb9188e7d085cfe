// The checkpoint manifest: parse, verify its checksum, check its layout.
// The JSON comes from disk: every field is type- and range-checked here, so
// that nothing downstream can index, allocate or seek by an unchecked value.
#include "engine/format/manifest.h"

#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <nlohmann/json.hpp>
#include "base/dtype.h"
#include "kernels/cpu/compact.h"
#include <set>

namespace strata::manifest {

using Json = nlohmann::json;

namespace {

constexpr uint64_t kMaxGroups = 1'000'001, kMaxElements = 1ull << 40, kMaxWorld = 1 << 20;
constexpr const char* kChecksumKey = "manifest_xxh3";
const std::set<std::string> kTopKeys = {"format", "version", "tag", "world_size", "shard_world", "stage",
                                        "compute_dtype", "optimizer", "state_format", "step", "save_seq", "loss_scaler",
                                        "groups", "files", "trainer_blob", kChecksumKey};

// Field readers: `where` says which field for the error; a wrong type or a
// missing field is CORRUPT.
struct Reader {
  const std::string& path;
  Status Bad(const std::string& where, const std::string& why) const {
    return CorruptError("checkpoint manifest " + path + ": " + where + " " + why);
  }
  Result<const Json*> Field(const Json& j, const char* key, const std::string& where) const {
    if (!j.is_object()) return Bad(where, "is not an object");
    auto it = j.find(key);
    if (it == j.end()) return Bad(where + "." + key, "is missing");
    return &*it;
  }
  Result<uint64_t> U64(const Json& j, const char* key, const std::string& where, uint64_t max) const {
    STRATA_ASSIGN_OR_RETURN(const Json* v, Field(j, key, where));
    if (!v->is_number_unsigned()) return Bad(where + "." + key, "is not a non-negative integer: " + v->dump());
    const uint64_t x = v->get<uint64_t>();
    if (x > max) return Bad(where + "." + key, "is " + std::to_string(x) + ", more than " + std::to_string(max));
    return x;
  }
  Result<std::string> Str(const Json& j, const char* key, const std::string& where) const {
    STRATA_ASSIGN_OR_RETURN(const Json* v, Field(j, key, where));
    if (!v->is_string()) return Bad(where + "." + key, "is not a string");
    return v->get<std::string>();
  }
  Result<uint64_t> Hash(const Json& j, const char* key, const std::string& where) const {
    STRATA_ASSIGN_OR_RETURN(std::string s, Str(j, key, where));
    uint64_t h = 0;
    if (s.size() != 16) return Bad(where + "." + key, "is not 16 hex digits: '" + s + "'");
    for (char c : s) {
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) return Bad(where + "." + key, "is not 16 hex digits: '" + s + "'");
      h = h << 4 | static_cast<uint64_t>(d);
    }
    return h;
  }
  Result<const Json*> Array(const Json& j, const char* key, const std::string& where, uint64_t max) const {
    STRATA_ASSIGN_OR_RETURN(const Json* v, Field(j, key, where));
    if (!v->is_array()) return Bad(where + "." + key, "is not an array");
    if (v->size() > max) return Bad(where + "." + key, "has " + std::to_string(v->size()) + " entries");
    return v;
  }
};

bool PlainName(const std::string& n) {
  return !n.empty() && n.size() <= 255 && n != "." && n != ".." && n.find('/') == std::string::npos &&
         n.find('\0') == std::string::npos;
}

// Verifies and removes the manifest's own checksum. Sets m->sealed.
Status CheckSeal(Json& j, const Reader& r, Manifest* m) {
  auto it = j.find(kChecksumKey);
  if (it == j.end()) return Status::Ok();  // written before manifests carried one
  STRATA_ASSIGN_OR_RETURN(uint64_t want, r.Hash(j, kChecksumKey, "manifest"));
  j.erase(kChecksumKey);
  const std::string canon = j.dump();
  const uint64_t got = XXH3_64bits(canon.data(), canon.size());
  if (got != want)
    return CorruptError("checkpoint manifest " + r.path + " is damaged: its checksum " + Hex(want) +
                        " does not match its contents (" + Hex(got) + ")");
  m->sealed = true;
  return Status::Ok();
}

Status ReadScalars(const Json& j, const Reader& r, Manifest* m) {
  for (const auto& [key, value] : j.items())
    if (!kTopKeys.count(key)) return r.Bad("key '" + key + "'", "is not a manifest field");
  STRATA_ASSIGN_OR_RETURN(std::string format, r.Str(j, "format", "manifest"));
  STRATA_ASSIGN_OR_RETURN(uint64_t version, r.U64(j, "version", "manifest", 1u << 30));
  if (format != "strata-checkpoint" || version != kFormatVersion)
    return r.Bad("format", "is not a version " + std::to_string(kFormatVersion) + " strata checkpoint");
  STRATA_ASSIGN_OR_RETURN(m->tag, r.Str(j, "tag", "manifest"));
  STRATA_ASSIGN_OR_RETURN(uint64_t world, r.U64(j, "world_size", "manifest", kMaxWorld));
  if (world < 1) return r.Bad("world_size", "is 0");
  m->world_size = static_cast<int>(world);
  uint64_t shards = world;  // older manifests: one shard per rank
  if (j.contains("shard_world")) {
    STRATA_ASSIGN_OR_RETURN(shards, r.U64(j, "shard_world", "manifest", kMaxWorld));
  }
  if (shards != 1 && shards != world)
    return r.Bad("shard_world", "is " + std::to_string(shards) + "; it must be 1 or world_size " + std::to_string(world));
  m->shard_world = static_cast<int>(shards);
  STRATA_ASSIGN_OR_RETURN(uint64_t stage, r.U64(j, "stage", "manifest", 3));
  m->stage = static_cast<int>(stage);
  STRATA_ASSIGN_OR_RETURN(m->compute_dtype, r.Str(j, "compute_dtype", "manifest"));
  STRATA_ASSIGN_OR_RETURN(m->optimizer, r.Str(j, "optimizer", "manifest"));
  if (j.contains("state_format")) {
    STRATA_ASSIGN_OR_RETURN(m->state_format, r.Str(j, "state_format", "manifest"));
    if (m->state_format != "fp32" && m->state_format != "compact")
      return r.Bad("state_format", "'" + m->state_format + "' is not one of fp32, compact");
  }
  // (At most INT64_MAX - 1: the next step's count must be one, as set_steps
  // refuses INT64_MAX; the step after a load of INT64_MAX overflowed.)
  STRATA_ASSIGN_OR_RETURN(uint64_t step, r.U64(j, "step", "manifest", INT64_MAX - 1));
  m->step = static_cast<int64_t>(step);
  if (j.contains("save_seq")) {
    STRATA_ASSIGN_OR_RETURN(m->save_seq, r.U64(j, "save_seq", "manifest", UINT64_MAX));
  }
  STRATA_ASSIGN_OR_RETURN(const Json* ls, r.Field(j, "loss_scaler", "manifest"));
  STRATA_ASSIGN_OR_RETURN(const Json* scale, r.Field(*ls, "scale", "loss_scaler"));
  if (!scale->is_number() || !std::isfinite(scale->get<double>()) || scale->get<double>() <= 0)
    return r.Bad("loss_scaler.scale", "is not a finite number > 0: " + scale->dump());
  m->loss_scale = scale->get<double>();
  STRATA_ASSIGN_OR_RETURN(uint64_t hyst, r.U64(*ls, "hysteresis_left", "loss_scaler", INT32_MAX));
  m->hysteresis_left = static_cast<int>(hyst);
  STRATA_ASSIGN_OR_RETURN(uint64_t clean, r.U64(*ls, "clean_steps", "loss_scaler", INT64_MAX));
  m->clean_steps = static_cast<int64_t>(clean);
  STRATA_ASSIGN_OR_RETURN(const Json* blob, r.Field(j, "trainer_blob", "manifest"));
  STRATA_ASSIGN_OR_RETURN(m->blob_file, r.Str(*blob, "file", "trainer_blob"));
  if (!PlainName(m->blob_file)) return r.Bad("trainer_blob.file", "'" + m->blob_file + "' is not a file name");
  STRATA_ASSIGN_OR_RETURN(m->blob_bytes, r.U64(*blob, "bytes", "trainer_blob", kMaxBlobBytes));
  STRATA_ASSIGN_OR_RETURN(m->blob_xxh3, r.Hash(*blob, "xxh3", "trainer_blob"));
  return Status::Ok();
}

// A tensor's optional "shape": at most kMaxDims dims, each at least 1, whose
// product (checked without overflow) is its numel.
Status ReadShape(const Json& e, const Reader& r, const std::string& where, Tensor* T) {
  if (!e.contains("shape")) return Status::Ok();  // registered by numel, or saved before shapes were kept
  STRATA_ASSIGN_OR_RETURN(const Json* sj, r.Array(e, "shape", where, kMaxDims));
  uint64_t product = 1;
  for (size_t i = 0; i < sj->size(); ++i) {
    const Json& d = (*sj)[i];
    const std::string dw = where + ".shape[" + std::to_string(i) + "]";
    if (!d.is_number_unsigned() || d.get<uint64_t>() < 1 || d.get<uint64_t>() > kMaxElements)
      return r.Bad(dw, "is not an integer in 1.." + std::to_string(kMaxElements) + ": " + d.dump());
    const uint64_t x = d.get<uint64_t>();
    if (x > kMaxElements / product)
      return r.Bad(where + ".shape", "has more than " + std::to_string(kMaxElements) + " elements");
    product *= x;
    T->shape.push_back(x);
  }
  if (product != T->numel)
    return r.Bad(where + ".shape",
                 "has " + std::to_string(product) + " elements; numel is " + std::to_string(T->numel));
  T->shaped = true;
  return Status::Ok();
}

// Tensors tile [0, numel) in order; shards tile the padded group.
Status ReadGroups(const Json& j, const Reader& r, Manifest* m) {
  STRATA_ASSIGN_OR_RETURN(const Json* gj, r.Array(j, "groups", "manifest", kMaxGroups));
  if (gj->empty()) return r.Bad("groups", "is empty");
  for (size_t g = 0; g < gj->size(); ++g) {
    const std::string where = "groups[" + std::to_string(g) + "]";
    const Json& e = (*gj)[g];
    Group G;
    STRATA_ASSIGN_OR_RETURN(G.numel, r.U64(e, "numel", where, kMaxElements));
    STRATA_ASSIGN_OR_RETURN(G.padded, r.U64(e, "padded", where, 2 * kMaxElements));
    STRATA_ASSIGN_OR_RETURN(G.shard_numel, r.U64(e, "shard_numel", where, 2 * kMaxElements));
    if (G.numel == 0 || G.padded < G.numel || G.shard_numel * static_cast<uint64_t>(m->shard_world) != G.padded)
      return r.Bad(where, "has an impossible layout: numel " + std::to_string(G.numel) + ", padded " +
                              std::to_string(G.padded) + ", shard_numel " + std::to_string(G.shard_numel) + " for " +
                              std::to_string(m->shard_world) + " shards");
    if (e.contains("frozen")) {
      if (!e["frozen"].is_boolean()) return r.Bad(where + ".frozen", "is not true or false: " + e["frozen"].dump());
      G.frozen = e["frozen"].get<bool>();
    }
    if (e.contains("steps")) {
      STRATA_ASSIGN_OR_RETURN(uint64_t steps, r.U64(e, "steps", where, INT64_MAX - 1));
      G.steps = static_cast<int64_t>(steps);
    }
    STRATA_ASSIGN_OR_RETURN(const Json* tj, r.Array(e, "tensors", where, G.numel));
    std::set<std::string> names;
    uint64_t end = 0;
    for (size_t t = 0; t < tj->size(); ++t) {
      const std::string tw = where + ".tensors[" + std::to_string(t) + "]";
      Tensor T;
      STRATA_ASSIGN_OR_RETURN(T.name, r.Str((*tj)[t], "name", tw));
      STRATA_ASSIGN_OR_RETURN(T.offset, r.U64((*tj)[t], "offset", tw, kMaxElements));
      STRATA_ASSIGN_OR_RETURN(T.numel, r.U64((*tj)[t], "numel", tw, kMaxElements));
      if (T.name.empty() || !names.insert(T.name).second) return r.Bad(tw + ".name", "is empty or used twice");
      STRATA_RETURN_IF_ERROR(ReadShape((*tj)[t], r, tw, &T));
      if ((*tj)[t].contains("aliases")) {  // a tied weight's other names
        STRATA_ASSIGN_OR_RETURN(const Json* aj, r.Array((*tj)[t], "aliases", tw, kMaxAliases));
        for (size_t a = 0; a < aj->size(); ++a) {
          const std::string aw = tw + ".aliases[" + std::to_string(a) + "]";
          if (!(*aj)[a].is_string() || (*aj)[a].get<std::string>().empty())
            return r.Bad(aw, "is not a non-empty string: " + (*aj)[a].dump());
          T.aliases.push_back((*aj)[a].get<std::string>());
        }
      }
      if (T.numel == 0 || T.offset != end) return r.Bad(tw, "does not follow the previous tensor");
      end += T.numel;
      G.tensors.push_back(std::move(T));
    }
    if (end != G.numel) return r.Bad(where, "has tensors of " + std::to_string(end) + " elements, not numel");
    for (const Tensor& T : G.tensors)  // aliases are names too: unique in the group
      for (const std::string& a : T.aliases)
        if (!names.insert(a).second) return r.Bad(where, "uses the name '" + a + "' twice (as a tensor or an alias)");
    m->groups.push_back(std::move(G));
  }
  return Status::Ok();
}

Result<Block> ReadBlock(const Json& e, const Reader& r, const Manifest& m, const std::string& where) {
  Block b;
  STRATA_ASSIGN_OR_RETURN(b.group, r.U64(e, "group", where, m.groups.size() - 1));
  STRATA_ASSIGN_OR_RETURN(std::string state, r.Str(e, "state", where));
  b.state = -1;
  for (int s = 0; s < kNumBlockStates; ++s)
    if (state == SavedStateName(s)) b.state = s;
  if (b.state < 0) return r.Bad(where + ".state", "'" + state + "' is not one of W, M, V, P");
  const Group& G = m.groups[b.group];
  if ((b.state == kSavedP) != G.frozen)
    return r.Bad(where + ".state", "'" + state + "' in group " + std::to_string(b.group) + ", which is " +
                                       (G.frozen ? "frozen (it holds P alone)" : "not frozen (P is for frozen groups)"));
  STRATA_ASSIGN_OR_RETURN(b.offset, r.U64(e, "offset", where, UINT64_MAX));
  STRATA_ASSIGN_OR_RETURN(b.bytes, r.U64(e, "bytes", where, UINT64_MAX));
  STRATA_ASSIGN_OR_RETURN(b.xxh3, r.Hash(e, "xxh3", where));
  uint64_t want = 0;
  if (b.state == kSavedP) {  // the parameters, in the compute dtype
    auto dt = ParseDType(m.compute_dtype);
    if (!dt.ok()) return r.Bad("compute_dtype", "'" + m.compute_dtype + "' is not an element type (f32, bf16, f16)");
    want = G.shard_numel * DTypeSize(*dt);
  } else {
    want = SavedBlockBytes(m.state_format == "compact", b.state, G.shard_numel);
  }
  if (b.bytes != want)
    return r.Bad(where + ".bytes", "is " + std::to_string(b.bytes) + "; a shard of group " + std::to_string(b.group) +
                                       " in the " + m.state_format + " format is " + std::to_string(want));
  return b;
}

// Blocks lie within the file and do not overlap; a copied file's tile it.
Status CheckBlockPlaces(const File& f, const Reader& r, const std::string& where) {
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const Block& b : f.blocks) {
    if (b.offset > f.bytes || b.bytes > f.bytes - b.offset)
      return r.Bad(where, "has a block at offset " + std::to_string(b.offset) + " of " + std::to_string(b.bytes) +
                              " bytes past its " + std::to_string(f.bytes) + " bytes");
    spans.emplace_back(b.offset, b.bytes);
  }
  std::sort(spans.begin(), spans.end());
  uint64_t end = 0;
  for (const auto& [off, len] : spans) {
    if (off < end) return r.Bad(where, "has blocks that overlap at offset " + std::to_string(off));
    if (!f.hash_of_blocks && off != end) return r.Bad(where, "has a gap before offset " + std::to_string(off));
    end = off + len;
  }
  if (!f.hash_of_blocks && end != f.bytes) return r.Bad(where + ".bytes", "is not the sum of its blocks");
  return Status::Ok();
}

// One file per shard (any order; sorted by rank here); each holds the same
// states of every group.
Status ReadFiles(const Json& j, const Reader& r, Manifest* m) {
  STRATA_ASSIGN_OR_RETURN(const Json* fj, r.Array(j, "files", "manifest", kMaxWorld));
  if (fj->size() != static_cast<size_t>(m->shard_world))
    return r.Bad("files", "lists " + std::to_string(fj->size()) + " data files for " +
                              std::to_string(m->shard_world) + " shards");
  std::set<std::string> names;
  std::set<uint64_t> ranks;  // a permutation of 0..shard_world-1: each shard's file once
  for (size_t k = 0; k < fj->size(); ++k) {
    const std::string where = "files[" + std::to_string(k) + "]";
    const Json& e = (*fj)[k];
    File f;
    STRATA_ASSIGN_OR_RETURN(f.name, r.Str(e, "name", where));
    if (!PlainName(f.name) || f.name == m->blob_file || !names.insert(f.name).second)
      return r.Bad(where + ".name", "'" + f.name + "' is not a distinct file name");
    STRATA_ASSIGN_OR_RETURN(uint64_t rank, r.U64(e, "rank", where, static_cast<uint64_t>(m->shard_world) - 1));
    if (!ranks.insert(rank).second) return r.Bad(where + ".rank", "repeats rank " + std::to_string(rank));
    f.rank = static_cast<int>(rank);
    STRATA_ASSIGN_OR_RETURN(f.bytes, r.U64(e, "bytes", where, UINT64_MAX));
    STRATA_ASSIGN_OR_RETURN(f.xxh3, r.Hash(e, "xxh3", where));
    if (e.contains("hash")) {
      STRATA_ASSIGN_OR_RETURN(std::string h, r.Str(e, "hash", where));
      if (h != "file" && h != "blocks") return r.Bad(where + ".hash", "'" + h + "' is not file or blocks");
      f.hash_of_blocks = h == "blocks";
    }
    STRATA_ASSIGN_OR_RETURN(const Json* bj, r.Array(e, "blocks", where, m->groups.size() * kNumSaved));
    std::vector<uint32_t> have(m->groups.size(), 0);  // bit s: group holds state s
    for (size_t i = 0; i < bj->size(); ++i) {
      const std::string bw = where + ".blocks[" + std::to_string(i) + "]";
      STRATA_ASSIGN_OR_RETURN(Block b, ReadBlock((*bj)[i], r, *m, bw));
      if (have[b.group] & (1u << b.state)) return r.Bad(bw, "repeats state " + std::string(SavedStateName(b.state)) +
                                                                 " of group " + std::to_string(b.group));
      have[b.group] |= 1u << b.state;
      f.blocks.push_back(b);
    }
    // The states of the first group that is not frozen are every such group's.
    size_t first = 0;
    while (first < have.size() && m->groups[first].frozen) ++first;
    if (k == 0) m->saved_states = first < have.size() ? have[first] : 0;
    if (first < have.size() && !(m->saved_states & 1u))
      return r.Bad(where, "holds no W of group " + std::to_string(first));
    for (size_t g = 0; g < have.size(); ++g) {
      const uint32_t want = m->groups[g].frozen ? 1u << kSavedP : m->saved_states;
      if (have[g] != want)
        return r.Bad(where, "holds other states of group " + std::to_string(g) +
                                (m->groups[g].frozen ? " than P (it is frozen)"
                                                     : " than of group " + std::to_string(first)) +
                                " (a block is missing)");
    }
    STRATA_RETURN_IF_ERROR(CheckBlockPlaces(f, r, where));
    m->files.push_back(std::move(f));
  }
  std::sort(m->files.begin(), m->files.end(), [](const File& a, const File& b) { return a.rank < b.rank; });
  return Status::Ok();
}

}  // namespace

const char* SavedStateName(int s) {
  static const char* const kNames[kNumBlockStates] = {"W", "M", "V", "P"};
  return s >= 0 && s < kNumBlockStates ? kNames[s] : "?";
}

std::string Hex(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

std::string Seal(const std::string& json_text) {
  Json j = Json::parse(json_text);
  j.erase(kChecksumKey);
  const std::string canon = j.dump();
  j[kChecksumKey] = Hex(XXH3_64bits(canon.data(), canon.size()));
  return j.dump(1);
}

Result<Manifest> Parse(std::string_view text, const std::string& path) {
  Reader r{path};
  Json j;
  // A manifest nests a few levels (groups, tensors, shapes); one nested
  // thousands deep (damaged, or made to harm) would overflow the stack in
  // the recursive dump() of the seal check: refused while parsing.
  constexpr int kMaxDepth = 32;
  bool too_deep = false;
  try {
    j = Json::parse(text.begin(), text.end(), [&](int depth, Json::parse_event_t, const Json&) {
      if (depth > kMaxDepth) {
        too_deep = true;
        throw std::length_error("nested too deep");
      }
      return true;
    });
  } catch (const std::exception& e) {
    if (too_deep)
      return CorruptError("checkpoint manifest " + path + " nests deeper than " + std::to_string(kMaxDepth) +
                          " levels: not a manifest");
    return CorruptError("checkpoint manifest " + path + " is not valid JSON: " + e.what());
  }
  if (!j.is_object()) return r.Bad("manifest", "is not a JSON object");
  Manifest m;
  try {  // the readers check types before every get; this is the backstop
    STRATA_RETURN_IF_ERROR(CheckSeal(j, r, &m));
    STRATA_RETURN_IF_ERROR(ReadScalars(j, r, &m));
    STRATA_RETURN_IF_ERROR(ReadGroups(j, r, &m));
    STRATA_RETURN_IF_ERROR(ReadFiles(j, r, &m));
  } catch (const std::exception& e) {
    return CorruptError("checkpoint manifest " + path + " is malformed: " + e.what());
  }
  return m;
}

Status CheckFiles(const Manifest& m, const std::string& folder) {
  auto size_of = [](const std::string& p, uint64_t* size) -> Status {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) {
      if (errno == ENOENT) return CorruptError("checkpoint: " + p + " is missing");
      return PosixError("checkpoint: stat", p, errno);  // the machine's error (EACCES, EIO...), not the file's
    }
    if (!S_ISREG(st.st_mode)) return CorruptError("checkpoint: " + p + " is not a regular file");
    *size = static_cast<uint64_t>(st.st_size);
    return Status::Ok();
  };
  for (const File& f : m.files) {
    const std::string p = folder + "/" + f.name;
    uint64_t size = 0;
    STRATA_RETURN_IF_ERROR(size_of(p, &size));
    if (size < f.bytes)
      return CorruptError("checkpoint: " + p + " is truncated: " + std::to_string(size) + " bytes, the manifest says " +
                          std::to_string(f.bytes));
  }
  return Status::Ok();
}

int SavedArrays(bool compact, int s, uint64_t n, SavedArray out[2]) {
  if (!compact) {
    out[0] = {0, 4, 1};
    return 1;
  }
  if (s == 0) {
    out[0] = {0, 2, 1};
    out[1] = {2 * n, 1, 1};
  } else {
    out[0] = {0, 1, 1};
    out[1] = {n, 4, kernels::kCompactBlock};
  }
  return 2;
}

uint64_t SavedBlockBytes(bool compact, int s, uint64_t n) {
  SavedArray a[2];
  const int k = SavedArrays(compact, s, n, a);
  const SavedArray& last = a[k - 1];
  const uint64_t end = last.offset + (n + last.per - 1) / last.per * last.unit;
  return compact ? (end + kCompactBlockAlign - 1) / kCompactBlockAlign * kCompactBlockAlign : end;
}

}  // namespace strata::manifest

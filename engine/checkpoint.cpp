// Checkpoints: this rank's W, M, V streamed from their home tiers into one
// data file through the io engine (state on NVMe goes swap file -> host slot
// -> checkpoint file, never through the device), plus a JSON manifest with
// the layout and XXH3 checksums, written in an order that survives a crash:
//   DIR/.TAG.partial/{rankNNNNN.bin, trainer.bin} written and fsynced
//   -> manifest.json.tmp fsynced, renamed to manifest.json, folder fsynced
//   -> .TAG.partial renamed to TAG, DIR fsynced
//   -> DIR/latest.tmp (the tag) fsynced, renamed to DIR/latest, DIR fsynced.
// STRATA_CHECKPOINT_KILL_AT=data|manifest|rename|latest aborts the process
// right after that point (crash tests).
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <tuple>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/align.h"
#include "base/log.h"
#include "base/sizes.h"
#include "engine/engine_impl.h"
#include "io/direct_file.h"
#include "kernels/cpu/cast.h"

namespace strata {

using Json = nlohmann::json;
static constexpr int kFormatVersion = 1;
static const int kSaved[] = {int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)};

namespace {

void KillPoint(const char* name) {
  const char* at = std::getenv("STRATA_CHECKPOINT_KILL_AT");
  if (at && std::strcmp(at, name) == 0) {
    std::fprintf(stderr, "strata: STRATA_CHECKPOINT_KILL_AT=%s: aborting here\n", name);
    std::_Exit(86);
  }
}

std::string Hex(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

Status FsyncPath(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return PosixError("open for fsync", path, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return PosixError("fsync", path, err);
  return Status::Ok();
}

// Reads exactly `bytes` at `off` of `fd` (the file `path`): a short file is
// CORRUPT, naming where it ends.
Status PreadFull(int fd, void* buf, uint64_t bytes, uint64_t off, const std::string& path) {
  for (uint64_t done = 0; done < bytes;) {
    const ssize_t n = ::pread(fd, static_cast<char*>(buf) + done, bytes - done, static_cast<off_t>(off + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PosixError("checkpoint load: pread", path, off + done, bytes - done, errno);
    if (n == 0) return CorruptError("checkpoint load: " + path + " ends early at offset " + std::to_string(off + done));
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

// Writes `bytes` to `path` (created, truncated), fsyncs it.
Status WriteSmallFile(const std::string& path, const void* data, uint64_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return PosixError("create", path, errno);
  const char* p = static_cast<const char*>(data);
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::write(fd, p + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      return PosixError("write", path, done, bytes - done, err);
    }
    done += static_cast<uint64_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return PosixError("fsync", path, err);
  }
  if (::close(fd) != 0) return PosixError("close", path, errno);
  return Status::Ok();
}

// Writes `text` to path.tmp, fsyncs, renames to path, fsyncs the folder.
Status ReplaceFile(const std::string& folder, const std::string& name, const std::string& text) {
  const std::string tmp = folder + "/" + name + ".tmp", dst = folder + "/" + name;
  STRATA_RETURN_IF_ERROR(WriteSmallFile(tmp, text.data(), text.size()));
  if (::rename(tmp.c_str(), dst.c_str()) != 0) return PosixError("rename " + tmp + " to", dst, errno);
  return FsyncPath(folder);
}

Result<std::string> ReadSmallFile(const std::string& path, uint64_t limit) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return CorruptError("checkpoint: cannot read " + path + " (" + std::strerror(errno) + ")");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (s.size() > limit) return CorruptError("checkpoint: " + path + " is larger than " + FormatBytes(limit));
  return s;
}

bool ValidTag(const std::string& t) {
  if (t.empty() || t.size() > 200 || t == "latest" || t[0] == '.') return false;
  for (char c : t)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') return false;
  return true;
}

std::string RankFile(int rank) {
  char b[32];
  std::snprintf(b, sizeof b, "rank%05d.bin", rank);
  return b;
}

}  // namespace

Status Engine::Impl::CheckBetweenSteps(const char* call, bool recovers) {
  if (!built_) return StateError(std::string(call) + ": the engine is not built");
  if (!recovers) STRATA_RETURN_IF_ERROR(CheckUsable(call, false));
  for (int g = 0; g < part_.num_groups(); ++g) {
    const GroupState& gs = groups_[static_cast<size_t>(g)];
    if (gs.dev.pins > 0) return StateError(std::string(call) + ": group " + std::to_string(g) + " is fetched");
    if (gs.grad_calls > 0 && !(recovers && (pending_ || !broken_.empty())))  // a load abandons a failed step's gradients
      return StateError(std::string(call) + ": gradients of group " + std::to_string(g) +
                        " are pending; save or load between steps");
  }
  WaitPrefetchIdle();
  return Status::Ok();
}

// Every rank learns whether every rank succeeded; a failure elsewhere names its rank.
Status Engine::Impl::Agree(const Status& local, const std::string& what) {
  if (!multi()) return local;
  const int w = comm_->world_size(), r = comm_->rank();
  std::vector<int32_t> codes(static_cast<size_t>(w));
  codes[static_cast<size_t>(r)] = local.ok() ? 0 : 1 + static_cast<int32_t>(local.code());
  comm_->SetLabel(what);
  Status st = comm_->AllGather(&codes[static_cast<size_t>(r)], codes.data(), sizeof(int32_t));
  if (!st.ok()) return st.WithContext(what);
  if (!local.ok()) return local;
  for (int k = 0; k < w; ++k)
    if (codes[static_cast<size_t>(k)])
      return Status(static_cast<Code>(codes[static_cast<size_t>(k)] - 1), what + ": failed on rank " + std::to_string(k) + " (see its log)");
  return Status::Ok();
}

// Writes this rank's shard of every group's W, M, V to `data_path`, returning
// its manifest entry. A pipeline over K staging slots: the reads of the next
// K-2 groups and the writes of the last one or two are in flight while a
// group's blocks are hashed, so the disk always has both queues full. A block
// read from NVMe brings the checksum the tier verified; it is not hashed again.
Result<std::string> Engine::Impl::WriteShardFile(const std::string& data_path, const std::string& name) {
  const int n = part_.num_groups();
  std::vector<uint64_t> offset(static_cast<size_t>(n) + 1, 0);
  for (int g = 0; g < n; ++g) {
    uint64_t bytes = 0;
    for (int s : kSaved)
      if (groups_[static_cast<size_t>(g)].blocks[static_cast<size_t>(s)].alloc.charged) bytes += part_.group(g).shard_numel * 4;
    offset[static_cast<size_t>(g) + 1] = offset[static_cast<size_t>(g)] + bytes;
  }
  const uint64_t total = offset[static_cast<size_t>(n)];
  STRATA_ASSIGN_OR_RETURN(FileId fid, storage_->Open(data_path, OpenMode::kCreate));
  Status st = ReserveFileSpace(storage_->Info(fid).fd, data_path, total);
  struct Job {
    void* slot = nullptr;
    const void* src[kNumStates] = {};
    BlockMove loads[kNumStates];
    IoTicket write;
  };
  std::vector<Job> jobs(static_cast<size_t>(n));
  auto keep = [&](Status s) { if (st.ok() && !s.ok()) st = std::move(s); };
  auto start = [&](int g) {  // the group's blocks: addressable in place, or read into a slot
    Job& j = jobs[static_cast<size_t>(g)];
    for (int s : kSaved) {
      const StateBlock& b = groups_[static_cast<size_t>(g)].blocks[static_cast<size_t>(s)];
      if (!b.alloc.charged) continue;
      if (io_->Direct(b)) { j.src[s] = io_->DirectPtr(b); continue; }
      if (!j.slot) j.slot = opt_staging_.Acquire();
      void* dst = static_cast<char*>(j.slot) + opt_slot_offsets_[s];
      j.src[s] = dst;
      auto m = io_->StartLoad(b, dst);
      if (m.ok()) j.loads[s] = std::move(m).value();
      else keep(m.status());
    }
  };
  auto retire = [&](int g) {  // its write done, its slot free
    Job& j = jobs[static_cast<size_t>(g)];
    if (j.write) keep(j.write->Wait());
    j.write.reset();
    if (j.slot) opt_staging_.Release(j.slot);
    j.slot = nullptr;
  };
  const int ahead = std::max(opt_staging_.count(), 3) - 2;  // groups read ahead
  for (int g = 0; g < std::min(ahead, n); ++g) start(g);
  Json blocks = Json::array();
  XXH3_state_t* hs = XXH3_createState();
  XXH3_64bits_reset(hs);
  for (int g = 0; g < n && st.ok(); ++g) {
    Job& j = jobs[static_cast<size_t>(g)];
    std::vector<IoOp> ops;
    uint64_t off = offset[static_cast<size_t>(g)];
    for (int s : kSaved) {
      const StateBlock& b = groups_[static_cast<size_t>(g)].blocks[static_cast<size_t>(s)];
      if (!b.alloc.charged) continue;
      const uint64_t bytes = part_.group(g).shard_numel * 4;
      const bool verified = j.loads[s].kind == BlockMove::kNvme && config_.strata.checksums;
      const uint64_t tier_hash = verified ? j.loads[s].nvme.checksum : 0;
      keep(io_->Finish(j.loads[s]));
      if (!st.ok()) break;
      const uint64_t h = verified ? tier_hash : XXH3_64bits(j.src[s], bytes);
      XXH3_64bits_update(hs, j.src[s], bytes);
      blocks.push_back({{"group", g}, {"state", StateName(StateKind(s))}, {"offset", off}, {"bytes", bytes}, {"xxh3", Hex(h)}});
      ops.push_back(IoOp{IoOp::kWrite, fid, off, const_cast<void*>(j.src[s]), bytes});
      stats_->AddMoved(b.home == TierKind::kNvme ? TierKind::kNvme : TierKind::kHost, TierKind::kNvme, bytes);
      off += bytes;
    }
    if (!st.ok()) break;
    j.write = storage_->Submit(ops);
    if (g >= 1) retire(g - 1);  // frees the slot the next read-ahead takes
    if (g + ahead < n) start(g + ahead);
  }
  // Drain whatever is still in flight, whatever happened.
  for (int g = 0; g < n; ++g) {
    Job& j = jobs[static_cast<size_t>(g)];
    for (auto& m : j.loads) keep(io_->Finish(m));
    retire(g);
  }
  const uint64_t file_hash = XXH3_64bits_digest(hs);
  XXH3_freeState(hs);
  if (st.ok() && ::fsync(storage_->Info(fid).fd) != 0) st = PosixError("fsync", data_path, errno);
  storage_->Close(fid).IgnoreError();
  if (!st.ok()) return st;
  Json entry = {{"name", name}, {"rank", srank_}, {"bytes", total}, {"xxh3", Hex(file_hash)}, {"blocks", blocks}};
  return entry.dump();
}

// The zero-copy save: when this rank's W, M, V all live in the NVMe tier, the
// swap file itself becomes the data file (a hard link, see NvmeTier::Snapshot)
// and the manifest lists where each block is and the checksum the tier keeps.
// Its file checksum is XXH3 over the blocks' checksums ("hash": "blocks").
// kUnsupported when it does not apply (the caller copies instead).
Result<std::string> Engine::Impl::SnapshotShardFile(const std::string& link_path, const std::string& name) {
  const char* copy = std::getenv("STRATA_CHECKPOINT_COPY");
  if (copy && *copy && std::strcmp(copy, "0") != 0) return UnsupportedError("STRATA_CHECKPOINT_COPY is set");
  if (!nvme_) return UnsupportedError("no state on NVMe");
  std::vector<Allocation> allocs;
  std::vector<std::pair<int, int>> which;  // (group, state) of each allocation
  for (int g = 0; g < part_.num_groups(); ++g)
    for (int s : kSaved) {
      const StateBlock& b = groups_[static_cast<size_t>(g)].blocks[static_cast<size_t>(s)];
      if (!b.alloc.charged) continue;
      if (b.home != TierKind::kNvme) return UnsupportedError("state not homed on NVMe");
      allocs.push_back(b.alloc);
      which.emplace_back(g, s);
    }
  std::vector<NvmeTier::SnapshotRef> refs;
  STRATA_RETURN_IF_ERROR(nvme_->Snapshot(link_path, allocs, &refs));
  Json blocks = Json::array();
  std::vector<uint64_t> hashes;
  uint64_t end = 0;
  for (size_t i = 0; i < refs.size(); ++i) {
    blocks.push_back({{"group", which[i].first}, {"state", StateName(StateKind(which[i].second))},
                      {"offset", refs[i].offset}, {"bytes", refs[i].bytes}, {"xxh3", Hex(refs[i].checksum)}});
    hashes.push_back(refs[i].checksum);
    end = std::max(end, refs[i].offset + refs[i].bytes);
  }
  Json entry = {{"name", name}, {"rank", srank_}, {"bytes", end}, {"hash", "blocks"},
                {"xxh3", Hex(XXH3_64bits(hashes.data(), hashes.size() * sizeof(uint64_t)))}, {"blocks", blocks}};
  return entry.dump();
}

Status Engine::Impl::SaveCheckpoint(const std::string& dir, const std::string& tag, const void* blob,
                                    uint64_t blob_bytes) {
  STRATA_RETURN_IF_ERROR(CheckBetweenSteps("checkpoint save"));
  Status local;
  if (!ValidTag(tag))
    local = InvalidError("checkpoint save: tag '" + tag + "' must be 1-200 of [A-Za-z0-9._-], not starting with '.', not 'latest'");
  else if (blob_bytes > 0 && !blob)
    local = InvalidError("checkpoint save: a blob length without a blob");
  STRATA_RETURN_IF_ERROR(Agree(local, "checkpoint save"));
  if (multi()) {  // every rank must name the same checkpoint
    const uint64_t mine = XXH3_64bits((dir + "\n" + tag).data(), dir.size() + 1 + tag.size());
    std::vector<uint64_t> all(static_cast<size_t>(comm_->world_size()));
    all[static_cast<size_t>(comm_->rank())] = mine;
    STRATA_RETURN_IF_ERROR(comm_->AllGather(&all[static_cast<size_t>(comm_->rank())], all.data(), 8));
    for (size_t k = 0; k < all.size(); ++k)
      if (all[k] != mine)
        return InvalidError("checkpoint save: ranks passed different folders or tags (rank " + std::to_string(k) +
                            " differs from rank " + std::to_string(comm_->rank()) + "'s " + dir + "/" + tag +
                            "); nothing was written");
  }
  const std::string final_dir = dir + "/" + tag, part = dir + "/." + tag + ".partial";
  const bool lead = options_.rank == 0;
  auto cleanup = [&] {
    std::error_code e2;
    if (lead) std::filesystem::remove_all(part, e2);
  };
  // The folder, by rank 0 (ranks share the file system).
  if (lead) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) local = IoError("checkpoint save: cannot create " + dir + ": " + ec.message());
    else if (std::filesystem::exists(final_dir))
      local = InvalidError("checkpoint save: " + final_dir + " exists; checkpoints are never overwritten");
    else {
      std::filesystem::remove_all(part, ec);  // a crashed save's leftovers
      if (::mkdir(part.c_str(), 0755) != 0) local = PosixError("mkdir", part, errno);
    }
  }
  STRATA_RETURN_IF_ERROR(Agree(local, "checkpoint save"));
  // Data: each shard's owner writes it (stage 0 keeps whole copies: rank 0 alone).
  const bool writer = sworld_ > 1 || lead;
  if (writer) {
    const std::string name = RankFile(srank_);
    auto entry = SnapshotShardFile(part + "/" + name, name);
    if (!entry.ok() && entry.status().code() == Code::kUnsupported) {
      STRATA_LOG_DEBUG("checkpoint save: copying the state ({})", entry.status().message());
      entry = WriteShardFile(part + "/" + name, name);
    }
    local = entry.ok() ? WriteSmallFile(part + "/" + name + ".json", entry->data(), entry->size()) : entry.status();
  }
  if (local.ok() && lead) local = WriteSmallFile(part + "/trainer.bin", blob, blob_bytes);
  Status st = Agree(local, "checkpoint save");
  if (!st.ok()) {
    cleanup();
    return st.WithContext("checkpoint save " + final_dir);
  }
  KillPoint("data");
  if (lead) local = WriteManifest(dir, tag, part, blob, blob_bytes);
  st = Agree(local, "checkpoint save");
  if (!st.ok()) cleanup();
  return st;
}

// Rank 0: the manifest from every shard's entry, then the renames.
Status Engine::Impl::WriteManifest(const std::string& dir, const std::string& tag, const std::string& part,
                                   const void* blob, uint64_t blob_bytes) {
  const std::string final_dir = dir + "/" + tag;
  Json files = Json::array();
  for (int k = 0; k < sworld_; ++k) {
    const std::string name = RankFile(k);
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(part + "/" + name + ".json", 64 * kMiB));
    files.push_back(Json::parse(text));
    ::unlink((part + "/" + name + ".json").c_str());
  }
  Json groups = Json::array();
  for (int g = 0; g < part_.num_groups(); ++g) {
    const GroupLayout& L = part_.group(g);
    Json tensors = Json::array();
    for (const auto& t : L.tensors) tensors.push_back({{"name", t.name}, {"offset", t.offset}, {"numel", t.numel}});
    groups.push_back({{"numel", L.numel}, {"padded", L.padded}, {"shard_numel", L.shard_numel}, {"tensors", tensors}});
  }
  const LossScaler::State ls = scaler_.state();
  Json m = {{"format", "strata-checkpoint"}, {"version", kFormatVersion}, {"tag", tag},
            {"world_size", options_.world_size}, {"shard_world", sworld_}, {"stage", config_.zero.stage},
            {"compute_dtype", DTypeName(dtype_)}, {"optimizer", config_.optimizer.type},
            {"step", step_count_},
            {"loss_scaler", {{"scale", ls.scale}, {"hysteresis_left", ls.hysteresis_left}, {"clean_steps", ls.clean_steps}}},
            {"groups", groups}, {"files", files},
            {"trainer_blob", {{"file", "trainer.bin"}, {"bytes", blob_bytes},
                              {"xxh3", Hex(XXH3_64bits(blob, blob_bytes))}}}};
  STRATA_RETURN_IF_ERROR(ReplaceFile(part, "manifest.json", m.dump(1)));
  KillPoint("manifest");
  if (::rename(part.c_str(), final_dir.c_str()) != 0) return PosixError("rename " + part + " to", final_dir, errno);
  STRATA_RETURN_IF_ERROR(FsyncPath(dir).WithContext("checkpoint save " + final_dir));
  KillPoint("rename");
  STRATA_RETURN_IF_ERROR(ReplaceFile(dir, "latest", tag + "\n").WithContext("checkpoint save: updating " + dir + "/latest"));
  KillPoint("latest");
  return Status::Ok();
}

// Streams `path` and returns its XXH3, or an error naming it.
static Result<uint64_t> HashFile(Storage& storage, const std::string& path, uint64_t bytes, void* buf, uint64_t buf_bytes) {
  STRATA_ASSIGN_OR_RETURN(FileId f, storage.Open(path, OpenMode::kReadOnly));
  struct stat stt {};
  if (::fstat(storage.Info(f).fd, &stt) != 0 || static_cast<uint64_t>(stt.st_size) < bytes) {
    storage.Close(f).IgnoreError();
    return CorruptError("checkpoint: " + path + " is truncated: " + std::to_string(stt.st_size) + " bytes, the manifest says " +
                        std::to_string(bytes));
  }
  XXH3_state_t* hs = XXH3_createState();
  XXH3_64bits_reset(hs);
  Status st;
  for (uint64_t off = 0; off < bytes && st.ok();) {
    const uint64_t n = std::min(buf_bytes, bytes - off);
    IoOp op{IoOp::kRead, f, off, buf, n};
    st = storage.Run({&op, 1});
    if (st.ok()) XXH3_64bits_update(hs, buf, n);
    off += n;
  }
  const uint64_t h = XXH3_64bits_digest(hs);
  XXH3_freeState(hs);
  storage.Close(f).IgnoreError();
  if (!st.ok()) return st;
  return h;
}

// The manifest is JSON from disk: any surprise in it is corruption, not a crash.
Status Engine::Impl::LoadCheckpoint(const std::string& dir, const std::string& tag, std::vector<uint8_t>* blob) {
  try {
    return LoadCheckpointChecked(dir, tag, blob);
  } catch (const std::exception& e) {
    return CorruptError("checkpoint load " + dir + ": malformed manifest: " + e.what());
  }
}

Status Engine::Impl::LoadCheckpointChecked(const std::string& dir, const std::string& tag_in, std::vector<uint8_t>* blob) {
  STRATA_RETURN_IF_ERROR(CheckBetweenSteps("checkpoint load", /*recovers=*/true));
  Json m;
  std::string folder, mpath;
  Status local = ReadManifest(dir, tag_in, &m, &folder, &mpath);
  // Everything is checked before anything changes: the layout, every file's
  // size and checksum, the trainer's blob — on every rank.
  if (local.ok()) local = CheckManifestLayout(m, mpath);
  std::string btext;
  if (local.ok()) local = VerifyFiles(m, folder);
  if (local.ok()) {
    const std::string bpath = folder + "/" + m["trainer_blob"].value("file", "trainer.bin");
    auto b = ReadSmallFile(bpath, 1ull << 32);
    if (!b.ok() || b->size() != m["trainer_blob"].value("bytes", uint64_t{0}) ||
        Hex(XXH3_64bits(b->data(), b->size())) != m["trainer_blob"].value("xxh3", ""))
      local = CorruptError("checkpoint load: " + bpath + " is missing, truncated or corrupt");
    else btext = std::move(b).value();
  }
  STRATA_RETURN_IF_ERROR(Agree(local, "checkpoint load"));
  // Apply: each rank builds its shards from whichever saved shards cover them.
  local = ApplyResharded(m, folder);
  void* buf = opt_staging_.Acquire();
  if (local.ok()) local = RecomputeP(buf, buf ? opt_staging_.bytes() : 0);
  opt_staging_.Release(buf);
  Status st = Agree(local, "checkpoint load");
  if (!st.ok()) return st.WithContext("checkpoint load " + folder + " (the engine's state is now partly loaded)");
  step_count_ = m.value("step", int64_t{0});
  const Json& lj = m["loss_scaler"];
  scaler_.set_state({lj.value("scale", 1.0), lj.value("hysteresis_left", 2), lj.value("clean_steps", int64_t{0})});
  DropDeviceCopies();
  if (blob) blob->assign(btext.begin(), btext.end());
  return Status::Ok();
}

Status Engine::Impl::ReadManifest(const std::string& dir, const std::string& tag_in, Json* m, std::string* folder,
                                  std::string* mpath) {
  std::string tag = tag_in;
  if (tag.empty()) {
    STRATA_ASSIGN_OR_RETURN(std::string t, ReadSmallFile(dir + "/latest", 4096));
    while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
    tag = t;
  }
  if (!ValidTag(tag)) return CorruptError("checkpoint load: " + dir + "/latest names an invalid tag '" + tag + "'");
  *folder = dir + "/" + tag;
  *mpath = *folder + "/manifest.json";
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(*mpath, 256 * kMiB));
  try {
    *m = Json::parse(text);
  } catch (const std::exception& e) {
    return CorruptError("checkpoint load: " + *mpath + " is not valid JSON: " + e.what());
  }
  return Status::Ok();
}

// The saved model must be this model: groups, tensor names and sizes, and
// optimizer. The number of ranks may differ (the shards are recut).
Status Engine::Impl::CheckManifestLayout(const Json& m, const std::string& mpath) {
  auto bad = [&](const std::string& why) { return CorruptError("checkpoint load: " + mpath + ": " + why); };
  if (m.at("format") != "strata-checkpoint" || m.at("version").get<int>() != kFormatVersion)
    return bad("not a version " + std::to_string(kFormatVersion) + " strata checkpoint");
  if (m.at("optimizer").get<std::string>() != config_.optimizer.type)
    return InvalidError("checkpoint load: " + mpath + " holds " + m.at("optimizer").get<std::string>() +
                        " state; this engine runs " + config_.optimizer.type);
  const Json& gj = m.at("groups");
  if (gj.size() != static_cast<size_t>(part_.num_groups()))
    return InvalidError("checkpoint load: " + mpath + " has " + std::to_string(gj.size()) + " groups; the engine has " +
                        std::to_string(part_.num_groups()));
  for (int g = 0; g < part_.num_groups(); ++g) {
    const GroupLayout& L = part_.group(g);
    const Json& tj = gj[static_cast<size_t>(g)].at("tensors");
    if (gj[static_cast<size_t>(g)].at("numel").get<uint64_t>() != L.numel || tj.size() != L.tensors.size())
      return InvalidError("checkpoint load: group " + std::to_string(g) + " of " + mpath + " has another layout");
    for (size_t t = 0; t < L.tensors.size(); ++t)
      if (tj[t].at("name") != L.tensors[t].name || tj[t].at("numel").get<uint64_t>() != L.tensors[t].numel)
        return InvalidError("checkpoint load: tensor '" + L.tensors[t].name + "' of group " + std::to_string(g) +
                            " differs in " + mpath);
  }
  const uint64_t shards = m.value("shard_world", m.at("world_size").get<uint64_t>());
  if (shards < 1 || m.at("files").size() != shards)
    return bad("lists " + std::to_string(m.at("files").size()) + " data files for " + std::to_string(shards) + " shards");
  return Status::Ok();
}

// Every data file: size and XXH3 as the manifest says.
Status Engine::Impl::VerifyFiles(const Json& m, const std::string& folder) {
  void* buf = nullptr;
  const uint64_t buf_bytes = 8 * kMiB;
  if (posix_memalign(&buf, 4096, buf_bytes) != 0) return NoMemError("checkpoint load: no memory for a read buffer");
  std::unique_ptr<void, void (*)(void*)> own(buf, std::free);
  for (const Json& file : m.at("files")) {
    const std::string path = folder + "/" + file.value("name", "");
    if (file.value("hash", "file") == "blocks") {  // a snapshot: each block against its checksum
      STRATA_RETURN_IF_ERROR(VerifyBlocks(file, path, buf, buf_bytes));
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(uint64_t h, HashFile(*storage_, path, file.value("bytes", uint64_t{0}), buf, buf_bytes));
    if (Hex(h) != file.value("xxh3", "")) return CorruptError("checkpoint load: checksum mismatch in " + path);
  }
  return Status::Ok();
}

// A snapshot data file: each listed block read and checked against its XXH3,
// and the file's checksum over the blocks' checksums.
Status Engine::Impl::VerifyBlocks(const Json& file, const std::string& path, void* buf, uint64_t buf_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return CorruptError("checkpoint load: cannot open " + path + " (" + std::strerror(errno) + ")");
  struct Closer { int fd; ~Closer() { ::close(fd); } } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < file.value("bytes", uint64_t{0}))
    return CorruptError("checkpoint load: " + path + " is truncated: " + std::to_string(st.st_size) +
                        " bytes, the manifest says " + std::to_string(file.value("bytes", uint64_t{0})));
  std::vector<uint64_t> hashes;
  XXH3_state_t* hs = XXH3_createState();
  struct Free { XXH3_state_t* h; ~Free() { XXH3_freeState(h); } } free_state{hs};
  for (const Json& bj : file.at("blocks")) {
    const uint64_t off = bj.at("offset").get<uint64_t>(), bytes = bj.at("bytes").get<uint64_t>();
    XXH3_64bits_reset(hs);
    for (uint64_t done = 0; done < bytes;) {
      const uint64_t n = std::min(buf_bytes, bytes - done);
      STRATA_RETURN_IF_ERROR(PreadFull(fd, buf, n, off + done, path));
      XXH3_64bits_update(hs, buf, n);
      done += n;
    }
    const uint64_t h = XXH3_64bits_digest(hs);
    if (Hex(h) != bj.at("xxh3").get<std::string>())
      return CorruptError("checkpoint load: checksum mismatch in " + path + " at offset " + std::to_string(off));
    hashes.push_back(h);
  }
  if (Hex(XXH3_64bits(hashes.data(), hashes.size() * sizeof(uint64_t))) != file.value("xxh3", ""))
    return CorruptError("checkpoint load: the block list of " + path + " does not match its checksum");
  return Status::Ok();
}

// This rank's shard of every group's W, M, V, cut from the saved shards
// (which may have been cut for another number of ranks).
Status Engine::Impl::ApplyResharded(const Json& m, const std::string& folder) {
  const Json& files = m.at("files");
  std::vector<int> fds;
  for (const Json& f : files) {
    const std::string path = folder + "/" + f.value("name", "");
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      for (int x : fds) ::close(x);
      return PosixError("checkpoint load: open", path, errno);
    }
    fds.push_back(fd);
  }
  struct Closer { std::vector<int>& v; ~Closer() { for (int x : v) ::close(x); } } closer{fds};
  // (file, group, state) -> the block's offset in that file, indexed once.
  std::map<std::tuple<uint64_t, int, int>, uint64_t> block_offset;
  for (uint64_t k = 0; k < files.size(); ++k)
    for (const Json& bj : files[k].at("blocks"))
      for (int s : kSaved)
        if (bj.value("state", "") == StateName(StateKind(s)))
          block_offset[{k, bj.value("group", -1), s}] = bj.value("offset", uint64_t{0});
  void* slot = opt_staging_.Acquire();
  struct SlotBack { StagingPool& p; void* s; ~SlotBack() { p.Release(s); } } back{opt_staging_, slot};
  for (int g = 0; g < part_.num_groups(); ++g) {
    const GroupLayout& L = part_.group(g);
    const uint64_t old_shard = m.at("groups")[static_cast<size_t>(g)].at("shard_numel").get<uint64_t>();
    const uint64_t lo = static_cast<uint64_t>(srank_) * L.shard_numel;
    const uint64_t hi = std::min(lo + L.shard_numel, L.numel);
    for (int s : kSaved) {
      const StateBlock& b = groups_[static_cast<size_t>(g)].blocks[static_cast<size_t>(s)];
      if (!b.alloc.charged) continue;
      float* dst = io_->Direct(b) ? static_cast<float*>(io_->DirectPtr(b)) : static_cast<float*>(slot);
      if (!dst) return InternalError("checkpoint load: no staging slot for a staged block");
      std::memset(dst, 0, L.shard_numel * 4);
      for (uint64_t a = lo; a < hi;) {
        const uint64_t k = a / old_shard, within = a % old_shard, run = std::min(hi - a, old_shard - within);
        if (k >= files.size()) return CorruptError("checkpoint load: no data file for shard " + std::to_string(k));
        auto where = block_offset.find({k, g, s});
        if (where == block_offset.end())
          return CorruptError("checkpoint load: " + files[k].value("name", "") + " lacks " + StateName(StateKind(s)) +
                              " of group " + std::to_string(g));
        const uint64_t off = where->second + within * 4;
        char* out = reinterpret_cast<char*>(dst + (a - lo));
        STRATA_RETURN_IF_ERROR(PreadFull(fds[k], out, run * 4, off, folder + "/" + files[k].value("name", "")));
        a += run;
      }
      if (!io_->Direct(b)) STRATA_RETURN_IF_ERROR(io_->Store(b, dst));
    }
  }
  return Status::Ok();
}

// P = W in the compute dtype, as after every step: this rank's shard, then
// (stages 1-2 with several ranks) the other ranks' slices gathered.
Status Engine::Impl::RecomputeP(void* buf, uint64_t buf_bytes) {
  for (int g = 0; g < part_.num_groups(); ++g) STRATA_RETURN_IF_ERROR(RecomputePGroup(g, buf, buf_bytes));
  return Status::Ok();
}

Status Engine::Impl::RecomputePGroup(int g, void* buf, uint64_t buf_bytes) {
  GroupState& gs = groups_[static_cast<size_t>(g)];
  const uint64_t n = part_.group(g).shard_numel;
  const StateBlock& wb = gs.blocks[int(StateKind::kW)];
  float* w = static_cast<float*>(buf);
  if (io_->Direct(wb)) w = static_cast<float*>(io_->DirectPtr(wb));
  else STRATA_RETURN_IF_ERROR(io_->Load(wb, w));
  const StateBlock& p = gs.blocks[int(StateKind::kP)];
  if (io_->Direct(p)) {  // our slice (or all of it), then the other ranks' slices
    STRATA_RETURN_IF_ERROR(kernels::Cast(DType::kF32, w, dtype_, static_cast<char*>(io_->DirectPtr(p)) + PSliceOffset(g), n));
    if (p_gathered_after_step()) STRATA_RETURN_IF_ERROR(GatherP(g, io_->DirectPtr(p)));
    return Status::Ok();
  }
  const uint64_t at = w == buf ? AlignUp(n * 4, 4096) : 0;  // after W when W is in the buffer
  if (!buf || at + p.bytes > buf_bytes) return InternalError("the staging slot cannot hold W and P");
  char* pbuf = static_cast<char*>(buf) + at;
  STRATA_RETURN_IF_ERROR(kernels::Cast(DType::kF32, w, dtype_, pbuf, n));
  return io_->Store(p, pbuf);
}

}  // namespace strata

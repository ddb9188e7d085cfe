// Checkpoints, the save: this rank's W, M, V streamed from their home tiers
// into one data file through the io engine (state on NVMe goes swap file ->
// host slot -> checkpoint file, never through the device), plus a JSON
// manifest with the layout and XXH3 checksums, itself checksummed (see
// engine/format/manifest.h), written in an order that survives a crash:
//   DIR/.TAG.partial/{rankNNNNN.bin, trainer.bin} written and fsynced
//   -> manifest.json.tmp fsynced, renamed to manifest.json, folder fsynced
//   -> .TAG.partial renamed to TAG, DIR fsynced
//   -> DIR/latest.tmp (the tag) fsynced, renamed to DIR/latest, DIR fsynced.
// STRATA_CHECKPOINT_KILL_AT=data|manifest|rename|latest aborts the process
// right after that point (crash tests). The load is in checkpoint_load.cpp.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>

#include "base/align.h"
#include "base/log.h"
#include "base/sizes.h"
#include "engine/checkpoint/checkpoint_files.h"
#include "engine/checkpoint/checkpointer.h"
#include "io/direct_file.h"

namespace strata {

using Json = nlohmann::json;
using manifest::Hex;
using namespace ckpt;  // NOLINT: the checkpoint file helpers
static const int kSaved[] = {int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)};
static const int kSavedFrozen[] = {int(StateKind::kP)};  // a frozen group's P alone ("P" blocks)

// Writes this rank's shard of every group's W, M, V (a frozen group's: its
// slice of P) to `data_path`, returning its manifest entry. A pipeline over
// K staging slots: the reads of the next K-2 groups and the writes of the
// last one or two are in flight while a group's blocks are hashed, so the
// disk always has both queues full. A block read from NVMe brings the
// checksum the tier verified; it is not hashed again. A frozen group's P off
// the host goes through its one buffer, read when its turn comes (after the
// write before it, which may hold that buffer, has landed).
Result<std::string> Checkpointer::WriteShardFile(const std::string& data_path, const std::string& name) {
  const int n = d_.layout.part.num_groups();
  std::vector<uint64_t> offset(static_cast<size_t>(n) + 1, 0);
  for (int g = 0; g < n; ++g) {
    uint64_t bytes = d_.layout.frozen(g) ? d_.layout.FrozenSavedBytes(g) : 0;
    for (int s : kSaved)
      if (d_.blocks[static_cast<size_t>(g)][static_cast<size_t>(s)].alloc.charged)
        bytes += manifest::SavedBlockBytes(d_.layout.compact, s - 1, d_.layout.part.group(g).shard_numel);
    offset[static_cast<size_t>(g) + 1] = offset[static_cast<size_t>(g)] + bytes;
  }
  const uint64_t total = offset[static_cast<size_t>(n)];
  STRATA_ASSIGN_OR_RETURN(FileId fid, d_.storage.Open(data_path, OpenMode::kCreate));
  Status st = ReserveFileSpace(d_.storage.Info(fid).fd, data_path, total);
  struct Job {
    void* slot = nullptr;
    StagingPool* pool = nullptr;  // the slot's
    bool deferred = false;        // a frozen group's P to read at its turn
    void* src[kNumStates] = {};
    BlockMove loads[kNumStates];
    IoTicket write;
  };
  std::vector<Job> jobs(static_cast<size_t>(n));
  auto keep = [&](Status s) { if (st.ok() && !s.ok()) st = std::move(s); };
  // Compact: P's slice is the master's bf16 half, saved with W.
  std::vector<int> states(std::begin(kSaved), std::end(kSaved));
  if (d_.layout.compact) states.insert(states.begin(), int(StateKind::kP));
  // The group's blocks: addressable in place, or read into a slot. `now`: a
  // frozen group's P is read too (else it waits for its turn).
  auto start = [&](int g, bool now) {
    Job& j = jobs[static_cast<size_t>(g)];
    const bool fz = d_.layout.frozen(g);
    for (int s : fz ? std::vector<int>{int(StateKind::kP)} : states) {
      const StateBlock& b = d_.blocks[static_cast<size_t>(g)][static_cast<size_t>(s)];
      if (!b.alloc.charged) continue;
      if (d_.io.Direct(b)) { j.src[s] = d_.io.DirectPtr(b); continue; }
      if (fz && !now) { j.deferred = true; continue; }
      if (!j.slot) {
        j.pool = fz ? &d_.staging.frozen : &d_.staging.opt;
        j.slot = j.pool->Acquire();
      }
      if (!j.slot) { keep(InternalError("checkpoint save: no staging slot for group " + std::to_string(g))); continue; }
      void* dst = static_cast<char*>(j.slot) + (fz ? 0 : d_.layout.opt_slot_offsets[s]);
      j.src[s] = dst;
      auto m = d_.io.StartLoad(b, dst);
      if (m.ok()) j.loads[s] = std::move(m).value();
      else keep(m.status());
    }
  };
  auto retire = [&](int g) {  // its write done, its slot free
    Job& j = jobs[static_cast<size_t>(g)];
    if (j.write) keep(j.write->Wait());
    j.write.reset();
    if (j.slot) j.pool->Release(j.slot);
    j.slot = nullptr;
  };
  const int ahead = std::max(d_.staging.opt.count(), 3) - 2;  // groups read ahead
  for (int g = 0; g < std::min(ahead, n); ++g) start(g, false);
  Json blocks = Json::array();
  XXH3_state_t* hs = XXH3_createState();
  XXH3_64bits_reset(hs);
  for (int g = 0; g < n && st.ok(); ++g) {
    Job& j = jobs[static_cast<size_t>(g)];
    if (j.deferred) {  // the frozen buffer: free once the write before (its holder, maybe) has landed
      if (g >= 1) retire(g - 1);
      j.deferred = false;
      start(g, true);
      if (!st.ok()) break;
    }
    std::vector<IoOp> ops;
    uint64_t off = offset[static_cast<size_t>(g)];
    if (d_.layout.compact && !d_.layout.frozen(g)) keep(d_.io.Finish(j.loads[int(StateKind::kP)]));
    const std::span<const int> saved = d_.layout.frozen(g) ? std::span<const int>(kSavedFrozen) : std::span<const int>(kSaved);
    for (int s : saved) {
      const StateBlock& b = d_.blocks[static_cast<size_t>(g)][static_cast<size_t>(s)];
      if (!b.alloc.charged) continue;
      ShardStore::Piece pieces[2];
      const int np = d_.shards.SavedPieces(g, s, j.src, pieces);
      // A block read from NVMe whole brings the checksum the tier verified.
      const bool verified = np == 1 && pieces[0].bytes == b.bytes && j.loads[s].kind == BlockMove::kNvme &&
                            d_.config.strata.checksums;
      const uint64_t tier_hash = verified ? j.loads[s].nvme.checksum : 0;
      keep(d_.io.Finish(j.loads[s]));
      if (!st.ok()) break;
      XXH3_state_t* bh = XXH3_createState();
      XXH3_64bits_reset(bh);
      uint64_t bytes = 0;
      for (int k = 0; k < np; ++k) {
        if (!verified) XXH3_64bits_update(bh, pieces[k].ptr, pieces[k].bytes);
        XXH3_64bits_update(hs, pieces[k].ptr, pieces[k].bytes);
        ops.push_back(IoOp{IoOp::kWrite, fid, off + bytes, const_cast<void*>(pieces[k].ptr), pieces[k].bytes});
        bytes += pieces[k].bytes;
      }
      const uint64_t h = verified ? tier_hash : XXH3_64bits_digest(bh);
      XXH3_freeState(bh);
      blocks.push_back({{"group", g}, {"state", StateName(StateKind(s))}, {"offset", off}, {"bytes", bytes}, {"xxh3", Hex(h)}});
      d_.stats.AddMoved(b.home == TierKind::kNvme ? TierKind::kNvme : TierKind::kHost, TierKind::kNvme, bytes);
      off += bytes;
    }
    if (!st.ok()) break;
    j.write = d_.storage.Submit(ops);
    if (g >= 1) retire(g - 1);  // frees the slot the next read-ahead takes
    if (g + ahead < n) start(g + ahead, false);
  }
  // Drain whatever is still in flight, whatever happened.
  for (int g = 0; g < n; ++g) {
    Job& j = jobs[static_cast<size_t>(g)];
    for (auto& m : j.loads) keep(d_.io.Finish(m));
    retire(g);
  }
  const uint64_t file_hash = XXH3_64bits_digest(hs);
  XXH3_freeState(hs);
  if (st.ok() && ::fsync(d_.storage.Info(fid).fd) != 0) st = PosixError("fsync", data_path, errno);
  d_.storage.Close(fid).IgnoreError();
  if (!st.ok()) return st;
  Json entry = {{"name", name}, {"rank", d_.layout.srank}, {"bytes", total}, {"xxh3", Hex(file_hash)}, {"blocks", blocks}};
  return entry.dump();
}

// The zero-copy save: when this rank's W, M, V (and frozen groups' P) all live in the NVMe tier, the
// swap file itself becomes the data file (a hard link, see NvmeTier::Snapshot)
// and the manifest lists where each block is and the checksum the tier keeps.
// Its file checksum is XXH3 over the blocks' checksums ("hash": "blocks").
// kUnsupported when it does not apply (the caller copies instead).
Result<std::string> Checkpointer::SnapshotShardFile(const std::string& link_path, const std::string& name) {
  const char* copy = std::getenv("STRATA_CHECKPOINT_COPY");
  if (copy && *copy && std::strcmp(copy, "0") != 0) return UnsupportedError("STRATA_CHECKPOINT_COPY is set");
  if (!d_.nvme) return UnsupportedError("no state on NVMe");
  if (d_.layout.compact) return UnsupportedError("compact: a saved W joins P's bf16 half and W's corrections");
  std::vector<Allocation> allocs;
  std::vector<std::pair<int, int>> which;  // (group, state) of each allocation
  for (int g = 0; g < d_.layout.part.num_groups(); ++g)
    for (int s : d_.layout.frozen(g) ? std::span<const int>(kSavedFrozen) : std::span<const int>(kSaved)) {
      const StateBlock& b = d_.blocks[static_cast<size_t>(g)][static_cast<size_t>(s)];
      if (!b.alloc.charged) continue;
      if (b.home != TierKind::kNvme) return UnsupportedError("state not homed on NVMe");
      if (!b.parts.empty()) return UnsupportedError("state stored in step units (parts)");
      // A frozen group's saved P is its whole block here (P on NVMe: one rank, or stage 3's shard).
      if (d_.layout.frozen(g) && (b.bytes != d_.layout.FrozenSavedBytes(g) || d_.layout.PSliceOffset(g) != 0))
        return UnsupportedError("a frozen group's saved P is not its whole block");
      allocs.push_back(b.alloc);
      which.emplace_back(g, s);
    }
  std::vector<NvmeTier::SnapshotRef> refs;
  STRATA_RETURN_IF_ERROR(d_.nvme->Snapshot(link_path, allocs, &refs));
  Json blocks = Json::array();
  std::vector<uint64_t> hashes;
  uint64_t end = 0;
  for (size_t i = 0; i < refs.size(); ++i) {
    blocks.push_back({{"group", which[i].first}, {"state", StateName(StateKind(which[i].second))},
                      {"offset", refs[i].offset}, {"bytes", refs[i].bytes}, {"xxh3", Hex(refs[i].checksum)}});
    hashes.push_back(refs[i].checksum);
    end = std::max(end, refs[i].offset + refs[i].bytes);
  }
  Json entry = {{"name", name}, {"rank", d_.layout.srank}, {"bytes", end}, {"hash", "blocks"},
                {"xxh3", Hex(XXH3_64bits(hashes.data(), hashes.size() * sizeof(uint64_t)))}, {"blocks", blocks}};
  return entry.dump();
}


Status Checkpointer::Save(const std::string& dir, const std::string& tag, const void* blob,
                                    uint64_t blob_bytes) {
  Status local;
  if (!ValidTag(tag))
    local = InvalidError("checkpoint save: tag '" + tag + "' must be 1-200 of [A-Za-z0-9._-], not starting with '.', not 'latest' or 'latest.tmp'");
  else if (blob_bytes > 0 && !blob)
    local = InvalidError("checkpoint save: a blob length without a blob");
  else if (blob_bytes > manifest::kMaxBlobBytes)
    local = InvalidError("checkpoint save: a blob of " + std::to_string(blob_bytes) + " bytes; a checkpoint holds at most " +
                         std::to_string(manifest::kMaxBlobBytes) + " (4 GiB); nothing was written");
  STRATA_RETURN_IF_ERROR(Agree(local, "checkpoint save"));
  if (d_.layout.multi) {  // every rank must name the same checkpoint
    const uint64_t mine = XXH3_64bits((dir + "\n" + tag).data(), dir.size() + 1 + tag.size());
    std::vector<uint64_t> all(static_cast<size_t>(d_.comm->world_size()));
    all[static_cast<size_t>(d_.comm->rank())] = mine;
    STRATA_RETURN_IF_ERROR(d_.comm->AllGather(&all[static_cast<size_t>(d_.comm->rank())], all.data(), 8));
    for (size_t k = 0; k < all.size(); ++k)
      if (all[k] != mine)
        return InvalidError("checkpoint save: ranks passed different folders or tags (rank " + std::to_string(k) +
                            " differs from rank " + std::to_string(d_.comm->rank()) + "'s " + dir + "/" + tag +
                            "); nothing was written");
  }
  const std::string final_dir = dir + "/" + tag, part = dir + "/." + tag + ".partial";
  // The tag exists (ranks share the file system): a save that was killed
  // before it updated `latest`, repeated with the same state, completes it.
  // (One rank's failure to look is every rank's: the others would wait in the collectives that follow.)
  Result<bool> exists = Exists(final_dir);
  STRATA_RETURN_IF_ERROR(Agree(exists.ok() ? Status::Ok() : exists.status(), "checkpoint save"));
  // And on its answer: a rank that sees the tag (a relative folder from
  // another working directory, a file system cached out of date) resaved
  // while the others saved afresh, their collectives paired wrongly.
  if (d_.layout.multi) {
    const size_t me = static_cast<size_t>(d_.comm->rank());
    std::vector<uint64_t> seen(static_cast<size_t>(d_.comm->world_size()));
    seen[me] = *exists ? 1 : 0;
    d_.comm->SetLabel("checkpoint save: tag exists");
    STRATA_RETURN_IF_ERROR(d_.comm->AllGather(&seen[me], seen.data(), 8).WithContext("checkpoint save"));
    for (size_t k = 0; k < seen.size(); ++k)
      if (seen[k] != seen[me])
        return InvalidError("checkpoint save: " + final_dir + (seen[me] ? " exists" : " does not exist") + " on rank " +
                            std::to_string(me) + " but " + (seen[k] ? "exists" : "does not") + " on rank " +
                            std::to_string(k) + ": the ranks see the folder differently (a relative path from " +
                            "another working directory, a file system cached out of date); nothing was written");
  }
  if (*exists) return ResaveExisting(dir, tag, blob, blob_bytes);
  const bool lead = d_.rank == 0;
  auto cleanup = [&] {
    std::error_code e2;
    if (lead) std::filesystem::remove_all(part, e2);
  };
  // The folder, by rank 0 (ranks share the file system), locked while we save.
  PartialLock part_lock;
  bool made = false;  // rank 0 made `part` (then a failure before the data removes it)
  if (lead) {
    local = CreateDirsDurably(dir).WithContext("checkpoint save");
    if (local.ok()) {
      if (const int n = RemoveAbandonedPartials(dir))  // killed saves' leftovers, ours included
        STRATA_LOG_INFO("checkpoint save: removed {} abandoned partial save(s) in {}", n, dir);
      if (::mkdir(part.c_str(), 0755) != 0)
        local = errno == EEXIST ? InvalidError("checkpoint save: " + part + " is being written by another live save")
                                : PosixError("mkdir", part, errno);
      else {
        made = true;
        local = part_lock.Lock(part);
      }
    }
  }
  if (Status agreed = Agree(local, "checkpoint save"); !agreed.ok()) {
    if (made) cleanup();  // (not another live save's folder: EEXIST above)
    return agreed;
  }
  // Data: each shard's owner writes it (stage 0 keeps whole copies: rank 0 alone).
  const bool writer = d_.layout.sworld > 1 || lead;
  if (writer) {
    const std::string name = RankFile(d_.layout.srank);
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

static_assert(manifest::kMaxDims == kMaxShapeDims, "the manifest's and the engine's most dims differ");
static_assert(manifest::kMaxAliases == kMaxTensorAliases, "the manifest's and the engine's most aliases differ");

// Rank 0: the manifest from every shard's entry, then the renames.
Status Checkpointer::WriteManifest(const std::string& dir, const std::string& tag, const std::string& part,
                                   const void* blob, uint64_t blob_bytes) {
  const std::string final_dir = dir + "/" + tag;
  Json files = Json::array();
  for (int k = 0; k < d_.layout.sworld; ++k) {
    const std::string name = RankFile(k);
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(part + "/" + name + ".json", 64 * kMiB));
    files.push_back(Json::parse(text));
    ::unlink((part + "/" + name + ".json").c_str());
  }
  Json groups = Json::array();
  for (int g = 0; g < d_.layout.part.num_groups(); ++g) {
    const GroupLayout& L = d_.layout.part.group(g);
    Json tensors = Json::array();
    for (const auto& t : L.tensors) {
      Json tj = {{"name", t.name}, {"offset", t.offset}, {"numel", t.numel}};
      if (t.shaped) tj["shape"] = t.shape;  // a flat tensor (registered by numel) has none
      if (!t.aliases.empty()) tj["aliases"] = t.aliases;
      tensors.push_back(std::move(tj));
    }
    Json gj = {{"numel", L.numel}, {"padded", L.padded}, {"shard_numel", L.shard_numel}, {"tensors", tensors}};
    if (d_.layout.frozen(g)) gj["frozen"] = true;  // its blocks are "P", in compute_dtype
    else if (d_.skips_gradless) gj["steps"] = d_.step.group_steps[static_cast<size_t>(g)];  // its own update count
    groups.push_back(std::move(gj));
  }
  // The order of saves in this folder: one more than any checkpoint there.
  // A folder that cannot be read fails the save: a number below a checkpoint
  // there would make a later load take the older one.
  uint64_t seq = 0;
  STRATA_ASSIGN_OR_RETURN(const std::vector<Found> there, ScanCheckpoints(dir));
  for (const Found& f : there)
    if (f.manifest.ok()) seq = std::max(seq, f.manifest->save_seq);
  const LossScaler::State ls = d_.step.scaler.state();
  Json m = {{"format", "strata-checkpoint"}, {"version", manifest::kFormatVersion}, {"tag", tag},
            {"world_size", d_.world_size}, {"shard_world", d_.layout.sworld}, {"stage", d_.config.zero.stage},
            {"compute_dtype", DTypeName(d_.layout.dtype)}, {"optimizer", d_.config.optimizer.type},
            {"state_format", d_.config.strata.state_format},
            {"step", d_.step.applied}, {"save_seq", seq + 1},
            {"loss_scaler", {{"scale", ls.scale}, {"hysteresis_left", ls.hysteresis_left}, {"clean_steps", ls.clean_steps}}},
            {"groups", groups}, {"files", files},
            {"trainer_blob", {{"file", "trainer.bin"}, {"bytes", blob_bytes},
                              {"xxh3", Hex(XXH3_64bits(blob, blob_bytes))}}}};
  const std::string text = manifest::Seal(m.dump());
  // What we write must read back: a state that the load would refuse (a
  // non-finite loss scale, say) is refused here, before it is published.
  STRATA_RETURN_IF_ERROR(manifest::Parse(text, part + "/manifest.json").status().WithContext("checkpoint save"));
  STRATA_RETURN_IF_ERROR(ReplaceFile(part, "manifest.json", text));
  KillPoint("manifest");
  if (::rename(part.c_str(), final_dir.c_str()) != 0) return PosixError("rename " + part + " to", final_dir, errno);
  // Published: a load finds it (the newest by save order) even where what
  // follows fails, and a save of the same state again completes it.
  const std::string published = "checkpoint save: " + final_dir + " is complete and loads as the newest, but ";
  STRATA_RETURN_IF_ERROR(FsyncPath(dir).WithContext(published + "its folder's entry may not survive a crash"));
  KillPoint("rename");
  STRATA_RETURN_IF_ERROR(ReplaceFile(dir, "latest", tag + "\n").WithContext(published + dir + "/latest was not updated"));
  KillPoint("latest");
  return Status::Ok();
}

// DIR/TAG exists. When it is the newest checkpoint there and holds exactly
// this state (step, loss scaler, layout, every block's checksum, its data
// verified), the save has nothing to write: it points `latest` at it and
// succeeds. Anything else is refused; checkpoints are never overwritten.
Status Checkpointer::ResaveExisting(const std::string& dir, const std::string& tag, const void* blob,
                                    uint64_t blob_bytes) {
  const std::string final_dir = dir + "/" + tag;
  auto refuse = [&](const std::string& why) {
    return InvalidError("checkpoint save: " + final_dir + " exists and " + why + "; checkpoints are never overwritten");
  };
  Status local;
  auto m = ReadManifestAt(final_dir);
  if (!m.ok()) local = refuse("cannot be read (" + m.status().message() + ")");
  auto there = local.ok() ? ScanCheckpoints(dir) : Result<std::vector<Found>>(std::vector<Found>{});
  if (!there.ok()) local = there.status().WithContext("checkpoint save");
  if (local.ok()) {
    for (const Found& f : *there)
      if (f.tag != tag && f.manifest.ok() && Older(*m, f.manifest.value()))
        local = refuse("is not the newest checkpoint there (" + f.tag + " was saved after it)");
  }
  if (local.ok()) {
    local = SameStateAs(*m, final_dir);
    if (!local.ok()) local = refuse(local.message());
  }
  // The trainer's blob is part of what the save writes (rank 0's): another
  // one (a data position, an RNG) would be lost, and a load hand back the old.
  if (local.ok() && d_.rank == 0 && XXH3_64bits(blob, blob_bytes) != m->blob_xxh3)
    local = refuse("holds this state but another trainer blob (the saved one: " + std::to_string(m->blob_bytes) +
                   " bytes; this save's: " + std::to_string(blob_bytes) + ")");
  STRATA_RETURN_IF_ERROR(Agree(local, "checkpoint save"));
  if (d_.rank == 0)
    local = ReplaceFile(dir, "latest", tag + "\n").WithContext("checkpoint save: updating " + dir + "/latest");
  STRATA_RETURN_IF_ERROR(Agree(local, "checkpoint save"));
  STRATA_LOG_INFO("checkpoint save: {} already holds this state; {}/latest names it", final_dir, dir);
  return Status::Ok();
}

// Whether the checkpoint `m` in `folder` holds this engine's state: the
// step, the loss scaler, the layout, and this rank's file's data, verified
// against its checksums, equal to this rank's blocks.
Status Checkpointer::SameStateAs(const manifest::Manifest& m, const std::string& folder) {
  auto differs = [&](const std::string& what) { return InvalidError("differs (" + what + ")"); };
  const LossScaler::State ls = d_.step.scaler.state();
  if (m.step != d_.step.applied)
    return differs("it is of step " + std::to_string(m.step) + ", the engine is at step " + std::to_string(d_.step.applied));
  if (m.loss_scale != ls.scale || m.hysteresis_left != ls.hysteresis_left || m.clean_steps != ls.clean_steps)
    return differs("another loss scaler state");
  if (m.shard_world != d_.layout.sworld || m.world_size != d_.world_size) return differs("another number of ranks");
  for (int g = 0; d_.skips_gradless && g < d_.layout.part.num_groups() && static_cast<size_t>(g) < m.groups.size(); ++g) {
    const int64_t saved = m.groups[static_cast<size_t>(g)].steps >= 0 ? m.groups[static_cast<size_t>(g)].steps : m.step;
    if (!d_.layout.frozen(g) && saved != d_.step.group_steps[static_cast<size_t>(g)])
      return differs("group " + std::to_string(g) + " has " + std::to_string(saved) + " updates there, " +
                     std::to_string(d_.step.group_steps[static_cast<size_t>(g)]) + " in the engine");
  }
  STRATA_RETURN_IF_ERROR(CheckManifestLayout(m, folder + "/manifest.json"));
  if (!(d_.layout.sworld > 1 || d_.rank == 0)) return Status::Ok();  // stage 0: rank 0's file holds it all
  const manifest::File& file = m.files[static_cast<size_t>(d_.layout.srank)];
  STRATA_RETURN_IF_ERROR(manifest::CheckFiles(m, folder));
  STRATA_RETURN_IF_ERROR(VerifyFile(file, folder));
  if ((m.state_format == "compact") != d_.layout.compact)
    return differs("it holds state_format " + m.state_format + "; the engine's is " + d_.config.strata.state_format);
  std::unique_ptr<ShardBlocks> sb;
  int located = -1;
  for (const manifest::Block& mb : file.blocks) {
    const int g = static_cast<int>(mb.group);
    if (g != located) {  // the group's blocks, loaded
      sb.reset();
      sb = std::make_unique<ShardBlocks>();
      STRATA_RETURN_IF_ERROR(d_.layout.frozen(g) ? d_.shards.LocateFrozenP(g, true, sb.get()) : d_.shards.LocateShard(g, true, sb.get()));
      located = g;
    }
    ShardStore::Piece pieces[2];  // CheckManifestLayout: a frozen group's blocks are P, the others' W, M, V
    const int np = d_.shards.SavedPieces(g, mb.state == manifest::kSavedP ? int(StateKind::kP) : mb.state + 1, sb->at, pieces);
    XXH3_state_t* bh = XXH3_createState();
    XXH3_64bits_reset(bh);
    uint64_t bytes = 0;
    for (int k = 0; k < np; ++k) {
      XXH3_64bits_update(bh, pieces[k].ptr, pieces[k].bytes);
      bytes += pieces[k].bytes;
    }
    const uint64_t h = XXH3_64bits_digest(bh);
    XXH3_freeState(bh);
    if (bytes != mb.bytes || h != mb.xxh3)
      return differs(std::string(manifest::SavedStateName(mb.state)) + " of group " + std::to_string(mb.group) +
                     " is not the engine's");
  }
  return Status::Ok();
}

}  // namespace strata

// Checkpoints, the load: find the checkpoint (a tag, or the newest in the
// folder), check its manifest against this engine and the files, verify
// every checksum, and only then apply it. The engine is changed only after
// everything was verified on every rank; an I/O error while applying (the
// state is then partly written) marks the engine broken until a load
// succeeds, never a silent mix.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <memory>

#include "base/align.h"
#include "base/log.h"
#include "base/sizes.h"
#include "engine/checkpoint/checkpoint_files.h"
#include "engine/checkpoint/checkpointer.h"
#include "engine/layout/staging_plan.h"
#include "engine/step/step_checks.h"
#include "kernels/cpu/cast.h"

namespace strata {

using manifest::Hex;
using namespace ckpt;  // NOLINT: the checkpoint file helpers

Status Checkpointer::Load(const std::string& dir, const std::string& tag, std::vector<uint8_t>* blob) {
  manifest::Manifest m;
  std::string folder = tag.empty() ? dir : dir + "/" + tag;
  // Everything is checked before anything changes: the manifest, the layout,
  // every file's size and checksum, the trainer's blob, on every rank.
  Status local = FindCheckpoint(dir, tag, &folder, &m);
  if (local.ok()) local = CheckManifestLayout(m, folder + "/manifest.json");
  if (local.ok()) local = manifest::CheckFiles(m, folder);
  for (size_t k = 0; k < m.files.size() && local.ok(); ++k) local = VerifyFile(m.files[k], folder);
  std::string btext;
  if (local.ok()) {
    const std::string bpath = folder + "/" + m.blob_file;
    auto b = ReadSmallFile(bpath, m.blob_bytes);
    if (!b.ok() && b.status().code() != Code::kNotFound && b.status().code() != Code::kCorrupt)
      local = b.status().WithContext("checkpoint load");  // the machine's error (EACCES, EIO...), not the file's
    else if (!b.ok()) local = CorruptError("checkpoint load: " + b.status().message());
    else if (b->size() != m.blob_bytes || XXH3_64bits(b->data(), b->size()) != m.blob_xxh3)
      local = CorruptError("checkpoint load: " + bpath + " is truncated or corrupt (size or checksum differs)");
    else btext = std::move(b).value();
  }
  STRATA_RETURN_IF_ERROR(Agree(local, "checkpoint load").WithContext("checkpoint load " + folder + " (nothing changed)"));
  if (d_.layout.multi) STRATA_RETURN_IF_ERROR(SameCheckpointOnEveryRank(m, folder));
  // Apply: each rank builds its shards from whichever saved shards cover them.
  // What can fail now is I/O, which leaves the state partly written. The
  // step in progress stops first: an update of it (or its speculation's
  // undo) must not land on the loaded state.
  hooks_.stop_step();
  local = ApplyResharded(m, folder);
  if (local.ok()) local = FaultPoint("recompute");
  // Agreed before P is recomputed, which gathers at stages 1-2: a rank
  // whose apply failed skipped the gathers its peers were in (COMM on
  // every rank, the communicator broken: "load again" could never work).
  Status st = Agree(local, "checkpoint load: the state written");
  if (st.ok()) {
    void* buf = d_.staging.opt.Acquire();
    st = hooks_.recompute_p(buf, buf ? d_.staging.opt.bytes() : 0);
    d_.staging.opt.Release(buf);
    st = Agree(st, "checkpoint load: P recomputed");
  }
  hooks_.drop_copies();
  if (!st.ok()) {
    d_.step.broken = "the engine's state is partly loaded: a checkpoint load from " + folder + " failed while writing it (" +
              st.ToString() + "); load a checkpoint again";
    return st.WithContext("checkpoint load " + folder + " (the state is partly written: the engine refuses every "
                          "call but a load until a load succeeds)");
  }
  hooks_.abandon_step();  // the way back from a failed or broken step (or load): none is pending now
  d_.step.applied = m.step;
  for (int g = 0; g < d_.layout.part.num_groups(); ++g) {  // each group's own count (an engine that skips groups without grads)
    const int64_t saved = m.groups[static_cast<size_t>(g)].steps;
    d_.step.group_steps[static_cast<size_t>(g)] = d_.layout.frozen(g) ? 0 : saved >= 0 ? saved : m.step;
  }
  const bool saved_fp16 = m.compute_dtype == DTypeName(DType::kF16);
  if (!d_.step.scaler.Restore({m.loss_scale, m.hysteresis_left, m.clean_steps}, saved_fp16) &&
      m.loss_scale != d_.step.scaler.scale())
    STRATA_LOG_WARN("checkpoint load {}: its loss scale {} ({}) is not taken; this engine's is {} ({})", folder,
                    m.loss_scale, m.compute_dtype, d_.step.scaler.scale(),
                    d_.step.scaler.dynamic() ? "dynamic fp16, from its config: the checkpoint is not fp16"
                                             : "fixed by its config");
  if (blob) blob->assign(btext.begin(), btext.end());
  return Status::Ok();
}

// Every rank found the same checkpoint: its identity (tag, step, save order,
// the loss scaler, the blob's and every file's checksum and size) is the
// same on all. Ranks that were given different folders or tags, or that
// resolve "" differently (a shared folder seen out of date on one host),
// would each load their shard of another state and return OK. The folder
// itself may differ (each host's mount point).
Status Checkpointer::SameCheckpointOnEveryRank(const manifest::Manifest& m, const std::string& folder) {
  std::string id = m.tag + "\n" + std::to_string(m.step) + "\n" + std::to_string(m.save_seq) + "\n" +
                   std::to_string(m.loss_scale) + "\n" + std::to_string(m.blob_bytes) + "\n" + Hex(m.blob_xxh3);
  for (const manifest::File& f : m.files) id += "\n" + f.name + " " + std::to_string(f.bytes) + " " + Hex(f.xxh3);
  const uint64_t mine = XXH3_64bits(id.data(), id.size());
  std::vector<uint64_t> all(static_cast<size_t>(d_.comm->world_size()));
  const size_t me = static_cast<size_t>(d_.comm->rank());
  all[me] = mine;
  STRATA_RETURN_IF_ERROR(d_.comm->AllGather(&all[me], all.data(), 8).WithContext("checkpoint load (nothing changed)"));
  for (size_t k = 0; k < all.size(); ++k)
    if (all[k] != mine)
      return InvalidError("checkpoint load: rank " + std::to_string(k) + " found another checkpoint than rank " +
                          std::to_string(me) + "'s " + folder + " (step " + std::to_string(m.step) +
                          "): ranks were given different folders or tags, or see the folder differently; "
                          "nothing changed");
  return Status::Ok();
}

// The checkpoint to load: DIR/TAG, or with TAG "" the newest complete one in
// DIR. Newest is by save order (save_seq, which every save numbers one past
// the checkpoints already there), then step (checkpoints of older Strata
// have no save_seq), then the one `latest` names. `latest` alone would be one
// behind after a save killed between its rename and the update of latest.
Status Checkpointer::FindCheckpoint(const std::string& dir, const std::string& tag, std::string* folder,
                                    manifest::Manifest* m) {
  STRATA_ASSIGN_OR_RETURN(const bool is_dir, IsDir(dir));
  if (!is_dir) return NotFoundError("checkpoint load: " + dir + " does not exist (no checkpoint saved there)");
  if (!tag.empty()) {
    if (!ValidTag(tag)) return InvalidError("checkpoint load: '" + tag + "' is not a valid tag");
    *folder = dir + "/" + tag;
    STRATA_ASSIGN_OR_RETURN(const bool exists, Exists(*folder));
    if (!exists) return NotFoundError("checkpoint load: " + *folder + " does not exist (no checkpoint of that tag)");
    STRATA_ASSIGN_OR_RETURN(*m, ReadManifestAt(*folder));
    return Status::Ok();
  }
  std::string newest;
  STRATA_RETURN_IF_ERROR(FindNewest(dir, "checkpoint load", &newest, m));
  *folder = dir + "/" + newest;
  return Status::Ok();
}

// The saved model must be this model: groups, tensor names and sizes (and
// shapes, where both the checkpoint and the engine have one), which groups
// are frozen, the optimizer and the states it keeps. The number of ranks
// may differ (the shards are recut).
Status Checkpointer::CheckManifestLayout(const manifest::Manifest& m, const std::string& mpath) {
  if (m.optimizer != d_.config.optimizer.type)
    return InvalidError("checkpoint load: " + mpath + " holds " + m.optimizer + " state; this engine runs " +
                        d_.config.optimizer.type);
  if (m.groups.size() != static_cast<size_t>(d_.layout.part.num_groups()))
    return InvalidError("checkpoint load: " + mpath + " has " + std::to_string(m.groups.size()) +
                        " groups; the engine has " + std::to_string(d_.layout.part.num_groups()));
  for (int g = 0; g < d_.layout.part.num_groups(); ++g) {
    const GroupLayout& L = d_.layout.part.group(g);
    const manifest::Group& G = m.groups[static_cast<size_t>(g)];
    if (G.numel != L.numel || G.tensors.size() != L.tensors.size())
      return InvalidError("checkpoint load: group " + std::to_string(g) + " of " + mpath + " has another layout");
    if (G.frozen != d_.layout.frozen(g))
      return InvalidError("checkpoint load: group " + std::to_string(g) + " is " +
                          (G.frozen ? "frozen" : "not frozen") + " in " + mpath + " but " +
                          (d_.layout.frozen(g) ? "frozen (freeze_group)" : "not frozen") +
                          " in the engine; freeze the groups the saving run froze");
    for (size_t t = 0; t < L.tensors.size(); ++t)
      if (G.tensors[t].name != L.tensors[t].name || G.tensors[t].numel != L.tensors[t].numel)
        return InvalidError("checkpoint load: tensor '" + L.tensors[t].name + "' of group " + std::to_string(g) +
                            " differs in " + mpath);
      else if (G.tensors[t].shaped && L.tensors[t].shaped && G.tensors[t].shape != L.tensors[t].shape)
        return InvalidError("checkpoint load: tensor '" + L.tensors[t].name + "' of group " +
                            std::to_string(g) + " has shape " + ShapeString(G.tensors[t].shape) + " in " +
                            mpath + "; the engine's is " + ShapeString(L.tensors[t].shape));
  }
  uint32_t kept = 0;  // the saved states this engine keeps (of the groups that train)
  for (int s = 0; s < manifest::kNumSaved && d_.layout.any_trainable(); ++s)
    if (d_.layout.StateUsed(s + 1)) kept |= 1u << s;
  if (kept != m.saved_states)
    return CorruptError("checkpoint load: " + mpath + " holds states " + StatesOf(m.saved_states) + " of each group; " +
                        d_.config.optimizer.type + " keeps " + StatesOf(kept));
  return Status::Ok();
}

std::string Checkpointer::StatesOf(uint32_t bits) {
  std::string s;
  for (int k = 0; k < manifest::kNumSaved; ++k)
    if (bits & (1u << k)) s += manifest::SavedStateName(k);
  return s.empty() ? "none" : s;
}

// One data file against its checksums: the whole file's, or (a snapshot)
// each block's and the one over the blocks' checksums.
Status Checkpointer::VerifyFile(const manifest::File& file, const std::string& folder) {
  const std::string path = folder + "/" + file.name;
  const uint64_t buf_bytes = 8 * kMiB;
  void* buf = nullptr;
  if (posix_memalign(&buf, 4096, buf_bytes) != 0) return NoMemError("checkpoint load: no memory for a read buffer");
  std::unique_ptr<void, void (*)(void*)> own(buf, std::free);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) return CorruptError("checkpoint load: " + path + " is missing");
  if (fd < 0) return PosixError("checkpoint load: open", path, errno);
  struct Closer { int fd; ~Closer() { ::close(fd); } } closer{fd};
  XXH3_state_t* hs = XXH3_createState();
  struct Free { XXH3_state_t* h; ~Free() { XXH3_freeState(h); } } free_state{hs};
  auto hash_range = [&](uint64_t off, uint64_t bytes, uint64_t* out) -> Status {
    XXH3_64bits_reset(hs);
    for (uint64_t done = 0; done < bytes;) {
      const uint64_t n = std::min(buf_bytes, bytes - done);
      STRATA_RETURN_IF_ERROR(PreadFull(fd, buf, n, off + done, path));
      XXH3_64bits_update(hs, buf, n);
      done += n;
    }
    *out = XXH3_64bits_digest(hs);
    return Status::Ok();
  };
  if (!file.hash_of_blocks) {
    uint64_t h = 0;
    STRATA_RETURN_IF_ERROR(hash_range(0, file.bytes, &h));
    if (h != file.xxh3) return CorruptError("checkpoint load: checksum mismatch in " + path);
    return Status::Ok();
  }
  std::vector<uint64_t> hashes;
  for (const manifest::Block& b : file.blocks) {
    uint64_t h = 0;
    STRATA_RETURN_IF_ERROR(hash_range(b.offset, b.bytes, &h));
    if (h != b.xxh3)
      return CorruptError("checkpoint load: checksum mismatch in " + path + " at offset " + std::to_string(b.offset));
    hashes.push_back(h);
  }
  if (XXH3_64bits(hashes.data(), hashes.size() * sizeof(uint64_t)) != file.xxh3)
    return CorruptError("checkpoint load: the block list of " + path + " does not match its checksum");
  return Status::Ok();
}

// This rank's shard of every group's W, M, V, cut from the saved shards
// (which may have been cut for another number of ranks). The manifest was
// checked: every shard's file holds every state of every group.
Status Checkpointer::ApplyResharded(const manifest::Manifest& m, const std::string& folder) {
  std::vector<int> fds;
  struct Closer { std::vector<int>& v; ~Closer() { for (int x : v) ::close(x); } } closer{fds};
  for (const manifest::File& f : m.files) {
    const std::string path = folder + "/" + f.name;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return PosixError("checkpoint load: open", path, errno);
    fds.push_back(fd);
  }
  // [file][group][state] -> the block's offset in that file.
  std::vector<std::vector<std::array<uint64_t, manifest::kNumBlockStates>>> at(m.files.size());
  for (size_t k = 0; k < m.files.size(); ++k) {
    at[k].resize(m.groups.size());
    for (const manifest::Block& b : m.files[k].blocks) at[k][b.group][static_cast<size_t>(b.state)] = b.offset;
  }
  // The saved blocks are read straight into the engine's blocks when the
  // formats agree; else a chunk at a time into these and converted.
  const bool saved_compact = m.state_format == "compact";
  constexpr uint64_t kChunk = 1 << 16;  // elements, a multiple of kCompactBlock
  std::vector<char> tmp;
  FormatView tv;
  tv.compact = saved_compact;
  const bool has_v = d_.layout.StateUsed(int(StateKind::kV));
  if (saved_compact != d_.layout.compact) {
    uint64_t bytes = 0, put[3][2] = {};
    for (int s = 0; s < manifest::kNumSaved; ++s) {
      manifest::SavedArray arr[2];
      const int k = manifest::SavedArrays(saved_compact, s, kChunk, arr);
      for (int a = 0; a < k; ++a) {
        put[s][a] = bytes;
        bytes += AlignUp(kChunk / arr[a].per * arr[a].unit, 64);
      }
    }
    tmp.resize(bytes);
    char* base = tmp.data();
    if (saved_compact) {
      tv.cs = {reinterpret_cast<uint16_t*>(base + put[0][0]), reinterpret_cast<int8_t*>(base + put[0][1]),
               reinterpret_cast<int8_t*>(base + put[1][0]), reinterpret_cast<float*>(base + put[1][1]),
               has_v ? reinterpret_cast<uint8_t*>(base + put[2][0]) : nullptr,
               has_v ? reinterpret_cast<float*>(base + put[2][1]) : nullptr};
    } else {
      for (int s = 0; s < 3; ++s) tv.f[s] = reinterpret_cast<float*>(base + put[s][0]);
      if (!has_v) tv.f[2] = nullptr;
    }
  }
  // A frozen group's P (CheckManifestLayout: frozen there too): the part of
  // the group this rank holds (its shard at stage 3, else all of it), from
  // the saved shards' P blocks, in the saved compute dtype, cast to ours.
  auto apply_frozen = [&](int g) -> Status {
    const GroupLayout& L = d_.layout.part.group(g);
    const uint64_t old_shard = m.groups[static_cast<size_t>(g)].shard_numel;
    STRATA_ASSIGN_OR_RETURN(const DType saved, ParseDType(m.compute_dtype));  // the parse checked it
    const uint64_t ssize = DTypeSize(saved), dsize = DTypeSize(d_.layout.dtype);
    ShardBlocks sb;
    STRATA_RETURN_IF_ERROR(d_.shards.LocateFrozenP(g, false, &sb));
    char* p = static_cast<char*>(sb.at[int(StateKind::kP)]);
    std::memset(p, 0, d_.layout.PHomeNumel(g) * dsize);  // the padding: zeros
    const uint64_t a0 = d_.layout.p_sharded ? static_cast<uint64_t>(d_.layout.srank) * L.shard_numel : 0;
    const uint64_t end = a0 + (d_.layout.p_sharded ? L.RealInShard(d_.layout.srank) : L.numel);
    std::vector<char> chunk(saved == d_.layout.dtype ? 0 : kChunk * ssize);
    std::vector<float> wide(saved != d_.layout.dtype && saved != DType::kF32 && d_.layout.dtype != DType::kF32 ? kChunk : 0);
    for (uint64_t a = a0; a < end;) {  // f < files: shard_numel * shard_world = padded >= numel
      const uint64_t f = a / old_shard, within = a % old_shard;
      uint64_t run = std::min(end - a, old_shard - within);
      if (!chunk.empty()) run = std::min(run, kChunk);
      char* into = chunk.empty() ? p + (a - a0) * dsize : chunk.data();
      STRATA_RETURN_IF_ERROR(PreadFull(fds[f], into, run * ssize,
                                       at[f][static_cast<size_t>(g)][manifest::kSavedP] + within * ssize,
                                       folder + "/" + m.files[f].name));
      if (!chunk.empty() && wide.empty()) {
        STRATA_RETURN_IF_ERROR(kernels::Cast(saved, into, d_.layout.dtype, p + (a - a0) * dsize, run));
      } else if (!chunk.empty()) {  // bf16 <-> f16: through fp32
        STRATA_RETURN_IF_ERROR(kernels::Cast(saved, into, DType::kF32, wide.data(), run));
        STRATA_RETURN_IF_ERROR(kernels::Cast(DType::kF32, wide.data(), d_.layout.dtype, p + (a - a0) * dsize, run));
      }
      a += run;
    }
    return d_.shards.StoreShard(g, sb);
  };
  for (int g = 0; g < d_.layout.part.num_groups(); ++g) {
    if (d_.layout.frozen(g)) {
      STRATA_RETURN_IF_ERROR(apply_frozen(g));
      if (g == 0) STRATA_RETURN_IF_ERROR(FaultPoint("apply"));  // tests: fail with the state partly written
      continue;
    }
    const GroupLayout& L = d_.layout.part.group(g);
    const uint64_t n = L.shard_numel, old_shard = m.groups[static_cast<size_t>(g)].shard_numel;
    const uint64_t lo = static_cast<uint64_t>(d_.layout.srank) * n, real = L.RealInShard(d_.layout.srank);
    ShardBlocks sb;
    STRATA_RETURN_IF_ERROR(d_.shards.LocateShard(g, false, &sb));
    const FormatView dst = d_.shards.ShardView(g, sb);
    // Elements [a0, a0 + count) of the group, every saved state, into `into`
    // (at its element 0), from whichever saved shards hold them.
    auto read = [&](const FormatView& into, uint64_t a0, uint64_t count) -> Status {
      for (int s = 0; s < manifest::kNumSaved; ++s) {
        if (!d_.blocks[static_cast<size_t>(g)][static_cast<size_t>(s + 1)].alloc.charged) continue;
        manifest::SavedArray arr[2];
        const int karr = manifest::SavedArrays(saved_compact, s, old_shard, arr);
        for (int k = 0; k < karr; ++k)
          for (uint64_t a = a0; a < a0 + count;) {  // f < files: shard_numel * shard_world = padded >= numel
            const uint64_t f = a / old_shard, within = a % old_shard, run = std::min(a0 + count - a, old_shard - within);
            const uint64_t off = at[f][static_cast<size_t>(g)][static_cast<size_t>(s)] + arr[k].offset +
                                 within / arr[k].per * arr[k].unit;
            const uint64_t bytes = (run + arr[k].per - 1) / arr[k].per * arr[k].unit;
            STRATA_RETURN_IF_ERROR(
                PreadFull(fds[f], into.Array(s, k, a - a0), bytes, off, folder + "/" + m.files[f].name));
            a += run;
          }
      }
      return Status::Ok();
    };
    for (int s = 0; s < manifest::kNumSaved; ++s) {  // padding, and what the saved shards leave: zeros
      manifest::SavedArray arr[2];
      const int karr = manifest::SavedArrays(d_.layout.compact, s, n, arr);
      for (int k = 0; k < karr; ++k)
        if (char* p = dst.Array(s, k, 0)) std::memset(p, 0, (n + arr[k].per - 1) / arr[k].per * arr[k].unit);
    }
    if (saved_compact == d_.layout.compact) {
      STRATA_RETURN_IF_ERROR(read(dst, lo, real));
    } else {
      for (uint64_t c0 = 0; c0 < real; c0 += kChunk) {
        const uint64_t c = std::min(kChunk, real - c0);
        STRATA_RETURN_IF_ERROR(read(tv, lo + c0, c));
        STRATA_RETURN_IF_ERROR(ConvertView(tv, dst.Shift(c0), c));
      }
    }
    STRATA_RETURN_IF_ERROR(d_.shards.StoreShard(g, sb));
    if (g == 0) STRATA_RETURN_IF_ERROR(FaultPoint("apply"));  // tests: fail with the state partly written
  }
  return Status::Ok();
}

}  // namespace strata

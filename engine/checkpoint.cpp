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
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/align.h"
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

Status Engine::Impl::CheckBetweenSteps(const char* call) {
  if (!built_) return StateError(std::string(call) + ": the engine is not built");
  if (multi())
    return UnsupportedError(std::string(call) + ": checkpoints of several ranks are not implemented yet (one rank only)");
  for (int g = 0; g < part_.num_groups(); ++g) {
    const GroupState& gs = groups_[static_cast<size_t>(g)];
    if (gs.dev.pins > 0) return StateError(std::string(call) + ": group " + std::to_string(g) + " is fetched");
    if (gs.grad_calls > 0)
      return StateError(std::string(call) + ": gradients of group " + std::to_string(g) +
                        " are pending; save or load between steps");
  }
  WaitPrefetchIdle();
  return Status::Ok();
}

Status Engine::Impl::SaveCheckpoint(const std::string& dir, const std::string& tag, const void* blob,
                                    uint64_t blob_bytes) {
  STRATA_RETURN_IF_ERROR(CheckBetweenSteps("checkpoint save"));
  if (!ValidTag(tag))
    return InvalidError("checkpoint save: tag '" + tag + "' must be 1-200 of [A-Za-z0-9._-], not starting with '.', not 'latest'");
  if (blob_bytes > 0 && !blob) return InvalidError("checkpoint save: a blob length without a blob");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IoError("checkpoint save: cannot create " + dir + ": " + ec.message());
  const std::string final_dir = dir + "/" + tag, part = dir + "/." + tag + ".partial";
  if (std::filesystem::exists(final_dir))
    return InvalidError("checkpoint save: " + final_dir + " exists; checkpoints are never overwritten");
  std::filesystem::remove_all(part, ec);  // a crashed save's leftovers
  if (::mkdir(part.c_str(), 0755) != 0) return PosixError("mkdir", part, errno);
  auto fail = [&](Status st) {
    std::error_code e2;
    std::filesystem::remove_all(part, e2);
    return st.WithContext("checkpoint save " + final_dir);
  };

  // The data file: every group's W, M, V shards, in order.
  uint64_t total = 0;
  for (int g = 0; g < part_.num_groups(); ++g)
    for (int s : kSaved)
      if (groups_[static_cast<size_t>(g)].blocks[static_cast<size_t>(s)].alloc.charged) total += part_.group(g).shard_numel * 4;
  const std::string data_path = part + "/" + RankFile(options_.rank);
  auto fid = storage_->Open(data_path, OpenMode::kCreate);
  if (!fid.ok()) return fail(fid.status());
  Status st = ReserveFileSpace(storage_->Info(*fid).fd, data_path, total);
  Json blocks = Json::array();
  XXH3_state_t* hs = XXH3_createState();
  XXH3_64bits_reset(hs);
  uint64_t off = 0;
  IoTicket pending;  // the write in flight, from `pending_slot`
  void* pending_slot = nullptr;
  void* slot = nullptr;
  for (int g = 0; st.ok() && g < part_.num_groups(); ++g) {
    for (int s : kSaved) {
      const StateBlock& b = groups_[static_cast<size_t>(g)].blocks[static_cast<size_t>(s)];
      if (!b.alloc.charged) continue;
      const uint64_t bytes = part_.group(g).shard_numel * 4;
      const void* src = nullptr;
      if (io_->Direct(b)) {
        src = io_->DirectPtr(b);
      } else {  // through a slot: read it while the previous block is written
        slot = opt_staging_.Acquire();
        st = io_->Load(b, slot);
        src = slot;
      }
      if (!st.ok()) break;
      const uint64_t h = XXH3_64bits(src, bytes);
      XXH3_64bits_update(hs, src, bytes);
      blocks.push_back({{"group", g}, {"state", StateName(StateKind(s))}, {"offset", off}, {"bytes", bytes}, {"xxh3", Hex(h)}});
      if (pending) {
        st = pending->Wait();
        if (pending_slot) opt_staging_.Release(pending_slot);
        pending_slot = nullptr;
        if (!st.ok()) break;
      }
      IoOp op{IoOp::kWrite, *fid, off, const_cast<void*>(src), bytes};
      pending = storage_->Submit({&op, 1});
      pending_slot = slot;
      slot = nullptr;
      stats_->AddMoved(b.home == TierKind::kNvme ? TierKind::kNvme : TierKind::kHost, TierKind::kNvme, bytes);
      off += bytes;
    }
  }
  if (pending) {
    Status w = pending->Wait();
    if (st.ok()) st = w;
  }
  if (pending_slot) opt_staging_.Release(pending_slot);
  if (slot) opt_staging_.Release(slot);
  const uint64_t file_hash = XXH3_64bits_digest(hs);
  XXH3_freeState(hs);
  if (st.ok() && ::fsync(storage_->Info(*fid).fd) != 0) st = PosixError("fsync", data_path, errno);
  storage_->Close(*fid).IgnoreError();
  if (!st.ok()) return fail(st);
  st = WriteSmallFile(part + "/trainer.bin", blob, blob_bytes);
  if (!st.ok()) return fail(st);
  KillPoint("data");

  Json groups = Json::array();
  for (int g = 0; g < part_.num_groups(); ++g) {
    const GroupLayout& L = part_.group(g);
    Json tensors = Json::array();
    for (const auto& t : L.tensors) tensors.push_back({{"name", t.name}, {"offset", t.offset}, {"numel", t.numel}});
    groups.push_back({{"numel", L.numel}, {"padded", L.padded}, {"shard_numel", L.shard_numel}, {"tensors", tensors}});
  }
  const LossScaler::State ls = scaler_.state();
  Json m = {{"format", "strata-checkpoint"}, {"version", kFormatVersion}, {"tag", tag},
            {"world_size", options_.world_size}, {"stage", config_.zero.stage},
            {"compute_dtype", DTypeName(dtype_)}, {"optimizer", config_.optimizer.type},
            {"step", step_count_},
            {"loss_scaler", {{"scale", ls.scale}, {"hysteresis_left", ls.hysteresis_left}, {"clean_steps", ls.clean_steps}}},
            {"groups", groups},
            {"files", Json::array({{{"name", RankFile(options_.rank)}, {"rank", options_.rank}, {"bytes", total},
                                    {"xxh3", Hex(file_hash)}, {"blocks", blocks}}})},
            {"trainer_blob", {{"file", "trainer.bin"}, {"bytes", blob_bytes},
                              {"xxh3", Hex(XXH3_64bits(blob, blob_bytes))}}}};
  st = ReplaceFile(part, "manifest.json", m.dump(1));
  if (!st.ok()) return fail(st);
  KillPoint("manifest");
  if (::rename(part.c_str(), final_dir.c_str()) != 0) return fail(PosixError("rename " + part + " to", final_dir, errno));
  st = FsyncPath(dir);
  if (!st.ok()) return st.WithContext("checkpoint save " + final_dir);
  KillPoint("rename");
  st = ReplaceFile(dir, "latest", tag + "\n");
  if (!st.ok()) return st.WithContext("checkpoint save: updating " + dir + "/latest");
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
  STRATA_RETURN_IF_ERROR(CheckBetweenSteps("checkpoint load"));
  std::string tag = tag_in;
  if (tag.empty()) {
    STRATA_ASSIGN_OR_RETURN(std::string t, ReadSmallFile(dir + "/latest", 4096));
    while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
    tag = t;
  }
  if (!ValidTag(tag)) return CorruptError("checkpoint load: " + dir + "/latest names an invalid tag '" + tag + "'");
  const std::string folder = dir + "/" + tag, mpath = folder + "/manifest.json";
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(mpath, 256 * kMiB));
  Json m;
  try {
    m = Json::parse(text);
  } catch (const std::exception& e) {
    return CorruptError("checkpoint load: " + mpath + " is not valid JSON: " + e.what());
  }
  // Everything is checked before anything changes.
  auto bad = [&](const std::string& why) { return CorruptError("checkpoint load: " + mpath + ": " + why); };
  try {
    if (m.at("format") != "strata-checkpoint" || m.at("version").get<int>() != kFormatVersion)
      return bad("not a version " + std::to_string(kFormatVersion) + " strata checkpoint");
    if (m.at("world_size").get<int>() != options_.world_size)
      return UnsupportedError("checkpoint load: " + mpath + " was saved by " + m.at("world_size").dump() +
                              " ranks; this engine has " + std::to_string(options_.world_size) + " (resharding needs the gathered path)");
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
  } catch (const std::exception& e) {
    return bad(std::string("missing or mistyped field: ") + e.what());
  }
  const Json& file = m["files"][0];
  const std::string data_path = folder + "/" + file.value("name", "");
  const uint64_t data_bytes = file.value("bytes", uint64_t{0});
  void* buf = opt_staging_.count() ? opt_staging_.Acquire() : nullptr;
  std::unique_ptr<void, void (*)(void*)> own(nullptr, std::free);
  uint64_t buf_bytes = opt_staging_.bytes();
  if (!buf) {  // no staging slots (everything addressable): a temporary aligned buffer
    buf_bytes = 8 * kMiB;
    if (posix_memalign(&buf, 4096, buf_bytes) != 0) return NoMemError("checkpoint load: no memory for a read buffer");
    own.reset(buf);
  }
  auto release = [&] { if (!own) opt_staging_.Release(buf); };
  auto h = HashFile(*storage_, data_path, data_bytes, buf, AlignDown(buf_bytes, 4096));
  if (!h.ok() || Hex(*h) != file.value("xxh3", "")) {
    release();
    return h.ok() ? CorruptError("checkpoint load: checksum mismatch in " + data_path) : h.status();
  }
  const std::string bpath = folder + "/" + m["trainer_blob"].value("file", "trainer.bin");
  auto btext = ReadSmallFile(bpath, 1ull << 32);
  if (!btext.ok() || btext->size() != m["trainer_blob"].value("bytes", uint64_t{0}) ||
      Hex(XXH3_64bits(btext->data(), btext->size())) != m["trainer_blob"].value("xxh3", "")) {
    release();
    return CorruptError("checkpoint load: " + bpath + " is missing, truncated or corrupt");
  }
  // Apply: each block read from the file (checked again), stored to its home.
  STRATA_ASSIGN_OR_RETURN(FileId f, storage_->Open(data_path, OpenMode::kReadOnly));
  Status st;
  for (const Json& bj : file["blocks"]) {
    const int g = bj.value("group", -1);
    const std::string sname = bj.value("state", "");
    int s = -1;
    for (int k : kSaved) if (sname == StateName(StateKind(k))) s = k;
    const uint64_t bytes = bj.value("bytes", uint64_t{0});
    if (g < 0 || g >= part_.num_groups() || s < 0 || bytes != part_.group(g).shard_numel * 4 || bytes > buf_bytes) {
      st = CorruptError("checkpoint load: a block entry of " + mpath + " does not fit the engine");
      break;
    }
    IoOp op{IoOp::kRead, f, bj.value("offset", uint64_t{0}), buf, bytes};
    st = storage_->Run({&op, 1});
    if (st.ok() && Hex(XXH3_64bits(buf, bytes)) != bj.value("xxh3", ""))
      st = CorruptError("checkpoint load: checksum mismatch in " + data_path + " at offset " +
                        std::to_string(bj.value("offset", uint64_t{0})));
    if (st.ok()) st = io_->Store(groups_[static_cast<size_t>(g)].blocks[static_cast<size_t>(s)], buf);
    if (!st.ok()) break;
  }
  storage_->Close(f).IgnoreError();
  // P = W in the compute dtype, as after every step.
  for (int g = 0; st.ok() && g < part_.num_groups(); ++g) {
    GroupState& gs = groups_[static_cast<size_t>(g)];
    const uint64_t n = part_.group(g).shard_numel;
    float* w = static_cast<float*>(buf);
    st = io_->Direct(gs.blocks[int(StateKind::kW)]) ? Status::Ok() : io_->Load(gs.blocks[int(StateKind::kW)], w);
    if (io_->Direct(gs.blocks[int(StateKind::kW)])) w = static_cast<float*>(io_->DirectPtr(gs.blocks[int(StateKind::kW)]));
    if (!st.ok()) break;
    const StateBlock& p = gs.blocks[int(StateKind::kP)];
    if (io_->Direct(p)) {
      st = kernels::Cast(DType::kF32, w, dtype_, io_->DirectPtr(p), n);
    } else {
      const uint64_t at = w == buf ? AlignUp(n * 4, 4096) : 0;  // after W when W is in the buffer
      char* pbuf = static_cast<char*>(buf) + at;
      if (at + n * DTypeSize(dtype_) > buf_bytes) {
        st = InternalError("checkpoint load: the staging slot cannot hold W and P together");
        break;
      }
      st = kernels::Cast(DType::kF32, w, dtype_, pbuf, n);
      if (st.ok()) st = io_->Store(p, pbuf);
    }
  }
  release();
  if (!st.ok()) return st.WithContext("checkpoint load " + folder + " (the engine's state is now partly loaded)");
  step_count_ = m.value("step", int64_t{0});
  const Json& lj = m["loss_scaler"];
  scaler_.set_state({lj.value("scale", 1.0), lj.value("hysteresis_left", 2), lj.value("clean_steps", int64_t{0})});
  DropDeviceCopies();
  if (blob) blob->assign(btext->begin(), btext->end());
  return Status::Ok();
}

}  // namespace strata

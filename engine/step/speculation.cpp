// Speculation (speculation.h): room for overlap_step's held updates, and
// their commit or undo.
#include "engine/step/speculation.h"

#include <cstring>

namespace strata {

namespace {

constexpr uint64_t kBackupAlign = 64;

// The states a step writes: P (compact: the master's bf16 half; fp32: a
// copy of W), W, M, V.
constexpr int kWritten[] = {int(StateKind::kP), int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)};

}  // namespace

Speculation::Needs Speculation::NeedsOf(const Layout& layout, int g, bool gpu_updates,
                                        const std::function<uint64_t(uint64_t)>& padded) {
  Needs n;
  // A group stepped in units (Layout::units) commits unit by unit: held
  // whole it would need the room its units exist to avoid. It updates after
  // backward.
  if (layout.frozen(g) || gpu_updates || layout.Units(g) > 1) return n;
  for (int s : kWritten) {
    if (!layout.StateUsedBy(s, g)) continue;  // (P that is W's bytes has no block: never written)
    const TierKind home = layout.home[s];
    const bool copy = s == int(StateKind::kP) && !layout.compact;  // recomputable from W
    if (home == TierKind::kNvme) {
      n.disk += padded(layout.StateBytes(s, g));
    } else if (BlockIo::DirectAt(home, layout.device_on_gpu)) {
      if (copy) continue;
      const uint64_t bytes = s == int(StateKind::kP) ? layout.part.group(g).shard_numel * 2  // this rank's slice
                                                      : layout.StateBytes(s, g);
      n.host += AlignUp(bytes, kBackupAlign);
    } else if (!copy) {
      return Needs{};  // lands in place on a GPU: nothing to undo it with
    }
  }
  n.eligible = true;
  return n;
}

Speculation::Needs Speculation::TotalNeeds(const Layout& layout, const std::function<bool(int)>& gpu_updates,
                                           const std::function<uint64_t(uint64_t)>& padded) {
  Needs t;
  for (int g = 0; g < layout.part.num_groups(); ++g) {
    const Needs n = NeedsOf(layout, g, gpu_updates(g), padded);
    if (!n.eligible) continue;
    t.eligible = true;
    t.host += n.host;
    t.disk += n.disk;
  }
  return t;
}

Speculation::~Speculation() {
  Discard();
  if (arena_.ptr) host_.Free(arena_);
}

Status Speculation::Init(uint64_t host_bytes, uint64_t disk_bytes) {
  records_.assign(static_cast<size_t>(layout_.part.num_groups()), Record{});
  disk_budget_ = disk_bytes;
  if (host_bytes > 0) {
    auto a = host_.Allocate(host_bytes);
    if (!a.ok())
      return a.status().WithContext("build: strata.speculation_host_bytes (" + std::to_string(host_bytes) +
                                    " bytes for overlap_step's speculation)");
    arena_ = *a;
  }
  return Status::Ok();
}

Status Speculation::AddHostRoom(uint64_t bytes) {
  if (arena_.bytes != 0) return InternalError("speculation: the host arena exists already");
  auto a = host_.Allocate(bytes);
  if (!a.ok()) return a.status().WithContext("overlap_step: speculation's host arena");
  arena_ = *a;
  return Status::Ok();
}

bool Speculation::Reserve(int g) {
  Record& r = records_[static_cast<size_t>(g)];
  if (r.reserved) return false;
  const Needs n = NeedsOf(layout_, g, gpu_updates_(g), padded_);
  if (!n.eligible || n.host > arena_.bytes - arena_top_ || n.disk > disk_budget_ - disk_used_) return false;
  r = Record{};
  r.reserved = true;
  r.host = n.host;
  r.disk = n.disk;
  r.host_at = arena_top_;
  arena_top_ += n.host;
  disk_used_ += n.disk;
  ++reserved_;
  return true;
}

void Speculation::Backup(int g, const void* home, uint64_t bytes) {
  Record& r = records_[static_cast<size_t>(g)];
  const uint64_t at = r.host_at + r.host_used;
  std::memcpy(static_cast<char*>(arena_.ptr) + at, home, bytes);
  r.backups.push_back({const_cast<void*>(home), at, bytes});
  r.host_used += AlignUp(bytes, kBackupAlign);
}

void Speculation::Hold(int g, BlockMove move) { records_[static_cast<size_t>(g)].held.push_back(std::move(move)); }

void Speculation::Ready(int g, bool p_stale) {
  Record& r = records_[static_cast<size_t>(g)];
  r.ready = true;
  r.p_stale = p_stale;
  ready_.push_back(g);
}

void Speculation::Undo(Record& r) {
  for (auto& m : r.held) io_.SettleStore(m, /*publish=*/false);
  for (const auto& b : r.backups) std::memcpy(b.home, static_cast<const char*>(arena_.ptr) + b.offset, b.bytes);
}

void Speculation::Release(Record& r) {
  r = Record{};
  if (--reserved_ == 0) {
    arena_top_ = 0;
    disk_used_ = 0;
  }
}

void Speculation::Fail(int g) {
  Record& r = records_[static_cast<size_t>(g)];
  if (!r.reserved) return;
  Undo(r);
  // A failure part-way (a W, M or V store) may come after the update wrote
  // P in place (a P copy of W, not backed up): as in Discard, P is marked to
  // be rewritten from the restored W, which a step that is then skipped
  // does (RepairStaleP), and an updating one overwrites.
  MarkPStale(g);
  Release(r);
}

void Speculation::MarkPStale(int g) {
  if (!layout_.compact && layout_.StateUsedBy(int(StateKind::kP), g) && layout_.home[int(StateKind::kP)] != TierKind::kNvme)
    steps_[static_cast<size_t>(g)].p_stale = true;
}

void Speculation::FailUnready() {
  for (int g = 0; g < static_cast<int>(records_.size()); ++g)
    if (records_[static_cast<size_t>(g)].reserved && !records_[static_cast<size_t>(g)].ready) Fail(g);
}

void Speculation::Commit() {
  FailUnready();
  for (int g : ready_) {
    Record& r = records_[static_cast<size_t>(g)];
    for (auto& m : r.held) io_.SettleStore(m, /*publish=*/true);
    GroupStep& gs = steps_[static_cast<size_t>(g)];
    gs.committed = true;
    gs.p_stale = r.p_stale;
    Release(r);
  }
  ready_.clear();
}

void Speculation::Discard() {
  FailUnready();
  for (int g : ready_) {
    Record& r = records_[static_cast<size_t>(g)];
    Undo(r);
    MarkPStale(g);  // P was rewritten from the new W; the restored W gives it back
    Release(r);
  }
  ready_.clear();
}

}  // namespace strata

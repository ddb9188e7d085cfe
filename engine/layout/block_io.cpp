// Block moves between the tiers and host memory.
#include "engine/layout/block_io.h"

#include <cstring>

namespace strata {

const char* StateName(StateKind s) {
  static const char* kNames[] = {"P", "W", "M", "V", "G"};
  return kNames[static_cast<int>(s)];
}

Result<StateBlock> BlockIo::Allocate(TierKind home, uint64_t bytes) {
  StateBlock b;
  b.home = home;
  b.bytes = bytes;
  Tier* t = home == TierKind::kDevice ? static_cast<Tier*>(device_)
            : home == TierKind::kHost ? static_cast<Tier*>(host_)
                                      : static_cast<Tier*>(nvme_);
  if (!t) return InternalError(std::string("no ") + TierName(home) + " tier for a block");
  STRATA_ASSIGN_OR_RETURN(b.alloc, t->Allocate(bytes));
  return b;
}

Result<StateBlock> BlockIo::AllocateParts(const std::vector<uint64_t>& part_bytes) {
  StateBlock b;
  b.home = TierKind::kNvme;
  // The parts lie back to back in a buffer (Start): each but the last must
  // end where the next one's aligned I/O begins.
  for (size_t i = 0; nvme_ && i + 1 < part_bytes.size(); ++i)
    if (part_bytes[i] % nvme_->align() != 0)
      return InternalError("nvme block in parts: part " + std::to_string(i) + " of " + std::to_string(part_bytes[i]) +
                           " bytes is not a multiple of the swap's alignment (" + std::to_string(nvme_->align()) + ")");
  for (uint64_t bytes : part_bytes) {
    auto p = Allocate(TierKind::kNvme, bytes);
    if (!p.ok()) {
      Free(b);
      return p.status();
    }
    b.bytes += bytes;
    b.alloc.bytes += bytes;
    b.alloc.charged += p->alloc.charged;
    b.parts.push_back(std::move(p).value());
  }
  return b;
}

void BlockIo::Free(StateBlock& b) {
  if (!b.parts.empty()) {
    for (StateBlock& p : b.parts) Free(p);
    b.parts.clear();
    b.alloc = {};
    return;
  }
  if (b.alloc.charged == 0) return;
  if (b.home == TierKind::kDevice) device_->Free(b.alloc);
  else if (b.home == TierKind::kHost) host_->Free(b.alloc);
  else nvme_->Free(b.alloc);
  b.alloc = {};
}

Result<BlockMove> BlockIo::Start(const StateBlock& b, void* host, bool to_home, const uint64_t* checksum) {
  if (b.home == TierKind::kNvme && gate_) STRATA_RETURN_IF_ERROR(gate_());
  BlockMove m;
  if (!b.parts.empty()) {  // each part from its place in `host`, checksummed on its own
    m.kind = BlockMove::kParts;
    m.bytes = b.bytes;
    uint64_t at = 0;
    for (const StateBlock& p : b.parts) {
      auto pm = Start(p, static_cast<char*>(host) + at, to_home, nullptr);
      if (!pm.ok()) {  // what started goes back: a load's buffer is free again, a store is discarded
        for (BlockMove& x : m.parts) {
          if (to_home) {
            (void)WaitStore(x);
            SettleStore(x, false);
          } else {
            (void)Finish(x);
          }
        }
        return pm.status().WithContext("part " + std::to_string(m.parts.size()) + " of " +
                                       std::to_string(b.parts.size()));
      }
      m.parts.push_back(std::move(pm).value());
      at += p.bytes;
    }
    return m;
  }
  m.start = stats_->Now();
  m.bytes = b.bytes;
  const TierKind from = to_home ? TierKind::kHost : b.home, to = to_home ? b.home : TierKind::kHost;
  if (b.home == TierKind::kNvme) {
    stats_->Begin(Resource::kDisk);
    auto p = to_home ? nvme_->StartWrite(b.alloc, host, checksum) : nvme_->StartRead(b.alloc, host);
    if (!p.ok()) { stats_->End(Resource::kDisk); return p.status(); }
    m.kind = BlockMove::kNvme;
    m.nvme = std::move(p).value();
    m.name = to_home ? "write" : "read";
  } else if (b.home == TierKind::kDevice) {
    stats_->Begin(Resource::kCopy);
    auto t = to_home ? device_->CopyIn(b.alloc.ptr, host, b.bytes) : device_->CopyOut(host, b.alloc.ptr, b.bytes);
    if (!t.ok()) { stats_->End(Resource::kCopy); return t.status(); }
    m.kind = BlockMove::kCopy;
    m.copy = *t;
    m.name = to_home ? "copy in" : "copy out";
  } else {
    std::memcpy(to_home ? b.alloc.ptr : host, to_home ? host : b.alloc.ptr, b.bytes);
    return m;
  }
  stats_->AddMoved(from, to, b.bytes);
  return m;
}

Result<BlockMove> BlockIo::StartLoad(const StateBlock& b, void* dst) { return Start(b, dst, false, nullptr); }

Result<BlockMove> BlockIo::StartStore(const StateBlock& b, const void* src, const uint64_t* checksum) {
  return Start(b, const_cast<void*>(src), true, checksum);  // only read from: the move goes home
}

uint64_t BlockIo::StoreChecksum(const StateBlock& b, const void* src) const {
  return b.home == TierKind::kNvme && b.parts.empty() ? nvme_->BlockChecksum(src, b.bytes) : 0;
}

void BlockIo::WaitIo(BlockMove& m) {
  if (m.kind == BlockMove::kParts) {
    for (BlockMove& p : m.parts) WaitIo(p);
    return;
  }
  if (m.kind != BlockMove::kNvme || m.io_done) return;
  nvme_->WaitIo(m.nvme);
  stats_->End(Resource::kDisk);
  stats_->Span(Resource::kDisk, m.name, m.start, stats_->Now(), m.bytes);
  m.io_done = true;
}

Status BlockIo::Finish(BlockMove& m) {
  Status st;
  if (m.kind == BlockMove::kParts) {
    for (BlockMove& p : m.parts) {
      Status s = Finish(p);
      if (st.ok() && !s.ok()) st = std::move(s);
    }
    m.parts.clear();
  } else if (m.kind == BlockMove::kNvme) {
    WaitIo(m);
    st = nvme_->Finish(m.nvme);
  } else if (m.kind == BlockMove::kCopy) {
    st = m.copy->Wait();
    stats_->End(Resource::kCopy);
    stats_->Span(Resource::kCopy, m.name, m.start, stats_->Now(), m.bytes);
  }
  m.kind = BlockMove::kNone;
  m.io_done = false;
  return st;
}

Status BlockIo::WaitStore(BlockMove& m) {
  if (m.kind == BlockMove::kParts) {
    Status st;
    for (BlockMove& p : m.parts) {
      Status s = WaitStore(p);
      if (st.ok() && !s.ok()) st = std::move(s);
    }
    return st;
  }
  if (m.kind != BlockMove::kNvme) return Finish(m);
  WaitIo(m);
  return nvme_->WaitWrite(m.nvme);
}

void BlockIo::SettleStore(BlockMove& m, bool publish) {
  if (m.kind == BlockMove::kParts) {
    for (BlockMove& p : m.parts) SettleStore(p, publish);
    m.parts.clear();
    m.kind = BlockMove::kNone;
    return;
  }
  if (m.kind != BlockMove::kNvme) return;
  nvme_->Settle(m.nvme, publish);
  m.kind = BlockMove::kNone;
  m.io_done = false;
}

Status BlockIo::Load(const StateBlock& b, void* dst) {
  STRATA_ASSIGN_OR_RETURN(BlockMove m, StartLoad(b, dst));
  return Finish(m);
}

Status BlockIo::Store(const StateBlock& b, const void* src, size_t* parts_stored) {
  if (parts_stored) *parts_stored = 0;
  if (!b.parts.empty()) {  // one part at a time: the swap's copy-on-write room holds a part, not the block
    uint64_t at = 0;
    for (const StateBlock& p : b.parts) {
      STRATA_RETURN_IF_ERROR(Store(p, static_cast<const char*>(src) + at));
      at += p.bytes;
      if (parts_stored) ++*parts_stored;
    }
    return Status::Ok();
  }
  STRATA_ASSIGN_OR_RETURN(BlockMove m, StartStore(b, src));
  return Finish(m);
}

}  // namespace strata

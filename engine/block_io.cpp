// Block moves between the tiers and host memory.
#include "engine/block_io.h"

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

void BlockIo::Free(StateBlock& b) {
  if (b.alloc.charged == 0) return;
  if (b.home == TierKind::kDevice) device_->Free(b.alloc);
  else if (b.home == TierKind::kHost) host_->Free(b.alloc);
  else nvme_->Free(b.alloc);
  b.alloc = {};
}

bool BlockIo::Direct(const StateBlock& b) const {
  return b.home == TierKind::kHost || (b.home == TierKind::kDevice && !device_->on_gpu());
}

Result<BlockMove> BlockIo::StartLoad(const StateBlock& b, void* dst) {
  BlockMove m;
  m.start = stats_->Now();
  m.bytes = b.bytes;
  if (b.home == TierKind::kNvme) {
    stats_->Begin(Resource::kDisk);
    auto p = nvme_->StartRead(b.alloc, dst);
    if (!p.ok()) { stats_->End(Resource::kDisk); return p.status(); }
    m.kind = BlockMove::kNvme;
    m.nvme = std::move(p).value();
    m.name = "read";
    stats_->AddMoved(TierKind::kNvme, TierKind::kHost, b.bytes);
  } else if (b.home == TierKind::kDevice) {
    stats_->Begin(Resource::kCopy);
    auto t = device_->CopyOut(dst, b.alloc.ptr, b.bytes);
    if (!t.ok()) { stats_->End(Resource::kCopy); return t.status(); }
    m.kind = BlockMove::kCopy;
    m.copy = *t;
    m.name = "copy out";
    stats_->AddMoved(TierKind::kDevice, TierKind::kHost, b.bytes);
  } else {
    std::memcpy(dst, b.alloc.ptr, b.bytes);
  }
  return m;
}

uint64_t BlockIo::StoreChecksum(const StateBlock& b, const void* src) const {
  return b.home == TierKind::kNvme ? nvme_->BlockChecksum(src, b.bytes) : 0;
}

Result<BlockMove> BlockIo::StartStore(const StateBlock& b, const void* src, const uint64_t* checksum) {
  BlockMove m;
  m.start = stats_->Now();
  m.bytes = b.bytes;
  if (b.home == TierKind::kNvme) {
    stats_->Begin(Resource::kDisk);
    auto p = nvme_->StartWrite(b.alloc, src, checksum);
    if (!p.ok()) { stats_->End(Resource::kDisk); return p.status(); }
    m.kind = BlockMove::kNvme;
    m.nvme = std::move(p).value();
    m.name = "write";
    stats_->AddMoved(TierKind::kHost, TierKind::kNvme, b.bytes);
  } else if (b.home == TierKind::kDevice) {
    stats_->Begin(Resource::kCopy);
    auto t = device_->CopyIn(b.alloc.ptr, src, b.bytes);
    if (!t.ok()) { stats_->End(Resource::kCopy); return t.status(); }
    m.kind = BlockMove::kCopy;
    m.copy = *t;
    m.name = "copy in";
    stats_->AddMoved(TierKind::kHost, TierKind::kDevice, b.bytes);
  } else {
    std::memcpy(b.alloc.ptr, src, b.bytes);
  }
  return m;
}

void BlockIo::WaitIo(BlockMove& m) {
  if (m.kind != BlockMove::kNvme || m.io_done) return;
  nvme_->WaitIo(m.nvme);
  stats_->End(Resource::kDisk);
  stats_->Span(Resource::kDisk, m.name, m.start, stats_->Now(), m.bytes);
  m.io_done = true;
}

Status BlockIo::Finish(BlockMove& m) {
  Status st;
  if (m.kind == BlockMove::kNvme) {
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

Status BlockIo::Load(const StateBlock& b, void* dst) {
  STRATA_ASSIGN_OR_RETURN(BlockMove m, StartLoad(b, dst));
  return Finish(m);
}

Status BlockIo::Store(const StateBlock& b, const void* src) {
  STRATA_ASSIGN_OR_RETURN(BlockMove m, StartStore(b, src));
  return Finish(m);
}

}  // namespace strata

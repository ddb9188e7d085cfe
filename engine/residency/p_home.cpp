// PHome (p_home.h): P's home into a device copy.
#include "engine/residency/p_home.h"

#include <cstring>

namespace strata {

Status PHome::Load(int g, void* copy) {
  const StateBlock& p = blocks_(g);
  void* dst = copy;
  uint64_t bytes = layout_.PBytes(g);
  if (layout_.p_sharded) {  // stage 3, several ranks: our shard now, the others' at Fetch
    bytes = p.bytes;
    dst = static_cast<char*>(dst) + static_cast<uint64_t>(layout_.srank) * bytes;
  }
  if (!device_.separate()) {
    // The device tier is host memory: read or copy straight into it.
    if (p.home == TierKind::kNvme) return io_.Load(p, dst);
    stats_.Begin(Resource::kCopy);
    std::memcpy(dst, io_.DirectPtr(p), bytes);
    stats_.End(Resource::kCopy);
    stats_.AddMoved(TierKind::kHost, TierKind::kDevice, bytes);
    return Status::Ok();
  }
  void* src = p.home == TierKind::kHost ? io_.DirectPtr(p) : nullptr;
  if (!src) {
    // The block comes whole into a slot (a load writes its aligned size).
    const uint64_t need = p.home == TierKind::kNvme ? io_.NvmeBuffer(p.bytes) : p.bytes;
    if (need > staging_.bytes())
      return InternalError("fetch of group " + std::to_string(g) + ": P's block of " + std::to_string(p.bytes) +
                           " bytes in " + TierName(p.home) + " does not fit a parameter staging slot of " +
                           std::to_string(staging_.bytes()) + " bytes");
    src = staging_.Acquire();
    if (src == nullptr)
      return InternalError("fetch of group " + std::to_string(g) + ": no parameter staging for P homed in " +
                           TierName(p.home) + " (PlanStaging made none)");
    Status st = io_.Load(p, src);
    if (!st.ok()) {
      staging_.Release(src);
      return st;
    }
  }
  stats_.Begin(Resource::kCopy);
  auto t = device_.CopyIn(dst, src, bytes);
  Status st = t.ok() ? (*t)->Wait() : t.status();
  stats_.End(Resource::kCopy);
  stats_.AddMoved(TierKind::kHost, TierKind::kDevice, bytes);
  if (p.home != TierKind::kHost) staging_.Release(src);
  return st;
}

}  // namespace strata

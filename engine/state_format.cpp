// strata.state_format: where the compact arrays of a shard are, and the fp32
// view of a shard's W, M, V in either format for the paths that are not the
// step (build, read_state, write_state, checkpoints).
#include <cstring>
#include <vector>

#include "engine/engine_impl.h"
#include "engine/preflight.h"

namespace strata {

kernels::CompactState Engine::Impl::CompactAt(int g, void* p, void* w, void* m, void* v) const {
  const uint64_t n = part_.group(g).shard_numel;
  kernels::CompactState s{};
  s.w_hi = reinterpret_cast<uint16_t*>(static_cast<char*>(p) + PSliceOffset(g));
  s.w_lo = static_cast<int8_t*>(w);
  s.m_code = static_cast<int8_t*>(m);
  s.m_scale = reinterpret_cast<float*>(static_cast<char*>(m) + n);
  if (v) {
    s.v_code = static_cast<uint8_t*>(v);
    s.v_scale = reinterpret_cast<float*>(static_cast<char*>(v) + n);
  }
  return s;
}

namespace {

// The blocks of a shard's fp32 view: W, M, V, and with compact P.
struct ShardBlocks {
  void* at[kNumStates] = {};
  void* slot = nullptr;
  StagingPool* pool = nullptr;
  ~ShardBlocks() { if (pool) pool->Release(slot); }
};

// Where each block is addressable: in place, or (staged) in one slot,
// loaded first when `load`. A P homed on the host is used in place here.
Status Locate(Engine::Impl& m, int g, bool load, ShardBlocks* sb) {
  GroupState& gs = m.groups_[static_cast<size_t>(g)];
  const bool gpu = m.device_->on_gpu();
  for (int s : {int(StateKind::kP), int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)}) {
    if (s == int(StateKind::kP) && !m.compact_) continue;
    const StateBlock& b = gs.blocks[static_cast<size_t>(s)];
    if (!b.alloc.charged) continue;
    if (m.io_->Direct(b)) { sb->at[s] = m.io_->DirectPtr(b); continue; }
    if (!StagedInSlot(m, s, gpu)) return InternalError("state " + std::string(StateName(StateKind(s))) + " has no slot");
    if (!sb->slot) {
      sb->pool = &m.opt_staging_;
      sb->slot = m.opt_staging_.Acquire();
      if (!sb->slot) return InternalError("no staging slot for a staged block");
    }
    sb->at[s] = static_cast<char*>(sb->slot) + m.opt_slot_offsets_[s];
    // A P that holds the whole group (stages 1-2, several ranks) is loaded
    // whole even to write this rank's slice: the others' stay as they are.
    if (load || (s == int(StateKind::kP) && m.p_gathered_after_step()))
      STRATA_RETURN_IF_ERROR(m.io_->Load(b, sb->at[s]));
  }
  return Status::Ok();
}

}  // namespace

Status Engine::Impl::ReadShardF32(int g, float* w, float* m, float* v) {
  const uint64_t n = part_.group(g).shard_numel;
  ShardBlocks sb;
  STRATA_RETURN_IF_ERROR(Locate(*this, g, true, &sb));
  if (compact_) {
    const kernels::CompactState cs =
        CompactAt(g, sb.at[int(StateKind::kP)], sb.at[int(StateKind::kW)], sb.at[int(StateKind::kM)], v ? sb.at[int(StateKind::kV)] : nullptr);
    return kernels::CompactUnpack(n, cs, w, m, v);
  }
  std::memcpy(w, sb.at[int(StateKind::kW)], n * 4);
  std::memcpy(m, sb.at[int(StateKind::kM)], n * 4);
  if (v) std::memcpy(v, sb.at[int(StateKind::kV)], n * 4);
  return Status::Ok();
}

Status Engine::Impl::WriteShardF32(int g, const float* w, const float* m, const float* v) {
  const uint64_t n = part_.group(g).shard_numel;
  ShardBlocks sb;
  STRATA_RETURN_IF_ERROR(Locate(*this, g, false, &sb));
  if (compact_) {
    const kernels::CompactState cs =
        CompactAt(g, sb.at[int(StateKind::kP)], sb.at[int(StateKind::kW)], sb.at[int(StateKind::kM)], v ? sb.at[int(StateKind::kV)] : nullptr);
    STRATA_RETURN_IF_ERROR(kernels::CompactPack(n, w, m, v, cs));
  } else {
    std::memcpy(sb.at[int(StateKind::kW)], w, n * 4);
    std::memcpy(sb.at[int(StateKind::kM)], m, n * 4);
    if (v) std::memcpy(sb.at[int(StateKind::kV)], v, n * 4);
  }
  GroupState& gs = groups_[static_cast<size_t>(g)];
  for (int s : {int(StateKind::kP), int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)}) {
    const StateBlock& b = gs.blocks[static_cast<size_t>(s)];
    if (!sb.at[s] || io_->Direct(b)) continue;
    STRATA_RETURN_IF_ERROR(io_->Store(b, sb.at[s]));
  }
  return Status::Ok();
}

}  // namespace strata

// ShardStore (shard_store.h), strata.state_format: where the compact arrays of a shard are, and the fp32
// view of a shard's W, M, V in either format for the paths that are not the
// step (build, read_state, write_state, checkpoints).
#include <cstring>
#include <vector>

#include "engine/step/shard_store.h"

#include "engine/format/manifest.h"

namespace strata {

kernels::CompactState ShardStore::CompactAt(int g, void* p, void* w, void* m, void* v) const {
  const uint64_t n = layout_.part.group(g).shard_numel;
  kernels::CompactState s{};
  s.w_hi = reinterpret_cast<uint16_t*>(static_cast<char*>(p) + layout_.PSliceOffset(g));
  s.w_lo = static_cast<int8_t*>(w);
  s.m_code = static_cast<int8_t*>(m);
  s.m_scale = reinterpret_cast<float*>(static_cast<char*>(m) + n);
  if (v) {
    s.v_code = static_cast<uint8_t*>(v);
    s.v_scale = reinterpret_cast<float*>(static_cast<char*>(v) + n);
  }
  return s;
}

ShardBlocks::~ShardBlocks() {
  if (pool) pool->Release(slot);
}

// Where each block is addressable: in place, or (staged) in one slot,
// loaded first when `load`. A P homed on the host is used in place here.
Status ShardStore::LocateShard(int g, bool load, ShardBlocks* sb) {
  if (layout_.frozen(g)) return InternalError("the optimizer state of frozen group " + std::to_string(g) + " (it has none)");
  for (int s : {int(StateKind::kP), int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)}) {
    if (s == int(StateKind::kP) && !layout_.compact) continue;
    const StateBlock& b = blocks_[static_cast<size_t>(g)][static_cast<size_t>(s)];
    if (!b.alloc.charged) continue;
    if (io_.Direct(b)) { sb->at[s] = io_.DirectPtr(b); continue; }
    if (!layout_.StagedInSlot(s)) return InternalError("state " + std::string(StateName(StateKind(s))) + " has no slot");
    if (!sb->slot) {
      sb->pool = &opt_staging_;
      sb->slot = opt_staging_.Acquire();
      if (!sb->slot) return InternalError("no staging slot for a staged block");
    }
    sb->at[s] = static_cast<char*>(sb->slot) + layout_.opt_slot_offsets[s];
    // A P that holds the whole group (stages 1-2, several ranks) is loaded
    // whole even to write this rank's slice: the others' stay as they are.
    if (load || (s == int(StateKind::kP) && layout_.p_gathered_after_step())) STRATA_RETURN_IF_ERROR(io_.Load(b, sb->at[s]));
  }
  // Compact blocks end in zeros (checkpoints save them): a slot holds another block's bytes there.
  if (layout_.compact)
    for (int s : {int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)}) {
      if (!sb->at[s]) continue;
      const uint64_t n = layout_.part.group(g).shard_numel, used = s == int(StateKind::kW) ? n : n + 4 * kernels::CompactScaleCount(n);
      std::memset(static_cast<char*>(sb->at[s]) + used, 0, layout_.StateBytes(s, g) - used);
    }
  return Status::Ok();
}

Status ShardStore::StoreShard(int g, const ShardBlocks& sb) {
  for (int s : {int(StateKind::kP), int(StateKind::kW), int(StateKind::kM), int(StateKind::kV)}) {
    const StateBlock& b = blocks_[static_cast<size_t>(g)][static_cast<size_t>(s)];
    if (!sb.at[s] || io_.Direct(b)) continue;
    STRATA_RETURN_IF_ERROR(io_.Store(b, sb.at[s]));
  }
  return Status::Ok();
}

Status ShardStore::ReadShardF32(int g, float* w, float* m, float* v) {
  const uint64_t n = layout_.part.group(g).shard_numel;
  ShardBlocks sb;
  STRATA_RETURN_IF_ERROR(LocateShard(g, true, &sb));
  const FormatView from = ShardView(g, sb);  // V's arrays are null exactly when v is (no V kept)
  if (layout_.compact) return kernels::CompactUnpack(n, from.cs, w, m, v);
  float* to[3] = {w, m, v};
  for (int s = 0; s < 3; ++s)
    if (to[s]) std::memcpy(to[s], from.f[s], n * 4);
  return Status::Ok();
}

Status ShardStore::WriteShardF32(int g, const float* w, const float* m, const float* v) {
  const uint64_t n = layout_.part.group(g).shard_numel;
  ShardBlocks sb;
  STRATA_RETURN_IF_ERROR(LocateShard(g, false, &sb));
  const FormatView to = ShardView(g, sb);
  if (layout_.compact) {
    STRATA_RETURN_IF_ERROR(kernels::CompactPack(n, w, m, v, to.cs));
  } else {
    const float* from[3] = {w, m, v};
    for (int s = 0; s < 3; ++s)
      if (from[s]) std::memcpy(to.f[s], from[s], n * 4);
  }
  return StoreShard(g, sb);
}

int ShardStore::SavedPieces(int g, int s, void* const at[kNumStates], Piece out[2]) const {
  const uint64_t n = layout_.part.group(g).shard_numel;
  if (layout_.frozen(g)) {  // "P": this rank's slice of P, in the compute dtype
    out[0] = {static_cast<const char*>(at[int(StateKind::kP)]) + layout_.PSliceOffset(g), layout_.FrozenSavedBytes(g)};
    return 1;
  }
  if (layout_.compact && s == int(StateKind::kW)) {
    out[0] = {static_cast<const char*>(at[int(StateKind::kP)]) + layout_.PSliceOffset(g), 2 * n};
    out[1] = {at[s], layout_.StateBytes(s, g)};  // the corrections, then zeros to 4 KiB
    return 2;
  }
  out[0] = {at[s], manifest::SavedBlockBytes(layout_.compact, s - 1, n)};
  return 1;
}

char* FormatView::Array(int s, int k, uint64_t at) const {
  if (!compact) return f[s] ? reinterpret_cast<char*>(f[s] + at) : nullptr;
  const uint64_t b = at / kernels::kCompactBlock;
  switch (s * 2 + k) {
    case 0: return reinterpret_cast<char*>(cs.w_hi + at);
    case 1: return reinterpret_cast<char*>(cs.w_lo + at);
    case 2: return reinterpret_cast<char*>(cs.m_code + at);
    case 3: return reinterpret_cast<char*>(cs.m_scale + b);
    case 4: return cs.v_code ? reinterpret_cast<char*>(cs.v_code + at) : nullptr;
    case 5: return cs.v_scale ? reinterpret_cast<char*>(cs.v_scale + b) : nullptr;
    default: return nullptr;
  }
}

FormatView FormatView::Shift(uint64_t at) const {
  FormatView v = *this;
  if (!compact) {
    for (float*& p : v.f) if (p) p += at;
    return v;
  }
  const uint64_t b = at / kernels::kCompactBlock;
  v.cs.w_hi += at;
  v.cs.w_lo += at;
  v.cs.m_code += at;
  v.cs.m_scale += b;
  if (v.cs.v_code) v.cs.v_code += at;
  if (v.cs.v_scale) v.cs.v_scale += b;
  return v;
}

Status ConvertView(const FormatView& from, const FormatView& to, uint64_t n) {
  if (from.compact == to.compact) return InternalError("a format conversion between equal formats");
  if (from.compact) return kernels::CompactUnpack(n, from.cs, to.f[0], to.f[1], to.f[2]);
  return kernels::CompactPack(n, from.f[0], from.f[1], from.f[2], to.cs);
}

FormatView ShardStore::ShardView(int g, const ShardBlocks& sb) const {
  FormatView v;
  v.compact = layout_.compact;
  if (layout_.compact) {
    v.cs = CompactAt(g, sb.at[int(StateKind::kP)], sb.at[int(StateKind::kW)], sb.at[int(StateKind::kM)],
                     sb.at[int(StateKind::kV)]);
  } else {
    for (int s = 0; s < 3; ++s) v.f[s] = static_cast<float*>(sb.at[s + 1]);
  }
  return v;
}

Status ShardStore::LocateFrozenP(int g, bool load, ShardBlocks* sb) {
  const StateBlock& p = blocks_[static_cast<size_t>(g)][int(StateKind::kP)];
  if (io_.Direct(p)) {
    sb->at[int(StateKind::kP)] = io_.DirectPtr(p);
    return Status::Ok();
  }
  if (frozen_staging_.count() == 0 || frozen_staging_.bytes() < p.bytes)
    return InternalError("frozen group " + std::to_string(g) + ": no staging buffer holds its P");
  sb->pool = &frozen_staging_;
  sb->slot = frozen_staging_.Acquire();
  sb->at[int(StateKind::kP)] = sb->slot;
  if (load) return io_.Load(p, sb->slot);
  return Status::Ok();
}

}  // namespace strata

// The Communicator's public face: argument checks, sequence numbers, the
// error prefix naming the collective, the broken latch; and the factory.
#include "io/net/comm.h"

#include <cstring>
#include <vector>

#include "io/net/comm_backends.h"

namespace strata::net {
namespace {

std::string Count(size_t n, const char* unit, const char* tail = "") {
  return std::to_string(n) + " " + unit + tail;
}

// What one rank says its collective is: fixed size, so that ranks whose
// collectives differ still exchange descriptors of equal length.
struct Descriptor {
  char op[16];
  uint64_t bytes;
  int32_t root;
  uint32_t refused;  // 1 + the code of this rank's refusal (its arguments, or its part it could not make); 0: none
  char label[32];
};
static_assert(sizeof(Descriptor) == 64);

Descriptor Describe(const char* op, uint64_t bytes, int root, const std::string& label) {
  Descriptor d{};
  std::strncpy(d.op, op, sizeof d.op - 1);
  d.bytes = bytes;
  d.root = root;
  std::strncpy(d.label, label.c_str(), sizeof d.label - 1);
  return d;
}

std::string Text(const Descriptor& d) {
  std::string s = std::string(d.op, strnlen(d.op, sizeof d.op)) + " of " + std::to_string(d.bytes) + " bytes";
  if (d.root >= 0) s += " from rank " + std::to_string(d.root);
  const std::string label(d.label, strnlen(d.label, sizeof d.label));
  return s + " for '" + (label.empty() ? "(no label)" : label) + "'";
}

bool Same(const Descriptor& a, const Descriptor& b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

// `local`: this rank's check of its own arguments. A rank that refused them
// still exchanges its descriptor, so that every rank fails (INVALID) before
// any data moves, never one rank's next call meeting its peers' data phase.
Status Communicator::AgreeOn(const char* op, uint64_t bytes, int root, const Status& local, bool* refused) {
  const int w = world_size(), r = rank();
  *refused = !local.ok();
  if (w == 1) return local;
  std::vector<Descriptor> all(static_cast<size_t>(w));
  Descriptor mine = Describe(op, bytes, root, label_);
  mine.refused = local.ok() ? 0 : 1 + static_cast<uint32_t>(local.code());
  all[static_cast<size_t>(r)] = mine;
  Status exchanged = DoExchangeDescriptors(&all[static_cast<size_t>(r)], all.data(), sizeof mine)
                         .WithContext("exchanging what the collective is");
  if (!exchanged.ok()) {
    *refused = false;
    return exchanged;
  }
  if (!local.ok()) return local;
  // Another rank's refusal, with its code (a trainer treats every rank's
  // failure alike: NOMEM on one rank is NOMEM on all).
  for (int k = 0; k < w; ++k)
    if (const uint32_t code = all[static_cast<size_t>(k)].refused) {
      Descriptor d = all[static_cast<size_t>(k)];
      d.refused = 0;
      *refused = true;
      return Status(static_cast<Code>(code - 1), "rank " + std::to_string(k) + " refused " + Text(d) +
                                                     " (its error says why); no rank ran it");
    }
  // Ranks at different collectives: every rank fails here, before any data
  // moves. The communicator is then failed on every rank (Run): the ranks'
  // engines may no longer be alike (a background reduction that met the
  // disagreement broke one rank's engine, which its peers cannot know), so
  // none goes on as if nothing happened; their errors say to restart.
  for (int k = 0; k < w; ++k)
    if (!Same(all[static_cast<size_t>(k)], mine)) {
      return CommError("ranks disagree on this collective: rank " + std::to_string(r) + " is at " + Text(mine) +
                       ", rank " + std::to_string(k) + " at " + Text(all[static_cast<size_t>(k)]) +
                       "; every rank must make the same calls in the same order (nothing moved)");
    }
  return Status::Ok();
}

template <typename Check, typename Fn>
Status Communicator::Run(const char* op, const std::string& size, uint64_t bytes, int root, Check&& check,
                         Fn&& fn) {
  ++seq_;
  std::string ctx = std::string(backend()) + " " + op + " #" + std::to_string(seq_) + " (" + size +
                    ") on rank " + std::to_string(rank()) + " of " + std::to_string(world_size());
  if (broken_) return CommError(ctx + ": not run, the communicator failed earlier: " + broken_->message());
  bool refused = false;
  Status s = AgreeOn(op, bytes, root, check(), &refused);
  const bool agreed = s.ok();
  if (agreed) s = fn();
  if (s.ok()) return s;
  Status e = s.WithContext(ctx);
  // A collective refused (by any rank) before any data moved leaves the
  // communicator usable on every rank; anything else, and any failure once
  // the ranks agreed (a backend's own refusal included), may have left
  // peers mid-protocol.
  if (!refused) broken_ = std::make_unique<Status>(e);
  return e;
}

Status Communicator::AllReduce(float* buf, size_t n) {
  return Run(
      "all_reduce", Count(n, "floats"), n * sizeof(float), -1,
      [&] { return !buf && n ? InvalidError("null buffer") : Status::Ok(); },
      [&] { return n ? DoAllReduce(buf, n) : Status::Ok(); });
}

Status Communicator::ReduceScatter(const float* in, float* out, size_t n_per_rank) {
  return Run(
      "reduce_scatter", Count(n_per_rank, "floats", " per rank"), n_per_rank * sizeof(float), -1,
      [&] { return (!in || !out) && n_per_rank ? InvalidError("null buffer") : Status::Ok(); },
      [&] { return n_per_rank ? DoReduceScatter(in, out, n_per_rank) : Status::Ok(); });
}

Status Communicator::ReduceScatterPieces(const FloatPieces& in, uint64_t stride, uint64_t first, float* out,
                                         size_t n_per_rank) {
  return Run(
      "reduce_scatter", Count(n_per_rank, "floats", " per rank"), n_per_rank * sizeof(float), -1,
      [&] {
        if (!out && n_per_rank) return InvalidError("null buffer");
        if (stride < n_per_rank)
          return InvalidError("the ranks' parts overlap (" + std::to_string(stride) + " elements apart, " +
                              std::to_string(n_per_rank) + " each)");
        return Status::Ok();
      },
      [&] { return n_per_rank ? DoReduceScatterPieces(in, stride, first, out, n_per_rank) : Status::Ok(); });
}

Status Communicator::DoReduceScatterPieces(const FloatPieces& in, uint64_t stride, uint64_t first, float* out,
                                           size_t n) {
  const size_t w = static_cast<size_t>(world_size());
  std::vector<float> packed(w * n);
  for (size_t r = 0; r < w; ++r) in.Read(r * stride + first, n, packed.data() + r * n);
  return DoReduceScatter(packed.data(), out, n);
}

Status Communicator::AllGather(const void* in, void* out, size_t bytes_per_rank) {
  return Run(
      "all_gather", Count(bytes_per_rank, "bytes", " per rank"), bytes_per_rank, -1,
      [&] { return (!in || !out) && bytes_per_rank ? InvalidError("null buffer") : Status::Ok(); },
      [&] { return bytes_per_rank ? DoAllGather(in, out, bytes_per_rank) : Status::Ok(); });
}

Status Communicator::AllGatherRefused(size_t bytes_per_rank, const Status& why) {
  if (why.ok()) return InternalError("all_gather refused without a reason");
  // Refused before any data moves: the communicator stays usable on every
  // rank, and the peers fail with why's code.
  Status s = Run(
      "all_gather", Count(bytes_per_rank, "bytes", " per rank"), bytes_per_rank, -1, [&] { return why; },
      [&] { return InternalError("a refused all_gather ran"); });
  if (s.code() == why.code() && s.message().find(why.message()) != std::string::npos) return why;
  return Status(why.code(), why.message() + " (and the all_gather it refused failed: " + s.message() + ")");
}

Status Communicator::Broadcast(void* buf, size_t bytes, int root) {
  return Run(
      "broadcast", Count(bytes, "bytes from rank ") + std::to_string(root), bytes, root,
      [&] {
        if (root < 0 || root >= world_size()) return InvalidError("root " + std::to_string(root) + " out of range");
        return !buf && bytes ? InvalidError("null buffer") : Status::Ok();
      },
      [&] { return bytes ? DoBroadcast(buf, bytes, root) : Status::Ok(); });
}

Status Communicator::Barrier() {
  return Run("barrier", "no data", 0, -1, [] { return Status::Ok(); }, [&] { return DoBarrier(); });
}

bool NcclAvailable() {
#if STRATA_HAVE_NCCL
  return NcclGpuPresent();
#else
  return false;
#endif
}

Result<std::unique_ptr<Communicator>> MakeCommunicator(const CommOptions& o) {
  const RankInfo& r = o.rank;
  std::string b = o.backend.empty() ? "auto" : o.backend;
  if (b != "auto" && b != "self" && b != "gloo" && b != "nccl")
    return InvalidError("communicator backend '" + b + "' is not one of auto, self, gloo, nccl");
  if (o.timeout_s <= 0) return InvalidError("communicator timeout must be > 0 s");
  if (b == "auto") b = NcclAvailable() ? "nccl" : r.world_size == 1 ? "self" : "gloo";
  if (b == "self") {
    if (r.world_size != 1)
      return InvalidError("communicator backend 'self' needs one rank, not " + std::to_string(r.world_size));
    return MakeSelfComm();
  }
  if (r.world_size > 1 && o.store == nullptr)
    return InvalidError("communicator backend '" + b + "' with " + std::to_string(r.world_size) +
                        " ranks needs a rendezvous store");
  if (b == "gloo") {
#if STRATA_HAVE_GLOO
    return MakeGlooComm(o);
#else
    return UnsupportedError("communicator backend 'gloo': this build has no Gloo (libgloo-dev)");
#endif
  }
#if STRATA_HAVE_NCCL
  if (!NcclGpuPresent()) return UnsupportedError("communicator backend 'nccl': no GPU");
  return MakeNcclComm(o);
#else
  return UnsupportedError("communicator backend 'nccl': this build has no NCCL");
#endif
}

}  // namespace strata::net

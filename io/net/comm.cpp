// The Communicator's public face: argument checks, sequence numbers, the
// error prefix naming the collective, the broken latch; and the factory.
#include "io/net/comm.h"

#include "io/net/comm_backends.h"

namespace strata::net {
namespace {

std::string Count(size_t n, const char* unit, const char* tail = "") {
  return std::to_string(n) + " " + unit + tail;
}

}  // namespace

template <typename Fn>
Status Communicator::Run(const char* op, const std::string& size, Fn&& fn) {
  ++seq_;
  std::string ctx = std::string(backend()) + " " + op + " #" + std::to_string(seq_) + " (" + size +
                    ") on rank " + std::to_string(rank()) + " of " + std::to_string(world_size());
  if (broken_) return CommError(ctx + ": not run, the communicator failed earlier: " + broken_->message());
  Status s = fn();
  if (s.ok()) return s;
  Status e = s.WithContext(ctx);
  // Bad arguments are local and leave the communicator usable; anything else
  // may have left peers mid-protocol.
  if (s.code() != Code::kInvalid) broken_ = std::make_unique<Status>(e);
  return e;
}

Status Communicator::AllReduce(float* buf, size_t n) {
  return Run("all_reduce", Count(n, "floats"), [&] {
    if (!buf && n) return InvalidError("null buffer");
    return n ? DoAllReduce(buf, n) : Status::Ok();
  });
}

Status Communicator::ReduceScatter(const float* in, float* out, size_t n_per_rank) {
  return Run("reduce_scatter", Count(n_per_rank, "floats", " per rank"), [&] {
    if ((!in || !out) && n_per_rank) return InvalidError("null buffer");
    return n_per_rank ? DoReduceScatter(in, out, n_per_rank) : Status::Ok();
  });
}

Status Communicator::AllGather(const void* in, void* out, size_t bytes_per_rank) {
  return Run("all_gather", Count(bytes_per_rank, "bytes", " per rank"), [&] {
    if ((!in || !out) && bytes_per_rank) return InvalidError("null buffer");
    return bytes_per_rank ? DoAllGather(in, out, bytes_per_rank) : Status::Ok();
  });
}

Status Communicator::Broadcast(void* buf, size_t bytes, int root) {
  return Run("broadcast", Count(bytes, "bytes from rank ") + std::to_string(root), [&] {
    if (root < 0 || root >= world_size())
      return InvalidError("root " + std::to_string(root) + " out of range");
    if (!buf && bytes) return InvalidError("null buffer");
    return bytes ? DoBroadcast(buf, bytes, root) : Status::Ok();
  });
}

Status Communicator::Barrier() {
  return Run("barrier", "no data", [&] { return DoBarrier(); });
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

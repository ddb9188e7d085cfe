// Communicators: one interface for the collectives ZeRO needs, with three
// backends — NCCL (CUDA device buffers), Gloo (host buffers, the CPU path) and
// self (one rank). Every collective has a sequence number and a timeout; a
// failure names the backend, the collective, its number and the rank:
//   "gloo all_reduce #17 (4096 floats) on rank 1 of 4: timed out after 5 s"
//
//   auto info = RankInfoFromEnv().value();
//   auto store = RendezvousStore::Open(info, std::chrono::seconds(30)).value();
//   CommOptions o; o.rank = info; o.timeout_s = 30; o.store = &store->client();
//   auto comm = MakeCommunicator(o).value();
//   STRATA_RETURN_IF_ERROR(comm->AllReduce(grads, n));
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"
#include "io/net/float_pieces.h"
#include "io/net/launch_env.h"
#include "io/net/store.h"

namespace strata::net {

struct CommOptions {
  RankInfo rank;
  // "auto": NCCL when a GPU is present and NCCL was built, else self for one
  // rank, else Gloo. "self" needs world_size 1.
  std::string backend = "auto";
  double timeout_s = 300;  // strata.timeout: bound on every collective and store wait
  // Required when world_size > 1; must outlive MakeCommunicator (not the
  // communicator: creation ends with a barrier, after which the store is unused).
  StoreClient* store = nullptr;
  // Key namespace in the store; give each communicator of a job its own.
  std::string prefix = "strata";
  // Gloo: the local address to listen on; empty = the address this host uses
  // to reach rank.master_addr (127.0.0.1 for a loopback master).
  std::string local_addr;
  // Gloo: when every rank is on this host (they all open one segment in
  // /dev/shm), all-gathers, reduce-scatters and the descriptors of every
  // collective move through shared memory
  // (shm_channel.h: world * 2 slots of shm_slot_bytes) instead of TCP over
  // loopback: the same bits, a fraction of the CPU. Where any rank cannot
  // open the segment, every rank keeps TCP (said in an info line).
  bool shared_memory = true;
  // NCCL: the GPU its communicator and stream use (the engine's device,
  // EngineOptions::device); -1: the local rank's (DeviceForLocalRank).
  int device = -1;
  uint64_t shm_slot_bytes = uint64_t{2} << 20;
};

// Collectives must be called in the same order with the same sizes on every
// rank. Not thread-safe: one caller at a time. Buffers live in the backend's
// memory (device_buffers()); NCCL also takes host buffers, staged through a
// 16 MiB device buffer of its own in pieces (the engine's small exchanges:
// norms, agreements, checkpoints). Every call is synchronous: it returns when the
// result is in place. NCCL runs on a stream of its own that waits for the
// legacy default stream; work on other streams must be synchronized first. After any failure the communicator
// is broken: every later call returns the first error (kComm) without communicating. Errors: kTimeout when a
// peer did not answer within timeout_s, kComm when a peer closed its connection or the backend failed,
// kInvalid for bad arguments.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual const char* backend() const = 0;  // "self", "gloo", "nccl"
  // true: buffers are CUDA device pointers (NCCL; host ones are staged);
  // false: host memory.
  virtual bool device_buffers() const = 0;
  // true: all-gathers and reduce-scatters go through shared memory (Gloo,
  // every rank on this host; CommOptions::shared_memory).
  virtual bool shared_memory() const { return false; }
  // Whether a failure left this communicator unusable (a lost peer, a
  // timeout, a failure once data moved): every later collective fails.
  bool broken() const { return broken_ != nullptr; }
  // true: ReduceScatterPieces reads the pieces where they lie (Gloo through
  // shared memory); false: it gathers them into a buffer of its own first.
  virtual bool reads_pieces() const { return false; }

  // buf[n] := sum over ranks of buf[n], in place. fp32 sums are bitwise equal
  // on every rank; the summation order depends on the world size.
  Status AllReduce(float* buf, size_t n);
  // out[n] := sum over ranks of in[rank*n .. rank*n+n); `in` holds
  // n*world_size floats. In place when out == in + rank*n. Sizes not divisible
  // by the world size are the caller's to pad.
  Status ReduceScatter(const float* in, float* out, size_t n_per_rank);
  // The same collective (the same descriptor, the same bits) with an input
  // in pieces: rank r's part is elements [r*stride + first, r*stride + first
  // + n) of `in` (zeros where no piece holds them); stride >= n. `out` lies
  // outside the pieces.
  Status ReduceScatterPieces(const FloatPieces& in, uint64_t stride, uint64_t first, float* out,
                             size_t n_per_rank);
  // out[r*bytes .. (r+1)*bytes) := rank r's in[bytes]; `out` holds
  // bytes*world_size. In place when in == out + rank*bytes.
  Status AllGather(const void* in, void* out, size_t bytes_per_rank);
  // Enters the all-gather the other ranks are in (the same bytes) refusing
  // it for `why` (a failure of this rank's own, non-OK): no data moves, every
  // rank fails INVALID naming this one, and the communicator stays usable.
  // Returns `why`. Where a rank's part could not be made, its peers fail at
  // once instead of waiting for it until the timeout.
  Status AllGatherRefused(size_t bytes_per_rank, const Status& why);
  // buf[bytes] := root's buf[bytes].
  Status Broadcast(void* buf, size_t bytes, int root);
  Status Barrier();

  uint64_t collectives_issued() const { return seq_; }

  // Ranks agree on what they do: before any data moves, every collective
  // exchanges a fixed-size descriptor (its kind, bytes per rank, root and
  // this label) on a channel of its own. When the ranks' k-th collectives
  // differ, every rank fails with kComm naming its own side and the first
  // rank that differs — never a size mismatch inside the backend. The label
  // says what the caller is doing ("grads g3 s12"); it holds for the
  // following collectives until changed; at most 31 characters are carried.
  void SetLabel(const std::string& label) { label_ = label.substr(0, 31); }
  const std::string& label() const { return label_; }

 protected:
  // Backends implement these; they return errors without the collective's
  // name (the wrappers add "backend op #seq (size) on rank r of w: ").
  virtual Status DoAllReduce(float* buf, size_t n) = 0;
  virtual Status DoReduceScatter(const float* in, float* out, size_t n_per_rank) = 0;
  // Backends that read pieces in place (reads_pieces) override this one; by
  // default the parts are gathered into one buffer for DoReduceScatter.
  virtual Status DoReduceScatterPieces(const FloatPieces& in, uint64_t stride, uint64_t first, float* out,
                                       size_t n_per_rank);
  virtual Status DoAllGather(const void* in, void* out, size_t bytes_per_rank) = 0;
  virtual Status DoBroadcast(void* buf, size_t bytes, int root) = 0;
  virtual Status DoBarrier() = 0;
  // An all-gather of `bytes` per rank on the descriptor channel (never
  // matched with a collective's data). Backends without peers return Ok.
  virtual Status DoExchangeDescriptors(const void* mine, void* all, size_t bytes) = 0;
  uint64_t current_seq() const { return seq_; }  // number of the collective in progress

 private:
  template <typename Check, typename Fn>
  Status Run(const char* op, const std::string& size, uint64_t bytes, int root, Check&& check, Fn&& fn);
  // `*refused`: the collective was refused (by this rank or another) before
  // any data moved: the communicator stays usable.
  Status AgreeOn(const char* op, uint64_t bytes, int root, const Status& local, bool* refused);

  uint64_t seq_ = 0;
  std::string label_;
  std::unique_ptr<Status> broken_;  // the first failure, once there is one
};

// Creates the communicator and rendezvouses with the other ranks (bounded by
// timeout_s). kUnsupported for "nccl" without a GPU or without NCCL in this
// build; kInvalid for an unknown backend, "self" with world_size > 1, or no
// store with world_size > 1.
Result<std::unique_ptr<Communicator>> MakeCommunicator(const CommOptions& options);

// True when this build has NCCL and a GPU is usable at run time.
bool NcclAvailable();

}  // namespace strata::net

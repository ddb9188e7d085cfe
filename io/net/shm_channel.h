// ShmChannel: the bulk collectives (all-gather, reduce-scatter) of ranks
// that share one host, through one shared-memory segment instead of TCP
// over loopback. Each rank owns two slots of the segment (a round's data,
// alternating) and two counters: the round it has written (`arrived`) and
// the round it has finished reading (`consumed`). A collective is cut into
// rounds of at most one slot; in round k a rank waits until every peer has
// consumed round k-2 (the last one to use this slot), writes its slot,
// publishes k, waits for every peer's k, reads theirs and publishes that
// it consumed k. Waits spin briefly, then sleep on a futex (the counters
// are 32-bit words of the shared mapping).
//
// Rendezvous is the caller's (comm_gloo.cpp: through the store): rank 0
// Creates the segment under a fresh name, the others Open that name, and
// rank 0 Unlinks it once every rank has opened it (nothing is left in
// /dev/shm after a crash past that point). Rounds are numbered alike on
// every rank only when every rank calls the same collectives with the same
// sizes: the caller checks that first (the communicator's descriptors,
// exchanged through this channel too: one all-gather of a fixed size per
// collective, whatever the collective, keeps the rounds in step).
//
// Failure: a wait is bounded by the collective's deadline (kTimeout, naming
// the rank waited for). A rank holds a lock on one byte of the segment's
// file for its life (an open-file-description lock, released by the kernel
// when the process dies): a waiter that finds a peer's lock gone fails at
// once (kComm, naming the rank) rather than at the deadline.
//
// Thread-safety: one caller at a time (the communicator's rule).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "io/net/float_pieces.h"

namespace strata::net {

class ShmChannel {
 public:
  using Deadline = std::chrono::steady_clock::time_point;
  // The segment of `world` ranks with slots of `slot_bytes` (a multiple of
  // 64, at least 4096): made by rank 0 under a fresh name (returned in
  // *name), its memory reserved (posix_fallocate: a /dev/shm too small is
  // refused here, never a SIGBUS later).
  // Before it, names of this scheme whose creator is gone (RemoveStaleSegments).
  static Result<std::unique_ptr<ShmChannel>> Create(int world, uint64_t slot_bytes, std::string* name);
  // A creator killed between Create and the unlink that follows every rank's
  // open (a launcher stopping the job then) leaves its name in /dev/shm, and
  // the memory behind it: names of this scheme ("/strata-PID-..."), owned by
  // this user, whose PID is gone (kill: ESRCH) are removed. A live
  // creator's (another job's) are left; one whose PID was reused is left
  // too, until that process is gone. Returns how many were removed.
  static int RemoveStaleSegments();
  // Rank `rank` (1..world-1) opens rank 0's segment; refused when its
  // header does not say `world` and `slot_bytes` (another job's segment).
  static Result<std::unique_ptr<ShmChannel>> Open(const std::string& name, int rank, int world, uint64_t slot_bytes);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // Removes the segment's name (rank 0, once every rank has opened it).
  void Unlink();
  int rank() const { return rank_; }
  int world() const { return world_; }
  uint64_t segment_bytes() const { return size_; }

  // out[q*bytes .. (q+1)*bytes) := rank q's in[bytes]; in place when
  // in == out + rank*bytes.
  Status AllGather(const void* in, void* out, size_t bytes, Deadline deadline);
  // out[n] := the sum over ranks of in[rank*n .. rank*n+n), added in the
  // order rank+1, rank+2, ..., rank (Gloo's ring order: the same bits as
  // the ring's reduce-scatter, at any world size); in place when
  // out == in + rank*n.
  Status ReduceScatter(const float* in, float* out, size_t n, Deadline deadline);
  // The same with an input in pieces, read where they lie
  // (Communicator::ReduceScatterPieces): rank r's part is elements
  // [r*stride + first, r*stride + first + n).
  Status ReduceScatter(const FloatPieces& in, uint64_t stride, uint64_t first, float* out, size_t n,
                       Deadline deadline);

 private:
  ShmChannel(int fd, void* base, uint64_t size, int rank, int world, uint64_t slot_bytes, std::string name);
  struct Control;
  Control& ctl(int q) const;
  char* slot(int q, uint32_t round) const;
  // Waits until rank q's counter (arrived or consumed) reaches `target`.
  Status WaitFor(int q, bool arrived, uint32_t target, Deadline deadline, const char* what) const;
  void Publish(bool arrived, uint32_t round);
  bool Alive(int q) const;  // its lock is still held
  // Begins round ++round_: waits until every peer consumed round_-2 (this
  // slot's last use); returns the slot to write.
  Result<char*> BeginRound(Deadline deadline);

  const int fd_;
  void* const base_;
  const uint64_t size_;
  const int rank_, world_;
  const uint64_t slot_bytes_;
  std::string name_;  // until Unlink
  uint32_t round_ = 0;
  // A reduce-scatter's own part: in place at 3+ ranks, or across pieces.
  std::vector<float> scratch_;
};

}  // namespace strata::net

// Several ranks: how a group's gradients are summed over the ranks, in
// buckets (zero_optimization.reduce_bucket_size elements a collective). The
// same code drives host buffers (Gloo) and device buffers (NCCL): only the
// memory operations differ (ReduceMemory).
//
// Reduce-scatter (stages 2-3): the group's gradient is world pieces of n
// elements, piece r owned by rank r. Bucket b takes the same `columns` of
// every piece, from column `first` on, and is packed contiguously at
// world*first (rank r's columns at world*first + r*columns), so one
// reduce-scatter sums it. An element is summed in the order of its owner's
// ring whatever the bucket, so the bits never depend on reduce_bucket_size.
// All-reduce (stages 0-1): buckets are plain ranges of the buffer, in place;
// the backend's sum order may follow the bucket bounds.
//
//   auto buckets = PlanReduceBuckets(n, world, bucket, /*scatter=*/true);
//   PackGradients(mem, grads, dtype, numel, n, world, buckets, true, packed);
//   ReduceBuckets(comm, mem, buckets, true, n, rank, packed, out);  // out: rank's n sums
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "io/net/comm.h"

namespace strata {

struct ReduceBucket {
  uint64_t first = 0;    // reduce-scatter: first column; all-reduce: first element
  uint64_t columns = 0;  // columns of every piece; all-reduce: elements
};

// Buckets over n columns (reduce-scatter: world*columns <= bucket_elems, at
// least one column) or n elements (all-reduce: at most bucket_elems each).
std::vector<ReduceBucket> PlanReduceBuckets(uint64_t n, int world, uint64_t bucket_elems, bool scatter);

// The packed buffer's memory: the host's, or a GPU's.
class ReduceMemory {
 public:
  virtual ~ReduceMemory() = default;
  virtual bool on_device() const = 0;
  // dst[0..n) := src[0..n) (`dtype`, the caller's gradients) as fp32.
  virtual Status Cast(DType dtype, const void* src, float* dst, uint64_t n) = 0;
  virtual Status Zero(float* dst, uint64_t n) = 0;
  // Waits for the work Cast and Zero queued, before a collective reads it.
  virtual Status Sync() = 0;
  // host_dst[0..n) := src[0..n); the ranges may overlap (host memory).
  virtual Status ToHost(float* host_dst, const float* src, uint64_t n) = 0;
};

// Host memory: kernels::Cast, memset, memmove.
std::unique_ptr<ReduceMemory> MakeHostReduceMemory();
// A GPU's memory (CUDA builds; null elsewhere): casts on the device, copies
// back through `stream` (a gpu::Stream).
std::unique_ptr<ReduceMemory> MakeDeviceReduceMemory(void* stream);

// Packs `numel` elements of `dtype` at `src` — the group's gradient; the
// rest of its world*n (reduce-scatter) or n (all-reduce) elements are zero
// padding — into `packed` in the buckets' layout.
Status PackGradients(ReduceMemory& mem, const void* src, DType dtype, uint64_t numel, uint64_t n, int world,
                     const std::vector<ReduceBucket>& buckets, bool scatter, float* packed);

// A grads call in parts (host memory only): PackPart writes elements
// [first, first + count) of the group's gradient (`dtype` at `src`) where
// PackGradients would put them; `add`: adds them to what is there instead,
// the sum rounded to `dtype` (the element a caller that summed the two in
// `dtype` first would hand). PackGaps zeroes every element of the packed
// buffer that no part gave (`given`: first -> count, disjoint), the padding
// included. After both, `packed` holds PackGradients' bits of the gradient
// the parts make.
Status PackPart(const void* src, DType dtype, uint64_t first, uint64_t count, uint64_t n, int world,
                const std::vector<ReduceBucket>& buckets, bool scatter, float* packed, bool add);
Status PackGaps(const std::map<uint64_t, uint64_t>& given, uint64_t n, int world,
                const std::vector<ReduceBucket>& buckets, bool scatter, float* packed);

// Runs the buckets' collectives on `packed`, then leaves in `out` (host
// memory; `packed` itself is allowed with host memory) the `n` sums of
// piece `piece`: reduce-scatter, this rank's (piece = rank); all-reduce,
// elements [piece*n, piece*n + n) of the buffer. A reduce-scatter of host
// memory into an `out` apart from `packed` writes each bucket's sums there
// directly (no copy after it); `packed` is then left as the backend leaves
// it.
Status ReduceBuckets(net::Communicator& comm, ReduceMemory& mem, const std::vector<ReduceBucket>& buckets,
                     bool scatter, uint64_t n, int piece, float* packed, float* out);

}  // namespace strata

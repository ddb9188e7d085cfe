// Bucketed gradient reduction over the ranks (grad_reduce.h).
#include "engine/reduce/grad_reduce.h"

#include <algorithm>
#include <cstring>

#include "base/sizes.h"
#include "kernels/cpu/cast.h"

namespace strata {

std::vector<ReduceBucket> PlanReduceBuckets(uint64_t n, int world, uint64_t bucket_elems, bool scatter) {
  const uint64_t w = scatter ? static_cast<uint64_t>(std::max(world, 1)) : 1;
  const uint64_t step = std::max<uint64_t>(bucket_elems / w, 1);
  std::vector<ReduceBucket> out;
  for (uint64_t at = 0; at < n; at += step) out.push_back({at, std::min(step, n - at)});
  return out;
}

namespace {

class HostReduceMemory final : public ReduceMemory {
 public:
  bool on_device() const override { return false; }
  Status Cast(DType dtype, const void* src, float* dst, uint64_t n) override {
    if (dtype == DType::kF32) {
      std::memcpy(dst, src, n * 4);
      return Status::Ok();
    }
    return kernels::Cast(dtype, src, DType::kF32, dst, n);
  }
  Status Zero(float* dst, uint64_t n) override {
    std::memset(dst, 0, n * 4);
    return Status::Ok();
  }
  Status Sync() override { return Status::Ok(); }
  Status ToHost(float* host_dst, const float* src, uint64_t n) override {
    if (host_dst != src) std::memmove(host_dst, src, n * 4);
    return Status::Ok();
  }
};

}  // namespace

std::unique_ptr<ReduceMemory> MakeHostReduceMemory() { return std::make_unique<HostReduceMemory>(); }

Status PackGradients(ReduceMemory& mem, const void* src, DType dtype, uint64_t numel, uint64_t n, int world,
                     const std::vector<ReduceBucket>& buckets, bool scatter, float* packed) {
  const uint64_t esize = DTypeSize(dtype);
  const auto* s = static_cast<const char*>(src);
  // dst[0..count) := the gradient's elements [from, from+count), zeros past numel.
  auto piece = [&](uint64_t from, uint64_t count, float* dst) -> Status {
    const uint64_t real = from >= numel ? 0 : std::min(count, numel - from);
    if (real) STRATA_RETURN_IF_ERROR(mem.Cast(dtype, s + from * esize, dst, real));
    if (real < count) STRATA_RETURN_IF_ERROR(mem.Zero(dst + real, count - real));
    return Status::Ok();
  };
  if (!scatter) {
    STRATA_RETURN_IF_ERROR(piece(0, n, packed));
  } else {
    const uint64_t w = static_cast<uint64_t>(world);
    for (const ReduceBucket& b : buckets)
      for (uint64_t r = 0; r < w; ++r)
        STRATA_RETURN_IF_ERROR(piece(r * n + b.first, b.columns, packed + w * b.first + r * b.columns));
  }
  return mem.Sync();
}

Status ReduceBuckets(net::Communicator& comm, ReduceMemory& mem, const std::vector<ReduceBucket>& buckets,
                     bool scatter, uint64_t n, int piece, float* packed, float* out) {
  const uint64_t w = static_cast<uint64_t>(comm.world_size());
  for (const ReduceBucket& b : buckets) {
    if (scatter) {
      float* in = packed + w * b.first;
      float* mine = in + static_cast<uint64_t>(comm.rank()) * b.columns;
      STRATA_RETURN_IF_ERROR(comm.ReduceScatter(in, mine, b.columns));
      // Host memory: moves left, onto columns whose buckets are done.
      STRATA_RETURN_IF_ERROR(mem.ToHost(out + b.first, mine, b.columns));
    } else {
      STRATA_RETURN_IF_ERROR(comm.AllReduce(packed + b.first, b.columns));
    }
  }
  if (!scatter) STRATA_RETURN_IF_ERROR(mem.ToHost(out, packed + static_cast<uint64_t>(piece) * n, n));
  return Status::Ok();
}

#if !STRATA_HAVE_CUDA
std::unique_ptr<ReduceMemory> MakeDeviceReduceMemory(void*) { return nullptr; }
#endif

}  // namespace strata

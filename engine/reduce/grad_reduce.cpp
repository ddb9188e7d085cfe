// Bucketed gradient reduction over the ranks (grad_reduce.h).
#include "engine/reduce/grad_reduce.h"

#include <algorithm>
#include <cstring>
#include <iterator>

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

namespace {

// Element e of the gradient (e < end) in PackGradients' layout: where it
// lies in `packed`, and how many elements from e on lie there in a row
// (up to `end`, and the end of e's bucket).
struct Run {
  uint64_t at, len;
};
Run Locate(uint64_t e, uint64_t end, uint64_t n, uint64_t w, const std::vector<ReduceBucket>& buckets, bool scatter) {
  if (!scatter) return {e, end - e};
  const uint64_t piece = e / n, col = e % n;
  auto b = std::upper_bound(buckets.begin(), buckets.end(), col,
                            [](uint64_t c, const ReduceBucket& k) { return c < k.first; });
  const ReduceBucket& k = *std::prev(b);  // buckets cover [0, n) in order, the first at column 0
  return {w * k.first + piece * k.columns + (col - k.first), std::min(end - e, k.first + k.columns - col)};
}

// dst[0, count) := round_dtype(dst + src) (src: `dtype`), in fp32 tiles.
Status AddRounded(float* dst, const void* src, DType dtype, uint64_t count) {
  constexpr uint64_t kTile = 4096;
  float wide[kTile];
  alignas(64) char narrow[kTile * 4];
  const uint64_t esize = DTypeSize(dtype);
  for (uint64_t at = 0; at < count; at += kTile) {
    const uint64_t k = std::min(kTile, count - at);
    float* d = dst + at;
    if (dtype == DType::kF32) {
      const float* x = static_cast<const float*>(src) + at;
      for (uint64_t i = 0; i < k; ++i) d[i] += x[i];
      continue;
    }
    STRATA_RETURN_IF_ERROR(kernels::Cast(dtype, static_cast<const char*>(src) + at * esize, DType::kF32, wide, k));
    for (uint64_t i = 0; i < k; ++i) wide[i] += d[i];
    // Rounded to the parts' dtype, widened again.
    STRATA_RETURN_IF_ERROR(kernels::Cast(DType::kF32, wide, dtype, narrow, k));
    STRATA_RETURN_IF_ERROR(kernels::Cast(dtype, narrow, DType::kF32, d, k));
  }
  return Status::Ok();
}

}  // namespace

Status PackPart(const void* src, DType dtype, uint64_t first, uint64_t count, uint64_t n, int world,
                const std::vector<ReduceBucket>& buckets, bool scatter, float* packed, bool add) {
  const uint64_t esize = DTypeSize(dtype), w = static_cast<uint64_t>(world), end = first + count;
  const auto* s = static_cast<const char*>(src);
  for (uint64_t e = first; e < end;) {
    const Run r = Locate(e, end, n, w, buckets, scatter);
    const char* from = s + (e - first) * esize;
    float* to = packed + r.at;
    if (add) STRATA_RETURN_IF_ERROR(AddRounded(to, from, dtype, r.len));
    else if (dtype == DType::kF32) std::memcpy(to, from, r.len * 4);
    else STRATA_RETURN_IF_ERROR(kernels::Cast(dtype, from, DType::kF32, to, r.len));
    e += r.len;
  }
  return Status::Ok();
}

Status PackGaps(const std::map<uint64_t, uint64_t>& given, uint64_t n, int world,
                const std::vector<ReduceBucket>& buckets, bool scatter, float* packed) {
  const uint64_t w = static_cast<uint64_t>(world), total = scatter ? w * n : n;
  auto zero = [&](uint64_t from, uint64_t to) {
    for (uint64_t e = from; e < to;) {
      const Run r = Locate(e, to, n, w, buckets, scatter);
      std::memset(packed + r.at, 0, r.len * 4);
      e += r.len;
    }
  };
  uint64_t at = 0;
  for (const auto& [first, count] : given) {
    if (first > at) zero(at, std::min(first, total));
    at = std::max(at, first + count);
  }
  if (at < total) zero(at, total);
  return Status::Ok();
}

Status ReduceBuckets(net::Communicator& comm, ReduceMemory& mem, const std::vector<ReduceBucket>& buckets,
                     bool scatter, uint64_t n, int piece, float* packed, float* out) {
  const uint64_t w = static_cast<uint64_t>(comm.world_size());
  // Host memory and an `out` of its own: each bucket's sums go straight there.
  const bool straight = !mem.on_device() && out != packed;
  for (const ReduceBucket& b : buckets) {
    if (scatter && straight) {
      STRATA_RETURN_IF_ERROR(comm.ReduceScatter(packed + w * b.first, out + b.first, b.columns));
    } else if (scatter) {
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

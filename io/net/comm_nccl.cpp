// The NCCL communicator: CUDA device buffers, one stream of its own. The
// unique id travels through the store; the communicator is non-blocking
// (ncclConfig_t.blocking = 0) so that every wait polls with a deadline and a
// stuck or failed peer ends in ncclCommAbort and an error instead of a hang.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "io/net/comm_backends.h"
#include "io/net/deadline.h"

namespace strata::net {
namespace {

using Clock = std::chrono::steady_clock;

Status CudaStatus(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return Status::Ok();
  return CommError(std::string(what) + ": " + cudaGetErrorString(e));
}

class NcclComm final : public Communicator {
 public:
  NcclComm(int rank, int world, Millis timeout) : rank_(rank), world_(world), timeout_(timeout) {}
  ~NcclComm() override {
    // A comm that failed was aborted already; a healthy one is finalized.
    if (comm_) ncclCommDestroy(comm_);
    if (scratch_) cudaFree(scratch_);
    if (desc_) cudaFree(desc_);
    if (bounce_) cudaFree(bounce_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const char* backend() const override { return "nccl"; }
  bool device_buffers() const override { return true; }

  Status Init(int device, const ncclUniqueId& id) {
    STRATA_RETURN_IF_ERROR(CudaStatus("cudaSetDevice", cudaSetDevice(device)));
    // A blocking stream: it waits for work the caller queued on the legacy
    // default stream, so gradients written there are complete when NCCL reads.
    STRATA_RETURN_IF_ERROR(CudaStatus("cudaStreamCreate", cudaStreamCreate(&stream_)));
    STRATA_RETURN_IF_ERROR(CudaStatus("cudaMalloc", cudaMalloc(&scratch_, sizeof(float))));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t rc = ncclCommInitRankConfig(&comm_, world_, id, rank_, &config);
    STRATA_RETURN_IF_ERROR(Check("ncclCommInitRankConfig", rc));
    return Await("ncclCommInitRankConfig", /*stream=*/false);
  }

  Status FirstBarrier() {
    return Launch("barrier", [&] { return Allreduce1(); });
  }

 protected:
  // Device buffers go to NCCL as they are. Host buffers (the engine's
  // norms, agreements, checkpoints' small exchanges, P homed on the host)
  // are staged through a device buffer of this communicator's, at most
  // kBounceBytes, in pieces: NCCL's own memory, outside the device tier's
  // budget, as NCCL's internal buffers are.
  Status DoAllReduce(float* buf, size_t n) override {
    STRATA_ASSIGN_OR_RETURN(bool dev, OnDevice(buf, nullptr));
    if (dev)
      return Launch("ncclAllReduce", [&] { return ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, comm_, stream_); });
    const size_t piece = kBounceBytes / sizeof(float);
    for (size_t at = 0; at < n; at += piece) {
      const size_t k = std::min(piece, n - at);
      STRATA_ASSIGN_OR_RETURN(float* b, Bounce(k * sizeof(float)));
      STRATA_RETURN_IF_ERROR(Copy(b, buf + at, k * sizeof(float), cudaMemcpyHostToDevice));
      STRATA_RETURN_IF_ERROR(
          Launch("ncclAllReduce (host buffer)", [&] { return ncclAllReduce(b, b, k, ncclFloat, ncclSum, comm_, stream_); }));
      STRATA_RETURN_IF_ERROR(Copy(buf + at, b, k * sizeof(float), cudaMemcpyDeviceToHost));
    }
    return Status::Ok();
  }
  Status DoReduceScatter(const float* in, float* out, size_t n) override {
    STRATA_ASSIGN_OR_RETURN(bool dev, OnDevice(in, out));
    if (dev)
      return Launch("ncclReduceScatter",
                    [&] { return ncclReduceScatter(in, out, n, ncclFloat, ncclSum, comm_, stream_); });
    // Columns [at, at+k) of every rank's piece, packed, reduce-scattered in place.
    const size_t w = static_cast<size_t>(world_), piece = std::max<size_t>(kBounceBytes / sizeof(float) / w, 1);
    for (size_t at = 0; at < n; at += piece) {
      const size_t k = std::min(piece, n - at);
      STRATA_ASSIGN_OR_RETURN(float* b, Bounce(k * w * sizeof(float)));
      for (size_t r = 0; r < w; ++r)
        STRATA_RETURN_IF_ERROR(Copy(b + r * k, in + r * n + at, k * sizeof(float), cudaMemcpyHostToDevice));
      float* mine = b + static_cast<size_t>(rank_) * k;
      STRATA_RETURN_IF_ERROR(Launch("ncclReduceScatter (host buffer)",
                                    [&] { return ncclReduceScatter(b, mine, k, ncclFloat, ncclSum, comm_, stream_); }));
      STRATA_RETURN_IF_ERROR(Copy(out + at, mine, k * sizeof(float), cudaMemcpyDeviceToHost));
    }
    return Status::Ok();
  }
  Status DoAllGather(const void* in, void* out, size_t bytes) override {
    STRATA_ASSIGN_OR_RETURN(bool dev, OnDevice(in, out));
    if (dev) return Launch("ncclAllGather", [&] { return ncclAllGather(in, out, bytes, ncclUint8, comm_, stream_); });
    const size_t w = static_cast<size_t>(world_), piece = std::max<size_t>(kBounceBytes / w, 1);
    auto* o = static_cast<char*>(out);
    const auto* i = static_cast<const char*>(in);
    for (size_t at = 0; at < bytes; at += piece) {
      const size_t k = std::min(piece, bytes - at);
      STRATA_ASSIGN_OR_RETURN(float* bf, Bounce(k * w));
      char* b = reinterpret_cast<char*>(bf);
      char* mine = b + static_cast<size_t>(rank_) * k;
      STRATA_RETURN_IF_ERROR(Copy(mine, i + at, k, cudaMemcpyHostToDevice));
      STRATA_RETURN_IF_ERROR(Launch("ncclAllGather (host buffer)",
                                    [&] { return ncclAllGather(mine, b, k, ncclUint8, comm_, stream_); }));
      for (size_t r = 0; r < w; ++r) STRATA_RETURN_IF_ERROR(Copy(o + r * bytes + at, b + r * k, k, cudaMemcpyDeviceToHost));
    }
    return Status::Ok();
  }
  Status DoBroadcast(void* buf, size_t bytes, int root) override {
    STRATA_ASSIGN_OR_RETURN(bool dev, OnDevice(buf, nullptr));
    if (dev)
      return Launch("ncclBroadcast", [&] { return ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_); });
    auto* h = static_cast<char*>(buf);
    for (size_t at = 0; at < bytes; at += kBounceBytes) {
      const size_t k = std::min(kBounceBytes, bytes - at);
      STRATA_ASSIGN_OR_RETURN(float* bf, Bounce(k));
      if (rank_ == root) STRATA_RETURN_IF_ERROR(Copy(bf, h + at, k, cudaMemcpyHostToDevice));
      STRATA_RETURN_IF_ERROR(Launch("ncclBroadcast (host buffer)",
                                    [&] { return ncclBroadcast(bf, bf, k, ncclUint8, root, comm_, stream_); }));
      STRATA_RETURN_IF_ERROR(Copy(h + at, bf, k, cudaMemcpyDeviceToHost));
    }
    return Status::Ok();
  }
  Status DoBarrier() override {
    return Launch("barrier", [&] { return Allreduce1(); });
  }
  // The descriptors go through a device buffer of their own (NCCL moves
  // device memory only); collectives on one communicator are ordered, so
  // they never mix with a collective's data.
  Status DoExchangeDescriptors(const void* mine, void* all, size_t bytes) override {
    const size_t total = bytes * static_cast<size_t>(world_);
    if (total > desc_bytes_) {
      if (desc_) cudaFree(desc_);
      desc_ = nullptr;
      desc_bytes_ = 0;
      STRATA_RETURN_IF_ERROR(CudaStatus("cudaMalloc", cudaMalloc(&desc_, total)));
      desc_bytes_ = total;
    }
    char* d = static_cast<char*>(desc_);
    STRATA_RETURN_IF_ERROR(CudaStatus("cudaMemcpy", cudaMemcpy(d + rank_ * bytes, mine, bytes, cudaMemcpyHostToDevice)));
    STRATA_RETURN_IF_ERROR(Launch("ncclAllGather (descriptors)", [&] {
      return ncclAllGather(d + rank_ * bytes, d, bytes, ncclUint8, comm_, stream_);
    }));
    return CudaStatus("cudaMemcpy", cudaMemcpy(all, d, total, cudaMemcpyDeviceToHost));
  }

 private:
  static constexpr size_t kBounceBytes = size_t{16} << 20;

  // Whether the buffers are device memory; both must be of one kind.
  Result<bool> OnDevice(const void* a, const void* b) {
    auto dev = [&](const void* p) -> Result<bool> {
      cudaPointerAttributes attr{};
      const cudaError_t e = cudaPointerGetAttributes(&attr, p);
      if (e != cudaSuccess) {
        cudaGetLastError();
        return InvalidError(std::string("cudaPointerGetAttributes: ") + cudaGetErrorString(e));
      }
      return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
    };
    STRATA_ASSIGN_OR_RETURN(bool da, dev(a));
    if (!b) return da;
    STRATA_ASSIGN_OR_RETURN(bool db, dev(b));
    if (da != db) return InvalidError("one buffer on the device and one on the host");
    return da;
  }
  // The staging buffer, at least `bytes` (<= kBounceBytes x world).
  Result<float*> Bounce(size_t bytes) {
    if (bytes > bounce_bytes_) {
      if (bounce_) cudaFree(bounce_);
      bounce_ = nullptr;
      bounce_bytes_ = 0;
      STRATA_RETURN_IF_ERROR(CudaStatus("cudaMalloc (host-buffer staging)", cudaMalloc(&bounce_, bytes)));
      bounce_bytes_ = bytes;
    }
    return static_cast<float*>(bounce_);
  }
  Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    STRATA_RETURN_IF_ERROR(CudaStatus("cudaMemcpyAsync (host-buffer staging)",
                                      cudaMemcpyAsync(dst, src, bytes, kind, stream_)));
    return CudaStatus("cudaStreamSynchronize (host-buffer staging)", cudaStreamSynchronize(stream_));
  }

  ncclResult_t Allreduce1() {
    return ncclAllReduce(scratch_, scratch_, 1, ncclFloat, ncclSum, comm_, stream_);
  }

  template <typename Fn>
  Status Launch(const char* what, Fn&& fn) {
    STRATA_RETURN_IF_ERROR(Check(what, fn()));
    return Await(what, /*stream=*/true);
  }

  Status Check(const char* what, ncclResult_t rc) {
    if (rc == ncclSuccess || rc == ncclInProgress) return Status::Ok();
    return Fail(what, rc);
  }

  Status Fail(const char* what, ncclResult_t rc) {
    std::string msg = std::string(what) + ": " + ncclGetErrorString(rc);
    const char* last = ncclGetLastError(comm_);
    if (last && *last) msg += " (" + std::string(last) + ")";
    Abort();
    return CommError(msg);
  }

  void Abort() {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  // Polls until NCCL has no pending work on the comm and (if `stream`) the
  // stream has drained; aborts the comm on an async error or the deadline.
  Status Await(const char* what, bool stream) {
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      ncclResult_t async = ncclSuccess;
      ncclResult_t rc = ncclCommGetAsyncError(comm_, &async);
      if (rc != ncclSuccess) return Fail("ncclCommGetAsyncError", rc);
      if (async != ncclSuccess && async != ncclInProgress) return Fail(what, async);
      if (async == ncclSuccess) {
        cudaError_t e = stream ? cudaStreamQuery(stream_) : cudaSuccess;
        if (e == cudaSuccess) return Status::Ok();
        // "Not ready" is left as the thread's last error, which the next
        // kernel launch's check on this thread would report as its own.
        if (e == cudaErrorNotReady) (void)cudaGetLastError();
        if (e != cudaErrorNotReady) {
          Abort();
          return CudaStatus(what, e);
        }
      }
      if (Clock::now() > deadline) {
        Abort();
        return TimeoutError("timed out after " + FormatSeconds(timeout_) + " in " + what);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  int rank_, world_;
  Millis timeout_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  float* scratch_ = nullptr;  // (1): the barrier's all-reduce operand
  void* desc_ = nullptr;      // (world, descriptor): what each rank's collective is
  size_t desc_bytes_ = 0;
  void* bounce_ = nullptr;    // host buffers' staging (Bounce)
  size_t bounce_bytes_ = 0;
};

}  // namespace

bool NcclGpuPresent() {
  int count = 0;
  // A failure ("driver version is insufficient", no device) counts as no GPU.
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

Result<std::unique_ptr<Communicator>> MakeNcclComm(const CommOptions& o) {
  const RankInfo& r = o.rank;
  const Millis timeout = SecondsToMillis(o.timeout_s);
  const std::string where =
      "nccl rendezvous on rank " + std::to_string(r.rank) + " of " + std::to_string(r.world_size);
  int count = 0;
  STRATA_RETURN_IF_ERROR(CudaStatus("cudaGetDeviceCount", cudaGetDeviceCount(&count)).WithContext(where));
  // One process per GPU: a local rank past the last GPU is refused, not
  // wrapped onto a GPU that another rank drives.
  // The device the engine was given (a Slurm job with one GPU a task
  // names device 0 on every rank), else the local rank's.
  Result<int> device = o.device >= 0 ? Result<int>(o.device) : DeviceForLocalRank(r.local_rank, count, r.source);
  if (!device.ok()) return device.status().WithContext(where);
  if (*device >= count)
    return InvalidError(where + ": device " + std::to_string(*device) + " asked, but this process sees " +
                        std::to_string(count) + " CUDA device(s)");
  if (*device < 0) return CommError(where + ": no CUDA device");
  ncclUniqueId id;
  const std::string key = o.prefix + "/nccl/unique_id";
  if (r.rank == 0) {
    ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess) return CommError(where + ": ncclGetUniqueId: " + ncclGetErrorString(rc));
    if (o.store) {
      auto* p = reinterpret_cast<const uint8_t*>(&id);
      STRATA_RETURN_IF_ERROR(o.store->Set(key, Bytes(p, p + sizeof id)).WithContext(where));
    }
  } else {
    STRATA_ASSIGN_OR_RETURN(Bytes b, o.store->Get(key, timeout));
    if (b.size() != sizeof id) return CommError(where + ": malformed NCCL unique id in the store");
    std::memcpy(&id, b.data(), sizeof id);
  }
  auto comm = std::make_unique<NcclComm>(r.rank, r.world_size, timeout);
  STRATA_RETURN_IF_ERROR(comm->Init(*device, id).WithContext(where));
  STRATA_RETURN_IF_ERROR(comm->FirstBarrier().WithContext(where + ": first barrier"));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace strata::net

// The NCCL communicator with one rank on the first GPU: every collective on
// device buffers. Skipped (77) without NCCL in the build or without a GPU.
#include <cstdio>
#include <vector>

#include "io/net/comm.h"
#if STRATA_HAVE_NCCL
#include <cuda_runtime.h>
#endif

using namespace strata;
using namespace strata::net;

int main() {
#if !STRATA_HAVE_NCCL
  std::printf("skipped: this build has no NCCL\n");
  return 77;
#else
  if (!NcclAvailable()) {
    std::printf("skipped: no GPU\n");
    return 77;
  }
  CommOptions o;
  o.backend = "nccl";
  o.timeout_s = 30;
  auto c = MakeCommunicator(o);
  if (!c.ok()) {
    std::fprintf(stderr, "FAILED: %s\n", c.status().ToString().c_str());
    return 1;
  }
  Communicator& comm = **c;
  const size_t n = 53;
  std::vector<float> host(n), back(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i);
  float *d = nullptr, *e = nullptr;
  if (cudaMalloc(&d, n * sizeof(float)) != cudaSuccess || cudaMalloc(&e, n * sizeof(float)) != cudaSuccess)
    return 1;
  cudaMemcpy(d, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  int failures = 0;
  auto ok = [&](const Status& s) {
    if (!s.ok()) std::fprintf(stderr, "FAILED: %s\n", s.ToString().c_str()), ++failures;
  };
  ok(comm.AllReduce(d, n));
  ok(comm.ReduceScatter(d, e, n));
  ok(comm.AllGather(e, d, n * sizeof(float)));
  ok(comm.Broadcast(d, n * sizeof(float), 0));
  ok(comm.Barrier());
  cudaMemcpy(back.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost);
  for (size_t i = 0; i < n; ++i)
    if (back[i] != host[i]) std::fprintf(stderr, "FAILED: element %zu = %g\n", i, back[i]), ++failures;
  cudaFree(d);
  cudaFree(e);
  std::printf("nccl one rank: %d failures\n", failures);
  return failures ? 1 : 0;
#endif
}

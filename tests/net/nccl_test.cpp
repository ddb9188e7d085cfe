// The NCCL communicator with one rank on the first GPU: every collective on
// device buffers. Skipped (77) without NCCL in the build or without a GPU.
#include <algorithm>
#include <cmath>
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
  // At one rank every collective's output equals its input: each output
  // that is not its input is filled with NaN first and checked after its
  // own collective, so one that writes nothing back fails.
  auto check_device = [&](const float* p, const char* what) {
    cudaMemcpy(back.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < n; ++i)
      if (back[i] != host[i]) {
        std::fprintf(stderr, "FAILED: %s: element %zu = %g\n", what, i, back[i]), ++failures;
        return;
      }
  };
  ok(comm.AllReduce(d, n));
  check_device(d, "all-reduce");
  cudaMemset(e, 0xff, n * sizeof(float));
  ok(comm.ReduceScatter(d, e, n));
  check_device(e, "reduce-scatter");
  cudaMemset(d, 0xff, n * sizeof(float));
  ok(comm.AllGather(e, d, n * sizeof(float)));
  check_device(d, "all-gather");
  ok(comm.Broadcast(d, n * sizeof(float), 0));
  ok(comm.Barrier());
  check_device(d, "broadcast");
  // Host buffers, staged through the communicator's device buffer: 5 M
  // floats, more than one 16 MiB piece, so the pieces' seams are crossed.
  const size_t big = 5u << 20;
  std::vector<float> h(big), h2(big, std::nanf(""));
  for (size_t i = 0; i < big; ++i) h[i] = static_cast<float>(i % 1021) - 510.0f;
  const std::vector<float> want = h;
  auto check_host = [&](const std::vector<float>& v, const char* what) {
    size_t wrong = 0;
    for (size_t i = 0; i < big; ++i) wrong += v[i] != want[i];  // (NaN never equals)
    if (wrong) std::fprintf(stderr, "FAILED: %s: %zu host-buffer elements differ\n", what, wrong), ++failures;
  };
  ok(comm.AllReduce(h.data(), big));
  check_host(h, "host all-reduce");
  ok(comm.ReduceScatter(h.data(), h2.data(), big));
  check_host(h2, "host reduce-scatter");
  std::fill(h.begin(), h.end(), std::nanf(""));
  ok(comm.AllGather(h2.data(), h.data(), big * sizeof(float)));
  check_host(h, "host all-gather");
  ok(comm.Broadcast(h.data(), big * sizeof(float), 0));
  check_host(h, "host broadcast");
  ok(comm.AllGather(h.data(), h.data(), big * sizeof(float)));  // in place
  check_host(h, "host all-gather in place");
  cudaFree(d);
  cudaFree(e);
  std::printf("nccl one rank: %d failures\n", failures);
  return failures ? 1 : 0;
#endif
}

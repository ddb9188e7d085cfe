// Host<->device copy rate through HostTier + DeviceTier against plain
// cudaMemcpyAsync from cudaMallocHost memory, alternating, medians.
// Last line: copy_bw h2d_ratio=R d2h_ratio=R. Exits 77 without a GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "base/align.h"
#include "tiers/device_tier.h"
#include "tiers/host_tier.h"

using namespace strata;

static double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

#define CUDA_OR_DIE(x)                                                              \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "copy_bw: %s: %s\n", #x, cudaGetErrorString(e_));        \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

int main(int argc, char** argv) {
  std::string why;
  if (gpu::DeviceCount(&why) == 0) {
    std::printf("copy_bw: skipped: no GPU (%s)\n", why.c_str());
    return 77;
  }
  const uint64_t bytes = (argc > 1 ? std::stoull(argv[1]) : 1024) * kMiB;
  const int rounds = 5;
  HostTier host({.budget = bytes + kHugePage});
  auto dev = DeviceTier::Create({.budget = 2 * bytes});
  if (!dev.ok()) { std::fprintf(stderr, "copy_bw: %s\n", dev.status().ToString().c_str()); return 1; }
  auto h = host.Allocate(bytes);
  auto d = (*dev)->Allocate(bytes);
  if (!h.ok() || !d.ok()) { std::fprintf(stderr, "copy_bw: allocation failed\n"); return 1; }
  void* peer_host = nullptr;
  void* peer_dev = nullptr;
  CUDA_OR_DIE(cudaMallocHost(&peer_host, bytes));
  CUDA_OR_DIE(cudaMalloc(&peer_dev, bytes));
  cudaStream_t s;
  CUDA_OR_DIE(cudaStreamCreate(&s));
  std::vector<double> tin, tout, pin, pout;
  auto secs = [](auto t0) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  for (int r = 0; r < rounds; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    auto ci = (*dev)->CopyIn(d->ptr, h->ptr, bytes);
    if (!ci.ok() || !(*ci)->Wait().ok()) { std::fprintf(stderr, "copy_bw: CopyIn failed\n"); return 1; }
    tin.push_back(secs(t0));
    t0 = std::chrono::steady_clock::now();
    CUDA_OR_DIE(cudaMemcpyAsync(peer_dev, peer_host, bytes, cudaMemcpyHostToDevice, s));
    CUDA_OR_DIE(cudaStreamSynchronize(s));
    pin.push_back(secs(t0));
    t0 = std::chrono::steady_clock::now();
    auto co = (*dev)->CopyOut(h->ptr, d->ptr, bytes);
    if (!co.ok() || !(*co)->Wait().ok()) { std::fprintf(stderr, "copy_bw: CopyOut failed\n"); return 1; }
    tout.push_back(secs(t0));
    t0 = std::chrono::steady_clock::now();
    CUDA_OR_DIE(cudaMemcpyAsync(peer_host, peer_dev, bytes, cudaMemcpyDeviceToHost, s));
    CUDA_OR_DIE(cudaStreamSynchronize(s));
    pout.push_back(secs(t0));
  }
  const double gb = static_cast<double>(bytes) / 1e9;
  std::printf("h2d: strata %.1f GB/s, cudaMemcpy pinned %.1f GB/s\n", gb / Median(tin), gb / Median(pin));
  std::printf("d2h: strata %.1f GB/s, cudaMemcpy pinned %.1f GB/s\n", gb / Median(tout), gb / Median(pout));
  std::printf("copy_bw h2d_ratio=%.2f d2h_ratio=%.2f\n", Median(pin) / Median(tin), Median(pout) / Median(tout));
  cudaFreeHost(peer_host);
  cudaFree(peer_dev);
  cudaStreamDestroy(s);
  (*dev)->Free(*d);
  host.Free(*h);
  return 0;
}

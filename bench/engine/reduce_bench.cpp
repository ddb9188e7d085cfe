// One group's gradients reduced over `world` ranks of this host (threads of
// this process, real Gloo communicators through shared memory, stage 3's
// reduce-scatter, the communication thread), each rank's sums landing in its
// G (host memory, fp32): a GradReducer::Grads call and its Drain, as the
// engine runs them, two ways in alternating order:
//   straight: the sums_target hook gives G (the engine's path where G holds
//             only the sums: fp32, host memory, the step's first gradients);
//   copy:     no target: the sums are left in the reducer's buffer and the
//             accumulate hook copies them into G (the path where G is
//             accumulated into, staged or of another dtype).
// The peer, in the same run on the same threads: a memory loop that copies
// each rank's gradient once (memcpy, N floats a rank at once), the least a
// reduction that reads its input can cost. Prints each way's median wall
// time a reduction and its ratio to the loop ("passes": how many gradient
// copies' time a reduction takes), then last
// `reduce_passes straight=R copy=R` (lower is better).
// Usage: strata-reduce-bench [elements=26000000] [rounds=5] [world=2]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/reduce/reducer.h"
#include "io/net/store.h"
#include "tiers/device_tier.h"
#include "tiers/host_tier.h"

using namespace strata;
using Clock = std::chrono::steady_clock;

namespace {

enum Way { kLoop, kStraight, kCopy };
const char* Name(Way w) { return w == kLoop ? "memcpy loop" : w == kStraight ? "straight" : "copy"; }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// One rank's timing of `way`, `reps` times after one warm-up; the wall time
// of one, measured between two barriers (all ranks at once).
Status RankRun(net::Communicator& comm, Way way, uint64_t n, int reps, double* seconds) {
  const int w = comm.world_size(), r = comm.rank();
  Config config;
  config.zero.stage = 3;
  config.zero.overlap_comm = true;
  Layout layout;
  layout.config = &config;
  STRATA_RETURN_IF_ERROR(layout.part.Add(0, "g", n).status());
  layout.sworld = w;
  layout.srank = r;
  layout.multi = layout.reduces = layout.p_sharded = true;
  STRATA_RETURN_IF_ERROR(layout.part.Finalize(w));
  const GroupLayout& L = layout.group(0);
  STRATA_ASSIGN_OR_RETURN(auto device,
                          DeviceTier::Create({.budget = 1 << 20, .device = 0, .force_host_arena = true, .pool = false}));
  auto host = std::make_unique<HostTier>(
      HostTierOptions{.budget = 2 * L.padded * 4 + (64ull << 20), .pin = false, .huge_pages = false, .numa_bind = false});
  StagingPool staging;
  STRATA_RETURN_IF_ERROR(staging.Init(host.get(), 2, L.padded * 4));
  std::vector<float> grads(n), G(L.shard_numel), sink(n);
  for (uint64_t i = 0; i < n; ++i) grads[i] = static_cast<float>((i * 2654435761u + static_cast<uint64_t>(r)) % 1000) * 1e-3f;
  GradReducer::Hooks h;
  h.accumulate = [&](int, const float* sums, uint64_t k) {
    if (sums != G.data()) std::memcpy(G.data(), sums, k * 4);
    return Status::Ok();
  };
  h.step = [] { return int64_t{1}; };
  h.grad_calls = [](int) { return 0; };
  h.pin_ahead = [](int) -> void* { return nullptr; };
  h.end_ahead = [](int, bool) {};
  if (way == kStraight) h.sums_target = [&](int) { return G.data(); };
  GradReducer reducer(layout, comm, *device, staging, /*g_staged=*/false, std::move(h));
  STRATA_RETURN_IF_ERROR(reducer.Init());
  auto once = [&]() -> Status {
    if (way == kLoop) {
      std::memcpy(sink.data(), grads.data(), n * 4);
      return Status::Ok();
    }
    STRATA_RETURN_IF_ERROR(reducer.Grads(0, grads.data(), DType::kF32));
    return reducer.Drain();
  };
  STRATA_RETURN_IF_ERROR(once());  // pages touched, the channel warm
  STRATA_RETURN_IF_ERROR(comm.Barrier());
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) STRATA_RETURN_IF_ERROR(once());
  STRATA_RETURN_IF_ERROR(comm.Barrier());
  *seconds = std::chrono::duration<double>(Clock::now() - t0).count() / reps;
  // The sums are checked, so that no way is timed doing less: element 0 of
  // this rank's shard is the sum of every rank's element r*shard.
  if (way != kLoop) {
    const uint64_t e = static_cast<uint64_t>(r) * L.shard_numel;
    float want = 0;
    for (int q = 0; q < w; ++q) want += static_cast<float>((e * 2654435761u + static_cast<uint64_t>(q)) % 1000) * 1e-3f;
    if (e < n && std::fabs(G[0] - want) > 1e-5f * w)
      return InternalError("rank " + std::to_string(r) + ": sum " + std::to_string(G[0]) + ", expected " +
                           std::to_string(want));
  }
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 26'000'000;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 5;
  const int world = argc > 3 ? std::atoi(argv[3]) : 2;
  if (n == 0 || rounds < 1 || world < 2) {
    std::fprintf(stderr, "usage: %s [elements>0] [rounds>=1] [world>=2]\n", argv[0]);
    return 2;
  }
  auto server = net::StoreServer::Start("127.0.0.1", 0);
  if (!server.ok()) {
    std::fprintf(stderr, "reduce_bench: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::vector<std::unique_ptr<net::StoreClient>> clients(static_cast<size_t>(world));
  std::vector<std::unique_ptr<net::Communicator>> comms(static_cast<size_t>(world));
  std::vector<Status> made(static_cast<size_t>(world));
  {
    std::vector<std::thread> t;
    for (int r = 0; r < world; ++r)
      t.emplace_back([&, r] {
        auto c = net::StoreClient::Connect("127.0.0.1", (*server)->port(), std::chrono::seconds(10));
        if (!c.ok()) { made[static_cast<size_t>(r)] = c.status(); return; }
        clients[static_cast<size_t>(r)] = std::move(*c);
        net::CommOptions o;
        o.rank.rank = r;
        o.rank.world_size = world;
        o.backend = "gloo";
        o.store = clients[static_cast<size_t>(r)].get();
        auto m = net::MakeCommunicator(o);
        if (!m.ok()) { made[static_cast<size_t>(r)] = m.status(); return; }
        comms[static_cast<size_t>(r)] = std::move(*m);
      });
    for (auto& x : t) x.join();
  }
  for (const Status& s : made)
    if (!s.ok()) {
      std::fprintf(stderr, "reduce_bench: %s\n", s.ToString().c_str());
      return 1;
    }
  if (!comms[0]->shared_memory()) std::printf("note: the ranks could not share memory; the collectives go over TCP\n");
  std::printf("%d ranks, a group of %llu fp32 gradients (%.1f MiB a rank), %d rounds\n", world,
              static_cast<unsigned long long>(n), n * 4.0 / (1 << 20), rounds);
  std::vector<double> times[3];
  for (int round = 0; round < rounds; ++round) {
    const Way order[3] = {kLoop, round % 2 ? kCopy : kStraight, round % 2 ? kStraight : kCopy};
    for (Way way : order) {
      std::vector<double> secs(static_cast<size_t>(world));
      std::vector<Status> st(static_cast<size_t>(world));
      std::vector<std::thread> t;
      for (int r = 0; r < world; ++r)
        t.emplace_back([&, r] {
          st[static_cast<size_t>(r)] = RankRun(*comms[static_cast<size_t>(r)], way, n, 5, &secs[static_cast<size_t>(r)]);
        });
      for (auto& x : t) x.join();
      for (const Status& s : st)
        if (!s.ok()) {
          std::fprintf(stderr, "reduce_bench: %s: %s\n", Name(way), s.ToString().c_str());
          return 1;
        }
      times[way].push_back(secs[0]);
      std::printf("round %d %-11s %.4f s\n", round, Name(way), secs[0]);
    }
  }
  const double loop = Median(times[kLoop]), straight = Median(times[kStraight]), copy = Median(times[kCopy]);
  std::printf("median: memcpy loop %.4f s, straight %.4f s, copy %.4f s a reduction (copy / straight %.3f)\n", loop,
              straight, copy, copy / straight);
  std::printf("reduce_passes straight=%.2f copy=%.2f\n", straight / loop, copy / loop);
  return 0;
}

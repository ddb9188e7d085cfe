// The optimizer step overlapped with backward (issue #26) against the same
// step after backward, through the public C API alone. bench/overlap_step.sh
// runs it; its header states the defaults and the targets.
//
// Five engines live side by side, each with W, M, V, G homed on NVMe in
// DIR/<name> (offload_optimizer nvme, bf16 compute, AdamW, no GPU: the device
// tier is a host arena), all fed the same gradients:
//   plain           overlap_step 0, gradient_clipping CLIP (1.0): never triggers
//   overlap         overlap_step 1, gradient_clipping CLIP
//   plain_replay    overlap_step 0, gradient_clipping REPLAY_CLIP (1e-4): triggers every step
//   overlap_replay  overlap_step 1, gradient_clipping REPLAY_CLIP, strata.speculation "always"
//                   (every step speculates and replays: the cost of a replay)
//   overlap_clipped overlap_step 1, gradient_clipping REPLAY_CLIP, the default policy
//                   (strata.speculation "auto": a step clipped every time pays nothing)
// The gradients are bf16, uniform with a fixed seed, scaled so that their
// global norm is about NORM (0.5); each (step, group) reads a different
// window of one buffer.
//
// One iteration of an engine, the trainer's compute modelled as sleeps (the
// CPU is left to the engine's threads), as a GPU's kernels look from the CPU:
//   for g = 0..groups-1:  fetch(g); sleep fwd; release(g)
//   prepare_step(NULL)                                   (overlap engines only)
//   for g = groups-1..0:  sleep bwd; grads(g)
//   step(NULL)
// exposed = from the return of the last grads call to the return of step
// (steady clock); iteration = the whole of it; in_calls = the time inside
// fetch, release, prepare_step and grads (iteration = waits + in_calls +
// exposed, plus the sleeps' overshoot), in_grads = that inside grads alone.
//
// First every engine runs WARMUP (1) iterations and then CALIB (1)
// calibration iterations, all without waits; T = the median of the
// non-overlapped engines' (plain's and plain_replay's) exposed step times in
// the calibration iterations: the non-overlapped step. Then bwd = T / groups and fwd = bwd / 2, so the backward lasts
// as long as the non-overlapped step and the forward half that. Then ROUNDS
// paired rounds, every engine once each, in alternating order (plain,
// overlap, plain_replay, overlap_replay; then overlap, plain, overlap_replay,
// plain_replay), medians over rounds:
//   E = median exposed(overlap) / median exposed(plain)
//   I = median iteration(overlap) / median iteration(plain)
//   X = median exposed(overlap_replay) / median exposed(plain_replay)
// Every call is checked (a failed one ends the run with its error); each step
// must apply (stats.steps + 1, not skipped), and its grad_norm must be below
// CLIP (plain pair) or above REPLAY_CLIP (replay pair). At the end each
// overlapped engine's master weights must equal its plain peer's bitwise
// (bitwise=yes/no; no exits 1), and plain's must differ from plain_replay's
// (else the replay pair did not clip: the run fails).
//   R = median iteration(overlap_clipped) / median iteration(plain_replay)
// Last line: `overlap_step exposed_ratio=E iteration_ratio=I replay_exposed_ratio=X clipped_iteration_ratio=R`.
//
// Usage: strata-overlap-step DIR [params=128Mi] [groups=32] [rounds=5] [host_budget=1GiB]
//   params takes a suffix K, M, G (powers of 1024).
// Env: CLIP (1.0), REPLAY_CLIP (1e-4), NORM (0.5), WARMUP (1), CALIB (1), STEP_IO
//   (strata.step_io, default alternate), TRACE (strata.trace_path; each engine
//   writes TRACE.<name>.json).
#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "strata/strata.h"

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "overlap_step: %s\n", what.c_str());
  std::fflush(stdout);
  std::exit(1);
}

void Check(strata_status_t s, const std::string& what) {
  if (s != STRATA_OK) Die(what + ": " + strata_status_name(s) + ": " + strata_last_error());
}

double Secs(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// The stats fields of issue #26, read only when this header has them.
template <class S, class = void>
struct HasSpec : std::false_type {};
template <class S>
struct HasSpec<S, std::void_t<decltype(S::exposed_step_s), decltype(S::speculated_steps), decltype(S::committed_steps),
                              decltype(S::replayed_steps), decltype(S::discarded_steps), decltype(S::early_updates)>>
    : std::true_type {};

template <class S>
std::string EngineExposedText(const S& s) {
  char b[32];
  if constexpr (HasSpec<S>::value) std::snprintf(b, sizeof b, "%.4f", s.exposed_step_s);
  else std::snprintf(b, sizeof b, "n/a");
  return b;
}

// Where the header has the stats: an overlapped engine whose groups were
// never updated before the end of backward did not overlap (said, not failed:
// the engine may decline, with a warning of its own).
template <class S>
void NoteNoOverlap(const std::string& name, const S& s) {
  if constexpr (HasSpec<S>::value)
    if (s.early_updates == 0)
      std::printf("note: %s updated no group before the end of backward (stats.early_updates 0): it did not overlap\n",
                  name.c_str());
}

template <class S>
std::string SpecStats(const S& s) {
  if constexpr (HasSpec<S>::value) {
    char b[256];
    std::snprintf(b, sizeof b, " speculated=%llu committed=%llu replayed=%llu discarded=%llu early_updates=%llu",
                  (unsigned long long)s.speculated_steps, (unsigned long long)s.committed_steps,
                  (unsigned long long)s.replayed_steps, (unsigned long long)s.discarded_steps,
                  (unsigned long long)s.early_updates);
    return b;
  } else {
    return " (this strata.h has no speculation stats)";
  }
}

uint64_t ParseCount(const char* text) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 10);
  uint64_t mul = 1;
  if (end && *end) {
    if (std::strcmp(end, "K") == 0 || std::strcmp(end, "k") == 0) mul = uint64_t{1} << 10;
    else if (std::strcmp(end, "M") == 0) mul = uint64_t{1} << 20;
    else if (std::strcmp(end, "G") == 0) mul = uint64_t{1} << 30;
    else Die(std::string("params: not a count: '") + text + "' (an integer, with K, M or G)");
  }
  if (errno || v == 0 || end == text) Die(std::string("params: not a positive count: '") + text + "'");
  return v * mul;
}

double EnvDouble(const char* name, double dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  const double d = std::strtod(v, &end);
  if (*end || !std::isfinite(d)) Die(std::string(name) + ": not a number: '" + v + "'");
  return d;
}

uint16_t ToBF16(float f) {  // round to nearest even (finite values only)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Run {
  std::string name;
  bool overlap = false;
  bool replay = false;  // clipping triggers every step
  double clip = 0;
  const char* speculation = "auto";
  strata_engine_t* e = nullptr;
  std::vector<double> exposed, iter, in_calls, in_grads;
  strata_stats_t last = STRATA_STATS_INIT;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [params=128M] [groups=32] [rounds=5] [host_budget=1GiB]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const uint64_t params = ParseCount(argc > 2 ? argv[2] : "128M");
  const int groups = argc > 3 ? std::atoi(argv[3]) : 32;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 5;
  const std::string host_budget = argc > 5 ? argv[5] : "1GiB";
  if (groups < 1 || static_cast<uint64_t>(groups) > params) Die("groups: must be 1..params, got " + std::to_string(groups));
  if (rounds < 1) Die("rounds: must be >= 1");
  const double clip = EnvDouble("CLIP", 1.0), replay_clip = EnvDouble("REPLAY_CLIP", 1e-4), norm = EnvDouble("NORM", 0.5);
  const int warmup = static_cast<int>(EnvDouble("WARMUP", 1));
  const int calib = static_cast<int>(EnvDouble("CALIB", 1));
  if (warmup < 0 || calib < 1) Die("WARMUP must be >= 0 and CALIB >= 1");
  if (!(clip > 0) || !(replay_clip > 0) || !(norm > 0)) Die("CLIP, REPLAY_CLIP and NORM must be > 0");
  if (norm >= clip) Die("NORM must be below CLIP (the plain pair's clipping must not trigger)");
  if (norm <= replay_clip) Die("NORM must be above REPLAY_CLIP (the replay pair's clipping must trigger)");
  const uint64_t per_group = params / static_cast<uint64_t>(groups);
  const uint64_t total = per_group * static_cast<uint64_t>(groups);
  const std::string step_io = std::getenv("STEP_IO") ? std::getenv("STEP_IO") : "alternate";
  const char* trace = std::getenv("TRACE");

  std::vector<Run> runs(5);
  const char* names[5] = {"plain", "overlap", "plain_replay", "overlap_replay", "overlap_clipped"};
  for (size_t k = 0; k < runs.size(); ++k) {
    runs[k].name = names[k];
    runs[k].overlap = k % 2 == 1 || k == 4;
    runs[k].replay = k >= 2;
    runs[k].clip = k >= 2 ? replay_clip : clip;
    runs[k].speculation = k == 3 ? "always" : "auto";
  }
  for (Run& r : runs) {
    const std::string where = dir + "/" + r.name;
    if (std::system(("mkdir -p '" + where + "'").c_str()) != 0) Die("mkdir " + where);
    char clipbuf[64];
    std::snprintf(clipbuf, sizeof clipbuf, "%.17g", r.clip);
    const std::string json = std::string(R"({"bf16": {"enabled": true}, "gradient_clipping": )") + clipbuf +
                             R"(, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + where + R"("}},
      "aio": {"block_size": 1048576, "queue_depth": 32},
      "strata": {"host_budget": ")" + host_budget + R"(", "device_budget": "4GiB", "step_io": ")" + step_io + "\"" +
                             R"(, "speculation": ")" + r.speculation + "\"" +
                             (trace ? R"(, "trace_path": ")" + std::string(trace) + "." + r.name + ".json\"" : std::string()) +
                             "}}";
    strata_engine_options_t opt = STRATA_ENGINE_OPTIONS_INIT;
    opt.world_size = 1;
    opt.force_no_gpu = 1;  // the gradients below are host memory
    opt.overlap_step = r.overlap ? 1 : 0;
    Check(strata_engine_create(json.c_str(), &opt, &r.e), r.name + ": create");
    // The same initial weights in every engine: small values, a fixed pattern.
    std::vector<float> init(per_group);
    for (int g = 0; g < groups; ++g) {
      for (uint64_t i = 0; i < per_group; ++i) init[i] = 0.02f * static_cast<float>(static_cast<int>((i * 7 + g) % 101) - 50) / 50.0f;
      Check(strata_engine_add_param(r.e, g, ("g" + std::to_string(g)).c_str(), per_group, init.data(), nullptr),
            r.name + ": add_param " + std::to_string(g));
    }
    Check(strata_engine_build(r.e), r.name + ": build");
    strata_dtype_t cd;
    Check(strata_engine_compute_dtype(r.e, &cd), r.name + ": compute_dtype");
    if (cd != STRATA_DTYPE_BF16) Die(r.name + ": compute dtype is not bf16");
    Check(strata_engine_stats(r.e, &r.last), r.name + ": stats");
  }

  // bf16 gradients: uniform in [-a, a] with a fixed seed; a window of
  // per_group values starting at (step, group)'s offset. Their global norm is
  // about sqrt(total * a^2 / 3) = NORM.
  const uint64_t kSlack = 4096;
  std::vector<uint16_t> gbuf(per_group + kSlack);
  {
    std::mt19937_64 rng(20261202);
    const double a = norm * std::sqrt(3.0 / static_cast<double>(total));
    std::uniform_real_distribution<float> u(static_cast<float>(-a), static_cast<float>(a));
    for (uint16_t& x : gbuf) x = ToBF16(u(rng));
  }
  auto grads_of = [&](int step, int g) { return gbuf.data() + (static_cast<uint64_t>(step) * 131 + static_cast<uint64_t>(g) * 17) % kSlack; };

  int step_no = 0;  // the iteration every engine is at (all step in lockstep)
  // One iteration of `r` with waits fwd and bwd (seconds) per group.
  // *calls: the seconds spent inside fetch, release, prepare_step and grads
  // (the iteration less the waits and the exposed step); *in_grads: those
  // inside grads alone.
  auto iterate = [&](Run& r, double fwd, double bwd, double* exposed, double* iter, double* calls, double* in_grads) {
    const auto fw = std::chrono::duration<double>(fwd), bw = std::chrono::duration<double>(bwd);
    const auto t0 = Clock::now();
    double in = 0, ing = 0;
    for (int g = 0; g < groups; ++g) {
      void* p = nullptr;
      auto c0 = Clock::now();
      Check(strata_engine_fetch(r.e, g, nullptr, &p), r.name + ": fetch " + std::to_string(g));
      in += Secs(c0, Clock::now());
      if (fwd > 0) std::this_thread::sleep_until(Clock::now() + std::chrono::duration_cast<Clock::duration>(fw));
      c0 = Clock::now();
      Check(strata_engine_release(r.e, g, nullptr), r.name + ": release " + std::to_string(g));
      in += Secs(c0, Clock::now());
    }
    if (r.overlap) {
      const auto c0 = Clock::now();
      Check(strata_engine_prepare_step(r.e, nullptr), r.name + ": prepare_step");
      in += Secs(c0, Clock::now());
    }
    for (int g = groups - 1; g >= 0; --g) {
      if (bwd > 0) std::this_thread::sleep_until(Clock::now() + std::chrono::duration_cast<Clock::duration>(bw));
      const auto c0 = Clock::now();
      Check(strata_engine_grads(r.e, g, grads_of(step_no, g), STRATA_DTYPE_BF16, nullptr), r.name + ": grads " + std::to_string(g));
      const double d = Secs(c0, Clock::now());
      in += d;
      ing += d;
    }
    const auto t1 = Clock::now();
    *calls = in;
    *in_grads = ing;
    strata_step_result_t res = STRATA_STEP_RESULT_INIT;
    Check(strata_engine_step(r.e, nullptr, &res), r.name + ": step");
    const auto t2 = Clock::now();
    *exposed = Secs(t1, t2);
    *iter = Secs(t0, t2);
    strata_stats_t st = STRATA_STATS_INIT;
    Check(strata_engine_stats(r.e, &st), r.name + ": stats");
    if (res.skipped || st.steps != r.last.steps + 1 || st.skipped_steps != r.last.skipped_steps)
      Die(r.name + ": step " + std::to_string(step_no) + " was not applied (skipped=" + std::to_string(res.skipped) +
          ", stats.steps " + std::to_string(r.last.steps) + " -> " + std::to_string(st.steps) + ", skipped_steps " +
          std::to_string(st.skipped_steps) + ")");
    if (!(res.grad_norm > 0) || !std::isfinite(res.grad_norm)) Die(r.name + ": grad_norm " + std::to_string(res.grad_norm));
    if (!r.replay && !(res.grad_norm < clip))
      Die(r.name + ": grad_norm " + std::to_string(res.grad_norm) + " is not below CLIP: clipping would trigger");
    if (r.replay && !(res.grad_norm > replay_clip))
      Die(r.name + ": grad_norm " + std::to_string(res.grad_norm) + " is not above REPLAY_CLIP: clipping would not trigger");
    r.last = st;
    return res.grad_norm;
  };

  double ex = 0, it = 0, calls = 0, gcalls = 0;
  for (int w = 0; w < warmup; ++w, ++step_no)
    for (Run& r : runs) {
      const double gn = iterate(r, 0, 0, &ex, &it, &calls, &gcalls);
      std::printf("warmup %d %s: exposed %.3f s, grad_norm %.4f\n", w, r.name.c_str(), ex, gn);
    }
  std::vector<double> plain_steps;
  for (int c = 0; c < calib; ++c, ++step_no)
    for (Run& r : runs) {
      iterate(r, 0, 0, &ex, &it, &calls, &gcalls);
      std::printf("calibration %d %s: exposed %.3f s (no waits)\n", c, r.name.c_str(), ex);
      if (!r.overlap) plain_steps.push_back(ex);
    }
  const double t_step = Median(plain_steps);
  const double bwd = t_step / groups, fwd = bwd / 2;
  std::printf("calibration: T = %.3f s (median of the non-overlapped steps above); waits per group: forward %.2f ms, "
              "backward %.2f ms (sleeps)\n",
              t_step, fwd * 1e3, bwd * 1e3);
  std::fflush(stdout);

  const int order[2][5] = {{0, 1, 2, 3, 4}, {1, 0, 4, 3, 2}};
  for (int round = 0; round < rounds; ++round, ++step_no) {
    for (int k : order[round % 2]) {
      Run& r = runs[static_cast<size_t>(k)];
      const double gn = iterate(r, fwd, bwd, &ex, &it, &calls, &gcalls);
      r.exposed.push_back(ex);
      r.iter.push_back(it);
      r.in_calls.push_back(calls);
      r.in_grads.push_back(gcalls);
      std::printf("overlap_step_round round=%d config=%s iteration_s=%.4f exposed_s=%.4f engine_exposed_s=%s "
                  "in_calls_s=%.4f in_grads_s=%.4f step_wall_s=%.4f grad_norm=%.4g\n",
                  round, r.name.c_str(), it, ex, EngineExposedText(r.last).c_str(), calls, gcalls, r.last.step_wall_s, gn);
    }
    std::fflush(stdout);
  }

  for (const Run& r : runs)
    std::printf("%s: steps=%llu skipped_steps=%llu%s; median exposed %.4f s, iteration %.4f s, "
                "in fetch/release/prepare_step/grads %.4f s (grads %.4f s); "
                "host peak %.1f MiB of %.1f MiB; disk per step: read %.1f MiB, written %.1f MiB\n",
                r.name.c_str(), (unsigned long long)r.last.steps, (unsigned long long)r.last.skipped_steps,
                SpecStats(r.last).c_str(), Median(r.exposed), Median(r.iter), Median(r.in_calls), Median(r.in_grads),
                r.last.host.peak / 1048576.0, r.last.host.budget / 1048576.0,
                r.last.steps ? r.last.nvme_to_host / 1048576.0 / static_cast<double>(r.last.steps) : 0.0,
                r.last.steps ? r.last.host_to_nvme / 1048576.0 / static_cast<double>(r.last.steps) : 0.0);
  for (const Run& r : runs)
    if (r.overlap) NoteNoOverlap(r.name, r.last);

  // Bitwise: each overlapped engine against its plain peer, group by group;
  // and the two plain engines must differ (the replay pair's clipping
  // changed the update: else it did not clip, and the comparison is blind).
  std::vector<std::vector<float>> m(runs.size(), std::vector<float>(per_group));
  // Pairs: overlap vs plain, overlap_replay vs plain_replay, overlap_clipped vs plain_replay.
  const int pairs[3][2] = {{0, 1}, {2, 3}, {2, 4}};
  uint64_t differ[3] = {0, 0, 0}, clip_differs = 0;
  int first_group[3] = {-1, -1, -1};
  for (int g = 0; g < groups; ++g) {
    for (size_t k = 0; k < runs.size(); ++k)
      Check(strata_engine_read_master(runs[k].e, g, m[k].data()), runs[k].name + ": read_master " + std::to_string(g));
    for (int p = 0; p < 3; ++p) {
      const std::vector<float>& a = m[static_cast<size_t>(pairs[p][0])];
      const std::vector<float>& b = m[static_cast<size_t>(pairs[p][1])];
      if (std::memcmp(a.data(), b.data(), per_group * sizeof(float)) == 0) continue;
      for (uint64_t i = 0; i < per_group; ++i) differ[p] += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
      if (first_group[p] < 0) first_group[p] = g;
    }
    for (uint64_t i = 0; i < per_group; ++i) clip_differs += std::memcmp(&m[0][i], &m[2][i], sizeof(float)) != 0;
  }
  bool same = true;
  for (int p = 0; p < 3; ++p) {
    const Run& a = runs[static_cast<size_t>(pairs[p][0])];
    const Run& b = runs[static_cast<size_t>(pairs[p][1])];
    std::printf("master %s vs %s: %s", a.name.c_str(), b.name.c_str(), differ[p] ? "DIFFER" : "bitwise equal");
    if (differ[p])
      std::printf(" (%llu of %llu values, first in group %d)", (unsigned long long)differ[p], (unsigned long long)total,
                  first_group[p]);
    std::printf("\n");
    same = same && differ[p] == 0;
  }
  std::printf("master plain vs plain_replay: %llu of %llu values differ (clipping changed the update)\n",
              (unsigned long long)clip_differs, (unsigned long long)total);
  if (clip_differs == 0) Die("plain and plain_replay have the same master weights: REPLAY_CLIP did not clip");
  for (Run& r : runs) strata_engine_destroy(r.e);

  const double E = Median(runs[1].exposed) / Median(runs[0].exposed);
  const double I = Median(runs[1].iter) / Median(runs[0].iter);
  const double X = Median(runs[3].exposed) / Median(runs[2].exposed);
  const double R = Median(runs[4].iter) / Median(runs[2].iter);
  std::printf("params=%llu groups=%d rounds=%d host_budget=%s clip=%g replay_clip=%g T=%.4f s\n", (unsigned long long)total,
              groups, rounds, host_budget.c_str(), clip, replay_clip, t_step);
  std::printf("bitwise=%s\n", same ? "yes" : "no");
  std::printf("overlap_step exposed_ratio=%.3f iteration_ratio=%.3f replay_exposed_ratio=%.3f clipped_iteration_ratio=%.3f\n",
              E, I, X, R);
  std::fflush(stdout);
  return same ? 0 : 1;
}

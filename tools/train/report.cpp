// Progress line and summary table.
#include "tools/train/report.h"

#include <unistd.h>

#include <cstdio>

namespace strata::train {

Progress::Progress(int64_t total_steps, int print_every)
    : total_(total_steps), every_(print_every < 1 ? 1 : print_every), tty_(::isatty(STDOUT_FILENO) == 1) {}

void Progress::Step(int64_t step, double loss, double tps, double eta, double lr, bool skipped) {
  if (tty_) {
    std::printf("\rstep %5lld/%lld  loss %.4f  %8.0f tok/s  lr %.2e  ETA %4.0f s%s   ", static_cast<long long>(step),
                static_cast<long long>(total_), loss, tps, lr, eta, skipped ? "  (skipped)" : "");
    std::fflush(stdout);
    return;
  }
  if (step == 1 || step % every_ == 0 || step == total_ || skipped)
    std::printf("step %lld/%lld loss %.4f tokens/s %.0f lr %.3e eta %.0fs%s\n", static_cast<long long>(step),
                static_cast<long long>(total_), loss, tps, lr, eta, skipped ? " skipped (fp16 overflow)" : "");
  std::fflush(stdout);  // a log file or a pipe shows each line as it comes, not a buffer's worth later
}

void Progress::Done() {
  if (tty_) std::printf("\n");
}

std::string HumanBytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) { v /= 1024; ++u; }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.1f %s" : "%.0f %s", v, units[u]);
  return buf;
}

std::string EnginePlacement(strata_engine_t* e) {
  size_t size = 0;
  if (strata_engine_placement(e, nullptr, &size) != STRATA_OK || size == 0) return "";
  std::string line(size, '\0');
  if (strata_engine_placement(e, line.data(), &size) != STRATA_OK) return "";
  line.resize(size - 1);  // without the NUL
  return line;
}

void PrintSummary(const RunFigures& f, const strata_stats_t& s) {
  auto tier = [](const char* name, const strata_tier_stats_t& t, uint64_t state) {
    std::printf("  %-7s budget %10s   peak %10s (%5.1f%%)   state vs budget %5.1fx\n", name,
                HumanBytes(t.budget).c_str(), HumanBytes(t.peak).c_str(),
                t.budget ? 100.0 * static_cast<double>(t.peak) / static_cast<double>(t.budget) : 0.0,
                t.budget ? static_cast<double>(state) / static_cast<double>(t.budget) : 0.0);
  };
  std::printf("\n== strata-train summary\n");
  if (!f.placement.empty()) std::printf("  placement         %s\n", f.placement.c_str());
  std::printf("  parameters        %llu (%s of state: P, W, M, V, G)\n", static_cast<unsigned long long>(f.params),
              HumanBytes(f.state_bytes).c_str());
  std::printf("  steps             %lld in %.1f s (%llu skipped)\n", static_cast<long long>(f.steps), f.wall_s,
              static_cast<unsigned long long>(s.skipped_steps));
  tier("device", s.device, f.state_bytes);
  tier("host", s.host, f.state_bytes);
  if (s.nvme.budget) tier("nvme", s.nvme, f.state_bytes);
  std::printf("  moved             nvme->host %s, host->nvme %s, host->device %s, device->host %s\n",
              HumanBytes(s.nvme_to_host).c_str(), HumanBytes(s.host_to_nvme).c_str(),
              HumanBytes(s.host_to_device).c_str(), HumanBytes(s.device_to_host).c_str());
  std::printf("  prefetch          %llu of %llu fetches foreseen (%.1f%%), %llu stalls (%.3f s)\n",
              static_cast<unsigned long long>(s.prefetch_hits), static_cast<unsigned long long>(s.fetches),
              s.fetches ? 100.0 * static_cast<double>(s.prefetch_hits) / static_cast<double>(s.fetches) : 0.0,
              static_cast<unsigned long long>(s.fetch_stalls), s.fetch_stall_s);
  std::printf("  overlap           %.2f (busiest resource / wall time)\n", f.overlap_efficiency);
  if (s.act_redeemed > 0 || s.act_host_bytes > 0 || s.act_nvme_bytes > 0)
    std::printf("  activations       %s stashed in host memory, %s sent to NVMe; %llu redeemed, %llu read ahead in "
                "time, %llu stalls (%.3f s)\n",
                HumanBytes(s.act_host_bytes).c_str(), HumanBytes(s.act_nvme_bytes).c_str(),
                static_cast<unsigned long long>(s.act_redeemed), static_cast<unsigned long long>(s.act_prefetch_hits),
                static_cast<unsigned long long>(s.act_stalls), s.act_stall_s);
  // The exposed step: from the last gradients handed to the step's return.
  if (f.overlap_step)
    std::printf("  overlapped step   %llu steps speculated (%llu committed, %llu replayed, %llu discarded), %llu not "
                "speculated, %llu groups updated during backward; exposed step %.1f ms\n",
                static_cast<unsigned long long>(s.speculated_steps), static_cast<unsigned long long>(s.committed_steps),
                static_cast<unsigned long long>(s.replayed_steps), static_cast<unsigned long long>(s.discarded_steps),
                static_cast<unsigned long long>(s.unspeculated_steps),
                static_cast<unsigned long long>(s.early_updates), 1e3 * f.exposed_s);
  else
    std::printf("  overlapped step   off (--no-overlap-step); exposed step %.1f ms\n", 1e3 * f.exposed_s);
  if (f.gpu)
    std::printf("  GPU               %.3f TFLOPS end to end, %.3f TFLOPS in the kernels (model FLOPs)\n", f.tflops,
                f.kernel_tflops);
  std::printf("  loss              %.4f -> %.4f\n", f.first_loss, f.last_loss);
}

}  // namespace strata::train

// Counters, busy clocks and the Chrome trace writer.
#include "engine/stats.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

namespace strata {

static const char* kTrackNames[] = {"disk", "copy", "cpu optimizer", "caller"};

StatsRecorder::StatsRecorder(int rank, std::string trace_path) : rank_(rank), trace_path_(std::move(trace_path)) {}

StatsRecorder::~StatsRecorder() { WriteTrace().IgnoreError(); }

double StatsRecorder::Now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

void StatsRecorder::Begin(Resource r) {
  const double now = Now();
  std::lock_guard<std::mutex> lock(mu_);
  Clock& c = clocks_[static_cast<int>(r)];
  if (c.active++ == 0) c.since = now;
}

void StatsRecorder::End(Resource r) {
  const double now = Now();
  std::lock_guard<std::mutex> lock(mu_);
  Clock& c = clocks_[static_cast<int>(r)];
  if (c.active > 0 && --c.active == 0) c.total += now - c.since;
}

void StatsRecorder::Span(Resource r, const char* name, double start_s, double end_s, uint64_t bytes) {
  if (trace_path_.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() < 4'000'000) events_.push_back({static_cast<int>(r), name, start_s, end_s, bytes});
}

void StatsRecorder::AddMoved(TierKind from, TierKind to, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (from == TierKind::kNvme && to == TierKind::kHost) stats_.nvme_to_host += bytes;
  if (from == TierKind::kHost && to == TierKind::kNvme) stats_.host_to_nvme += bytes;
  if (from == TierKind::kHost && to == TierKind::kDevice) stats_.host_to_device += bytes;
  if (from == TierKind::kDevice && to == TierKind::kHost) stats_.device_to_host += bytes;
}

void StatsRecorder::OnFetch(bool counted, bool hit, double stall_s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (counted) {
    ++stats_.fetches;
    if (hit) ++stats_.prefetch_hits;
  }
  if (stall_s > 0) {
    ++stats_.fetch_stalls;
    stats_.fetch_stall_s += stall_s;
  }
}

void StatsRecorder::StepBegin() {
  const double now = Now();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& c : clocks_) {
    c.total = 0;
    if (c.active) c.since = now;
  }
  step_start_ = now;
}

void StatsRecorder::StepEnd(bool skipped) {
  const double now = Now();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& c : clocks_)
    if (c.active) { c.total += now - c.since; c.since = now; }
  stats_.disk_busy_s = clocks_[0].total;
  stats_.copy_busy_s = clocks_[1].total;
  stats_.cpu_optimizer_s = clocks_[2].total;
  stats_.step_wall_s = now - step_start_;
  const double busiest = std::max({clocks_[0].total, clocks_[1].total, clocks_[2].total});
  stats_.overlap_efficiency = stats_.step_wall_s > 0 ? busiest / stats_.step_wall_s : 0;
  ++stats_.steps;
  if (skipped) ++stats_.skipped_steps;
  if (!trace_path_.empty() && events_.size() < 4'000'000)
    events_.push_back({3, skipped ? "step (skipped)" : "step", step_start_, now, 0});
}

EngineStats StatsRecorder::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

Status StatsRecorder::WriteTrace() const {
  if (trace_path_.empty()) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  const std::string tmp = trace_path_ + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) return PosixError("open trace", tmp, errno);
  std::fprintf(f, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
  for (int t = 0; t < 4; ++t)
    std::fprintf(f, "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}},\n",
                 rank_, t, kTrackNames[t]);
  std::fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}", rank_, rank_);
  uint64_t id = 0;
  for (const Event& e : events_) {
    if (e.track == 0) {  // concurrent I/O: async begin/end pairs
      std::fprintf(f, ",\n{\"ph\":\"b\",\"cat\":\"io\",\"name\":\"%s\",\"id\":%llu,\"pid\":%d,\"tid\":0,\"ts\":%.3f,\"args\":{\"bytes\":%llu}}",
                   e.name, static_cast<unsigned long long>(id), rank_, e.start * 1e6, static_cast<unsigned long long>(e.bytes));
      std::fprintf(f, ",\n{\"ph\":\"e\",\"cat\":\"io\",\"name\":\"%s\",\"id\":%llu,\"pid\":%d,\"tid\":0,\"ts\":%.3f}",
                   e.name, static_cast<unsigned long long>(id), rank_, e.end * 1e6);
      ++id;
    } else {
      std::fprintf(f, ",\n{\"ph\":\"X\",\"name\":\"%s\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"bytes\":%llu}}",
                   e.name, rank_, e.track, e.start * 1e6, (e.end - e.start) * 1e6, static_cast<unsigned long long>(e.bytes));
    }
  }
  std::fprintf(f, "\n]}\n");
  if (std::fflush(f) != 0 || std::ferror(f)) {
    std::fclose(f);
    return PosixError("write trace", tmp, errno);
  }
  std::fclose(f);
  if (std::rename(tmp.c_str(), trace_path_.c_str()) != 0) return PosixError("rename trace", trace_path_, errno);
  return Status::Ok();
}

}  // namespace strata

// Counters, busy clocks, the trainer's spans and the Chrome trace writer.
#include "engine/stats/stats.h"

#include <fcntl.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdio>

#include "base/log.h"
#include "base/text.h"

namespace strata {

static const char* kTrackNames[] = {"disk", "copy", "cpu optimizer", "caller", "comm"};

StatsRecorder::StatsRecorder(int rank, std::string trace_path, size_t max_events)
    : rank_(rank), trace_path_(std::move(trace_path)), max_events_(std::max<size_t>(1, max_events)) {}

StatsRecorder::~StatsRecorder() {
  if (Status st = WriteTrace(); !st.ok()) STRATA_LOG_WARN("trace: not written at close: {}", st.message());
}

void StatsRecorder::Add(int track, const std::string& name, double start, double end, uint64_t bytes,
                        int64_t group) {
  auto it = name_ids_.find(name);
  if (it == name_ids_.end()) {
    // Past twice as many names as spans, half or more are held by no span
    // (a trainer's spans named by step, overwritten long ago): let them go
    // (at most once every max_events_ new names).
    if (names_.size() >= 2 * max_events_) {
      CompactNames();
    }
    it = name_ids_.emplace(name, static_cast<uint32_t>(names_.size())).first;
    names_.push_back(name);
  }
  const Event e{track, it->second, start, end, bytes, group};
  if (events_.size() < max_events_) {
    events_.push_back(e);
    return;
  }
  if (dropped_++ == 0)
    STRATA_LOG_WARN("trace: {} holds its most spans ({}); from now on each new one replaces the oldest "
                    "(their count is in its otherData.dropped_events)",
                    trace_path_, max_events_);
  events_[next_] = e;
  next_ = (next_ + 1) % max_events_;
}

void StatsRecorder::CompactNames() {
  std::vector<uint32_t> renumber(names_.size(), UINT32_MAX);
  std::vector<std::string> kept;
  for (Event& e : events_) {
    if (renumber[e.name] == UINT32_MAX) {
      renumber[e.name] = static_cast<uint32_t>(kept.size());
      kept.push_back(std::move(names_[e.name]));
    }
    e.name = renumber[e.name];
  }
  names_ = std::move(kept);
  name_ids_.clear();
  for (uint32_t i = 0; i < names_.size(); ++i) name_ids_.emplace(names_[i], i);
}

StatsRecorder::TraceHeld StatsRecorder::Held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {events_.size(), names_.size(), dropped_};
}

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
  Add(static_cast<int>(r), name, start_s, end_s, bytes, -1);
}

void StatsRecorder::GroupSpan(Resource r, const char* name, int group, double start_s, double end_s) {
  if (trace_path_.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  Add(static_cast<int>(r), name, start_s, end_s, 0, group);
}

int StatsRecorder::TrackOfThisThread() {
  auto [it, added] =
      thread_tracks_.emplace(std::this_thread::get_id(), static_cast<int>(open_stacks_.size()));
  if (added) open_stacks_.emplace_back();
  return it->second;
}

Result<uint64_t> StatsRecorder::BeginUserSpan(const char* name) {
  if (name == nullptr) return InvalidError("span name is NULL");
  const std::string n = name;
  if (n.empty() || n.size() > kMaxSpanName)
    return InvalidError("span name '" + n.substr(0, 64) + "' has " + std::to_string(n.size()) +
                        " bytes; it must have 1.." + std::to_string(kMaxSpanName));
  if (!IsUtf8(n)) return InvalidError("span name '" + n.substr(0, 64) + "' is not UTF-8");
  const double now = Now();
  std::lock_guard<std::mutex> lock(mu_);
  if (open_.size() >= kMaxOpenSpans)
    return InvalidError("span '" + n + "': " + std::to_string(open_.size()) +
                        " spans are open already (spans must be ended)");
  const int track = TrackOfThisThread();
  const uint64_t token = next_token_++;
  open_.emplace(token, OpenSpan{n, track, now});
  open_stacks_[static_cast<size_t>(track)].push_back(token);
  return token;
}

Status StatsRecorder::EndUserSpan(uint64_t token) {
  const double now = Now();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = open_.find(token);
  if (it == open_.end())
    return InvalidError("span token " + std::to_string(token) +
                        " is not open (never begun, or already ended)");
  const OpenSpan& span = it->second;
  std::vector<uint64_t>& stack = open_stacks_[static_cast<size_t>(span.track)];
  if (stack.back() != token)  // a token on the stack is open: the innermost one is there too
    return InvalidError("span '" + span.name + "' (token " + std::to_string(token) + ") cannot end before '" +
                        open_.at(stack.back()).name + "' (token " + std::to_string(stack.back()) +
                        "), begun inside it on the same thread and still open: spans of one thread nest");
  stack.pop_back();
  if (!trace_path_.empty()) Add(kUserTrack0 + span.track, span.name, span.start, now, 0, -1);
  open_.erase(it);
  return Status::Ok();
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

void StatsRecorder::OnGather() {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.p_gathers;
}

void StatsRecorder::OnCollective(bool gather, uint64_t bytes, double wall_s, double cpu_s) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.comm_s += wall_s;
  stats_.comm_cpu_s += cpu_s;
  (gather ? stats_.gathered_bytes : stats_.reduced_bytes) += bytes;
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
  if (!trace_path_.empty()) Add(3, skipped ? "step (skipped)" : "step", step_start_, now, 0, -1);
}

void StatsRecorder::OnOverlap(Speculated outcome, int early_groups) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.early_updates += static_cast<uint64_t>(early_groups);
  if (outcome == Speculated::kNone) return;
  ++stats_.speculated_steps;
  if (outcome == Speculated::kCommitted) ++stats_.committed_steps;
  if (outcome == Speculated::kReplayed) ++stats_.replayed_steps;
  if (outcome == Speculated::kDiscarded) ++stats_.discarded_steps;
}

void StatsRecorder::OnSpeculationDeclined() {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.unspeculated_steps;
}

void StatsRecorder::OnReadAheadUsed(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.step_read_ahead_bytes += bytes;
}

void StatsRecorder::OnWriteBehind() {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.write_behind_steps;
}

void StatsRecorder::OnBehindWait(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.behind_wait_s += seconds;
}

void StatsRecorder::SetExposed(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.exposed_step_s = seconds;
}

EngineStats StatsRecorder::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

// A name as a JSON string's contents (names are UTF-8: checked when begun).
static std::string JsonEscaped(const std::string& s) {
  std::string out;
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      out += b;
    } else {
      out += ch;
    }
  }
  return out;
}

// Seconds as the trace's microseconds, exact to the nanosecond: a span that
// lies inside another (in the recorder's clock) lies inside it in the file.
static long long Nanos(double s) { return std::max(0LL, std::llround(s * 1e9)); }
static std::string Micros(long long ns) {
  char b[32];
  std::snprintf(b, sizeof b, "%lld.%03lld", ns / 1000, ns % 1000);
  return b;
}

Status StatsRecorder::WriteTrace() const {
  if (trace_path_.empty()) return Status::Ok();
  std::lock_guard<std::mutex> write_lock(write_mu_);
  // A copy, so that spans keep being recorded (I/O threads among others)
  // while the file is written. Open spans go in as ending now, unfinished.
  std::vector<Event> events;
  std::vector<std::string> names;
  size_t first_open = 0;  // events[first_open..] are the open spans
  size_t tracks = 0;
  uint64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Taken under the lock: every span recorded or opened before it started
    // and ended by then, so open spans cut here still hold their children.
    const double now = Now();
    // Oldest first: once the ring is full, from next_ round to it.
    events.reserve(events_.size() + open_.size());
    events.insert(events.end(), events_.begin() + static_cast<std::ptrdiff_t>(next_), events_.end());
    events.insert(events.end(), events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(next_));
    first_open = events.size();
    names = names_;
    for (const auto& stack : open_stacks_)
      for (uint64_t token : stack) {
        const OpenSpan& o = open_.at(token);
        names.push_back(o.name);  // the copy's own id for it
        events.push_back(
            {kUserTrack0 + o.track, static_cast<uint32_t>(names.size() - 1), o.start, now, 0, -1});
      }
    tracks = open_stacks_.size();
    dropped = dropped_;
  }
  // The temporary is made new: a file left at its name goes first, and a
  // link put there since is never written through (O_EXCL|O_NOFOLLOW).
  const std::string tmp = trace_path_ + ".tmp";
  if (::unlink(tmp.c_str()) != 0 && errno != ENOENT) return PosixError("remove the old trace", tmp, errno);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);  // (less the umask)
  if (fd < 0) return PosixError("open trace", tmp, errno);
  std::FILE* f = ::fdopen(fd, "w");
  if (!f) {
    const int err = errno;
    ::close(fd);
    return PosixError("open trace", tmp, err);
  }
  std::fprintf(
      f,
      "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"rank\":%d,\"dropped_events\":%llu},\"traceEvents\":[\n",
      rank_, static_cast<unsigned long long>(dropped));
  std::fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}", rank_, rank_);
  for (size_t t = 0; t < kUserTrack0 + tracks; ++t)
    std::fprintf(
        f, ",\n{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%zu,\"args\":{\"name\":\"%s%s\"}}",
        rank_, t, t < kUserTrack0 ? kTrackNames[t] : "trainer thread ",
        t < kUserTrack0 ? "" : std::to_string(t - kUserTrack0).c_str());
  uint64_t id = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    const Event& e = events[i];
    const std::string name = JsonEscaped(names[e.name]);
    const long long start = Nanos(e.start), end = std::max(start, Nanos(e.end));
    if (e.track == 0) {  // concurrent I/O: async begin/end pairs
      std::fprintf(f,
                   ",\n{\"ph\":\"b\",\"cat\":\"io\",\"name\":\"%s\",\"id\":%llu,\"pid\":%d,\"tid\":0,\"ts\":%"
                   "s,\"args\":{\"bytes\":%llu}}",
                   name.c_str(), static_cast<unsigned long long>(id), rank_, Micros(start).c_str(),
                   static_cast<unsigned long long>(e.bytes));
      std::fprintf(
          f, ",\n{\"ph\":\"e\",\"cat\":\"io\",\"name\":\"%s\",\"id\":%llu,\"pid\":%d,\"tid\":0,\"ts\":%s}",
          name.c_str(), static_cast<unsigned long long>(id), rank_, Micros(end).c_str());
      ++id;
      continue;
    }
    std::string args;
    if (e.track == 1 || e.track == 2) args = "\"bytes\":" + std::to_string(e.bytes);
    if (e.group >= 0) args = "\"group\":" + std::to_string(e.group);
    if (i >= first_open) args = "\"unfinished\":true";
    std::fprintf(
        f, ",\n{\"ph\":\"X\",\"name\":\"%s\",\"pid\":%d,\"tid\":%d,\"ts\":%s,\"dur\":%s,\"args\":{%s}}",
        name.c_str(), rank_, e.track, Micros(start).c_str(), Micros(end - start).c_str(), args.c_str());
  }
  std::fprintf(f, "\n]}\n");
  const bool written = std::fflush(f) == 0 && !std::ferror(f);
  const int write_errno = errno;
  if (std::fclose(f) != 0 || !written) {
    ::unlink(tmp.c_str());
    return PosixError("write trace", tmp, written ? errno : write_errno);
  }
  if (std::rename(tmp.c_str(), trace_path_.c_str()) != 0) return PosixError("rename trace", trace_path_, errno);
  return Status::Ok();
}

}  // namespace strata

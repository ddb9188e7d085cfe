// Starts the ranks (fork/execvpe), forwards their output through pipes with a
// rank prefix (one poll loop), reaps them and stops the rest on a failure.
#include "tools/launch/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <thread>

extern char** environ;

namespace strata::launch {
namespace {

using Clock = std::chrono::steady_clock;

int g_signal_pipe[2] = {-1, -1};  // SIGINT/SIGTERM/SIGHUP -> the poll loop

void OnSignal(int sig) {
  unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &b, 1);
}

void WriteAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our own output is gone: keep supervising regardless
    off += static_cast<size_t>(n);
  }
}

void Say(const std::string& msg) { WriteAll(2, "[strata-launch] " + msg + "\n"); }

// One of a rank's output streams: its pipe and the unfinished last line
// (never more than kMaxPartial: Drain).
constexpr size_t kMaxPartial = 64 * 1024;
struct Stream {
  int fd = -1;  // read end; -1 once closed
  int out = 1;  // where its lines go: 1 or 2
  std::string partial;
};

struct Rank {
  int rank = 0;   // global: node_rank * nproc + local
  int local = 0;  // index on this node
  pid_t pid = -1;           // also its process group's id
  bool running = false;     // the rank's own process (the group's leader) not yet reaped
  bool group_gone = false;  // no process of its group is left (kill says ESRCH)
  Stream streams[2];
};

// `local` is the rank's index on this node; its global rank is node-major.
std::vector<std::string> RankEnv(const LaunchSpec& spec, int local) {
  const int rank = spec.node_rank * spec.nproc + local;
  std::map<std::string, std::string> set = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(spec.nnodes * spec.nproc)},
      {"LOCAL_RANK", std::to_string(local)},
      {"LOCAL_WORLD_SIZE", std::to_string(spec.nproc)},
      {"GROUP_RANK", std::to_string(spec.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(spec.nnodes)},
      {"MASTER_ADDR", spec.master_addr},
      {"MASTER_PORT", std::to_string(spec.master_port)},
  };
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e, key = kv.substr(0, kv.find('='));
    // Our variables replace inherited ones; torchrun's agent-store flag
    // would move the store port, and there is no agent here. A NODE_RANK
    // inherited from a job script would contradict GROUP_RANK if stale.
    if (!set.count(key) && key != "TORCHELASTIC_USE_AGENT_STORE" && key != "NODE_RANK") env.push_back(kv);
  }
  for (const auto& [k, v] : set) env.push_back(k + "=" + v);
  return env;
}

std::vector<char*> CStrings(std::vector<std::string>& v) {
  std::vector<char*> out;
  for (auto& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// fork + execvpe; the child's stdout/stderr go to two pipes.
bool Spawn(const LaunchSpec& spec, Rank* r) {
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) return false;
  std::vector<std::string> env = RankEnv(spec, r->local), args = spec.argv;
  std::vector<char*> envp = CStrings(env), argv = CStrings(args);
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    setpgid(0, 0);                        // a group of its own: we stop it and its children
    prctl(PR_SET_PDEATHSIG, SIGKILL);     // and it dies with the launcher
    if (getppid() != parent) _exit(127);  // the launcher died before prctl
    signal(SIGPIPE, SIG_DFL);
    dup2(out[1], 1);
    dup2(err[1], 2);
    execvpe(argv[0], argv.data(), envp.data());
    std::string msg = "cannot run '" + spec.argv[0] + "': " + std::strerror(errno) + "\n";
    [[maybe_unused]] ssize_t n = write(2, msg.data(), msg.size());
    _exit(127);
  }
  setpgid(pid, pid);  // also here, so that a kill before the child ran still finds the group
  close(out[1]);
  close(err[1]);
  r->pid = pid;
  r->running = true;
  r->streams[0] = {out[0], 1, {}};
  r->streams[1] = {err[0], 2, {}};
  return true;
}

// Reads what is there; forwards complete lines (and the rest at EOF). A
// line ends at '\n' or '\r' (a progress bar redraws its line with '\r' and
// writes no newline until it closes: it was held, unseen, for the whole run,
// and rescanned at every read); a line longer than kMaxPartial goes on in
// pieces of that size, each with the prefix.
void Drain(int rank, Stream* s) {
  char buf[65536];
  ssize_t n = read(s->fd, buf, sizeof buf);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  const size_t old = s->partial.size();  // (no line end before it: only the new bytes are searched)
  if (n > 0) s->partial.append(buf, static_cast<size_t>(n));
  const std::string prefix = "[rank " + std::to_string(rank) + "] ";
  std::string lines;
  size_t start = 0, nl = old;
  while ((nl = s->partial.find_first_of("\n\r", nl)) != std::string::npos) {
    lines += prefix + s->partial.substr(start, nl - start + 1);
    start = ++nl;
  }
  while (s->partial.size() - start >= kMaxPartial) {
    lines += prefix + s->partial.substr(start, kMaxPartial) + "\n";
    start += kMaxPartial;
  }
  s->partial.erase(0, start);
  if (n <= 0) {  // EOF or error: the last line without its newline
    if (!s->partial.empty()) lines += prefix + s->partial + "\n";
    s->partial.clear();
    close(s->fd);
    s->fd = -1;
  }
  WriteAll(s->out, lines);
}

int ExitCodeOf(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string Describe(int status) {
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + strsignal(WTERMSIG(status));
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

class Supervisor {
 public:
  explicit Supervisor(const LaunchSpec& spec) : spec_(spec), ranks_(spec.nproc) {}

  int Run() {
    for (int i = 0; i < spec_.nproc; ++i) {
      ranks_[i].local = i;
      ranks_[i].rank = spec_.node_rank * spec_.nproc + i;
      if (!Spawn(spec_, &ranks_[i])) {
        Say("cannot start rank " + std::to_string(i) + ": " + std::strerror(errno));
        Stop(1);
        break;
      }
    }
    while (Busy()) Step();
    if (stop_at_) KillLeftovers();
    return code_;
  }

 private:
  bool Busy() {
    for (auto& r : ranks_)
      if (r.running) return true;
    // Every rank has exited: forward what is left, but a grandchild that
    // keeps a pipe open must not keep us here for more than a second.
    if (!all_exited_at_) all_exited_at_ = Clock::now();
    if (Clock::now() - *all_exited_at_ > std::chrono::seconds(1)) return false;
    for (auto& r : ranks_)
      for (auto& s : r.streams)
        if (s.fd >= 0) return true;
    return false;
  }

  void Step() {
    std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}};
    std::vector<std::pair<int, Stream*>> who;
    for (auto& r : ranks_)
      for (auto& s : r.streams)
        if (s.fd >= 0) {
          fds.push_back({s.fd, POLLIN, 0});
          who.push_back({r.rank, &s});
        }
    if (poll(fds.data(), fds.size(), 100) > 0) {
      if (fds[0].revents & POLLIN) {
        unsigned char sig = 0;
        if (read(g_signal_pipe[0], &sig, 1) == 1) {
          Say(std::string("got ") + strsignal(sig) + "; stopping every rank");
          Stop(128 + sig);
        }
      }
      for (size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents) Drain(who[i - 1].first, who[i - 1].second);
    }
    Reap();
    if (stop_at_ && !killed_ && Clock::now() - *stop_at_ > std::chrono::duration<double>(spec_.grace_s)) {
      Signal(SIGKILL);
      killed_ = true;
    }
  }

  // Ranks found failed in one pass died within one poll of each other. The
  // cause is most likely one killed by a signal: the others usually exit with
  // an error because a peer closed its connections (and rank order says
  // nothing about who went first).
  void Reap() {
    std::vector<std::pair<int, int>> failed;  // rank, wait status
    for (auto& r : ranks_) {
      int status = 0;
      if (!r.running || waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
      r.running = false;
      if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) failed.push_back({r.rank, status});
    }
    if (failed.empty() || stop_at_) return;
    auto cause = std::find_if(failed.begin(), failed.end(), [](const auto& f) { return WIFSIGNALED(f.second); });
    if (cause == failed.end()) cause = failed.begin();
    std::string also;
    for (const auto& f : failed)
      if (&f != &*cause) also += (also.empty() ? " (at the same time rank " : ", rank ") + std::to_string(f.first) +
                                 " " + Describe(f.second);
    if (!also.empty()) also += ")";
    Say("rank " + std::to_string(cause->first) + " " + Describe(cause->second) + also + "; stopping the other ranks");
    Stop(ExitCodeOf(cause->second));
  }

  void Stop(int code) {
    if (stop_at_) return;
    code_ = code;
    stop_at_ = Clock::now();
    Signal(SIGTERM);
  }

  // Every process of each rank's group, its leader reaped or not (a shell
  // wrapper killed while its python child lives on), until the group is gone.
  void Signal(int sig) {
    for (auto& r : ranks_)
      if (r.pid > 0 && !r.group_gone && kill(-r.pid, sig) != 0 && errno == ESRCH) r.group_gone = true;
  }

  // Stopping: what is left of the ranks' groups once their leaders are gone
  // gets the rest of the grace after SIGTERM, then SIGKILL, so that nothing
  // outlives the launcher.
  void KillLeftovers() {
    auto alive = [this] {
      Signal(0);
      return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.pid > 0 && !r.group_gone; });
    };
    while (!killed_ && alive() && Clock::now() - *stop_at_ < std::chrono::duration<double>(spec_.grace_s))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (alive()) {
      Signal(SIGKILL);
      while (alive() && Clock::now() - *stop_at_ < std::chrono::duration<double>(spec_.grace_s + 5))
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  const LaunchSpec& spec_;
  std::vector<Rank> ranks_;
  int code_ = 0;
  std::optional<Clock::time_point> stop_at_;        // when the first failure stopped everyone
  std::optional<Clock::time_point> all_exited_at_;  // when the last rank exited
  bool killed_ = false;
};

void InstallSignals() {
  if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return;
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a closed stdout must not kill the supervisor
}

}  // namespace

int RunRanks(const LaunchSpec& spec) {
  InstallSignals();
  return Supervisor(spec).Run();
}

}  // namespace strata::launch

// ShmChannel (shm_channel.h): the segment, its rounds and its waits.
#include "io/net/shm_channel.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "base/log.h"

namespace strata::net {

namespace {

constexpr uint64_t kMagic = 0x5354524154415348ull;  // "STRATASH"
constexpr uint64_t kPage = 4096;

struct Header {
  uint64_t magic;
  uint64_t world;
  uint64_t slot_bytes;
};

// Round counters compare modulo 2^32.
bool Reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

uint64_t SegmentBytes(int world, uint64_t slot_bytes) {
  return kPage + kPage + uint64_t(world) * 2 * slot_bytes;  // header, controls, slots
}

std::string ErrnoText(int e) { return std::strerror(e); }

// A child of fork() closes its copies of the channels' descriptors: the
// lock that says a rank lives belongs to the open file description, which
// a child (a DataLoader worker) would otherwise keep open, and with it the
// lock, after the rank itself died. Lock-free: the child of a fork must not
// take a lock another thread may have held.
constexpr int kMaxFds = 64;
std::atomic<int> g_fds[kMaxFds];

void CloseInChild() {
  for (auto& f : g_fds)
    if (int fd = f.load(std::memory_order_relaxed); fd >= 0) close(fd);
}

void RegisterFd(int fd) {
  static const bool registered = [] {
    for (auto& f : g_fds) f.store(-1);
    pthread_atfork(nullptr, nullptr, CloseInChild);
    return true;
  }();
  (void)registered;
  for (auto& f : g_fds) {
    int none = -1;
    if (f.compare_exchange_strong(none, fd)) return;
  }
  // More channels than slots: a child keeps this one's lock (a peer's death
  // is then found at the deadline, not at once).
}

void UnregisterFd(int fd) {
  for (auto& f : g_fds) {
    int mine = fd;
    if (f.compare_exchange_strong(mine, -1)) return;
  }
}

}  // namespace

// One rank's counters, each on a cache line of its own.
struct ShmChannel::Control {
  alignas(64) std::atomic<uint32_t> arrived;
  alignas(64) std::atomic<uint32_t> consumed;
};
static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free);

ShmChannel::ShmChannel(int fd, void* base, uint64_t size, int rank, int world, uint64_t slot_bytes, std::string name)
    : fd_(fd), base_(base), size_(size), rank_(rank), world_(world), slot_bytes_(slot_bytes), name_(std::move(name)) {
  RegisterFd(fd_);
  // Nor does a child map the segment. Should this fail, a child maps it and
  // changes nothing: it never reads or writes it, and the lock goes with
  // the descriptor, not the mapping.
  if (madvise(base_, size_, MADV_DONTFORK) != 0)
    STRATA_LOG_DEBUG("shared memory: madvise(MADV_DONTFORK): {}", ErrnoText(errno));
}

ShmChannel::~ShmChannel() {
  UnregisterFd(fd_);
  munmap(base_, size_);
  close(fd_);  // releases this rank's lock
  if (rank_ == 0) Unlink();
}

void ShmChannel::Unlink() {
  if (name_.empty()) return;
  if (shm_unlink(name_.c_str()) != 0 && errno != ENOENT)
    STRATA_LOG_WARN("shared memory {}: cannot remove its name ({}); remove /dev/shm{} by hand", name_,
                    ErrnoText(errno), name_);
  name_.clear();
}

ShmChannel::Control& ShmChannel::ctl(int q) const {
  return reinterpret_cast<Control*>(static_cast<char*>(base_) + kPage)[q];
}

char* ShmChannel::slot(int q, uint32_t round) const {
  return static_cast<char*>(base_) + 2 * kPage + (uint64_t(q) * 2 + (round & 1)) * slot_bytes_;
}

// Maps the segment and takes this rank's lock (byte `rank` of the file).
static Result<void*> MapAndLock(int fd, uint64_t size, int rank, const std::string& name) {
  flock l{};
  l.l_type = F_WRLCK;
  l.l_whence = SEEK_SET;
  l.l_start = rank;
  l.l_len = 1;
  if (fcntl(fd, F_OFD_SETLK, &l) != 0)
    return CommError("shared memory " + name + ": rank " + std::to_string(rank) + "'s lock: " + ErrnoText(errno));
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return CommError("shared memory " + name + ": mmap of " + std::to_string(size) +
                                           " bytes: " + ErrnoText(errno));
  return base;
}

int ShmChannel::RemoveStaleSegments() {
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return 0;
  int removed = 0;
  while (const dirent* e = readdir(d)) {
    int pid = 0;
    unsigned a = 0, b = 0;
    char again[64];
    // Exactly this scheme's names ("strata-PID-" and 16 hex digits), nothing else.
    if (std::sscanf(e->d_name, "strata-%d-%8x%8x", &pid, &a, &b) != 3 || pid <= 0 || pid == getpid()) continue;
    std::snprintf(again, sizeof again, "strata-%d-%08x%08x", pid, a, b);
    if (std::strcmp(again, e->d_name) != 0) continue;
    struct stat st {};
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != geteuid()) continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;  // its creator lives (EPERM: it lives, as another user)
    if (shm_unlink((std::string("/") + e->d_name).c_str()) == 0) ++removed;
  }
  closedir(d);
  return removed;
}

Result<std::unique_ptr<ShmChannel>> ShmChannel::Create(int world, uint64_t slot_bytes, std::string* name) {
  if (world < 2 || slot_bytes < kPage || slot_bytes % 64 != 0 || slot_bytes / uint64_t(world) < 64)
    return InvalidError("shared memory: world " + std::to_string(world) + ", slots of " + std::to_string(slot_bytes) +
                        " bytes (want 2+ ranks, slots of 4096+ bytes, a multiple of 64, 64+ bytes a rank)");
  const uint64_t size = SegmentBytes(world, slot_bytes);
  if (const int stale = RemoveStaleSegments())
    STRATA_LOG_INFO("shared memory: removed {} segment(s) in /dev/shm left by Strata processes that are gone", stale);
  std::random_device rd;
  char buf[64];
  std::snprintf(buf, sizeof buf, "/strata-%d-%08x%08x", static_cast<int>(getpid()), rd(), rd());
  const std::string n = buf;
  const int fd = shm_open(n.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return CommError("shared memory " + n + ": shm_open: " + ErrnoText(errno));
  auto fail = [&](Status st) {
    close(fd);
    shm_unlink(n.c_str());
    return st;
  };
  if (ftruncate(fd, static_cast<off_t>(size)) != 0)
    return fail(CommError("shared memory " + n + ": ftruncate to " + std::to_string(size) + " bytes: " + ErrnoText(errno)));
  if (int e = posix_fallocate(fd, 0, static_cast<off_t>(size)); e != 0)
    return fail(CommError("shared memory " + n + ": reserving " + std::to_string(size) + " bytes: " + ErrnoText(e)));
  auto base = MapAndLock(fd, size, 0, n);
  if (!base.ok()) return fail(base.status());
  auto* h = static_cast<Header*>(*base);
  h->world = static_cast<uint64_t>(world);
  h->slot_bytes = slot_bytes;
  for (int q = 0; q < world; ++q) {
    auto* c = new (static_cast<char*>(*base) + kPage + sizeof(Control) * q) Control;
    c->arrived.store(0, std::memory_order_relaxed);
    c->consumed.store(0, std::memory_order_relaxed);
  }
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;  // last: a header with it is whole (the openers come after the store says the name)
  *name = n;
  return std::unique_ptr<ShmChannel>(new ShmChannel(fd, *base, size, 0, world, slot_bytes, n));
}

Result<std::unique_ptr<ShmChannel>> ShmChannel::Open(const std::string& name, int rank, int world,
                                                     uint64_t slot_bytes) {
  if (world < 2 || slot_bytes < kPage || slot_bytes % 64 != 0 || slot_bytes / uint64_t(world) < 64)
    return InvalidError("shared memory: slots of " + std::to_string(slot_bytes) + " bytes for " +
                        std::to_string(world) + " ranks");
  if (rank < 1 || rank >= world) return InvalidError("shared memory: rank " + std::to_string(rank) + " of " +
                                                     std::to_string(world) + " opens (rank 0 creates)");
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return CommError("shared memory " + name + ": shm_open: " + ErrnoText(errno) +
                               " (rank 0 is on another host, or /dev/shm is not shared)");
  const uint64_t size = SegmentBytes(world, slot_bytes);
  struct stat s {};
  if (fstat(fd, &s) != 0 || static_cast<uint64_t>(s.st_size) != size) {
    close(fd);
    return CommError("shared memory " + name + ": " + std::to_string(s.st_size) + " bytes, want " +
                     std::to_string(size));
  }
  // Rank 0 of this job is this user and makes its segment 0600: one of
  // another user's, or that others may open (a name someone put in the
  // store to read or change the gradients), is not this job's.
  if (s.st_uid != geteuid() || (s.st_mode & 077) != 0) {
    close(fd);
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(s.st_mode & 07777));
    return CommError("shared memory " + name + ": owned by uid " + std::to_string(s.st_uid) + " with mode " + mode +
                     "; rank 0 of this job makes its segment as uid " + std::to_string(geteuid()) +
                     ", mode 0600: not this job's");
  }
  auto base = MapAndLock(fd, size, rank, name);
  if (!base.ok()) {
    close(fd);
    return base.status();
  }
  const auto* h = static_cast<const Header*>(*base);
  if (h->magic != kMagic || h->world != static_cast<uint64_t>(world) || h->slot_bytes != slot_bytes) {
    munmap(*base, size);
    close(fd);
    return CommError("shared memory " + name + ": its header is not this job's (" + std::to_string(world) +
                     " ranks, slots of " + std::to_string(slot_bytes) + " bytes)");
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  return std::unique_ptr<ShmChannel>(new ShmChannel(fd, *base, size, rank, world, slot_bytes, ""));
}

bool ShmChannel::Alive(int q) const {
  flock l{};
  l.l_type = F_WRLCK;
  l.l_whence = SEEK_SET;
  l.l_start = q;
  l.l_len = 1;
  if (fcntl(fd_, F_OFD_GETLK, &l) != 0) return true;  // cannot tell: the deadline decides
  return l.l_type != F_UNLCK;
}

Status ShmChannel::WaitFor(int q, bool arrived, uint32_t target, Deadline deadline, const char* what) const {
  std::atomic<uint32_t>& word = arrived ? ctl(q).arrived : ctl(q).consumed;
  for (int spin = 0; spin < 4000; ++spin) {
    if (Reached(word.load(std::memory_order_acquire), target)) return Status::Ok();
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  for (;;) {
    const uint32_t v = word.load(std::memory_order_acquire);
    if (Reached(v, target)) return Status::Ok();
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline)
      return TimeoutError("timed out in shared memory waiting for rank " + std::to_string(q) + " to " + what +
                          " round " + std::to_string(target));
    if (!Alive(q))
      return CommError("rank " + std::to_string(q) + " closed its shared memory (it exited) while rank " +
                       std::to_string(rank_) + " waited for it to " + what + " round " + std::to_string(target));
    // Sleep until the word changes, a wake, or 20 ms (then look at the
    // deadline and the peer's lock again).
    const auto left = std::min<std::chrono::nanoseconds>(deadline - now, std::chrono::milliseconds(20));
    timespec ts{static_cast<time_t>(left.count() / 1000000000), static_cast<long>(left.count() % 1000000000)};
    // Its result is not needed: a wake, a changed word (EAGAIN), a signal
    // (EINTR) or the 20 ms (ETIMEDOUT) all come back to the checks above.
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, v, &ts, nullptr, 0);
  }
}

void ShmChannel::Publish(bool arrived, uint32_t round) {
  std::atomic<uint32_t>& word = arrived ? ctl(rank_).arrived : ctl(rank_).consumed;
  word.store(round, std::memory_order_release);
  // A wake cannot fail on a mapped, aligned word; a waiter that missed it
  // would still see the word within its 20 ms.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

Result<char*> ShmChannel::BeginRound(Deadline deadline) {
  const uint32_t k = ++round_;
  for (int q = 0; q < world_; ++q)
    if (q != rank_) STRATA_RETURN_IF_ERROR(WaitFor(q, /*arrived=*/false, k - 2, deadline, "finish reading"));
  return slot(rank_, k);
}

Status ShmChannel::AllGather(const void* in, void* out, size_t bytes, Deadline deadline) {
  auto* o = static_cast<char*>(out);
  const auto* src = static_cast<const char*>(in);
  const uint64_t me = static_cast<uint64_t>(rank_) * bytes;
  if (src != o + me) std::memmove(o + me, src, bytes);
  for (size_t off = 0; off < bytes; off += slot_bytes_) {
    const size_t c = std::min<size_t>(slot_bytes_, bytes - off);
    STRATA_ASSIGN_OR_RETURN(char* mine, BeginRound(deadline));
    std::memcpy(mine, o + me + off, c);
    Publish(/*arrived=*/true, round_);
    for (int q = 0; q < world_; ++q) {
      if (q == rank_) continue;
      STRATA_RETURN_IF_ERROR(WaitFor(q, /*arrived=*/true, round_, deadline, "write"));
      std::memcpy(o + static_cast<uint64_t>(q) * bytes + off, slot(q, round_), c);
    }
    Publish(/*arrived=*/false, round_);
  }
  return Status::Ok();
}

Status ShmChannel::ReduceScatter(const float* in, float* out, size_t n, Deadline deadline) {
  FloatPieces whole;
  whole.Add(0, static_cast<uint64_t>(world_) * n, in);
  return ReduceScatter(whole, n, 0, out, n, deadline);
}

Status ShmChannel::ReduceScatter(const FloatPieces& in, uint64_t stride, uint64_t first, float* out, size_t n,
                                 Deadline deadline) {
  const int w = world_, r = rank_;
  // Each slot holds one part per destination rank, 64-byte aligned.
  const size_t cap = (slot_bytes_ / static_cast<uint64_t>(w)) / sizeof(float) / 16 * 16;
  auto at = [&](int q, size_t off) { return static_cast<uint64_t>(q) * stride + first + off; };
  for (size_t off = 0; off < n; off += cap) {
    const size_t c = std::min(cap, n - off);
    STRATA_ASSIGN_OR_RETURN(char* mine_slot, BeginRound(deadline));
    auto* mine = reinterpret_cast<float*>(mine_slot);
    for (int d = 0; d < w; ++d)
      if (d != r) in.Read(at(d, off), c, mine + static_cast<size_t>(d) * cap);
    Publish(/*arrived=*/true, round_);
    // x(j): the part of rank r+j (mod w); x(w) is this rank's own, read
    // where it lies when one piece holds it.
    float* dst = out + off;
    const float* own = in.Find(at(r, off), c);
    if (!own || (own == dst && w > 2)) {  // across pieces, or in place (added last, after dst is written)
      scratch_.resize(c);
      in.Read(at(r, off), c, scratch_.data());
      own = scratch_.data();
    }
    auto x = [&](int j) -> const float* {
      const int q = (r + j) % w;
      return q == r ? own : reinterpret_cast<const float*>(slot(q, round_)) + static_cast<size_t>(r) * cap;
    };
    for (int q = 0; q < w; ++q)
      if (q != r) STRATA_RETURN_IF_ERROR(WaitFor(q, /*arrived=*/true, round_, deadline, "write"));
    if (w == 2) {
      const float* a = x(1);
      for (size_t i = 0; i < c; ++i) dst[i] = a[i] + own[i];
    } else {
      const float *a = x(1), *b = x(2);
      for (size_t i = 0; i < c; ++i) dst[i] = a[i] + b[i];
      for (int j = 3; j <= w; ++j) {
        const float* y = x(j);
        for (size_t i = 0; i < c; ++i) dst[i] += y[i];
      }
    }
    Publish(/*arrived=*/false, round_);
  }
  return Status::Ok();
}

}  // namespace strata::net

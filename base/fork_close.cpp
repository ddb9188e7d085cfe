// The registry of descriptors closed in a child of fork (fork_close.h).
#include "base/fork_close.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <mutex>
#include <map>
#include <utility>

namespace strata {
namespace {

std::mutex g_mu;  // held across fork (prepare to after), so the map is whole in the child
// fd -> the file it named when registered (device, inode): a number whose
// file changed since (closed, and the number reused, without
// ForgetInForkChild) is left alone.
// (Never destroyed: a child may fork during static destruction.)
std::map<int, std::pair<dev_t, ino_t>>* g_fds = nullptr;

void Prepare() { g_mu.lock(); }
void InParent() { g_mu.unlock(); }
void InChild() {
  if (g_fds) {
    for (const auto& [fd, id] : *g_fds) {
      struct stat st {};
      if (::fstat(fd, &st) == 0 && st.st_dev == id.first && st.st_ino == id.second) ::close(fd);
    }
    // (Not cleared here: no allocator call in a fork handler. The child's
    // later registrations overwrite, and the file check covers the rest.)
  }
  g_mu.unlock();  // (locked by this thread in Prepare)
}

std::map<int, std::pair<dev_t, ino_t>>& Fds() {  // under g_mu
  if (!g_fds) {
    g_fds = new std::map<int, std::pair<dev_t, ino_t>>();
    ::pthread_atfork(Prepare, InParent, InChild);
  }
  return *g_fds;
}

}  // namespace

void CloseInForkChild(int fd) {
  if (fd < 0) return;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return;  // (not open: nothing to close)
  std::lock_guard<std::mutex> lock(g_mu);
  Fds()[fd] = {st.st_dev, st.st_ino};
}

void KeepFromForkAndExec(int fd) {
  if (fd < 0) return;
  const int flags = ::fcntl(fd, F_GETFD);
  if (flags >= 0) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
  CloseInForkChild(fd);
}

void ForgetInForkChild(int fd) {
  // Only its own entry: where the number was closed by another (a library
  // closing its socket on an error) and reused, the new file's stays.
  struct stat st {};
  const bool open = ::fstat(fd, &st) == 0;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_fds) return;
  auto it = g_fds->find(fd);
  if (it != g_fds->end() && (!open || (it->second.first == st.st_dev && it->second.second == st.st_ino)))
    g_fds->erase(it);
}

bool ClosedInForkChild(int fd) {
  // As the child's handler decides: only where the number names the file registered.
  struct stat st {};
  if (::fstat(fd, &st) != 0) return false;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_fds) return false;
  auto it = g_fds->find(fd);
  return it != g_fds->end() && it->second.first == st.st_dev && it->second.second == st.st_ino;
}

}  // namespace strata

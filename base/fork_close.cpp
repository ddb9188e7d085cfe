// The registry of descriptors closed in a child of fork (fork_close.h).
#include "base/fork_close.h"

#include <pthread.h>
#include <unistd.h>

#include <mutex>
#include <set>

namespace strata {
namespace {

std::mutex g_mu;  // held across fork (prepare to after), so the set is whole in the child
std::set<int>* g_fds = nullptr;  // (never destroyed: a child may fork during static destruction)

void Prepare() { g_mu.lock(); }
void InParent() { g_mu.unlock(); }
void InChild() {
  if (g_fds) {
    for (const int fd : *g_fds) ::close(fd);
    g_fds->clear();
  }
  g_mu.unlock();  // (locked by this thread in Prepare)
}

std::set<int>& Fds() {  // under g_mu
  if (!g_fds) {
    g_fds = new std::set<int>();
    ::pthread_atfork(Prepare, InParent, InChild);
  }
  return *g_fds;
}

}  // namespace

void CloseInForkChild(int fd) {
  if (fd < 0) return;
  std::lock_guard<std::mutex> lock(g_mu);
  Fds().insert(fd);
}

void ForgetInForkChild(int fd) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_fds) g_fds->erase(fd);
}

bool ClosedInForkChild(int fd) {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_fds && g_fds->count(fd) > 0;
}

}  // namespace strata

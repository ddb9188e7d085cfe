// Test helpers: run a function, or this test program's own test, in a forked
// child whose io_uring_setup fails with a chosen errno (a seccomp filter, as
// a container's profile or kernel.io_uring_disabled would), and hand back
// what it returned or printed.
#pragma once

#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <functional>
#include <string>

namespace strata::testing {

struct ChildResult {
  bool filtered = false;  // false: this machine allows no seccomp filter (nothing tested)
  bool exited = false;    // the child ran to its end (exit status 0)
  std::string out;        // what the function returned
};

// Makes io_uring_setup fail with `err` in this process and its children;
// false where the machine allows no seccomp filter.
inline bool DenyIoUring(int err) {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | static_cast<uint32_t>(err)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

// The parent's half: reads what the child at `pid` writes to `read_fd` until
// it closes, then waits for it (exit 3: no filter; 0: ran to its end).
inline ChildResult CollectChild(int read_fd, pid_t pid) {
  ChildResult r;
  char buf[4096];
  for (ssize_t n; (n = ::read(read_fd, buf, sizeof buf)) > 0;) r.out.append(buf, static_cast<size_t>(n));
  ::close(read_fd);
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return r;
  r.filtered = !(WIFEXITED(status) && WEXITSTATUS(status) == 3);
  r.exited = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!r.exited) r.out += "\n(the child failed: status " + std::to_string(status) + ")";
  return r;
}

// Set in a child of ExecWithoutIoUring: the test it runs does its part.
inline constexpr const char* kNoUringChildEnv = "STRATA_TEST_NO_URING_CHILD";

// Runs this test program again, only the test `gtest_filter`, with
// kNoUringChildEnv set, in a child whose io_uring_setup fails with `err`
// (a fresh process: no threads or pools of this one's). out: its stdout and
// stderr.
inline ChildResult ExecWithoutIoUring(int err, const std::string& gtest_filter) {
  ChildResult r;
  int fds[2];
  if (::pipe(fds) != 0) return r;
  const std::string arg = "--gtest_filter=" + gtest_filter;
  const pid_t pid = ::fork();
  if (pid < 0) return r;
  if (pid == 0) {
    ::close(fds[0]);
    if (::dup2(fds[1], 1) < 0 || ::dup2(fds[1], 2) < 0) ::_exit(4);
    if (!DenyIoUring(err)) ::_exit(3);
    ::setenv(kNoUringChildEnv, "1", 1);
    ::execl("/proc/self/exe", "/proc/self/exe", arg.c_str(), static_cast<char*>(nullptr));
    ::_exit(5);
  }
  ::close(fds[1]);
  return CollectChild(fds[0], pid);
}

// Runs `fn` in a child in which io_uring_setup fails with `err`. Keep `fn`
// to work of this process's own (no threads of the parent's are there).
inline ChildResult RunWithoutIoUring(int err, const std::function<std::string()>& fn) {
  ChildResult r;
  int fds[2];
  if (::pipe(fds) != 0) return r;
  const pid_t pid = ::fork();
  if (pid < 0) return r;
  if (pid == 0) {
    ::close(fds[0]);
    if (!DenyIoUring(err)) ::_exit(3);
    const std::string msg = fn();
    for (size_t done = 0; done < msg.size();) {
      const ssize_t n = ::write(fds[1], msg.data() + done, msg.size() - done);
      if (n <= 0) ::_exit(4);
      done += static_cast<size_t>(n);
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  return CollectChild(fds[0], pid);
}

}  // namespace strata::testing

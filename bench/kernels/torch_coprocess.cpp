// posix_spawn of the torch worker with a pipe each way.
#include "bench/kernels/torch_coprocess.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <vector>

extern char** environ;

namespace strata::bench {

TorchCoprocess::~TorchCoprocess() {
  if (to_) std::fclose(to_);  // EOF on stdin ends the worker's loop
  if (from_) std::fclose(from_);
  if (pid_ > 0) waitpid(pid_, nullptr, 0);
}

Status TorchCoprocess::Start(const std::string& python, const std::string& worker, size_t n,
                             int threads) {
  int in[2], out[2];
  if (pipe(in) != 0 || pipe(out) != 0) return PosixError("pipe", "torch worker", errno);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_addclose(&fa, in[1]);
  posix_spawn_file_actions_addclose(&fa, out[0]);
  const std::string ns = std::to_string(n), ts = std::to_string(threads);
  std::vector<char*> argv = {const_cast<char*>(python.c_str()), const_cast<char*>(worker.c_str()),
                             const_cast<char*>(ns.c_str()), const_cast<char*>(ts.c_str()), nullptr};
  const int rc = posix_spawn(&pid_, python.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(in[0]);
  close(out[1]);
  if (rc != 0) {
    close(in[1]);
    close(out[0]);
    pid_ = -1;
    return PosixError("posix_spawn", python, rc);
  }
  to_ = fdopen(in[1], "w");
  from_ = fdopen(out[0], "r");
  STRATA_ASSIGN_OR_RETURN(banner_, ReadLine());
  if (banner_.rfind("ready", 0) != 0) return InternalError("torch worker said: " + banner_);
  return Status::Ok();
}

Result<std::string> TorchCoprocess::ReadLine() {
  std::string line;
  for (int c = std::fgetc(from_); c != EOF && c != '\n'; c = std::fgetc(from_))
    line.push_back(static_cast<char>(c));
  if (line.empty() && std::feof(from_)) return InternalError("torch worker exited (no torch?)");
  return line;
}

Result<double> TorchCoprocess::TimeSteps(int steps) {
  std::fprintf(to_, "%d\n", steps);
  std::fflush(to_);
  STRATA_ASSIGN_OR_RETURN(const std::string line, ReadLine());
  return std::strtod(line.c_str(), nullptr);
}

}  // namespace strata::bench

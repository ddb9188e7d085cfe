// strata-launch --nproc N [--master-port P] -- CMD ARGS: starts N local
// ranks of CMD with torchrun's variables set (see supervisor.h).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "tools/launch/supervisor.h"

namespace {

// A port nobody listens on now (bind port 0 and read it back). Another
// process may take it before rank 0 does; good enough for one machine.
int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = -1;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  return port;
}

}  // namespace

int main(int argc, char** argv) {
  strata::launch::LaunchSpec spec;
  CLI::App app{
      "Starts N local ranks of a command with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,\n"
      "MASTER_ADDR and MASTER_PORT set; prefixes their output with [rank K]; if one rank\n"
      "fails, stops the others and exits with its code.\n"
      "Usage: strata-launch --nproc N [--master-port P] -- CMD ARGS"};
  app.add_option("--nproc,--nproc-per-node", spec.nproc, "number of ranks")
      ->required()
      ->check(CLI::Range(1, 4096));
  app.add_option("--master-addr", spec.master_addr, "address of rank 0")->capture_default_str();
  app.add_option("--master-port", spec.master_port, "rank 0's store port; 0 picks a free one")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--grace", spec.grace_s, "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("command", spec.argv, "the rank's command and its arguments (after --)")->required();
  CLI11_PARSE(app, argc, argv);
  if (spec.master_port == 0 && (spec.master_port = FreePort()) < 0) {
    std::perror("strata-launch: find a free port");
    return 1;
  }
  return strata::launch::RunRanks(spec);
}

// strata-launch --nproc N [--master-port P] -- CMD ARGS: starts N local
// ranks of CMD with torchrun's variables set (see supervisor.h). On many
// hosts, once per host: --nnodes H --node-rank K --master-addr HOST0
// --master-port P.
#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>

#include "io/net/free_port.h"
#include "tools/launch/supervisor.h"


int main(int argc, char** argv) {
  strata::launch::LaunchSpec spec;
  CLI::App app{
      "Starts N local ranks of a command with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,\n"
      "GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; prefixes their output with\n"
      "[rank K]; if one rank fails, stops the others and exits with its code.\n"
      "Usage: strata-launch --nproc N [--master-port P] -- CMD ARGS\n"
      "Many hosts, once on each: strata-launch --nnodes H --node-rank K --nproc N\n"
      "  --master-addr ADDR-OF-NODE-0 --master-port P -- CMD ARGS   (ranks K*N .. K*N+N-1 of H*N)"};
  app.add_option("--nproc,--nproc-per-node", spec.nproc, "number of ranks on this host")
      ->required()
      ->check(CLI::Range(1, 4096));
  app.add_option("--nnodes", spec.nnodes, "number of hosts, each running --nproc ranks")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  app.add_option("--node-rank,--node_rank", spec.node_rank, "this host's index in [0, nnodes); host 0 runs rank 0")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  CLI::Option* addr = app.add_option("--master-addr,--master_addr", spec.master_addr,
                                     "address of rank 0's host, as the other hosts reach it (needed with --nnodes "
                                     "above 1)")
                          ->capture_default_str();
  app.add_option("--master-port,--master_port", spec.master_port,
                 "rank 0's store port; 0 picks a free one (one host only)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--grace", spec.grace_s, "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("command", spec.argv, "the rank's command and its arguments (after --)")->required();
  CLI11_PARSE(app, argc, argv);
  if (spec.node_rank >= spec.nnodes) {
    std::fprintf(stderr, "strata-launch: --node-rank %d is not below --nnodes %d\n", spec.node_rank, spec.nnodes);
    return 2;
  }
  if (spec.nnodes > 1 && spec.master_port == 0) {
    std::fprintf(stderr,
                 "strata-launch: --master-port 0 (a free port) works on one host only: with --nnodes %d every "
                 "host must be given the same --master-port\n",
                 spec.nnodes);
    return 2;
  }
  if (spec.nnodes > 1 && addr->count() == 0) {
    std::fprintf(stderr,
                 "strata-launch: --nnodes %d needs --master-addr, rank 0's host as the others reach it (the "
                 "default, %s, is each host's own loopback)\n",
                 spec.nnodes, spec.master_addr.c_str());
    return 2;
  }
  if (static_cast<int64_t>(spec.nnodes) * spec.nproc > (int64_t{1} << 20)) {
    std::fprintf(stderr, "strata-launch: --nnodes %d x --nproc %d ranks is too many\n", spec.nnodes, spec.nproc);
    return 2;
  }
  if (spec.master_port == 0 && (spec.master_port = strata::net::FreeListenPort(/*pair=*/true)) < 0) {
    std::perror("strata-launch: find a free port");
    return 1;
  }
  return strata::launch::RunRanks(spec);
}

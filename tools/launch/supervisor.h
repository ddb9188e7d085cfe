// strata-launch's supervisor: starts the local ranks, forwards their output
// line by line with a "[rank K] " prefix, and stops everyone when one fails.
#pragma once

#include <string>
#include <vector>

namespace strata::launch {

struct LaunchSpec {
  int nproc = 1;       // ranks on this node
  int nnodes = 1;      // nodes, each running nproc ranks (one strata-launch per node)
  int node_rank = 0;   // this node's index in [0, nnodes)
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double grace_s = 5;             // SIGTERM -> SIGKILL
  std::vector<std::string> argv;  // the rank's command line; argv[0] is looked up in PATH
};

// Runs nproc copies of spec.argv with RANK (node_rank * nproc + local rank),
// WORLD_SIZE (nnodes * nproc), LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK
// (node_rank), GROUP_WORLD_SIZE (nnodes), MASTER_ADDR and MASTER_PORT set
// (torchrun's names; the output prefix is the global rank), each in a process group
// of its own (killed with the launcher via PR_SET_PDEATHSIG). Returns 0 when
// every rank exits 0; else the exit code of the first rank that failed
// (128 + signal when a signal killed it), after stopping the others with
// SIGTERM and, grace_s later, SIGKILL. SIGINT/SIGTERM to the launcher stop
// every rank and return 128 + that signal.
int RunRanks(const LaunchSpec& spec);

}  // namespace strata::launch

// Which rank am I? Reads the variables a launcher sets: torchrun's, else
// OpenMPI's, else Slurm's; none of them means one rank. A partial or
// inconsistent set is an error that names the variables.
#pragma once

#include <functional>
#include <string>

#include "base/status.h"

namespace strata::net {

struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";  // where rank 0 serves the store
  int master_port = 29500;                // MASTER_PORT as the launcher gave it
  // The port the rendezvous store listens on. Usually master_port; under
  // torchrun (TORCHELASTIC_USE_AGENT_STORE=True) torchrun's own TCPStore
  // holds master_port, so ours takes master_port + 1. STRATA_STORE_PORT
  // overrides both.
  int store_port = 29500;
  std::string source = "none";  // "torchrun", "openmpi", "slurm" or "none"
  // The job this rank is of, as the environment names it ("" where it does
  // not): STRATA_JOB_ID, Slurm's SLURM_JOB_ID (and step), Open MPI's job id,
  // torchrun's TORCHELASTIC_RUN_ID (its --rdzv-id; not its default "none").
  // Ranks of two jobs given the same store address meet at one store: the
  // store tells them apart by it (RendezvousStore::Open).
  std::string job;

  std::string ToString() const;  // "rank 1 of 4 (local 1 of 4) via torchrun, store 127.0.0.1:29500"
};

using GetEnvFn = std::function<const char*(const char*)>;

// Reads the launch variables through `getenv` (injectable for tests).
//   torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
//             MASTER_PORT (the last two may be absent when WORLD_SIZE is 1).
//             Many nodes: GROUP_RANK (torchrun's) or NODE_RANK, the node's
//             index; with GROUP_WORLD_SIZE * LOCAL_WORLD_SIZE == WORLD_SIZE
//             (every node runs LOCAL_WORLD_SIZE ranks; without
//             GROUP_WORLD_SIZE, LOCAL_WORLD_SIZE must divide WORLD_SIZE)
//             RANK must be node * LOCAL_WORLD_SIZE + LOCAL_RANK, and may be
//             left out. GROUP_RANK and NODE_RANK both set must agree.
//   OpenMPI:  OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
//             MASTER_ADDR (needed unless every rank is local), MASTER_PORT
//             (default 29500).
//   Slurm:    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is
//             MASTER_ADDR, else the first host of SLURM_STEP_NODELIST (else
//             SLURM_JOB_NODELIST), which must then be given; SLURM_NODEID,
//             when set, in [0, SLURM_NNODES), and 0 on rank 0 unless
//             MASTER_ADDR names its host; local world from
//             SLURM_NTASKS_PER_NODE, else the leading count of
//             SLURM_TASKS_PER_NODE; MASTER_PORT default 29500.
//             (SLURM_LAUNCH_NODE_IPADDR is srun's host, rank 0's only when
//             srun runs on the first node, as in an sbatch script: it is not
//             used unless a script exports it as MASTER_ADDR.)
// A family is chosen when any of its rank variables is set (torchrun first:
// torchrun started by srun or mpirun sees their variables too); then all of
// its required variables must be present, be integers, and agree
// (0 <= rank < world, 0 <= local_rank < local_world <= world). Errors are
// kInvalid and name the variables.
Result<RankInfo> RankInfoFromEnv(const GetEnvFn& getenv = ::getenv);

// The GPU of the process with local rank `local_rank` among the
// `device_count` GPUs it sees: one process per GPU, local rank i drives GPU i.
// -1 when device_count is 0 (no GPU). A local rank past the last GPU is
// kInvalid naming both numbers and the variable that gave the local rank
// (from `source`, RankInfo::source), never wrapped around onto a GPU that
// another process drives.
Result<int> DeviceForLocalRank(int local_rank, int device_count, const std::string& source = "none");

// First host of a Slurm hostlist: "gpu[03-05,09],cpu1" -> "gpu03".
Result<std::string> FirstSlurmHost(const std::string& nodelist);

}  // namespace strata::net

// Reads torchrun's, OpenMPI's or Slurm's launch variables into a RankInfo.
#include "io/net/launch_env.h"

#include <charconv>
#include <vector>

namespace strata::net {
namespace {

// The variables of one launcher family, by role.
struct Family {
  const char* source;
  const char* rank;
  const char* world;
  const char* local_rank;
  const char* local_world;  // nullptr: derived elsewhere
};

constexpr Family kTorchrun{"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
constexpr Family kOpenMpi{"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                          "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
constexpr Family kSlurm{"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr};

class Env {
 public:
  explicit Env(const GetEnvFn& getenv) : getenv_(getenv) {}
  bool Has(const char* name) const {
    const char* v = getenv_(name);
    return v != nullptr && *v != '\0';
  }
  std::string Get(const char* name) const { return Has(name) ? getenv_(name) : ""; }
  Result<int> Int(const char* name) const {
    std::string v = Get(name);
    int out = 0;
    auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    if (ec != std::errc() || end != v.data() + v.size())
      return InvalidError(std::string(name) + "='" + v + "' is not an integer");
    return out;
  }

 private:
  const GetEnvFn& getenv_;
};

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// Every name present, or an error listing which are set and which are missing.
Status RequireAll(const Env& env, const char* source, const std::vector<const char*>& names) {
  std::vector<std::string> set, missing;
  for (const char* n : names) (env.Has(n) ? set : missing).push_back(n);
  if (missing.empty()) return Status::Ok();
  return InvalidError(std::string(source) + " launch variables incomplete: " + Join(set) + " set but " +
                      Join(missing) + " missing");
}

Status CheckRanks(const RankInfo& r, const Family& f) {
  std::string lw = f.local_world ? f.local_world : "local world size";
  auto bad = [&](const std::string& what) {
    return InvalidError(std::string(f.source) + " launch variables inconsistent: " + what + " (" +
                        r.ToString() + ")");
  };
  if (r.world_size < 1) return bad(std::string(f.world) + " must be >= 1");
  if (r.rank < 0 || r.rank >= r.world_size)
    return bad(std::string(f.rank) + " must be in [0, " + f.world + ")");
  if (r.local_world_size < 1 || r.local_world_size > r.world_size)
    return bad(lw + " must be in [1, " + f.world + "]");
  if (r.local_rank < 0 || r.local_rank >= r.local_world_size)
    return bad(std::string(f.local_rank) + " must be in [0, " + lw + ")");
  return Status::Ok();
}

Result<int> Port(const Env& env, const char* name, int fallback) {
  if (!env.Has(name)) return fallback;
  STRATA_ASSIGN_OR_RETURN(int p, env.Int(name));
  if (p < 1 || p > 65535)
    return InvalidError(std::string(name) + "=" + std::to_string(p) + " is not a TCP port");
  return p;
}

// Master address and ports shared by all families; torchrun's own store
// holds MASTER_PORT, so ours moves one up (see RankInfo::store_port).
Status ReadMaster(const Env& env, RankInfo* r) {
  if (env.Has("MASTER_ADDR")) r->master_addr = env.Get("MASTER_ADDR");
  STRATA_ASSIGN_OR_RETURN(r->master_port, Port(env, "MASTER_PORT", 29500));
  bool agent_store = env.Get("TORCHELASTIC_USE_AGENT_STORE") == "True";
  int store_default = r->master_port + (agent_store ? 1 : 0);
  if (store_default > 65535) store_default = r->master_port - 1;
  STRATA_ASSIGN_OR_RETURN(r->store_port, Port(env, "STRATA_STORE_PORT", store_default));
  return Status::Ok();
}

Status ReadRanks(const Env& env, const Family& f, RankInfo* r) {
  STRATA_ASSIGN_OR_RETURN(r->rank, env.Int(f.rank));
  STRATA_ASSIGN_OR_RETURN(r->world_size, env.Int(f.world));
  STRATA_ASSIGN_OR_RETURN(r->local_rank, env.Int(f.local_rank));
  if (f.local_world) {
    STRATA_ASSIGN_OR_RETURN(r->local_world_size, env.Int(f.local_world));
  }
  r->source = f.source;
  return Status::Ok();
}

// The node's index under torchrun-style launchers: GROUP_RANK (torchrun's
// own) or NODE_RANK (what job scripts and other launchers export); -1 when
// neither is set. Both set and different is an error naming both.
Result<int> TorchrunNode(const Env& env) {
  int group = -1, node = -1;
  if (env.Has("GROUP_RANK")) {
    STRATA_ASSIGN_OR_RETURN(group, env.Int("GROUP_RANK"));
  }
  if (env.Has("NODE_RANK")) {
    STRATA_ASSIGN_OR_RETURN(node, env.Int("NODE_RANK"));
  }
  if (env.Has("GROUP_RANK") && group < 0) return InvalidError("GROUP_RANK=" + std::to_string(group) + " is negative");
  if (env.Has("NODE_RANK") && node < 0) return InvalidError("NODE_RANK=" + std::to_string(node) + " is negative");
  if (group >= 0 && node >= 0 && group != node)
    return InvalidError("torchrun launch variables inconsistent: GROUP_RANK=" + std::to_string(group) +
                        " but NODE_RANK=" + std::to_string(node) + " (both name this node's index)");
  return group >= 0 ? group : node;
}

const char* NodeVar(const Env& env) { return env.Has("GROUP_RANK") ? "GROUP_RANK" : "NODE_RANK"; }

// Ranks are node-major when every node runs LOCAL_WORLD_SIZE ranks (torchrun
// with one --nproc_per_node, strata-launch --nnodes): RANK = node *
// LOCAL_WORLD_SIZE + LOCAL_RANK. RANK may then be left out; when given it
// must agree. Uniform means GROUP_WORLD_SIZE * LOCAL_WORLD_SIZE == WORLD_SIZE
// (without GROUP_WORLD_SIZE: LOCAL_WORLD_SIZE divides WORLD_SIZE).
Status TorchrunNodeRanks(const Env& env, bool have_rank, RankInfo* r) {
  STRATA_ASSIGN_OR_RETURN(int node, TorchrunNode(env));
  if (node < 0) return Status::Ok();
  const char* nv = NodeVar(env);
  int nodes = 0;
  if (env.Has("GROUP_WORLD_SIZE")) {
    STRATA_ASSIGN_OR_RETURN(nodes, env.Int("GROUP_WORLD_SIZE"));
  } else if (r->local_world_size > 0 && r->world_size % r->local_world_size == 0) {
    nodes = r->world_size / r->local_world_size;
  }
  const bool uniform = nodes > 0 && static_cast<int64_t>(nodes) * r->local_world_size == r->world_size;
  if (!uniform) {
    if (have_rank) return Status::Ok();  // nodes of different sizes: RANK alone says
    return InvalidError("torchrun launch variables incomplete: RANK missing, and it cannot be derived from " +
                        std::string(nv) + ": WORLD_SIZE=" + std::to_string(r->world_size) +
                        " is not LOCAL_WORLD_SIZE=" + std::to_string(r->local_world_size) +
                        " times the number of nodes" +
                        (env.Has("GROUP_WORLD_SIZE") ? " (GROUP_WORLD_SIZE=" + std::to_string(nodes) + ")" : ""));
  }
  if (node >= nodes)
    return InvalidError("torchrun launch variables inconsistent: " + std::string(nv) + "=" + std::to_string(node) +
                        " but there are " + std::to_string(nodes) + " nodes (WORLD_SIZE " +
                        std::to_string(r->world_size) + " / LOCAL_WORLD_SIZE " + std::to_string(r->local_world_size) + ")");
  const int64_t expect = static_cast<int64_t>(node) * r->local_world_size + r->local_rank;
  if (!have_rank) {
    r->rank = static_cast<int>(expect);
    return Status::Ok();
  }
  if (r->rank != expect)
    return InvalidError("torchrun launch variables inconsistent: RANK=" + std::to_string(r->rank) + " but " + nv +
                        "=" + std::to_string(node) + " x LOCAL_WORLD_SIZE=" + std::to_string(r->local_world_size) +
                        " + LOCAL_RANK=" + std::to_string(r->local_rank) + " = " + std::to_string(expect));
  return Status::Ok();
}

Result<RankInfo> FromTorchrun(const Env& env) {
  RankInfo r;
  // RANK may be left out when the node index says it (see TorchrunNodeRanks).
  const bool have_rank = env.Has("RANK");
  const bool node_given = env.Has("GROUP_RANK") || env.Has("NODE_RANK");
  if (!have_rank && node_given) {
    STRATA_RETURN_IF_ERROR(RequireAll(env, "torchrun", {"WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}));
    STRATA_ASSIGN_OR_RETURN(r.world_size, env.Int("WORLD_SIZE"));
    STRATA_ASSIGN_OR_RETURN(r.local_rank, env.Int("LOCAL_RANK"));
    STRATA_ASSIGN_OR_RETURN(r.local_world_size, env.Int("LOCAL_WORLD_SIZE"));
    r.source = kTorchrun.source;
  } else {
    STRATA_RETURN_IF_ERROR(
        RequireAll(env, "torchrun", {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}));
    STRATA_RETURN_IF_ERROR(ReadRanks(env, kTorchrun, &r));
  }
  STRATA_RETURN_IF_ERROR(TorchrunNodeRanks(env, have_rank, &r));
  if (r.world_size > 1)
    STRATA_RETURN_IF_ERROR(RequireAll(env, "torchrun", {"WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}));
  STRATA_RETURN_IF_ERROR(ReadMaster(env, &r));
  STRATA_RETURN_IF_ERROR(CheckRanks(r, kTorchrun));
  return r;
}

Result<RankInfo> FromOpenMpi(const Env& env) {
  RankInfo r;
  STRATA_RETURN_IF_ERROR(
      RequireAll(env, "openmpi", {kOpenMpi.rank, kOpenMpi.world, kOpenMpi.local_rank, kOpenMpi.local_world}));
  STRATA_RETURN_IF_ERROR(ReadRanks(env, kOpenMpi, &r));
  if (r.local_world_size != r.world_size && !env.Has("MASTER_ADDR"))
    return InvalidError("openmpi launch variables incomplete: ranks span several hosts (" +
                        std::string(kOpenMpi.local_world) + " < " + kOpenMpi.world +
                        ") but MASTER_ADDR (rank 0's host) is missing");
  STRATA_RETURN_IF_ERROR(ReadMaster(env, &r));
  STRATA_RETURN_IF_ERROR(CheckRanks(r, kOpenMpi));
  return r;
}

// Slurm's per-node task count: SLURM_NTASKS_PER_NODE, else the leading count
// of SLURM_TASKS_PER_NODE ("4(x2),3" -> 4), else every task on one node.
int SlurmLocalWorld(const Env& env, int world) {
  for (const char* name : {"SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    std::string v = env.Get(name);
    int n = 0;
    auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
    if (ec == std::errc() && end != v.data() && n >= 1) return n;
  }
  return world;
}

// The nodes of this job step: SLURM_STEP_NODELIST (srun's step, which may
// be a subset of the allocation), else SLURM_JOB_NODELIST.
const char* SlurmNodelistVar(const Env& env) {
  return env.Has("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST" : "SLURM_JOB_NODELIST";
}

Result<RankInfo> FromSlurm(const Env& env) {
  RankInfo r;
  const char* nodelist = SlurmNodelistVar(env);
  STRATA_RETURN_IF_ERROR(RequireAll(env, "slurm", {kSlurm.rank, kSlurm.world, kSlurm.local_rank}));
  if (!env.Has("MASTER_ADDR") && !env.Has(nodelist))
    return InvalidError("slurm launch variables incomplete: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID set but "
                        "SLURM_JOB_NODELIST missing (and no MASTER_ADDR names rank 0's host)");
  STRATA_RETURN_IF_ERROR(ReadRanks(env, kSlurm, &r));
  r.local_world_size = SlurmLocalWorld(env, r.world_size);
  // SLURM_NODEID: this task's node among the step's. Task 0 runs on the
  // step's first node under srun's distributions; if it says otherwise, the
  // nodelist's first host is not rank 0's and only MASTER_ADDR can say which.
  int node = -1;
  if (env.Has("SLURM_NODEID")) {
    STRATA_ASSIGN_OR_RETURN(node, env.Int("SLURM_NODEID"));
    int nnodes = 0;
    if (env.Has("SLURM_NNODES")) {
      STRATA_ASSIGN_OR_RETURN(nnodes, env.Int("SLURM_NNODES"));
    }
    if (node < 0 || (nnodes > 0 && node >= nnodes))
      return InvalidError("slurm launch variables inconsistent: SLURM_NODEID=" + std::to_string(node) +
                          (nnodes > 0 ? " not in [0, SLURM_NNODES=" + std::to_string(nnodes) + ")" : " is negative"));
  }
  if (env.Has("MASTER_ADDR")) {
    r.master_addr = env.Get("MASTER_ADDR");
  } else {
    if (r.rank == 0 && node > 0)
      return InvalidError("slurm: rank 0 (SLURM_PROCID=0) runs on SLURM_NODEID=" + std::to_string(node) +
                          ", not on the first host of " + nodelist +
                          ", which would serve the rendezvous: set MASTER_ADDR to rank 0's host");
    STRATA_ASSIGN_OR_RETURN(r.master_addr, FirstSlurmHost(env.Get(nodelist)));
  }
  STRATA_RETURN_IF_ERROR(ReadMaster(env, &r));
  STRATA_RETURN_IF_ERROR(CheckRanks(r, kSlurm));
  return r;
}

bool AnySet(const Env& env, const Family& f) {
  return env.Has(f.rank) || env.Has(f.world) || env.Has(f.local_rank) ||
         (f.local_world && env.Has(f.local_world));
}

}  // namespace

std::string RankInfo::ToString() const {
  return "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " (local " +
         std::to_string(local_rank) + " of " + std::to_string(local_world_size) + ") via " + source +
         ", store " + master_addr + ":" + std::to_string(store_port);
}

Result<int> DeviceForLocalRank(int local_rank, int device_count, const std::string& source) {
  if (device_count <= 0) return -1;
  if (local_rank >= 0 && local_rank < device_count) return local_rank;
  const char* var = source == kTorchrun.source  ? kTorchrun.local_rank
                    : source == kOpenMpi.source ? kOpenMpi.local_rank
                    : source == kSlurm.source   ? kSlurm.local_rank
                                                : "the local rank";
  return InvalidError(std::string(var) + " is " + std::to_string(local_rank) + " but this process sees " +
                      std::to_string(device_count) + (device_count == 1 ? " GPU" : " GPUs") +
                      ": one process per GPU, so local rank i drives GPU i (start at most " +
                      std::to_string(device_count) + " processes on this node, or name the GPU in the engine "
                      "options when CUDA_VISIBLE_DEVICES gives each process its own)");
}

Result<std::string> FirstSlurmHost(const std::string& nodelist) {
  // Copy up to the first top-level comma; inside brackets keep only the first
  // element of the first range ("[03-05,09]" -> "03").
  std::string host;
  bool in_bracket = false, skipping = false;
  for (char c : nodelist) {
    if (!in_bracket && c == ',') break;
    if (c == '[') {
      in_bracket = true;
      skipping = false;
    } else if (c == ']') {
      in_bracket = false;
    } else if (in_bracket && (c == '-' || c == ',')) {
      skipping = true;
    } else if (!skipping || !in_bracket) {
      host += c;
    }
  }
  if (host.empty() || in_bracket)
    return InvalidError("SLURM_JOB_NODELIST='" + nodelist + "' has no first host");
  return host;
}

namespace {

// As the launcher that gave the ranks names it (mpirun inside an sbatch
// gives its ranks on other nodes another SLURM_STEP_ID than its own: the
// launcher's own id, not the first variable found, is the job's).
std::string JobOf(const Env& env, const std::string& source) {
  if (env.Has("STRATA_JOB_ID")) return "STRATA_JOB_ID=" + env.Get("STRATA_JOB_ID");
  if (source == "slurm" && env.Has("SLURM_JOB_ID"))
    return "SLURM_JOB_ID=" + env.Get("SLURM_JOB_ID") +
           (env.Has("SLURM_STEP_ID") ? " SLURM_STEP_ID=" + env.Get("SLURM_STEP_ID") : "");
  if (source == "openmpi" && env.Has("OMPI_MCA_ess_base_jobid"))
    return "OMPI_MCA_ess_base_jobid=" + env.Get("OMPI_MCA_ess_base_jobid");
  if (source == "torchrun" && env.Has("TORCHELASTIC_RUN_ID") && env.Get("TORCHELASTIC_RUN_ID") != "none")
    return "TORCHELASTIC_RUN_ID=" + env.Get("TORCHELASTIC_RUN_ID");
  return "";
}

Result<RankInfo> RanksOf(const Env& env) {
  if (AnySet(env, kTorchrun)) return FromTorchrun(env);
  if (AnySet(env, kOpenMpi)) return FromOpenMpi(env);
  if (AnySet(env, kSlurm)) return FromSlurm(env);
  RankInfo r;
  STRATA_RETURN_IF_ERROR(ReadMaster(env, &r));
  return r;
}

}  // namespace

Result<RankInfo> RankInfoFromEnv(const GetEnvFn& getenv) {
  Env env(getenv);
  STRATA_ASSIGN_OR_RETURN(RankInfo r, RanksOf(env));
  r.job = JobOf(env, r.source);
  return r;
}

}  // namespace strata::net

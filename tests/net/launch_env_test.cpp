// RankInfoFromEnv: each launcher's variables, precedence, and partial or
// inconsistent sets refused with the variables named.
#include "io/net/launch_env.h"

#include <gtest/gtest.h>

#include <map>

using namespace strata;
using namespace strata::net;

namespace {

Result<RankInfo> From(const std::map<std::string, std::string>& env) {
  return RankInfoFromEnv([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

std::map<std::string, std::string> Torchrun() {
  return {{"RANK", "3"},
          {"WORLD_SIZE", "8"},
          {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "2"},
          {"MASTER_ADDR", "10.0.0.5"},
          {"MASTER_PORT", "29600"}};
}

void ExpectError(const Result<RankInfo>& r, std::initializer_list<const char*> words) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalid);
  for (const char* w : words)
    EXPECT_NE(r.status().message().find(w), std::string::npos) << r.status().ToString();
}

// The job a rank is of, as its launcher names it: the store tells two jobs
// at one address apart by it. torchrun's default run id ("none") names none.
TEST(LaunchEnv, TheJobAsTheLauncherNamesIt) {
  auto job = [](std::map<std::string, std::string> env) {
    auto r = From(env);
    return r.ok() ? r->job : "error: " + r.status().ToString();
  };
  auto t = Torchrun();
  EXPECT_EQ(job(t), "");
  t["TORCHELASTIC_RUN_ID"] = "none";
  EXPECT_EQ(job(t), "");
  t["TORCHELASTIC_RUN_ID"] = "a1b2";
  EXPECT_EQ(job(t), "TORCHELASTIC_RUN_ID=a1b2");
  t["SLURM_JOB_ID"] = "77";
  t["SLURM_STEP_ID"] = "3";
  EXPECT_EQ(job(t), "TORCHELASTIC_RUN_ID=a1b2") << "the launcher that gave the ranks names the job (torchrun in an sbatch)";
  t["STRATA_JOB_ID"] = "mine";
  EXPECT_EQ(job(t), "STRATA_JOB_ID=mine") << "the user's first";
  // mpirun inside an sbatch: its ranks on other nodes see another
  // SLURM_STEP_ID (orted started by srun); Open MPI's job id is the job's.
  std::map<std::string, std::string> mpi = {{"OMPI_COMM_WORLD_RANK", "1"},       {"OMPI_COMM_WORLD_SIZE", "2"},
                                            {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
                                            {"MASTER_ADDR", "10.0.0.5"},         {"MASTER_PORT", "29600"},
                                            {"OMPI_MCA_ess_base_jobid", "123"},  {"SLURM_JOB_ID", "900"},
                                            {"SLURM_STEP_ID", "0"}};
  EXPECT_EQ(job(mpi), "OMPI_MCA_ess_base_jobid=123");
  mpi.erase("SLURM_STEP_ID");
  EXPECT_EQ(job(mpi), "OMPI_MCA_ess_base_jobid=123");
  EXPECT_EQ(job({}), "");
}

TEST(LaunchEnv, NoneIsOneRank) {
  auto r = From({});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rank, 0);
  EXPECT_EQ(r->world_size, 1);
  EXPECT_EQ(r->source, "none");
  EXPECT_EQ(r->master_addr, "127.0.0.1");
}

TEST(LaunchEnv, Torchrun) {
  auto r = From(Torchrun());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->source, "torchrun");
  EXPECT_EQ(r->rank, 3);
  EXPECT_EQ(r->world_size, 8);
  EXPECT_EQ(r->local_rank, 1);
  EXPECT_EQ(r->local_world_size, 2);
  EXPECT_EQ(r->master_addr, "10.0.0.5");
  EXPECT_EQ(r->master_port, 29600);
  EXPECT_EQ(r->store_port, 29600);
}

TEST(LaunchEnv, TorchrunAgentStoreMovesOurPort) {
  auto env = Torchrun();
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  auto r = From(env);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->master_port, 29600);
  EXPECT_EQ(r->store_port, 29601);
  env["STRATA_STORE_PORT"] = "31000";
  EXPECT_EQ(From(env)->store_port, 31000);
}

TEST(LaunchEnv, TorchrunPartialNamesTheMissing) {
  auto env = Torchrun();
  env.erase("LOCAL_RANK");
  env.erase("LOCAL_WORLD_SIZE");
  ExpectError(From(env), {"torchrun", "RANK, WORLD_SIZE set", "LOCAL_RANK, LOCAL_WORLD_SIZE missing"});
  env = Torchrun();
  env.erase("MASTER_PORT");
  ExpectError(From(env), {"MASTER_PORT missing"});
}

TEST(LaunchEnv, TorchrunOneRankNeedsNoMaster) {
  auto r = From({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->world_size, 1);
}

TEST(LaunchEnv, InconsistentNamesTheVariables) {
  auto env = Torchrun();
  env["RANK"] = "8";
  ExpectError(From(env), {"inconsistent", "RANK must be in [0, WORLD_SIZE)"});
  env = Torchrun();
  env["LOCAL_RANK"] = "2";
  ExpectError(From(env), {"LOCAL_RANK must be in [0, LOCAL_WORLD_SIZE)"});
  env = Torchrun();
  env["LOCAL_WORLD_SIZE"] = "9";
  ExpectError(From(env), {"LOCAL_WORLD_SIZE must be in [1, WORLD_SIZE]"});
  env = Torchrun();
  env["WORLD_SIZE"] = "eight";
  ExpectError(From(env), {"WORLD_SIZE='eight' is not an integer"});
  env = Torchrun();
  env["MASTER_PORT"] = "70000";
  ExpectError(From(env), {"MASTER_PORT=70000 is not a TCP port"});
}

TEST(LaunchEnv, OpenMpi) {
  std::map<std::string, std::string> env = {{"OMPI_COMM_WORLD_RANK", "2"},
                                            {"OMPI_COMM_WORLD_SIZE", "4"},
                                            {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                            {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};
  auto r = From(env);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->source, "openmpi");
  EXPECT_EQ(r->rank, 2);
  EXPECT_EQ(r->world_size, 4);
  EXPECT_EQ(r->master_addr, "127.0.0.1");  // every rank local
  EXPECT_EQ(r->master_port, 29500);
  // Ranks on several hosts need MASTER_ADDR.
  env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "2";
  env["OMPI_COMM_WORLD_LOCAL_RANK"] = "0";
  ExpectError(From(env), {"openmpi", "MASTER_ADDR"});
  env["MASTER_ADDR"] = "node7";
  EXPECT_EQ(From(env)->master_addr, "node7");
  env.erase("OMPI_COMM_WORLD_SIZE");
  ExpectError(From(env), {"openmpi launch variables incomplete", "OMPI_COMM_WORLD_SIZE missing"});
}

// mpirun over 2 hosts of 2 ranks, as the hosts tests start them.
TEST(LaunchEnv, OpenMpiManyHosts) {
  std::map<std::string, std::string> env = {{"OMPI_COMM_WORLD_RANK", "3"},       {"OMPI_COMM_WORLD_SIZE", "4"},
                                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                            {"MASTER_ADDR", "10.213.0.1"},       {"MASTER_PORT", "29411"}};
  auto r = From(env);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rank, 3);
  EXPECT_EQ(r->local_rank, 1);
  EXPECT_EQ(r->local_world_size, 2);
  EXPECT_EQ(r->master_addr, "10.213.0.1");
  EXPECT_EQ(r->store_port, 29411);
  env["OMPI_COMM_WORLD_LOCAL_RANK"] = "2";
  ExpectError(From(env), {"OMPI_COMM_WORLD_LOCAL_RANK must be in [0, OMPI_COMM_WORLD_LOCAL_SIZE)"});
}

TEST(LaunchEnv, Slurm) {
  std::map<std::string, std::string> env = {{"SLURM_PROCID", "5"},
                                            {"SLURM_NTASKS", "8"},
                                            {"SLURM_LOCALID", "1"},
                                            {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                            {"SLURM_JOB_NODELIST", "gpu-a[017-018,020],cpu1"}};
  auto r = From(env);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->source, "slurm");
  EXPECT_EQ(r->rank, 5);
  EXPECT_EQ(r->world_size, 8);
  EXPECT_EQ(r->local_rank, 1);
  EXPECT_EQ(r->local_world_size, 4);
  EXPECT_EQ(r->master_addr, "gpu-a017");
  env["MASTER_ADDR"] = "10.1.1.1";
  EXPECT_EQ(From(env)->master_addr, "10.1.1.1");
  // An explicit master needs no node list; without either, both are named.
  env.erase("SLURM_JOB_NODELIST");
  EXPECT_EQ(From(env)->master_addr, "10.1.1.1");
  env.erase("MASTER_ADDR");
  ExpectError(From(env), {"slurm", "SLURM_JOB_NODELIST missing", "MASTER_ADDR"});
}

// Many nodes under srun: the step's node list (a subset of the job's) names
// the master; SLURM_NODEID is checked; srun's own host is never guessed.
TEST(LaunchEnv, SlurmManyNodes) {
  std::map<std::string, std::string> env = {{"SLURM_PROCID", "3"},          {"SLURM_NTASKS", "4"},
                                            {"SLURM_LOCALID", "1"},         {"SLURM_NODEID", "1"},
                                            {"SLURM_NNODES", "2"},          {"SLURM_NTASKS_PER_NODE", "2"},
                                            {"SLURM_JOB_NODELIST", "n[1-4]"}, {"SLURM_STEP_NODELIST", "n[3-4]"},
                                            {"SLURM_LAUNCH_NODE_IPADDR", "10.9.9.9"}};
  auto r = From(env);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rank, 3);
  EXPECT_EQ(r->local_rank, 1);
  EXPECT_EQ(r->local_world_size, 2);
  EXPECT_EQ(r->master_addr, "n3") << "the step's first node, not the job's, not srun's host";
  env["MASTER_ADDR"] = "10.213.0.1";
  EXPECT_EQ(From(env)->master_addr, "10.213.0.1");
  env.erase("MASTER_ADDR");
  env["SLURM_NODEID"] = "2";
  ExpectError(From(env), {"SLURM_NODEID=2 not in [0, SLURM_NNODES=2)"});
  env["SLURM_NODEID"] = "one";
  ExpectError(From(env), {"SLURM_NODEID='one' is not an integer"});
  // Rank 0 on another node than the list's first: only MASTER_ADDR can say.
  env["SLURM_PROCID"] = "0";
  env["SLURM_LOCALID"] = "0";
  env["SLURM_NODEID"] = "1";
  ExpectError(From(env), {"rank 0 (SLURM_PROCID=0) runs on SLURM_NODEID=1", "SLURM_STEP_NODELIST", "MASTER_ADDR"});
  env["MASTER_ADDR"] = "10.213.0.2";
  EXPECT_EQ(From(env)->master_addr, "10.213.0.2");
}

// torchrun on several nodes: RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK.
std::map<std::string, std::string> TorchrunNode1() {  // node 1 of 2, 2 ranks a node
  return {{"RANK", "3"},           {"WORLD_SIZE", "4"},        {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "1"},      {"GROUP_WORLD_SIZE", "2"},
          {"MASTER_ADDR", "10.213.0.1"}, {"MASTER_PORT", "29400"}};
}

TEST(LaunchEnv, TorchrunManyNodes) {
  auto r = From(TorchrunNode1());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rank, 3);
  EXPECT_EQ(r->master_addr, "10.213.0.1");
  // NODE_RANK alone (a job script's), agreeing: fine; disagreeing: both named.
  auto env = TorchrunNode1();
  env.erase("GROUP_RANK");
  env["NODE_RANK"] = "1";
  EXPECT_TRUE(From(env).ok());
  env["GROUP_RANK"] = "0";
  ExpectError(From(env), {"GROUP_RANK=0 but NODE_RANK=1"});
  // RANK that is not node-major.
  env = TorchrunNode1();
  env["RANK"] = "1";
  ExpectError(From(env), {"RANK=1 but GROUP_RANK=1 x LOCAL_WORLD_SIZE=2 + LOCAL_RANK=1 = 3"});
  env = TorchrunNode1();
  env["GROUP_RANK"] = "2";
  ExpectError(From(env), {"GROUP_RANK=2 but there are 2 nodes"});
  env = TorchrunNode1();
  env["GROUP_RANK"] = "-1";
  ExpectError(From(env), {"GROUP_RANK=-1 is negative"});
  // RANK left out: derived from the node's index.
  env = TorchrunNode1();
  env.erase("RANK");
  env.erase("GROUP_RANK");
  env["NODE_RANK"] = "1";
  env["LOCAL_RANK"] = "0";
  r = From(env);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rank, 2);
  // ... but not when the nodes' sizes do not multiply out.
  env["WORLD_SIZE"] = "5";
  env.erase("GROUP_WORLD_SIZE");
  ExpectError(From(env), {"RANK missing", "cannot be derived from NODE_RANK", "WORLD_SIZE=5"});
  // Nodes of different sizes (GROUP_WORLD_SIZE * LOCAL_WORLD_SIZE != WORLD_SIZE): RANK alone says.
  env = TorchrunNode1();
  env["WORLD_SIZE"] = "5";
  env["RANK"] = "4";
  EXPECT_EQ(From(env)->rank, 4);
  // The master is still required on many ranks.
  env = TorchrunNode1();
  env.erase("MASTER_ADDR");
  ExpectError(From(env), {"MASTER_ADDR missing"});
}

TEST(LaunchEnv, TorchrunWinsOverSlurm) {
  auto env = Torchrun();
  env["SLURM_PROCID"] = "0";
  env["SLURM_NTASKS"] = "1";
  EXPECT_EQ(From(env)->source, "torchrun");
}

TEST(LaunchEnv, FirstSlurmHost) {
  EXPECT_EQ(FirstSlurmHost("node1").value(), "node1");
  EXPECT_EQ(FirstSlurmHost("node1,node2").value(), "node1");
  EXPECT_EQ(FirstSlurmHost("gpu[03-05,09]").value(), "gpu03");
  EXPECT_EQ(FirstSlurmHost("gpu[09,03-05],x").value(), "gpu09");
  EXPECT_EQ(FirstSlurmHost("rack[1-2]-n[01-04]").value(), "rack1-n01");
  EXPECT_FALSE(FirstSlurmHost("").ok());
  EXPECT_FALSE(FirstSlurmHost("gpu[01").ok());
}

}  // namespace

// ---- One process per GPU: the local rank selects the GPU ----

TEST(DeviceForLocalRank, LocalRankIsTheGpu) {
  EXPECT_EQ(DeviceForLocalRank(0, 8, "torchrun").value(), 0);
  EXPECT_EQ(DeviceForLocalRank(7, 8, "torchrun").value(), 7);
  EXPECT_EQ(DeviceForLocalRank(1, 2, "slurm").value(), 1);
  // From the variables, as the engine reads them.
  auto info = From(Torchrun());
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(DeviceForLocalRank(info->local_rank, 2, info->source).value(), 1);
}

TEST(DeviceForLocalRank, NoGpuIsMinusOne) {
  EXPECT_EQ(DeviceForLocalRank(0, 0).value(), -1);
  EXPECT_EQ(DeviceForLocalRank(5, 0, "torchrun").value(), -1) << "no GPU: the device tier is a host arena";
}

TEST(DeviceForLocalRank, PastTheLastGpuIsRefusedNamingBothNumbers) {
  const Result<int> r = DeviceForLocalRank(2, 2, "torchrun");
  ASSERT_FALSE(r.ok()) << "local rank 2 of 2 GPUs must not wrap onto GPU 0";
  EXPECT_EQ(r.status().code(), Code::kInvalid);
  const std::string m = r.status().message();
  EXPECT_NE(m.find("LOCAL_RANK is 2"), std::string::npos) << m;
  EXPECT_NE(m.find("sees 2 GPUs"), std::string::npos) << m;
  EXPECT_NE(m.find("one process per GPU"), std::string::npos) << m;

  const Result<int> one = DeviceForLocalRank(3, 1, "slurm");
  ASSERT_FALSE(one.ok());
  EXPECT_NE(one.status().message().find("SLURM_LOCALID is 3 but this process sees 1 GPU:"), std::string::npos)
      << one.status().message();
  const Result<int> mpi = DeviceForLocalRank(4, 4, "openmpi");
  ASSERT_FALSE(mpi.ok());
  EXPECT_NE(mpi.status().message().find("OMPI_COMM_WORLD_LOCAL_RANK is 4"), std::string::npos);
  EXPECT_FALSE(DeviceForLocalRank(-1, 4).ok());
}

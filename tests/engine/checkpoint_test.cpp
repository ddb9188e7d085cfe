// Checkpoints: resume equals continuous (in new processes), crashes during
// save leave a whole checkpoint, corruption is refused with the engine as
// it was.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "engine/engine.h"
#include "tests/engine/tiny_mlp.h"
#include "tests/util/temp_dir.h"

extern char** environ;

namespace strata {
namespace {

using testing::TempDir;

std::string WorkerPath() {
  return (std::filesystem::path(std::filesystem::read_symlink("/proc/self/exe")).parent_path() / "checkpoint_worker").string();
}

struct WorkerRun {
  int code = -1;
  std::string out;
};

// Runs the worker with `args`, `env_extra` added, capturing stdout.
WorkerRun Worker(const std::vector<std::string>& args, const std::string& env_extra = "", int kill_after_ms = -1) {
  WorkerRun r;
  const std::string out_path = std::filesystem::temp_directory_path() / ("ckw-" + std::to_string(::getpid()) + ".out");
  std::vector<std::string> argv_s = {WorkerPath()};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) env_s.push_back(*e);
  if (!env_extra.empty()) env_s.push_back(env_extra);
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid;
  if (posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data()) != 0) return r;
  posix_spawn_file_actions_destroy(&fa);
  if (kill_after_ms >= 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(kill_after_ms));
    ::kill(pid, SIGKILL);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream f(out_path);
  std::stringstream ss;
  ss << f.rdbuf();
  r.out = ss.str();
  std::filesystem::remove(out_path);
  return r;
}

std::string MasterLine(const std::string& out) {
  const auto p = out.rfind("master ");
  return p == std::string::npos ? "" : out.substr(p);
}

TEST(Checkpoint, ResumeEqualsContinuous) {
  TempDir swap, ckpt;
  const WorkerRun whole = Worker({swap.path(), ckpt.path(), "train", "0", "12"});
  ASSERT_EQ(whole.code, 0) << whole.out;
  const WorkerRun first = Worker({swap.path(), ckpt.path(), "train", "0", "6", "save", "step6"});
  ASSERT_EQ(first.code, 0) << first.out;
  const WorkerRun second = Worker({swap.path(), ckpt.path(), "train", "0", "12", "resume"});
  ASSERT_EQ(second.code, 0) << second.out;
  // Loss lines: the first run's 6 and the resumed run's 6 equal the whole run's 12.
  const std::string joined = first.out.substr(0, first.out.find("master")) + second.out;
  EXPECT_EQ(joined, whole.out);
  EXPECT_EQ(MasterLine(second.out), MasterLine(whole.out));
  EXPECT_FALSE(MasterLine(whole.out).empty());
  EXPECT_NE(whole.out.find(" 1\n"), std::string::npos) << "fp16 should overflow and skip at least once:\n" << whole.out;
}

TEST(Checkpoint, KillPointsLeaveAWholeCheckpoint) {
  for (const char* point : {"data", "manifest", "rename", "latest"}) {
    TempDir swap, ckpt;
    ASSERT_EQ(Worker({swap.path(), ckpt.path(), "train", "0", "3", "save", "old"}).code, 0);
    const WorkerRun killed = Worker({swap.path(), ckpt.path(), "train", "0", "5", "save", "new"},
                              std::string("STRATA_CHECKPOINT_KILL_AT=") + point);
    ASSERT_EQ(killed.code, 86) << point;
    // The next load finds a whole checkpoint: the old one, or (after the
    // rename) the new one; the worker's resume verifies every checksum.
    const WorkerRun resumed = Worker({swap.path(), ckpt.path(), "train", "0", "6", "resume"});
    ASSERT_EQ(resumed.code, 0) << point << ": " << resumed.out;
    std::ifstream latest(ckpt.path() + "/latest");
    std::string tag;
    latest >> tag;
    EXPECT_EQ(tag, std::string(point) == "latest" ? "new" : "old") << point;
    const size_t lines = std::count(resumed.out.begin(), resumed.out.end(), '\n') - 1;
    EXPECT_EQ(lines, tag == "new" ? 1u : 3u) << point;
  }
}

TEST(Checkpoint, SigkillAtRandomMomentsNeverLeavesAMix) {
  std::mt19937 rng(11);
  for (int round = 0; round < 6; ++round) {
    TempDir swap, ckpt;
    const WorkerRun r = Worker({swap.path(), ckpt.path(), "train", "0", "0", "loop"}, "", 150 + static_cast<int>(rng() % 400));
    ASSERT_EQ(r.code, 128 + SIGKILL);
    if (!std::filesystem::exists(ckpt.path() + "/latest")) continue;  // killed before the first save finished
    const WorkerRun resumed = Worker({swap.path(), ckpt.path(), "train", "0", "1", "resume"});
    EXPECT_TRUE(resumed.code == 0 || resumed.out.empty()) << resumed.out;
    EXPECT_EQ(resumed.code, 0) << "round " << round;
  }
}

// In-process: corruption is refused and the engine is unchanged.
class CorruptCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cfg = ParseConfig(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ")" +
                           swap.path() + R"("}}, "strata": {"device_budget": "8MiB", "host_budget": "8MiB"}})");
    ASSERT_TRUE(cfg.ok());
    auto e = Engine::Create(*cfg, {});
    ASSERT_TRUE(e.ok());
    eng = std::move(e).value();
    ASSERT_TRUE(model.Register(*eng).ok());
    ASSERT_TRUE(eng->Build().ok());
    ASSERT_TRUE(model.TrainStep(*eng).ok());
    ASSERT_TRUE(eng->Step({}).ok());
    ASSERT_TRUE(eng->SaveCheckpoint(ckpt.path(), "a", "xy", 2).ok());
    ASSERT_TRUE(model.TrainStep(*eng).ok());
    ASSERT_TRUE(eng->Step({}).ok());
    before = Master();
  }
  std::vector<float> Master() {
    std::vector<float> w;
    for (int g = 0; g < eng->num_groups(); ++g) {
      std::vector<float> x(eng->group_numel(g));
      EXPECT_TRUE(eng->ReadMaster(g, x.data()).ok());
      w.insert(w.end(), x.begin(), x.end());
    }
    return w;
  }
  void ExpectRefused(const std::string& needle) {
    std::vector<uint8_t> blob;
    Status st = eng->LoadCheckpoint(ckpt.path(), "", &blob);
    EXPECT_EQ(st.code(), Code::kCorrupt) << st.ToString();
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
    EXPECT_EQ(Master(), before) << "state must be unchanged";
    EXPECT_TRUE(blob.empty());
  }
  TempDir swap, ckpt;
  testing::TinyMlp model{2, 16};
  std::unique_ptr<Engine> eng;
  std::vector<float> before;
};

TEST_F(CorruptCheckpoint, LoadsWhenIntact) {
  std::vector<uint8_t> blob;
  ASSERT_TRUE(eng->LoadCheckpoint(ckpt.path(), "", &blob).ok());
  EXPECT_EQ(std::string(blob.begin(), blob.end()), "xy");
  EXPECT_NE(Master(), before);
  EXPECT_EQ(eng->steps_applied(), 1);
}

TEST_F(CorruptCheckpoint, FlippedByte) {
  const std::string p = ckpt.path() + "/a/rank00000.bin";
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(100);
  char c;
  f.get(c);
  f.seekp(100);
  f.put(static_cast<char>(c ^ 1));
  f.close();
  ExpectRefused("rank00000.bin");
}

TEST_F(CorruptCheckpoint, TruncatedFile) {
  std::filesystem::resize_file(ckpt.path() + "/a/rank00000.bin", 4096);
  ExpectRefused("truncated");
}

TEST_F(CorruptCheckpoint, MissingManifest) {
  std::filesystem::remove(ckpt.path() + "/a/manifest.json");
  ExpectRefused("manifest.json");
}

TEST_F(CorruptCheckpoint, GarbledManifest) {
  std::ofstream(ckpt.path() + "/a/manifest.json") << "{\"format\": \"strata-checkpoint\", \"version\": 1}";
  ExpectRefused("manifest");
}

// A full disk during save (the file size limit stands in for it): a clear
// error, nothing left behind, and the previous checkpoint still loads.
TEST_F(CorruptCheckpoint, FullDiskDuringSaveKeepsThePreviousCheckpoint) {
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  Status st = eng->SaveCheckpoint(ckpt.path(), "b", "zz", 2);
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  EXPECT_EQ(st.code(), Code::kNoSpace) << st.ToString();
  EXPECT_NE(st.message().find("reserving"), std::string::npos) << st.message();
  EXPECT_FALSE(std::filesystem::exists(ckpt.path() + "/b"));
  EXPECT_FALSE(std::filesystem::exists(ckpt.path() + "/.b.partial"));
  std::vector<uint8_t> blob;
  ASSERT_TRUE(eng->LoadCheckpoint(ckpt.path(), "", &blob).ok());
  EXPECT_EQ(std::string(blob.begin(), blob.end()), "xy");
}

TEST_F(CorruptCheckpoint, ExistingTagAndBadTagsAreRefused) {
  EXPECT_EQ(eng->SaveCheckpoint(ckpt.path(), "a", nullptr, 0).code(), Code::kInvalid);
  EXPECT_EQ(eng->SaveCheckpoint(ckpt.path(), "../x", nullptr, 0).code(), Code::kInvalid);
  EXPECT_EQ(eng->SaveCheckpoint(ckpt.path(), "latest", nullptr, 0).code(), Code::kInvalid);
}

}  // namespace
}  // namespace strata

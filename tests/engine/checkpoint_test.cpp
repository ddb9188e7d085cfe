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
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <sys/file.h>
#include <xxhash.h>

#include <functional>

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

// The state format of the test running: every test here runs in both.
bool g_compact = false;

// A suite run once per strata.state_format ("fp32", "compact").
class Formats : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { g_compact = IsCompact(); }
  void TearDown() override { g_compact = false; }
  static bool IsCompact() { return std::string(GetParam()) == "compact"; }
};

// Runs the worker with `args` (in the test's state format), `env_extra`
// added, capturing stdout.
// kill_after_ms >= 0: SIGKILL that long after the start, or, with
// `after_file`, after that file appears (polled; at most 60 s).
WorkerRun Worker(const std::vector<std::string>& args, const std::string& env_extra = "", int kill_after_ms = -1,
                 const std::string& after_file = "") {
  WorkerRun r;
  const std::string out_path = std::filesystem::temp_directory_path() / ("ckw-" + std::to_string(::getpid()) + ".out");
  std::vector<std::string> argv_s = {WorkerPath()};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  if (g_compact) argv_s.push_back("compact");
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
    for (int waited = 0; !after_file.empty() && !std::filesystem::exists(after_file) && waited < 60000; waited += 5)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
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

class Checkpoint : public Formats {};

TEST_P(Checkpoint, ResumeEqualsContinuous) {
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
  if (!IsCompact()) {
    EXPECT_NE(whole.out.find(" 1\n"), std::string::npos) << "fp16 should overflow and skip at least once:\n" << whole.out;
  }
}

TEST_P(Checkpoint, KillPointsLeaveAWholeCheckpoint) {
  for (const char* point : {"data", "manifest", "rename", "latest"}) {
    TempDir swap, ckpt;
    ASSERT_EQ(Worker({swap.path(), ckpt.path(), "train", "0", "3", "save", "old"}).code, 0);
    const WorkerRun killed = Worker({swap.path(), ckpt.path(), "train", "0", "5", "save", "new"},
                              std::string("STRATA_CHECKPOINT_KILL_AT=") + point);
    ASSERT_EQ(killed.code, 86) << point;
    // The next load finds a whole checkpoint: the old one, or (after the
    // rename) the new one, even where `latest` still names the old one; the
    // worker's resume verifies every checksum.
    const WorkerRun resumed = Worker({swap.path(), ckpt.path(), "train", "0", "6", "resume"});
    ASSERT_EQ(resumed.code, 0) << point << ": " << resumed.out;
    // The killed engine's swap files (every generation) went when the next
    // engine started; that one removed its own at exit.
    for (const auto& e : std::filesystem::directory_iterator(swap.path()))
      ADD_FAILURE() << point << ": left in the swap folder: " << e.path();
    std::ifstream latest(ckpt.path() + "/latest");
    std::string tag;
    latest >> tag;
    const bool renamed = std::string(point) == "rename" || std::string(point) == "latest";
    EXPECT_EQ(tag, std::string(point) == "latest" ? "new" : "old") << point;
    const size_t lines = std::count(resumed.out.begin(), resumed.out.end(), '\n') - 1;
    EXPECT_EQ(lines, renamed ? 1u : 3u) << point;
    // A killed save's folder is gone after the next save.
    const WorkerRun again = Worker({swap.path(), ckpt.path(), "train", "0", "6", "resume", "save", "again"});
    ASSERT_EQ(again.code, 0) << point << ": " << again.out;
    for (const auto& e : std::filesystem::directory_iterator(ckpt.path()))
      EXPECT_EQ(e.path().filename().string().find(".partial"), std::string::npos) << point << ": " << e.path();
  }
}

// The worker saves after every step, for good; each round kills it at a
// random moment of the saves after its first one (the clock starts once
// `latest` exists: a slow machine never makes a round check nothing).
TEST_P(Checkpoint, SigkillAtRandomMomentsNeverLeavesAMix) {
  std::mt19937 rng(11);
  for (int round = 0; round < 6; ++round) {
    TempDir swap, ckpt;
    const WorkerRun r = Worker({swap.path(), ckpt.path(), "train", "0", "0", "loop"}, "",
                               static_cast<int>(rng() % 400), ckpt.path() + "/latest");
    ASSERT_EQ(r.code, 128 + SIGKILL) << r.out;
    ASSERT_TRUE(std::filesystem::exists(ckpt.path() + "/latest")) << "round " << round << ": no first save";
    const WorkerRun resumed = Worker({swap.path(), ckpt.path(), "train", "0", "1", "resume"});
    EXPECT_TRUE(resumed.code == 0 || resumed.out.empty()) << resumed.out;
    EXPECT_EQ(resumed.code, 0) << "round " << round;
  }
}

// In-process: corruption is refused and the engine is unchanged.
class CorruptCheckpoint : public Formats {
 protected:
  void SetUp() override {
    Formats::SetUp();
    eng = NewEngine(swap.path());
    ASSERT_TRUE(eng);
    ASSERT_TRUE(TrainOne(*eng));
    ASSERT_TRUE(eng->SaveCheckpoint(ckpt.path(), "a", "xy", 2).ok());
    ASSERT_TRUE(TrainOne(*eng));
    before = Master();
  }
  std::unique_ptr<Engine> NewEngine(const std::string& swap_dir) {
    const std::string format = IsCompact() ? R"(, "state_format": "compact"}, "bf16": {"enabled": true})" : "}";
    auto cfg = ParseConfig(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ")" +
                           swap_dir + R"("}}, "strata": {"device_budget": "8MiB", "host_budget": "8MiB")" + format +
                           "}");
    if (!cfg.ok()) return nullptr;
    auto e = Engine::Create(*cfg, {});
    if (!e.ok() || !model.Register(**e).ok() || !(*e)->Build().ok()) return nullptr;
    return std::move(e).value();
  }
  bool TrainOne(Engine& e) { return model.TrainStep(e).ok() && e.Step({}).ok(); }
  std::vector<float> Master(Engine* e = nullptr) {
    if (!e) e = eng.get();
    std::vector<float> w;
    for (int g = 0; g < e->num_groups(); ++g) {
      std::vector<float> x(e->group_numel(g));
      EXPECT_TRUE(e->ReadMaster(g, x.data()).ok());
      w.insert(w.end(), x.begin(), x.end());
    }
    return w;
  }
  // Rewrites a's manifest with `edit` applied and its checksum made right
  // again: what a buggy writer (or a bit flipped before sealing) leaves.
  void EditManifest(const std::function<void(nlohmann::json&)>& edit, bool reseal = true) {
    const std::string p = ckpt.path() + "/a/manifest.json";
    std::ifstream in(p);
    nlohmann::json m = nlohmann::json::parse(in);
    in.close();
    edit(m);
    m.erase("manifest_xxh3");
    if (reseal) {
      const std::string canon = m.dump();
      char hex[17];
      std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(XXH3_64bits(canon.data(), canon.size())));
      m["manifest_xxh3"] = hex;
    }
    std::ofstream(p) << m.dump(1);
  }
  // After a refused load: a step gives what the same step gives an engine
  // that never saw the checkpoint.
  void ExpectStepsAsFresh() {
    TempDir swap2;
    auto twin = NewEngine(swap2.path());
    ASSERT_TRUE(twin);
    ASSERT_TRUE(TrainOne(*twin));
    ASSERT_TRUE(TrainOne(*twin));
    ASSERT_EQ(Master(twin.get()), before);
    ASSERT_TRUE(TrainOne(*twin));
    ASSERT_TRUE(TrainOne(*eng));
    EXPECT_EQ(Master(), Master(twin.get()));
    EXPECT_EQ(eng->steps_applied(), twin->steps_applied());
  }
  void ExpectRefused(const std::string& needle) {
    std::vector<uint8_t> blob;
    Status st = eng->LoadCheckpoint(ckpt.path(), "", &blob);
    EXPECT_EQ(st.code(), Code::kCorrupt) << st.ToString();
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
    EXPECT_EQ(Master(), before) << "state must be unchanged";
    EXPECT_EQ(eng->steps_applied(), 2);
    EXPECT_EQ(eng->loss_scale(), 1.0);
    EXPECT_TRUE(blob.empty());
  }
  TempDir swap, ckpt;
  testing::TinyMlp model{2, 16};
  std::unique_ptr<Engine> eng;
  std::vector<float> before;
};

TEST_P(CorruptCheckpoint, LoadsWhenIntact) {
  std::vector<uint8_t> blob;
  ASSERT_TRUE(eng->LoadCheckpoint(ckpt.path(), "", &blob).ok());
  EXPECT_EQ(std::string(blob.begin(), blob.end()), "xy");
  EXPECT_NE(Master(), before);
  EXPECT_EQ(eng->steps_applied(), 1);
  // The checkpoint is in the test's format (a manifest without the key is fp32).
  std::ifstream in(ckpt.path() + "/a/manifest.json");
  const nlohmann::json m = nlohmann::json::parse(in);
  EXPECT_EQ(m.value("state_format", std::string("fp32")), GetParam());
}

TEST_P(CorruptCheckpoint, FlippedByte) {
  const std::string p = ckpt.path() + "/a/rank00000.bin";
  // Inside the first block the manifest references (a snapshot links the
  // swap file, where blocks sit wherever their last write put them).
  std::ifstream mf(ckpt.path() + "/a/manifest.json");
  const auto m = nlohmann::json::parse(mf);
  const uint64_t at = m["files"][0]["blocks"][0]["offset"].get<uint64_t>() + 100;
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(at));
  f.put(static_cast<char>(c ^ 1));
  f.close();
  ExpectRefused("rank00000.bin");
}

TEST_P(CorruptCheckpoint, TruncatedFile) {
  std::filesystem::resize_file(ckpt.path() + "/a/rank00000.bin", 4096);
  ExpectRefused("truncated");
}

TEST_P(CorruptCheckpoint, MissingManifest) {
  std::filesystem::remove(ckpt.path() + "/a/manifest.json");
  ExpectRefused("manifest.json");
}

TEST_P(CorruptCheckpoint, GarbledManifest) {
  std::ofstream(ckpt.path() + "/a/manifest.json") << "{\"format\": \"strata-checkpoint\", \"version\": 1}";
  ExpectRefused("manifest");
}

// A manifest nested 200,000 deep, sealed (the seal is read first): refused
// as CORRUPT, never a stack overflow in the seal's check (a crash at load,
// and at every later save in the folder, which reads its siblings).
TEST_P(CorruptCheckpoint, DeeplyNestedManifest) {
  std::string text = "{\"manifest_xxh3\": \"0000000000000000\", \"a\": ";
  text += std::string(200000, '[') + std::string(200000, ']') + "}";
  std::ofstream(ckpt.path() + "/a/manifest.json") << text;
  ExpectRefused("nests deeper than 32 levels");
}

// A checkpoint folder that cannot be read (no file descriptor left here:
// EMFILE; EACCES or EIO alike) is an I/O error naming why: not NOT_FOUND,
// which a trainer takes for "start afresh", nor CORRUPT, which has it throw
// a good checkpoint away. Nothing changes; once readable, it loads.
TEST_P(CorruptCheckpoint, AFolderThatCannotBeReadIsIoNotNotFoundOrCorrupt) {
  std::filesystem::remove(ckpt.path() + "/latest");  // (the newest by its manifest all the same)
  const int probe = ::dup(0);
  ASSERT_GE(probe, 0);
  ::close(probe);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit none = old;
  none.rlim_cur = static_cast<rlim_t>(probe);  // no new descriptor
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &none), 0);
  std::vector<uint8_t> blob;
  const Status newest = eng->LoadCheckpoint(ckpt.path(), "", &blob);
  const Status tagged = eng->LoadCheckpoint(ckpt.path(), "a", &blob);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  for (const Status& st : {newest, tagged}) {
    EXPECT_EQ(st.code(), Code::kIo) << st.ToString();
    EXPECT_NE(st.message().find(std::strerror(EMFILE)), std::string::npos) << st.message();
  }
  EXPECT_EQ(Master(), before) << "a refused load changed the state";
  ASSERT_TRUE(eng->LoadCheckpoint(ckpt.path(), "", &blob).ok());
  EXPECT_EQ(std::string(blob.begin(), blob.end()), "xy");
}

// A full disk during save (the file size limit stands in for it): a clear
// error, nothing left behind, and the previous checkpoint still loads.
TEST_P(CorruptCheckpoint, FullDiskDuringSaveKeepsThePreviousCheckpoint) {
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

// Nothing saved yet is NOT_FOUND, so that a trainer can tell it from damage.
TEST_P(CorruptCheckpoint, NothingSavedIsNotFound) {
  std::vector<uint8_t> blob;
  TempDir empty;
  for (const std::string& dir : {empty.path() + "/absent", empty.path()}) {
    Status st = eng->LoadCheckpoint(dir, "", &blob);
    EXPECT_EQ(st.code(), Code::kNotFound) << st.ToString();
    EXPECT_NE(st.message().find(dir), std::string::npos) << st.message();
  }
  Status st = eng->LoadCheckpoint(ckpt.path(), "b", &blob);
  EXPECT_EQ(st.code(), Code::kNotFound) << st.ToString();
  EXPECT_NE(st.message().find(ckpt.path() + "/b"), std::string::npos) << st.message();
  EXPECT_EQ(Master(), before);
  // A tag folder that is there but lacks its manifest is damage, not absence.
  std::filesystem::create_directory(empty.path() + "/t");
  EXPECT_EQ(eng->LoadCheckpoint(empty.path(), "t", &blob).code(), Code::kCorrupt);
  EXPECT_EQ(std::string(CodeName(Code::kNotFound)), "NOT_FOUND");
}

TEST_P(CorruptCheckpoint, ExistingTagAndBadTagsAreRefused) {
  EXPECT_EQ(eng->SaveCheckpoint(ckpt.path(), "a", nullptr, 0).code(), Code::kInvalid);
  EXPECT_EQ(eng->SaveCheckpoint(ckpt.path(), "../x", nullptr, 0).code(), Code::kInvalid);
  EXPECT_EQ(eng->SaveCheckpoint(ckpt.path(), "latest", nullptr, 0).code(), Code::kInvalid);
  // latest's own temporary: before, the save published DIR/latest.tmp and
  // then failed (EISDIR) updating latest, and so did every later save there.
  EXPECT_EQ(eng->SaveCheckpoint(ckpt.path(), "latest.tmp", nullptr, 0).code(), Code::kInvalid);
  EXPECT_FALSE(std::filesystem::exists(ckpt.path() + "/latest.tmp"));
  Status later = eng->SaveCheckpoint(ckpt.path(), "c", nullptr, 0);
  EXPECT_TRUE(later.ok()) << later.ToString();
}

// latest's temporary left as a symlink to another of the user's files (a
// folder others may write, or a stale link): the save replaces the link,
// never writes through it (before, O_TRUNC emptied the target and wrote the
// tag into it).
TEST_P(CorruptCheckpoint, ASaveNeverWritesThroughALinkAtItsTemporaryName) {
  TempDir other;
  const std::string victim = other.path() + "/notes.txt";
  std::ofstream(victim) << "keep me\n";
  ASSERT_EQ(::symlink(victim.c_str(), (ckpt.path() + "/latest.tmp").c_str()), 0);
  Status st = eng->SaveCheckpoint(ckpt.path(), "c", nullptr, 0);
  ASSERT_TRUE(st.ok()) << st.ToString();
  std::string text;
  std::getline(std::ifstream(victim), text);
  EXPECT_EQ(text, "keep me");
  std::string latest;
  std::getline(std::ifstream(ckpt.path() + "/latest"), latest);
  EXPECT_EQ(latest, "c");
}

// The small files are checked before they are read: a FIFO in trainer.bin's
// place is CORRUPT at once (before, the load blocked on it for good; a link
// to /dev/zero read until memory ran out).
TEST_P(CorruptCheckpoint, ASmallFileThatIsNoFileIsRefusedUnread) {
  const std::string p = ckpt.path() + "/a/trainer.bin";
  ASSERT_EQ(std::remove(p.c_str()), 0);
  ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0);
  ExpectRefused("trainer.bin");
}

// Item: the manifest checks itself. One flipped digit of the step count
// (the checksum no longer matches) is CORRUPT, not a wrong step count.
TEST_P(CorruptCheckpoint, FlippedStepInManifest) {
  const std::string p = ckpt.path() + "/a/manifest.json";
  std::ifstream in(p);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  const auto at = text.find("\"step\": 1");
  ASSERT_NE(at, std::string::npos) << text;
  text[at + 8] = '3';
  std::ofstream(p) << text;
  ExpectRefused("manifest.json");
}

// Fields that address data or drive training are checked even when the
// checksum matches (a writer's bug): a loss scale of 0, a negative step,
// a block past its file, overlapping blocks.
TEST_P(CorruptCheckpoint, ImpossibleFieldsAreRefused) {
  struct Case {
    const char* needle;
    std::function<void(nlohmann::json&)> edit;
  };
  const std::vector<Case> cases = {
      {"loss_scaler.scale", [](nlohmann::json& m) { m["loss_scaler"]["scale"] = 0.0; }},
      {"step", [](nlohmann::json& m) { m["step"] = -4; }},
      // (the next step's count would overflow int64)
      {"step", [](nlohmann::json& m) { m["step"] = uint64_t{9223372036854775807u}; }},
      {"steps", [](nlohmann::json& m) { m["groups"][0]["steps"] = uint64_t{9223372036854775807u}; }},
      {"blocks", [](nlohmann::json& m) { m["files"][0]["blocks"][0]["offset"] = m["files"][0]["bytes"].get<uint64_t>(); }},
      {"blocks", [](nlohmann::json& m) { m["files"][0]["blocks"][1]["offset"] = m["files"][0]["blocks"][0]["offset"]; }},
      {"shard_numel", [](nlohmann::json& m) { m["groups"][1]["shard_numel"] = 8; }},
  };
  const std::string p = ckpt.path() + "/a/manifest.json";
  std::ifstream in(p);
  const std::string orig((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  for (const Case& c : cases) {
    std::ofstream(p) << orig;
    EditManifest(c.edit);
    SCOPED_TRACE(c.needle);
    ExpectRefused("manifest.json");
  }
  std::ofstream(p) << orig;
  ExpectStepsAsFresh();
}

// A saved loss scale drives only a dynamic fp16 scaler: this engine (fp32,
// or bf16 in compact) keeps its scale of 1 whatever the checkpoint says.
// Before, a scale of 65536 from an fp16 run was taken and divided every
// later gradient by it, silently, for good.
TEST_P(CorruptCheckpoint, ASavedLossScaleDrivesOnlyADynamicScaler) {
  EditManifest([](nlohmann::json& m) {
    m["loss_scaler"]["scale"] = 65536.0;
    m["loss_scaler"]["hysteresis_left"] = 2147483647;
  });
  std::vector<uint8_t> blob;
  Status st = eng->LoadCheckpoint(ckpt.path(), "", &blob);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(eng->steps_applied(), 1);
  EXPECT_EQ(eng->loss_scale(), 1.0) << "the checkpoint's scale was taken by an engine without fp16";
}

// A manifest written before manifests carried a checksum still loads.
TEST_P(CorruptCheckpoint, UnsealedManifestLoads) {
  EditManifest([](nlohmann::json& m) { m.erase("save_seq"); }, /*reseal=*/false);
  std::vector<uint8_t> blob;
  Status st = eng->LoadCheckpoint(ckpt.path(), "", &blob);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(eng->steps_applied(), 1);
}

// Item: the load is all or nothing. A manifest that lacks the last group's
// last block (the old load wrote every earlier block, then failed) is
// refused before anything changes, and the next step is a fresh engine's.
TEST_P(CorruptCheckpoint, LateFailureLeavesTheEngineAsItWas) {
  EditManifest([](nlohmann::json& m) {
    auto& blocks = m["files"][0]["blocks"];
    blocks.erase(blocks.size() - 1);
  });
  ExpectRefused("manifest.json");
  ExpectStepsAsFresh();
}

// An I/O error while the state is being written (injected after the first
// group) leaves the engine broken, saying why, until a load succeeds.
TEST_P(CorruptCheckpoint, IoErrorWhileApplyingMarksTheEngineBroken) {
  std::vector<uint8_t> blob;
  ::setenv("STRATA_CHECKPOINT_FAIL_AT", "apply", 1);
  Status st = eng->LoadCheckpoint(ckpt.path(), "", &blob);
  ::unsetenv("STRATA_CHECKPOINT_FAIL_AT");
  EXPECT_EQ(st.code(), Code::kIo) << st.ToString();
  EXPECT_NE(st.message().find("partly written"), std::string::npos) << st.message();
  std::vector<float> w(eng->group_numel(0));
  Status rd = eng->ReadMaster(0, w.data());
  EXPECT_EQ(rd.code(), Code::kState) << rd.ToString();
  EXPECT_NE(rd.message().find("load a checkpoint again"), std::string::npos) << rd.message();
  EXPECT_EQ(eng->Step({}).status().code(), Code::kState);
  EXPECT_EQ(eng->SaveCheckpoint(ckpt.path(), "b", nullptr, 0).code(), Code::kState);
  ASSERT_TRUE(eng->LoadCheckpoint(ckpt.path(), "", &blob).ok());
  TempDir swap2;
  auto twin = NewEngine(swap2.path());
  ASSERT_TRUE(twin && twin->LoadCheckpoint(ckpt.path(), "a", &blob).ok());
  ASSERT_TRUE(TrainOne(*eng));
  ASSERT_TRUE(TrainOne(*twin));
  EXPECT_EQ(Master(), Master(twin.get()));
}

// Item: a save killed between its rename and the update of `latest`. The
// load of "" takes the newest checkpoint; saving the same state under the
// same tag again completes the save; another state under it is refused.
TEST_P(CorruptCheckpoint, LatestOneBehind) {
  ASSERT_TRUE(eng->SaveCheckpoint(ckpt.path(), "b", "b", 1).ok());
  std::ofstream(ckpt.path() + "/latest") << "a\n";  // what the kill leaves
  std::vector<uint8_t> blob;
  ASSERT_TRUE(eng->LoadCheckpoint(ckpt.path(), "", &blob).ok());
  EXPECT_EQ(std::string(blob.begin(), blob.end()), "b");
  EXPECT_EQ(eng->steps_applied(), 2);
  EXPECT_EQ(Master(), before);
  // The trainer that resumed from `latest` (a) and retrains to step 2 saves b again.
  ASSERT_TRUE(eng->LoadCheckpoint(ckpt.path(), "a", &blob).ok());
  ASSERT_TRUE(TrainOne(*eng));
  ASSERT_EQ(Master(), before);
  // The same state with another trainer blob is refused (it would be lost,
  // and a load would hand back the saved one); `latest` stays at a.
  Status st = eng->SaveCheckpoint(ckpt.path(), "b", "c", 1);
  EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
  EXPECT_NE(st.message().find("another trainer blob"), std::string::npos) << st.message();
  {
    std::ifstream still(ckpt.path() + "/latest");
    std::string at;
    still >> at;
    EXPECT_EQ(at, "a");
  }
  st = eng->SaveCheckpoint(ckpt.path(), "b", "b", 1);
  ASSERT_TRUE(st.ok()) << st.ToString();
  std::ifstream latest(ckpt.path() + "/latest");
  std::string tag;
  latest >> tag;
  EXPECT_EQ(tag, "b");
  ASSERT_TRUE(TrainOne(*eng));
  st = eng->SaveCheckpoint(ckpt.path(), "b", "b", 1);
  EXPECT_EQ(st.code(), Code::kInvalid) << st.ToString();
  EXPECT_NE(st.message().find("never overwritten"), std::string::npos) << st.message();
  // a is older than b: re-saving a's state under a is refused too.
  ASSERT_TRUE(eng->LoadCheckpoint(ckpt.path(), "a", &blob).ok());
  EXPECT_EQ(eng->SaveCheckpoint(ckpt.path(), "a", "xy", 2).code(), Code::kInvalid);
}

// Item: a killed save's .TAG.partial goes at the next save into the folder;
// a live save's (its folder flock'ed) stays.
TEST_P(CorruptCheckpoint, AbandonedPartialsAreRemoved) {
  const std::string dead = ckpt.path() + "/.x.partial", live = ckpt.path() + "/.y.partial";
  ASSERT_TRUE(std::filesystem::create_directory(dead));
  ASSERT_TRUE(std::filesystem::create_directory(live));
  std::ofstream(dead + "/rank00000.bin") << "left by a killed save";
  std::ofstream(live + "/rank00000.bin") << "being written";
  const int fd = ::open(live.c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  ASSERT_TRUE(eng->SaveCheckpoint(ckpt.path(), "b", nullptr, 0).ok());
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_TRUE(std::filesystem::exists(live + "/rank00000.bin"));
  ::close(fd);
  EXPECT_TRUE(std::filesystem::exists(ckpt.path() + "/a/manifest.json"));
}

// Item: a killed engine's swap files of every generation go when an engine
// of the same rank starts in the folder; a file some live engine holds stays.
TEST(CheckpointSwap, StaleGenerationsRemovedAtStart) {
  TempDir swap;
  const std::string dead = swap.path() + "/strata-swap.r0.s0.g7.bin", held = swap.path() + "/strata-swap.r0.s0.g9.bin",
                    other = swap.path() + "/strata-swap.r1.s0.g3.bin";
  for (const auto& p : {dead, held, other}) std::ofstream(p) << "old";
  const int fd = ::open(held.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  auto cfg = ParseConfig(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ")" +
                         swap.path() + R"("}}})");
  ASSERT_TRUE(cfg.ok());
  auto e = Engine::Create(*cfg, {});
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  testing::TinyMlp model{2, 16};
  ASSERT_TRUE(model.Register(**e).ok());
  ASSERT_TRUE((*e)->Build().ok());
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_TRUE(std::filesystem::exists(held));
  EXPECT_TRUE(std::filesystem::exists(other));  // rank 1's
  ::close(fd);
}

// The swap file deleted under the engine (another process cleaning the
// folder), or its whole folder: training goes on from the open file, and a
// save copies the state instead of linking the file (every save failed:
// "link ...: No such file or directory", or "statvfs ...").
TEST(CheckpointSwap, ASwapFileDeletedUnderTheEngineIsCopied) {
  for (bool whole_folder : {false, true}) {
    TempDir swap, ckpt;
    const std::string folder = swap.path() + "/swap";
    std::filesystem::create_directories(folder);
    auto cfg = ParseConfig(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ")" +
                           folder + R"("}}})");
    ASSERT_TRUE(cfg.ok());
    auto e = Engine::Create(*cfg, {});
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    testing::TinyMlp model{2, 16};
    ASSERT_TRUE(model.Register(**e).ok());
    ASSERT_TRUE((*e)->Build().ok());
    ASSERT_TRUE(model.TrainStep(**e).ok());
    ASSERT_TRUE((*e)->Step({}).ok());
    if (whole_folder) {
      std::filesystem::remove_all(folder);
    } else {
      for (const auto& f : std::filesystem::directory_iterator(folder)) std::filesystem::remove(f.path());
    }
    ASSERT_TRUE(model.TrainStep(**e).ok());
    ASSERT_TRUE((*e)->Step({}).ok()) << "training goes on from the open file";
    std::vector<float> saved(static_cast<size_t>((*e)->group_numel(0)));
    ASSERT_TRUE((*e)->ReadMaster(0, saved.data()).ok());
    const Status st = (*e)->SaveCheckpoint(ckpt.path(), "t", nullptr, 0);
    ASSERT_TRUE(st.ok()) << (whole_folder ? "folder removed: " : "file removed: ") << st.ToString();
    ASSERT_TRUE(model.TrainStep(**e).ok());
    ASSERT_TRUE((*e)->Step({}).ok());
    ASSERT_TRUE((*e)->LoadCheckpoint(ckpt.path(), "t", nullptr).ok());
    std::vector<float> loaded(saved.size());
    ASSERT_TRUE((*e)->ReadMaster(0, loaded.data()).ok());
    EXPECT_EQ(std::memcmp(saved.data(), loaded.data(), saved.size() * 4), 0) << "the copied checkpoint";
  }
}

// Item: a snapshot (the swap file linked) holds the state, not the swap
// file's reservation: its free ranges are punched out.
TEST_P(CorruptCheckpoint, SnapshotHoldsOnlyTheState) {
  const std::string p = ckpt.path() + "/a/rank00000.bin";
  struct stat st {};
  ASSERT_EQ(::stat(p.c_str(), &st), 0);
  std::ifstream in(ckpt.path() + "/a/manifest.json");
  const nlohmann::json m = nlohmann::json::parse(in);
  uint64_t state = 0;
  for (const auto& b : m["files"][0]["blocks"]) state += b["bytes"].get<uint64_t>();
  const uint64_t on_disk = static_cast<uint64_t>(st.st_blocks) * 512;
  std::printf("checkpoint data file: %llu bytes on disk for %llu bytes of state (size %llu)\n",
              static_cast<unsigned long long>(on_disk), static_cast<unsigned long long>(state),
              static_cast<unsigned long long>(st.st_size));
  EXPECT_LE(on_disk, state + state / 4 + 64 * 1024);
  // Still whole: it loads.
  std::vector<uint8_t> blob;
  ASSERT_TRUE(eng->LoadCheckpoint(ckpt.path(), "a", &blob).ok());
  EXPECT_EQ(eng->steps_applied(), 1);
}

INSTANTIATE_TEST_SUITE_P(StateFormat, Checkpoint, ::testing::Values("fp32", "compact"));
INSTANTIATE_TEST_SUITE_P(StateFormat, CorruptCheckpoint, ::testing::Values("fp32", "compact"));

}  // namespace
}  // namespace strata

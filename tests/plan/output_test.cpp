// strata-plan's output: --json parses (from the binary, too), --svg writes a
// well-formed SVG, and the --auto config is one the engine accepts.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "tools/plan/calibrate.h"
#include "tools/plan/report.h"

namespace strata::plan {
namespace {

std::string g_binary;  // path of strata-plan, from argv

Report OneTrillionOnDgx2() {
  Report r;
  r.model = PresetModel("1t").value();
  r.cluster = PresetCluster("dgx2").value();
  r.layout = MakeLayout(r.model, 16).value();
  r.config = ParseConfig(R"({"bf16": {"enabled": true}})").value();
  r.autoplan = PlanAuto(r.model, r.cluster, r.config, "/nvme").value();
  r.config = r.autoplan->candidates[static_cast<size_t>(r.autoplan->best)].config;
  r.capacity = ComputeCapacity(r.model, r.layout, r.cluster, r.config);
  r.sim = Simulate(r.model, r.layout, r.capacity, r.cluster, r.config, {});
  return r;
}

std::string RunBinary(const std::string& args) {
  std::string out;
  FILE* p = popen((g_binary + " " + args).c_str(), "r");
  if (!p) return out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  EXPECT_EQ(pclose(p), 0) << args;
  return out;
}

// Exit status and stderr of a run (stdout discarded).
int RunStatus(const std::string& args, std::string* err) {
  const std::string errfile = ::testing::TempDir() + "/strata-plan-stderr.txt";
  const int rc = std::system((g_binary + " " + args + " >/dev/null 2>" + errfile).c_str());
  std::ifstream f(errfile);
  err->assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// Element nesting: every opened tag closes in order, one root <svg>.
bool WellFormed(const std::string& s, std::string* why) {
  std::vector<std::string> stack;
  int roots = 0;
  for (size_t i = s.find('<'); i != std::string::npos; i = s.find('<', i + 1)) {
    const size_t end = s.find('>', i);
    if (end == std::string::npos) {
      *why = "unterminated tag";
      return false;
    }
    const std::string tag = s.substr(i + 1, end - i - 1);
    if (tag.starts_with("?") || tag.starts_with("!")) continue;
    if (tag.starts_with("/")) {
      if (stack.empty() || stack.back() != tag.substr(1)) {
        *why = "unexpected </" + tag.substr(1) + ">";
        return false;
      }
      stack.pop_back();
      continue;
    }
    const std::string name = tag.substr(0, tag.find_first_of(" \n/"));
    if (stack.empty()) ++roots;
    if (!tag.ends_with("/")) stack.push_back(name);
    if (std::count(tag.begin(), tag.end(), '"') % 2) {
      *why = "odd quotes in <" + name + ">";
      return false;
    }
  }
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] == '&' && s.compare(i, 5, "&amp;") && s.compare(i, 4, "&lt;") && s.compare(i, 4, "&gt;") &&
        s.compare(i, 6, "&quot;")) {
      *why = "bare &";
      return false;
    }
  if (!stack.empty()) {
    *why = "<" + stack.back() + "> not closed";
    return false;
  }
  if (roots != 1) {
    *why = std::to_string(roots) + " root elements";
    return false;
  }
  return true;
}

TEST(Output, JsonParses) {
  const Report r = OneTrillionOnDgx2();
  const auto j = nlohmann::json::parse(FormatJson(r));
  EXPECT_TRUE(j["capacity"]["fits"].get<bool>());
  EXPECT_EQ(j["placement"]["param"], "nvme");
  EXPECT_EQ(j["placement"]["optimizer"], "nvme");
  EXPECT_GT(j["simulation"]["step_s"].get<double>(), 0);
  EXPECT_EQ(j["auto"]["candidates"].size(), r.autoplan->candidates.size());
  EXPECT_EQ(FormatJson(r), FormatJson(OneTrillionOnDgx2())) << "deterministic";
}

TEST(Output, BinaryJsonParses) {
  const std::string out = RunBinary("--model 1t --cluster dgx2 --auto --json");
  const auto j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out.substr(0, 400);
  EXPECT_TRUE(j["capacity"]["fits"].get<bool>());
  EXPECT_TRUE(j["auto"].contains("config"));
  EXPECT_EQ(out, RunBinary("--model 1t --cluster dgx2 --auto --json"));
}

TEST(Output, SvgIsWellFormed) {
  const std::string svg = FormatSvg(OneTrillionOnDgx2());
  std::string why;
  EXPECT_TRUE(WellFormed(svg, &why)) << why;
  EXPECT_TRUE(svg.starts_with("<?xml"));
  EXPECT_NE(svg.find("<svg xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  EXPECT_EQ(std::count(svg.begin(), svg.end(), '\n') > 20, true);
  for (const char* tier : {">device<", ">host<", ">nvme<"})
    EXPECT_NE(svg.find(tier), std::string::npos) << tier;
  // Names from the input are escaped.
  Report r = OneTrillionOnDgx2();
  r.model.name = "a<b & \"c\"";
  EXPECT_TRUE(WellFormed(FormatSvg(r), &why)) << why;
}

TEST(Output, BinaryWritesSvg) {
  const std::string path = ::testing::TempDir() + "/strata-plan-test.svg";
  const std::string table = RunBinary("--model 13b --cluster dgx-a100 --simulate --svg " + path);
  EXPECT_NE(table.find("simulated step"), std::string::npos) << table;
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string why;
  EXPECT_TRUE(WellFormed(ss.str(), &why)) << why;
  std::remove(path.c_str());
}

// The --auto config goes back through the engine's parser and its checks.
TEST(Output, AutoConfigIsAcceptedByTheEngine) {
  const Report r = OneTrillionOnDgx2();
  auto cfg = ParseConfig(PlanConfigJson(r));
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  ConfigFacts facts;
  facts.largest_group_numel = r.layout.largest_group;
  facts.world_size = r.cluster.world_size();
  facts.has_gpu = true;
  EXPECT_TRUE(ValidateConfig(*cfg, facts).ok()) << ValidateConfig(*cfg, facts).ToString();
  EXPECT_EQ(cfg->zero.offload_param.device, OffloadDevice::kNvme);
}

// Nothing fits: the exit status says so (3), stderr names the tier, and
// --write-config writes nothing rather than a config that cannot run.
TEST(Output, NothingFitsExitsNonZeroAndWritesNoConfig) {
  const std::string path = ::testing::TempDir() + "/strata-plan-nofit.json";
  std::remove(path.c_str());
  std::string err;
  EXPECT_EQ(RunStatus("--model 1t --cluster local --write-config " + path, &err), 3) << err;
  EXPECT_NE(err.find("does not fit"), std::string::npos) << err;
  EXPECT_NE(err.find("needed per rank"), std::string::npos) << err;
  EXPECT_FALSE(std::ifstream(path).good()) << path << " was written";
  EXPECT_EQ(RunStatus("--model small --cluster local --write-config " + path, &err), 0) << err;
  EXPECT_TRUE(std::ifstream(path).good());
  std::remove(path.c_str());
  // 13b on one rank with 24 GiB of host memory: fp32's step slots fit
  // nowhere (22.27 GiB of 21.60), compact's do (12.01); --auto keeps the
  // user's format (exit 3, nothing written) and names the fit.
  const std::string cluster = ::testing::TempDir() + "/strata-plan-24g.json";
  std::ofstream(cluster) << R"({"preset": "local", "host_memory": "24GiB", "device_memory": "6GiB"})";
  EXPECT_EQ(RunStatus("--model 13b --cluster " + cluster + " --auto --write-config " + path, &err), 3) << err;
  EXPECT_NE(err.find("nothing fits"), std::string::npos) << err;
  EXPECT_NE(err.find("with strata.state_format \"compact\" stage 3, P nvme, W/M/V nvme"), std::string::npos)
      << err;
  EXPECT_FALSE(std::ifstream(path).good()) << path << " was written";
  std::remove(cluster.c_str());
}

// A plan names only resources that exist: on a machine without a GPU the
// compute resource is the CPU layers, never "gpu".
TEST(Output, NoGpuNamedWithoutAGpu) {
  const std::string table = RunBinary("--model small --cluster local --simulate");
  EXPECT_EQ(table.find("gpu"), std::string::npos) << table;
  EXPECT_NE(table.find("cpu_layers"), std::string::npos) << table;
  const std::string with_gpu = RunBinary("--model 13b --cluster dgx-a100 --simulate");
  EXPECT_NE(with_gpu.find(" gpu "), std::string::npos) << with_gpu;
}

// The plan shows what strata.state_format saves: with the default fp32 the
// table and the JSON give compact's bytes and step beside fp32's, and --auto
// searches both but keeps the user's format in the config it writes.
TEST(Output, StateFormatComparison) {
  const std::string table = RunBinary("--model 1t --cluster dgx2 --auto");
  EXPECT_NE(table.find("W/M/V on nvme (fp32)"), std::string::npos) << table;
  EXPECT_NE(table.find("state format fp32; compact"), std::string::npos) << table;
  EXPECT_NE(table.find("nvme per rank"), std::string::npos) << table;
  EXPECT_NE(table.find("--auto with compact: stage 3, P nvme, W/M/V nvme"), std::string::npos) << table;
  const auto j = nlohmann::json::parse(RunBinary("--model 1t --cluster dgx2 --auto --json"));
  ASSERT_TRUE(j.contains("state_format")) << j.dump(2).substr(0, 400);
  EXPECT_EQ(j["placement"]["state_format"], "fp32");
  EXPECT_EQ(j["auto"]["config"]["strata"]["state_format"], "fp32") << "--auto keeps the format";
  const auto& other = j["state_format"]["other"];
  EXPECT_EQ(other["format"], "compact");
  EXPECT_TRUE(other["fits"].get<bool>());
  EXPECT_LT(other["used"]["nvme"].get<double>(),
            0.6 * j["capacity"]["per_rank"]["nvme"]["used"].get<double>());
  EXPECT_LT(other["step_s"].get<double>(), j["simulation"]["step_s"].get<double>());
  // --auto searches the placement fp32 chose too, so compact's best is no slower there.
  EXPECT_LE(other["auto"]["step_s"].get<double>(), other["step_s"].get<double>());

  // Planned in compact (from the config): the rows still read fp32 -> compact.
  const std::string cfg = ::testing::TempDir() + "/strata-plan-compact.json";
  const std::string out = ::testing::TempDir() + "/strata-plan-compact-out.json";
  std::ofstream(cfg) << R"({"bf16": {"enabled": true}, "strata": {"state_format": "compact"}})";
  const auto c = nlohmann::json::parse(RunBinary("--model 1t --cluster dgx2 --auto --json --config " + cfg));
  EXPECT_EQ(c["placement"]["state_format"], "compact");
  EXPECT_EQ(c["state_format"]["other"]["format"], "fp32");
  EXPECT_GE(c["state_format"]["other"]["step_s"].get<double>(), j["simulation"]["step_s"].get<double>());
  EXPECT_EQ(c["simulation"]["step_s"], other["auto"]["step_s"]);
  EXPECT_EQ(c["state_format"]["other"]["auto"]["step_s"], j["simulation"]["step_s"]);
  RunBinary("--model 1t --cluster dgx2 --auto --config " + cfg + " --write-config " + out);
  auto written = LoadConfigFile(out);
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  EXPECT_EQ(written->strata.state_format, "compact");
  const std::string text = RunBinary("--model 1t --cluster dgx2 --auto --config " + cfg);
  EXPECT_NE(text.find("state format compact; against fp32"), std::string::npos) << text;
  EXPECT_NE(text.find("--auto with fp32: stage 3"), std::string::npos) << text;
  std::remove(cfg.c_str());
  std::remove(out.c_str());

  // Adagrad has no compact kernel: the plan says so instead of a comparison.
  std::ofstream(cfg) << R"({"bf16": {"enabled": true}, "optimizer": {"type": "Adagrad"}})";
  const std::string adagrad = RunBinary("--model small --cluster local --simulate --config " + cfg);
  EXPECT_NE(adagrad.find("state format fp32 (compact is refused with adagrad)"), std::string::npos)
      << adagrad;
  std::remove(cfg.c_str());
}

// The overlapped step's figures: the table and the JSON give the exposed and
// iteration times with and without overlap, the replay rate they assume
// (--replay-rate, refused outside 0..1) and the memory speculation holds.
TEST(Output, OverlapFiguresAndReplayRate) {
  const std::string cfg = ::testing::TempDir() + "/strata-plan-clip.json";
  std::ofstream(cfg) << R"({"bf16": {"enabled": true}, "gradient_clipping": 1.0,
                           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})";
  const std::string args =
      "--model gpt2-xl --cluster dgx-a100 --gpus-per-node 1 --seq 1024 --micro-batch 16 "
      "--simulate --overlap-step --config " +
      cfg;
  const std::string table = RunBinary(args);
  EXPECT_NE(table.find("overlapped step (speculative), replay rate 0.05, speculation auto (speculates 94% of steps): "
                       "exposed"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("without overlap: exposed"), std::string::npos) << table;
  EXPECT_NE(table.find("host backups"), std::string::npos) << table;
  EXPECT_NE(table.find("\nspec "), std::string::npos) << "the capacity table's speculation row\n" << table;
  EXPECT_EQ(RunBinary(args.substr(0, args.find(" --overlap-step")) + " --config " + cfg).find("\nspec "),
            std::string::npos)
      << "no row without the overlapped step";
  const auto j = nlohmann::json::parse(RunBinary(args + " --json --replay-rate 0.25"));
  const auto& sim = j["simulation"];
  ASSERT_TRUE(sim.contains("overlap")) << sim.dump(2);
  const auto& o = sim["overlap"];
  EXPECT_EQ(o["replay_rate"].get<double>(), 0.25);
  EXPECT_EQ(j["placement"]["replay_rate"].get<double>(), 0.25);
  const double committed = o["committed"]["exposed_s"], replayed = o["replayed"]["exposed_s"];
  const double plain = sim["without_overlap"]["exposed_s"];
  // The default policy ("auto"): S = 0.75 (0.75^3 + 3 x 0.25 x 0.75^2) of the steps speculate.
  const double s = 0.75 * (0.421875 + 0.421875);
  EXPECT_EQ(o["speculation"].get<std::string>(), "auto");
  EXPECT_NEAR(o["speculated_rate"].get<double>(), s, 1e-12);
  EXPECT_NEAR(o["exposed_s"].get<double>(), s * 0.75 * committed + s * 0.25 * replayed + (1 - s) * plain, 1e-9);
  EXPECT_EQ(o["exposed_s"], sim["exposed_s"]);
  EXPECT_EQ(o["iteration_s"], sim["step_s"]);
  EXPECT_LT(o["exposed_s"].get<double>(), sim["without_overlap"]["exposed_s"].get<double>());
  EXPECT_LT(o["iteration_s"].get<double>(), sim["without_overlap"]["iteration_s"].get<double>());
  // gpt2-xl's W, M, V in fp32: 12 bytes a parameter, each group's backup 64-byte aligned.
  const Layout l = MakeLayout(PresetModel("gpt2-xl").value(), 1).value();
  uint64_t want = 0;
  for (uint64_t n : l.group_shard) want += 3 * ((4 * n + 63) / 64 * 64);
  EXPECT_EQ(o["host_bytes_needed"].get<uint64_t>(), want);
  EXPECT_EQ(o["host_bytes"].get<uint64_t>(), want);
  EXPECT_EQ(j["capacity"]["per_rank"]["host"]["bytes"]["spec"].get<uint64_t>(), want);
  EXPECT_EQ(o["disk_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(o["speculated_groups"], o["groups"]);
  std::string err;
  EXPECT_NE(RunStatus(args + " --replay-rate 1.5", &err), 0);
  EXPECT_NE(err.find("--replay-rate"), std::string::npos) << err;
  EXPECT_NE(RunStatus(args + " --replay-rate -0.1", &err), 0);
  EXPECT_NE(err.find("--replay-rate"), std::string::npos) << err;
  std::remove(cfg.c_str());
}

// The README's overlapped-step examples (tools/plan/examples/) load, and
// show what the README says of them: Llama 2 70B's 68,976,648,192
// parameters; on a DGX H100 with W, M, V on the host and clipping at 1.0,
// the overlap hides most of the update at 4 x 4096 tokens a GPU and costs
// more than it hides at 1 x 4096 (the backups' memcpy); --auto picks it
// only in the first case.
TEST(Output, ReadmeOverlapExamples) {
  const std::string root = std::string(__FILE__).substr(0, std::string(__FILE__).rfind("/tests/plan/"));
  const std::string dir = root + "/tools/plan/examples/";
  auto m = LoadModelFile(dir + "llama2-70b.json");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->total_numel(), 68976648192u);
  for (const char* f : {"host-clip.json", "clip.json"}) {
    auto c = LoadConfigFile(dir + f);
    ASSERT_TRUE(c.ok()) << f << ": " << c.status().ToString();
    EXPECT_EQ(c->gradient_clipping, 1.0) << f;
  }
  const std::string base = "--model " + dir + "llama2-70b.json --cluster dgx-h100 --json ";
  const auto run = [&](const std::string& args) { return nlohmann::json::parse(RunBinary(base + args)); };
  const auto long_bwd = run("--config " + dir + "host-clip.json --micro-batch 4 --simulate --overlap-step");
  const auto short_bwd = run("--config " + dir + "host-clip.json --simulate --overlap-step");
  const auto& l = long_bwd["simulation"];
  EXPECT_LT(l["overlap"]["exposed_s"].get<double>(), 0.2 * l["without_overlap"]["exposed_s"].get<double>());
  EXPECT_LT(l["overlap"]["iteration_s"].get<double>(), l["without_overlap"]["iteration_s"].get<double>());
  const auto& s = short_bwd["simulation"];
  EXPECT_GT(s["overlap"]["iteration_s"].get<double>(), s["without_overlap"]["iteration_s"].get<double>());
  EXPECT_TRUE(
      run("--config " + dir + "clip.json --micro-batch 4 --auto")["placement"]["overlap_step"].get<bool>());
  EXPECT_FALSE(run("--config " + dir + "clip.json --auto")["placement"]["overlap_step"].get<bool>());
}

// What --calibrate writes is a cluster file that --cluster reads back.
TEST(Output, CalibrationJsonRoundTrips) {
  Calibration c;
  c.nvme_read_Bps = 2.5e9;
  c.nvme_write_Bps = 1.25e9;
  c.cpu_adam_eps = 7e8;
  c.cpu_compact_adam_eps = 4e8;
  c.host_mem_Bps = 2e10;
  c.checksum_Bps = 9e9;
  c.dir_free_bytes = 1ull << 40;
  auto back = ParseClusterJson(CalibrationJson(c));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  const ClusterSpec want = CalibratedCluster(c);
  EXPECT_EQ(back->nvme_read_Bps, want.nvme_read_Bps);
  EXPECT_EQ(back->nvme_write_Bps, want.nvme_write_Bps);
  EXPECT_EQ(back->cpu_adam_eps, want.cpu_adam_eps);
  EXPECT_EQ(back->cpu_compact_adam_eps, 4e8);
  EXPECT_EQ(back->checksum_Bps, want.checksum_Bps);
  EXPECT_EQ(back->nvme_bytes(), 1ull << 40);
  EXPECT_EQ(back->has_gpu, want.has_gpu);
  EXPECT_FALSE(ParseClusterJson(R"({"gpus_per_nod": 8})").ok()) << "a misspelled key is refused";
}

// A plan divides by every rate and multiplies nodes by GPUs into a 32-bit
// world: a zero rate, a fractional or wrapping count, or a size past 2^60 is
// refused naming its key, in the file and on the command line.
TEST(Output, ClusterValuesAreCheckedByKey) {
  struct Case {
    const char* json;
    const char* names;
  };
  const Case refused[] = {
      {R"({"nvme_read": 0})", "cluster.nvme_read: a rate must be above 0"},
      {R"({"cpu_adam_rate": "0B"})", "cluster.cpu_adam_rate: a rate must be above 0"},
      {R"({"gpu_tflops": 0})", "cluster.gpu_tflops"},
      {R"({"gpu_efficiency": 0})", "cluster.gpu_efficiency"},
      {R"({"nvme_mixed_factor": 0})", "cluster.nvme_mixed_factor"},
      {R"({"nodes": 1.5})", "cluster.nodes: expected a whole number"},
      {R"({"nvme_drives": 4294967297})", "cluster.nvme_drives: expected a whole number"},
      {R"({"nodes": 65536, "gpus_per_node": 65537})", "65536 x 65537 = 4295032832 ranks"},
      {R"({"device_memory": 1e30})", "cluster.device_memory: expected a size"},
      {R"({"nvme_drives": 1024, "nvme_drive_capacity": 1152921504606846976})", "nvme_drives x nvme_drive_capacity"},
      {R"({"cpu_layers": [{"hidden": 1e30, "block_flops": 1, "head_flops": 1}]})", "cpu_layers[0].hidden"},
  };
  for (const Case& c : refused) {
    auto r = ParseClusterJson(c.json);
    ASSERT_FALSE(r.ok()) << c.json << " was accepted";
    EXPECT_NE(r.status().ToString().find(c.names), std::string::npos) << c.json << ": " << r.status().ToString();
  }
  // 0 for the compact Adam's rate means "unknown" (the presets); no NVMe drives is a machine.
  auto ok = ParseClusterJson(R"({"cpu_compact_adam_rate": 0, "nvme_drives": 0, "nodes": 2, "gpus_per_node": 8})");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->world_size(), 16u);
  std::string err;
  EXPECT_NE(RunStatus("--model small --cluster local --nodes 65536 --gpus-per-node 65537", &err), 0) << err;
  EXPECT_NE(err.find("4295032832 ranks"), std::string::npos) << err;
}

}  // namespace
}  // namespace strata::plan

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc > 1) strata::plan::g_binary = argv[1];
  return RUN_ALL_TESTS();
}

// strata-export: a small engine's checkpoint exported as f32 and bf16 and read
// back by hand with numpy (check_safetensors.py) equals the engine's gathered
// master weights; a 3-rank checkpoint of the same weights (written here in
// the manifest's general form) exports the same; a corrupt or truncated data
// file is refused with a message naming it, and no output is left behind. A
// frozen group (freeze_group: its parameters saved alone, in bf16) exports
// as its read_master gives it.
// Usage: export_test STRATA_EXPORT CHECK_SAFETENSORS_PY (exit 77 without numpy)
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "engine/engine.h"
#include "engine/format/manifest.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;
std::string g_export, g_checker;

struct Tensor {
  int group;
  std::string name;
  uint64_t numel;
};

// Odd sizes so that every group is padded; registered out of group order.
const std::vector<Tensor> kTensors = {
    {2, "lm_head.weight", 5000},          {0, "embed.weight", 7000},        {0, "embed.bias", 13},
    {1, "blocks.0.attn.qkv.weight", 4099}, {1, "blocks.0.ln_1.weight", 33}, {1, "blocks.0.ln_1.bias", 33},
    {2, "edge.values", 64},
};

// Bit patterns that test bf16 rounding: ties to even (down and up), a
// subnormal tie, the largest float (rounds to infinity). Their gradients
// are zero and weight decay is off, so the step leaves them as they are.
const uint32_t kEdgeBits[] = {0x3F808000u, 0x3F818000u, 0xBF808000u, 0x00008000u, 0x7F7FFFFFu, 0x7F7F8000u, 0x3F80FFFFu};

struct Saved {
  testing::TempDir swap, dir;
  std::vector<std::vector<float>> master;  // per group, from ReadMaster
  std::string ref_json, ref_bin;           // the reference for check_safetensors.py
  int64_t step = 0;
};

std::string Config(const std::string& swap, const std::string& format) {
  return R"({"bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("},
      "offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"("}},
    "strata": {"device_budget": "1MiB", "host_budget": "8MiB", "state_format": ")" + format + R"("}})";
}

std::vector<float> Init(const Tensor& t, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 0.1f);
  std::vector<float> v(t.numel);
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = t.name == "edge.values" ? BitsF32(kEdgeBits[i % std::size(kEdgeBits)] + static_cast<uint32_t>(i / 7 * 0x10000))
                                   : nd(rng);
  return v;
}

// Trains two steps, saves DIR/step2, reads the master weights back.
// `frozen`: group 1 is frozen (it takes no gradients).
void MakeCheckpoint(Saved& s, const std::string& format, bool frozen = false) {
  auto cfg = ParseConfig(Config(s.swap.path(), format));
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  EngineOptions opt;
  opt.force_no_gpu = true;
  auto e = Engine::Create(*cfg, opt);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& eng = **e;
  std::mt19937_64 rng(7);
  for (const Tensor& t : kTensors) ASSERT_TRUE(eng.AddParam(t.group, t.name, t.numel, Init(t, rng).data()).ok());
  if (frozen) {
    ASSERT_TRUE(eng.FreezeGroup(1).ok());
  }
  ASSERT_TRUE(eng.Build().ok());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int step = 0; step < 2; ++step) {
    for (int g = 0; g < eng.num_groups(); ++g) {
      std::vector<float> grads(eng.group_numel(g));
      for (auto& x : grads) x = nd(rng);
      if (g == 2) std::fill(grads.begin() + 5000, grads.end(), 0.0f);  // edge.values
      if (frozen && g == 1) continue;
      ASSERT_TRUE(eng.Grads(g, grads.data(), DType::kF32).ok());
    }
    auto r = eng.Step({});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  const int blob = 2;
  Status st = eng.SaveCheckpoint(s.dir.path(), "step2", &blob, sizeof blob);
  ASSERT_TRUE(st.ok()) << st.ToString();
  s.step = eng.steps_applied();
  for (int g = 0; g < eng.num_groups(); ++g) {
    s.master.emplace_back(eng.group_numel(g));
    ASSERT_TRUE(eng.ReadMaster(g, s.master.back().data()).ok());
  }
}

// REF.json / REF.bin: every tensor's gathered master weights, in registration order.
void WriteReference(Saved& s) {
  std::vector<uint64_t> next(s.master.size(), 0);
  Json ref = Json::array();
  std::ofstream bin(s.dir.path() + "/ref.bin", std::ios::binary);
  uint64_t at = 0;
  for (const Tensor& t : kTensors) {
    const uint64_t off = next[static_cast<size_t>(t.group)];
    next[static_cast<size_t>(t.group)] += t.numel;
    bin.write(reinterpret_cast<const char*>(s.master[static_cast<size_t>(t.group)].data() + off), static_cast<std::streamsize>(t.numel * 4));
    ref.push_back({{"name", t.name}, {"numel", t.numel}, {"at", at}});
    at += t.numel;
  }
  std::ofstream(s.dir.path() + "/ref.json") << ref.dump();
  s.ref_json = s.dir.path() + "/ref.json";
  s.ref_bin = s.dir.path() + "/ref.bin";
}

std::unique_ptr<Saved> g_saved, g_saved_compact, g_saved_frozen[2];  // made by the first test that needs one

// strata.state_format "fp32" (the default) or "compact"; `frozen`: group 1 frozen.
Saved& Checkpoint(const std::string& format = "fp32", bool frozen = false) {
  std::unique_ptr<Saved>& saved =
      frozen ? g_saved_frozen[format == "compact"] : format == "compact" ? g_saved_compact : g_saved;
  if (!saved) {
    saved = std::make_unique<Saved>();
    MakeCheckpoint(*saved, format, frozen);
    WriteReference(*saved);
  }
  return *saved;
}

struct Run {
  int code = -1;
  std::string out, err;
};

Run Sh(const std::string& cmd) {
  const std::string o = "/tmp/export_test." + std::to_string(::getpid());
  const int rc = std::system((cmd + " >" + o + ".out 2>" + o + ".err").c_str());
  Run r;
  r.code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  auto slurp = [](const std::string& p) {
    std::stringstream ss;
    ss << std::ifstream(p).rdbuf();
    fs::remove(p);
    return ss.str();
  };
  r.out = slurp(o + ".out");
  r.err = slurp(o + ".err");
  return r;
}

Run Export(const std::string& ckpt, const std::string& out, const std::string& dtype) {
  return Sh(g_export + " '" + ckpt + "' '" + out + "' --dtype " + dtype);
}

// Exports `ckpt` as f32 and bf16 and checks both against the reference.
void ExpectExportsEqual(const std::string& ckpt, const Saved& s) {
  for (const std::string dt : {"f32", "bf16"}) {
    const std::string out = s.dir.path() + "/model." + dt + ".safetensors";
    Run r = Export(ckpt, out, dt);
    ASSERT_EQ(r.code, 0) << r.err;
    Run c = Sh("/usr/bin/python3 " + g_checker + " '" + out + "' " + dt + " '" + s.ref_json + "' '" + s.ref_bin + "'");
    EXPECT_EQ(c.code, 0) << ckpt << " " << dt << ": " << c.out << c.err;
    fs::remove(out);
  }
}

std::string Hex(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

// The same weights as a checkpoint of `world` shards saved by `world_size` ranks in the manifest's general
// form: shard r of group g holds elements [r*S, (r+1)*S) of the padded
// group, padding is NaN (it must never reach the export), the files are
// listed in reverse rank order.
void WriteRankCheckpoint(const Saved& s, const std::string& folder, int world, int world_size) {
  fs::create_directories(folder);
  const Json m0 = Json::parse(std::ifstream(s.dir.path() + "/step2/manifest.json"));
  Json m = m0, files = Json::array();
  m["world_size"] = world_size;
  m["shard_world"] = world;
  std::vector<std::vector<float>> padded;
  for (size_t g = 0; g < s.master.size(); ++g) {
    const uint64_t unit = 2048ull * static_cast<uint64_t>(world);
    const uint64_t p = (s.master[g].size() + unit - 1) / unit * unit;
    m["groups"][g]["padded"] = p;
    m["groups"][g]["shard_numel"] = p / static_cast<uint64_t>(world);
    padded.push_back(s.master[g]);
    padded.back().resize(p, BitsF32(0x7FC0DEADu));
  }
  for (int r = world - 1; r >= 0; --r) {
    char name[32];
    std::snprintf(name, sizeof name, "rank%05d.bin", r);
    std::ofstream f(folder + "/" + name, std::ios::binary);
    Json blocks = Json::array();
    uint64_t off = 0;
    XXH3_state_t* hs = XXH3_createState();
    XXH3_64bits_reset(hs);
    for (size_t g = 0; g < padded.size(); ++g) {
      const uint64_t sn = padded[g].size() / static_cast<uint64_t>(world);
      std::vector<float> w(padded[g].begin() + static_cast<int64_t>(sn) * r, padded[g].begin() + static_cast<int64_t>(sn) * (r + 1));
      std::vector<float> mv(sn, 0.5f);
      for (const char* state : {"W", "M", "V"}) {
        const float* d = std::string(state) == "W" ? w.data() : mv.data();
        f.write(reinterpret_cast<const char*>(d), static_cast<std::streamsize>(sn * 4));
        XXH3_64bits_update(hs, d, sn * 4);
        blocks.push_back({{"group", g}, {"state", state}, {"offset", off}, {"bytes", sn * 4}, {"xxh3", Hex(XXH3_64bits(d, sn * 4))}});
        off += sn * 4;
      }
    }
    files.push_back({{"name", name}, {"rank", r}, {"bytes", off}, {"xxh3", Hex(XXH3_64bits_digest(hs))}, {"blocks", blocks}});
    XXH3_freeState(hs);
  }
  m["files"] = files;
  std::ofstream(folder + "/manifest.json") << manifest::Seal(m.dump());
}

// Flips one byte `at` bytes into the `state` block of `group` in `file` of `folder`.
void FlipInWBlock(const std::string& folder, const std::string& file, int group, uint64_t at,
                  const std::string& state = "W") {
  const Json m = Json::parse(std::ifstream(folder + "/manifest.json"));
  for (const Json& fj : m["files"])
    if (fj["name"] == file)
      for (const Json& b : fj["blocks"])
        if (b["group"] == group && b["state"] == state) {
          std::fstream f(folder + "/" + file, std::ios::in | std::ios::out | std::ios::binary);
          f.seekg(static_cast<std::streamoff>(b["offset"].get<uint64_t>() + at));
          char c = 0;
          f.read(&c, 1);
          c = static_cast<char>(c ^ 0x10);
          f.seekp(static_cast<std::streamoff>(b["offset"].get<uint64_t>() + at));
          f.write(&c, 1);
          return;
        }
  FAIL() << "no " << state << " block of group " << group << " in " << file;
}

void ExpectRefused(const std::string& ckpt, const Saved& s, const std::string& file, const std::string& why) {
  const std::string out = s.dir.path() + "/refused.safetensors";
  Run r = Export(ckpt, out, "f32");
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find(file), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(why), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out));
  EXPECT_FALSE(fs::exists(out + ".partial"));
}

TEST(Export, OneRankF32AndBf16EqualGatheredMaster) {
  Saved& s = Checkpoint();
  ExpectExportsEqual(s.dir.path(), s);                // through DIR/latest
  ExpectExportsEqual(s.dir.path() + "/step2", s);     // the folder itself
}

TEST(Export, MetadataAndOneDimensionalShapes) {
  Saved& s = Checkpoint();
  const std::string out = s.dir.path() + "/meta.safetensors";
  ASSERT_EQ(Export(s.dir.path(), out, "bf16").code, 0);
  std::ifstream f(out, std::ios::binary);
  unsigned char len[8];
  f.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | len[i];
  EXPECT_EQ(n % 8, 0u);
  std::string text(n, ' ');
  f.read(text.data(), static_cast<std::streamsize>(n));
  const Json h = Json::parse(text);
  EXPECT_EQ(h["__metadata__"]["producer"], "strata");
  EXPECT_EQ(h["__metadata__"]["step"], std::to_string(s.step));
  EXPECT_EQ(h["blocks.0.ln_1.bias"]["dtype"], "BF16");
  EXPECT_EQ(h["blocks.0.ln_1.bias"]["shape"], Json::array({33}));
  EXPECT_EQ(fs::file_size(out), 8 + n + (5000 + 7000 + 13 + 4099 + 33 + 33 + 64) * 2);
  fs::remove(out);
}

TEST(Export, ThreeRanksGatheredInRankOrder) {
  Saved& s = Checkpoint();
  const std::string folder = s.dir.path() + "/ranks3/t";
  WriteRankCheckpoint(s, folder, 3, 3);
  ExpectExportsEqual(folder, s);
  FlipInWBlock(folder, "rank00002.bin", 1, 100);
  ExpectRefused(folder, s, folder + "/rank00002.bin", "checksum mismatch");
}

TEST(Export, StageZeroOfFourRanksIsOneShard) {
  Saved& s = Checkpoint();
  const std::string folder = s.dir.path() + "/stage0/t";
  WriteRankCheckpoint(s, folder, 1, 4);
  ExpectExportsEqual(folder, s);
}

// A compact checkpoint: the masters rebuilt from their bf16 halves and
// corrections, exactly as the engine reads them back; a flipped bit refused.
TEST(Export, CompactCheckpointEqualsGatheredMaster) {
  Saved& s = Checkpoint("compact");
  ExpectExportsEqual(s.dir.path(), s);
  const std::string folder = s.dir.path() + "/corrupt";
  fs::copy(s.dir.path() + "/step2", folder, fs::copy_options::recursive);
  FlipInWBlock(folder, "rank00000.bin", 1, 2 * 4099 + 1);  // a bf16 half inside blocks.0.ln_1.weight
  ExpectRefused(folder, s, folder + "/rank00000.bin", "checksum mismatch");
}

// A frozen group's P block (bf16, the compute dtype) is exported widened,
// as read_master gives it, beside the masters of the others; in both state
// formats. A flipped bit in it is refused.
TEST(Export, FrozenGroupExportsItsParameters) {
  for (const char* format : {"fp32", "compact"}) {
    Saved& s = Checkpoint(format, /*frozen=*/true);
    const Json m = Json::parse(std::ifstream(s.dir.path() + "/step2/manifest.json"));
    ASSERT_EQ(m["groups"][1].value("frozen", false), true) << format;
    ExpectExportsEqual(s.dir.path(), s);
    for (float x : s.master[1]) ASSERT_EQ(x, BF16ToF32(F32ToBF16(x))) << "the frozen group holds bf16 values";
    const std::string folder = s.dir.path() + "/corrupt";
    fs::copy(s.dir.path() + "/step2", folder, fs::copy_options::recursive);
    FlipInWBlock(folder, "rank00000.bin", 1, 2 * 4099 + 1, "P");  // inside blocks.0.ln_1.weight
    ExpectRefused(folder, s, folder + "/rank00000.bin", "checksum mismatch");
    fs::remove_all(folder);
  }
}

TEST(Export, RefusesCorruptBlock) {
  Saved& s = Checkpoint();
  const std::string folder = s.dir.path() + "/corrupt";
  fs::copy(s.dir.path() + "/step2", folder, fs::copy_options::recursive);
  FlipInWBlock(folder, "rank00000.bin", 1, 4 * 4099 + 3);  // inside blocks.0.ln_1.weight
  ExpectRefused(folder, s, folder + "/rank00000.bin", "checksum mismatch");
}

TEST(Export, RefusesTruncatedFile) {
  Saved& s = Checkpoint();
  const std::string folder = s.dir.path() + "/truncated";
  fs::copy(s.dir.path() + "/step2", folder, fs::copy_options::recursive);
  // Half of what the manifest says the file holds (a snapshot's file is the
  // whole swap file, larger than the blocks it lists).
  const Json m = Json::parse(std::ifstream(folder + "/manifest.json"));
  fs::resize_file(folder + "/rank00000.bin", m["files"][0]["bytes"].get<uint64_t>() / 2);
  ExpectRefused(folder, s, folder + "/rank00000.bin", "truncated");
}

TEST(Export, RefusesMissingRankAndBadUsage) {
  Saved& s = Checkpoint();
  const std::string folder = s.dir.path() + "/missing/t";
  WriteRankCheckpoint(s, folder, 2, 2);
  Json m = Json::parse(std::ifstream(folder + "/manifest.json"));
  m["files"].erase(0);  // rank 1's entry
  std::ofstream(folder + "/manifest.json") << manifest::Seal(m.dump());
  ExpectRefused(folder, s, folder + "/manifest.json", "1 data files for 2 shards");
  std::ofstream(folder + "/manifest.json") << m.dump();  // the same, not resealed: the checksum says so
  ExpectRefused(folder, s, folder + "/manifest.json", "does not match");
  EXPECT_EQ(Export(s.dir.path(), s.dir.path() + "/x.safetensors", "f16").code, 2);
  EXPECT_EQ(Export(s.dir.path() + "/nope", s.dir.path() + "/x.safetensors", "f32").code, 1);
}

// The safetensors header and data section of an exported file.
std::pair<Json, std::string> ReadExport(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(all[static_cast<size_t>(i)]);
  return {Json::parse(all.substr(8, n)), all.substr(8 + n)};
}

// A copy of step2 whose manifest gives some tensors a shape, resealed.
std::string ShapedCopy(const Saved& s, const std::string& name, const std::map<std::string, Json>& shapes) {
  const std::string folder = s.dir.path() + "/" + name;
  fs::copy(s.dir.path() + "/step2", folder, fs::copy_options::recursive);
  Json m = Json::parse(std::ifstream(folder + "/manifest.json"));
  for (auto& g : m["groups"])
    for (auto& t : g["tensors"]) {
      EXPECT_FALSE(t.contains("shape")) << "registered by numel: no shape";
      auto it = shapes.find(t["name"].get<std::string>());
      if (it != shapes.end()) t["shape"] = it->second;
    }
  std::ofstream(folder + "/manifest.json") << manifest::Seal(m.dump());
  return folder;
}

TEST(Export, TensorsInTheirManifestShapes) {
  Saved& s = Checkpoint();
  const std::string folder = ShapedCopy(s, "shaped",
                                        {{"embed.weight", {70, 100}},
                                         {"lm_head.weight", {10, 50, 10}},
                                         {"embed.bias", {13}},
                                         {"blocks.0.ln_1.bias", {1, 33, 1}}});
  const std::string flat_out = s.dir.path() + "/flat.safetensors",
                    shaped_out = s.dir.path() + "/shaped.safetensors";
  ASSERT_EQ(Export(s.dir.path() + "/step2", flat_out, "f32").code, 0);
  ASSERT_EQ(Export(folder, shaped_out, "f32").code, 0);
  const auto [flat_h, flat_data] = ReadExport(flat_out);
  const auto [h, data] = ReadExport(shaped_out);
  EXPECT_EQ(h["embed.weight"]["shape"], Json::array({70, 100}));
  EXPECT_EQ(h["lm_head.weight"]["shape"], Json::array({10, 50, 10}));
  EXPECT_EQ(h["blocks.0.ln_1.bias"]["shape"], Json::array({1, 33, 1}));
  EXPECT_EQ(h["blocks.0.ln_1.weight"]["shape"], Json::array({33}));  // none in the manifest: flat
  EXPECT_EQ(flat_h["embed.weight"]["shape"], Json::array({7000}));
  // The same values in the same places: a shape only changes the header.
  EXPECT_EQ(data, flat_data);
  for (const auto& [name, v] : flat_h.items()) {
    if (name != "__metadata__") {
      EXPECT_EQ(h[name]["data_offsets"], v["data_offsets"]) << name;
    }
  }
  fs::remove(flat_out);
  fs::remove(shaped_out);
}

TEST(Export, RefusesImpossibleShapes) {
  Saved& s = Checkpoint();
  const std::string big = "1099511627776";  // 2^40: a dim may be that large, not a product of two
  const std::vector<std::pair<Json, std::string>> cases = {
      {Json::array({70, 99}), "groups[0].tensors[0].shape has 6930 elements; numel is 7000"},
      {Json::array({0, 7000}), "groups[0].tensors[0].shape[0] is not an integer in 1.."},
      {Json::array({-7000}), "groups[0].tensors[0].shape[0] is not an integer"},
      {Json::array({"7000"}), "groups[0].tensors[0].shape[0] is not an integer"},
      {Json::parse("[" + big + ", " + big + "]"), "groups[0].tensors[0].shape has more than"},
      {Json(7000), "groups[0].tensors[0].shape is not an array"},
      {Json(std::vector<int>(33, 1)), "groups[0].tensors[0].shape has 33 entries"},
  };
  int k = 0;
  for (const auto& [shape, why] : cases) {
    const std::string folder = ShapedCopy(s, "bad" + std::to_string(k++), {{"embed.weight", shape}});
    ExpectRefused(folder, s, folder + "/manifest.json", why);
  }
}

// A checkpoint saved without shapes (registered by numel, or by an older
// engine) loads into an engine that registers shapes; one with shapes
// refuses an engine whose shapes differ, naming the tensor.
TEST(Export, ShapelessCheckpointLoadsIntoAShapedEngine) {
  Saved& s = Checkpoint();
  auto load_into = [&](const std::string& folder, const std::vector<uint64_t>& embed_shape) -> Status {
    testing::TempDir swap;
    auto cfg = ParseConfig(Config(swap.path(), "fp32"));
    EXPECT_TRUE(cfg.ok());
    EngineOptions opt;
    opt.force_no_gpu = true;
    auto e = Engine::Create(*cfg, opt);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    for (const Tensor& t : kTensors) {
      const std::vector<uint64_t> shape =
          t.name == "embed.weight" ? embed_shape : std::vector<uint64_t>{t.numel};
      EXPECT_TRUE((*e)->AddShapedParam(t.group, t.name, shape, nullptr).ok());
    }
    EXPECT_TRUE((*e)->Build().ok());
    std::vector<uint8_t> blob;
    const std::string dir = fs::path(folder).parent_path().string(),
                      tag = fs::path(folder).filename().string();
    Status st = (*e)->LoadCheckpoint(dir, tag, &blob);
    if (!st.ok()) return st;
    for (int g = 0; g < (*e)->num_groups(); ++g) {
      std::vector<float> w((*e)->group_numel(g));
      EXPECT_TRUE((*e)->ReadMaster(g, w.data()).ok());
      const std::vector<float>& want = s.master[static_cast<size_t>(g)];  // bitwise: edge.values holds NaNs
      EXPECT_TRUE(w.size() == want.size() && std::memcmp(w.data(), want.data(), w.size() * 4) == 0)
          << "group " << g;
    }
    return st;
  };
  Status st = load_into(s.dir.path() + "/step2", {70, 100});
  EXPECT_TRUE(st.ok()) << st.ToString();
  const std::string shaped = ShapedCopy(s, "shaped_load", {{"embed.weight", {70, 100}}});
  st = load_into(shaped, {70, 100});
  EXPECT_TRUE(st.ok()) << st.ToString();
  st = load_into(shaped, {100, 70});
  EXPECT_EQ(st.code(), Code::kInvalid);
  EXPECT_NE(st.message().find("tensor 'embed.weight' of group 0 has shape [70, 100]"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("the engine's is [100, 70]"), std::string::npos) << st.message();
}

}  // namespace
// DIR/latest is one behind after a save killed between its rename and
// latest's update: the export takes the newest checkpoint by save order, as
// the engine's load does (before, it read latest alone and exported the older).
TEST(Export, AFolderOfCheckpointsMeansTheNewestNotLatest) {
  Saved& s = Checkpoint();
  const std::string dir = s.dir.path() + "/behind";
  fs::create_directories(dir);
  fs::copy(s.dir.path() + "/step2", dir + "/a", fs::copy_options::recursive);
  fs::copy(s.dir.path() + "/step2", dir + "/b", fs::copy_options::recursive);
  Json m = Json::parse(std::ifstream(dir + "/b/manifest.json"));
  m["save_seq"] = m["save_seq"].get<uint64_t>() + 1;
  m["step"] = 3;
  m.erase("manifest_xxh3");
  std::ofstream(dir + "/b/manifest.json") << manifest::Seal(m.dump());
  std::ofstream(dir + "/latest") << "a\n";
  const std::string out = dir + "/newest.safetensors";
  const auto r = Export(dir, out, "f32");  // (Run, in a TEST, names the fixture's member)
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(ReadExport(out).first["__metadata__"]["step"], "3") << "exported the checkpoint latest names, not the newest";
  EXPECT_NE(r.err.find("saved after it"), std::string::npos) << "the warning names the interrupted save: " << r.err;
  fs::remove_all(dir);
}

}  // namespace strata

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc < 3) {
    std::fprintf(stderr, "usage: export_test STRATA_EXPORT CHECK_SAFETENSORS_PY\n");
    return 2;
  }
  strata::g_export = argv[1];
  strata::g_checker = argv[2];
  if (std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0) {
    std::printf("skipped: /usr/bin/python3 with numpy (Debian's python3-numpy) is not available\n");
    return 77;
  }
  const int rc = RUN_ALL_TESTS();
  strata::g_saved.reset();
  strata::g_saved_compact.reset();
  return rc;
}

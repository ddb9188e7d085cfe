// strata.state_format "compact" at the engine's edges: checkpoints (resume
// is exact, the files shrink, corruption is caught), conversion between
// formats both ways, read_state/write_state, and the config's refusals.
// Also data_types.grad_accum_dtype "bf16" (G in 2 bytes), in both formats.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "base/dtype.h"
#include "engine/engine.h"
#include "kernels/cpu/compact.h"
#include "tests/engine/tiny_mlp.h"
#include "tests/util/temp_dir.h"

namespace strata {
namespace {

using testing::TempDir;
using testing::TinyMlp;
using OS = Engine::OptimizerState;

// "nvme_all": P and W, M, V on NVMe; "nvme_opt": P in the (host arena)
// device tier, W, M, V on NVMe (P's bf16 half is updated in the step's slot
// and copied back at commit); "host": everything addressable in place.
std::string Json(const std::string& where, const std::string& dir, const std::string& format,
                 const std::string& opt = "AdamW") {
  std::string o = "none", p = "none";
  if (where == "host") o = "cpu";
  if (where == "nvme_opt") o = "nvme";
  if (where == "nvme_all") o = p = "nvme";
  return R"({"bf16": {"enabled": true}, "optimizer": {"type": ")" + opt + R"(", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": ")" + o + R"(", "nvme_path": ")" + dir + R"("},
      "offload_param": {"device": ")" + p + R"(", "nvme_path": ")" + dir + R"(", "buffer_size": 1e5}},
    "strata": {"device_budget": "64MiB", "host_budget": "64MiB", "state_format": ")" + format + R"("}})";
}

std::unique_ptr<Engine> Make(const std::string& json, const TinyMlp& model) {
  auto c = ParseConfig(json);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (!c.ok()) return nullptr;
  auto e = Engine::Create(*c, {});
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return nullptr;
  EXPECT_TRUE(model.Register(**e).ok());
  Status b = (*e)->Build();
  EXPECT_TRUE(b.ok()) << b.ToString();
  return b.ok() ? std::move(*e) : nullptr;
}

std::vector<double> Steps(Engine& e, const TinyMlp& model, int from, int to) {
  std::vector<double> losses;
  for (int s = from; s < to; ++s) {
    auto loss = model.TrainStep(e);
    EXPECT_TRUE(loss.ok()) << loss.status().ToString();
    if (!loss.ok()) return losses;
    StepOptions so;
    so.lr = 0.01 * (1.0 - 0.03 * s);
    auto r = e.Step(so);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    losses.push_back(*loss);
  }
  return losses;
}

std::vector<std::vector<float>> States(Engine& e, OS which) {
  std::vector<std::vector<float>> out;
  for (int g = 0; g < e.num_groups(); ++g) {
    out.emplace_back(e.group_numel(g));
    Status st = e.ReadState(g, which, out.back().data());
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  return out;
}

uint64_t DataBytes(const std::string& folder) {
  uint64_t n = 0;
  for (const auto& f : std::filesystem::directory_iterator(folder))
    if (f.path().extension() == ".bin" && f.path().filename() != "trainer.bin") n += f.file_size();
  return n;
}

uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

TEST(Compact, ResumeEqualsContinuousInEveryPlacement) {
  for (const char* where : {"nvme_all", "nvme_opt", "host"}) {
    TempDir swap, ckpt;
    TinyMlp model(3, 40);
    auto whole = Make(Json(where, swap.path(), "compact"), model);
    ASSERT_TRUE(whole);
    const std::vector<double> all = Steps(*whole, model, 0, 10);
    const auto want = States(*whole, OS::kMaster);
    whole.reset();
    std::vector<double> joined;
    {
      auto first = Make(Json(where, swap.path(), "compact"), model);
      ASSERT_TRUE(first);
      joined = Steps(*first, model, 0, 5);
      Status sv = first->SaveCheckpoint(ckpt.path(), "s5", nullptr, 0);
      ASSERT_TRUE(sv.ok()) << where << ": " << sv.ToString();
    }
    auto second = Make(Json(where, swap.path(), "compact"), model);
    ASSERT_TRUE(second);
    Status ld = second->LoadCheckpoint(ckpt.path(), "", nullptr);
    ASSERT_TRUE(ld.ok()) << where << ": " << ld.ToString();
    for (double l : Steps(*second, model, 5, 10)) joined.push_back(l);
    EXPECT_EQ(joined, all) << where;
    const auto got = States(*second, OS::kMaster);
    for (size_t g = 0; g < want.size(); ++g)
      EXPECT_EQ(0, std::memcmp(want[g].data(), got[g].data(), want[g].size() * 4)) << where << " group " << g;
  }
}

TEST(Compact, CheckpointsShrinkAndCorruptionIsCaught) {
  TempDir swap, ckpt;
  // Groups of 65280 elements: padded to 65536 in both formats, so the
  // files differ by the format alone (host homes: the copying save, whose
  // file is exactly its blocks).
  TinyMlp model(2, 255);
  for (const char* format : {"fp32", "compact"}) {
    auto e = Make(Json("host", swap.path(), format), model);
    ASSERT_TRUE(e);
    Steps(*e, model, 0, 2);
    ASSERT_TRUE(e->SaveCheckpoint(ckpt.path(), format, nullptr, 0).ok());
  }
  const double f32 = static_cast<double>(DataBytes(ckpt.path() + "/fp32"));
  const double cmp = static_cast<double>(DataBytes(ckpt.path() + "/compact"));
  EXPECT_EQ(cmp / f32, 5.25 / 12.0) << cmp << " against " << f32;
  // A flipped byte in the compact data file: refused, nothing changed.
  std::string data;
  for (const auto& f : std::filesystem::directory_iterator(ckpt.path() + "/compact"))
    if (f.path().extension() == ".bin" && f.path().filename() != "trainer.bin") data = f.path();
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(100);
    f.write(&c, 1);
  }
  auto e = Make(Json("nvme_all", swap.path(), "compact"), model);
  ASSERT_TRUE(e);
  const auto before = States(*e, OS::kMaster);
  Status ld = e->LoadCheckpoint(ckpt.path(), "compact", nullptr);
  EXPECT_EQ(ld.code(), Code::kCorrupt) << ld.ToString();
  const auto after = States(*e, OS::kMaster);
  EXPECT_EQ(before, after);
}

// fp32 -> compact: the masters within the format's bound, the moments as
// CompactPack makes them; compact -> fp32: exactly the values the compact
// engine reads back. Either way, training goes on.
TEST(Compact, CheckpointsConvertBetweenFormats) {
  TempDir swap, ckpt;
  TinyMlp model(3, 40);
  auto f32 = Make(Json("host", swap.path(), "fp32"), model);
  ASSERT_TRUE(f32);
  Steps(*f32, model, 0, 4);
  ASSERT_TRUE(f32->SaveCheckpoint(ckpt.path(), "from_fp32", nullptr, 0).ok());
  const auto w32 = States(*f32, OS::kMaster), m32 = States(*f32, OS::kExpAvg), v32 = States(*f32, OS::kExpAvgSq);

  for (const char* where : {"nvme_all", "host"}) {
    TempDir own;  // f32 holds swap.path()
    auto c = Make(Json(where, own.path(), "compact"), model);
    ASSERT_TRUE(c);
    Status ld = c->LoadCheckpoint(ckpt.path(), "from_fp32", nullptr);
    ASSERT_TRUE(ld.ok()) << ld.ToString();
    EXPECT_EQ(c->steps_applied(), 4);
    const auto wc = States(*c, OS::kMaster), mc = States(*c, OS::kExpAvg), vc = States(*c, OS::kExpAvgSq);
    for (size_t g = 0; g < w32.size(); ++g) {
      // Exactly what packing the fp32 state gives, then unpacking it.
      const size_t n = w32[g].size();
      const size_t nb = kernels::CompactScaleCount(n);
      std::vector<uint16_t> hi(n);
      std::vector<int8_t> lo(n), mcode(n);
      std::vector<uint8_t> vcode(n);
      std::vector<float> ms(nb), vs(nb), w(n), m(n), v(n);
      const kernels::CompactState cs{hi.data(), lo.data(), mcode.data(), ms.data(), vcode.data(), vs.data()};
      // Whole groups fit one shard here (one rank), and blocks start at 0: the same blocks.
      ASSERT_TRUE(kernels::CompactPack(n, w32[g].data(), m32[g].data(), v32[g].data(), cs).ok());
      ASSERT_TRUE(kernels::CompactUnpack(n, cs, w.data(), m.data(), v.data()).ok());
      EXPECT_EQ(0, std::memcmp(w.data(), wc[g].data(), n * 4)) << where << " W of group " << g;
      EXPECT_EQ(0, std::memcmp(m.data(), mc[g].data(), n * 4)) << where << " M of group " << g;
      EXPECT_EQ(0, std::memcmp(v.data(), vc[g].data(), n * 4)) << where << " V of group " << g;
      for (size_t i = 0; i < n; ++i)
        ASSERT_LE(std::abs(static_cast<int64_t>(Bits(w32[g][i])) - static_cast<int64_t>(Bits(wc[g][i]))),
                  static_cast<int64_t>(kernels::kCompactMasterUlps)) << "element " << i;
    }
    const std::vector<double> more = Steps(*c, model, 4, 8);
    ASSERT_EQ(more.size(), 4u);
    EXPECT_TRUE(std::isfinite(more.back()));
  }

  // compact -> fp32: the fp32 engine holds exactly the compact engine's values.
  TempDir cswap;
  auto c = Make(Json("nvme_all", cswap.path(), "compact"), model);
  ASSERT_TRUE(c);
  Steps(*c, model, 0, 4);
  ASSERT_TRUE(c->SaveCheckpoint(ckpt.path(), "from_compact", nullptr, 0).ok());
  f32.reset();
  for (const char* where : {"nvme_all", "host"}) {
    auto f = Make(Json(where, swap.path(), "fp32"), model);
    ASSERT_TRUE(f);
    Status ld = f->LoadCheckpoint(ckpt.path(), "from_compact", nullptr);
    ASSERT_TRUE(ld.ok()) << ld.ToString();
    for (OS which : {OS::kMaster, OS::kExpAvg, OS::kExpAvgSq})
      EXPECT_EQ(States(*f, which), States(*c, which)) << where << " state " << static_cast<int>(which);
  }
}

// write_state then read_state: the master round-trips within its bound, and
// what is read back is a fixed point (writing it again changes nothing).
TEST(Compact, WriteStateThenReadStateIsAFixedPoint) {
  TempDir swap;
  TinyMlp model(2, 40);
  for (const char* where : {"nvme_all", "nvme_opt", "host"}) {
    auto e = Make(Json(where, swap.path(), "compact"), model);
    ASSERT_TRUE(e);
    Steps(*e, model, 0, 3);
    std::vector<float> w(e->group_numel(1));
    for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(static_cast<float>(i)) * 0.1f;
    ASSERT_TRUE(e->WriteState(1, OS::kMaster, w.data()).ok());
    std::vector<float> back(w.size()), again(w.size());
    ASSERT_TRUE(e->ReadState(1, OS::kMaster, back.data()).ok());
    for (size_t i = 0; i < w.size(); ++i)
      ASSERT_LE(std::abs(static_cast<int64_t>(Bits(w[i])) - static_cast<int64_t>(Bits(back[i]))),
                static_cast<int64_t>(kernels::kCompactMasterUlps)) << where << " element " << i;
    ASSERT_TRUE(e->WriteState(1, OS::kMaster, back.data()).ok());
    ASSERT_TRUE(e->ReadState(1, OS::kMaster, again.data()).ok());
    EXPECT_EQ(back, again) << where;
    // P (what a fetch hands out) is the master's bf16 half.
    auto p = e->Fetch(1);
    ASSERT_TRUE(p.ok());
    const uint16_t* pb = static_cast<const uint16_t*>(*p);
    for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(pb[i], F32ToBF16(back[i])) << where << " element " << i;
    ASSERT_TRUE(e->Release(1).ok());
  }
}

TEST(Compact, ConfigRefusals) {
  auto a = ParseConfig(R"({"bf16": {"enabled": true}, "optimizer": {"type": "Adagrad"}, "strata": {"state_format": "compact"}})");
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("strata.state_format"), std::string::npos) << a.status().ToString();
  auto b = ParseConfig(R"({"strata": {"state_format": "compact"}})");
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("bf16.enabled"), std::string::npos) << b.status().ToString();
  auto c = ParseConfig(R"({"bf16": {"enabled": true}, "strata": {"state_format": "int8"}})");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("state_format"), std::string::npos) << c.status().ToString();
  auto d = ParseConfig(R"({"bf16": {"enabled": true}, "optimizer": {"type": "Lion"}, "strata": {"state_format": "compact"}})");
  EXPECT_TRUE(d.ok()) << d.status().ToString();
}

// Lion keeps no V: the compact format holds W and M only, and resumes exactly.
TEST(Compact, LionResumes) {
  TempDir swap, ckpt;
  TinyMlp model(2, 40);
  auto whole = Make(Json("nvme_all", swap.path(), "compact", "Lion"), model);
  ASSERT_TRUE(whole);
  const std::vector<double> all = Steps(*whole, model, 0, 6);
  const auto want = States(*whole, OS::kMaster);
  whole.reset();
  auto first = Make(Json("nvme_all", swap.path(), "compact", "Lion"), model);
  ASSERT_TRUE(first);
  std::vector<double> joined = Steps(*first, model, 0, 3);
  ASSERT_TRUE(first->SaveCheckpoint(ckpt.path(), "s3", nullptr, 0).ok());
  first.reset();
  auto second = Make(Json("nvme_all", swap.path(), "compact", "Lion"), model);
  ASSERT_TRUE(second);
  ASSERT_TRUE(second->LoadCheckpoint(ckpt.path(), "", nullptr).ok());
  for (double l : Steps(*second, model, 3, 6)) joined.push_back(l);
  EXPECT_EQ(joined, all);
  EXPECT_EQ(States(*second, OS::kMaster), want);
}

// An engine of two groups (5000 and 3000 elements) with state on NVMe, fed
// bf16 gradients: `calls` grads calls a step (strata.grad_reduce "sum").
struct GradRun {
  std::vector<std::vector<float>> master;
  uint64_t nvme_read = 0;
};
GradRun TrainBf16Grads(const std::string& dir, const std::string& format, const std::string& accum, int calls,
                       bool presum = false) {
  GradRun out;
  auto c = ParseConfig(R"({"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": ")" + accum + R"("},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir + R"("},
      "offload_param": {"device": "nvme", "nvme_path": ")" + dir + R"(", "buffer_size": 1e5}},
    "strata": {"device_budget": "64MiB", "host_budget": "64MiB", "grad_home": "nvme", "grad_reduce": "sum", "state_format": ")" + format +
                       R"("}})");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (!c.ok()) return out;
  EngineOptions eo;
  eo.grad_accumulation_steps = presum ? 1 : calls;
  auto e = Engine::Create(*c, eo);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return out;
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  const uint64_t sizes[2] = {5000, 3000};
  for (int g = 0; g < 2; ++g) {
    std::vector<float> init(sizes[g]);
    for (auto& x : init) x = nd(rng);
    EXPECT_TRUE((*e)->AddParam(g, "p" + std::to_string(g), sizes[g], init.data()).ok());
  }
  EXPECT_TRUE((*e)->Build().ok());
  const EngineStats before = (*e)->stats();
  for (int step = 0; step < 3; ++step) {
    for (int g = 0; g < 2; ++g) {
      std::vector<std::vector<uint16_t>> parts(static_cast<size_t>(calls), std::vector<uint16_t>(sizes[g]));
      for (auto& part : parts)
        for (auto& x : part) x = F32ToBF16(nd(rng) * 10.0f);
      if (presum) {  // one call of the parts summed in fp32 and rounded to bf16, as G keeps them
        std::vector<uint16_t> sum(sizes[g]);
        for (size_t i = 0; i < sum.size(); ++i) {
          float acc = BF16ToF32(parts[0][i]);
          for (int k = 1; k < calls; ++k) acc = BF16ToF32(F32ToBF16(acc + BF16ToF32(parts[static_cast<size_t>(k)][i])));
          sum[i] = F32ToBF16(acc);
        }
        EXPECT_TRUE((*e)->Grads(g, sum.data(), DType::kBF16).ok());
      } else {
        for (auto& part : parts) EXPECT_TRUE((*e)->Grads(g, part.data(), DType::kBF16).ok());
      }
    }
    auto r = (*e)->Step({});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }
  out.nvme_read = (*e)->stats().nvme_to_host - before.nvme_to_host;
  for (int g = 0; g < 2; ++g) {
    out.master.emplace_back(sizes[g]);
    EXPECT_TRUE((*e)->ReadMaster(g, out.master.back().data()).ok());
  }
  return out;
}

// G in bf16: one call of bf16 gradients is stored exactly, so the step is
// bitwise that of fp32 G (either state format) with fewer bytes read; two
// calls add in fp32 and round the sum, as said.
TEST(GradAccum, Bf16StoresOneBf16CallExactlyAndRoundsSums) {
  for (const char* format : {"fp32", "compact"}) {
    TempDir a, b, c, d;
    const GradRun g32 = TrainBf16Grads(a.path(), format, "fp32", 1);
    const GradRun g16 = TrainBf16Grads(b.path(), format, "bf16", 1);
    ASSERT_EQ(g32.master.size(), 2u);
    EXPECT_EQ(g32.master, g16.master) << format;
    EXPECT_LT(g16.nvme_read, g32.nvme_read) << format;
    const GradRun two = TrainBf16Grads(d.path(), format, "bf16", 2);
    const GradRun presummed = TrainBf16Grads(c.path(), format, "fp32", 2, /*presum=*/true);
    EXPECT_EQ(two.master, presummed.master) << format;
  }
  auto bad = ParseConfig(R"({"data_types": {"grad_accum_dtype": "fp16"}})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("data_types.grad_accum_dtype"), std::string::npos) << bad.status().ToString();
}

}  // namespace
}  // namespace strata

// Frozen groups through the public header (libstrata.so):
// strata_engine_freeze_group and _group_frozen, the refusals each names
// (grads, the moments, late or out-of-range freezing), the frozen group's
// parameters kept bitwise through steps, set by write_state(MASTER), and a
// checkpoint's round trip and its refusal by an engine frozen otherwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "strata/strata.h"
#include "tests/util/temp_dir.h"

namespace {

using strata::testing::TempDir;

constexpr uint64_t kN0 = 3000, kN1 = 5000, kN2 = 700;

std::string Config(const std::string& swap) {
  return R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("},
      "offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"("}},
    "strata": {"device_budget": "8MiB", "host_budget": "8MiB"}})";
}

std::vector<float> Ramp(uint64_t n, float scale) {
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = scale * std::sin(0.37f * static_cast<float>(i) + scale);
  return v;
}

uint16_t ToBf16(float f) {  // round to nearest even (no NaNs here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float FromBf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<float> Rounded(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = FromBf16(ToBf16(v[i]));
  return r;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

std::string LastError() { return strata_last_error(); }

// Groups 0 and 2 train, group 1 (marked before its tensor) is frozen.
strata_engine_t* Make(const std::string& swap, const std::vector<float>& frozen_init, bool freeze = true) {
  strata_engine_options_t o = STRATA_ENGINE_OPTIONS_INIT;
  o.force_no_gpu = 1;
  strata_engine_t* e = nullptr;
  if (strata_engine_create(Config(swap).c_str(), &o, &e) != STRATA_OK) {
    ADD_FAILURE() << LastError();
    return nullptr;
  }
  if (freeze) {
    EXPECT_EQ(strata_engine_freeze_group(e, 1), STRATA_OK) << LastError();
  }
  const std::vector<float> a = Ramp(kN0, 0.2f), c = Ramp(kN2, 0.4f);
  EXPECT_EQ(strata_engine_add_param(e, 0, "a", kN0, a.data(), nullptr), STRATA_OK);
  const int64_t shape[2] = {50, 100};
  EXPECT_EQ(strata_engine_add_param_shaped(e, 1, "base", 2, shape, frozen_init.data(), nullptr), STRATA_OK);
  EXPECT_EQ(strata_engine_add_param(e, 2, "c", kN2, c.data(), nullptr), STRATA_OK);
  EXPECT_EQ(strata_engine_build(e), STRATA_OK) << LastError();
  return e;
}

std::vector<float> Master(strata_engine_t* e, int g) {
  uint64_t n = 0;
  EXPECT_EQ(strata_engine_group_numel(e, g, &n), STRATA_OK);
  std::vector<float> v(n);
  EXPECT_EQ(strata_engine_read_master(e, g, v.data()), STRATA_OK) << LastError();
  return v;
}

std::vector<float> Fetched(strata_engine_t* e, int g, uint64_t n) {
  void* p = nullptr;
  EXPECT_EQ(strata_engine_fetch(e, g, nullptr, &p), STRATA_OK) << LastError();
  std::vector<float> v(n);
  for (uint64_t i = 0; p && i < n; ++i) v[i] = FromBf16(static_cast<const uint16_t*>(p)[i]);
  EXPECT_EQ(strata_engine_release(e, g, nullptr), STRATA_OK);
  return v;
}

void Steps(strata_engine_t* e, int n) {
  for (int s = 0; s < n; ++s) {
    for (int g : {0, 2}) {
      uint64_t numel = 0;
      ASSERT_EQ(strata_engine_group_numel(e, g, &numel), STRATA_OK);
      const std::vector<float> grad = Ramp(numel, 0.1f * static_cast<float>(s + 1 + g));
      ASSERT_EQ(strata_engine_grads(e, g, grad.data(), STRATA_DTYPE_F32, nullptr), STRATA_OK) << LastError();
    }
    strata_step_result_t r = STRATA_STEP_RESULT_INIT;
    ASSERT_EQ(strata_engine_step(e, nullptr, &r), STRATA_OK) << LastError();
    ASSERT_EQ(r.skipped, 0);
  }
}

TEST(CapiFrozen, MarkingAndItsRefusals) {
  TempDir swap;
  strata_engine_options_t o = STRATA_ENGINE_OPTIONS_INIT;
  o.force_no_gpu = 1;
  strata_engine_t* e = nullptr;
  ASSERT_EQ(strata_engine_create(Config(swap.path()).c_str(), &o, &e), STRATA_OK) << LastError();
  int f = 7;
  EXPECT_EQ(strata_engine_freeze_group(nullptr, 0), STRATA_INVALID);
  EXPECT_EQ(strata_engine_freeze_group(e, -1), STRATA_INVALID);
  EXPECT_NE(LastError().find("freeze_group -1"), std::string::npos) << LastError();
  EXPECT_EQ(strata_engine_freeze_group(e, 1000001), STRATA_INVALID);
  EXPECT_EQ(strata_engine_group_frozen(e, 1, nullptr), STRATA_INVALID);
  EXPECT_EQ(strata_engine_group_frozen(e, -1, &f), STRATA_INVALID);
  EXPECT_EQ(f, 7);  // out* only on OK
  ASSERT_EQ(strata_engine_group_frozen(e, 1, &f), STRATA_OK);
  EXPECT_EQ(f, 0);
  ASSERT_EQ(strata_engine_freeze_group(e, 1), STRATA_OK);
  ASSERT_EQ(strata_engine_freeze_group(e, 1), STRATA_OK);
  ASSERT_EQ(strata_engine_group_frozen(e, 1, &f), STRATA_OK);
  EXPECT_EQ(f, 1);
  const std::vector<float> a = Ramp(kN0, 0.2f), base = Ramp(kN1, 0.5f);
  ASSERT_EQ(strata_engine_add_param(e, 0, "a", kN0, a.data(), nullptr), STRATA_OK);
  ASSERT_EQ(strata_engine_add_param(e, 1, "base", kN1, base.data(), nullptr), STRATA_OK);
  ASSERT_EQ(strata_engine_build(e), STRATA_OK) << LastError();
  EXPECT_EQ(strata_engine_freeze_group(e, 0), STRATA_STATE);
  EXPECT_NE(LastError().find("already built"), std::string::npos) << LastError();
  EXPECT_EQ(strata_engine_group_frozen(e, 2, &f), STRATA_INVALID);  // after build: the engine's groups
  ASSERT_EQ(strata_engine_group_frozen(e, 0, &f), STRATA_OK);
  EXPECT_EQ(f, 0);

  const std::vector<float> g1(kN1, 1.0f);
  EXPECT_EQ(strata_engine_grads(e, 1, g1.data(), STRATA_DTYPE_F32, nullptr), STRATA_INVALID);
  EXPECT_NE(LastError().find("group 1 is frozen"), std::string::npos) << LastError();
  std::vector<float> out(kN1);
  EXPECT_EQ(strata_engine_read_state(e, 1, STRATA_STATE_EXP_AVG, out.data()), STRATA_INVALID);
  EXPECT_NE(LastError().find("group 1 is frozen"), std::string::npos) << LastError();
  EXPECT_NE(LastError().find("exp_avg"), std::string::npos) << LastError();
  EXPECT_EQ(strata_engine_read_state(e, 1, STRATA_STATE_EXP_AVG_SQ, out.data()), STRATA_INVALID);
  EXPECT_NE(LastError().find("exp_avg_sq"), std::string::npos) << LastError();
  EXPECT_EQ(strata_engine_write_state(e, 1, STRATA_STATE_EXP_AVG, out.data()), STRATA_INVALID);
  ASSERT_EQ(strata_engine_read_state(e, 1, STRATA_STATE_MASTER, out.data()), STRATA_OK) << LastError();
  EXPECT_TRUE(SameBits(out, Rounded(base)));
  strata_engine_destroy(e);
}

TEST(CapiFrozen, KeptThroughStepsSetByWriteStateAndCheckpointed) {
  TempDir swap, ckpt;
  const std::vector<float> base = Ramp(kN1, 0.5f), other = Ramp(kN1, 0.9f);
  strata_engine_t* e = Make(swap.path(), base);
  ASSERT_NE(e, nullptr);
  const std::vector<float> a0 = Master(e, 0);
  Steps(e, 3);
  EXPECT_FALSE(SameBits(Master(e, 0), a0)) << "the trained group did not move";
  EXPECT_TRUE(SameBits(Master(e, 1), Rounded(base))) << "weight decay or a step reached the frozen group";
  EXPECT_TRUE(SameBits(Fetched(e, 1, kN1), Rounded(base)));
  ASSERT_EQ(strata_checkpoint_save(e, ckpt.path().c_str(), "s3", "xy", 2), STRATA_OK) << LastError();

  // write_state(MASTER): the frozen group's parameters, fetched and read so.
  ASSERT_EQ(strata_engine_write_state(e, 1, STRATA_STATE_MASTER, other.data()), STRATA_OK) << LastError();
  EXPECT_TRUE(SameBits(Fetched(e, 1, kN1), Rounded(other)));
  Steps(e, 1);
  EXPECT_TRUE(SameBits(Master(e, 1), Rounded(other)));

  // The load brings the saved parameters back, and the trained groups' state.
  char blob[8];
  uint64_t blob_bytes = sizeof blob;
  ASSERT_EQ(strata_checkpoint_load(e, ckpt.path().c_str(), "s3", blob, &blob_bytes), STRATA_OK) << LastError();
  EXPECT_TRUE(SameBits(Master(e, 1), Rounded(base)));
  EXPECT_TRUE(SameBits(Fetched(e, 1, kN1), Rounded(base)));
  int64_t steps = 0;
  ASSERT_EQ(strata_engine_get_steps(e, &steps), STRATA_OK);
  EXPECT_EQ(steps, 3);

  // An engine that does not freeze group 1 refuses the checkpoint, naming it.
  TempDir swap2;
  strata_engine_t* plain = Make(swap2.path(), base, /*freeze=*/false);
  ASSERT_NE(plain, nullptr);
  blob_bytes = sizeof blob;
  EXPECT_EQ(strata_checkpoint_load(plain, ckpt.path().c_str(), "s3", blob, &blob_bytes), STRATA_INVALID);
  EXPECT_NE(LastError().find("group 1 is frozen in"), std::string::npos) << LastError();
  strata_engine_destroy(plain);
  strata_engine_destroy(e);
}

}  // namespace

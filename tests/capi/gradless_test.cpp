// skip_groups_without_grads through the public header: the option (an
// appended field of strata_engine_options_t, 0 in a struct that ends before
// it), strata_engine_group_steps and _set_group_steps, and their refusals.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "strata/strata.h"

namespace {

const char* kConfig = R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
  "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
  "strata": {"device_budget": "8MiB", "host_budget": "8MiB"}})";

strata_engine_t* Make(const strata_engine_options_t& o) {
  strata_engine_t* e = nullptr;
  EXPECT_EQ(strata_engine_create(kConfig, &o, &e), STRATA_OK) << strata_last_error();
  const std::vector<float> v(1000, 0.5f);
  EXPECT_EQ(strata_engine_add_param(e, 0, "a", 1000, v.data(), nullptr), STRATA_OK);
  EXPECT_EQ(strata_engine_add_param(e, 1, "b", 1000, v.data(), nullptr), STRATA_OK);
  EXPECT_EQ(strata_engine_add_param(e, 2, "base", 1000, v.data(), nullptr), STRATA_OK);
  EXPECT_EQ(strata_engine_freeze_group(e, 2), STRATA_OK);
  EXPECT_EQ(strata_engine_build(e), STRATA_OK) << strata_last_error();
  return e;
}

// Two steps, b's gradients in the first only.
void Train(strata_engine_t* e) {
  const std::vector<float> g(1000, 0.25f);
  for (int s = 0; s < 2; ++s) {
    ASSERT_EQ(strata_engine_grads(e, 0, g.data(), STRATA_DTYPE_F32, nullptr), STRATA_OK);
    if (s == 0) {
      ASSERT_EQ(strata_engine_grads(e, 1, g.data(), STRATA_DTYPE_F32, nullptr), STRATA_OK);
    }
    ASSERT_EQ(strata_engine_step(e, nullptr, nullptr), STRATA_OK) << strata_last_error();
  }
}

TEST(CapiGradless, OwnCountsWithTheOptionAndTheEnginesWithout) {
  strata_engine_options_t o = STRATA_ENGINE_OPTIONS_INIT;
  o.force_no_gpu = 1;
  o.skip_groups_without_grads = 1;
  strata_engine_t* e = Make(o);
  Train(e);
  int64_t n = -1;
  ASSERT_EQ(strata_engine_group_steps(e, 0, &n), STRATA_OK);
  EXPECT_EQ(n, 2);
  ASSERT_EQ(strata_engine_group_steps(e, 1, &n), STRATA_OK);
  EXPECT_EQ(n, 1);
  ASSERT_EQ(strata_engine_group_steps(e, 2, &n), STRATA_OK);
  EXPECT_EQ(n, 0);  // frozen: never updated
  EXPECT_EQ(strata_engine_group_steps(e, 3, &n), STRATA_INVALID);
  EXPECT_EQ(strata_engine_group_steps(e, 0, nullptr), STRATA_INVALID);
  EXPECT_EQ(strata_engine_set_group_steps(e, 2, 1), STRATA_INVALID);
  EXPECT_NE(std::string(strata_last_error()).find("frozen"), std::string::npos) << strata_last_error();
  ASSERT_EQ(strata_engine_set_group_steps(e, 1, 7), STRATA_OK) << strata_last_error();
  ASSERT_EQ(strata_engine_group_steps(e, 1, &n), STRATA_OK);
  EXPECT_EQ(n, 7);
  ASSERT_EQ(strata_engine_set_steps(e, 3), STRATA_OK);
  ASSERT_EQ(strata_engine_group_steps(e, 1, &n), STRATA_OK);
  EXPECT_EQ(n, 3);
  strata_engine_destroy(e);

  // A struct that ends before the field: the engine's rule (every group, every step).
  strata_engine_options_t old = STRATA_ENGINE_OPTIONS_INIT;
  old.force_no_gpu = 1;
  old.skip_groups_without_grads = 1;  // not covered by struct_size: not read
  old.struct_size = offsetof(strata_engine_options_t, skip_groups_without_grads);
  e = Make(old);
  Train(e);
  ASSERT_EQ(strata_engine_group_steps(e, 1, &n), STRATA_OK);
  EXPECT_EQ(n, 2);
  EXPECT_EQ(strata_engine_set_group_steps(e, 1, 1), STRATA_INVALID);
  EXPECT_NE(std::string(strata_last_error()).find("skip_groups_without_grads"), std::string::npos);
  strata_engine_destroy(e);
}

}  // namespace

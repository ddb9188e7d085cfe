// engine/config: what a hostile or careless document cannot do — nest
// without bound, repeat a key, overflow a number, print a huge value into a
// message — and the limits and warnings that keep config and engine agreed.
#include <gtest/gtest.h>

#include <string>

#include "engine/config/config.h"
#include "engine/config/config_reader.h"

namespace strata {
namespace {

std::string Refusal(const std::string& text) {
  Result<Config> c = ParseConfig(text);
  if (c.ok()) return "(accepted)";
  EXPECT_EQ(c.status().code(), Code::kConfig) << c.status().ToString();
  return c.status().message();
}

std::string Nested(char open, char close, size_t depth) {
  return std::string(depth, open) + std::string(depth, close);
}

// ---- Nesting and message size ----

TEST(ConfigLimits, DeepNestingIsRefusedNotACrash) {
  // 100k levels used to overflow the stack describing the value.
  const std::string deep_arrays = Nested('[', ']', 100000);
  EXPECT_NE(Refusal(deep_arrays).find("nested deeper than 64 levels"), std::string::npos);
  std::string deep_objects;
  for (int i = 0; i < 100000; ++i) deep_objects += "{\"a\":";
  deep_objects += "1" + std::string(100000, '}');
  EXPECT_NE(Refusal(deep_objects).find("nested deeper than 64 levels"), std::string::npos);
  EXPECT_NE(Refusal(R"({"aio": )" + Nested('[', ']', 200) + "}").find("aio[0][0]"), std::string::npos);
}

TEST(ConfigLimits, NestingUpToTheLimitIsParsed) {
  // 64 levels: the top object plus 63 arrays under "aio" (refused for its type, not its depth).
  const std::string message = Refusal(R"({"aio": )" + Nested('[', ']', 63) + "}");
  EXPECT_EQ(message.rfind("aio: expected an object, got array [[[[", 0), 0u) << message;
}

TEST(ConfigLimits, MessagesPrintAtMostABriefValue) {
  const std::string big(1 << 20, 'x');
  for (const std::string& doc : {R"({"aio": [")" + big + R"("]})", R"({"strata": {"step_io": ")" + big + R"("}})",
                                 R"({"strata": {"host_budget": ")" + big + R"("}})",
                                 R"({"zero_optimization": {")" + big + R"(": 1}})",
                                 R"({"aio": )" + Nested('[', ']', 60) + "}"}) {
    const std::string message = Refusal(doc);
    EXPECT_LT(message.size(), 400u) << message.substr(0, 400);
  }
  EXPECT_EQ(config_internal::BriefJson(config_internal::Json::parse(R"({"a": ")" + big + R"("})")),
            "{\"a\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...");
}

TEST(ConfigLimits, ABriefValueNeverSplitsAUtf8Sequence) {
  // Found by the fuzzer: the cut fell inside a two-byte character and the
  // description threw (std::terminate through ParseConfig).
  std::string many;
  for (int i = 0; i < 40; ++i) many += "\xc3\xa9";  // é
  const std::string message = Refusal(R"({"aio": ")" + many + R"("})");
  EXPECT_EQ(message.rfind("aio: expected an object, got string \"", 0), 0u) << message;
  EXPECT_EQ(Refusal(R"({"aio": {")" + many + R"(": 1}})").rfind("aio.", 0), 0u);
}

// ---- Duplicate keys ----

TEST(ConfigLimits, DuplicateKeyIsRefusedWithItsPath) {
  EXPECT_EQ(Refusal(R"({"zero_optimization": {"stage": 7, "stage": 2}})"),
            "zero_optimization.stage: duplicate key; give each key once");
  EXPECT_EQ(Refusal(R"({"aio": {}, "aio": {}})"), "aio: duplicate key; give each key once");
  EXPECT_EQ(Refusal(R"({"strata": {"nvme_paths": [{"a": 1, "a": 1}]}})"),
            "strata.nvme_paths[0].a: duplicate key; give each key once");
  // The same key in two objects is two keys.
  EXPECT_EQ(Refusal(R"({"bf16": {"enabled": false}, "fp16": {"enabled": false}})"), "(accepted)");
}

// ---- Numbers that overflow ----

TEST(ConfigLimits, OverflowingNumberNamesTheKey) {
  const std::string message = Refusal(R"({"optimizer": {"params": {"lr": 1e400}}})");
  EXPECT_EQ(message.rfind("optimizer.params.lr: number overflow parsing '1e400' at line 1, column ", 0), 0u)
      << message;
  EXPECT_NE(message.find("allowed: a finite number"), std::string::npos) << message;
  EXPECT_EQ(Refusal(R"({"optimizer": {"params": {"betas": [0.9, -1e999]}}})")
                .rfind("optimizer.params.betas[1]: number overflow", 0),
            0u);
  EXPECT_EQ(Refusal("1e400").rfind("config: number overflow parsing '1e400' at line 1", 0), 0u);
}

// ---- One limit for config and engine ----

TEST(ConfigLimits, QueueDepthHasTheStoragesLimit) {
  EXPECT_EQ(Refusal(R"({"aio": {"queue_depth": 4096}})"), "(accepted)");
  EXPECT_EQ(Refusal(R"({"aio": {"queue_depth": 4097}})"),
            "aio.queue_depth: 4097 is out of range; allowed: from 1 to 4096");
  EXPECT_EQ(Refusal(R"({"aio": {"queue_depth": 65536}})"),
            "aio.queue_depth: 65536 is out of range; allowed: from 1 to 4096");
  EXPECT_EQ(Refusal(R"({"aio": {"block_size": 2147483648}})"),
            "aio.block_size: 2147483648 is out of range; allowed: from 4096 to 1073741824");
  Config in_code;  // held to the same rule when built without the parser
  in_code.aio.queue_depth = 65536;
  const Status st = ValidateConfig(in_code, ConfigFacts{});
  EXPECT_EQ(st.code(), Code::kConfig);
  EXPECT_EQ(st.message(), "aio.queue_depth: 65536 is out of range; allowed: from 1 to 4096");
}

// ---- Warnings ----

TEST(ConfigLimits, OffloadParamBelowStage3Warns) {
  for (int stage : {0, 1, 2}) {
    Result<Config> c = ParseConfig(R"({"zero_optimization": {"stage": )" + std::to_string(stage) +
                                   R"(, "offload_param": {"device": "cpu"}}})");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_EQ(c->warnings.size(), 1u) << "stage " << stage;
    EXPECT_EQ(c->warnings[0], "zero_optimization.offload_param: DeepSpeed ignores it below stage 3 (stage " +
                                  std::to_string(stage) +
                                  " here) and keeps parameters on the GPU; Strata keeps them on cpu as it says");
  }
  // The deprecated spelling too; stage 3, or no offload, says nothing.
  Result<Config> legacy = ParseConfig(R"({"zero_optimization": {"stage": 2, "cpu_offload_param": true}})");
  ASSERT_TRUE(legacy.ok());
  EXPECT_EQ(legacy->warnings.size(), 2u);  // deprecated key + below stage 3
  for (const char* quiet : {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})",
                            R"({"zero_optimization": {"stage": 1, "offload_param": {"device": "none"}}})"}) {
    Result<Config> c = ParseConfig(quiet);
    ASSERT_TRUE(c.ok());
    EXPECT_TRUE(c->warnings.empty()) << quiet;
  }
}

}  // namespace
}  // namespace strata

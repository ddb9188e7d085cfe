// libFuzzer target: the config reader (ParseConfig, then ValidateConfig with
// a few machine facts) on arbitrary bytes. Beyond "no crash, no sanitizer
// report", it checks the reader's promises: a refusal is kConfig, and an
// accepted document round-trips through ConfigToJson to an equal Config.
// Built and run by run_config_fuzz.sh (clang++ -fsanitize=fuzzer,address,undefined).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "engine/config/config.h"

namespace {

void Die(const char* what, const strata::Status& st) {
  std::fprintf(stderr, "config_fuzz: %s: %s\n", what, st.ToString().c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  strata::Result<strata::Config> c = strata::ParseConfig(text);
  if (!c.ok()) {
    if (c.status().code() != strata::Code::kConfig) Die("a refusal that is not CONFIG", c.status());
    return 0;
  }
  strata::ConfigFacts facts;
  facts.largest_group_numel = 1 << 20;
  facts.world_size = 4;
  facts.host_ram_bytes = 64ull << 30;
  facts.memlock_limit_bytes = 8ull << 30;
  const strata::Status valid = strata::ValidateConfig(*c, facts);
  if (!valid.ok() && valid.code() != strata::Code::kConfig) Die("validation that is not CONFIG", valid);
  strata::Result<strata::Config> again = strata::ParseConfig(strata::ConfigToJson(*c));
  if (!again.ok()) Die("ConfigToJson's output refused", again.status());
  if (!(*again == *c)) Die("ConfigToJson does not round-trip", strata::Status::Ok());
  return 0;
}

// Helpers of the engine's tests: an engine built from a config with its
// groups' values, and a step's gradient made from the parameters as fetched
// (so that a wrong update shows in every later one).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "engine/engine.h"

namespace strata::testing {

// Under STRATA_STRICT_DEVICE=1 (the ctest label strict): the device tier is
// separate memory, as a GPU's.
inline bool StrictDevice() {
  const char* v = std::getenv("STRATA_STRICT_DEVICE");
  return v && std::string(v) == "1";
}

// The engine of `json` and `options`, group g holding values[g] under
// names[g] ("g<g>" where names is short), built. nullptr, and the test
// failing with what refused, where anything does.
inline std::unique_ptr<Engine> BuiltEngine(const std::string& json, const EngineOptions& options,
                                           const std::vector<std::vector<float>>& values,
                                           const std::vector<std::string>& names = {}) {
  auto cfg = ParseConfig(json);
  EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
  if (!cfg.ok()) return nullptr;
  auto e = Engine::Create(*cfg, options);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return nullptr;
  for (size_t g = 0; g < values.size(); ++g) {
    const std::string name = g < names.size() ? names[g] : "g" + std::to_string(g);
    const auto off = (*e)->AddParam(static_cast<int>(g), name, values[g].size(), values[g].data());
    EXPECT_TRUE(off.ok()) << off.status().ToString();
    if (!off.ok()) return nullptr;
  }
  const Status st = (*e)->Build();
  EXPECT_TRUE(st.ok()) << st.ToString();
  return st.ok() ? std::move(*e) : nullptr;
}

// P of group g as fetched (fp32 or bf16 compute), widened to float.
inline std::vector<float> FetchedP(Engine& e, int g) {
  auto p = e.Fetch(g);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  std::vector<float> out(e.group_numel(g));
  const bool bf16 = e.compute_dtype() == DType::kBF16;
  for (size_t i = 0; p.ok() && i < out.size(); ++i)
    out[i] = bf16 ? BF16ToF32(static_cast<const uint16_t*>(*p)[i]) : static_cast<const float*>(*p)[i];
  EXPECT_TRUE(e.Release(g).ok());
  return out;
}

// The gradient of a group's k-th update: scale * sin(freq * p + phase * k)
// over its parameters as fetched.
inline std::vector<float> GradOfFetched(Engine& e, int g, int k, float scale = 0.5f, float freq = 4.0f,
                                        float phase = 0.3f) {
  std::vector<float> grad = FetchedP(e, g);
  for (float& x : grad) x = scale * std::sin(freq * x + phase * static_cast<float>(k));
  return grad;
}

}  // namespace strata::testing

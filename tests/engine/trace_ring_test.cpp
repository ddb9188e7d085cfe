// The trace's span ring (engine/stats): once it holds its most spans, each
// new one replaces the oldest, so a long run's trace shows its end; names
// no held span uses are let go.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/stats/stats.h"

namespace strata {
namespace {

std::string TempPath() {
  char dir[] = "/tmp/strata-trace-ring-XXXXXX";
  EXPECT_NE(::mkdtemp(dir), nullptr);
  return std::string(dir) + "/trace.json";
}

// The names of the trace's complete spans ("X") on the caller's track, in file order.
std::vector<std::string> CallerSpans(const std::string& path, uint64_t* dropped) {
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  *dropped = j.at("otherData").at("dropped_events").get<uint64_t>();
  std::vector<std::string> names;
  for (const auto& e : j.at("traceEvents"))
    if (e.at("ph") == "X" && e.at("tid") == static_cast<int>(Resource::kCaller))
      names.push_back(e.at("name").get<std::string>());
  return names;
}

TEST(TraceRing, KeepsTheNewestSpansOldestFirst) {
  const std::string path = TempPath();
  {
    StatsRecorder stats(0, path, 8);
    for (int i = 0; i < 20; ++i) stats.CallSpan(("step " + std::to_string(i)).c_str(), -1, i, i + 0.5);
    const StatsRecorder::TraceHeld held = stats.Held();
    EXPECT_EQ(held.events, 8u);
    EXPECT_EQ(held.dropped, 12u);
    ASSERT_TRUE(stats.WriteTrace().ok());
    uint64_t dropped = 0;
    const std::vector<std::string> names = CallerSpans(path, &dropped);
    EXPECT_EQ(dropped, 12u);
    ASSERT_EQ(names.size(), 8u);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(names[static_cast<size_t>(i)], "step " + std::to_string(12 + i));
  }
  std::remove(path.c_str());
  ::rmdir(path.substr(0, path.rfind('/')).c_str());
}

// The trace's temporary left as a symlink to another file: replaced, never
// written through (before, fopen "w" emptied the target and wrote into it).
TEST(TraceRing, NeverWritesThroughALinkAtItsTemporaryName) {
  const std::string path = TempPath();
  const std::string dir = path.substr(0, path.rfind('/')), victim = dir + "/notes.txt";
  std::ofstream(victim) << "keep me\n";
  ASSERT_EQ(::symlink(victim.c_str(), (path + ".tmp").c_str()), 0);
  {
    StatsRecorder stats(0, path, 8);
    stats.CallSpan("step 0", -1, 0, 0.5);
    ASSERT_TRUE(stats.WriteTrace().ok());
  }
  std::string text;
  std::getline(std::ifstream(victim), text);
  EXPECT_EQ(text, "keep me");
  uint64_t dropped = 0;
  EXPECT_EQ(CallerSpans(path, &dropped).size(), 1u);
  std::remove(victim.c_str());
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

TEST(TraceRing, NamesOfOverwrittenSpansAreLetGo) {
  const std::string path = TempPath();
  {
    StatsRecorder stats(0, path, 16);
    for (int i = 0; i < 100'000; ++i) {
      stats.CallSpan(("span " + std::to_string(i)).c_str(), -1, i, i + 0.5);
      ASSERT_LE(stats.Held().names, 32u) << "after span " << i;
    }
    stats.CallSpan("fetch", 3, 1e5, 1e5 + 1);
    ASSERT_TRUE(stats.WriteTrace().ok());
    uint64_t dropped = 0;
    const std::vector<std::string> names = CallerSpans(path, &dropped);
    EXPECT_EQ(dropped, 100'001u - 16u);
    ASSERT_EQ(names.size(), 16u);
    // Each span keeps its own name through the renumbering.
    for (int i = 0; i < 15; ++i) EXPECT_EQ(names[static_cast<size_t>(i)], "span " + std::to_string(99'985 + i));
    EXPECT_EQ(names.back(), "fetch");
  }
  std::remove(path.c_str());
  ::rmdir(path.substr(0, path.rfind('/')).c_str());
}

}  // namespace
}  // namespace strata

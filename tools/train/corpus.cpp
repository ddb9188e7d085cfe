// The built-in corpus and the batch sampler.
#include "tools/train/corpus.h"

#include <fstream>
#include <random>
#include <sstream>

namespace strata::train {

std::string BuiltinCorpus(uint64_t seed, size_t bytes) {
  static const char* kSubjects[] = {"the engine", "a small model", "the disk", "every shard", "the optimizer",
                                    "the host", "our trainer", "the device", "each rank", "the prefetcher"};
  static const char* kVerbs[] = {"reads", "writes", "moves", "updates", "checks", "streams", "keeps", "fetches"};
  static const char* kObjects[] = {"the weights", "its moments", "a block of state", "the next layer",
                                   "every gradient", "the swap file", "a checksum", "the master copy"};
  static const char* kTails[] = {"before the step", "while the layer computes", "in order", "just in time",
                                 "without a copy", "from the fast tier", "at the speed of memory", "again"};
  std::mt19937_64 rng(seed);
  std::string out;
  out.reserve(bytes + 128);
  auto pick = [&](const auto& arr) { return arr[rng() % (sizeof(arr) / sizeof(arr[0]))]; };
  while (out.size() < bytes) {
    std::string s = std::string(pick(kSubjects)) + " " + pick(kVerbs) + " " + pick(kObjects) + " " + pick(kTails);
    s[0] = static_cast<char>(s[0] - 'a' + 'A');
    out += s + (rng() % 4 == 0 ? ".\n" : ". ");
  }
  return out;
}

bool ReadCorpus(const std::string& path, size_t min_bytes, std::string* out, std::string* error) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    *error = "cannot read --data " + path;
    return false;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  if (out->size() < min_bytes) {
    *error = "--data " + path + " has " + std::to_string(out->size()) + " bytes; at least " +
             std::to_string(min_bytes) + " are needed (--seq + 1: a sequence and its next-token targets)";
    return false;
  }
  return true;
}

void SampleBatch(const std::string& corpus, uint64_t seed, int64_t step, int B, int T,
                 std::vector<int32_t>* inputs, std::vector<int32_t>* targets) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(step));
  inputs->resize(static_cast<size_t>(B) * T);
  targets->resize(inputs->size());
  const size_t span = corpus.size() - static_cast<size_t>(T) - 1;
  for (int b = 0; b < B; ++b) {
    const size_t at = rng() % (span + 1);
    for (int t = 0; t < T; ++t) {
      (*inputs)[static_cast<size_t>(b) * T + t] = static_cast<uint8_t>(corpus[at + t]);
      (*targets)[static_cast<size_t>(b) * T + t] = static_cast<uint8_t>(corpus[at + t + 1]);
    }
  }
}

void SampleRankBatch(const std::string& corpus, uint64_t seed, int64_t step, int B, int T, int rank, int world,
                     std::vector<int32_t>* inputs, std::vector<int32_t>* targets) {
  SampleBatch(corpus, seed, step, B, T, inputs, targets);
  if (world == 1) return;
  const size_t count = static_cast<size_t>(B / world) * static_cast<size_t>(T);  // tokens per rank
  const size_t first = static_cast<size_t>(rank) * count;
  inputs->erase(inputs->begin(), inputs->begin() + static_cast<std::ptrdiff_t>(first));
  inputs->resize(count);
  targets->erase(targets->begin(), targets->begin() + static_cast<std::ptrdiff_t>(first));
  targets->resize(count);
}

}  // namespace strata::train

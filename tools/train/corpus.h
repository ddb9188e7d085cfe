// Training data for strata-train: byte-level tokens from a text file, or a
// built-in corpus generated deterministically (no downloads, ever), and a
// sampler whose batch for step s depends only on (seed, s), so a resumed run
// sees the same batches as an uninterrupted one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::train {

// The built-in corpus: about `bytes` of English-like sentences from a small
// grammar, the same for the same seed.
std::string BuiltinCorpus(uint64_t seed, size_t bytes);

// Reads `path` whole; false (with `error`) when it cannot, or it is shorter
// than `min_bytes`.
bool ReadCorpus(const std::string& path, size_t min_bytes, std::string* out, std::string* error);

// Fills inputs and targets (B*T each; targets = inputs shifted by one) with
// B windows of the corpus at positions drawn from (seed, step).
void SampleBatch(const std::string& corpus, uint64_t seed, int64_t step, int B, int T,
                 std::vector<int32_t>* inputs, std::vector<int32_t>* targets);

// Data parallelism: this rank's slice of the global batch that SampleBatch
// draws for (seed, step) — rows [rank*B/world, (rank+1)*B/world), so the
// ranks together see exactly the batch one rank would. REQUIRES: world
// divides B (the caller refuses other batches, naming the numbers).
void SampleRankBatch(const std::string& corpus, uint64_t seed, int64_t step, int B, int T, int rank, int world,
                     std::vector<int32_t>* inputs, std::vector<int32_t>* targets);

}  // namespace strata::train

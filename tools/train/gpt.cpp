// Forward and backward of the GPT over the engine's groups.
#include "tools/train/gpt.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <algorithm>

#include "kernels/cpu/layers/convert.h"
#include "kernels/cpu/layers/encoder.h"

namespace strata::train {

namespace {

bool Ok(strata_status_t s, const char* what, std::string* error) {
  if (s == STRATA_OK) return true;
  *error = std::string(what) + ": " + strata_status_name(s) + ": " + strata_last_error();
  return false;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

uint64_t Gpt::param_count() const { return layers::GptParamCount(cfg_); }

namespace {

// The initial values of one tensor, drawn in chunks of kInitChunk values,
// each from its own generator seeded by (seed, tensor, chunk): the values
// do not depend on how many threads draw them, and a 1.5B model's take
// seconds instead of most of a minute.
constexpr uint64_t kInitChunk = uint64_t{1} << 20;

uint64_t MixSeed(uint64_t x) {  // SplitMix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void DrawNormal(float* out, uint64_t count, uint64_t seed, uint64_t tensor, float scale) {
  const uint64_t chunks = (count + kInitChunk - 1) / kInitChunk;
  auto draw = [&](uint64_t c) {
    std::mt19937_64 rng(MixSeed(MixSeed(seed ^ MixSeed(tensor)) ^ c));
    std::normal_distribution<float> normal(0.0f, 0.02f);
    const uint64_t end = std::min(count, (c + 1) * kInitChunk);
    for (uint64_t i = c * kInitChunk; i < end; ++i) out[i] = normal(rng) * scale;
  };
  const unsigned threads = static_cast<unsigned>(std::min<uint64_t>(chunks, std::max(1u, std::thread::hardware_concurrency())));
  if (threads <= 1) {
    for (uint64_t c = 0; c < chunks; ++c) draw(c);
    return;
  }
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (uint64_t c = t; c < chunks; c += threads) draw(c);
    });
  for (auto& th : pool) th.join();
}

}  // namespace

bool RegisterGpt(const layers::GptConfig& cfg, strata_engine_t* e, uint64_t seed, std::string* error) {
  const float proj_scale = 1.0f / std::sqrt(2.0f * static_cast<float>(cfg.layers));
  uint64_t tensor_no = 0;
  auto add = [&](int group, const layers::ParamTensor& t, const std::string& prefix, bool is_proj) {
    std::vector<float> init(t.count);
    const std::string name = t.name;
    const bool ln_weight = name.find("ln") != std::string::npos && name.find("weight") != std::string::npos;
    const bool bias = name.find("bias") != std::string::npos;
    const uint64_t this_tensor = tensor_no++;
    if (ln_weight || bias) std::fill(init.begin(), init.end(), ln_weight ? 1.0f : 0.0f);
    else DrawNormal(init.data(), t.count, seed, this_tensor, is_proj ? proj_scale : 1.0f);
    uint64_t off = 0;
    // Shaped as torch holds them (biases and norms 1-D), so that a
    // strata-export of the checkpoint loads into a model.
    const int64_t shape[2] = {static_cast<int64_t>(t.rows), static_cast<int64_t>(t.cols)};
    const bool flat = t.rows == 1;
    return Ok(strata_engine_add_param_shaped(e, group, (prefix + name).c_str(), flat ? 1 : 2, flat ? shape + 1 : shape,
                                             init.data(), &off),
              "add_param", error);
  };
  for (const auto& t : layers::EmbedParamTensors(cfg))
    if (!add(0, t, "", false)) return false;
  for (int l = 0; l < cfg.layers; ++l)
    for (const auto& t : layers::BlockParamTensors(cfg)) {
      const std::string n = t.name;
      const bool proj = n == "attn.proj.weight" || n == "mlp.proj.weight";
      if (!add(l + 1, t, "h" + std::to_string(l) + ".", proj)) return false;
    }
  return true;
}

uint64_t Gpt::HostBufferBytes() const {
  // What Setup allocates, in floats.
  const uint64_t B = static_cast<uint64_t>(B_), T = static_cast<uint64_t>(T_), N = B * T;
  const uint64_t C = static_cast<uint64_t>(cfg_.channels), V = static_cast<uint64_t>(cfg_.vocab);
  const uint64_t inputs = offload_ ? 3 : static_cast<uint64_t>(cfg_.layers) + 1;
  const uint64_t floats = (inputs + 2) * N * C + 2 * layers::EmbedParamCount(cfg_) +
                          2 * layers::BlockParamCount(cfg_) + layers::BlockActsFloats(cfg_, B, T) + 2 * N * C + 3 * N +
                          std::min<uint64_t>(N, layers::kHeadChunkRows) * V;
  return floats * sizeof(float);
}

void Gpt::Setup() {
  if (ready_) return;
  const size_t BTC = static_cast<size_t>(B_) * T_ * cfg_.channels;
  x_.assign(offload_ ? 3 : static_cast<size_t>(cfg_.layers) + 1, std::vector<float>(BTC));
  stashed_.assign(static_cast<size_t>(cfg_.layers), 0);
  embed_.resize(layers::EmbedParamCount(cfg_));
  dembed_.resize(embed_.size());
  block_.resize(layers::BlockParamCount(cfg_));
  dblock_.resize(block_.size());
  dx_.resize(BTC);
  dx2_.resize(BTC);
  layers::BlockActsInit(&acts_, cfg_, static_cast<size_t>(B_), static_cast<size_t>(T_));
  layers::HeadActsInit(&head_, cfg_, static_cast<size_t>(B_), static_cast<size_t>(T_));
  ready_ = true;
}

bool Gpt::FetchF32(strata_engine_t* e, int group, std::vector<float>* out, std::string* error) {
  void* p = nullptr;
  if (!Ok(strata_engine_fetch(e, group, nullptr, &p), "fetch", error)) return false;
  layers::ToF32(static_cast<DType>(dtype_), p, out->data(), out->size());
  return Ok(strata_engine_release(e, group, nullptr), "release", error);
}

bool Gpt::TrainStep(strata_engine_t* e, const int32_t* inputs, const int32_t* targets, double loss_scale,
                    double* loss, std::string* error) {
  if (!dtype_known_) {
    if (!Ok(strata_engine_compute_dtype(e, &dtype_), "compute_dtype", error)) return false;
    dtype_known_ = true;
  }
  Setup();
  const size_t B = static_cast<size_t>(B_), T = static_cast<size_t>(T_), C = static_cast<size_t>(cfg_.channels);
  const int L = cfg_.layers;
  const size_t V = static_cast<size_t>(cfg_.vocab);
  const float* wte = embed_.data();
  const float* wpe = wte + V * C;
  // Forward: embeddings, then each block from its input (kept for backward).
  if (!FetchF32(e, 0, &embed_, error)) return false;
  double t0 = Now();
  layers::EncoderForward(x_[0].data(), inputs, wte, wpe, B, T, C, V);
  compute_s_ += Now() - t0;
  // Offloaded, block l's input and output alternate in x_[0] and x_[1],
  // and its input goes to the engine once the block has run.
  auto in_of = [&](int l) -> std::vector<float>& { return x_[offload_ ? static_cast<size_t>(l % 2) : static_cast<size_t>(l)]; };
  const size_t act_bytes = B * T * C * sizeof(float);
  for (int l = 0; l < L; ++l) {
    if (!FetchF32(e, l + 1, &block_, error)) return false;
    t0 = Now();
    layers::BlockForward(cfg_, block_.data(), in_of(l).data(), in_of(l + 1).data(), &acts_, B, T);
    compute_s_ += Now() - t0;
    if (offload_ && !Ok(strata_engine_stash(e, in_of(l).data(), act_bytes, nullptr, &stashed_[static_cast<size_t>(l)]),
                        "stash", error))
      return false;
  }
  if (before_backward && !before_backward(error)) return false;
  // Head (tied to wte, which group 0 holds): loss and its backward.
  if (!FetchF32(e, 0, &embed_, error)) return false;
  t0 = Now();
  std::memset(dembed_.data(), 0, dembed_.size() * sizeof(float));
  *loss = layers::HeadForwardBackward(cfg_, embed_.data(), in_of(L).data(), targets, B, T, &head_, dx_.data(),
                                      dembed_.data());
  compute_s_ += Now() - t0;
  // Backward through the blocks, recomputing each (activation checkpointing).
  for (int l = L - 1; l >= 0; --l) {
    if (offload_ && !Ok(strata_engine_redeem(e, stashed_[static_cast<size_t>(l)], x_[2].data(), act_bytes, nullptr),
                        "redeem", error))
      return false;
    if (!FetchF32(e, l + 1, &block_, error)) return false;
    t0 = Now();
    std::memset(dblock_.data(), 0, dblock_.size() * sizeof(float));
    layers::BlockBackward(cfg_, block_.data(), offload_ ? x_[2].data() : x_[l].data(), dx_.data(), &acts_,
                          layers::BlockBackwardMode::kRecompute,
                          dblock_.data(), dx2_.data(), B, T);
    dx_.swap(dx2_);
    if (loss_scale != 1.0)
      for (auto& g : dblock_) g *= static_cast<float>(loss_scale);
    compute_s_ += Now() - t0;
    if (!Ok(strata_engine_grads(e, l + 1, dblock_.data(), STRATA_DTYPE_F32, nullptr), "grads", error)) return false;
  }
  t0 = Now();
  layers::EncoderBackward(dembed_.data(), dembed_.data() + V * C, dx_.data(), inputs, B, T, C);
  if (loss_scale != 1.0)
    for (auto& g : dembed_) g *= static_cast<float>(loss_scale);
  compute_s_ += Now() - t0;
  return Ok(strata_engine_grads(e, 0, dembed_.data(), STRATA_DTYPE_F32, nullptr), "grads", error);
}

}  // namespace strata::train

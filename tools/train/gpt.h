// The GPT-2-style decoder trained through the C API: group 0 holds the
// embeddings and the final LayerNorm (wte is also the tied LM head), group l
// (1..L) holds block l-1. Activation checkpointing per block: the forward
// keeps only each block's input; the backward recomputes the block.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cpu/layers/block.h"
#include "kernels/cpu/layers/gpt_config.h"
#include "kernels/cpu/layers/head.h"
#include "strata/strata.h"

namespace strata::train {

// Registers every tensor with GPT-2's initialization (normal(0, 0.02),
// residual projections scaled by 1/sqrt(2L), LayerNorm weights 1, biases 0).
bool RegisterGpt(const layers::GptConfig& cfg, strata_engine_t* e, uint64_t seed, std::string* error);

// What the training loop drives: the CPU model below or the GPU one (gpt_cuda.h).
class GptModel {
 public:
  virtual ~GptModel() = default;
  // One forward and backward pass on (inputs, targets), (B, T) each, host
  // memory; the gradients, times `loss_scale`, go to the engine group by group.
  // `before_backward`, when set, runs between the two, before the step's
  // first gradients (the loop's prepare_step: the last step's writes left
  // behind go on beside this forward); false fails the step with its error.
  std::function<bool(std::string* error)> before_backward;
  virtual bool TrainStep(strata_engine_t* e, const int32_t* inputs, const int32_t* targets, double loss_scale,
                         double* loss, std::string* error) = 0;
  virtual double compute_seconds() const = 0;  // in the kernels, cumulative
  // --offload-activations: each block's input goes to the engine's
  // activation store after its forward (strata_engine_stash) and comes back
  // for its backward (strata_engine_redeem), so the model keeps three of
  // them instead of one a layer. false: this model cannot.
  virtual bool OffloadActivations() { return false; }
  // The host memory the model's own buffers take (activations, the host
  // copies of a fetched group and its gradients), allocated by Allocate (or
  // at the first TrainStep); 0 where they are not in host memory.
  virtual uint64_t HostBufferBytes() const { return 0; }
  virtual void Allocate() {}
};

// The CPU model: fp32 CPU layers over host copies of the fetched groups.
class Gpt : public GptModel {
 public:
  Gpt(const layers::GptConfig& cfg, int B, int T) : cfg_(cfg), B_(B), T_(T) {}
  bool TrainStep(strata_engine_t* e, const int32_t* inputs, const int32_t* targets, double loss_scale,
                 double* loss, std::string* error) override;
  double compute_seconds() const override { return compute_s_; }
  bool OffloadActivations() override {
    offload_ = true;
    return true;
  }
  uint64_t param_count() const;
  uint64_t HostBufferBytes() const override;
  void Allocate() override { Setup(); }

 private:
  bool FetchF32(strata_engine_t* e, int group, std::vector<float>* out, std::string* error);
  void Setup();

  layers::GptConfig cfg_;
  int B_, T_;
  bool ready_ = false;  // Setup done
  bool dtype_known_ = false;
  strata_dtype_t dtype_ = STRATA_DTYPE_F32;
  std::vector<std::vector<float>> x_;  // block inputs (B, T, C), L + 1 of them (offloaded: 3, see TrainStep)
  bool offload_ = false;
  std::vector<uint64_t> stashed_;  // offloaded: block l's input's handle
  std::vector<float> embed_, block_, dembed_, dblock_, dx_, dx2_;
  layers::BlockActs acts_;
  layers::HeadActs head_;
  double compute_s_ = 0;
};

}  // namespace strata::train

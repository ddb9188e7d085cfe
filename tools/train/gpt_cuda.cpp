// The GPT's forward and backward on the GPU, in tools/train/gpt.cpp's order:
// fetch a group (device pointer, compute dtype), run its layers on our stream,
// release it, and for the backward hand its fp32 gradients over.
#include "tools/train/gpt_cuda.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cuda/adam_cuda.h"
#include "kernels/cuda/layers/block.h"
#include "kernels/cuda/layers/context.h"
#include "kernels/cuda/layers/encoder.h"
#include "kernels/cuda/layers/head.h"
#include "strata/strata.h"

namespace strata::train {
namespace {

using layers::CudaDeviceBuffer;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Status Api(strata_status_t s, const char* what) {
  if (s == STRATA_OK) return Status::Ok();
  return Status(Code::kInternal,
                std::string(what) + ": " + strata_status_name(s) + ": " + strata_last_error());
}

Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return InternalError(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

Status CheckTokens(const char* what, const int32_t* t, size_t n, int vocab) {
  for (size_t i = 0; i < n; ++i)
    if (t[i] < 0 || t[i] >= vocab)
      return InvalidError(std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(t[i]) +
                          " is outside the vocabulary of " + std::to_string(vocab));
  return Status::Ok();
}

class GptCuda : public GptModel {
 public:
  GptCuda(const layers::GptConfig& cfg, int B, int T)
      : cfg_(cfg), B_(static_cast<size_t>(B)), T_(static_cast<size_t>(T)) {}

  bool TrainStep(strata_engine_t* e, const int32_t* inputs, const int32_t* targets, double loss_scale,
                 double* loss, std::string* error) override {
    const Status s = Step(e, inputs, targets, loss_scale, loss);
    if (s.ok()) return true;
    *error = "GPU step: " + s.ToString();
    return false;
  }
  double compute_seconds() const override { return compute_s_; }
  bool OffloadActivations() override {
    offload_ = true;
    return true;
  }

 private:
  size_t C() const { return static_cast<size_t>(cfg_.channels); }
  size_t V() const { return static_cast<size_t>(cfg_.vocab); }
  size_t NC() const { return B_ * T_ * C(); }
  // Block l's input. Offloaded, x_ holds three: inputs and outputs alternate
  // in the first two, and the third takes a redeemed input for its backward.
  float* x(int l) const {
    return static_cast<float*>(x_.get()) + static_cast<size_t>(offload_ ? l % 2 : l) * NC();
  }
  float* redeemed() const { return static_cast<float*>(x_.get()) + 2 * NC(); }
  float* f(const CudaDeviceBuffer& b) const { return static_cast<float*>(b.get()); }
  const layers::CudaLayerContext& ctx() const { return rt_.context(); }

  Status Setup(strata_engine_t* e);
  Status Step(strata_engine_t* e, const int32_t* inputs, const int32_t* targets, double loss_scale,
              double* loss);
  Status Forward(strata_engine_t* e);
  Status Head(strata_engine_t* e, float loss_scale);
  Status Backward(strata_engine_t* e);

  Status Fetch(strata_engine_t* e, int group, const void** p) {
    void* ptr = nullptr;
    STRATA_RETURN_IF_ERROR(Api(strata_engine_fetch(e, group, ctx().stream, &ptr), "strata_engine_fetch"));
    *p = ptr;
    return Status::Ok();
  }
  Status Release(strata_engine_t* e, int group) {
    return Api(strata_engine_release(e, group, ctx().stream), "strata_engine_release");
  }
  // Ends a span of kernels: waits for the stream, so that compute_s_ is the
  // kernels' time. It costs no overlap: release and grads wait for the stream too.
  Status EndCompute(double t0) {
    STRATA_RETURN_IF_ERROR(rt_.Synchronize());
    compute_s_ += Now() - t0;
    return Status::Ok();
  }

  layers::GptConfig cfg_;
  size_t B_, T_;
  bool ready_ = false;
  DType dtype_ = DType::kF32;
  layers::CudaLayerRuntime rt_;
  layers::BlockActsCuda acts_;
  layers::HeadActsCuda head_;
  CudaDeviceBuffer x_;                // (L + 1) block inputs (B, T, C); x_[L] is the head's input (offloaded: 3)
  bool offload_ = false;              // --offload-activations: block inputs stashed in the engine
  std::vector<uint64_t> stashed_;     // offloaded: block l's input's handle
  CudaDeviceBuffer embed32_;          // the embedding group as fp32 (for the encoder)
  CudaDeviceBuffer dembed_, dblock_;  // fp32 gradients of the embedding group and of one block
  CudaDeviceBuffer dx_, dx2_;         // (B, T, C) gradients flowing back
  CudaDeviceBuffer tokens_, targets_;
  std::vector<float> losses_;
  double compute_s_ = 0;
};

Status GptCuda::Setup(strata_engine_t* e) {
  strata_dtype_t dt;
  STRATA_RETURN_IF_ERROR(Api(strata_engine_compute_dtype(e, &dt), "strata_engine_compute_dtype"));
  dtype_ = static_cast<DType>(dt);
  int on_gpu = 0;
  STRATA_RETURN_IF_ERROR(Api(strata_engine_device_is_gpu(e, &on_gpu), "strata_engine_device_is_gpu"));
  if (!on_gpu) return StateError("the engine's device tier is host memory, not the GPU (force_no_gpu?)");
  STRATA_RETURN_IF_ERROR(rt_.Init());
  const size_t L = static_cast<size_t>(cfg_.layers), N = B_ * T_, F = sizeof(float);
  STRATA_RETURN_IF_ERROR(layers::BlockActsCudaInit(&acts_, cfg_, B_, T_, dtype_));
  STRATA_RETURN_IF_ERROR(layers::HeadActsCudaInit(&head_, cfg_, B_, T_, dtype_));
  STRATA_RETURN_IF_ERROR(x_.Allocate((offload_ ? 3 : L + 1) * NC() * F));
  stashed_.assign(L, 0);
  STRATA_RETURN_IF_ERROR(embed32_.Allocate(layers::EmbedParamCount(cfg_) * F));
  STRATA_RETURN_IF_ERROR(dembed_.Allocate(layers::EmbedParamCount(cfg_) * F));
  STRATA_RETURN_IF_ERROR(dblock_.Allocate(layers::BlockParamCount(cfg_) * F));
  STRATA_RETURN_IF_ERROR(dx_.Allocate(NC() * F));
  STRATA_RETURN_IF_ERROR(dx2_.Allocate(NC() * F));
  STRATA_RETURN_IF_ERROR(tokens_.Allocate(N * sizeof(int32_t)));
  STRATA_RETURN_IF_ERROR(targets_.Allocate(N * sizeof(int32_t)));
  losses_.resize(N);
  ready_ = true;
  return Status::Ok();
}

Status GptCuda::Step(strata_engine_t* e, const int32_t* inputs, const int32_t* targets, double loss_scale,
                     double* loss) {
  if (!ready_) STRATA_RETURN_IF_ERROR(Setup(e));
  const size_t N = B_ * T_;
  // The kernels cannot abort on a bad id (the CPU layers do): refuse it here.
  STRATA_RETURN_IF_ERROR(CheckTokens("inputs", inputs, N, cfg_.vocab));
  STRATA_RETURN_IF_ERROR(CheckTokens("targets", targets, N, cfg_.vocab));
  // Pageable sources: each copy has read the host array when it returns.
  STRATA_RETURN_IF_ERROR(
      Cuda(cudaMemcpyAsync(tokens_.get(), inputs, N * sizeof(int32_t), cudaMemcpyHostToDevice, ctx().stream),
           "cudaMemcpyAsync tokens"));
  STRATA_RETURN_IF_ERROR(Cuda(
      cudaMemcpyAsync(targets_.get(), targets, N * sizeof(int32_t), cudaMemcpyHostToDevice, ctx().stream),
      "cudaMemcpyAsync targets"));
  STRATA_RETURN_IF_ERROR(Forward(e));
  if (before_backward) {
    std::string why;
    if (!before_backward(&why)) return InternalError(why);
  }
  STRATA_RETURN_IF_ERROR(Head(e, static_cast<float>(loss_scale)));
  STRATA_RETURN_IF_ERROR(Backward(e));
  double sum = 0;  // the per-token losses came back in Head; summed in order, in fp64, as the CPU head does
  for (float l : losses_) sum += l;
  *loss = sum / static_cast<double>(N);
  return Status::Ok();
}

// Embeddings, then each block from its input (kept for the backward).
Status GptCuda::Forward(strata_engine_t* e) {
  const void* p = nullptr;
  STRATA_RETURN_IF_ERROR(Fetch(e, 0, &p));
  double t0 = Now();
  STRATA_RETURN_IF_ERROR(
      kernels::CastCuda(dtype_, p, DType::kF32, embed32_.get(), layers::EmbedParamCount(cfg_), ctx().stream));
  const float* wte = f(embed32_);
  STRATA_RETURN_IF_ERROR(layers::EncoderForwardCuda(ctx(), x(0), static_cast<const int32_t*>(tokens_.get()),
                                                    wte, wte + V() * C(), B_, T_, C(), V()));
  STRATA_RETURN_IF_ERROR(EndCompute(t0));
  STRATA_RETURN_IF_ERROR(Release(e, 0));
  for (int l = 0; l < cfg_.layers; ++l) {
    STRATA_RETURN_IF_ERROR(Fetch(e, l + 1, &p));
    t0 = Now();
    STRATA_RETURN_IF_ERROR(layers::BlockForwardCuda(ctx(), cfg_, p, dtype_, x(l), x(l + 1), &acts_, B_, T_));
    STRATA_RETURN_IF_ERROR(EndCompute(t0));
    STRATA_RETURN_IF_ERROR(Release(e, l + 1));
    // The input goes to the engine (stash waits for the stream, copies, and
    // returns with the copy done: the next block may overwrite it).
    if (offload_)
      STRATA_RETURN_IF_ERROR(Api(strata_engine_stash(e, x(l), NC() * sizeof(float), ctx().stream,
                                                     &stashed_[static_cast<size_t>(l)]),
                                 "strata_engine_stash"));
  }
  return Status::Ok();
}

// The head (tied to wte, which group 0 holds): per-token losses back to the
// host, and the backward of loss_scale · mean loss into dx_ and dembed_.
Status GptCuda::Head(strata_engine_t* e, float loss_scale) {
  const void* p = nullptr;
  STRATA_RETURN_IF_ERROR(Fetch(e, 0, &p));
  const double t0 = Now();
  STRATA_RETURN_IF_ERROR(
      Cuda(cudaMemsetAsync(dembed_.get(), 0, dembed_.bytes(), ctx().stream), "cudaMemsetAsync dembed"));
  STRATA_RETURN_IF_ERROR(layers::HeadForwardBackwardCuda(ctx(), cfg_, p, dtype_, x(cfg_.layers),
                                                         static_cast<const int32_t*>(targets_.get()), B_, T_,
                                                         &head_, f(dx_), f(dembed_), loss_scale));
  STRATA_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(losses_.data(), head_.losses, losses_.size() * sizeof(float),
                                              cudaMemcpyDeviceToHost, ctx().stream),
                              "cudaMemcpyAsync losses"));
  STRATA_RETURN_IF_ERROR(EndCompute(t0));  // also: the losses are on the host
  return Release(e, 0);
}

// Backward through the blocks, recomputing each (activation checkpointing),
// then the embeddings; each group's gradients go to the engine as soon as done.
Status GptCuda::Backward(strata_engine_t* e) {
  const void* p = nullptr;
  float* dx = f(dx_);  // the head's output; then each block's dx_in in turn
  float* dx2 = f(dx2_);
  for (int l = cfg_.layers - 1; l >= 0; --l) {
    // Redeem waits for the stream (the last block's backward read this
    // buffer) and returns with the input in it.
    if (offload_)
      STRATA_RETURN_IF_ERROR(Api(strata_engine_redeem(e, stashed_[static_cast<size_t>(l)], redeemed(),
                                                      NC() * sizeof(float), ctx().stream),
                                 "strata_engine_redeem"));
    STRATA_RETURN_IF_ERROR(Fetch(e, l + 1, &p));
    const double t0 = Now();
    STRATA_RETURN_IF_ERROR(
        Cuda(cudaMemsetAsync(dblock_.get(), 0, dblock_.bytes(), ctx().stream), "cudaMemsetAsync dblock"));
    STRATA_RETURN_IF_ERROR(layers::BlockBackwardCuda(ctx(), cfg_, p, dtype_, offload_ ? redeemed() : x(l), dx, &acts_,
                                                     layers::BlockBackwardMode::kRecompute, f(dblock_), dx2,
                                                     B_, T_));
    STRATA_RETURN_IF_ERROR(EndCompute(t0));
    std::swap(dx, dx2);
    STRATA_RETURN_IF_ERROR(Release(e, l + 1));
    // grads copies dblock_ before it returns, so the next block may overwrite it.
    STRATA_RETURN_IF_ERROR(Api(strata_engine_grads(e, l + 1, dblock_.get(), STRATA_DTYPE_F32, ctx().stream),
                               "strata_engine_grads"));
  }
  const double t0 = Now();
  float* dembed = f(dembed_);
  STRATA_RETURN_IF_ERROR(layers::EncoderBackwardCuda(
      ctx(), dembed, dembed + V() * C(), dx, static_cast<const int32_t*>(tokens_.get()), B_, T_, C(), V()));
  STRATA_RETURN_IF_ERROR(EndCompute(t0));
  return Api(strata_engine_grads(e, 0, dembed_.get(), STRATA_DTYPE_F32, ctx().stream), "strata_engine_grads");
}

}  // namespace

std::string GpuUnavailableReason() {
  const Result<int> gpus = kernels::CudaDeviceCount();
  if (!gpus.ok()) return gpus.status().message();
  if (gpus.value() == 0) return "cudaGetDeviceCount found no CUDA device";
  return "";
}

std::unique_ptr<GptModel> MakeGptCuda(const layers::GptConfig& cfg, int B, int T) {
  return std::make_unique<GptCuda>(cfg, B, T);
}

}  // namespace strata::train

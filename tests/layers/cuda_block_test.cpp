// A whole CUDA block, and one step of a small whole model (encoder, blocks,
// head and back, in the order of tools/train/gpt.cpp), against the CPU layers
// on the same parameters and inputs: outputs and every parameter gradient,
// tensor by tensor. Also on the GPU alone: the kSaved backward equals the
// kRecompute one bitwise, and a second run equals the first bitwise. Exits 77
// without a GPU.
//
// Tolerances, on ||gpu - cpu|| / ||cpu|| per tensor (a wrong index, layout or
// missed accumulation gives errors of order 1):
//   f32   1e-4  every GEMM in plain fp32, so only summation order and fp32
//               sums (the CPU sums some in fp64) differ: expected ~1e-6, and a
//               chain of a dozen layers stays well inside.
//   bf16  2e-2  linear-layer inputs rounded to bf16 (unit roundoff 2^-8; about
//               2e-3 relative per GEMM after averaging over a dot product) and
//               TF32 attention; a backward chains ~10 such GEMMs, which adds
//               up to ~5e-3 — the tolerance leaves a factor of ~4.
#include <array>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/layers/block.h"
#include "kernels/cpu/layers/encoder.h"
#include "kernels/cpu/layers/head.h"
#include "kernels/cuda/adam_cuda.h"
#include "kernels/cuda/layers/block.h"
#include "kernels/cuda/layers/encoder.h"
#include "kernels/cuda/layers/head.h"
#include "tests/layers/cuda_test_util.h"

namespace strata::layers::cuda_test {
namespace {

double Tolerance(DType dtype) { return dtype == DType::kF32 ? 1e-4 : 2e-2; }

// A block's parameters: LayerNorm weights near 1, the rest small, so that the
// activations stay O(1) as in a trained model.
std::vector<float> RandomBlock(const GptConfig& cfg, uint64_t seed) {
  std::vector<float> p = Random(BlockParamCount(cfg), seed, -0.1f, 0.1f);
  for (int t : {kLn1Weight, kLn2Weight}) {
    const ParamTensor pt = BlockParamTensors(cfg)[t];
    for (size_t i = 0; i < pt.count; ++i) p[pt.offset + i] += 1.0f;
  }
  return p;
}

std::vector<float> RandomEmbed(const GptConfig& cfg, uint64_t seed) {
  std::vector<float> p = Random(EmbedParamCount(cfg), seed, -0.3f, 0.3f);
  const ParamTensor w = EmbedParamTensors(cfg)[kLnfWeight];
  for (size_t i = 0; i < w.count; ++i) p[w.offset + i] += 1.0f;
  return p;
}

// Values the GPU gets (bytes of `dtype`) and the same values as fp32 for the CPU.
struct Params {
  std::vector<uint8_t> lo;
  std::vector<float> f32;
};
Params Split(DType dtype, const std::vector<float>& p) {
  Params out{AsDType(dtype, p), std::vector<float>(p.size())};
  ToF32(dtype, out.lo.data(), out.f32.data(), p.size());
  return out;
}

// Compares got - start with want - start for each tensor of a layout.
template <size_t K>
void CompareGrads(const std::string& what, const std::array<ParamTensor, K>& layout,
                  const std::vector<float>& got, const std::vector<float>& want,
                  const std::vector<float>& start, double tol) {
  for (const ParamTensor& t : layout) {
    std::vector<float> g(t.count), w(t.count);
    for (size_t i = 0; i < t.count; ++i) {
      g[i] = got[t.offset + i] - start[t.offset + i];
      w[i] = want[t.offset + i] - start[t.offset + i];
    }
    Compare(what + " d" + t.name, g, w, tol);
  }
}

void BlockCase(const CudaLayerContext& ctx, DType dtype) {
  const GptConfig cfg{64, 16, 64, 4, 1};
  const size_t B = 2, T = 13, N = B * T, C = 64, P = BlockParamCount(cfg);
  const std::string n = std::string("block ") + DTypeName(dtype);
  const double tol = Tolerance(dtype);
  const Params params = Split(dtype, RandomBlock(cfg, 70));
  const auto x = Random(N * C, 71), dx_out = Random(N * C, 72), dparams0 = Random(P, 73, -0.01f, 0.01f);
  // CPU
  BlockActs cpu;
  BlockActsInit(&cpu, cfg, B, T);
  std::vector<float> x_out(N * C), dx_in(N * C), dparams = dparams0;
  BlockForward(cfg, params.f32.data(), x.data(), x_out.data(), &cpu, B, T);
  BlockBackward(cfg, params.f32.data(), x.data(), dx_out.data(), &cpu, BlockBackwardMode::kRecompute,
                dparams.data(), dx_in.data(), B, T);
  // GPU
  BlockActsCuda gpu;
  Must(BlockActsCudaInit(&gpu, cfg, B, T, dtype), "BlockActsCudaInit");
  Dev d_params(ctx, params.lo), d_x(ctx, x), d_dx_out(ctx, dx_out), d_x_out(ctx, x_out), d_dx_in(ctx, dx_in),
      d_dparams(ctx, dparams0);
  auto run = [&](BlockBackwardMode mode) {
    Must(cudaMemcpyAsync(d_dparams.f(), dparams0.data(), P * sizeof(float), cudaMemcpyHostToDevice,
                         ctx.stream) == cudaSuccess
             ? Status::Ok()
             : InternalError("cudaMemcpyAsync"),
         "reset dparams");
    Must(BlockForwardCuda(ctx, cfg, d_params.v(), dtype, d_x.f(), d_x_out.f(), &gpu, B, T),
         "BlockForwardCuda");
    Must(BlockBackwardCuda(ctx, cfg, d_params.v(), dtype, d_x.f(), d_dx_out.f(), &gpu, mode, d_dparams.f(),
                           d_dx_in.f(), B, T),
         "BlockBackwardCuda");
    return std::make_pair(Get(ctx, d_dx_in.f(), N * C), Get(ctx, d_dparams.f(), P));
  };
  const auto recompute = run(BlockBackwardMode::kRecompute);
  Compare(n + " x_out", Get(ctx, d_x_out.f(), N * C), x_out, tol);
  Compare(n + " dx_in", recompute.first, dx_in, tol);
  CompareGrads(n, BlockParamTensors(cfg), recompute.second, dparams, dparams0, tol);
  const auto saved = run(BlockBackwardMode::kSaved);
  ExpectBitwise(n + " kSaved == kRecompute dx_in", saved.first, recompute.first);
  ExpectBitwise(n + " kSaved == kRecompute dparams", saved.second, recompute.second);
  const auto again = run(BlockBackwardMode::kRecompute);
  ExpectBitwise(n + " run twice: dx_in", again.first, recompute.first);
  ExpectBitwise(n + " run twice: dparams", again.second, recompute.second);
}

// One training step's forward and backward, CPU side (tools/train/gpt.cpp's order).
struct CpuStep {
  float loss = 0;
  std::vector<float> dembed;
  std::vector<std::vector<float>> dblock;
};
CpuStep RunCpu(const GptConfig& cfg, const Params& embed, const std::vector<Params>& blocks,
               const std::vector<int32_t>& in, const std::vector<int32_t>& tg, size_t B, size_t T) {
  const size_t C = static_cast<size_t>(cfg.channels), V = static_cast<size_t>(cfg.vocab), L = blocks.size();
  std::vector<std::vector<float>> x(L + 1, std::vector<float>(B * T * C));
  BlockActs acts;
  BlockActsInit(&acts, cfg, B, T);
  HeadActs head;
  HeadActsInit(&head, cfg, B, T);
  const float* wte = embed.f32.data();
  EncoderForward(x[0].data(), in.data(), wte, wte + V * C, B, T, C, V);
  for (size_t l = 0; l < L; ++l)
    BlockForward(cfg, blocks[l].f32.data(), x[l].data(), x[l + 1].data(), &acts, B, T);
  CpuStep s;
  s.dembed.assign(embed.f32.size(), 0.0f);
  std::vector<float> dx(B * T * C), dx2(B * T * C);
  s.loss = HeadForwardBackward(cfg, embed.f32.data(), x[L].data(), tg.data(), B, T, &head, dx.data(),
                               s.dembed.data());
  s.dblock.assign(L, std::vector<float>(BlockParamCount(cfg), 0.0f));
  for (size_t l = L; l-- > 0;) {
    BlockBackward(cfg, blocks[l].f32.data(), x[l].data(), dx.data(), &acts, BlockBackwardMode::kRecompute,
                  s.dblock[l].data(), dx2.data(), B, T);
    dx.swap(dx2);
  }
  EncoderBackward(s.dembed.data(), s.dembed.data() + V * C, dx.data(), in.data(), B, T, C);
  return s;
}

// The same on the GPU: the embedding group as fetched (dtype) and as fp32 for the encoder.
CpuStep RunGpu(const CudaLayerContext& ctx, DType dtype, const GptConfig& cfg, const Params& embed,
               const std::vector<Params>& blocks, const std::vector<int32_t>& in,
               const std::vector<int32_t>& tg, size_t B, size_t T) {
  const size_t C = static_cast<size_t>(cfg.channels), V = static_cast<size_t>(cfg.vocab), L = blocks.size();
  const size_t NC = B * T * C, E = embed.f32.size(), P = BlockParamCount(cfg);
  std::vector<float> zeros_nc(NC, 0.0f), zeros_e(E, 0.0f), zeros_p(P, 0.0f);
  std::vector<std::unique_ptr<Dev>> x, params;
  for (size_t l = 0; l <= L; ++l) x.push_back(std::make_unique<Dev>(ctx, zeros_nc));
  for (size_t l = 0; l < L; ++l) params.push_back(std::make_unique<Dev>(ctx, blocks[l].lo));
  Dev d_embed(ctx, embed.lo), d_embed32(ctx, zeros_e), d_dembed(ctx, zeros_e), d_dblock(ctx, zeros_p),
      d_in(ctx, in), d_tg(ctx, tg), d_dx(ctx, zeros_nc), d_dx2(ctx, zeros_nc);
  BlockActsCuda acts;
  Must(BlockActsCudaInit(&acts, cfg, B, T, dtype), "BlockActsCudaInit");
  HeadActsCuda head;
  Must(HeadActsCudaInit(&head, cfg, B, T, dtype), "HeadActsCudaInit");
  Must(kernels::CastCuda(dtype, d_embed.v(), DType::kF32, d_embed32.f(), E, ctx.stream), "cast embed");
  const float* wte = d_embed32.f();
  Must(EncoderForwardCuda(ctx, x[0]->f(), d_in.i(), wte, wte + V * C, B, T, C, V), "encoder fwd");
  for (size_t l = 0; l < L; ++l)
    Must(BlockForwardCuda(ctx, cfg, params[l]->v(), dtype, x[l]->f(), x[l + 1]->f(), &acts, B, T),
         "block fwd");
  Must(HeadForwardBackwardCuda(ctx, cfg, d_embed.v(), dtype, x[L]->f(), d_tg.i(), B, T, &head, d_dx.f(),
                               d_dembed.f(), 1.0f),
       "head");
  CpuStep s;
  double sum = 0;
  for (float l : Get(ctx, head.losses, B * T)) sum += l;
  s.loss = static_cast<float>(sum / static_cast<double>(B * T));
  float *dx = d_dx.f(), *dx2 = d_dx2.f();
  s.dblock.resize(L);
  for (size_t l = L; l-- > 0;) {
    MustCuda(cudaMemsetAsync(d_dblock.f(), 0, P * sizeof(float), ctx.stream), "memset dblock");
    Must(BlockBackwardCuda(ctx, cfg, params[l]->v(), dtype, x[l]->f(), dx, &acts,
                           BlockBackwardMode::kRecompute, d_dblock.f(), dx2, B, T),
         "block bwd");
    std::swap(dx, dx2);
    s.dblock[l] = Get(ctx, d_dblock.f(), P);
  }
  Must(EncoderBackwardCuda(ctx, d_dembed.f(), d_dembed.f() + V * C, dx, d_in.i(), B, T, C, V), "encoder bwd");
  s.dembed = Get(ctx, d_dembed.f(), E);
  return s;
}

void ModelCase(const CudaLayerContext& ctx, DType dtype) {
  const GptConfig cfg{64, 16, 64, 4, 2};
  const size_t B = 2, T = 13;
  const std::string n = std::string("model ") + DTypeName(dtype);
  const double tol = Tolerance(dtype);
  const Params embed = Split(dtype, RandomEmbed(cfg, 80));
  std::vector<Params> blocks;
  for (int l = 0; l < cfg.layers; ++l) blocks.push_back(Split(dtype, RandomBlock(cfg, 81 + l)));
  const auto in = RandomTokens(B * T, cfg.vocab, 90), tg = RandomTokens(B * T, cfg.vocab, 91);
  const CpuStep want = RunCpu(cfg, embed, blocks, in, tg, B, T);
  const CpuStep got = RunGpu(ctx, dtype, cfg, embed, blocks, in, tg, B, T);
  Compare(n + " loss", std::vector<float>{got.loss}, std::vector<float>{want.loss}, tol);
  const std::vector<float> zeros_e(want.dembed.size(), 0.0f), zeros_p(BlockParamCount(cfg), 0.0f);
  CompareGrads(n + " embed", EmbedParamTensors(cfg), got.dembed, want.dembed, zeros_e, tol);
  for (int l = 0; l < cfg.layers; ++l)
    CompareGrads(n + " h" + std::to_string(l), BlockParamTensors(cfg), got.dblock[l], want.dblock[l], zeros_p,
                 tol);
}

}  // namespace
}  // namespace strata::layers::cuda_test

int main() {
  using namespace strata::layers::cuda_test;
  using strata::DType;
  SkipWithoutGpu();
  strata::layers::CudaLayerRuntime rt;
  Must(rt.Init(), "CudaLayerRuntime::Init");
  for (DType dt : {DType::kF32, DType::kBF16}) {
    BlockCase(rt.context(), dt);
    ModelCase(rt.context(), dt);
  }
  return Finish();
}

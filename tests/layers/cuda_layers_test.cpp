// Each CUDA layer against its CPU twin on the same random inputs: encoder,
// LayerNorm, matmul (f32, f16, bf16), GELU, residual, attention, cross-entropy
// and the head, forward and backward. Gradients start from random values, so
// that a "=" where "+=" is due fails. Exits 77 without a GPU.
//
// Tolerances, on ||gpu - cpu|| / ||cpu|| over a whole tensor (a wrong index,
// a missed row or a lost accumulation gives errors of order 1):
//   kSameMath 1e-5  the same fp32 formulas summed in another order, fp32 sums
//                   where the CPU sums in fp64: expected ~1e-7.
//   kExactIn  1e-4  f16/bf16 GEMMs whose inputs are exactly representable:
//                   only fp32 accumulation order differs (expected ~1e-6).
//   kBf16     2e-2  bf16 GEMM inputs rounded (unit roundoff 2^-8 = 3.9e-3 per
//                   value; independent roundings average out over a dot
//                   product to ~2e-3 relative): room for a chain of layers.
//   kF16      5e-3  the same with f16's unit roundoff 2^-11.
//   kTf32     5e-3  attention's TF32 GEMMs (10-bit mantissa, 2^-11).
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <vector>

#include "kernels/cpu/layers/attention.h"
#include "kernels/cpu/layers/cross_entropy.h"
#include "kernels/cpu/layers/elementwise.h"
#include "kernels/cpu/layers/encoder.h"
#include "kernels/cpu/layers/head.h"
#include "kernels/cpu/layers/layernorm.h"
#include "kernels/cpu/layers/matmul.h"
#include "kernels/cuda/layers/attention.h"
#include "kernels/cuda/layers/cross_entropy.h"
#include "kernels/cuda/layers/elementwise.h"
#include "kernels/cuda/layers/encoder.h"
#include "kernels/cuda/layers/head.h"
#include "kernels/cuda/layers/layernorm.h"
#include "kernels/cuda/layers/matmul.h"
#include "tests/layers/cuda_test_util.h"

namespace strata::layers::cuda_test {
namespace {

constexpr double kSameMath = 1e-5, kExactIn = 1e-4, kBf16 = 2e-2, kF16 = 5e-3, kTf32 = 5e-3;

std::string Dims(const char* name, std::initializer_list<size_t> dims) {
  std::string s = name;
  for (size_t d : dims) s += " " + std::to_string(d);
  return s;
}

void EncoderCase(const CudaLayerContext& ctx, size_t B, size_t T, size_t C, size_t V) {
  const std::string n = Dims("encoder", {B, T, C, V});
  const size_t maxT = T + 2, N = B * T;
  const auto tokens = RandomTokens(N, static_cast<int32_t>(V), 1);
  const auto wte = Random(V * C, 2), wpe = Random(maxT * C, 3), dout = Random(N * C, 4);
  auto dwte = Random(V * C, 5), dwpe = Random(maxT * C, 6);
  std::vector<float> out(N * C);
  Dev d_tokens(ctx, tokens), d_wte(ctx, wte), d_wpe(ctx, wpe), d_dout(ctx, dout), d_dwte(ctx, dwte),
      d_dwpe(ctx, dwpe), d_out(ctx, out);
  EncoderForward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, V);
  Must(EncoderForwardCuda(ctx, d_out.f(), d_tokens.i(), d_wte.f(), d_wpe.f(), B, T, C, V),
       "EncoderForwardCuda");
  Compare(n + " out", Get(ctx, d_out.f(), N * C), out, kSameMath);
  EncoderBackward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  Must(EncoderBackwardCuda(ctx, d_dwte.f(), d_dwpe.f(), d_dout.f(), d_tokens.i(), B, T, C, V),
       "EncoderBackwardCuda");
  Compare(n + " dwte", Get(ctx, d_dwte.f(), V * C), dwte, kSameMath);
  Compare(n + " dwpe", Get(ctx, d_dwpe.f(), maxT * C), dwpe, kSameMath);
}

void LayerNormCase(const CudaLayerContext& ctx, size_t N, size_t C) {
  const std::string n = Dims("layernorm", {N, C});
  const auto inp = Random(N * C, 10, -0.5f, 1.5f), w = Random(C, 11, 0.5f, 1.5f), b = Random(C, 12);
  const auto dout = Random(N * C, 13);
  auto dinp = Random(N * C, 14), dw = Random(C, 15), db = Random(C, 16);
  std::vector<float> out(N * C), mean(N), rstd(N);
  Dev d_inp(ctx, inp), d_w(ctx, w), d_b(ctx, b), d_dout(ctx, dout), d_dinp(ctx, dinp), d_dw(ctx, dw),
      d_db(ctx, db), d_out(ctx, out), d_mean(ctx, mean), d_rstd(ctx, rstd);
  CudaDeviceBuffer scratch;
  Must(scratch.Allocate(LayerNormBackwardScratchBytes(C)), "scratch");
  LayerNormForward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
  Must(LayerNormForwardCuda(ctx, d_out.f(), d_mean.f(), d_rstd.f(), d_inp.f(), d_w.f(), d_b.f(), N, C),
       "LN fwd");
  Compare(n + " out", Get(ctx, d_out.f(), N * C), out, kSameMath);
  Compare(n + " mean", Get(ctx, d_mean.f(), N), mean, kSameMath);
  Compare(n + " rstd", Get(ctx, d_rstd.f(), N), rstd, kSameMath);
  // Both backwards from the CPU's saved statistics, so that only the backward is compared.
  Dev d_mean_cpu(ctx, mean), d_rstd_cpu(ctx, rstd);
  LayerNormBackward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), mean.data(),
                    rstd.data(), N, C);
  Must(LayerNormBackwardCuda(ctx, d_dinp.f(), d_dw.f(), d_db.f(), d_dout.f(), d_inp.f(), d_w.f(),
                             d_mean_cpu.f(), d_rstd_cpu.f(), N, C,
                             CudaScratch{scratch.get(), scratch.bytes()}),
       "LN bwd");
  Compare(n + " dinp", Get(ctx, d_dinp.f(), N * C), dinp, kSameMath);
  Compare(n + " dweight", Get(ctx, d_dw.f(), C), dw, kSameMath);
  Compare(n + " dbias", Get(ctx, d_db.f(), C), db, kSameMath);
}

// exact: inputs made exactly representable in `dtype`, so only accumulation order differs.
void MatmulCase(const CudaLayerContext& ctx, DType dtype, bool exact, size_t N, size_t C, size_t OC) {
  const std::string n =
      Dims((std::string("matmul ") + DTypeName(dtype) + (exact ? " exact-in" : "")).c_str(), {N, C, OC});
  const double tol = dtype == DType::kF32 || exact ? (dtype == DType::kF32 ? kSameMath : kExactIn)
                                                   : (dtype == DType::kBF16 ? kBf16 : kF16);
  auto inp = Random(N * C, 20), dout = Random(N * OC, 21);
  if (exact) {
    inp = RoundTo(dtype, inp);
    dout = RoundTo(dtype, dout);
  }
  // The weight arrives in `dtype`; the CPU multiplies by the same values.
  const auto w_lo = AsDType(dtype, Random(OC * C, 22, -0.2f, 0.2f));
  std::vector<float> w(OC * C);
  ToF32(dtype, w_lo.data(), w.data(), w.size());
  const auto bias = Random(OC, 23);
  auto dinp = Random(N * C, 24), dw = Random(OC * C, 25), db = Random(OC, 26);
  std::vector<float> out(N * OC);
  Dev d_inp(ctx, inp), d_dout(ctx, dout), d_w(ctx, w_lo), d_bias(ctx, bias), d_dinp(ctx, dinp), d_dw(ctx, dw),
      d_db(ctx, db), d_out(ctx, out);
  CudaDeviceBuffer scratch;
  Must(scratch.Allocate(MatmulScratchBytes(N, C, OC, dtype)), "scratch");
  const CudaScratch s{scratch.get(), scratch.bytes()};
  MatmulForward(out.data(), inp.data(), w.data(), bias.data(), N, C, OC);
  Must(MatmulForwardCuda(ctx, d_out.f(), d_inp.f(), d_w.v(), dtype, d_bias.f(), N, C, OC, s), "matmul fwd");
  Compare(n + " out", Get(ctx, d_out.f(), N * OC), out, tol);
  MatmulBackward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), N, C, OC);
  Must(MatmulBackwardCuda(ctx, d_dinp.f(), d_dw.f(), d_db.f(), d_dout.f(), d_inp.f(), d_w.v(), dtype, N, C,
                          OC, s),
       "matmul bwd");
  Compare(n + " dinp", Get(ctx, d_dinp.f(), N * C), dinp, tol);
  Compare(n + " dweight", Get(ctx, d_dw.f(), OC * C), dw, tol);
  Compare(n + " dbias", Get(ctx, d_db.f(), OC), db, kSameMath);  // fp32 sums of fp32 dout
}

void ElementwiseCase(const CudaLayerContext& ctx, size_t n) {
  const std::string name = Dims("elementwise", {n});
  const auto x = Random(n, 30, -4.0f, 4.0f), y = Random(n, 31), dout = Random(n, 32);
  auto dinp = Random(n, 33);
  std::vector<float> out(n), sum(n);
  Dev d_x(ctx, x), d_y(ctx, y), d_dout(ctx, dout), d_dinp(ctx, dinp), d_out(ctx, out), d_sum(ctx, sum);
  GeluForward(out.data(), x.data(), n);
  Must(GeluForwardCuda(ctx, d_out.f(), d_x.f(), n), "gelu fwd");
  Compare(name + " gelu", Get(ctx, d_out.f(), n), out, kSameMath);
  GeluBackward(dinp.data(), x.data(), dout.data(), n);
  Must(GeluBackwardCuda(ctx, d_dinp.f(), d_x.f(), d_dout.f(), n), "gelu bwd");
  Compare(name + " gelu dinp", Get(ctx, d_dinp.f(), n), dinp, kSameMath);
  ResidualForward(sum.data(), x.data(), y.data(), n);
  Must(ResidualForwardCuda(ctx, d_sum.f(), d_x.f(), d_y.f(), n), "residual");
  ExpectBitwise(name + " residual", Get(ctx, d_sum.f(), n), sum);
}

void AttentionCase(const CudaLayerContext& ctx, DType dtype, size_t B, size_t T, size_t C, size_t NH) {
  const std::string n = Dims((std::string("attention ") + DTypeName(dtype)).c_str(), {B, T, C, NH});
  const double tol = dtype == DType::kF32 ? kSameMath : kTf32;
  const size_t N = B * T;
  const auto qkv = Random(N * 3 * C, 40), dout = Random(N * C, 41);
  auto dqkv = Random(N * 3 * C, 42);
  std::vector<float> out(N * C), att(B * NH * T * T);
  Dev d_qkv(ctx, qkv), d_dout(ctx, dout), d_dqkv(ctx, dqkv), d_out(ctx, out), d_att(ctx, att);
  CudaDeviceBuffer scratch;
  Must(scratch.Allocate(AttentionScratchBytes(B, T, C, NH)), "scratch");
  const CudaScratch s{scratch.get(), scratch.bytes()};
  AttentionForward(out.data(), att.data(), qkv.data(), B, T, C, NH);
  Must(AttentionForwardCuda(ctx, d_out.f(), d_att.f(), d_qkv.f(), B, T, C, NH, dtype, s), "attention fwd");
  Compare(n + " out", Get(ctx, d_out.f(), N * C), out, tol);
  Compare(n + " att", Get(ctx, d_att.f(), att.size()), att, tol);
  // Both backwards from the CPU's probabilities, so that only the backward is compared.
  Dev d_att_cpu(ctx, att);
  AttentionBackward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH);
  Must(AttentionBackwardCuda(ctx, d_dqkv.f(), d_dout.f(), d_qkv.f(), d_att_cpu.f(), B, T, C, NH, dtype, s),
       "attention bwd");
  Compare(n + " dqkv", Get(ctx, d_dqkv.f(), dqkv.size()), dqkv, tol);
}

void CrossEntropyCase(const CudaLayerContext& ctx, size_t N, size_t V, bool in_place) {
  const std::string n = Dims(in_place ? "cross-entropy in place" : "cross-entropy", {N, V});
  const auto logits = Random(N * V, 50, -3.0f, 3.0f);
  const auto targets = RandomTokens(N, static_cast<int32_t>(V), 51);
  const float dloss = 1.0f / static_cast<float>(N);
  std::vector<float> losses(N), dlogits(N * V);
  Dev d_logits(ctx, logits), d_targets(ctx, targets), d_losses(ctx, losses), d_dlogits(ctx, dlogits);
  float* dz = in_place ? d_logits.f() : d_dlogits.f();
  CrossEntropyForwardBackward(losses.data(), dlogits.data(), logits.data(), targets.data(), N, V, dloss);
  Must(CrossEntropyForwardBackwardCuda(ctx, d_losses.f(), dz, d_logits.f(), d_targets.i(), N, V, dloss),
       "ce");
  Compare(n + " losses", Get(ctx, d_losses.f(), N), losses, kSameMath);
  Compare(n + " dlogits", Get(ctx, dz, N * V), dlogits, kSameMath);
}

void HeadCase(const CudaLayerContext& ctx, DType dtype) {
  const GptConfig cfg{64, 16, 48, 4, 1};
  const size_t B = 2, T = 13, N = B * T, C = 48;
  const std::string n = std::string("head ") + DTypeName(dtype);
  const double tol = dtype == DType::kF32 ? kSameMath : kBf16;
  auto embed = Random(EmbedParamCount(cfg), 60, -0.3f, 0.3f);
  const auto tensors = EmbedParamTensors(cfg);
  for (size_t i = 0; i < C; ++i) embed[tensors[kLnfWeight].offset + i] += 1.0f;
  const auto embed_lo = AsDType(dtype, embed);
  std::vector<float> embed32(embed.size());
  ToF32(dtype, embed_lo.data(), embed32.data(), embed.size());
  const auto x = Random(N * C, 61), dembed0 = Random(embed.size(), 62);
  const auto targets = RandomTokens(N, cfg.vocab, 63);
  std::vector<float> dx(N * C, 0.0f), dembed = dembed0;
  HeadActs cpu;
  HeadActsInit(&cpu, cfg, B, T);
  const float loss = HeadForwardBackward(cfg, embed32.data(), x.data(), targets.data(), B, T, &cpu, dx.data(),
                                         dembed.data());
  HeadActsCuda gpu;
  Must(HeadActsCudaInit(&gpu, cfg, B, T, dtype), "HeadActsCudaInit");
  Dev d_embed(ctx, embed_lo), d_x(ctx, x), d_targets(ctx, targets), d_dx(ctx, dx), d_dembed(ctx, dembed0);
  Must(HeadForwardBackwardCuda(ctx, cfg, d_embed.v(), dtype, d_x.f(), d_targets.i(), B, T, &gpu, d_dx.f(),
                               d_dembed.f(), 1.0f),
       "head");
  const auto losses = Get(ctx, gpu.losses, N);
  double sum = 0;
  for (float l : losses) sum += l;
  const std::vector<float> mean{static_cast<float>(sum / static_cast<double>(N))};
  Compare(n + " mean loss", mean, std::vector<float>{loss}, tol);
  Compare(n + " dx", Get(ctx, d_dx.f(), N * C), dx, tol);
  const auto got = Get(ctx, d_dembed.f(), embed.size());
  for (int t : {kWte, kLnfWeight, kLnfBias}) {
    // Gradients only: the starting values (identical on both sides) are taken out.
    std::vector<float> g(tensors[t].count), w(tensors[t].count);
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = got[tensors[t].offset + i] - dembed0[tensors[t].offset + i];
      w[i] = dembed[tensors[t].offset + i] - dembed0[tensors[t].offset + i];
    }
    Compare(n + " d" + tensors[t].name, g, w, tol);
  }
  const size_t wpe = tensors[kWpe].offset, wpe_n = tensors[kWpe].count;
  ExpectBitwise(n + " dwpe untouched", std::vector<float>(got.begin() + wpe, got.begin() + wpe + wpe_n),
                std::vector<float>(dembed0.begin() + wpe, dembed0.begin() + wpe + wpe_n));
}

}  // namespace
}  // namespace strata::layers::cuda_test

int main() {
  using namespace strata::layers::cuda_test;
  using strata::DType;
  SkipWithoutGpu();
  strata::layers::CudaLayerRuntime rt;
  Must(rt.Init(), "CudaLayerRuntime::Init");
  const auto& ctx = rt.context();
  EncoderCase(ctx, 3, 7, 40, 29);
  EncoderCase(ctx, 2, 64, 128, 256);
  LayerNormCase(ctx, 37, 72);
  LayerNormCase(ctx, 300, 1000);  // more rows than one column-sum chunk, C not a multiple of 32
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (bool exact : {false, true}) {
      if (dt == DType::kF32 && exact) continue;
      MatmulCase(ctx, dt, exact, 37, 48, 144);
      MatmulCase(ctx, dt, exact, 130, 256, 1024);
    }
  ElementwiseCase(ctx, 100003);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    AttentionCase(ctx, dt, 2, 13, 48, 4);
    AttentionCase(ctx, dt, 1, 70, 64, 2);  // rows longer than a warp's 32 columns, twice over
  }
  CrossEntropyCase(ctx, 19, 300, false);
  CrossEntropyCase(ctx, 19, 300, true);
  for (DType dt : {DType::kF32, DType::kBF16}) HeadCase(ctx, dt);
  return Finish();
}

// The AVX-512 kernels come in two variants for bf16 (range_kernels.h's
// bf16_insn): with the AVX512-BF16 instruction (vcvtneps2bf16) and with the
// integer rounding every AVX-512 CPU has. Each CPU runs only its own (the
// entry points pick by DetectCpuFeatures), so a CPU with AVX512-BF16 never
// ran the other one: here both variants run on this CPU (the one it has),
// against the scalar reference, bitwise, for every kernel that rounds to
// bf16: Adam/AdamW, Lion, Adagrad (bf16 gradients and bf16 copy-out) and the
// f32 -> bf16 cast, on values around every rounding case (ties, the top of
// bf16's range, subnormals, infinities, NaN).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "kernels/cpu/adagrad.h"
#include "kernels/cpu/adam.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/lion.h"
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/step_scalars.h"

namespace strata::kernels::test {
namespace {

using internal::CopyOut;

constexpr size_t kN = 4096 + 37;  // several vectors and a partial one

// Floats that land on every bf16 rounding case: ties (low half 0x8000) to
// even and odd, just above and below, the top of the range (rounding to
// inf), subnormals, ±0, ±inf, NaN; the rest spread over many binades.
std::vector<float> Values(uint64_t seed) {
  std::vector<float> x(kN);
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&] { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return s; };
  const uint32_t specials[] = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0x7f7f8000u, 0x7f7fffffu,
                               0xff7f8000u, 0x00008000u, 0x00018000u, 0x80000001u, 0x00000000u, 0x80000000u,
                               0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u};
  for (size_t i = 0; i < kN; ++i) {
    const uint64_t r = next();
    if (i % 7 == 3) {
      x[i] = BitsF32(specials[(i / 7) % (sizeof specials / sizeof specials[0])]);
    } else {
      // a random mantissa with a tie or near-tie low half now and then
      uint32_t bits = static_cast<uint32_t>(r) & 0x807fffffu;
      bits |= static_cast<uint32_t>(100 + (r >> 40) % 60) << 23;
      if (i % 5 == 1) bits = (bits & 0xffff0000u) | 0x8000u;
      x[i] = BitsF32(bits);
    }
  }
  return x;
}

std::vector<uint16_t> Bf16Of(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = F32ToBF16(x[i]);
  return b;
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// The variants to run: the scalar reference, then AVX-512 without and (where
// this CPU has it) with AVX512-BF16.
struct Variants {
  bool has_insn = DetectCpuFeatures().avx512_bf16;
};

// One optimizer's state for a run: param (moderate, finite), two moment
// arrays, the bf16 gradients (Values) and the copy-out.
struct State {
  std::vector<float> p, a, b;
  std::vector<uint16_t> copy;
  explicit State(uint64_t seed) : p(kN), a(kN), b(kN), copy(kN, 0) {
    const std::vector<float> v = Values(seed);
    for (size_t i = 0; i < kN; ++i) {
      p[i] = std::isfinite(v[i]) ? std::fmod(v[i], 4.0f) : 0.5f;
      a[i] = 0.01f * static_cast<float>(i % 13);
      b[i] = 1e-4f * static_cast<float>(i % 7);
    }
  }
  bool operator==(const State& o) const {
    return SameBits(p, o.p) && SameBits(a, o.a) && SameBits(b, o.b) && SameBits(copy, o.copy);
  }
};

TEST(Bf16Variants, AdamBothAvx512VariantsAreTheScalarReference) {
  if (!CpuSupports(CpuIsa::kAvx512)) GTEST_SKIP() << "no AVX-512 on this CPU";
  const Variants var;
  for (bool bf16_grad : {false, true})
    for (bool l2 : {false, true})
      for (bool lerp : {false, true}) {
        AdamOptions opt;
        opt.mode = l2 ? AdamMode::kAdam : AdamMode::kAdamW;
        opt.weight_decay = 0.01;
        opt.step = 3;
        opt.grad_dtype = bf16_grad ? DType::kBF16 : DType::kF32;
        opt.moment_update = lerp ? MomentUpdate::kLerp : MomentUpdate::kMulAdd;
        const AdamStepScalars s = MakeAdamStepScalars(opt);
        const std::vector<float> gf = Values(7);
        const std::vector<uint16_t> gb = Bf16Of(gf);
        const void* g = bf16_grad ? static_cast<const void*>(gb.data()) : gf.data();
        const std::string what = std::string("grad ") + (bf16_grad ? "bf16" : "f32") + (l2 ? " l2" : "") +
                                 (lerp ? " lerp" : "");
        State ref(1);
        internal::SelectAdamScalar(opt.grad_dtype, CopyOut::kBF16, l2, lerp)(
            s, {ref.p.data(), ref.a.data(), ref.b.data(), g, ref.copy.data()}, 0, kN);
        for (bool insn : {false, true}) {
          if (insn && !var.has_insn) continue;
          State got(1);
          internal::SelectAdamAvx512(opt.grad_dtype, CopyOut::kBF16, l2, lerp, insn)(
              s, {got.p.data(), got.a.data(), got.b.data(), g, got.copy.data()}, 0, kN);
          EXPECT_TRUE(got == ref) << what << (insn ? " with" : " without") << " AVX512-BF16";
        }
      }
}

TEST(Bf16Variants, LionAndAdagradBothAvx512VariantsAreTheScalarReference) {
  if (!CpuSupports(CpuIsa::kAvx512)) GTEST_SKIP() << "no AVX-512 on this CPU";
  const Variants var;
  const std::vector<float> gf = Values(11);
  const std::vector<uint16_t> gb = Bf16Of(gf);
  for (bool bf16_grad : {false, true}) {
    const DType gd = bf16_grad ? DType::kBF16 : DType::kF32;
    const void* g = bf16_grad ? static_cast<const void*>(gb.data()) : gf.data();
    LionOptions lo;
    lo.weight_decay = 0.1;
    lo.grad_dtype = gd;
    const LionStepScalars ls = MakeLionStepScalars(lo);
    AdagradOptions ao;
    ao.weight_decay = 0.01;
    ao.step = 5;
    ao.grad_dtype = gd;
    const AdagradStepScalars as = MakeAdagradStepScalars(ao);
    State lion_ref(2), ada_ref(3);
    internal::SelectLionScalar(gd, CopyOut::kBF16)(ls, {lion_ref.p.data(), lion_ref.a.data(), g, lion_ref.copy.data()},
                                                   0, kN);
    internal::SelectAdagradScalar(gd, CopyOut::kBF16, true)(
        as, {ada_ref.p.data(), ada_ref.a.data(), g, ada_ref.copy.data()}, 0, kN);
    for (bool insn : {false, true}) {
      if (insn && !var.has_insn) continue;
      State lion(2), ada(3);
      internal::SelectLionAvx512(gd, CopyOut::kBF16, insn)(ls, {lion.p.data(), lion.a.data(), g, lion.copy.data()}, 0,
                                                           kN);
      internal::SelectAdagradAvx512(gd, CopyOut::kBF16, true, insn)(
          as, {ada.p.data(), ada.a.data(), g, ada.copy.data()}, 0, kN);
      EXPECT_TRUE(lion == lion_ref) << "Lion grad " << DTypeName(gd) << (insn ? " with" : " without") << " AVX512-BF16";
      EXPECT_TRUE(ada == ada_ref) << "Adagrad grad " << DTypeName(gd) << (insn ? " with" : " without")
                                  << " AVX512-BF16";
    }
  }
}

TEST(Bf16Variants, CastBothAvx512VariantsAreTheScalarReference) {
  if (!CpuSupports(CpuIsa::kAvx512)) GTEST_SKIP() << "no AVX-512 on this CPU";
  const Variants var;
  const std::vector<float> x = Values(13);
  std::vector<uint16_t> ref(kN);
  internal::SelectCastScalar(DType::kF32, DType::kBF16)(x.data(), ref.data(), 0, kN);
  EXPECT_TRUE(SameBits(ref, Bf16Of(x))) << "the scalar cast is F32ToBF16";
  for (bool insn : {false, true}) {
    if (insn && !var.has_insn) continue;
    std::vector<uint16_t> got(kN, 0);
    internal::SelectCastAvx512(DType::kF32, DType::kBF16, insn)(x.data(), got.data(), 0, kN);
    EXPECT_TRUE(SameBits(got, ref)) << (insn ? "with" : "without") << " AVX512-BF16";
  }
}

}  // namespace
}  // namespace strata::kernels::test

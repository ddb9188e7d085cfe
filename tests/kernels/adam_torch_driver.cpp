// Runs AdamStepOn over a problem written by adam_torch_oracle_test.py and
// writes the final param, exp_avg and exp_avg_sq for comparison with torch.
//   adam_torch_driver <scalar|avx2|avx512> <mul_add|lerp> <in> <out> [weight_decay override]
// in:  int64 n, int64 steps, int64 mode (0 AdamW, 1 Adam), double beta1,
//      beta2, eps, weight_decay; float param[n]; per step: double lr, float grad[n]
// out: float param[n], exp_avg[n], exp_avg_sq[n]
// Exit 77 when this CPU lacks the path.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cpu/adam.h"

namespace {

using strata::kernels::AdamMode;
using strata::kernels::AdamOptions;
using strata::kernels::CpuIsa;
using strata::kernels::MomentUpdate;

bool Read(FILE* f, void* p, size_t bytes) { return std::fread(p, 1, bytes, f) == bytes; }

int Run(CpuIsa isa, MomentUpdate moment, FILE* in, FILE* out, const char* wd_override) {
  int64_t n = 0, steps = 0, mode = 0;
  double hyper[4];  // beta1, beta2, eps, weight_decay
  if (!Read(in, &n, 8) || !Read(in, &steps, 8) || !Read(in, &mode, 8) || !Read(in, hyper, 32))
    return 2;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n);
  if (!Read(in, p.data(), n * 4)) return 2;
  AdamOptions opt;
  opt.mode = mode == 0 ? AdamMode::kAdamW : AdamMode::kAdam;
  opt.beta1 = hyper[0];
  opt.beta2 = hyper[1];
  opt.eps = hyper[2];
  opt.weight_decay = wd_override ? std::strtod(wd_override, nullptr) : hyper[3];
  opt.moment_update = moment;
  for (int64_t t = 1; t <= steps; ++t) {
    if (!Read(in, &opt.lr, 8) || !Read(in, g.data(), n * 4)) return 2;
    opt.step = t;
    const strata::Status st = strata::kernels::AdamStepOn(isa, opt, n, p.data(), m.data(),
                                                          v.data(), g.data(), nullptr);
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
  }
  const bool ok = std::fwrite(p.data(), 4, n, out) == size_t(n) &&
                  std::fwrite(m.data(), 4, n, out) == size_t(n) &&
                  std::fwrite(v.data(), 4, n, out) == size_t(n);
  return ok ? 0 : 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: adam_torch_driver <isa> <mul_add|lerp> <in> <out> [weight_decay]\n");
    return 2;
  }
  const strata::Result<CpuIsa> isa = strata::kernels::ParseCpuIsa(argv[1]);
  if (!isa.ok()) return 2;
  const strata::Result<MomentUpdate> moment = strata::kernels::ParseMomentUpdate(argv[2]);
  if (!moment.ok()) {
    std::fprintf(stderr, "%s\n", moment.status().ToString().c_str());
    return 2;
  }
  if (!strata::kernels::CpuSupports(isa.value())) {
    std::printf("skipped: CPU lacks path %s\n", argv[1]);
    return 77;
  }
  FILE* in = std::fopen(argv[3], "rb");
  FILE* out = std::fopen(argv[4], "wb");
  if (!in || !out) return 2;
  const int rc = Run(isa.value(), moment.value(), in, out, argc > 5 ? argv[5] : nullptr);
  std::fclose(in);
  return std::fclose(out) == 0 ? rc : 2;
}

// strata-export: a checkpoint's master weights as one safetensors file, with
// the parameter names the trainer registered, gathered across ranks.
// Usage: strata-export CKPT OUT.safetensors [--dtype f32|bf16]
//   CKPT: a checkpoint folder (DIR/TAG) or its directory (DIR, via DIR/latest).
// Exit status: 0 written (or --help); 1 refused (corrupt, truncated, I/O error: the
// message names the file); 2 usage.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "base/sizes.h"
#include "tools/export/checkpoint_plan.h"
#include "tools/export/export.h"

using namespace strata;

static int Usage(const char* why) {
  std::fprintf(stderr, "strata-export: %s\nusage: strata-export CKPT OUT.safetensors [--dtype f32|bf16]\n", why);
  return 2;
}

int main(int argc, char** argv) {
  std::vector<std::string> pos;
  exporter::ExportOptions opt;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], val;
    if (a == "-h" || a == "--help") {  // asked for: stdout, success
      std::printf("strata-export: a checkpoint's master weights as safetensors\n"
                  "usage: strata-export CKPT OUT.safetensors [--dtype f32|bf16]\n"
                  "  CKPT: a checkpoint folder (DIR/TAG) or its directory (DIR, via DIR/latest)\n");
      return 0;
    }
    if (a.rfind("--dtype=", 0) == 0) {
      val = a.substr(8);
    } else if (a == "--dtype") {
      if (i + 1 >= argc) return Usage("--dtype needs a value");
      val = argv[++i];
    } else if (a.rfind("--", 0) == 0) {
      return Usage(("unknown option " + a).c_str());
    } else {
      pos.push_back(a);
      continue;
    }
    if (val == "f32" || val == "fp32" || val == "float32") opt.dtype = DType::kF32;
    else if (val == "bf16" || val == "bfloat16") opt.dtype = DType::kBF16;
    else return Usage(("--dtype " + val + ": must be f32 or bf16").c_str());
  }
  if (pos.size() != 2) return Usage("needs CKPT and OUT");
  const auto t0 = std::chrono::steady_clock::now();
  auto plan = exporter::ReadCheckpointPlan(pos[0]);
  if (!plan.ok()) {
    std::fprintf(stderr, "%s\n", plan.status().ToString().c_str());
    return 1;
  }
  auto sum = exporter::ExportSafetensors(*plan, pos[1], opt);
  if (!sum.ok()) {
    std::fprintf(stderr, "%s\n", sum.status().WithContext("strata-export " + plan->folder).ToString().c_str());
    return 1;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("strata-export: %s step %lld, %d rank(s), %d shard(s): %llu tensors, %llu parameters as %s -> %s (%s) in %.2f s\n",
              plan->folder.c_str(), static_cast<long long>(plan->step), plan->world_size, plan->shards,
              static_cast<unsigned long long>(sum->tensors), static_cast<unsigned long long>(sum->elements),
              DTypeName(opt.dtype), pos[1].c_str(), FormatBytes(sum->file_bytes).c_str(), secs);
  return 0;
}

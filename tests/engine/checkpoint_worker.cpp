// A training process for the checkpoint tests: trains the tiny MLP with
// state on NVMe, fp16 loss scaling and an lr schedule, saving and resuming.
//   checkpoint_worker SWAP CKPT train FROM TO [save TAG] [resume] [loop] [compact]
// `compact`: strata.state_format "compact", which needs bf16 (no loss
// scaling, so no overflow is injected). Writes the losses to stdout, one per
// line, then "master <hash>".
#include <xxhash.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "engine/engine.h"
#include "tests/engine/tiny_mlp.h"

using namespace strata;

static std::string Json(const std::string& swap, bool compact) {
  const std::string precision =
      compact ? R"("bf16": {"enabled": true}, "strata": {"device_budget": "1MiB", "host_budget": "8MiB",
                  "state_format": "compact"},)"
              : R"("fp16": {"enabled": true, "initial_scale_power": 16, "loss_scale_window": 3, "hysteresis": 1},
                  "strata": {"device_budget": "1MiB", "host_budget": "8MiB"},)";
  return "{" + precision + R"(
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("},
      "offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"("}}})";
}

static int Die(const Status& s) {
  std::fprintf(stderr, "checkpoint_worker: %s\n", s.ToString().c_str());
  return 1;
}

int main(int argc, char** argv) {
  if (argc < 6) return 2;
  const std::string swap = argv[1], ckpt = argv[2];
  const int from = std::stoi(argv[4]), to = std::stoi(argv[5]);
  std::string save_tag;
  bool resume = false, loop = false, compact = false;
  for (int i = 6; i < argc; ++i) {
    if (!std::strcmp(argv[i], "save") && i + 1 < argc) save_tag = argv[++i];
    else if (!std::strcmp(argv[i], "resume")) resume = true;
    else if (!std::strcmp(argv[i], "loop")) loop = true;
    else if (!std::strcmp(argv[i], "compact")) compact = true;
  }
  auto cfg = ParseConfig(Json(swap, compact));
  if (!cfg.ok()) return Die(cfg.status());
  auto e = Engine::Create(*cfg, {});
  if (!e.ok()) return Die(e.status());
  Engine& eng = **e;
  testing::TinyMlp model(3, 24);
  if (Status st = model.Register(eng); !st.ok()) return Die(st);
  if (Status st = eng.Build(); !st.ok()) return Die(st);
  int start = from;
  if (resume) {
    std::vector<uint8_t> blob;
    if (Status st = eng.LoadCheckpoint(ckpt, "", &blob); !st.ok()) return Die(st);
    if (blob.size() != sizeof(int)) return Die(CorruptError("bad trainer blob"));
    std::memcpy(&start, blob.data(), sizeof(int));
  }
  for (int s = start; s < to || loop; ++s) {
    // Every fifth step overflows (as fp16 would), which the scaler must skip.
    auto loss = model.TrainStep(eng, nullptr, !compact && s % 5 == 2 ? INFINITY : eng.loss_scale());
    if (!loss.ok()) return Die(loss.status());
    StepOptions so;
    so.lr = 0.01 * (1.0 - 0.03 * (s % 30));  // a schedule
    auto r = eng.Step(so);
    if (!r.ok()) return Die(r.status());
    std::printf("%.17g %d\n", *loss, r->skipped ? 1 : 0);
    if (loop) {  // save every step, forever (the test kills us)
      const int next = s + 1;
      if (Status st = eng.SaveCheckpoint(ckpt, "s" + std::to_string(next), &next, sizeof next); !st.ok()) return Die(st);
      std::fflush(stdout);
    }
  }
  if (!save_tag.empty()) {
    const int next = to;
    if (Status st = eng.SaveCheckpoint(ckpt, save_tag, &next, sizeof next); !st.ok()) return Die(st);
  }
  XXH64_hash_t h = 0;
  for (int g = 0; g < eng.num_groups(); ++g) {
    std::vector<float> w(eng.group_numel(g));
    if (Status st = eng.ReadMaster(g, w.data()); !st.ok()) return Die(st);
    h = XXH64(w.data(), w.size() * 4, h);
  }
  std::printf("master %016llx\n", static_cast<unsigned long long>(h));
  return 0;
}

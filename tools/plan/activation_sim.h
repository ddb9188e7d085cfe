// The activation store (engine/activations/activation_store.h) in the
// step's simulation: what each forward use stashes, its copy into the
// arena, the spill of the oldest stashes to NVMe when the arena is full, and
// backward's redeems with their read-ahead. The transfers are StepSim's
// (booked on its resources); this keeps only the store's own state, for one
// micro-batch at a time.
#pragma once

#include <functional>
#include <vector>

#include "engine/config/config.h"
#include "tools/plan/model.h"
#include "tools/plan/simulator.h"

namespace strata::plan {

class ActivationSim {
 public:
  // Each returns when its transfer ends, booked from `t`.
  struct Io {
    std::function<double(double t, double bytes)> copy;       // device <-> arena (PCIe, or a memcpy)
    std::function<double(double t, double bytes)> spill;      // checksum, then write to NVMe
    std::function<double(double t, double bytes)> read_back;  // read from NVMe, then verify
  };
  ActivationSim(const Config& cfg, const ModelSpec& m, Io io);

  // The bytes each use stashes after its forward: the model's stashable
  // bytes a micro-batch (every layer's input with checkpointing), spread
  // over the forward uses by their FLOPs (the head stashes nothing), as
  // much as the arena and its swap hold (the rest stays with the trainer).
  // All zero without a store.
  std::vector<double> StashBytes(const std::vector<GroupUse>& uses) const;
  void BeginMicroBatch();
  // After the forward of `g` at `t`: the copy into the arena on the store's
  // threads (the trainer goes on); the oldest stashes spill when it is full.
  void Stash(int g, double t, double bytes, SimResult* r);
  // Before the backward of `g` at `t`: its stash back (read from NVMe now,
  // unless read ahead), then the stashes made before it read ahead up to
  // the window. Returns when the layer has its bytes.
  double Redeem(int g, double t, SimResult* r);

 private:
  struct Stashed {
    int group;
    double bytes;
    bool on_nvme;
    double ready;      // in the arena (or on its way to NVMe) from then
    double read_done;  // read back from NVMe (when `read`)
    bool read;
  };
  const ModelSpec& m_;
  Io io_;
  bool on_ = false;
  double arena_ = 0, nvme_ = 0, window_ = 0, in_arena_ = 0;
  std::vector<Stashed> stashes_;
};

}  // namespace strata::plan

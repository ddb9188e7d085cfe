// LossScaler: fp16 dynamic loss scaling as DeepSpeed does it. On overflow
// the step is skipped and, once `hysteresis` overflows have been seen, the
// scale halves (not below min_loss_scale); after `window` clean steps it
// doubles. A static scale (loss_scale > 0) never changes; without fp16 the
// scale is 1.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "engine/config/config.h"

namespace strata {

class LossScaler {
 public:
  void Init(const Fp16Config& c) {
    cfg_ = c;
    dynamic_ = c.enabled && c.loss_scale == 0;
    scale_ = !c.enabled ? 1.0 : dynamic_ ? std::ldexp(1.0, c.initial_scale_power) : c.loss_scale;
    hysteresis_left_ = c.hysteresis;
    clean_steps_ = 0;
  }
  double scale() const { return scale_; }
  // For checkpoints: the whole dynamic state.
  struct State { double scale; int hysteresis_left; int64_t clean_steps; };
  State state() const { return {scale_, hysteresis_left_, clean_steps_}; }
  // A checkpoint's state, taken only by a dynamic scaler and only from a
  // checkpoint saved in fp16 (`saved_fp16`): a run in fp32 or bf16 saves a
  // scale of 1, which is no fp16 state, and a static scale (or none, 1) is
  // this engine's config's whatever a checkpoint says. The saved counters
  // are bounded by this config's, which may have changed since the save.
  // Returns whether the state was taken.
  bool Restore(const State& s, bool saved_fp16) {
    if (!dynamic_ || !saved_fp16) return false;
    scale_ = std::min(std::max(s.scale, cfg_.min_loss_scale), kMaxLossScale);
    hysteresis_left_ = std::max(1, std::min(s.hysteresis_left, cfg_.hysteresis));
    clean_steps_ = std::max<int64_t>(
        0, std::min<int64_t>(s.clean_steps, static_cast<int64_t>(cfg_.loss_scale_window) - 1));
    return true;
  }
  bool dynamic() const { return dynamic_; }
  // Records the outcome of a step.
  void Update(bool overflow) {
    if (!dynamic_) return;
    if (overflow) {
      // As DeepSpeed's DynamicLossScaler: the first hysteresis - 1
      // overflows only count down; from then on every overflow halves,
      // until a doubling gives the counter back (not each halving: that
      // halved on every second overflow of a burst, skipping more steps).
      clean_steps_ = 0;
      if (hysteresis_left_ > 1) --hysteresis_left_;
      else scale_ = std::max(scale_ / 2, cfg_.min_loss_scale);
      return;
    }
    if (++clean_steps_ >= static_cast<int64_t>(cfg_.loss_scale_window)) {
      scale_ = std::min(scale_ * 2, kMaxLossScale);  // (as torch's: grown only while a float holds it)
      clean_steps_ = 0;
      hysteresis_left_ = cfg_.hysteresis;
    }
  }

 private:
  Fp16Config cfg_;
  bool dynamic_ = false;
  double scale_ = 1;
  int hysteresis_left_ = 2;
  int64_t clean_steps_ = 0;
};

}  // namespace strata

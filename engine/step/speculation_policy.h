// SpeculationPolicy: whether overlap_step speculates this step. Speculation
// pays only when the step keeps it: a step that clips (or skips) discards
// every early update and redoes it after backward, which costs the update
// twice (and, for NVMe-homed state, twice the disk traffic). The policy
// learns from every step's outcome, speculated or not — the step always
// knows its norm, so it knows whether a speculation would have been kept —
// and speculates when the recent steps say the next one will be kept:
//   - never before one step of evidence (the first steps of a run are the
//     ones most often clipped);
//   - not when the last step would have discarded (clipping and overflow
//     come in runs: a run clipped at every step never speculates again);
//   - not when more than one of the last kWindow (4) steps would have
//     (a run that clips every other step settles on not speculating).
// So a run that stops clipping goes back to speculating after one clean
// step, and a run clipped at every step pays for one speculation at most
// (none, with the first step's rule). Exactness does not depend on the
// decision: both paths are bitwise the step without overlap.
//
// Where speculation cannot pay at all (Decline: no GPU and the optimizer
// state in host memory, where backing up what an early update changes in
// place costs about what the update does, and backward has the same cores),
// "auto" never speculates.
//
// The mode (strata.speculation): "auto" is the above; "always" speculates
// at every step where an update could still change (the behaviour before
// the policy); "never" updates such steps after backward.
//
// Thread: the caller's (prepare_step and step). No lock.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace strata {

class SpeculationPolicy {
 public:
  enum class Mode { kAuto, kAlways, kNever };
  static constexpr int kWindow = 4;

  explicit SpeculationPolicy(Mode mode = Mode::kAuto) : mode_(mode) {}
  // Parses strata.speculation; false for anything else.
  static bool ParseMode(const std::string& s, Mode* out);

  // Whether the coming step, whose early updates would be speculative,
  // speculates; `why` (may be null) says why not, for the trace and the log.
  bool Decide(std::string* why) const;
  // "auto" never speculates from now on, saying `why` (the engine's reason
  // that speculation cannot pay where it runs: StartOverlap).
  void Decline(std::string why) { declined_ = std::move(why); }
  // A step's outcome: whether its speculation would be (or was) kept — not
  // skipped and not clipped, the factor on G as without clipping.
  void Record(bool kept);

  int steps_seen() const { return seen_; }

 private:
  Mode mode_;
  std::string declined_;  // Decline's reason ("": none)
  uint32_t history_ = 0;  // bit i: the i-th last step would have discarded
  int seen_ = 0;
};

}  // namespace strata

// GroupStep: one group's part in the step in progress — its gradients'
// arrival and figures, and how far its update got. Owned by the step (the
// composition's Step, and the pipeline that updates the group); read by the
// checks before the update.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

namespace strata {

// One grads call of a group given in parts (Engine::GradsPart, then
// GradsEnd): each part written straight into G. Until the end G holds no
// gradient of the step (grad_calls stays 0).
struct GradParts {
  bool open = false;
  std::map<uint64_t, uint64_t> given;  // first element -> count, of the parts so far
  // Per tile of G (kernels::kReduceTile elements): its sum of squares, where
  // `done`: a part covered it whole and summed it while copying it. The end
  // sums the others from G.
  std::vector<double> partial;
  std::vector<uint8_t> done;
};

// A part of G that the caller lent (Engine::GradsPart with `lend`) instead of
// having it copied: `count` elements from `first`, at `src`, in G's dtype.
// The step's update reads it there; anything else that needs G whole copies
// it in first (Engine::Impl::SettleLent).
struct LentPart {
  uint64_t first = 0, count = 0;
  const void* src = nullptr;
};

struct GroupStep {
  int grad_calls = 0;      // grads calls in this step
  double sum_squares = 0;  // of G, after the last grads call
  bool finite = true;
  // grads calls the caller handed in for this step (the caller's thread;
  // with the reduction, grad_calls counts those accumulated, on its thread).
  int handed = 0;
  // This step's update of W, M, V is in their homes (all three, or none:
  // NVMe writes are published together). A failed step leaves the others
  // for the next Step call to finish.
  bool committed = false;
  // A group stepped in units (Layout::units): which units this step's
  // update reached their homes (W, M, V of each unit are published
  // together); the group is committed once all have. Empty otherwise.
  std::vector<uint8_t> unit_done;
  bool p_stale = false;
  // Parts of this step's G still at the caller's (LentPart), in element
  // order; G holds every other element.
  std::vector<LentPart> lent;
  GradParts parts;  // a grads call in parts, while open  // committed, but P's store failed: P is recomputed from W
};

}  // namespace strata

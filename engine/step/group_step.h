// GroupStep: one group's part in the step in progress — its gradients'
// arrival and figures, and how far its update got. Owned by the step (the
// composition's Step, and the pipeline that updates the group); read by the
// checks before the update.
#pragma once

#include <cstdint>
#include <vector>

namespace strata {

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
  bool p_stale = false;  // committed, but P's store failed: P is recomputed from W
};

}  // namespace strata

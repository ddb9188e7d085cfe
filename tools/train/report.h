// strata-train's output: a live progress line on a terminal (plain lines when
// piped), and the end-of-run summary table.
#pragma once

#include <cstdint>
#include <string>

#include "strata/strata.h"

namespace strata::train {

class Progress {
 public:
  Progress(int64_t total_steps, int print_every);
  void Step(int64_t step, double loss, double tokens_per_s, double eta_s, double lr, bool skipped);
  void Done();

 private:
  int64_t total_;
  int every_;
  bool tty_;
};

std::string HumanBytes(uint64_t b);

struct RunFigures {
  uint64_t params = 0, state_bytes = 0;
  double first_loss = 0, last_loss = 0, tokens_per_s = 0, overlap_efficiency = 0, wall_s = 0;
  int64_t steps = 0;
  bool gpu = false;                      // the layers ran on the GPU
  double tflops = 0, kernel_tflops = 0;  // model FLOPs per second: end to end, and in the kernels
  std::string placement;                 // strata_engine_placement: where this rank landed
  bool overlap_step = false;             // the engine's overlap_step (off: --no-overlap-step)
  double exposed_s = 0;                  // mean of the timed steps' exposed step time (strata_stats_t.exposed_step_s)
};

// strata_engine_placement's line ("rank 0/1: GPU 0 (...); ..."), or "" when
// the call fails.
std::string EnginePlacement(strata_engine_t* e);

void PrintSummary(const RunFigures& f, const strata_stats_t& s);

}  // namespace strata::train

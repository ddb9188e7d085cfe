// A Python co-process (torch_adamw_worker.py) that runs torch's AdamW steps
// on request, so the benchmark can alternate torch with our kernels in one run.
#pragma once

#include <sys/types.h>

#include <cstdio>
#include <string>

#include "base/status.h"

namespace strata::bench {

class TorchCoprocess {
 public:
  TorchCoprocess() = default;
  ~TorchCoprocess();
  TorchCoprocess(const TorchCoprocess&) = delete;
  TorchCoprocess& operator=(const TorchCoprocess&) = delete;

  // Starts `python worker n threads` and waits for its "ready" line.
  Status Start(const std::string& python, const std::string& worker, size_t n, int threads);
  // Runs `steps` AdamW steps in the worker; returns seconds per step.
  Result<double> TimeSteps(int steps);
  const std::string& banner() const { return banner_; }

 private:
  Result<std::string> ReadLine();
  pid_t pid_ = -1;
  FILE* to_ = nullptr;    // worker's stdin
  FILE* from_ = nullptr;  // worker's stdout
  std::string banner_;
};

}  // namespace strata::bench

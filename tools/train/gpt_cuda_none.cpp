// strata-train built without a CUDA toolkit: no GPU model.
#include "tools/train/gpt_cuda.h"

namespace strata::train {

std::string GpuUnavailableReason() {
  return "this strata-train was built without CUDA (configure with -DSTRATA_CUDA=ON)";
}

std::unique_ptr<GptModel> MakeGptCuda(const layers::GptConfig&, int, int) { return nullptr; }

}  // namespace strata::train

// Streams a checkpoint's fp32 master weights (W), gathered across the ranks'
// shards with padding dropped, into one safetensors file named by the
// trainer's parameter names, each tensor in its registered shape (flat
// when it has none). Memory stays bounded by the buffer size (plus
// half of it for bf16), whatever the model's size; every W block read is
// checked against its XXH3, and the output appears (renamed into place)
// only when all of it was written and fsynced.
#pragma once

#include <cstdint>
#include <string>

#include "base/dtype.h"
#include "base/status.h"
#include "tools/export/checkpoint_plan.h"

namespace strata::exporter {

struct ExportOptions {
  DType dtype = DType::kF32;        // F32, or BF16 rounded to nearest even
  uint64_t buffer_bytes = 32 << 20;  // read chunk; a multiple of 4
};

struct ExportSummary {
  uint64_t tensors = 0, elements = 0;
  uint64_t file_bytes = 0;  // the safetensors file
  uint64_t read_bytes = 0;  // W shards read from the checkpoint
};

Result<ExportSummary> ExportSafetensors(const CheckpointPlan& plan, const std::string& out_path, const ExportOptions& options);

}  // namespace strata::exporter

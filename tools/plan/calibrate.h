// --calibrate DIR: measures this machine's rates that the simulator needs —
// the disk under DIR (reads, writes, and both at once) through Strata's
// io_uring storage (O_DIRECT, huge-page buffers), the CPU Adam
// (kernels::AdamStep), host memory streams, the XXH3 checksum of swap blocks
// and the CPU layer kernels (a block's forward, recompute and backward, the
// LM head) at a few widths — and writes them as a cluster JSON file that
// --cluster takes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "tools/plan/cluster.h"

namespace strata::plan {

struct CalibrateOptions {
  std::string dir;
  uint64_t file_bytes = 512ull << 20;  // disk test file
  uint64_t block_bytes = 1ull << 20;   // request size (aio.block_size)
  uint32_t queue_depth = 32;           // aio.queue_depth
  uint64_t adam_elements = 8ull << 20;
  int repeats = 3;  // median of
  // Shapes the layer kernels are timed at (strata-train's tiny, small and
  // medium, and a GPT-2 width at one sequence); empty: not measured.
  struct LayerShape {
    uint64_t hidden, heads, batch, seq;
  };
  std::vector<LayerShape> layer_shapes = {
      {64, 4, 8, 64}, {128, 4, 8, 128}, {384, 6, 8, 128}, {768, 12, 1, 256}};
  double layer_seconds = 0.5;  // each shape's block (and head) runs for at least this long in all
};

struct Calibration {
  double nvme_read_Bps = 0, nvme_write_Bps = 0;
  double nvme_mixed_factor = 1;  // reads and writes at once: time / (read-alone + write-alone time)
  double cpu_adam_eps = 0, host_mem_Bps = 0, checksum_Bps = 0;
  double cpu_compact_adam_eps = 0;            // the compact kernel (strata.state_format "compact")
  std::vector<CpuLayerRate> cpu_layer_rates;  // by width, ascending
  uint64_t dir_free_bytes = 0;
};

Result<Calibration> Calibrate(const CalibrateOptions& options);
// "local" with the measured rates (one rank, one drive: the folder's disk).
ClusterSpec CalibratedCluster(const Calibration& c);
// The cluster JSON that ParseClusterJson reads back to CalibratedCluster.
std::string CalibrationJson(const Calibration& c);

// Busy CPU seconds of the whole machine, every process (/proc/stat); -1 when
// unreadable. With the caller's own CPU time over a window, FreeCores says
// how many of the machine's cores the other processes left free (all of them
// when `others_busy_s` is negative: unknown).
double MachineBusySeconds();
double FreeCores(double others_busy_s, double wall_s);

}  // namespace strata::plan

// --calibrate DIR: measures this machine's rates that the simulator needs —
// the disk under DIR (reads, writes, and both at once) through Strata's io_uring storage (O_DIRECT, huge-page
// buffers), the CPU Adam (kernels::AdamStep), host memory streams and the
// XXH3 checksum of swap blocks — and writes them as a cluster JSON file that
// --cluster takes.
#pragma once

#include <cstdint>
#include <string>

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
};

struct Calibration {
  double nvme_read_Bps = 0, nvme_write_Bps = 0;
  double nvme_mixed_factor = 1;  // reads and writes at once: time / (read-alone + write-alone time)
  double cpu_adam_eps = 0, host_mem_Bps = 0, checksum_Bps = 0;
  uint64_t dir_free_bytes = 0;
};

Result<Calibration> Calibrate(const CalibrateOptions& options);
// "local" with the measured rates (one rank, one drive: the folder's disk).
ClusterSpec CalibratedCluster(const Calibration& c);
// The cluster JSON that ParseClusterJson reads back to CalibratedCluster.
std::string CalibrationJson(const Calibration& c);

}  // namespace strata::plan

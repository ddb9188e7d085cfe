// Measurements for --calibrate. Each figure is the median of a few runs.
#include "tools/plan/calibrate.h"

#include <sys/statvfs.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "base/align.h"
#include "io/direct_file.h"
#include "io/uring_storage.h"
#include "kernels/cpu/adam.h"
#include "tiers/gpu.h"
#include "tiers/host_tier.h"

namespace strata::plan {

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename F>
Result<double> MedianSeconds(int repeats, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const double t0 = Now();
    STRATA_RETURN_IF_ERROR(f());
    t.push_back(Now() - t0);
  }
  std::sort(t.begin(), t.end());
  return std::max(t[t.size() / 2], 1e-9);
}

// Sequential writes then reads of one file, `queue_depth` requests in flight.
Status MeasureDisk(const CalibrateOptions& o, Calibration* out) {
  UringOptions uo;
  uo.queue_depth = o.queue_depth;
  uo.block_size = o.block_bytes;
  STRATA_ASSIGN_OR_RETURN(auto storage, UringStorage::Create(uo));
  const std::string path = o.dir + "/strata-plan-calibrate.bin";
  STRATA_ASSIGN_OR_RETURN(FileId file, storage->Open(path, OpenMode::kCreate));
  const uint64_t size = AlignDown(o.file_bytes, o.block_bytes);
  const uint64_t nbufs = o.queue_depth;
  HostTier host({.budget = nbufs * o.block_bytes + kHugePage, .storage = storage.get()});
  auto mem = host.Allocate(nbufs * o.block_bytes);
  Status st = mem.ok() ? ReserveFileSpace(storage->Info(file).fd, path, size) : mem.status();
  if (st.ok()) {
    std::memset(mem->ptr, 0x5A, nbufs * o.block_bytes);
    // mixed: reads and writes at once, 4 reads to 3 writes (the step's 16 B read
    // to 12 B written per parameter), reads and writes in separate buffers.
    auto pass = [&](IoOp::Kind kind, bool mixed = false) {
      std::vector<IoOp> ops;
      for (uint64_t i = 0; i < size / o.block_bytes; ++i) {
        const IoOp::Kind k = mixed ? (i % 7 < 4 ? IoOp::kRead : IoOp::kWrite) : kind;
        const uint64_t buf =
            mixed ? (k == IoOp::kRead ? i % (nbufs / 2) : nbufs / 2 + i % (nbufs / 2)) : i % nbufs;
        ops.push_back(IoOp{k, file, i * o.block_bytes, static_cast<char*>(mem->ptr) + buf * o.block_bytes,
                           o.block_bytes});
      }
      return storage->Run(ops);
    };
    st = pass(IoOp::kWrite);  // lay the file out, so that timed writes overwrite
    auto w = st.ok() ? MedianSeconds(o.repeats, [&] { return pass(IoOp::kWrite); }) : Result<double>(st);
    auto r =
        w.ok() ? MedianSeconds(o.repeats, [&] { return pass(IoOp::kRead); }) : Result<double>(w.status());
    auto m = r.ok() ? MedianSeconds(o.repeats, [&] { return pass(IoOp::kRead, true); })
                    : Result<double>(r.status());
    if (m.ok()) {
      out->nvme_write_Bps = static_cast<double>(size) / *w;
      out->nvme_read_Bps = static_cast<double>(size) / *r;
      // Mixed time against the sum of the read-alone and write-alone times.
      const double blocks = static_cast<double>(size / o.block_bytes),
                   bb = static_cast<double>(o.block_bytes);
      const double reads = std::ceil(blocks * 4 / 7) * bb, writes = blocks * bb - reads;
      const double serial = reads / out->nvme_read_Bps + writes / out->nvme_write_Bps;
      out->nvme_mixed_factor = std::clamp(*m / serial, 0.5, 2.0);
    }
    st = m.status();
  }
  if (mem.ok()) host.Free(*mem);
  storage->Close(file).IgnoreError();
  std::remove(path.c_str());
  return st.WithContext("calibrate: disk under " + o.dir);
}

// The step's update as the engine runs it: fp32 W, M, V, G, bf16 copy of P.
Status MeasureAdam(const CalibrateOptions& o, Calibration* out) {
  const size_t n = o.adam_elements;
  std::vector<float> w(n, 0.01f), m(n, 0.0f), v(n, 0.0f), g(n, 1e-3f);
  std::vector<uint16_t> p(n);
  kernels::AdamOptions ao;
  ao.weight_decay = 0.01;
  int64_t step = 0;
  STRATA_ASSIGN_OR_RETURN(double secs, MedianSeconds(o.repeats, [&] {
                            ao.step = ++step;
                            return kernels::AdamStep(ao, n, w.data(), m.data(), v.data(), g.data(), p.data());
                          }));
  out->cpu_adam_eps = static_cast<double>(n) / secs;
  return Status::Ok();
}

// memcpy (bytes read + written) and XXH3 over 256 MiB.
Status MeasureMemory(const CalibrateOptions& o, Calibration* out) {
  const size_t bytes = 256u << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  STRATA_ASSIGN_OR_RETURN(double copy, MedianSeconds(o.repeats, [&] {
                            std::memcpy(b.data(), a.data(), bytes);
                            return Status::Ok();
                          }));
  volatile uint64_t sink = 0;
  STRATA_ASSIGN_OR_RETURN(double hash, MedianSeconds(o.repeats, [&] {
                            sink = sink + XXH3_64bits(b.data(), bytes);
                            return Status::Ok();
                          }));
  out->host_mem_Bps = 2.0 * static_cast<double>(bytes) / copy;
  out->checksum_Bps = static_cast<double>(bytes) / hash;
  return Status::Ok();
}

}  // namespace

Result<Calibration> Calibrate(const CalibrateOptions& o) {
  Calibration c;
  STRATA_RETURN_IF_ERROR(MeasureDisk(o, &c));
  STRATA_RETURN_IF_ERROR(MeasureAdam(o, &c));
  STRATA_RETURN_IF_ERROR(MeasureMemory(o, &c));
  struct statvfs vfs {};
  if (statvfs(o.dir.c_str(), &vfs) == 0)
    c.dir_free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  return c;
}

ClusterSpec CalibratedCluster(const Calibration& c) {
  ClusterSpec s = PresetCluster("local").value();
  s.name = "local (calibrated)";
  s.nvme_drives = 1;
  s.nvme_drive_bytes = c.dir_free_bytes ? c.dir_free_bytes : s.nvme_drive_bytes;
  s.nvme_read_Bps = c.nvme_read_Bps;
  s.nvme_write_Bps = c.nvme_write_Bps;
  s.nvme_mixed_factor = c.nvme_mixed_factor;
  s.cpu_adam_eps = c.cpu_adam_eps;
  s.host_mem_Bps = c.host_mem_Bps;
  s.checksum_Bps = c.checksum_Bps;
  if (gpu::Available()) {  // planning for this machine's GPU; rates stay nominal until measured
    s.has_gpu = true;
    s.device_bytes = gpu::DeviceMemoryBytes(0);
  }
  return s;
}

std::string CalibrationJson(const Calibration& c) {
  const ClusterSpec s = CalibratedCluster(c);
  nlohmann::ordered_json j;
  j["preset"] = "local";
  j["name"] = s.name;
  j["has_gpu"] = s.has_gpu;
  j["device_memory"] = s.device_bytes;
  j["host_memory"] = s.host_bytes;
  j["nvme_drives"] = 1;
  j["nvme_drive_capacity"] = s.nvme_drive_bytes;
  j["nvme_read"] = std::round(c.nvme_read_Bps);
  j["nvme_write"] = std::round(c.nvme_write_Bps);
  j["nvme_mixed_factor"] = std::round(c.nvme_mixed_factor * 1000) / 1000;
  j["cpu_adam_rate"] = std::round(c.cpu_adam_eps);
  j["host_mem_bw"] = std::round(c.host_mem_Bps);
  j["checksum_rate"] = std::round(c.checksum_Bps);
  return j.dump(2) + "\n";
}

}  // namespace strata::plan

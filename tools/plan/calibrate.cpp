// Measurements for --calibrate. Each figure is the median of a few runs.
#include "tools/plan/calibrate.h"

#include <sys/resource.h>
#include <sys/statvfs.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "base/align.h"
#include "io/direct_file.h"
#include "io/file_storage.h"
#include "kernels/cpu/adam.h"
#include "kernels/cpu/compact.h"
#include "kernels/cpu/layers/block.h"
#include "kernels/cpu/layers/head.h"
#include "tiers/gpu.h"
#include "tiers/host_tier.h"
#include "tools/plan/model.h"

namespace strata::plan {

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double ProcessCpuSeconds() {  // user + system, every thread
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec);
  };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

}  // namespace

double MachineBusySeconds() {
  std::FILE* f = std::fopen("/proc/stat", "r");
  if (!f) return -1;
  unsigned long long v[8] = {};  // user nice system idle iowait irq softirq steal
  const int n = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                            &v[4], &v[5], &v[6], &v[7]);
  std::fclose(f);
  if (n < 4) return -1;
  const double busy = static_cast<double>(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]);
  return busy / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double FreeCores(double others_busy_s, double wall_s) {
  const double cores = static_cast<double>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  if (others_busy_s < 0 || wall_s <= 0) return cores;
  return std::clamp(cores - others_busy_s / wall_s, 0.05 * cores, cores);
}

namespace {

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
  StorageOptions uo;
  uo.queue_depth = o.queue_depth;
  uo.block_size = o.block_bytes;
  STRATA_ASSIGN_OR_RETURN(auto storage, FileStorage::Create(uo));
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
    // Lay the file out, so that timed writes overwrite written blocks: the
    // engine's swap file is fallocate'd whole (ReserveFileSpace, as here) and
    // written at build, and its copy-on-write step reuses the extents it frees
    // (first fit), so past the first step it too overwrites. Writes into
    // fallocate'd, never-written extents are slower (ext4 converts them; on
    // the development VM 1.49 GB/s against 1.79-1.84 GB/s, fio, 1 MiB, QD 32).
    st = pass(IoOp::kWrite);
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
  // The compact step as the engine runs it: P's bf16 half and W's int8
  // corrections, M and V codes and scales, the fp32 gradient.
  const size_t blocks = kernels::CompactScaleCount(n);
  std::vector<int8_t> lo(n), mc(n);
  std::vector<uint8_t> vc(n);
  std::vector<float> ms(blocks), vs(blocks);
  const kernels::CompactState cs{p.data(), lo.data(), mc.data(), ms.data(), vc.data(), vs.data()};
  STRATA_RETURN_IF_ERROR(kernels::CompactPack(n, w.data(), m.data(), v.data(), cs));
  STRATA_ASSIGN_OR_RETURN(double compact, MedianSeconds(o.repeats, [&] {
                            ao.step = ++step;
                            return kernels::CompactAdamStep(ao, n, cs, g.data(), nullptr);
                          }));
  out->cpu_compact_adam_eps = static_cast<double>(n) / compact;
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

// A block's forward, then its backward with recompute (strata-train's
// checkpointing), and the tied head's forward and backward, at one shape; the
// rates are the model's FLOP counts (model.h) over the measured times.
Status MeasureLayers(const CalibrateOptions& o, const CalibrateOptions::LayerShape& s, Calibration* out) {
  const ModelSpec m = [&] {
    ModelSpec x = GptModel("calibrate", 1, s.hidden, s.heads, s.seq, GroupScheme::kStrataTrain);
    x.micro_batch = s.batch;
    return x;
  }();
  const layers::GptConfig cfg{static_cast<int>(m.vocab), static_cast<int>(s.seq), static_cast<int>(s.hidden),
                              static_cast<int>(s.heads), 1};
  STRATA_RETURN_IF_ERROR(layers::ValidateGptConfig(cfg));
  const size_t B = s.batch, T = s.seq, BTC = B * T * s.hidden;
  std::vector<float> params(layers::BlockParamCount(cfg)), dparams(params.size());
  std::vector<float> embed(layers::EmbedParamCount(cfg)), dembed(embed.size());
  std::vector<float> x(BTC), dx(BTC), y(BTC), dy(BTC);
  std::vector<int32_t> targets(B * T);
  // Values as in training (GPT-2's initialization, unit-scale activations):
  // tanh and exp take fast paths on tiny inputs, which would flatter the rate.
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto init = [&](float* p, const layers::ParamTensor& t) {
    const std::string name = t.name;
    const bool ln = name.find("ln") != std::string::npos, bias = name.find("bias") != std::string::npos;
    for (size_t i = 0; i < t.count; ++i) p[t.offset + i] = bias ? 0.0f : ln ? 1.0f : 0.02f * normal(rng);
  };
  for (const auto& t : layers::BlockParamTensors(cfg)) init(params.data(), t);
  for (const auto& t : layers::EmbedParamTensors(cfg)) init(embed.data(), t);
  for (size_t i = 0; i < BTC; ++i) {
    x[i] = normal(rng);
    dy[i] = 1e-3f * normal(rng);
  }
  for (size_t i = 0; i < targets.size(); ++i) targets[i] = static_cast<int32_t>(rng() % m.vocab);
  layers::BlockActs acts;
  layers::BlockActsInit(&acts, cfg, B, T);
  layers::HeadActs head;
  layers::HeadActsInit(&head, cfg, B, T);
  auto block = [&] {
    layers::BlockForward(cfg, params.data(), x.data(), y.data(), &acts, B, T);
    layers::BlockBackward(cfg, params.data(), x.data(), dy.data(), &acts,
                          layers::BlockBackwardMode::kRecompute, dparams.data(), dx.data(), B, T);
  };
  auto lm_head = [&] {
    layers::HeadForwardBackward(cfg, embed.data(), x.data(), targets.data(), B, T, &head, dx.data(),
                                dembed.data());
  };
  // The mean over at least layer_seconds (a trainer's step time is a mean, and
  // a shared machine's load comes and goes), after a warm-up run (first touch
  // of the buffers, OpenBLAS's set-up).
  auto mean_seconds = [&](auto&& f) {
    f();
    int runs = 0;
    const double t0 = Now();
    double t = t0;
    while (runs < 2 || t - t0 < o.layer_seconds) {
      f();
      ++runs;
      t = Now();
    }
    return (t - t0) / runs;
  };
  const double busy0 = MachineBusySeconds(), self0 = ProcessCpuSeconds(), wall0 = Now();
  const double block_s = mean_seconds(block);
  const double head_s = mean_seconds(lm_head);
  const double busy1 = MachineBusySeconds(), self1 = ProcessCpuSeconds(), wall1 = Now();
  const double others = busy0 < 0 || busy1 < 0 ? -1 : std::max(0.0, (busy1 - busy0) - (self1 - self0));
  out->cpu_layer_rates.push_back({s.hidden, 4 * m.ForwardFlops(m.groups[1]) / block_s, m.HeadFlops() / head_s,
                                  FreeCores(others, wall1 - wall0)});
  return Status::Ok();
}

}  // namespace

Result<Calibration> Calibrate(const CalibrateOptions& o) {
  Calibration c;
  STRATA_RETURN_IF_ERROR(MeasureDisk(o, &c));
  STRATA_RETURN_IF_ERROR(MeasureAdam(o, &c));
  STRATA_RETURN_IF_ERROR(MeasureMemory(o, &c));
  for (const auto& shape : o.layer_shapes) STRATA_RETURN_IF_ERROR(MeasureLayers(o, shape, &c));
  std::sort(c.cpu_layer_rates.begin(), c.cpu_layer_rates.end(),
            [](const CpuLayerRate& a, const CpuLayerRate& b) { return a.hidden < b.hidden; });
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
  s.cpu_compact_adam_eps = c.cpu_compact_adam_eps;
  s.host_mem_Bps = c.host_mem_Bps;
  s.checksum_Bps = c.checksum_Bps;
  s.cpu_layer_rates = c.cpu_layer_rates;
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
  j["cpu_compact_adam_rate"] = std::round(c.cpu_compact_adam_eps);
  j["host_mem_bw"] = std::round(c.host_mem_Bps);
  j["checksum_rate"] = std::round(c.checksum_Bps);
  j["cpu_layers"] = nlohmann::ordered_json::array();
  for (const CpuLayerRate& r : c.cpu_layer_rates)
    j["cpu_layers"].push_back({{"hidden", r.hidden},
                               {"block_flops", std::round(r.block_flops)},
                               {"head_flops", std::round(r.head_flops)},
                               {"free_cores", std::round(r.free_cores * 100) / 100}});
  return j.dump(2) + "\n";
}

}  // namespace strata::plan

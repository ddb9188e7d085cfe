// Placement: GPU choice, NUMA binding and their description.
#include "engine/layout/placement.h"

#include "base/log.h"
#include "io/net/launch_env.h"
#include "tiers/gpu.h"
#include "tiers/numa.h"

namespace strata {

std::string DescribePlacement(const Placement& p) {
  std::string s = "rank " + std::to_string(p.rank) + "/" + std::to_string(p.world_size) + ": ";
  if (p.device >= 0) {
    s += "GPU " + std::to_string(p.device) + " (" + (p.device_name.empty() ? "unnamed" : p.device_name) +
         ", NUMA node " + (p.gpu_node >= 0 ? std::to_string(p.gpu_node) : "unknown") + ")";
  } else {
    s += "no GPU" + (p.no_gpu_why.empty() ? "" : " (" + p.no_gpu_why + ")") + ": device tier is a host arena";
  }
  if (p.cpu_node >= 0)
    s += "; cores " + p.cpus + " bound to node " + std::to_string(p.cpu_node);
  else
    s += "; no NUMA binding (" + p.no_bind_why + ")";
  const char* memory = p.pinned ? "pinned memory" : "host memory";
  if (p.memory_node >= 0)
    s += std::string("; ") + memory + " on node " + std::to_string(p.memory_node);
  else
    s += std::string("; ") + memory + " not NUMA-bound";
  if (p.cpu_kernel_threads > 0) {
    s += "; CPU kernels: " + std::to_string(p.cpu_kernel_threads) + (p.cpu_kernel_threads == 1 ? " thread" : " threads");
    if (p.cpu_sharers > 1) s += " (" + std::to_string(p.cpu_sharers) + " processes share these CPUs)";
  }
  return s;
}

Result<int> ChooseDevice(int requested, int local_rank, int device_count, const std::string& rank_source) {
  if (requested < -1)
    return InvalidError("engine options: device " + std::to_string(requested) +
                        " is not -1 (the local rank's GPU) or a GPU index");
  if (device_count <= 0) return -1;
  if (requested == -1) return net::DeviceForLocalRank(local_rank, device_count, rank_source);
  if (requested >= device_count)
    return InvalidError("engine options: device " + std::to_string(requested) + " but this process sees " +
                        std::to_string(device_count) + (device_count == 1 ? " GPU" : " GPUs"));
  return requested;
}

NumaChoice ChooseNumaNode(const std::string& mode, int device, int gpu_node, int node_count) {
  if (mode == "off") return {-1, "strata.numa_bind is off"};
  if (device < 0) return {-1, "no GPU"};
  if (node_count == 0) return {-1, "hwloc sees no NUMA node"};
  if (node_count == 1) return {-1, "one NUMA node"};
  if (gpu_node < 0) return {-1, "the GPU's NUMA node is unknown"};
  return {gpu_node, ""};
}

Status PlaceOnGpu(bool force_no_gpu, int requested, Placement* p) {
  // The local rank selects the GPU under a launcher; a broken set of
  // variables was refused by the rank setup already when it mattered.
  if (auto info = net::RankInfoFromEnv(); info.ok()) {
    p->local_rank = info->local_rank;
    p->rank_source = info->source;
  }
  if (force_no_gpu) {
    p->no_gpu_why = "force_no_gpu";
    return Status::Ok();
  }
  std::string why;
  const int count = gpu::DeviceCount(&why);
  STRATA_ASSIGN_OR_RETURN(p->device, ChooseDevice(requested, p->local_rank, count, p->rank_source));
  if (p->device < 0) {
    p->no_gpu_why = why;
    return Status::Ok();
  }
  // The caller's thread (which creates the engine, and usually drives it and
  // runs the trainer's kernels) works on this GPU from now on.
  STRATA_RETURN_IF_ERROR(gpu::SetDevice(p->device).WithContext("engine"));
  p->device_name = gpu::DeviceName(p->device);
  p->gpu_node = gpu::NumaNodeOfDevice(p->device);
  return Status::Ok();
}

void PlaceOnNumaNode(const std::string& mode, Placement* p) {
  p->numa_nodes = NumaNodeCount();
  const NumaChoice c = ChooseNumaNode(mode, p->device, p->gpu_node, p->numa_nodes);
  if (c.node < 0) {
    p->no_bind_why = c.why_not;
    return;
  }
  const NumaCpuBinding b = BindProcessToNumaNode(c.node);
  if (!b.bound) {
    STRATA_LOG_WARN(
        "NUMA binding: cannot bind this process's CPUs to node {} nearest GPU {}: {}; its threads "
        "run anywhere",
        c.node, p->device, b.error);
    p->no_bind_why = "binding failed: " + b.error;
    return;
  }
  p->cpu_node = c.node;
  p->cpus = b.cpus;
}

}  // namespace strata

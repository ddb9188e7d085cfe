// tiers/numa: the node count, binding this process's CPUs to a node (here
// the first one, which every machine has), and a refusal naming a node that
// does not exist. Its own process: the binding lasts.
#include "tiers/numa.h"

#include <gtest/gtest.h>
#include <hwloc.h>
#include <sched.h>

#include <condition_variable>
#include <mutex>
#include <thread>

namespace strata {
namespace {

int AffinityCount() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return -1;
  return CPU_COUNT(&set);
}

// The first NUMA node's OS index and its CPUs, from hwloc directly.
struct FirstNode {
  int os_index = -1;
  int cpus = 0;
};
FirstNode First() {
  FirstNode f;
  hwloc_topology_t t;
  if (hwloc_topology_init(&t) != 0) return f;
  if (hwloc_topology_load(t) == 0) {
    hwloc_obj_t n = hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, 0);
    if (n != nullptr && n->cpuset != nullptr) {
      f.os_index = static_cast<int>(n->os_index);
      f.cpus = hwloc_bitmap_weight(n->cpuset);
    }
  }
  hwloc_topology_destroy(t);
  return f;
}

TEST(Numa, CountsNodes) { EXPECT_GE(NumaNodeCount(), 1) << "hwloc sees at least one NUMA node on Linux"; }

TEST(Numa, BindsEveryThreadToTheNodesCpus) {
  const FirstNode f = First();
  ASSERT_GE(f.os_index, 0);
  ASSERT_GT(f.cpus, 0);
  // Narrow this thread to one CPU first, so that the binding has to widen it
  // (on a one-node machine the node's CPUs are all of them).
  cpu_set_t one;
  CPU_ZERO(&one);
  ASSERT_EQ(sched_getaffinity(0, sizeof one, &one), 0);
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &one)) {
      CPU_ZERO(&one);
      CPU_SET(c, &one);
      break;
    }
  ASSERT_EQ(sched_setaffinity(0, sizeof one, &one), 0);
  ASSERT_EQ(AffinityCount(), 1);
  // A thread running before the binding (on one CPU) is bound too, process-
  // wide: it reads its affinity once before the binding and once after it
  // returned (told so, not after a guessed sleep).
  std::mutex mu;
  std::condition_variable cv;
  bool started = false, bound = false;
  int in_thread_before = -1, in_thread = -1;
  std::thread early([&] {
    std::unique_lock<std::mutex> lock(mu);
    in_thread_before = AffinityCount();
    started = true;
    cv.notify_all();
    cv.wait(lock, [&] { return bound; });
    in_thread = AffinityCount();
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return started; });
  }
  const NumaCpuBinding b = BindProcessToNumaNode(f.os_index);
  {
    std::lock_guard<std::mutex> lock(mu);
    bound = true;
  }
  cv.notify_all();
  early.join();
  ASSERT_TRUE(b.bound) << b.error;
  EXPECT_FALSE(b.cpus.empty());
  EXPECT_EQ(b.error, "");
  EXPECT_EQ(AffinityCount(), f.cpus);
  EXPECT_EQ(in_thread_before, 1);
  EXPECT_EQ(in_thread, f.cpus);
}

TEST(Numa, AMissingNodeIsNamed) {
  const NumaCpuBinding b = BindProcessToNumaNode(4093);
  EXPECT_FALSE(b.bound);
  EXPECT_EQ(b.error, "hwloc knows no NUMA node 4093");
  EXPECT_FALSE(BindProcessToNumaNode(-1).bound);
}

}  // namespace
}  // namespace strata

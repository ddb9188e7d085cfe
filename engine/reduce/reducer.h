// GradReducer: several ranks' gradients summed into this rank's G, and the
// parameter gathers of stage 3 — the engine's collectives other than the
// step's agreement. A group's gradients are packed (cast to fp32, in the
// buckets' layout, grad_reduce.h) into a buffer (host memory; a GPU's with
// NCCL), reduced over the ranks in buckets, and handed to `accumulate` — on
// the communication thread with zero_optimization.overlap_comm, else before
// Grads returns. With the thread, stage 3's next group is gathered there
// ahead of its fetch (when every rank has its shard loaded: they agree
// first; none gathers alone).
//
// Invariants:
// - Every rank issues the same collectives in the same order: the caller's
//   thread and the communication thread never run collectives at once (the
//   caller drains the thread first), and what is queued is the same on
//   every rank.
// - At most max_packed host buffers are in use, so that the communication
//   thread always finds a staging slot for G; device buffers: two with the
//   thread, one without. A grads call in parts holds one from PartsBegin to
//   PartsEnd, one group at a time, and only with the thread; parts lent and
//   read where they lie hold none.
// - Lent parts are read by the job queued at PartsEnd (or packed on the
//   caller's thread: PackLent, SettleLent): the engine drains the thread
//   (Drain(true)) before the step or a load returns, and Stop drops a
//   queued job unread, so none is read after the caller's promise
//   (strata_engine_grads_part_lend) ends. ReadsLent says when a group's are
//   read no more (the caller may let them go earlier).
// - After a background failure nothing more is reduced; the failure is
//   returned once, by Drain, and the caller's step cannot finish.
//
// Lock: mu_ guards queue_, current_, busy_, stop_, error_, device_free_,
// packed_in_use_. The communication thread is this component's own. It
// touches nothing of the others but through the Hooks the composition gives
// it (G's accumulation, residency's pins for gathers ahead, labels).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/layout/layout.h"
#include "engine/layout/staging.h"
#include "engine/reduce/grad_reduce.h"
#include "io/net/comm.h"

namespace strata {

class GradReducer {
 public:
  struct Hooks {
    // This rank's n sums of group g's gradients (host memory, fp32) into G.
    std::function<Status(int g, const float* sums, uint64_t n)> accumulate;
    // Where the reduction may write group g's n sums itself, so that
    // `accumulate` finds them in place (G, when the sums are all it will
    // hold: fp32, host memory, the step's first gradients of g), or null
    // (a buffer of the reducer's). Asked on the thread that reduces g, and
    // at PartsBegin (LendsParts: lent parts need it).
    std::function<float*(int g)> sums_target;
    // The step number the labels name (the step in progress: applied + 1).
    std::function<int64_t()> step;
    // The grads calls group g has had in this step (the label's "#k").
    std::function<int(int g)> grad_calls;
    // Gathers ahead: residency's copy of g, pinned, or null (Residency::PinForAhead),
    // and the end of the ranks' decision on it (Residency::EndAhead).
    std::function<void*(int g)> pin_ahead;
    std::function<void(int g, bool gathered)> end_ahead;
    std::function<void()> on_thread_start;  // the CUDA device of the thread
    // The trace's clock, and a span of the thread's job (StatsRecorder::CommSpan); either may be null.
    std::function<double()> now;
    std::function<void(const char* name, int g, double start_s, double end_s)> span;
    // Each collective of gradients (a group's buckets) or parameters (one
    // gather): its bytes, wall seconds and the CPU seconds of the thread
    // that ran it (StatsRecorder::OnCollective); may be null (and is at one rank).
    std::function<void(bool gather, uint64_t bytes, double wall_s, double cpu_s)> collective;
  };
  // `grad_staging`: the host buffers of packed groups and of G's staging
  // (`g_staged`: one of them is G's). `comm` and `device` outlive the reducer.
  GradReducer(const Layout& layout, net::Communicator& comm, DeviceTier& device, StagingPool& grad_staging,
              bool g_staged, Hooks hooks);
  ~GradReducer();  // Stop()
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // At build: the device buffers (NCCL) and the communication thread.
  Status Init();
  void Stop();  // drops what is queued; frees the device buffers
  bool threaded() const { return thread_.joinable(); }

  // Packs group g's gradients (all `numel` of `dtype` at `grads`), then
  // reduces them and accumulates the sums: here, or queued on the thread.
  Status Grads(int g, const void* grads, DType dtype);
  // A grads call in parts: PartsBegin takes a packed buffer for group g
  // (waiting, as Grads does, for one the thread frees), Part packs elements
  // [first, first + count) of g's gradient into it (`again`: adds them, a
  // part given again), PartsEnd zeroes what no part gave (`given`: first ->
  // count) and reduces as Grads would — the same packed bits, so the same
  // sums. One group's parts at a time (a second is refused, naming the
  // first): the caller then holds one buffer and the thread always finds
  // another. PartsRefused: why this reducer takes no parts ("" when it does):
  // device buffers, or no thread (overlap_comm off: one buffer, which parts
  // would hold while a whole group waits for it).
  // Lent parts (`lend`: the caller keeps them alive and unchanged until the
  // engine's next drain of this thread, Drain(true), or Stop) are not packed
  // where the reduction can read them where they lie (LendsParts): then
  // the group holds no packed buffer, and its reduce-scatter reads the
  // parts on the thread (Communicator::ReduceScatterPieces). A part not lent,
  // of another dtype, or given again packs the ones before it and the rest.
  std::string PartsRefused() const;
  bool LendsParts(int g) const;
  Status PartsBegin(int g, bool lend);
  Status Part(int g, uint64_t first, uint64_t count, const void* src, DType dtype, bool again, bool lend);
  Status PartsEnd(int g, const std::map<uint64_t, uint64_t>& given);
  void DropParts();  // a call in parts that will not end (a checkpoint load): its buffer back
  // A call in parts still open when the caller's promise on its lent parts
  // ends (a step or load returned): the parts lent so far are packed.
  void SettleLent();
  // Whether lent parts of group g may still be read here: its call in
  // parts is open and lent, or its lent job is queued or running.
  bool ReadsLent(int g);
  // Waits for the thread's work (wait) or only looks (not); a background
  // failure is returned once (the composition's DrainComm takes it, and
  // breaks the engine: the groups queued after it got no gradients).
  // `take` false: the failure stays for the next Drain (Gather's look).
  Status Drain(bool wait = true, bool take = true);
  // Stage 3: all-gathers group g's P into `full` (this rank's slice at its
  // offset), after the thread's work (GatherNow: without waiting for it).
  Status Gather(int g, void* full);
  Status GatherNow(int g, void* full);
  // This rank cannot take part in group g's gather (its copy could not be
  // allocated or loaded: `why`): enters it refusing, so that every rank's
  // fetch fails at once (INVALID naming this rank), the communicator intact.
  Status RefuseGather(int g, const Status& why);
  // Queues a gather ahead of group g on the thread; waits until none of g is
  // queued or running.
  void QueueGatherAhead(int g);
  void WaitAheadOf(int g);

  uint64_t gathers_ahead() const { return gathers_ahead_.load(); }
  uint64_t gathers_ahead_declined() const { return gathers_ahead_declined_.load(); }
  uint64_t lent_reduced_bytes() const { return lent_reduced_bytes_.load(); }  // (counted as reduced_bytes too)

 private:
  // A job of the thread: reduce a group's packed gradients, or (stage 3)
  // gather its parameters ahead of their fetch.
  struct Job {
    int group = -1;
    float* packed = nullptr;  // Reduce's input: packed,
    std::shared_ptr<const net::FloatPieces> lent;  // or lent parts; neither for a gather ahead
    bool gather_ahead() const { return group >= 0 && packed == nullptr && lent == nullptr; }
  };
  std::vector<ReduceBucket> PlanOf(int g) const;
  Status Reduce(const Job& job);
  Status Queue(Job job);  // queued on the thread; without it, reduced here
  Status PackLent();      // the open lent parts into a packed buffer: they are packed from here on
  Status GatherAhead(int g);
  float* AcquirePacked();
  void ReleasePacked(float* p);
  void Run();

  const Layout& layout_;
  net::Communicator& comm_;
  DeviceTier& device_;
  StagingPool& grad_staging_;
  const bool g_staged_;
  const Hooks hooks_;
  const bool scatter_;  // stages 2-3: reduce-scatter, else all-reduce
  std::unique_ptr<ReduceMemory> mem_;
  std::vector<Allocation> device_bufs_;  // the device's packed buffers (NCCL)
  int max_packed_ = 1;
  int parts_group_ = -1;           // the group whose parts are open (the caller's thread only)
  float* parts_packed_ = nullptr;  // its packed buffer,
  std::shared_ptr<net::FloatPieces> parts_lent_;  // or its lent parts (LendsParts)
  std::vector<ReduceBucket> parts_buckets_;  // its buckets (PlanOf), and PackPart's n and world
  uint64_t parts_n_ = 0;
  int parts_world_ = 1;
  std::atomic<uint64_t> gathers_ahead_{0}, gathers_ahead_declined_{0}, lent_reduced_bytes_{0};

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<float*> device_free_;
  int packed_in_use_ = 0;
  std::deque<Job> queue_;
  Job current_;  // the job running
  bool busy_ = false, stop_ = false;
  Status error_;
  std::thread thread_;
};

}  // namespace strata

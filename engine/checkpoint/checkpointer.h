// Checkpointer: save and load of the engine's state — each rank's shard
// file (a snapshot of the NVMe swap file where it can be linked, else a
// copy), the trainer's blob, and rank 0's manifest, published by rename;
// a load from any checkpoint of the same model, resharded to this run's
// ranks, checked whole before anything changes.
//
// Invariants:
// - A save is all or nothing: a killed or failed save leaves a ".partial"
//   folder that the next save removes, never a checkpoint that loads.
// - A load changes nothing until every rank has checked the manifest, the
//   layout, every file's size and checksum and the blob; an I/O failure
//   after that leaves the engine broken (StepState::broken) until a load
//   succeeds.
// - Every rank calls Save and Load together; each agrees with the others
//   (AgreeOverRanks) before a step that another rank may have refused.
//
// Touches what Deps names, and nothing else: the layout and home blocks
// (read), the shard store, the blocks' I/O, the staging pools (borrowed
// slots), the storage engine (the shard files), the NVMe tier (snapshots),
// the communicator, the stats, and the step's counts and scale (StepState: saved, and
// restored by a load). No lock and no thread: called between steps
// (the composition checks that first).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "engine/config/config.h"
#include "engine/format/manifest.h"
#include "engine/layout/layout.h"
#include "engine/reduce/agree.h"
#include "engine/stats/stats.h"
#include "engine/step/shard_store.h"
#include "engine/step/step_state.h"
#include "io/net/comm.h"
#include "io/file_storage.h"
#include "tiers/nvme_tier.h"

namespace strata {

class Checkpointer {
 public:
  struct Deps {
    const Config& config;
    const Layout& layout;
    const std::vector<GroupBlocks>& blocks;
    ShardStore& shards;
    BlockIo& io;
    StagingPools& staging;
    FileStorage& storage;
    NvmeTier* nvme;              // null without state on NVMe
    net::Communicator* comm;     // null alone
    int rank, world_size;        // of the run (stage 0 shards nothing: rank 0 writes)
    StepState& step;
    bool skips_gradless;  // each group keeps its own update count (saved per group)
    StatsRecorder& stats;
  };
  // What a load asks of the composition: before it writes the state (once
  // every check passed), the step in progress stopped, so that no update of
  // it runs beside the load or lands after it (the overlapped step's queued
  // updates dropped, its held speculation undone first); once the state is
  // in, P recomputed from W (`buf`: a staging slot of `bytes`, or null), the
  // device copies dropped, the step in progress abandoned.
  struct Hooks {
    std::function<void()> stop_step;
    std::function<Status(void* buf, uint64_t bytes)> recompute_p;
    std::function<void()> drop_copies;
    std::function<void()> abandon_step;
  };
  Checkpointer(Deps deps, Hooks hooks) : d_(deps), hooks_(std::move(hooks)) {}

  Status Save(const std::string& dir, const std::string& tag, const void* blob, uint64_t blob_bytes);
  Status Load(const std::string& dir, const std::string& tag, std::vector<uint8_t>* blob);

 private:
  Status Agree(const Status& local, const std::string& what) { return AgreeOverRanks(d_.comm, local, what); }
  Result<std::string> WriteShardFile(const std::string& data_path, const std::string& name);
  Result<std::string> SnapshotShardFile(const std::string& link_path, const std::string& name);
  Status WriteManifest(const std::string& dir, const std::string& tag, const std::string& part, const void* blob,
                       uint64_t blob_bytes);
  Status ResaveExisting(const std::string& dir, const std::string& tag, const void* blob, uint64_t blob_bytes);
  Status SameStateAs(const manifest::Manifest& m, const std::string& folder);
  Status SameCheckpointOnEveryRank(const manifest::Manifest& m, const std::string& folder);
  Status FindCheckpoint(const std::string& dir, const std::string& tag, std::string* folder, manifest::Manifest* m);
  Status CheckManifestLayout(const manifest::Manifest& m, const std::string& mpath);
  static std::string StatesOf(uint32_t bits);
  Status VerifyFile(const manifest::File& file, const std::string& folder);
  Status ApplyResharded(const manifest::Manifest& m, const std::string& folder);

  const Deps d_;
  const Hooks hooks_;
};

}  // namespace strata

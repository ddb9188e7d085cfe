// One rank of the ZeRO tests, started by strata-launch (or torchrun): trains
// the tiny MLP plus a 53-element group (uneven over 2, 4 or 8 ranks) on a
// global batch split across the ranks, at a given stage and placement.
//   zero_worker STAGE device|host|nvme SWAP OUT [kill-rank-1-at-step K] [timeout S]
//               [steps N] [save DIR] [load DIR] [tag-by-rank 1] [load-by-rank 1]
//               [read-eio-rank-1 1]   (rank 1's reads fail when the master is read at the end)
//               [bucket N] [overlap 0|1]   (reduce_bucket_size, overlap_comm)
//               [frozen G] [frozen-on-rank R]   (FreezeGroup(G), on every rank or on rank R only)
//               [device-budget B]   (strata.device_budget, "64MiB")
//               [gradless-at-step K]   (skip_groups_without_grads; at step K no rank gives the 53-element
//                                       group gradients)
//               [eio-rank-0-at-step K]   (as eio-rank-1-at-step, rank 0's disk: with behind-eio-rank-1-at-step
//                                          K, the step fails on rank 0 while rank 1 loses a write behind it)
//               [lone-frozen-read 1]   (after training, rank 0 alone reads exp_avg of frozen group G: refused
//                                       at once, INVALID, no collective)
// Rank 0 writes the gathered master weights (fp32) to OUT. With `load`, the
// run resumes from DIR's latest checkpoint (saved by any number of ranks);
// with `save`, it saves to DIR after its steps (tag "t", or "t<rank>" with
// tag-by-rank, which every rank must refuse). With load-by-rank, rank R
// loads DIR<R>: ranks that find different checkpoints must all refuse.
#include <csignal>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "engine/engine.h"
#include "io/fault.h"
#include "io/net/launch_env.h"
#include "tiers/nvme_tier.h"
#include "tests/engine/tiny_mlp.h"

using namespace strata;

static int Die(const Status& s) {
  std::fprintf(stderr, "zero_worker: %s\n", s.ToString().c_str());
  return 1;
}

int main(int argc, char** argv) {
  if (argc < 5) return 2;
  const std::string stage = argv[1], place = argv[2], swap = argv[3], out = argv[4];
  int kill_at = -1, steps = 20, eio_at = -1, eio_skip = 0, diverge_at = -1, frozen = -1, frozen_on = -1, dim = 24;
  int behind_eio_at = -1;  // rank 1's disk fails a write behind this step (strata.write_behind)
  int eio_rank = 1;        // whose disk fails part-way through step eio_at
  int gradless_at = -1;    // the step at which the 53-element group gets no gradients (skip_groups_without_grads)
  std::string device_budget = "64MiB";
  bool lone_frozen_read = false;
  bool behind_reload = false;  // then every rank loads the checkpoint in place (else exits 3 to be restarted)
  bool prepare = false;  // overlap_step, and prepare_step before each step's forward
  // With behind-reload: what comes first after the lost write (and fails on
  // every rank): "save" (a checkpoint save) or "read" (read_master); or
  // "badload", a load of a checkpoint that is not there (refused on every
  // rank, changing nothing), before the step that then fails on every rank.
  std::string behind_first;
  std::string diverge;  // "lr": rank 1 steps with another lr; "grads": rank 1 skips a group's grads
  bool tag_by_rank = false, load_by_rank = false, read_eio = false, compact = false, bf16 = false, tcp = false, hole = false, parts = false, lend = false;
  std::string timeout = "60", save_dir, load_dir, zero_extra, strata_extra, clip_json;
  for (int i = 5; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "kill-rank-1-at-step")) kill_at = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "timeout")) timeout = argv[i + 1];
    if (!std::strcmp(argv[i], "steps")) steps = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "save")) save_dir = argv[i + 1];
    if (!std::strcmp(argv[i], "load")) load_dir = argv[i + 1];
    if (!std::strcmp(argv[i], "tag-by-rank")) tag_by_rank = true;
    if (!std::strcmp(argv[i], "load-by-rank")) load_by_rank = true;
    if (!std::strcmp(argv[i], "read-eio-rank-1")) read_eio = true;
    if (!std::strcmp(argv[i], "eio-rank-1-at-step")) eio_at = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "eio-rank-0-at-step")) {  // (with a write lost behind it on rank 1)
      eio_at = std::stoi(argv[i + 1]);
      eio_rank = 0;
    }
    if (!std::strcmp(argv[i], "eio-skip")) eio_skip = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "behind-eio-rank-1-at-step")) behind_eio_at = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "behind-first")) behind_first = argv[i + 1];
    if (!std::strcmp(argv[i], "gradless-at-step")) gradless_at = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "device-budget")) device_budget = argv[i + 1];
    if (!std::strcmp(argv[i], "lone-frozen-read")) lone_frozen_read = std::strcmp(argv[i + 1], "0") != 0;
    if (!std::strcmp(argv[i], "prepare")) prepare = std::strcmp(argv[i + 1], "0") != 0;
    if (!std::strcmp(argv[i], "behind-reload")) behind_reload = std::strcmp(argv[i + 1], "0") != 0;
    if (!std::strcmp(argv[i], "speculation")) strata_extra += R"(, "speculation": ")" + std::string(argv[i + 1]) + "\"";
    if (!std::strcmp(argv[i], "write-behind")) strata_extra += R"(, "write_behind": ")" + std::string(argv[i + 1]) + "\"";
    if (!std::strcmp(argv[i], "grad-home")) strata_extra += R"(, "grad_home": ")" + std::string(argv[i + 1]) + "\"";
    if (!std::strcmp(argv[i], "clip")) clip_json = R"("gradient_clipping": )" + std::string(argv[i + 1]) + ", ";
    if (!std::strcmp(argv[i], "diverge-rank-1-at-step")) diverge_at = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "diverge")) diverge = argv[i + 1];
    if (!std::strcmp(argv[i], "compact")) compact = true;
    if (!std::strcmp(argv[i], "tcp")) tcp = true;
    if (!std::strcmp(argv[i], "frozen")) frozen = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "frozen-on-rank")) frozen_on = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "bf16")) bf16 = true;
    if (!std::strcmp(argv[i], "hole")) hole = std::strcmp(argv[i + 1], "0") != 0;
    if (!std::strcmp(argv[i], "parts")) parts = std::strcmp(argv[i + 1], "0") != 0;
    if (!std::strcmp(argv[i], "lend")) lend = std::strcmp(argv[i + 1], "0") != 0;  // parts lent
    if (!std::strcmp(argv[i], "dim")) dim = std::stoi(argv[i + 1]);  // the model's width (24)
    if (!std::strcmp(argv[i], "sub-group")) zero_extra += R"(, "sub_group_size": )" + std::string(argv[i + 1]);
    if (!std::strcmp(argv[i], "bucket")) zero_extra += R"(, "reduce_bucket_size": )" + std::string(argv[i + 1]);
    if (!std::strcmp(argv[i], "overlap"))
      zero_extra += R"(, "overlap_comm": )" + std::string(std::strcmp(argv[i + 1], "0") ? "true" : "false");
  }
  auto info = net::RankInfoFromEnv();
  if (!info.ok()) return Die(info.status());
  const std::string opt = place == "device" ? "none" : place == "host" ? "cpu" : "nvme";
  // The batch of 8 splits evenly over 1, 2, 4 and 8 ranks: each rank's loss
  // is the mean over its rows and the engine averages over the ranks (the
  // default, DDP's semantics). Over 3 ranks it does not: the loss is
  // normalized by the whole batch and the engine sums.
  const bool uneven = 8 % info->world_size != 0;
  // "optnvme": W, M, V on NVMe and P off it at every stage.
  const std::string par = place == "nvme" && stage == "3" ? "nvme" : "none";
  const std::string rank_swap = swap + "/rank" + std::to_string(info->rank);
  std::string mk = "mkdir -p '" + rank_swap + "'";
  if (std::system(mk.c_str()) != 0) return 1;
  // "compact": strata.state_format compact (bf16 compute, as it needs);
  // "bf16": bf16 compute with fp32 state.
  std::string format = compact ? R"(, "state_format": "compact")" : "";
  if (tcp) format += R"(, "comm_shared_memory": false)";  // collectives over TCP, not /dev/shm
  format += strata_extra;
  auto cfg = ParseConfig(std::string(compact || bf16 ? R"({"bf16": {"enabled": true}, )" : "{") + clip_json +
                         R"("optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
      "zero_optimization": {"stage": )" + stage + R"(,
        "offload_optimizer": {"device": ")" + opt + R"(", "nvme_path": ")" + rank_swap + R"("},
        "offload_param": {"device": ")" + par + R"(", "nvme_path": ")" + rank_swap + R"("})" + zero_extra + R"(},
      "strata": {"device_budget": ")" + device_budget + R"(", "host_budget": "64MiB", "timeout": )" + timeout +
                        R"(, "grad_reduce": ")" + (uneven ? "sum" : "mean") + "\"" + format + "}}");
  if (!cfg.ok()) return Die(cfg.status());
  EngineOptions eo;
  eo.rank = info->rank;
  eo.world_size = info->world_size;
  eo.force_no_gpu = true;
  eo.faults = std::make_shared<FaultPlan>();
  eo.overlap_step = prepare;
  eo.skip_groups_without_grads = gradless_at >= 0;
  auto e = Engine::Create(*cfg, eo);
  if (!e.ok()) return Die(e.status());
  Engine& eng = **e;
  testing::TinyMlp model(3, dim);
  model.whole_batch_norm = uneven;
  model.hole = hole;
  model.in_parts = parts;
  model.lend = lend;
  if (Status st = model.Register(eng); !st.ok()) return Die(st);
  std::vector<float> extra(53);
  for (int i = 0; i < 53; ++i) extra[static_cast<size_t>(i)] = 0.01f * static_cast<float>(i % 7);
  auto off = eng.AddParam(model.layers, "uneven", 53, extra.data());
  if (!off.ok()) return Die(off.status());
  if (frozen >= 0 && (frozen_on < 0 || frozen_on == info->rank))
    if (Status st = eng.FreezeGroup(frozen); !st.ok()) return Die(st);
  if (Status st = eng.Build(); !st.ok()) return Die(st);
  int first = 0;
  if (!load_dir.empty()) {
    std::vector<uint8_t> blob;
    const std::string dir = load_by_rank ? load_dir + std::to_string(info->rank) : load_dir;
    if (Status st = eng.LoadCheckpoint(dir, "", &blob); !st.ok()) return Die(st);
    if (blob.size() != sizeof first) return Die(CorruptError("trainer blob"));
    std::memcpy(&first, blob.data(), sizeof first);
  }
  uint64_t last_read = 0;  // NVMe bytes read by the last step (forward, backward, update)
  const std::string behind_ck = swap + "/behind-ck";
  bool behind_done = behind_eio_at < 0;
  // After a planned failure: every rank loads step K-1's checkpoint in place
  // (their communicator intact); *next: the step to train next.
  auto reload_in_place = [&](int* next) -> Status {
    eo.faults->Disarm();
    eo.faults->SlowWrites(0);
    if (info->rank == 1 && eo.faults->fired() != 1)
      return StateError("rank 1's write fault fired " + std::to_string(eo.faults->fired()) + " times");
    std::vector<uint8_t> blob;
    STRATA_RETURN_IF_ERROR(eng.LoadCheckpoint(behind_ck, "b", &blob));
    if (blob.size() != sizeof *next) return CorruptError("trainer blob");
    std::memcpy(next, blob.data(), sizeof *next);
    std::fprintf(stderr, "rank %d: loaded step %d's checkpoint in place\n", info->rank, *next - 1);
    behind_done = true;
    return Status::Ok();
  };
  // The step that fails after the lost write: the next one; or, at a step
  // whose copies do not all take its new P (the group without gradients, P
  // on NVMe at stage 3), that step itself, which waits for its writes.
  // With rank 0's disk failing step K too (eio-rank-0-at-step K), step K
  // fails on every rank, and so does its second call.
  const int fails_at =
      behind_eio_at < 0 ? -1 : behind_eio_at + (gradless_at == behind_eio_at || eio_at == behind_eio_at ? 0 : 1);
  for (int s = first; s < first + steps; ++s) {
    // Write-behind: rank 1's disk fails a write of step K after the step
    // returned. Step K succeeds on every rank; step K+1 fails on every rank
    // at once (rank 1 naming the lost write, the others naming rank 1), which
    // exit 3 to be restarted from the checkpoint of step K-1, or with
    // behind-reload (their communicator intact) load it in place and go on.
    const bool behind_fault = !behind_done && s == behind_eio_at;
    if (behind_fault && info->rank == 1) {
      eo.faults->SlowWrites(5);  // (the writes are still in flight when the step returns)
      eo.faults->Arm(FaultPlan::Ops::kWrites, EIO, static_cast<uint64_t>(eio_skip), 1);
    }
    if (s == kill_at && info->rank == 1) std::raise(SIGKILL);
    if (behind_first == "badload" && behind_reload && !behind_done && s == fails_at) {
      std::vector<uint8_t> blob;
      Status st = eng.LoadCheckpoint(swap + "/nowhere", "", &blob);
      if (st.ok()) return Die(StateError("a load of a missing checkpoint succeeded"));
      std::fprintf(stderr, "rank %d: a load of a missing checkpoint failed as planned: %s\n", info->rank,
                   st.ToString().c_str());
    }
    if ((behind_first == "save" || behind_first == "read") && behind_reload && !behind_done && s == fails_at) {
      // A save (or a read of the master weights) before the step that would
      // fail: it fails on every rank at once (nothing written), the engines
      // broken together.
      const int next = s;
      std::vector<float> w0(eng.group_numel(0));
      Status st = behind_first == "save" ? eng.SaveCheckpoint(swap + "/after-loss", "a", &next, sizeof next)
                                         : eng.ReadMaster(0, w0.data());
      if (st.ok()) return Die(StateError("a " + behind_first + " after rank 1 lost a write succeeded"));
      std::fprintf(stderr, "rank %d: %s before step %d failed as planned: %s\n", info->rank, behind_first.c_str(), s,
                   st.ToString().c_str());
      int again = 0;
      if (Status st = reload_in_place(&again); !st.ok()) return Die(st);
      s = again - 1;  // (the loop's ++s: step `again` next)
      continue;
    }
    const uint64_t read_before = eng.stats().nvme_to_host;
    if (prepare) {  // (the options Step gets below)
      StepOptions po;
      po.lr = 0.01 * (1.0 + 0.05 * s);
      if (Status st = eng.PrepareStep(po); !st.ok()) return Die(st);
    }
    auto loss = model.TrainStep(eng, nullptr, 1.0, info->rank, info->world_size);
    if (!loss.ok()) return Die(loss.status());
    // The uneven group: a gradient from its parameters, split over the ranks too.
    auto p = eng.Fetch(model.layers);
    if (!p.ok()) return Die(p.status());
    std::vector<float> g(53);
    for (int i = 0; i < 53; ++i)
      g[static_cast<size_t>(i)] = (static_cast<const float*>(*p)[i] - 0.02f) /
                                  (uneven ? static_cast<float>(info->world_size) : 1.0f);  // "mean" averages
    if (Status st = eng.Release(model.layers); !st.ok()) return Die(st);
    const bool diverging = s == diverge_at && info->rank == 1;
    if (!(diverging && diverge == "grads") && s != gradless_at)
      if (Status st = eng.Grads(model.layers, g.data(), DType::kF32); !st.ok()) return Die(st);
    StepOptions so;
    so.lr = 0.01 * (1.0 + 0.05 * s) * (diverging && diverge == "lr" ? 2 : 1);
    // Rank 1's disk fails part-way through this step: every rank's step
    // fails (rank 1's with IO, the others naming rank 1), and every rank
    // calls step again once the disk is back.
    const bool faulty = s == eio_at;
    if (faulty && info->rank == eio_rank) eo.faults->Arm(FaultPlan::Ops::kBoth, EIO, static_cast<uint64_t>(eio_skip));
    auto r = eng.Step(so);
    if (faulty) {
      // (Rank 1's write fault behind this step, if any, stays armed.)
      if (info->rank == eio_rank) eo.faults->Disarm();
      if (r.ok())
        return Die(StateError("step " + std::to_string(s) + " succeeded although rank " + std::to_string(eio_rank) +
                              "'s disk failed"));
      std::fprintf(stderr, "rank %d: step %d failed as planned, first call: %s\n", info->rank, s,
                   r.status().ToString().c_str());
      r = eng.Step(so);
    }
    if (!behind_done && s == behind_eio_at - 1 && r.ok()) {
      const int next = s + 1;
      if (Status st = eng.SaveCheckpoint(behind_ck, "b", &next, sizeof next); !st.ok()) return Die(st);
    }
    if (behind_fault && s != fails_at && !r.ok())
      return Die(r.status().WithContext("step " + std::to_string(s) + " waited for its writes"));
    if (!behind_done && s == fails_at) {
      eo.faults->Disarm();
      eo.faults->SlowWrites(0);
      if (r.ok()) return Die(StateError("step " + std::to_string(s) + " went ahead after rank 1 lost a write"));
      std::fprintf(stderr, "rank %d: step %d failed as planned: %s\n", info->rank, s, r.status().ToString().c_str());
      if (!behind_reload) {
        if (info->rank == 1 && eo.faults->fired() != 1)
          return Die(StateError("rank 1's write fault fired " + std::to_string(eo.faults->fired()) + " times"));
        return 3;
      }
      int again = 0;
      if (Status st = reload_in_place(&again); !st.ok()) return Die(st);
      s = again - 1;  // (the loop's ++s: step `again` next)
      continue;
    }
    if (!r.ok()) return Die(r.status());
    last_read = eng.stats().nvme_to_host - read_before;
  }
  if (lone_frozen_read && frozen >= 0 && info->rank == 0) {
    std::vector<float> m(eng.group_numel(frozen));
    Status st = eng.ReadState(frozen, Engine::OptimizerState::kExpAvg, m.data());
    if (st.ok() || st.code() != Code::kInvalid)
      return Die(StateError("rank 0 alone reading exp_avg of frozen group " + std::to_string(frozen) +
                            " was not refused at once: " + st.ToString()));
    std::fprintf(stderr, "rank 0: a lone read of a frozen group's exp_avg refused at once: %s\n", st.ToString().c_str());
  }
  if (!save_dir.empty()) {
    const int next = first + steps;
    const std::string tag = tag_by_rank ? "t" + std::to_string(info->rank) : "t";
    if (Status st = eng.SaveCheckpoint(save_dir, tag, &next, sizeof next); !st.ok()) return Die(st);
  }
  std::vector<float> all;
  if (read_eio && info->rank == 1) eo.faults->Arm(FaultPlan::Ops::kReads, EIO, 0, -1);  // rank 1's reads of the master fail
  for (int g = 0; g < eng.num_groups(); ++g) {
    std::vector<float> w(eng.group_numel(g));
    if (Status st = eng.ReadMaster(g, w.data()); !st.ok()) return Die(st);
    all.insert(all.end(), w.begin(), w.end());
  }
  if (info->rank == 0) {
    const EngineStats st = eng.stats();
    // What a step must read from NVMe when it holds W, M, V there: this
    // rank's shard of each (fp32, padded to the ranks' 2048-element shards).
    const uint64_t per_shard = uint64_t{2048} * static_cast<uint64_t>(info->world_size);
    // Every group's fp32 bytes, padded to the ranks' shards (stages 1-3),
    // and to one shard of 2048 elements (stage 0: unpartitioned).
    uint64_t wmv = 0, padded = 0, padded_one = 0;
    for (int g = 0; g < eng.num_groups(); ++g) {
      wmv += 3 * NvmeTier::PaddedSizeFor(
                     (eng.group_numel(g) + per_shard - 1) / per_shard * 2048 * 4, 1);
      padded += (eng.group_numel(g) + per_shard - 1) / per_shard * per_shard * 4;
      padded_one += (eng.group_numel(g) + 2047) / 2048 * 2048 * 4;
    }
    std::fprintf(stderr,
                 "zero_worker: gathers_ahead %llu declined %llu p_gathers %llu groups %d steps %d "
                 "last_step_read %llu wmv %llu write_behind_steps %llu "
                 "comm_s %.6f comm_cpu_s %.6f reduced_bytes %llu gathered_bytes %llu padded %llu padded_one %llu "
                 "speculated_steps %llu lent_reduced_bytes %llu\n",
                 static_cast<unsigned long long>(st.gathers_ahead),
                 static_cast<unsigned long long>(st.gathers_ahead_declined),
                 static_cast<unsigned long long>(st.p_gathers), eng.num_groups(), steps,
                 static_cast<unsigned long long>(last_read), static_cast<unsigned long long>(wmv),
                 static_cast<unsigned long long>(st.write_behind_steps), st.comm_s, st.comm_cpu_s,
                 static_cast<unsigned long long>(st.reduced_bytes),
                 static_cast<unsigned long long>(st.gathered_bytes), static_cast<unsigned long long>(padded),
                 static_cast<unsigned long long>(padded_one), static_cast<unsigned long long>(st.speculated_steps),
                 static_cast<unsigned long long>(st.lent_reduced_bytes));
    std::ofstream f(out, std::ios::binary);
    f.write(reinterpret_cast<const char*>(all.data()), static_cast<std::streamsize>(all.size() * 4));
    if (!f) return Die(IoError("cannot write " + out));
  }
  return 0;
}

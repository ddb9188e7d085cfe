#!/usr/bin/env bash
# Strata against DeepSpeed, whole engine (issue 36): the same HF GPT-2
# (random weights, fp32, ~51M parameters, batch 4 x 256) and the same
# ds_config.json (ZeRO-3, offload_param and offload_optimizer on "cpu", then
# "nvme"; AdamW lr 1e-4, weight decay 0.01, gradient_clipping 1.0) under
# deepspeed.initialize and under strata.torch.offload_module, each run in a
# fresh process, at 1 and 2 ranks (torchrun, Gloo), in alternating order over
# ROUNDS rounds. A bench, not a test (not in ./dev.sh test).
#
# It makes what it needs: the torch-2 venv (tools/make-venv.sh), DeepSpeed
# and its imports pinned in bench/python/requirements-deepspeed.txt (pip
# --target into the cache, --no-deps), Debian's libaio-dev for DeepSpeed's
# async_io op (apt-get, when missing); DeepSpeed builds its CPU Adam and aio
# ops itself at first use (into ~/.cache/torch_extensions, a few minutes).
#
# Each round also runs the floor: torch's own AdamW with clip_grad_norm_,
# nothing offloaded and nothing communicated, at each rank count, its
# forward, backward and update timed apart. No offload engine's step can be
# shorter than torch's forward and backward on the same cores, so DeepSpeed's
# step time over theirs is the most any engine can lead it by here (printed
# as `ceiling`, beside DeepSpeed's time over torch's whole step, which an
# engine with a faster update than torch's AdamW can beat).
#
# Prints each run's line (step time, tokens/s, peak RSS, disk bytes per step,
# the swap folder's size, minor page faults, kernel and all threads' CPU
# seconds per step; for Strata and torch, each phase's wall seconds and the
# calling thread's CPU seconds in it), the config keys Strata named as
# ignored (in this config, and in Hugging Face's ZeRO-3 template:
# config_honesty.py), a table of rank 0's medians (peak RSS: the largest of
# any rank), the ceiling, the `phases` lines (where a step's time goes: what
# the caller computed, what it waited for), and last
#   vs_deepspeed cpu=R nvme=R cpu_2r=R nvme_2r=R
# R = DeepSpeed's median step time / Strata's (above 1: Strata leads).
# Usage: bench/vs_deepspeed.sh DIR
#   env: ROUNDS (2), STEPS (20), WARMUP (2), RANKS ("1 2"), MODES ("cpu nvme"), BUILD_DIR,
#        N_EMBD and N_LAYER (the GPT-2's size: 512 and 8, 51M parameters), BATCH (4), SEQ (256),
#        CLIP (gradient_clipping, 1.0), STATS=1 (each Strata run's engine stats in the log, and at
#        several ranks a `collectives` line: rank 0's reductions and gathers a step, wall and CPU)
set -euo pipefail
DIR=${1:?usage: bench/vs_deepspeed.sh DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
ROUNDS=${ROUNDS:-2} RANKS=${RANKS:-1 2} MODES=${MODES:-cpu nvme}
export STEPS=${STEPS:-20} WARMUP=${WARMUP:-2}
[ -d "$DIR" ] || { echo "vs_deepspeed: $DIR is not a directory" >&2; exit 2; }
PY=$("$ROOT/tools/make-venv.sh")
CACHE=${STRATA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}
REQ=$ROOT/bench/python/requirements-deepspeed.txt
SITE=$CACHE/deepspeed-site-$(sha256sum "$REQ" | cut -c1-12)
if [ ! -f "$SITE/.complete" ]; then
  rm -rf "$SITE"
  "$PY" -m pip install --quiet --no-deps --target "$SITE" -r "$REQ"
  touch "$SITE/.complete"
fi
if ! dpkg-query -W -f='${Status}' libaio-dev 2>/dev/null | grep -q "install ok installed"; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libaio-dev >/dev/null
fi
[ -f "$BUILD_DIR/engine/libstrata.so" ] || cmake --build "$BUILD_DIR" --target strata >/dev/null
export STRATA_LIBRARY=$BUILD_DIR/engine/libstrata.so PYTHONPATH=$ROOT/python:$SITE DS_ACCELERATOR=cpu
export OMP_WAIT_POLICY=PASSIVE MASTER_ADDR=127.0.0.1
OUT=$DIR/vs_deepspeed.log
: >"$OUT"
run() {  # engine mode ranks
  local eng=$1 mode=$2 ranks=$3 swap=$DIR/swap-$1-$2 lines=$DIR/last.out status=0
  rm -rf "$swap"; mkdir -p "$swap"
  export MASTER_PORT=$((29500 + RANDOM % 1000))
  if [ "$ranks" -eq 1 ]; then
    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 "$PY" "$ROOT/bench/python/vs_deepspeed_run.py" "$eng" "$mode" "$swap"
  else
    "$(dirname "$PY")/torchrun" --nproc_per_node "$ranks" --master_port "$MASTER_PORT" \
      "$ROOT/bench/python/vs_deepspeed_run.py" "$eng" "$mode" "$swap"
  fi 2>"$DIR/last.err" | grep -E '^vs_deepspeed_(run|ignored|stats)' >"$lines" || status=$?
  if [ "$status" -ne 0 ]; then
    # DeepSpeed's run whose every rank reported its steps and that failed
    # after them (its aio op's threads at exit: "terminate called without an
    # active exception") is kept, and said so; any other failure ends the bench.
    local reported; reported=$(grep -c '^vs_deepspeed_run ' "$lines" || true)
    if [ "$eng" = deepspeed ] && [ "$reported" -eq "$ranks" ]; then
      echo "vs_deepspeed: $eng $mode at $ranks ranks failed after every rank reported its steps (kept):" \
        "$(grep -E 'terminate|Error|Signal' "$DIR/last.err" | head -3 | tr '\n' ' ')" | tee -a "$OUT" >&2
    else
      tail -20 "$DIR/last.err" >&2; echo "vs_deepspeed: $eng $mode at $ranks ranks failed" >&2; exit 1
    fi
  fi
  tee -a "$OUT" <"$lines"
  rm -rf "$swap"
}
for r in $(seq 1 "$ROUNDS"); do
  for ranks in $RANKS; do
    run torch cpu "$ranks"
    for mode in $MODES; do
      if [ $(( (r + ranks) % 2 )) -eq 0 ]; then order="deepspeed strata"; else order="strata deepspeed"; fi
      for eng in $order; do run "$eng" "$mode" "$ranks"; done
    done
  done
done
echo "== ds_config keys Strata ignores or leaves to the trainer (from its notes at creation):"
grep '^vs_deepspeed_ignored' "$OUT" | sed 's/^vs_deepspeed_ignored //' | sort -u || echo "(none)"
echo "== the same for Hugging Face's ZeRO-3 template (bench/python/config_honesty.py):"
for offload in cpu nvme; do
  mkdir -p "$DIR/swap-honesty"
  "$PY" "$ROOT/bench/python/config_honesty.py" "$offload" "$DIR/swap-honesty" 2>"$DIR/last.err" ||
    { tail -20 "$DIR/last.err" >&2; echo "vs_deepspeed: config_honesty $offload failed" >&2; exit 1; }
  rm -rf "$DIR/swap-honesty"
done
"$PY" - "$OUT" <<'PY'
import json, statistics, sys
runs = [json.loads(l.split(" ", 1)[1]) for l in open(sys.argv[1]) if l.startswith("vs_deepspeed_run ")]
rows, rss = {}, {}  # rank 0's runs; peak RSS over every rank (the ranks' largest)
for r in runs:
    key = (r["offload"], r["world"], r["engine"])
    rss[key] = max(rss.get(key, 0), r["peak_rss_mib"])
    if r["rank"] != 0:
        continue
    rows.setdefault(key, []).append(r)
print(f"{'mode':6} {'ranks':5} {'engine':9} {'step s':>7} {'tok/s':>7} {'RSS MiB':>8} {'read MiB':>8} {'written':>8} {'swap MiB':>8} {'faults k':>8} {'sys s':>6}")
ratio = {}
for (mode, world, eng), rs in sorted(rows.items()):
    med = lambda k: statistics.median(x[k] for x in rs)
    med_or = lambda k: statistics.median(x.get(k, float("nan")) for x in rs)  # (a log from before the field)
    print(f"{mode:6} {world:5} {eng:9} {med('step_s'):7.3f} {med('tokens_per_s'):7.0f} {rss[(mode, world, eng)]:8.0f} "
          f"{med('disk_read_mib_per_step'):8.1f} {med('disk_written_mib_per_step'):8.1f} {max(x['swap_mib'] for x in rs):8.0f} "
          f"{med_or('minor_faults_per_step') / 1e3:8.1f} {med_or('sys_s_per_step'):6.3f}")
    ratio.setdefault((mode, world), {})[eng] = med("step_s")
# The floor: torch's forward and backward (its medians), the compute every
# engine runs; torch's whole step adds its AdamW, which an engine can beat.
floor, whole = {}, {}
for (m, w, e), rs in rows.items():
    if e == "torch" and all("forward_s" in x for x in rs):
        floor[w] = statistics.median(x["forward_s"] + x["backward_s"] for x in rs)
        whole[w] = statistics.median(x["step_s"] for x in rs)
for (mode, world), x in sorted(ratio.items()):
    if "deepspeed" in x and world in floor:
        print(f"ceiling {mode} {world}r: DeepSpeed {x['deepspeed']:.3f} s / torch's forward and backward "
              f"{floor[world]:.3f} s = {x['deepspeed'] / floor[world]:.3f} (no engine can lead by more here; "
              f"over torch's whole step, AdamW included, {whole[world]:.3f} s: {x['deepspeed'] / whole[world]:.3f})")
# Where a step's time goes (rank 0, medians; Strata and torch, which time
# their phases): each phase's wall seconds and the calling thread's CPU
# seconds in it (the rest it waited, or was preempted), and every thread's
# CPU seconds a step (the engine's own threads included).
for (mode, world, eng), rs in sorted(rows.items()):
    if not all("forward_cpu_s" in x for x in rs):
        continue  # (DeepSpeed's step is one call; a log from before the fields)
    med = lambda k: statistics.median(x[k] for x in rs)
    # The update call's own median (a log from before the field: the step's
    # median less the others', which mixes steps, said so).
    update = lambda rs: (f"{statistics.median(x['update_s'] for x in rs):.3f} s" if all("update_s" in x for x in rs)
                         else f"{statistics.median(x['step_part_s'] for x in rs):.3f} s (the step less the others)")
    print(f"phases {mode} {world}r {eng}: forward {med('forward_s'):.3f} s ({med('forward_cpu_s'):.3f} s of the "
          f"caller's CPU), backward {med('backward_s'):.3f} s ({med('backward_cpu_s'):.3f}), the update "
          f"{update(rs)}; every thread's CPU {med('cpu_s_per_step'):.3f} s a step of {med('step_s'):.3f}")
# STATS=1 at several ranks: Strata's collectives a step (rank 0; stats
# lines from before the run's keys are left out): wall, the CPU of it, bytes.
for s in (json.loads(l.split(" ", 1)[1]) for l in open(sys.argv[1]) if l.startswith("vs_deepspeed_stats ")):
    if s.get("rank") == 0 and s.get("world", 1) > 1 and s.get("steps"):
        n = s["steps"]
        print(f"collectives {s['offload']} {s['world']}r (Strata, rank 0, a step): {s['comm_s'] / n:.3f} s, "
              f"{s['comm_cpu_s'] / n:.3f} s of it CPU (the rest waited for the other ranks); "
              f"{s['reduced_bytes'] / n / 2**20:.1f} MiB reduced, {s['gathered_bytes'] / n / 2**20:.1f} MiB gathered")
def r(mode, world):
    x = ratio.get((mode, world), {})
    return f"{x['deepspeed'] / x['strata']:.3f}" if "deepspeed" in x and "strata" in x else "n/a"
print(f"vs_deepspeed cpu={r('cpu', 1)} nvme={r('nvme', 1)} cpu_2r={r('cpu', 2)} nvme_2r={r('nvme', 2)}")
PY

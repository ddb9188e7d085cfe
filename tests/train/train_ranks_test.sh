#!/usr/bin/env bash
# strata-train on several ranks is data-parallel, not N copies of one run.
# Modes:
#   stages    On 2 ranks (strata-launch --nproc 2) it logs, step by step, the
#             loss and gradient norm that 1 rank logs on the same global batch,
#             at ZeRO stages 0-3 (fp32), at stage 3 in bf16, and with
#             strata.grad_reduce "sum" (stages 1, 3); at step 1 each rank's
#             own loss is that of its half of the batch.
#   refusals  A global batch that does not split evenly is refused naming the
#             numbers, and --gpu on several ranks without a GPU names why
#             (skipped where a GPU is: there it trains, over NCCL); the banner names the swap folder --config gives,
#             and the run says where it landed (placement), at start and in its summary.
#   resume    Saved and resumed on 2 ranks == the uninterrupted run, bitwise.
#   torchrun  The same equality under torchrun's variables (skipped without torch).
#
# Tolerance: relative 1e-4 on each step's loss and gradient norm. The runs
# differ only in the order of fp32 sums (each rank sums its 256 tokens, the
# engine adds the ranks' gradients and divides by 2; one rank sums 512), a few
# ulps (~1e-7) in each gradient that Adam carries into the weights; we see
# at most ~1e-7 after 8 steps. A semantic error is 10x larger than the bound
# or more: the two halves' losses differ from their mean by ~1e-3 relative at
# step 1 (a wrong or shared slice), summed instead of averaged gradients
# double the gradient norm.
# Usage: train_ranks_test.sh stages|refusals|resume|torchrun STRATA_TRAIN STRATA_LAUNCH
set -euo pipefail
MODE=${1:?usage: train_ranks_test.sh stages|refusals|resume|torchrun STRATA_TRAIN STRATA_LAUNCH}
TRAIN=${2:?strata-train}
LAUNCH=${3:?strata-launch}
PY=/usr/bin/python3
WORK=$(mktemp -d /var/tmp/strata-ranks-test-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
common=(--preset tiny --steps 8 --log-losses --print-every 100 --nvme "$WORK")

# config FILE STAGE DTYPE [REDUCE]: a --config at STAGE; below stage 3 with
# several ranks every rank keeps all parameters, so they stay in host memory.
# REDUCE: strata.grad_reduce ("mean" by default; with "sum" strata-train
# hands each rank's gradients divided by the world size itself).
config() {
  local bf16=false params='"nvme"'
  [ "$3" = bf16 ] && bf16=true
  [ "$2" -lt 3 ] && params='"cpu"'
  printf '{"bf16": {"enabled": %s}, "zero_optimization": {"stage": %s, "offload_param": {"device": %s}}, "strata": {"grad_reduce": "%s"}}\n' \
    "$bf16" "$2" "$params" "${4:-mean}" >"$1"
}

# compare ONE TWO STAGE WHAT: the loss lines of a 1-rank and a 2-rank output agree.
compare() {
  "$PY" - "$1" "$2" "$3" "$4" <<'PY'
import sys
def lines(path):
    out = []
    for l in open(path):
        l = l.removeprefix("[rank 0] ")
        if l.startswith("loss "):
            out.append(l.split())
    return out
one, two, stage = lines(sys.argv[1]), lines(sys.argv[2]), sys.argv[3]
assert len(one) == len(two) == 8, f"expected 8 loss lines each, got {len(one)} and {len(two)}"
banner = [l for l in open(sys.argv[2]) if "strata-train: preset" in l]
assert banner and f"(4 a rank on 2 ranks, ZeRO stage {stage})" in banner[0], f"banner: {banner}"
assert not any("[rank 1]" in l and ("loss" in l or "summary" in l) for l in open(sys.argv[2])), "rank 1 logged"
worst = 0.0
for a, b in zip(one, two):
    step, la, ga, lb, gb = a[1], float(a[2]), float(a[4]), float(b[2]), float(b[4])
    ranks = [float(x) for x in b[6:]]
    assert b[5] == "ranks" and len(ranks) == 2, f"step {step}: no per-rank losses: {b}"
    assert abs(sum(ranks) / 2 - lb) <= 1e-8 * lb, f"step {step}: the logged loss {lb} is not the ranks' mean {ranks}"
    for what, x, y in (("loss", la, lb), ("grad_norm", ga, gb)):
        rel = abs(x - y) / abs(x)
        worst = max(worst, rel)
        assert rel <= 1e-4, f"step {step}: {what} on 1 rank {x}, on 2 ranks {y}: relative {rel:.2e} > 1e-4"
print(f"stage {stage} {sys.argv[4]}: 8 steps, loss and grad_norm on 2 ranks == on 1 rank, worst relative {worst:.1e}")
PY
}

if [ "$MODE" = stages ]; then
  for case in 0:fp32:mean 1:fp32:mean 2:fp32:mean 3:fp32:mean 3:bf16:mean 1:fp32:sum 3:fp32:sum; do
    IFS=: read -r stage dtype reduce <<<"$case"
    config "$WORK/c$stage$dtype$reduce.json" "$stage" "$dtype" "$reduce"
    run=("${common[@]}" --config "$WORK/c$stage$dtype$reduce.json")
    "$TRAIN" "${run[@]}" >"$WORK/one.out" || fail "$case on 1 rank"
    "$LAUNCH" --nproc 2 --master-port 0 -- "$TRAIN" "${run[@]}" >"$WORK/two.out" 2>&1 ||
      { cat "$WORK/two.out"; fail "$case on 2 ranks"; }
    compare "$WORK/one.out" "$WORK/two.out" "$stage" "$dtype grad_reduce $reduce" || fail "$case: 2 ranks differ from 1"
  done
  # Each rank trained its own half: at step 1 (same weights everywhere) rank
  # 0's loss is that of a 1-rank run on the first half (--batch 4 draws the
  # same first 4 windows), rank 1's that of the second: 2 * L(8) - L(4).
  "$TRAIN" --preset tiny --steps 1 --batch 4 --log-losses --print-every 100 --nvme "$WORK" \
    --config "$WORK/c3fp32mean.json" >"$WORK/half.out"
  "$PY" - "$WORK/one.out" "$WORK/two.out" "$WORK/half.out" <<'PY' || fail "the ranks did not train their own halves"
import sys
def first(path):
    return [l.removeprefix("[rank 0] ").split() for l in open(path) if l.removeprefix("[rank 0] ").startswith("loss 1 ")][0]
l8, l4 = float(first(sys.argv[1])[2]), float(first(sys.argv[3])[2])
r0, r1 = (float(x) for x in first(sys.argv[2])[6:8])
tol = 1e-4 * l8
assert abs(l4 - l8) > 10 * tol, f"the halves are too alike to tell apart: {l4} vs {l8}"
assert abs(r0 - l4) <= tol, f"rank 0's loss {r0} is not its half's {l4}"
assert abs(r1 - (2 * l8 - l4)) <= tol, f"rank 1's loss {r1} is not the second half's {2 * l8 - l4}"
print(f"step 1: rank 0 {r0:.6f} == first half {l4:.6f}; rank 1 {r1:.6f} == second half {2 * l8 - l4:.6f}")
PY
  echo "8 passed, 0 failed"
elif [ "$MODE" = refusals ]; then
  set +e
  "$LAUNCH" --nproc 2 --master-port 0 -- "$TRAIN" --preset tiny --steps 1 --batch 7 --nvme "$WORK" >"$WORK/odd.out" 2>&1
  rc=$?
  set -e
  [ "$rc" -ne 0 ] || fail "--batch 7 on 2 ranks ran"
  grep -q -- '--batch 7 (the global batch) does not split evenly over 2 ranks' "$WORK/odd.out" ||
    fail "unclear refusal: $(cat "$WORK/odd.out")"
  echo "ok: $(grep -m1 -- '--batch 7' "$WORK/odd.out")"
  set +e
  "$LAUNCH" --nproc 2 --master-port 0 -- "$TRAIN" --preset tiny --steps 1 --gpu --nvme "$WORK" >"$WORK/gpu.out" 2>&1
  rc=$?
  set -e
  if [ "$rc" -eq 0 ]; then
    # (asked of the driver, not of the tool: a --gpu quietly on the CPU fails here)
    [ -e /dev/nvidia0 ] || nvidia-smi -L >/dev/null 2>&1 || fail "--gpu on 2 ranks ran where no GPU is"
    echo "note: --gpu on 2 ranks ran (a GPU is here: NCCL); its refusal is not checked"
  else
    grep -q -- '--gpu: no usable GPU: .' "$WORK/gpu.out" || fail "unclear refusal: $(cat "$WORK/gpu.out")"
    echo "ok: $(grep -m1 -- '--gpu: no usable GPU' "$WORK/gpu.out")"
  fi
  mkdir "$WORK/swap"
  printf '{"zero_optimization": {"offload_param": {"nvme_path": "%s"}, "offload_optimizer": {"nvme_path": "%s"}}}\n' \
    "$WORK/swap" "$WORK/swap" >"$WORK/swap.json"
  "$TRAIN" --preset tiny --steps 1 --print-every 100 --config "$WORK/swap.json" >"$WORK/banner.out"
  grep -q "state on NVMe in $WORK/swap\$" "$WORK/banner.out" || fail "banner: $(grep preset "$WORK/banner.out")"
  ! grep -q /var/tmp/strata-train- "$WORK/banner.out" || fail "the banner names a /var/tmp folder"
  echo "ok: $(grep preset "$WORK/banner.out")"
  # Where the rank landed: at start and in the summary (the CPU layers: no GPU).
  grep -q '^strata-train: rank 0/1: no GPU (force_no_gpu): device tier is a host arena; no NUMA binding (no GPU); ' \
    "$WORK/banner.out" || fail "placement at start: $(grep -m1 'rank 0/1' "$WORK/banner.out")"
  grep -q '^  placement         rank 0/1: no GPU (force_no_gpu)' "$WORK/banner.out" ||
    fail "no placement in the summary: $(cat "$WORK/banner.out")"
  echo "ok: $(grep -m1 '^strata-train: rank 0/1' "$WORK/banner.out")"
  # A "strata" section "auto" (the engine's default one) on 2 ranks: rank 1
  # dropped its trace_path from it as from an object, and aborted.
  echo '{"strata": "auto"}' >"$WORK/auto.json"
  "$LAUNCH" --nproc 2 --master-port 0 -- "$TRAIN" --preset tiny --steps 1 --print-every 100 --nvme "$WORK" \
    --config "$WORK/auto.json" >"$WORK/auto.out" 2>&1 || fail "{\"strata\": \"auto\"} on 2 ranks: $(tail -5 "$WORK/auto.out")"
  echo "ok: {\"strata\": \"auto\"} trains on 2 ranks"
  echo "5 passed, 0 failed"
elif [ "$MODE" = resume ]; then
  # Saved and resumed on 2 ranks (each saves and loads its own shards) ==
  # the uninterrupted run, bitwise: losses of steps 7-8 and the final weights.
  run=("${common[@]}" --weights-hash)
  "$LAUNCH" --nproc 2 --master-port 0 -- "$TRAIN" "${run[@]}" >"$WORK/whole.out" 2>&1 || fail "2 ranks"
  # 6 steps, saved at 3 and at the last (--save-every saves it too); the
  # learning rate of steps 1-6 (the warm-up) does not depend on --steps.
  "$LAUNCH" --nproc 2 --master-port 0 -- "$TRAIN" --preset tiny --steps 6 --log-losses --print-every 100 \
    --nvme "$WORK" --weights-hash --save "$WORK/ckpt" --save-every 3 >/dev/null 2>&1 || fail "2 ranks, saving"
  "$LAUNCH" --nproc 2 --master-port 0 -- "$TRAIN" "${run[@]}" --resume "$WORK/ckpt" >"$WORK/resumed.out" 2>&1 ||
    fail "2 ranks, resuming"
  grep -q 'resumed from .* at step 6' "$WORK/resumed.out" || fail "did not resume at step 6"
  grep -E '^\[rank 0\] (loss [78] |strata-train weights_hash)' "$WORK/whole.out" >"$WORK/a"
  grep -E '^\[rank 0\] (loss |strata-train weights_hash)' "$WORK/resumed.out" >"$WORK/b"
  [ "$(wc -l <"$WORK/a")" -eq 3 ] || fail "expected 2 loss lines and a hash: $(cat "$WORK/a")"
  diff "$WORK/a" "$WORK/b" || fail "resumed on 2 ranks differs from the uninterrupted run"
  echo "ok: resumed on 2 ranks == uninterrupted (steps 7-8, weights)"
  echo "1 passed, 0 failed"
elif [ "$MODE" = torchrun ]; then
  "$PY" -c "import torch.distributed.run" 2>/dev/null || { echo "skipped: torch.distributed.run not importable"; exit 77; }
  config "$WORK/c.json" 3 fp32
  run=("${common[@]}" --config "$WORK/c.json")
  "$TRAIN" "${run[@]}" >"$WORK/one.out"
  # Two free ports: torchrun's store on PORT, ours on PORT + 1.
  port=$(PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)" "$PY" -c "from free_ports import free_port_block; print(free_port_block(2))")
  # --redirects 2 --tee 2: torch 1.13 on Python 3.11 cannot parse the default (see tests/net/comm_driver.py).
  "$PY" -m torch.distributed.run --nproc_per_node 2 --master_port "$port" --redirects 2 --tee 2 --no_python \
    "$TRAIN" "${run[@]}" >"$WORK/two.out" 2>&1 || { cat "$WORK/two.out"; fail "torchrun"; }
  compare "$WORK/one.out" "$WORK/two.out" 3 "fp32 (torchrun)" || fail "under torchrun 2 ranks differ from 1"
  echo "1 passed, 0 failed"
else
  fail "unknown mode $MODE"
fi

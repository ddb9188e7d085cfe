#!/usr/bin/env bash
# strata-train end to end: (1) the same 10-step run all-resident and with
# parameters and optimizer state on NVMe under tight budgets gives the same
# loss sequence and bitwise the same weights; (2) on the built-in corpus the
# tiny preset's loss falls below 3.0 within 60 steps; (3) --save-every and
# --resume reproduce the uninterrupted run exactly (fp16 loss scaling, lr schedule);
# the medium preset builds on its default device budget; the overlapped step
# (the default) is bitwise --no-overlap-step's, bf16 and fp16; --config's lr
# is the peak unless --lr is given; SIGINT stops cleanly and resumes exactly.
# Usage: train_test.sh STRATA_TRAIN
set -euo pipefail
TRAIN=${1:?usage: train_test.sh path/to/strata-train path/to/strata-export}
EXPORT=${2:?usage: train_test.sh path/to/strata-train path/to/strata-export}
WORK=$(mktemp -d /var/tmp/strata-train-test-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
common=(--preset tiny --steps 10 --log-losses --weights-hash --print-every 100)

"$TRAIN" "${common[@]}" --resident >"$WORK/resident.out"
"$TRAIN" "${common[@]}" --nvme "$WORK" --device-budget 256KiB --host-budget 8MiB >"$WORK/offload.out"
grep -E '^(loss|strata-train weights_hash)' "$WORK/resident.out" >"$WORK/a"
grep -E '^(loss|strata-train weights_hash)' "$WORK/offload.out" >"$WORK/b"
[ "$(grep -c '^loss' "$WORK/a")" -eq 10 ] || fail "expected 10 loss lines"
diff "$WORK/a" "$WORK/b" || fail "resident and offloaded runs differ"
grep -q 'state_to_device_budget=' "$WORK/offload.out" || fail "no summary line"
ratio=$(sed -n 's/.*state_to_device_budget=\([0-9.]*\).*/\1/p' "$WORK/offload.out")
/usr/bin/python3 -c "import sys; sys.exit(0 if float('$ratio') >= 4 else 1)" || fail "state/device budget $ratio < 4"
echo "ok: resident == offloaded (10 steps, state/device budget $ratio)"

# The overlapped step (the default) against --no-overlap-step: bitwise the
# same. Clipping at 1.0 applies at every step of this run, so the default
# policy (strata.speculation "auto") speculates none: nothing is replayed,
# no update is paid for twice.
"$TRAIN" "${common[@]}" --nvme "$WORK" --device-budget 256KiB --host-budget 8MiB --no-overlap-step >"$WORK/plain.out"
diff "$WORK/b" <(grep -E '^(loss|strata-train weights_hash)' "$WORK/plain.out") || fail "overlapped and --no-overlap-step runs differ"
grep -Eq 'overlapped step +0 steps speculated \(0 committed, 0 replayed, 0 discarded\), 10 not speculated' \
  "$WORK/offload.out" ||
  { grep 'overlapped step' "$WORK/offload.out" >&2; fail "the default run, clipped at every step, speculated"; }
grep -Eq 'overlapped step +off' "$WORK/plain.out" || fail "--no-overlap-step did not say it is off"
echo "ok: overlapped == --no-overlap-step ($(grep -o '[0-9]* committed, [0-9]* replayed' "$WORK/offload.out"))"
echo '{"gradient_clipping": 0.0}' >"$WORK/noclip.json"
for m in overlap plain; do
  "$TRAIN" "${common[@]}" --nvme "$WORK" --device-budget 256KiB --config "$WORK/noclip.json" \
    $([ $m = plain ] && echo --no-overlap-step) >"$WORK/noclip-$m.out"
done
diff <(grep -E '^(loss|strata-train weights_hash)' "$WORK/noclip-overlap.out") \
     <(grep -E '^(loss|strata-train weights_hash)' "$WORK/noclip-plain.out") || fail "unclipped: overlapped and --no-overlap-step differ"
# Unclipped: every step after the first (no evidence yet) speculates and commits.
grep -Eq 'overlapped step +9 steps speculated \(9 committed, 0 replayed, 0 discarded\), 1 not speculated' \
  "$WORK/noclip-overlap.out" ||
  { grep 'overlapped step' "$WORK/noclip-overlap.out" >&2; fail "unclipped: not every step after the first committed"; }
echo "ok: unclipped overlapped == --no-overlap-step (9 committed)"

# The default device budget follows the preset: medium's blocks (1.77 M parameters, 3.4 MiB
# of bf16) do not fit the 2 MiB that suits the small preset, so it must grow to two of them.
"$TRAIN" --preset medium --steps 1 --batch 1 --seq 16 --nvme "$WORK" >"$WORK/medium.out" 2>&1 ||
  { cat "$WORK/medium.out" >&2; fail "the medium preset does not run on the default device budget"; }
grep -Eq 'device +budget +7\.0 MiB' "$WORK/medium.out" || { cat "$WORK/medium.out" >&2; fail "medium's default device budget is not 7 MiB"; }
echo "ok: the medium preset runs on its default device budget (7 MiB)"

"$TRAIN" --preset tiny --steps 60 --print-every 100 >"$WORK/learn.out"
last=$(sed -n 's/.*last_loss=\([0-9.]*\).*/\1/p' "$WORK/learn.out")
/usr/bin/python3 -c "import sys; sys.exit(0 if float('$last') < 3.0 else 1)" || fail "loss $last not below 3.0 after 60 steps"
echo; echo "ok: loss $last < 3.0 after 60 steps"

fpx=(--preset tiny --fp16 --log-losses --weights-hash --print-every 100 --nvme "$WORK" --device-budget 256KiB)
fp=("${fpx[@]}" --steps 12)
"$TRAIN" "${fp[@]}" >"$WORK/whole.out"
"$TRAIN" "${fpx[@]}" --steps 10 --save "$WORK/ckpt" --save-every 5 >/dev/null
[ "$(ls "$WORK/ckpt" | grep -c '^step')" -eq 2 ] || fail "--save-every 5 over 10 steps: not 2 checkpoints"
# Resume from step 10's checkpoint (the latest) to step 12.
"$TRAIN" "${fp[@]}" --resume "$WORK/ckpt" >"$WORK/resumed.out"
grep -q 'resumed from .* at step 10' "$WORK/resumed.out" || fail "did not resume at step 10"
grep -E '^loss (11|12) ' "$WORK/whole.out" >"$WORK/c"
grep -E '^loss ' "$WORK/resumed.out" >"$WORK/d"
diff "$WORK/c" "$WORK/d" || fail "resumed losses differ"
diff <(grep weights_hash "$WORK/whole.out") <(grep weights_hash "$WORK/resumed.out") || fail "resumed weights differ"
echo "ok: resume == continuous"
# fp16 loss scaling under the overlapped step: the same as without it.
"$TRAIN" "${fp[@]}" --no-overlap-step >"$WORK/whole-plain.out"
diff <(grep -E '^(loss|strata-train weights_hash)' "$WORK/whole.out") \
     <(grep -E '^(loss|strata-train weights_hash)' "$WORK/whole-plain.out") || fail "fp16: overlapped and --no-overlap-step differ"
echo "ok: fp16 overlapped == --no-overlap-step"

# strata.state_format compact: resident == offloaded, resume == continuous.
mkdir -p "$WORK/cnvme"
cfx=(--preset tiny --state-format compact --log-losses --weights-hash --print-every 100)
cf=("${cfx[@]}" --steps 12)
"$TRAIN" "${cf[@]}" --resident >"$WORK/cres.out"
"$TRAIN" "${cf[@]}" --nvme "$WORK/cnvme" --device-budget 256KiB --host-budget 8MiB >"$WORK/cwhole.out"
diff <(grep -E '^(loss|strata-train weights_hash)' "$WORK/cres.out") \
     <(grep -E '^(loss|strata-train weights_hash)' "$WORK/cwhole.out") || fail "compact: resident and offloaded differ"
cmp -s <(grep weights_hash "$WORK/cwhole.out") <(grep weights_hash "$WORK/resident.out") && fail "compact gave fp32's weights"
"$TRAIN" "${cfx[@]}" --steps 10 --nvme "$WORK/cnvme" --device-budget 256KiB --host-budget 8MiB --save "$WORK/cckpt" --save-every 5 >/dev/null
"$TRAIN" "${cf[@]}" --nvme "$WORK/cnvme" --device-budget 256KiB --host-budget 8MiB --resume "$WORK/cckpt" >"$WORK/cres2.out"
diff <(grep -E '^loss (11|12) ' "$WORK/cwhole.out") <(grep -E '^loss ' "$WORK/cres2.out") || fail "compact: resumed losses differ"
diff <(grep weights_hash "$WORK/cwhole.out") <(grep weights_hash "$WORK/cres2.out") || fail "compact: resumed weights differ"
# The banner's state follows --state-format: bf16 P, W, M, V, G are 18 bytes
# a parameter in fp32 state, about 11.25 compact (it said 18 for both).
/usr/bin/python3 - "$WORK/cwhole.out" "$WORK/offload.out" <<'PY' || fail "the banner's state bytes"
import re, sys
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
def per_param(path):
    m = re.search(r"preset \w+, (\d+) parameters, ([\d.]+) (B|KiB|MiB|GiB) of state", open(path).read())
    assert m, f"no banner in {path}"
    return float(m.group(2)) * units[m.group(3)] / int(m.group(1))
c, f = per_param(sys.argv[1]), per_param(sys.argv[2])
# (the banner rounds to a tenth of its unit: within 3%)
assert abs(c / 11.25 - 1) < 0.03 and abs(f / 18 - 1) < 0.03, f"state bytes a parameter: compact {c:.2f}, fp32 {f:.2f}"
PY
echo "ok: compact resident == offloaded, resume == continuous; the banner's state bytes follow the format"

# --save alone checkpoints after the last step, with the tensors' shapes:
# strata-export writes them as torch holds them.
"$TRAIN" --preset tiny --steps 2 --print-every 100 --nvme "$WORK" --save "$WORK/last" >/dev/null
[ -d "$WORK/last/step00000002" ] || fail "--save alone wrote no checkpoint after the last step"
"$EXPORT" "$WORK/last" "$WORK/last.safetensors" >/dev/null || fail "strata-export of the checkpoint"
/usr/bin/python3 - "$WORK/last.safetensors" <<'PY' || fail "exported shapes"
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
head = json.loads(raw[8:8 + n])
shapes = {k: v["shape"] for k, v in head.items() if k != "__metadata__"}
c = shapes["h0.ln1.weight"][0]
assert shapes["h0.attn.qkv.weight"] == [3 * c, c], shapes["h0.attn.qkv.weight"]
assert shapes["h0.attn.qkv.bias"] == [3 * c], shapes["h0.attn.qkv.bias"]
assert all(len(s) in (1, 2) for s in shapes.values()), shapes
print("ok: exported shapes", shapes["h0.attn.qkv.weight"], shapes["h0.ln1.weight"])
PY
# --save-every N saves after the last step too; what would train nothing, or
# ignore a flag, is refused before the engine is built, naming it.
"$TRAIN" --preset tiny --steps 6 --print-every 100 --nvme "$WORK" --save "$WORK/every" --save-every 4 >/dev/null
[ -d "$WORK/every/step00000004" ] && [ -d "$WORK/every/step00000006" ] ||
  { ls "$WORK/every" >&2; fail "--save-every 4 over 6 steps: not steps 4 and 6"; }
refused() {  # WORDS ARGS...: strata-train ARGS fails, saying WORDS
  local words=$1 rc=0
  shift
  "$TRAIN" --preset tiny --print-every 100 "$@" >"$WORK/refused.out" 2>&1 || rc=$?
  [ "$rc" -ne 0 ] && grep -q -- "$words" "$WORK/refused.out" ||
    { cat "$WORK/refused.out" >&2; fail "strata-train $* (rc $rc) was not refused saying '$words'"; }
}
refused "--save" --steps 2 --save-every 1
refused "--save" --steps 2 --keep-last 1
# --keep-last 2: after every save only the newest two of the run's
# checkpoints are left (a long run filled the disk), another tag untouched;
# the newest resumes.
mkdir -p "$WORK/keep/mine"
"$TRAIN" --preset tiny --steps 6 --print-every 100 --nvme "$WORK" --save "$WORK/keep" --save-every 1 --keep-last 2 \
  >"$WORK/keep.out" || { cat "$WORK/keep.out" >&2; fail "--keep-last 2"; }
[ "$(cd "$WORK/keep" && ls | tr '\n' ' ')" = "latest mine step00000005 step00000006 " ] ||
  { ls -la "$WORK/keep" >&2; fail "--keep-last 2 over 6 saves: not the newest two left (and mine)"; }
grep -q 'removed 1 older checkpoint(s), the last step00000004' "$WORK/keep.out" || { cat "$WORK/keep.out" >&2; fail "--keep-last not said"; }
"$TRAIN" --preset tiny --steps 7 --print-every 100 --nvme "$WORK" --resume "$WORK/keep" >"$WORK/keep-resume.out" ||
  fail "resume after --keep-last"
grep -q 'resumed from .* at step 6' "$WORK/keep-resume.out" || fail "did not resume at step 6 after --keep-last"
refused "leaves nothing to train" --steps 6 --nvme "$WORK" --resume "$WORK/every"
refused "no such folder" --steps 2 --resume "$WORK/nowhere"
refused "excludes" --steps 2 --resident --nvme "$WORK"
refused "excludes" --steps 2 --resident --device-budget 1MiB
refused "finite" --steps 2 --lr nan
echo "ok: --save-every saves the last step; a resume past --steps, --save-every without --save, --resident with budgets, --lr nan refused"

# A batch whose activations cannot fit this host is refused before the build
# (it was a bad_alloc or the OOM killer after it), naming them: the gpt2
# preset at 65536 x 1024 tokens wants terabytes on any machine. Over two
# ranks where only rank 0 is short (it counts two ranks on its host, each
# wanting 0.55x the host's memory as the tool reports it), both refuse at
# once, naming rank 0 (rank 1 does not wait in the build).
rc=0
"$TRAIN" --preset gpt2 --seq 1024 --batch 65536 --steps 2 --print-every 100 >"$WORK/huge.out" 2>&1 || rc=$?
[ "$rc" = 1 ] && grep -q "the model's activations and buffers take .* a rank (65536 sequences)" "$WORK/huge.out" ||
  { cat "$WORK/huge.out" >&2; fail "the terabyte batch was not refused naming the activations (rc $rc)"; }
grep -q 'building the engine\|built in' "$WORK/huge.out" && { cat "$WORK/huge.out" >&2; fail "the oversized batch was refused after the build"; }
read -r per_seq ram < <(/usr/bin/python3 - "$WORK/huge.out" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
def size(m): return float(m.group(1)) * units[m.group(2)]
need = size(re.search(r"buffers take ([0-9.]+) (\w+) a rank \(65536 sequences", t))
ram = size(re.search(r"the host has ([0-9.]+) (\w+) of memory", t))
print(need / 65536, ram)
PY
)
half=$(/usr/bin/python3 -c "import sys; print(int(0.55 * float(sys.argv[2]) / float(sys.argv[1])) + 1)" "$per_seq" "$ram")
[ "$half" -ge 1 ] && [ "$half" -le 32768 ] || fail "cannot size the two-rank batch: $half sequences a rank"
port=$(/usr/bin/python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=$((2 - r)) MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout -k 5 120 "$TRAIN" --preset gpt2 --seq 1024 --steps 2 --batch $((2 * half)) --print-every 100 \
    >"$WORK/short$r.out" 2>&1 &
done
for r in 0 1; do
  rc=0; wait -n || rc=$?
  [ "$rc" = 1 ] || { cat "$WORK"/short*.out >&2; fail "a rank of the two-rank oversized batch exited $rc, not 1"; }
done
# (Rank 1 may be named too where this host has less than 0.55x its memory
# free at the moment: other jobs.)
for r in 0 1; do
  grep -q "rank $r of 2: --batch $((2 * half)) x --seq 1024: .*rank 0: [0-9.]* [KMGT]iB needed" "$WORK/short$r.out" ||
    { cat "$WORK/short$r.out" >&2; fail "rank $r did not name rank 0's shortfall"; }
done
echo "ok: a batch too large for the host is refused before the build, by every rank, naming the rank short of it"

# The CPU kernels' path (STRATA_CPU_ISA) never changes a bit, end to end:
# 6 offloaded steps in fp32 and compact state on every path this CPU has
# (CI machines differ: AVX-512, AVX2 only; each kernel is compared with
# scalar in its own test, this is the whole run).
isa_hash() { sed -n 's/^strata-train weights_hash=//p' "$WORK/$1.out"; }
isa_args=(--preset tiny --steps 6 --weights-hash --print-every 100 --nvme "$WORK" --device-budget 256KiB --host-budget 8MiB)
for fmt in fp32 compact; do
  STRATA_CPU_ISA=scalar "$TRAIN" "${isa_args[@]}" --state-format $fmt >"$WORK/isa-scalar-$fmt.out" ||
    fail "STRATA_CPU_ISA=scalar, $fmt"
  for isa in avx2 avx512; do
    rc=0
    STRATA_CPU_ISA=$isa "$TRAIN" "${isa_args[@]}" --state-format $fmt >"$WORK/isa-$isa-$fmt.out" 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then
      grep -q 'UNSUPPORTED' "$WORK/isa-$isa-$fmt.out" || { cat "$WORK/isa-$isa-$fmt.out" >&2; fail "STRATA_CPU_ISA=$isa, $fmt"; }
      echo "note: this CPU has no $isa path: not compared"
      continue
    fi
    [ "$(isa_hash "isa-$isa-$fmt")" = "$(isa_hash "isa-scalar-$fmt")" ] && [ -n "$(isa_hash "isa-scalar-$fmt")" ] ||
      fail "STRATA_CPU_ISA=$isa trains other bits than scalar ($fmt): $(isa_hash "isa-$isa-$fmt") against $(isa_hash "isa-scalar-$fmt")"
    echo "ok: STRATA_CPU_ISA=$isa == scalar, $fmt: $(isa_hash "isa-scalar-$fmt")"
  done
done

# --config's optimizer.params.lr is the schedule's peak where --lr is not
# given (it was ignored: --lr's default won); a --lr given wins, saying so.
short=(--preset tiny --steps 3 --weights-hash --print-every 100 --resident)
hash_of() { sed -n 's/^strata-train weights_hash=//p' "$WORK/$1.out"; }
echo '{"optimizer": {"params": {"lr": 0.001}}}' >"$WORK/lr.json"
echo '{"optimizer": {"params": {"lr": 0.01}}}' >"$WORK/lr2.json"
"$TRAIN" "${short[@]}" --config "$WORK/lr.json" >"$WORK/lr-config.out"
"$TRAIN" "${short[@]}" --lr 0.001 >"$WORK/lr-flag.out"
"$TRAIN" "${short[@]}" >"$WORK/lr-default.out"
"$TRAIN" "${short[@]}" --lr 0.001 --config "$WORK/lr2.json" >"$WORK/lr-both.out"
[ -n "$(hash_of lr-config)" ] && [ "$(hash_of lr-config)" = "$(hash_of lr-flag)" ] ||
  fail "--config's lr 0.001 did not train as --lr 0.001 ($(hash_of lr-config) against $(hash_of lr-flag))"
[ "$(hash_of lr-config)" != "$(hash_of lr-default)" ] || fail "--config's lr 0.001 trained as the default lr"
[ "$(hash_of lr-both)" = "$(hash_of lr-flag)" ] || fail "--lr 0.001 did not win over --config's lr 0.01"
grep -q "^strata-train: --lr 0.001 overrides --config's optimizer.params.lr 0.01" "$WORK/lr-both.out" ||
  fail "--lr over --config's lr was not said: $(head -3 "$WORK/lr-both.out")"
refused "optimizer.params.lr must be a finite number" --steps 1 --resident --config <(echo '{"optimizer": {"params": {"lr": -1}}}')
# The flags given win over --config's keys (they lost without a word: a
# strata-plan --write-config file names every key), each said; the built-in
# values the file changes are said too; what strata-train does not do
# (a scheduler, gradient accumulation, another batch) is refused.
cat >"$WORK/over.json" <<'JSON'
{"fp16": {"enabled": false}, "bf16": {"enabled": true}, "gradient_clipping": 1.0,
 "strata": {"trace_path": "", "state_format": "compact", "host_budget": "auto", "device_budget": "auto"},
 "zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/nonexistent"},
                       "offload_optimizer": {"device": "nvme", "nvme_path": "/nonexistent"}}}
JSON
flags=(--preset tiny --steps 3 --weights-hash --print-every 100 --fp16 --state-format fp32 --device-budget 256KiB
       --host-budget 8MiB --nvme "$WORK")
"$TRAIN" "${flags[@]}" --trace "$WORK/over-trace.json" --config "$WORK/over.json" >"$WORK/over.out" 2>&1 ||
  { cat "$WORK/over.out" >&2; fail "the flags over --config's keys did not run"; }
"$TRAIN" "${flags[@]}" >"$WORK/over-flags.out"
[ -n "$(hash_of over)" ] && [ "$(hash_of over)" = "$(hash_of over-flags)" ] ||
  { cat "$WORK/over.out" >&2; fail "the flags given did not win over --config's keys"; }
[ -s "$WORK/over-trace.json" ] || fail "--trace lost to --config's strata.trace_path \"\""
for said in "--fp16 overrides --config's fp16.enabled false" "--fp16 overrides --config's bf16.enabled true" \
  "--state-format overrides --config's strata.state_format \"compact\"" "--trace overrides --config's strata.trace_path" \
  "--device-budget overrides --config's strata.device_budget \"auto\"" "--host-budget overrides --config's strata.host_budget" \
  "--nvme overrides --config's zero_optimization.offload_param.nvme_path \"/nonexistent\""; do
  grep -qF -- "strata-train: $said" "$WORK/over.out" || { cat "$WORK/over.out" >&2; fail "not said: $said"; }
done
echo '{"gradient_clipping": 0, "optimizer": {"params": {"betas": [0.9, 0.999]}}}' >"$WORK/defaults.json"
"$TRAIN" "${short[@]}" --config "$WORK/defaults.json" >"$WORK/defaults.out"
grep -qF "strata-train: --config changes strata-train's gradient_clipping 1.0 to 0" "$WORK/defaults.out" &&
  grep -qF "strata-train: --config changes strata-train's optimizer.params.betas [0.9,0.95] to [0.9,0.999]" "$WORK/defaults.out" ||
  { cat "$WORK/defaults.out" >&2; fail "the built-in values --config changes were not said"; }
refused "gradient_accumulation_steps 8: strata-train takes one micro-batch" --steps 1 --resident --config <(echo '{"gradient_accumulation_steps": 8}')
refused "train_batch_size 16: strata-train takes 8 sequences" --steps 1 --resident --config <(echo '{"train_batch_size": 16}')
refused "train_micro_batch_size_per_gpu 2: strata-train trains 8 sequences" --steps 1 --resident --config <(echo '{"train_micro_batch_size_per_gpu": 2}')
refused "scheduler: strata-train runs its own schedule" --steps 1 --resident --config <(echo '{"scheduler": {"type": "WarmupLR"}}')
"$TRAIN" "${short[@]}" --config <(echo '{"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, "scheduler": null}') \
  >"$WORK/agree.out" || fail "--config's batch keys agreeing with --batch were refused"
echo "ok: the flags given win over --config's keys, saying so; built-in values changed by --config said; a scheduler, accumulation or another batch refused"
# A "strata" section that --config makes "auto" or null is the engine's
# default one: the activations' swap folder joins it (it crashed), and the
# flags given (--offload-activations, --trace) still hold.
for v in auto null; do
  echo "{\"strata\": $([ $v = auto ] && echo '"auto"' || echo null)}" >"$WORK/strata.json"
  "$TRAIN" "${short[@]}" --offload-activations nvme --trace "$WORK/trace-$v.json" --config "$WORK/strata.json" \
    >"$WORK/strata-$v.out" 2>&1 ||
    { cat "$WORK/strata-$v.out" >&2; fail "--config {\"strata\": $v} with --offload-activations nvme"; }
  [ "$(hash_of "strata-$v")" = "$(hash_of lr-default)" ] || fail "--config {\"strata\": $v} changed the run"
  [ -s "$WORK/trace-$v.json" ] || fail "--config {\"strata\": $v} dropped --trace"
  grep -Eq '^  activations .*redeemed' "$WORK/strata-$v.out" || fail "--config {\"strata\": $v} dropped --offload-activations"
done
echo "ok: --config's lr drives the schedule, --lr wins saying so; \"strata\": \"auto\" or null with --offload-activations nvme"

# --offload-activations nvme: each block's input through the engine's
# activation store (a 2-stash host arena, the rest on NVMe, read ahead of
# backward), bitwise the run that keeps them (issue 34).
"$TRAIN" --preset small --steps 3 --batch 32 --seq 128 --print-every 100 --weights-hash --log-losses \
  --nvme "$WORK" --host-budget 64MiB >"$WORK/keep.out"
"$TRAIN" --preset small --steps 3 --batch 32 --seq 128 --print-every 100 --weights-hash --log-losses \
  --nvme "$WORK" --host-budget 64MiB --offload-activations nvme >"$WORK/acts.out"
diff <(grep -E '^(loss|strata-train weights_hash)' "$WORK/keep.out") \
     <(grep -E '^(loss|strata-train weights_hash)' "$WORK/acts.out") || fail "--offload-activations nvme changed the run"
grep -Eq 'activations .* [1-9][0-9.]* [KMG]iB sent to NVMe; 12 redeemed' "$WORK/acts.out" ||
  { grep 'activations' "$WORK/acts.out" >&2; fail "--offload-activations nvme sent nothing to NVMe"; }
echo "ok: --offload-activations nvme == keeping them ($(grep -o '[0-9.]* [KMG]iB sent to NVMe' "$WORK/acts.out"))"

# SIGINT: the run stops at the end of the step in flight, saves a checkpoint
# there (--save), removes the swap folder it made (no --nvme) and exits 130;
# --resume goes on from it bitwise. In warm-up the lr does not depend on
# --steps, so a run of S + 2 steps is the continuous reference.
sig=(--preset tiny --fp16 --log-losses --print-every 1 --warmup 1000000 --device-budget 256KiB --host-budget 8MiB)
set -m  # (job control: a background job of a script ignores SIGINT otherwise, and strata-train keeps it so)
"$TRAIN" "${sig[@]}" --steps 1000000 --save "$WORK/int" >"$WORK/int.out" 2>&1 &
pid=$!
set +m
for _ in $(seq 1 1200); do grep -q '^loss 3 ' "$WORK/int.out" && break; sleep 0.05; done
kill -INT "$pid"
rc=0; wait "$pid" || rc=$?
[ "$rc" -eq 130 ] || { cat "$WORK/int.out" >&2; fail "SIGINT: exit $rc, not 130"; }
S=$(sed -n 's/^strata-train: stopped by a signal after step \([0-9]*\) of .*/\1/p' "$WORK/int.out")
[ -n "$S" ] && [ "$S" -ge 3 ] || { cat "$WORK/int.out" >&2; fail "SIGINT: no stop line naming a step of 3 or more"; }
own=$(sed -n 's/.*state on NVMe in \(\/var\/tmp\/strata-train-[A-Za-z0-9]*\).*/\1/p' "$WORK/int.out")
[ -n "$own" ] || { cat "$WORK/int.out" >&2; fail "SIGINT: the run made no swap folder of its own"; }
[ ! -e "$own" ] || fail "SIGINT: the swap folder $own was left behind"
[ -d "$WORK/int/step$(printf %08d "$S")" ] || fail "SIGINT: no checkpoint at step $S: $(ls "$WORK/int")"
"$TRAIN" "${sig[@]}" --steps $((S + 2)) --resume "$WORK/int" >"$WORK/int-resumed.out"
"$TRAIN" "${sig[@]}" --steps $((S + 2)) >"$WORK/int-whole.out"
diff <(grep '^loss ' "$WORK/int-whole.out") <(grep '^loss ' "$WORK/int.out" "$WORK/int-resumed.out" -h) ||
  fail "SIGINT at step $S, then --resume: not the continuous run"
echo "ok: SIGINT stops after step $S, saved, its swap folder removed, exit 130; --resume == continuous"
echo "1 passed, 0 failed"

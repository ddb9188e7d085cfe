#!/usr/bin/env bash
# Ranks on separate hosts (network namespaces, tests/hosts/hosts.sh), with
# strata-train. Every rank's swap folder is its host's own; checkpoints go to
# one folder every host sees. Modes:
#   launch   the hosts are isolated (no route out); 4 hosts x 1 rank and 2 hosts
#            x 2 ranks through strata-launch --nnodes, and 2 x 2 started directly
#            under Slurm's, OpenMPI's and torchrun-style NODE_RANK variables:
#            bitwise the weights of 4 ranks on one host
#   exact    2 hosts x 2 ranks == 4 ranks on one host, bitwise (weights and
#            every step's loss), at ZeRO stages 0-3, state_format fp32 and
#            compact, state on NVMe; one host's ranks share memory for their
#            collectives, two hosts' take TCP (and say why)
#   lossy    links with 2 ms delay and 1% loss each way (tc netem, or
#            link_switch.py where the kernel lacks netem): the same bits; the
#            step time on clean and lossy links is printed (not compared)
#   cut      a link cut mid-step: every rank on both hosts exits 1 within
#            strata.timeout + MARGIN, naming the collective and the peers lost
#   kill     a host killed mid-step (SIGKILL to all its processes): the other
#            host's ranks fail the same way; their last checkpoint is bitwise
#            the one a clean run saved at that step, and training resumes from it
#   resume   a checkpoint of 2 hosts x 2 ranks resumes on 1 host x 2 ranks and
#            on 3 hosts x 1 rank (resharded), bitwise as a resume at that world
#            size on one host over loopback; with host-local checkpoint folders
#            (the same path, each host's own disk) the save fails on every rank
#   torch    strata.torch.offload_module (stage 3, NVMe, fp32 and compact) on 2
#            hosts x 2 ranks under torchrun --nnodes 2 == torchrun on one host
#            with 4 ranks, bitwise (skipped without torch's torchrun)
#   elastic  torchrun --nnodes 1:2 --max_restarts (c10d rendezvous) on 2 hosts x 2
#            ranks: host 1 is killed mid-run, host 0's torchrun restarts its
#            ranks as a world of 2, which resume from the shared checkpoint
#            (resharded) and finish bitwise as a resume of that checkpoint on
#            2 ranks over loopback (skipped without torchrun or unshare)
#   addr     two interfaces a host: Gloo follows the route to the master, or
#            STRATA_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (checked by the
#            interfaces' byte counters); an unknown interface, an unreachable
#            master and a port in use are errors naming them
# Skips (77) when not root or when the kernel refuses namespaces. The addr and
# torch modes use the Python binding: STRATA_LIBRARY and PYTHONPATH set (ctest
# sets them).
# Usage: hosts_test.sh MODE STRATA_TRAIN STRATA_LAUNCH STRATA_EXPORT
set -euo pipefail
MODE=${1:?usage: hosts_test.sh MODE STRATA_TRAIN STRATA_LAUNCH STRATA_EXPORT}
TRAIN=${2:?strata-train}
LAUNCH=${3:?strata-launch}
EXPORT=${4:?strata-export}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/hosts.sh"
PY=/usr/bin/python3
PORT=29500      # every run has its own network stacks: a fixed port never collides
TIMEOUT_S=10    # strata.timeout in the fault cases: it also bounds the 4-rank rendezvous and every
                # collective before the fault, so it must outlast a slow step on a loaded machine
MARGIN_S=10     # fail within TIMEOUT_S + MARGIN_S: a step in flight, a probe after the failure (<= 1 s), the exit
GUARD_S=120     # a rank still running after this is killed and the test fails (a hang)
WORK=$(mktemp -d "/var/tmp/strata-hosts-test-st$$-XXXXXX")  # named for hosts_sweep
HOSTS_EXTRA_CLEANUP='rm -rf "$WORK"'
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
now() { date +%s.%N; }
elapsed() { "$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$1" "$2"; }

# config FILE STAGE [TIMEOUT]: optimizer state on NVMe; at stage 3 the
# parameters too (below it every rank keeps all parameters, in host memory).
config() {
  local params='"nvme"'
  [ "$2" -lt 3 ] && params='"cpu"'
  printf '{"zero_optimization": {"stage": %s, "offload_param": {"device": %s}, "offload_optimizer": {"device": "nvme"}}, "strata": {"timeout": %s}}\n' \
    "$2" "$params" "${3:-30}" >"$1"
}

# on_hosts NHOSTS NPROC OUT ARGS...: strata-launch --nnodes on every host,
# each with its own swap folder; host i's output in OUT.h<i>.
on_hosts() {
  local nh=$1 np=$2 out=$3 i rc=0 pids=()
  shift 3
  for ((i = 0; i < nh; i++)); do
    hosts_exec "$i" timeout -k 5 "$GUARD_S" "$LAUNCH" --nnodes "$nh" --node-rank "$i" --nproc "$np" \
      --master-addr "$(hosts_addr 0)" --master-port "$PORT" -- "$TRAIN" "$@" --nvme "$HOSTS_DIR/h$i/swap" \
      >"$out.h$i" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [ "$rc" = 0 ] || { tail -n 5 "$out".h* >&2; return 1; }
}

# local_ranks N OUT ARGS...: N ranks on this machine over loopback (no namespaces).
local_ranks() {
  local n=$1 out=$2
  shift 2
  mkdir -p "$WORK/local-swap"
  timeout -k 5 "$GUARD_S" "$LAUNCH" --nproc "$n" --master-port 0 -- "$TRAIN" "$@" --nvme "$WORK/local-swap" >"$out" 2>&1 ||
    { tail -n 5 "$out" >&2; return 1; }
}

# result FILE: rank 0's loss lines and weights hash, without the launcher's prefix.
result() { sed 's/^\[rank 0\] //' "$1" | grep -E '^(loss |strata-train weights_hash)' || true; }

# same WHAT A B: A's and B's results are identical and not empty.
same() {
  local a b
  a=$(result "$2")
  b=$(result "$3")
  [ -n "$a" ] && grep -q weights_hash <<<"$a" || fail "$1: no result in $2"
  [ "$a" = "$b" ] || { diff <(echo "$a") <(echo "$b") >&2; fail "$1: differs"; }
  echo "ok: $1: $(grep -c '^loss ' <<<"$a") losses and $(grep -o 'weights_hash=.*' <<<"$a") bitwise equal"
}

# rank_env FAMILY RANK NHOSTS NPROC: the variables a launcher of FAMILY gives RANK.
rank_env() {
  local f=$1 r=$2 nh=$3 np=$4 h=$(($2 / $4)) l=$(($2 % $4)) w=$(($3 * $4)) m
  m=$(hosts_addr 0)
  case $f in
    torchrun) echo "RANK=$r WORLD_SIZE=$w LOCAL_RANK=$l LOCAL_WORLD_SIZE=$np GROUP_RANK=$h GROUP_WORLD_SIZE=$nh MASTER_ADDR=$m MASTER_PORT=$PORT" ;;
    node) echo "NODE_RANK=$h WORLD_SIZE=$w LOCAL_RANK=$l LOCAL_WORLD_SIZE=$np MASTER_ADDR=$m MASTER_PORT=$PORT" ;;
    slurm) echo "SLURM_PROCID=$r SLURM_NTASKS=$w SLURM_LOCALID=$l SLURM_NODEID=$h SLURM_NNODES=$nh SLURM_NTASKS_PER_NODE=$np SLURM_JOB_NODELIST=testhost[0-$((nh - 1))] SLURM_STEP_NODELIST=testhost[0-$((nh - 1))] SLURM_LAUNCH_NODE_IPADDR=$m MASTER_ADDR=$m MASTER_PORT=$PORT" ;;
    openmpi) echo "OMPI_COMM_WORLD_RANK=$r OMPI_COMM_WORLD_SIZE=$w OMPI_COMM_WORLD_LOCAL_RANK=$l OMPI_COMM_WORLD_LOCAL_SIZE=$np MASTER_ADDR=$m MASTER_PORT=$PORT" ;;
    *) fail "unknown family $f" ;;
  esac
}

# start_ranks FAMILY NHOSTS NPROC DIR ARGS...: every rank started directly on
# its host (no launcher) with FAMILY's variables, in the background. DIR/r<k>
# is rank k's output, DIR/r<k>.end "EXIT_CODE END_TIME" once it exited.
start_ranks() {
  local f=$1 nh=$2 np=$3 dir=$4 r h
  shift 4
  mkdir -p "$dir"
  RANK_PIDS=()
  for ((r = 0; r < nh * np; r++)); do
    h=$((r / np))
    # shellcheck disable=SC2046
    (
      set +e
      hosts_exec "$h" timeout -k 2 "$GUARD_S" env $(rank_env "$f" "$r" "$nh" "$np") stdbuf -oL "$TRAIN" "$@" \
        --nvme "$HOSTS_DIR/h$h/swap" >"$dir/r$r" 2>&1
      echo "$? $(now)" >"$dir/r$r.end"
    ) &
    RANK_PIDS+=($!)
  done
}
wait_ranks() { for p in "${RANK_PIDS[@]}"; do wait "$p" || true; done; }

# all_ok DIR N: every rank of a direct start exited 0.
all_ok() {
  local r code t
  for ((r = 0; r < $2; r++)); do
    read -r code t <"$1/r$r.end"
    [ "$code" = 0 ] || { tail -n 5 "$1/r$r" >&2; fail "rank $r exited $code"; }
  done
}

# wait_for FILE PATTERN: until FILE has a line matching PATTERN (at most GUARD_S).
wait_for() {
  local i
  for ((i = 0; i < GUARD_S * 20; i++)); do
    grep -qE "$2" "$1" 2>/dev/null && return 0
    sleep 0.05
  done
  fail "no line '$2' in $1 within $GUARD_S s"
}

# The message a rank printed: its "strata-train rank K of N: ..." line.
message() { grep -m1 '^strata-train rank [0-9]* of [0-9]*: ' "$1" || echo "(no message)"; }

# check_failure DIR RANK T0 LOST...: rank RANK exited 1 (not a signal, not the
# guard) within TIMEOUT_S + MARGIN_S of T0, naming a gloo collective and, as
# lost, each rank in LOST. Prints its time and message.
check_failure() {
  local dir=$1 r=$2 t0=$3 code t dt msg k
  shift 3
  [ -e "$dir/r$r.end" ] || fail "rank $r has no exit record"
  read -r code t <"$dir/r$r.end"
  dt=$(elapsed "$t0" "$t")
  msg=$(message "$dir/r$r")
  echo "rank $r: exit $code after $dt s: $msg"
  [ "$code" != 124 ] && [ "$code" != 137 ] || fail "rank $r hung (stopped by the guard after $GUARD_S s)"
  [ "$code" -lt 128 ] || fail "rank $r was killed by signal $((code - 128))"
  [ "$code" = 1 ] || fail "rank $r exited $code, not 1"
  "$PY" -c "import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) else 1)" "$dt" "$((TIMEOUT_S + MARGIN_S))" ||
    fail "rank $r took $dt s to fail, more than strata.timeout $TIMEOUT_S s + $MARGIN_S s"
  grep -Eq 'gloo (all_reduce|reduce_scatter|all_gather|broadcast|barrier) #[0-9]+ ' <<<"$msg" ||
    fail "rank $r does not name the collective: $msg"
  for k in "$@"; do
    grep -Eq "lost peers? .*rank $k at [0-9.]+:[0-9]+ \(" <<<"$msg" || fail "rank $r does not name rank $k as lost: $msg"
  done
}

# tx_bytes HOST IFACE: bytes the interface has sent.
tx_bytes() {
  hosts_exec "$1" cat "/sys/class/net/$2/statistics/tx_bytes"
}

# step_ms FILE: rank 0's steady-state step time from its summary line.
step_ms() {
  local tps
  tps=$(sed -n 's/.*tokens_per_s=\([0-9.]*\).*/\1/p' "$1" | tail -1)
  "$PY" -c "import sys; print(f'{12 * 64 / float(sys.argv[1]) * 1000:.1f}')" "${tps:-0.000001}"
}

args=(--preset tiny --batch 12 --log-losses --weights-hash --print-every 1000)

case "$MODE" in
launch)
  hosts_up 4
  # No way out: only the test subnet is routed, the outside is unreachable.
  routes=$(ip -n "$(hosts_ns 1)" route show)
  [ "$routes" = "10.213.0.0/25 dev eth0 proto kernel scope link src 10.213.0.2 " ] || fail "host 1's routes: $routes"
  out=$(hosts_exec 1 bash -c 'exec 3<>/dev/tcp/192.0.2.1/80' 2>&1 || true)
  grep -q 'Network is unreachable' <<<"$out" || fail "host 1 reaches outside the test subnet: $out"
  echo "ok: the hosts route only 10.213.0.0/25; outside: $(tail -1 <<<"$out" | sed 's/.*: //')"
  config "$WORK/c.json" 3
  run=("${args[@]}" --steps 4 --config "$WORK/c.json")
  local_ranks 4 "$WORK/one" "${run[@]}"
  on_hosts 4 1 "$WORK/four" "${run[@]}"
  grep -q '^\[rank 3\] strata-train: rank 3/4' "$WORK/four.h3" || fail "host 3 does not run rank 3: $(head -3 "$WORK/four.h3")"
  same "4 hosts x 1 rank (strata-launch --nnodes 4) == 4 ranks on one host" "$WORK/one" "$WORK/four.h0"
  on_hosts 2 2 "$WORK/two" "${run[@]}"
  grep -q '^\[rank 2\] strata-train: rank 2/4' "$WORK/two.h1" || fail "host 1 does not run rank 2"
  grep -q '^\[rank 3\] strata-train: rank 3/4' "$WORK/two.h1" || fail "host 1 does not run rank 3"
  same "2 hosts x 2 ranks (strata-launch --nnodes 2) == 4 ranks on one host" "$WORK/one" "$WORK/two.h0"
  for fam in slurm openmpi node; do
    start_ranks "$fam" 2 2 "$WORK/$fam" "${run[@]}"
    wait_ranks
    all_ok "$WORK/$fam" 4
    same "2 hosts x 2 ranks started under $fam variables ($(rank_env "$fam" 3 2 2 | cut -c1-60)...) == 4 ranks on one host" \
      "$WORK/one" "$WORK/$fam/r0"
  done
  echo "6 passed, 0 failed"
  ;;
exact)
  hosts_up 2
  n=0
  declare -A hashes=()
  for fmt in fp32 compact; do
    for stage in 0 1 2 3; do
      config "$WORK/c$stage.json" "$stage"
      run=("${args[@]}" --steps 4 --config "$WORK/c$stage.json" --state-format "$fmt")
      local_ranks 4 "$WORK/one" "${run[@]}"
      on_hosts 2 2 "$WORK/two" "${run[@]}"
      grep -q "ZeRO stage $stage), 4 steps, state on NVMe in $HOSTS_DIR/h0/swap" "$WORK/two.h0" ||
        fail "banner: $(grep -m1 preset "$WORK/two.h0")"
      same "stage $stage $fmt: 2 hosts x 2 ranks == 4 ranks on one host" "$WORK/one" "$WORK/two.h0"
      # Ranks on one host share memory for their collectives; on two hosts
      # (other network namespaces) they take the network, every rank alike.
      grep -q 'ranks share this host: all-gathers and reduce-scatters through shared memory' "$WORK/one" ||
        fail "4 ranks on one host do not share memory: $(grep -m1 'gloo' "$WORK/one")"
      grep -q 'collectives over TCP, not shared memory (rank 0 is on another host' "$WORK/two.h1" ||
        fail "host 1 does not say why it takes TCP: $(grep -m1 'gloo' "$WORK/two.h1")"
      ! grep -q 'through shared memory' "$WORK/two.h0" || fail "2 hosts share memory"
      hashes[$fmt]+="$(result "$WORK/one" | grep -o 'weights_hash=.*') "
      n=$((n + 1))
    done
  done
  # The format took effect (compact rounds the optimizer state: other bits).
  [ "${hashes[fp32]%% *}" != "${hashes[compact]%% *}" ] || fail "compact gave fp32's weights"
  echo "weights per stage 0-3: fp32 ${hashes[fp32]}; compact ${hashes[compact]}"
  echo "$n passed, 0 failed"
  ;;
lossy)
  config "$WORK/c.json" 3
  run=("${args[@]}" --steps 6 --config "$WORK/c.json")
  hosts_up 2
  local_ranks 4 "$WORK/one" "${run[@]}"
  on_hosts 2 2 "$WORK/clean" "${run[@]}"
  same "2 hosts x 2 ranks, clean links (veth, bridge)" "$WORK/one" "$WORK/clean.h0"
  hosts_down
  hosts_up_lossy 2 0 0
  on_hosts 2 2 "$WORK/clean-sw" "${run[@]}"
  [ "$HOSTS_LINKS" = netem ] || echo "note: this kernel has no netem: the links are link_switch.py's (user space)"
  same "2 hosts x 2 ranks, clean links ($HOSTS_LINKS, no delay, no loss)" "$WORK/one" "$WORK/clean-sw.h0"
  hosts_switch_stats
  clean_sw_stats=$HOSTS_SWITCH_STATS
  hosts_down
  hosts_up_lossy 2 2 0.01
  on_hosts 2 2 "$WORK/lossy" "${run[@]}"
  same "2 hosts x 2 ranks, 2 ms delay and 1% loss on each link ($HOSTS_LINKS)" "$WORK/one" "$WORK/lossy.h0"
  if [ "$HOSTS_LINKS" = netem ]; then
    dropped=0
    for i in 0 1; do
      d=$(tc -s -n "$(hosts_ns "$i")" qdisc show dev eth0 | sed -n 's/.*dropped \([0-9]*\).*/\1/p' | head -1)
      dropped=$((dropped + ${d:-0}))
    done
    lossy_stats="netem dropped $dropped packets on the hosts' side"
  else
    hosts_switch_stats
    lossy_stats=$HOSTS_SWITCH_STATS
    dropped=$(sed -n 's/.*dropped \([0-9]*\).*/\1/p' <<<"$lossy_stats")
  fi
  # The loss took place (else the equality above proves nothing about it).
  [ "${dropped:-0}" -gt 0 ] || fail "the lossy links dropped nothing: $lossy_stats"
  echo "links: clean $HOSTS_LINKS: $clean_sw_stats; lossy: $lossy_stats"
  echo "step time (rank 0, steady state, 12 x 64 tokens): clean veth $(step_ms "$WORK/clean.h0") ms," \
    "clean $HOSTS_LINKS $(step_ms "$WORK/clean-sw.h0") ms, 2 ms + 1% loss $(step_ms "$WORK/lossy.h0") ms"
  echo "3 passed, 0 failed"
  ;;
cut | kill)
  hosts_up 2
  config "$WORK/c.json" 3 "$TIMEOUT_S"
  steps=40
  run=("${args[@]}" --steps "$steps" --config "$WORK/c.json")
  saving=()
  [ "$MODE" = kill ] && saving=(--save "$HOSTS_DIR/shared/ckpt" --save-every 2)
  start_ranks torchrun 2 2 "$WORK/ranks" "${run[@]}" "${saving[@]}"
  wait_for "$WORK/ranks/r0" '^loss 7 '
  t0=$(now)
  if [ "$MODE" = cut ]; then
    hosts_cut 1
    echo "cut host 1's link (its switch port down) after rank 0 logged step 7"
  else
    hosts_kill 1
    echo "killed every process on host 1 (SIGKILL) after rank 0 logged step 7"
  fi
  wait_ranks
  if [ "$MODE" = cut ]; then
    for r in 0 1; do check_failure "$WORK/ranks" "$r" "$t0" 2 3; done
    for r in 2 3; do check_failure "$WORK/ranks" "$r" "$t0" 0 1; done
    echo "4 passed, 0 failed"
    exit 0
  fi
  for r in 2 3; do
    read -r code t <"$WORK/ranks/r$r.end"
    [ "$code" = 137 ] || fail "rank $r on the killed host exited $code, not by SIGKILL"
  done
  for r in 0 1; do check_failure "$WORK/ranks" "$r" "$t0" 2 3; done
  # The last checkpoint: complete, bitwise the one a clean run saved at that
  # step, and training resumes from it (on host 0 alone, resharded to 2 ranks).
  last=$(cat "$HOSTS_DIR/shared/ckpt/latest")
  [ -d "$HOSTS_DIR/shared/ckpt/$last" ] || fail "latest names $last, which is not there"
  local_ranks 4 "$WORK/clean" "${run[@]}" --save "$WORK/clean-ckpt" --save-every 2
  "$EXPORT" "$HOSTS_DIR/shared/ckpt/$last" "$WORK/a.safetensors" >/dev/null || fail "strata-export of $last"
  "$EXPORT" "$WORK/clean-ckpt/$last" "$WORK/b.safetensors" >/dev/null || fail "strata-export of the clean $last"
  cmp -s "$WORK/a.safetensors" "$WORK/b.safetensors" || fail "the checkpoint $last differs from the clean run's"
  echo "ok: the survivors' last checkpoint $last exports bitwise as the clean run's $last"
  on_hosts 1 2 "$WORK/resumed" "${run[@]}" "${saving[@]}" --resume "$HOSTS_DIR/shared/ckpt"
  grep -q "resumed from $HOSTS_DIR/shared/ckpt at step $((10#${last#step}))\$" "$WORK/resumed.h0" ||
    fail "did not resume from $last: $(grep -m1 resumed "$WORK/resumed.h0")"
  echo "ok: $(sed 's/^\[rank 0\] //' "$WORK/resumed.h0" | grep -m1 'resumed from'), on 1 host x 2 ranks, to step $steps"
  echo "4 passed, 0 failed"
  ;;
resume)
  hosts_up 3
  n=0
  for case in 3:fp32 1:compact; do
    IFS=: read -r stage fmt <<<"$case"
    config "$WORK/c.json" "$stage"
    run=("${args[@]}" --config "$WORK/c.json" --state-format "$fmt")
    rm -rf "${HOSTS_DIR:?}/shared/ckpt"
    on_hosts 2 2 "$WORK/save" "${run[@]}" --steps 4 --save "$HOSTS_DIR/shared/ckpt"
    [ -d "$HOSTS_DIR/shared/ckpt/step00000004" ] || fail "no checkpoint at step 4"
    cp -r "$HOSTS_DIR/shared/ckpt" "$WORK/ckpt"
    for world in 2 3; do
      if [ "$world" = 2 ]; then on_hosts 1 2 "$WORK/h" "${run[@]}" --steps 8 --resume "$HOSTS_DIR/shared/ckpt"
      else on_hosts 3 1 "$WORK/h" "${run[@]}" --steps 8 --resume "$HOSTS_DIR/shared/ckpt"; fi
      grep -q 'resumed from .* at step 4' "$WORK/h.h0" || fail "did not resume at step 4"
      local_ranks "$world" "$WORK/l" "${run[@]}" --steps 8 --resume "$WORK/ckpt"
      what="1 host x 2 ranks"
      [ "$world" = 3 ] && what="3 hosts x 1 rank"
      same "stage $stage $fmt: saved by 2 hosts x 2 ranks, resumed on $what == resumed on $world ranks on one host" \
        "$WORK/l" "$WORK/h.h0"
      n=$((n + 1))
    done
    rm -rf "$WORK/ckpt"
  done
  # Host-local disks only: the same path on each host is its own folder (a
  # private bind mount). The save fails on every rank and leaves nothing that
  # a load would take for a checkpoint.
  if command -v unshare >/dev/null; then
    mkdir -p "$WORK/ck" "$WORK/ck0" "$WORK/ck1"
    pids=()
    for i in 0 1; do
      hosts_exec "$i" unshare --mount --propagation private sh -c "mount --bind '$WORK/ck$i' '$WORK/ck' && exec \"\$@\"" sh \
        timeout -k 5 "$GUARD_S" "$LAUNCH" --nnodes 2 --node-rank "$i" --nproc 1 --master-addr "$(hosts_addr 0)" \
        --master-port "$PORT" -- "$TRAIN" "${run[@]}" --steps 2 --save "$WORK/ck" --nvme "$HOSTS_DIR/h$i/swap" \
        >"$WORK/local.h$i" 2>&1 &
      pids+=($!)
    done
    codes=""
    for p in "${pids[@]}"; do
      c=0
      wait "$p" || c=$?
      codes+="$c "
    done
    [ "$codes" = "1 1 " ] || fail "host-local checkpoint folders: the hosts exited $codes"
    for i in 0 1; do
      [ ! -e "$WORK/ck$i/latest" ] && ! ls "$WORK/ck$i" | grep -q '^step' ||
        fail "host $i's local folder holds a checkpoint: $(ls -a "$WORK/ck$i")"
    done
    echo "ok: host-local checkpoint folders: the save fails on both hosts, no checkpoint left:"
    grep -h 'strata_checkpoint_save' "$WORK/local.h0" "$WORK/local.h1" | sed 's/^/  /' | cut -c1-300
    n=$((n + 1))
  fi
  echo "$n passed, 0 failed"
  ;;
addr)
  hosts_up 2 2
  config "$WORK/c.json" 3 5
  run=("${args[@]}" --steps 3 --config "$WORK/c.json")
  # gloo_run NAME [VAR=VALUE]: 2 hosts x 1 rank with VAR set on both (and
  # debug logs); E0 and E1: the bytes host 1 sent on eth0 and on eth1.
  gloo_run() {
    local e0 e1
    e0=$(tx_bytes 1 eth0)
    e1=$(tx_bytes 1 eth1)
    (
      export STRATA_LOG_LEVEL=debug ${2:+"$2"}
      on_hosts 2 1 "$WORK/$1" "${run[@]}"
    ) || fail "$1: the run failed"
    E0=$(($(tx_bytes 1 eth0) - e0))
    E1=$(($(tx_bytes 1 eth1) - e1))
  }
  gloo_run route
  listen=$(grep -m1 'gloo rank 1 of 2 listens on' "$WORK/route.h1" || true)
  grep -q 'listens on 10.213.0.2 (the route to MASTER_ADDR 10.213.0.1)' <<<"$listen" || fail "route: $listen"
  [ "$E0" -gt 100000 ] && [ "$E1" -lt 10000 ] || fail "route: host 1 sent $E0 bytes on eth0, $E1 on eth1"
  echo "ok: by route: ${listen#*] }; host 1 sent $E0 bytes on eth0, $E1 on eth1"
  for var in STRATA_SOCKET_IFNAME GLOO_SOCKET_IFNAME; do
    gloo_run "$var" "$var=eth1"
    listen=$(grep -m1 'gloo rank 1 of 2 listens on' "$WORK/$var.h1" || true)
    grep -q "listens on 10.213.0.130 ($var=eth1)" <<<"$listen" || fail "$var: $listen"
    [ "$E1" -gt 100000 ] && [ "$E0" -lt 50000 ] || fail "$var=eth1: host 1 sent $E0 bytes on eth0, $E1 on eth1"
    same "$var=eth1: the same bits as by route" "$WORK/route.h0" "$WORK/$var.h0"
    echo "ok: $var=eth1: ${listen#*] }; host 1 sent $E0 bytes on eth0 (the store), $E1 on eth1"
  done
  # An interface this host lacks: named, with those it has.
  (
    export STRATA_SOCKET_IFNAME=eth7
    on_hosts 2 1 "$WORK/eth7" "${run[@]}" 2>/dev/null
  ) && fail "STRATA_SOCKET_IFNAME=eth7 ran"
  grep -q 'STRATA_SOCKET_IFNAME=eth7: this host has no interface of that name with an IPv4 address (it has: lo 127.0.0.1, eth0 10.213.0.1, eth1 10.213.0.129)' \
    "$WORK/eth7.h0" || fail "eth7: $(grep -m1 'rank 0' "$WORK/eth7.h0")"
  echo "ok: $(grep -m1 -o 'STRATA_SOCKET_IFNAME=eth7: .*' "$WORK/eth7.h0")"
  # A rank listening on a loopback address beside a rank on another host
  # (MASTER_ADDR given as the host's name on Debian, which /etc/hosts maps to
  # 127.0.1.1): refused on both hosts, naming the address and the way out
  # (the full mesh waited for it until strata.timeout, then named a connection).
  (
    export STRATA_SOCKET_IFNAME=lo
    on_hosts 2 1 "$WORK/lo" "${run[@]}" 2>/dev/null
  ) && fail "STRATA_SOCKET_IFNAME=lo on 2 hosts ran"
  for h in 0 1; do
    grep -q 'rank [01] listens on 127.0.0.1, a loopback address, but rank [01] runs on another host and cannot reach it.*STRATA_SOCKET_IFNAME' \
      "$WORK/lo.h$h" || fail "lo on host $h: $(grep -m1 'strata-train' "$WORK/lo.h$h")"
  done
  echo "ok: $(grep -m1 -o 'rank [01] listens on 127.0.0.1, a loopback address, but rank [01] runs on another host' "$WORK/lo.h0")"
  # create HOST OUT VARS...: a Strata engine made on HOST through the Python
  # binding (which gives the status code) with VARS; prints "CODE: message".
  create() {
    local h=$1 out=$2
    shift 2
    hosts_exec "$h" env "$@" timeout -k 2 "$GUARD_S" "$PY" -c "
import strata, sys
try:
    strata.Engine({'strata': {'timeout': $TIMEOUT_S}}, force_no_gpu=True).close()
except strata.Error as e:
    print(e)
    sys.exit(1)" >"$out" 2>&1
  }
  # An unreachable master: COMM within strata.timeout, naming address and port.
  t0=$(now)
  code=0
  create 1 "$WORK/far" RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=10.213.0.100 MASTER_PORT=$PORT || code=$?
  dt=$(elapsed "$t0" "$(now)")
  msg=$(tail -1 "$WORK/far")
  echo "unreachable master: exit $code after $dt s: $msg"
  [ "$code" = 1 ] || fail "unreachable master: exit $code: $(cat "$WORK/far")"
  grep -q "^COMM: .*store 10.213.0.100:$PORT .*no answer within $TIMEOUT_S s" <<<"$msg" || fail "unreachable master: $msg"
  "$PY" -c "import sys; sys.exit(0 if float(sys.argv[1]) <= $TIMEOUT_S + $MARGIN_S else 1)" "$dt" || fail "took $dt s"
  # The master's port taken by another program: rank 0 names it.
  hosts_exec 0 "$PY" -c "
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', $PORT)); s.listen(8)
open('$WORK/taken', 'w').close(); time.sleep(60)" &
  squatter=$!
  for ((i = 0; i < 100; i++)); do
    [ -e "$WORK/taken" ] && break
    kill -0 "$squatter" 2>/dev/null || fail "the program meant to take port $PORT did not start"
    sleep 0.05
  done
  code=0
  create 0 "$WORK/taken.out" RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR="$(hosts_addr 0)" \
    MASTER_PORT=$PORT || code=$?
  kill "$squatter" 2>/dev/null || true
  msg=$(tail -1 "$WORK/taken.out")
  echo "port in use: exit $code: $msg"
  [ "$code" = 1 ] || fail "port in use: exit $code: $(cat "$WORK/taken.out")"
  grep -q "^COMM: .*port $PORT is in use on this host" <<<"$msg" || fail "port in use: $msg"
  echo "7 passed, 0 failed"
  ;;
torch)
  "$PY" -c "import torch.distributed.run" 2>/dev/null || hosts_skip "torch.distributed.run is not importable by $PY"
  hosts_up 2
  # --redirects/--tee given: Debian's torch 1.13 under Python 3.11 fails on their defaults.
  trun=("$PY" -m torch.distributed.run --redirects 1 --tee 1)
  # One host: torchrun's store on a free port, ours on the next.
  port=$(PYTHONPATH="$HERE/.." "$PY" -c "from free_ports import free_port_block; print(free_port_block(2))")
  mkdir -p "$WORK/ref-swap"
  timeout -k 5 "$GUARD_S" "${trun[@]}" --nproc_per_node 4 --master_addr 127.0.0.1 --master_port "$port" \
    "$HERE/torch_worker.py" "$WORK/ref" "$WORK/ref-swap" >"$WORK/ref.out" 2>&1 || { grep -v "^\s*$" "$WORK/ref.out" | grep -m5 -i "error\|Traceback" -A3; fail "torchrun on one host"; }
  pids=()
  for i in 0 1; do
    hosts_exec "$i" timeout -k 5 "$GUARD_S" "${trun[@]}" --nnodes 2 --node_rank "$i" --nproc_per_node 2 \
      --master_addr "$(hosts_addr 0)" --master_port "$PORT" "$HERE/torch_worker.py" "$WORK/hosts" \
      "$HOSTS_DIR/h$i/swap" >"$WORK/hosts.h$i" 2>&1 &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [ "$rc" = 0 ] || { tail -n 8 "$WORK"/hosts.h*; fail "torchrun --nnodes 2"; }
  for fmt in fp32 compact; do
    for r in 0 1 2 3; do
      [ -s "$WORK/hosts/$fmt.r$r" ] || fail "$fmt: rank $r wrote nothing"
      cmp -s "$WORK/ref/$fmt.r$r" "$WORK/hosts/$fmt.r$r" ||
        fail "$fmt rank $r: on 2 hosts $(cat "$WORK/hosts/$fmt.r$r"), on one host $(cat "$WORK/ref/$fmt.r$r")"
      [ "$(cut -d' ' -f1 "$WORK/hosts/$fmt.r$r")" = "$(cut -d' ' -f1 "$WORK/hosts/$fmt.r0")" ] ||
        fail "$fmt: rank $r holds other weights than rank 0"
    done
    echo "ok: offload_module $fmt: torchrun --nnodes 2 x --nproc_per_node 2 == --nproc_per_node 4 on one host:" \
      "every rank's 4 losses and weights sha256 $(cut -c1-16 "$WORK/hosts/$fmt.r0") bitwise equal"
  done
  [ "$(cut -d' ' -f1 "$WORK/hosts/fp32.r0")" != "$(cut -d' ' -f1 "$WORK/hosts/compact.r0")" ] || fail "compact gave fp32's weights"
  echo "2 passed, 0 failed"
  ;;
elastic)
  "$PY" -c "import torch.distributed.run" 2>/dev/null || hosts_skip "torch.distributed.run is not importable by $PY"
  command -v unshare >/dev/null || hosts_skip "util-linux's unshare is not installed"
  hosts_up 2
  config "$WORK/c.json" 3 "$TIMEOUT_S"
  ck=$HOSTS_DIR/shared/ckpt
  run=("${args[@]}" --steps 40 --config "$WORK/c.json" --save "$ck" --save-every 2)
  # What torchrun starts on each host: resume when a checkpoint is there.
  cat >"$WORK/rank.sh" <<EOS
#!/usr/bin/env bash
res=()
[ -e "$ck/latest" ] && res=(--resume "$ck")
echo "started as rank \$RANK of \$WORLD_SIZE (restart \$TORCHELASTIC_RESTART_COUNT) \${res[*]}" >&2
exec "$TRAIN" ${run[*]} --nvme "\$1" "\${res[@]}"
EOS
  chmod +x "$WORK/rank.sh"
  # torchrun's c10d rendezvous and its MASTER_ADDR go by host name: each host
  # gets its own (a UTS namespace) and a hosts file naming the others (a
  # private bind mount over /etc/hosts, seen by that host's processes only).
  printf '127.0.0.1 localhost\n%s strata-h0\n%s strata-h1\n' "$(hosts_addr 0)" "$(hosts_addr 1)" >"$WORK/hosts"
  for i in 0 1; do
    hosts_exec "$i" unshare --uts --mount --propagation private sh -c \
      "hostname strata-h$i && mount --bind '$WORK/hosts' /etc/hosts && exec \"\$@\"" sh \
      timeout -k 5 "$GUARD_S" "$PY" -m torch.distributed.run --redirects 1 --tee 1 --nnodes 1:2 --nproc_per_node 2 \
      --rdzv_backend c10d --rdzv_endpoint strata-h0:29400 --rdzv_id strata-hosts --rdzv_conf last_call_timeout=8 \
      --max_restarts 1 --monitor_interval 1 --no_python "$WORK/rank.sh" "$HOSTS_DIR/h$i/swap" >"$WORK/t$i" 2>&1 &
    tpid[$i]=$!
  done
  for ((k = 0; k < GUARD_S * 20; k++)); do
    [ -e "$ck/step00000008" ] && break
    sleep 0.05
  done
  [ -e "$ck/step00000008" ] || { tail "$WORK/t0"; fail "no checkpoint at step 8"; }
  hosts_kill 1
  t0=$(now)
  echo "killed every process on host 1 (its torchrun too) once step 8 was saved"
  code=0
  wait "${tpid[0]}" || code=$?
  wait "${tpid[1]}" 2>/dev/null || true
  grep -h 'started as rank' "$WORK/t0" | sed 's/^/  host 0: /'
  [ "$code" = 0 ] || { tail -n 20 "$WORK/t0"; fail "host 0's torchrun exited $code"; }
  # The premise: both hosts were in the job (a world of 4) before one was
  # lost. (The rendezvous waits last_call_timeout for a second host once one
  # has joined: at 1 s a loaded machine once let host 0 start alone and then
  # restart at each of host 1's tries to join, never as a world of 4.)
  grep -q 'started as rank 0 of 4 (restart 0)' "$WORK/t0" || fail "host 0 never ran in a world of 4 (both hosts)"
  grep -q 'started as rank 0 of 2 (restart 1) --resume' "$WORK/t0" || fail "host 0's torchrun did not restart rank 0 as 1 of 2"
  from=$(sed -n 's/.*resumed from .* at step \([0-9]*\)$/\1/p' "$WORK/t0" | tail -1)
  [ -n "$from" ] || fail "the restarted ranks did not resume"
  echo "ok: torchrun restarted host 0's ranks as a world of 2 ($(elapsed "$t0" "$(now)") s after the kill, to the end);" \
    "they resumed from step $from"
  tag=$(printf 'step%08d' "$from")
  mkdir -p "$WORK/ref-ckpt"
  cp -r "$ck/$tag" "$WORK/ref-ckpt/"
  echo "$tag" >"$WORK/ref-ckpt/latest"
  ref=("${args[@]}" --steps 40 --config "$WORK/c.json" --resume "$WORK/ref-ckpt")
  local_ranks 2 "$WORK/ref" "${ref[@]}"
  a=$(grep -o 'strata-train weights_hash=.*' "$WORK/t0" | tail -1)
  b=$(grep -o 'strata-train weights_hash=.*' "$WORK/ref" | tail -1)
  [ -n "$a" ] && [ "$a" = "$b" ] || fail "after the elastic restart $a; resumed from $tag on 2 ranks on one host: $b"
  echo "ok: the elastic restart's weights == a resume of $tag on 2 ranks on one host: ${a#strata-train }"
  echo "2 passed, 0 failed"
  ;;
*)
  fail "unknown mode $MODE"
  ;;
esac

# Test hosts on one machine: network namespaces joined by a switch. Source
# it, then call hosts_up N. Each host is a namespace with its own network
# stack, loopback, and eth0 on one test network; with hosts_up N 2 also eth1
# on a second one. The switch is a bridge in a namespace of its own: nothing
# joins it to the machine's network, no host has a default route, IP
# forwarding stays off, so test traffic reaches only the test hosts.
#
# Addresses: one private test subnet, 10.213.0.0/24, never routed beyond the
# namespaces; eth0 in its lower half (host i: 10.213.0.(1+i)/25), eth1 in
# its upper half (10.213.0.(129+i)/25). Every run has its own namespaces (names
# carry the shell's pid), so runs in parallel reuse the addresses on separate
# switches and never meet.
#
# Folders under $HOSTS_DIR (/var/tmp/strata-hosts-st<pid>-*): h<i>/swap, each host's own "NVMe"; shared/, one
# folder every host sees (a shared file system); logs go where the test says.
#
# Not root, or a kernel that refuses namespaces: hosts_up exits 77 (skipped)
# saying why. A trap on EXIT, INT, TERM and HUP kills every process in the
# namespaces and removes them and $HOSTS_DIR, whatever happens; a run killed
# outright (SIGKILL: no trap) is swept by the next one (hosts_sweep).
#
#   hosts_up N [NETS]       make hosts 0..N-1 (NETS 1 or 2)
#   hosts_up_lossy N DELAY_MS LOSS   hosts on one network whose links delay and drop:
#                           tc netem where the kernel has it, else link_switch.py
#                           (a switch in user space; kernels without netem)
#   hosts_exec I CMD...     run CMD on host I
#   hosts_addr I [NET]      host I's address on eth0 (NET 1: eth1)
#   hosts_netem SPEC...     tc netem SPEC (e.g. delay 2ms loss 1%) on both ends of every eth0 link
#   hosts_cut I             cut host I's eth0 cable (its switch port goes down)
#   hosts_kill I            SIGKILL every process on host I
#   hosts_ns I              host I's namespace name (for ip -n, ip netns pids)
#   hosts_switch_stats      stop link_switch.py; its frame counts in HOSTS_SWITCH_STATS

HOSTS_ID="st$$"
HOSTS_SW="strata-$HOSTS_ID-sw"
HOSTS_N=0
HOSTS_NETS=1
HOSTS_DIR=""
HOSTS_EXTRA_CLEANUP=""  # run by the EXIT trap after hosts_down (a test's own folders)
HOSTS_SWITCH_PID=""
HOSTS_LINKS=""  # how the links delay and drop: "netem" or "link_switch.py" (hosts_up_lossy)
HOSTS_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

hosts_ns() { echo "strata-$HOSTS_ID-h$1"; }

hosts_addr() {
  if [ "${2:-0}" = 1 ]; then echo "10.213.0.$((129 + $1))"; else echo "10.213.0.$((1 + $1))"; fi
}

hosts_exec() {
  local i=$1
  shift
  ip netns exec "$(hosts_ns "$i")" "$@"
}

hosts_kill() {
  local pids
  pids=$(ip netns pids "$(hosts_ns "$1")" 2>/dev/null || true)
  [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
}

hosts_down() {
  local i
  if [ -n "$HOSTS_SWITCH_PID" ]; then
    kill "$HOSTS_SWITCH_PID" 2>/dev/null || true
    wait "$HOSTS_SWITCH_PID" 2>/dev/null || true
    HOSTS_SWITCH_PID=""
  fi
  for ((i = 0; i < HOSTS_N; i++)); do hosts_kill "$i"; done
  for ((i = 0; i < HOSTS_N; i++)); do ip netns del "$(hosts_ns "$i")" 2>/dev/null || true; done
  ip netns del "$HOSTS_SW" 2>/dev/null || true
  [ -z "$HOSTS_DIR" ] || rm -rf "$HOSTS_DIR"
  HOSTS_DIR=""
  HOSTS_N=0
}

# hosts_down, then the test's own cleanup: what the EXIT trap runs.
hosts_exit() {
  hosts_down
  eval "$HOSTS_EXTRA_CLEANUP"
}

hosts_skip() {
  echo "skipped: $*"
  exit 77
}

# Runs on every exit; a test's own EXIT trap should call it too.
hosts_trap() {
  trap 'hosts_exit' EXIT
  trap 'hosts_exit; exit 130' INT
  trap 'hosts_exit; exit 143' TERM
  trap 'hosts_exit; exit 129' HUP
}

# Namespaces of an earlier run whose shell is gone (killed with SIGKILL,
# say by a test timeout, so its trap never ran): their processes killed and
# the namespaces removed. Only names this file makes, only of dead shells.
hosts_sweep() {
  local ns pid pids
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^strata-st[0-9]+-(sw|h[0-9]+)$' || true); do
    pid=${ns#strata-st}
    pid=${pid%%-*}
    kill -0 "$pid" 2>/dev/null && continue
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  local d
  for d in /var/tmp/strata-hosts-st[0-9]*-* /var/tmp/strata-hosts-test-st[0-9]*-*; do
    [ -d "$d" ] || continue
    pid=${d##*-st}
    pid=${pid%%-*}
    kill -0 "$pid" 2>/dev/null || rm -rf "$d"
  done
}

# The switch namespace, the folders, the trap; skips when not allowed.
hosts_begin() {
  [ "$(id -u)" = 0 ] || hosts_skip "the hosts tests make network namespaces, which needs root (uid $(id -u))"
  command -v ip >/dev/null || hosts_skip "iproute2's ip is not installed"
  hosts_sweep
  hosts_trap
  local err
  if ! err=$(ip netns add "$HOSTS_SW" 2>&1); then
    hosts_skip "the kernel refuses network namespaces (ip netns add: $err)"
  fi
  HOSTS_DIR=$(mktemp -d "/var/tmp/strata-hosts-$HOSTS_ID-XXXXXX")
  mkdir -p "$HOSTS_DIR/shared"
  ip -n "$HOSTS_SW" link set lo up
}

# A host namespace with loopback up and no IPv6 (no router solicitations,
# no link-local chatter in the interface counters).
hosts_add() {
  local ns
  ns=$(hosts_ns "$1")
  ip netns add "$ns"
  HOSTS_N=$(($1 + 1))
  ip -n "$ns" link set lo up
  ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 || true
  mkdir -p "$HOSTS_DIR/h$1/swap"
}

hosts_check_isolated() {
  local i
  for ((i = 0; i < HOSTS_N; i++)); do
    if [ -n "$(ip -n "$(hosts_ns "$i")" route show default)" ]; then
      echo "FAIL: host $i has a default route" >&2
      exit 1
    fi
  done
}

hosts_up_lossy() {
  local n=$1 delay=$2 loss=$3 i
  hosts_begin
  if ip netns exec "$HOSTS_SW" tc qdisc add dev lo root netem delay 1ms 2>/dev/null; then
    ip netns exec "$HOSTS_SW" tc qdisc del dev lo root
    hosts_build "$n" 1
    hosts_netem delay "${delay}ms" loss "$(/usr/bin/python3 -c "print($loss * 100)")%"
    HOSTS_LINKS=netem
    return
  fi
  for ((i = 0; i < n; i++)); do hosts_add "$i"; done
  local names=()
  for ((i = 0; i < n; i++)); do names+=("$(hosts_ns "$i")"); done
  /usr/bin/python3 "$HOSTS_HERE/link_switch.py" --ready "$HOSTS_DIR/switch" --delay-ms "$delay" --loss "$loss" \
    "${names[@]}" 2>"$HOSTS_DIR/switch.err" &
  HOSTS_SWITCH_PID=$!
  for ((i = 0; i < 100; i++)); do
    [ -e "$HOSTS_DIR/switch" ] && break
    kill -0 "$HOSTS_SWITCH_PID" 2>/dev/null || { cat "$HOSTS_DIR/switch.err" >&2; echo "FAIL: link_switch.py" >&2; exit 1; }
    sleep 0.05
  done
  [ -e "$HOSTS_DIR/switch" ] || { echo "FAIL: link_switch.py not ready" >&2; exit 1; }
  for ((i = 0; i < n; i++)); do
    ip -n "$(hosts_ns "$i")" addr add "$(hosts_addr "$i")/25" dev eth0
    ip -n "$(hosts_ns "$i")" link set eth0 up
  done
  HOSTS_LINKS=link_switch.py
  hosts_check_isolated
}

# Stops link_switch.py; HOSTS_SWITCH_STATS: its counts ("frames N dropped K").
hosts_switch_stats() {
  HOSTS_SWITCH_STATS="no switch"
  [ -n "$HOSTS_SWITCH_PID" ] || return 0
  kill "$HOSTS_SWITCH_PID" 2>/dev/null || true
  wait "$HOSTS_SWITCH_PID" 2>/dev/null || true
  HOSTS_SWITCH_PID=""
  HOSTS_SWITCH_STATS=$(cat "$HOSTS_DIR/switch.stats" 2>/dev/null || echo "no counts")
}

hosts_up() {
  hosts_begin
  hosts_build "$@"
}

hosts_build() {
  local n=$1 nets=${2:-1} i k
  HOSTS_NETS=$nets
  for ((k = 0; k < nets; k++)); do
    ip -n "$HOSTS_SW" link add "br$k" type bridge || hosts_skip "the kernel refuses bridges"
    ip -n "$HOSTS_SW" link set "br$k" up
  done
  for ((i = 0; i < n; i++)); do
    hosts_add "$i"
    for ((k = 0; k < nets; k++)); do
      ip -n "$HOSTS_SW" link add "p$k-$i" type veth peer name "eth$k" netns "$(hosts_ns "$i")" ||
        hosts_skip "the kernel refuses veth pairs"
      ip -n "$HOSTS_SW" link set "p$k-$i" master "br$k" up
      ip -n "$(hosts_ns "$i")" addr add "$(hosts_addr "$i" "$k")/25" dev "eth$k"
      ip -n "$(hosts_ns "$i")" link set "eth$k" up
    done
  done
  # Never a way out: no default route anywhere, no forwarding.
  hosts_check_isolated
}

hosts_netem() {
  local i
  for ((i = 0; i < HOSTS_N; i++)); do
    tc -n "$(hosts_ns "$i")" qdisc replace dev eth0 root netem "$@"
    tc -n "$HOSTS_SW" qdisc replace dev "p0-$i" root netem "$@"
  done
}

hosts_cut() { ip -n "$HOSTS_SW" link set "p0-$1" down; }

#!/usr/bin/env bash
# Installs what Strata needs from Debian 12's packages, and only what is
# missing (idempotent). The CUDA toolkit with NCCL is optional and not
# installed here: the build finds it where it is (/usr/local/cuda).
set -euo pipefail
PKGS=(
  build-essential cmake ninja-build pkg-config git
  liburing-dev libtbb-dev libhwloc-dev libboost-dev nlohmann-json3-dev libspdlog-dev
  libxxhash-dev libcli11-dev googletest libgtest-dev libbenchmark-dev libgloo-dev
  libopenblas-dev fio python3 python3-numpy python3-torch python3-torchvision python3-pytest python3-venv
  python3-pip python3-setuptools python3-wheel  # pip install --no-deps --no-build-isolation ./python, offline
  clang libclang-rt-14-dev  # tests/fuzz: clang++ -fsanitize=fuzzer
  iproute2  # tests/hosts: network namespaces, veth, a bridge, tc
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || {
    echo "install-deps: missing ${missing[*]}; installing them needs root: run as root, or install sudo" >&2
    exit 1
  }
  SUDO="sudo"
fi
echo "install-deps: installing ${missing[*]}" >&2
$SUDO apt-get update -qq
# (env: sudo resets the environment, and would drop DEBIAN_FRONTEND)
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

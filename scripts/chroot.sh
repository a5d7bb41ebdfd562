#!/usr/bin/env bash
# Debian build roots for dtrain's other CI legs: Debian 13 "trixie" (LibTorch 2.6, CUDA LibTorch
# 2.6) and Debian "forky", testing (LibTorch 2.14, C++20), made the way Debian builds against
# another release (sbuild/pbuilder): debootstrap + chroot.
#
#   scripts/chroot.sh create  FLAVOUR      make the root (once) and install its packages
#   scripts/chroot.sh update  FLAVOUR      apt-get update + upgrade + install the package list
#   scripts/chroot.sh run     FLAVOUR CMD… run CMD (through bash -c when one word with spaces,
#                                          else as argv) in the root, in the source tree
#   scripts/chroot.sh enter   FLAVOUR      interactive shell in the root
#   scripts/chroot.sh destroy FLAVOUR      tear the root down (delete it)
#   scripts/chroot.sh path    FLAVOUR      print the root's directory
#
# FLAVOUR:
#   cpu   libtorch-dev 2.6 (CPU), python3-torch 2.6, libgloo-dev, g++ 14, CMake, Ninja, …
#   cuda  libtorch-cuda-dev 2.6 (contrib), libgloo-cuda-dev (libgloo-dev conflicts with the CUDA
#         LibTorch), nvidia-cuda-toolkit 12.4 and libnccl-dev 2.22 (non-free); ~3 GB to fetch.
#         Debian's nvidia-cudnn fetches cuDNN from NVIDIA in its install script, which fails
#         without that network, so libcudnn.so.9 is absent: CUDA executables link only with
#         -Wl,--allow-shlib-undefined and cannot start (scripts/ci-legs.sh says the same).
#   forky Debian testing: libtorch-dev 2.14 (needs C++20), python3-torch 2.14, g++ 16,
#         CMake 4, libgloo-dev, GoogleTest 1.17, etcd. bookworm's debootstrap has no forky
#         script, so the sid script makes it. The archive's forky Release file may be past
#         its Valid-Until date (a snapshot mirror): this root's apt is told to accept that
#         (/etc/apt/apt.conf.d/99dtrain-snapshot); the signature is still checked.
#
# Idempotent: `create` returns at once when the root exists with the same package list, and
# installs what is missing when the list changed; `run` creates the root first if needed.
# Concurrent calls on one root are safe: creation and updates hold a lock, and every run
# mounts inside its own private mount namespace (unshare -m), so its bind mounts vanish when
# it exits — even when killed — and two runs never see each other's mounts; an EXIT trap
# also unmounts them explicitly.
#
# Mounts for run/enter: /proc, /dev, /dev/shm, and the source tree at its own absolute path
# (so build trees and CMake caches keep host paths). When the tree's data/ is a symlink, its
# target is mounted too. DTRAIN_CHROOT_BIND="path1 path2" adds more paths (same place inside).
#
# Environment:
#   DTRAIN_CHROOT_DIR      where roots are cached (default /var/cache/dtrain-chroots): a root
#                          is DIR/trixie-cpu, DIR/trixie-cuda or DIR/forky-cpu; outside the
#                          repository on purpose.
#   DTRAIN_DEBIAN_MIRROR   the Debian archive URI; by default read at run time from this
#                          machine's apt configuration (/etc/apt/sources.list.d/debian.sources,
#                          else /etc/apt/sources.list): the first non-security "deb" entry.
#
# Needs root (debootstrap, chroot, mount); uses sudo otherwise. Installs debootstrap when absent.
set -euo pipefail

src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${DTRAIN_CHROOT_DIR:-/var/cache/dtrain-chroots}"

usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" >&2; exit 2; }
die() { echo "chroot.sh: $*" >&2; exit 1; }

if [ "$(id -u)" -ne 0 ]; then
  exec sudo --preserve-env=DTRAIN_CHROOT_DIR,DTRAIN_DEBIAN_MIRROR,DTRAIN_CHROOT_BIND \
    "${BASH_SOURCE[0]}" "$@"
fi

[ $# -ge 2 ] || usage
cmd="$1"
flavour="$2"
shift 2

common_pkgs=(
  g++ cmake ninja-build pkg-config make git ca-certificates
  libabsl-dev libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev
  # OpenMP variant for the same reason as scripts/install-deps.sh (BLAS threads bounded by
  # at::set_num_threads()).
  libopenblas0-openmp
  # The multi-host test joins two network namespaces with a veth pair.
  iproute2
  python3
  # examples/cnn: Fashion-MNIST's gzip-compressed IDX files, read with zlib.
  zlib1g-dev dataset-fashion-mnist
  # The MPI backend compiles in every leg (its tests under mpirun run in leg 1).
  libopenmpi-dev openmpi-bin
)
suite=trixie
debootstrap_script=""
case "$flavour" in
  # etcd-server: the etcd store's tests start a real etcd (3.5 in trixie); etcd-client:
  # their scripts probe it and read its keys with etcdctl (only recommended by the server).
  cpu) pkgs=("${common_pkgs[@]}" libtorch-dev libgloo-dev python3-torch etcd-server etcd-client) ;;
  cuda) pkgs=("${common_pkgs[@]}" libtorch-cuda-dev libgloo-cuda-dev nvidia-cuda-toolkit libnccl-dev) ;;
  forky)
    suite=forky
    debootstrap_script=/usr/share/debootstrap/scripts/sid
    pkgs=("${common_pkgs[@]}" libtorch-dev libgloo-dev python3-torch etcd-server etcd-client)
    ;;
  *) die "unknown flavour '$flavour' (cpu, cuda or forky)" ;;
esac
case "$flavour" in forky) dir="$cache/forky-cpu" ;; *) dir="$cache/$suite-$flavour" ;; esac
stamp="$dir/.dtrain-packages"

# The archive URI from this machine's apt configuration: never written into the project.
mirror() {
  if [ -n "${DTRAIN_DEBIAN_MIRROR:-}" ]; then echo "$DTRAIN_DEBIAN_MIRROR"; return; fi
  local uri=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    # deb822 stanzas: the first URIs of a "Types: deb" stanza that is not the security archive.
    uri="$(awk '
      /^[[:space:]]*$/ { if (deb && u != "" && u !~ /security/) { print u; exit } deb = 0; u = ""; next }
      /^Types:/ { deb = ($0 ~ /(^|[[:space:]])deb([[:space:]]|$)/) }
      /^URIs:/ { u = $2 }
      END { if (deb && u != "" && u !~ /security/) print u }' /etc/apt/sources.list.d/debian.sources |
      head -n1)"
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri="$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/) { if ($i !~ /security/) { print $i; exit } break } }' \
      /etc/apt/sources.list)"
  fi
  [ -n "$uri" ] || die "no Debian archive found in /etc/apt (set DTRAIN_DEBIAN_MIRROR)"
  echo "$uri"
}

# Serialises create/update/destroy of one root across processes.
lock() {
  mkdir -p "$cache"
  exec 9>"$cache/.${dir##*/}.lock"
  flock 9
}

# The root's apt sources; for testing, also accept a Release file past its Valid-Until date.
apt_sources() {
  echo "deb $1 $suite main contrib non-free" >"$dir/etc/apt/sources.list"
  if [ "$suite" = forky ]; then
    echo 'Acquire::Check-Valid-Until "false";' >"$dir/etc/apt/apt.conf.d/99dtrain-snapshot"
  fi
}

apt_in_root() {
  chroot "$dir" env DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 apt-get "$@"
}

install_pkgs() {
  # /proc is needed by some maintainer scripts; mount it privately for the install.
  # cuda: nvidia-cudnn (a dependency of libtorch-cuda) is an installer package whose
  # postinst downloads cuDNN from NVIDIA, which fails here and leaves it and everything that
  # depends on it unconfigured. Its postinst is then replaced by a no-op and the rest is
  # configured: the root has no cuDNN, as documented at the top.
  unshare --mount --propagation private bash -c '
    set -e; dir="$1"; shift; mount -t proc proc "$dir/proc"
    in_root() { chroot "$dir" env DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 "$@"; }
    if in_root apt-get install -y -q --no-install-recommends "$@"; then exit 0; fi
    postinst="$dir/var/lib/dpkg/info/nvidia-cudnn.postinst"
    [ -f "$postinst" ] && in_root dpkg -s nvidia-cudnn | grep -q "^Status: .*half-configured\|^Status: .*unpacked" || exit 1
    echo "chroot.sh: nvidia-cudnn cannot download cuDNN here: configuring it without cuDNN" >&2
    printf "#!/bin/sh\n# dtrain chroot.sh: cuDNN download disabled (no access to NVIDIA)\nexit 0\n" >"$postinst"
    in_root dpkg --configure -a
    in_root apt-get install -y -q --no-install-recommends "$@"' \
    chroot-install "$dir" "${pkgs[@]}"
  printf '%s\n' "${pkgs[@]}" >"$stamp"
}

create() {
  lock
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(printf '%s\n' "${pkgs[@]}")" ]; then
    return 0
  fi
  command -v debootstrap >/dev/null || {
    # The host's dpkg may be busy with scripts/install-deps.sh (.ci/run runs both at once):
    # the same lock file serialises them, and apt waits for any other holder.
    flock /var/lock/dtrain-apt.lock env DEBIAN_FRONTEND=noninteractive \
      apt-get -o DPkg::Lock::Timeout=900 install -y -q debootstrap >/dev/null
  }
  local uri
  uri="$(mirror)"
  if [ ! -x "$dir/usr/bin/apt-get" ] || [ ! -f "$dir/.dtrain-debootstrap-done" ]; then
    echo "chroot.sh: debootstrap $suite into $dir" >&2
    rm -rf "$dir"
    # shellcheck disable=SC2086
    debootstrap --variant=minbase "$suite" "$dir" "$uri" $debootstrap_script >&2
    touch "$dir/.dtrain-debootstrap-done"
  fi
  apt_sources "$uri"
  cp -L /etc/resolv.conf "$dir/etc/resolv.conf" 2>/dev/null || true
  cp -L /etc/hosts "$dir/etc/hosts" 2>/dev/null || true  # the host name resolves as outside
  echo "chroot.sh: installing ${pkgs[*]} into $dir" >&2
  apt_in_root update -q >&2
  install_pkgs >&2
}

update() {
  [ -f "$dir/.dtrain-debootstrap-done" ] || { create; return; }
  lock
  apt_sources "$(mirror)"
  cp -L /etc/resolv.conf "$dir/etc/resolv.conf" 2>/dev/null || true
  cp -L /etc/hosts "$dir/etc/hosts" 2>/dev/null || true  # the host name resolves as outside
  apt_in_root update -q >&2
  apt_in_root upgrade -y -q >&2
  install_pkgs >&2
}

destroy() {
  lock
  # Mounts live in private namespaces of runs; refuse while one of them still uses the root.
  if grep -q " $dir/" /proc/*/mountinfo 2>/dev/null; then
    die "$dir is still mounted by a running 'chroot.sh run' (see /proc/*/mountinfo)"
  fi
  rm -rf --one-file-system "$dir"
  echo "chroot.sh: removed $dir" >&2
}

# Runs "$@" inside the root with the bind mounts, in a private mount namespace.
in_root() {
  create
  exec 9>&-  # release create's lock: runs share the root
  local binds=("$src")
  if [ -L "$src/data" ]; then binds+=("$(readlink -f "$src/data")"); fi
  # shellcheck disable=SC2206
  binds+=(${DTRAIN_CHROOT_BIND:-})
  # Variables the command sees besides a clean PATH/HOME: dtrain's and the benchmarks' knobs.
  local envs=() v
  for v in $(compgen -e); do
    case "$v" in DTRAIN_* | STEPS | REPEATS | OUT | TORCH_MALLOC | OMP_* | OPENBLAS_* | TERM) envs+=("$v=${!v}") ;; esac
  done
  exec unshare --mount --propagation private bash -c "$inner" chroot-run \
    "$dir" "$PWD" "${#binds[@]}" "${binds[@]}" "${#envs[@]}" "${envs[@]}" "$@"
}

# The part of `run` inside the private mount namespace.
read -r -d '' inner <<'INNER' || true
set -euo pipefail
dir="$1"; cwd="$2"; n="$3"; shift 3
binds=("${@:1:$n}"); shift "$n"
n="$1"; shift
envs=("${@:1:$n}"); shift "$n"
mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
mnt() { mkdir -p "$2"; mount "${@:3}" "$1" "$2"; mounted+=("$2"); }
mnt proc "$dir/proc" -t proc
mnt /dev "$dir/dev" --rbind
mnt /dev/shm "$dir/dev/shm" --bind
for b in "${binds[@]}"; do [ -e "$b" ] && mnt "$b" "$dir$b" --bind; done
case "$cwd" in "${binds[0]}"*) ;; *) cwd="${binds[0]}" ;; esac
if [ $# -eq 0 ]; then set -- bash -l; fi
# Not exec: the EXIT trap unmounts after the command (the namespace drops the mounts anyway).
status=0
chroot "$dir" env -i HOME=/root LC_ALL=C.UTF-8 \
  PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin "${envs[@]}" \
  bash -c 'cd "$0" && if [ $# -eq 1 ]; then exec bash -c "$1"; else exec "$@"; fi' "$cwd" "$@" ||
  status=$?
exit "$status"
INNER

case "$cmd" in
  create) create ;;
  update) update ;;
  run) [ $# -ge 1 ] || usage; in_root "$@" ;;
  enter) in_root ;;
  destroy) destroy ;;
  path) echo "$dir" ;;
  *) usage ;;
esac

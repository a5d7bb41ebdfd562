# Sourced (sh): two "hosts" on one machine, as two network namespaces joined by a veth pair,
# each with its own address and no route elsewhere. Used by the multi-host test and benchmark.
#
#   . scripts/veth-hosts.sh
#   veth_hosts_up TAG || exit 77     # sets ns_a ns_b addr_a addr_b veth_net; 1 when not allowed
#   ip netns exec "$ns_a" ...        # runs on host A
#   veth_hosts_down                  # kills what runs there, deletes both (also on EXIT)
#
# Needs root (CAP_NET_ADMIN) and ip(8); veth_hosts_up prints why when it cannot.
# The pair's /24 is 10.213.(pid % 250) unless VETH_NET (e.g. 10.214.0) fixes it: a setup that
# outlives the script (scripts/slurm-cluster.sh) needs addresses it can write down.
#
# A slow link: with VETH_RATE (tc's rate syntax, e.g. 1gbit, 100mbit) and/or VETH_DELAY
# (e.g. 0.5ms) set, veth_hosts_up also puts tc qdiscs on both ends of the pair (tbf for the
# rate, netem for the delay: each direction limited and delayed; needs tc(8), and sch_netem
# in the kernel for a delay). They touch only this pair, inside the two namespaces, and go
# with them.

veth_hosts_up() {
  ns_a="${1}a"
  ns_b="${1}b"
  veth_net="${VETH_NET:-10.213.$(($$ % 250))}"
  addr_a="$veth_net.1"
  addr_b="$veth_net.2"
  if ! command -v ip >/dev/null 2>&1; then
    echo "the 'ip' command (iproute2) is missing"
    return 1
  fi
  if ! err=$(ip netns add "$ns_a" 2>&1); then
    echo "cannot create network namespaces here ($err); run as root"
    return 1
  fi
  ip netns add "$ns_b" &&
    ip link add "${1}va" type veth peer name "${1}vb" &&
    ip link set "${1}va" netns "$ns_a" &&
    ip link set "${1}vb" netns "$ns_b" &&
    ip -n "$ns_a" addr add "$addr_a/24" dev "${1}va" &&
    ip -n "$ns_b" addr add "$addr_b/24" dev "${1}vb" &&
    ip -n "$ns_a" link set lo up &&
    ip -n "$ns_b" link set lo up &&
    ip -n "$ns_a" link set "${1}va" up &&
    ip -n "$ns_b" link set "${1}vb" up || {
    echo "setting up the veth pair failed"
    veth_hosts_down
    return 1
  }
  if [ -n "${VETH_RATE:-}${VETH_DELAY:-}" ]; then
    veth_hosts_throttle "${1}va" "${1}vb" || {
      veth_hosts_down
      return 1
    }
  fi
}

# Each end of the pair, i.e. each direction: VETH_DELAY through netem (root) and VETH_RATE
# through tbf (netem's child, or root alone without a delay; bucket VETH_BURST, default
# 256kb, queueing up to 100 ms before dropping).
veth_hosts_throttle() {
  if ! command -v tc >/dev/null 2>&1; then
    echo "VETH_RATE/VETH_DELAY need the 'tc' command (iproute2)"
    return 1
  fi
  for end in "$ns_a:$1" "$ns_b:$2"; do
    ns=${end%%:*}
    dev=${end#*:}
    parent="root"
    if [ -n "${VETH_DELAY:-}" ]; then
      if ! err=$(tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$VETH_DELAY" \
        limit 100000 2>&1); then
        echo "VETH_DELAY: tc netem on $dev failed ($err; the kernel needs sch_netem)"
        return 1
      fi
      parent="parent 1:1"
    fi
    if [ -n "${VETH_RATE:-}" ]; then
      # shellcheck disable=SC2086 # $parent is two words when netem is the root
      if ! err=$(tc -n "$ns" qdisc add dev "$dev" $parent handle 10: tbf rate "$VETH_RATE" \
        burst "${VETH_BURST:-256kb}" latency 100ms 2>&1); then
        echo "VETH_RATE: tc tbf on $dev failed ($err)"
        return 1
      fi
    fi
  done
  echo "veth link: rate ${VETH_RATE:-unlimited}, delay ${VETH_DELAY:-none} each way"
}

ns_a=""
ns_b=""

veth_hosts_down() {
  for ns in "$ns_a" "$ns_b"; do
    [ -n "$ns" ] || continue
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  return 0
}

# veth_test_hosts PREFIX: for a test script with a scratch directory $tmp: brings the two
# hosts up, and at exit kills the script's background jobs, removes the hosts and $tmp; or,
# when they cannot be made here (no root, no ip), exits 77 (ctest: skipped) saying why.
veth_test_hosts() {
  # shellcheck disable=SC2317  # called by the trap
  veth_test_cleanup() {
    for p in $(jobs -p); do kill -9 "$p" 2>/dev/null; done
    veth_hosts_down
    rm -rf "$tmp"
  }
  trap veth_test_cleanup EXIT
  if ! veth_hosts_up "$1" >"$tmp/why"; then
    echo "SKIP: $(cat "$tmp/why")"
    exit 77
  fi
}

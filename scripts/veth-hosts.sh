# Sourced (sh): two "hosts" on one machine, as two network namespaces joined by a veth pair,
# each with its own address and no route elsewhere. Used by the multi-host test and benchmark.
#
#   . scripts/veth-hosts.sh
#   veth_hosts_up TAG || exit 77     # sets ns_a ns_b addr_a addr_b veth_net; 1 when not allowed
#   ip netns exec "$ns_a" ...        # runs on host A
#   veth_hosts_down                  # kills what runs there, deletes both (also on EXIT)
#
# Needs root (CAP_NET_ADMIN) and ip(8); veth_hosts_up prints why when it cannot.

veth_hosts_up() {
  ns_a="${1}a"
  ns_b="${1}b"
  veth_net="10.213.$(($$ % 250))"
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

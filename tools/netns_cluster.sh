#!/usr/bin/env bash
# Emulated cluster for tools/bench_cluster.py: one network namespace per "node", joined through a switch namespace
# (a Linux bridge) by veth pairs, each rate-limited by tbf in both directions (node NIC egress and switch port
# egress). Ranks of one node talk over that node's loopback; only cross-node traffic crosses the rate-limited links.
# Everything is created inside namespaces this script creates: no host interface is touched (veth pairs are created
# from inside the node namespace with their peer moved straight into the switch namespace).
#
#   tools/netns_cluster.sh up   <nodes> <rate> [prefix]   e.g. up 2 1gbit   -> namespaces mxn0, mxn1, mxnsw
#                                                          (rate "unlimited": no tbf, the veth's own speed)
#   tools/netns_cluster.sh rate <nodes> <rate> [prefix]   change the link rate of an existing cluster
#   tools/netns_cluster.sh down <nodes> [prefix]          delete the namespaces (idempotent)
#   tools/netns_cluster.sh addr <node>                    the node's IP address (10.77.0.<node+1>)
# Needs root (CAP_NET_ADMIN / CAP_SYS_ADMIN) and iproute2 with tc.
set -euo pipefail

cmd=${1:?usage: $0 up|rate|down|addr ...}
burst=${MX_TBF_BURST:-256kb}
latency=${MX_TBF_LATENCY:-50ms}

shape() {  # shape <netns> <dev> <rate>; rate "unlimited" removes the limit (the no-link floor)
  if [[ "$3" == unlimited ]]; then
    ip netns exec "$1" tc qdisc del dev "$2" root 2>/dev/null || true
  else
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$3" burst "$burst" latency "$latency"
  fi
}

case "$cmd" in
  up)
    nodes=${2:?nodes}; rate=${3:?rate}; p=${4:-mxn}
    sw="${p}sw"
    ip netns add "$sw"
    ip netns exec "$sw" ip link set lo up
    ip netns exec "$sw" ip link add br0 type bridge
    ip netns exec "$sw" ip link set br0 up
    for ((i = 0; i < nodes; i++)); do
      ns="${p}${i}"
      ip netns add "$ns"
      ip netns exec "$ns" ip link set lo up
      ip netns exec "$ns" ip link add eth0 type veth peer name "port${i}" netns "$sw"
      ip netns exec "$ns" ip addr add "10.77.0.$((i + 1))/24" dev eth0
      ip netns exec "$ns" ip link set eth0 up
      ip netns exec "$sw" ip link set "port${i}" master br0
      ip netns exec "$sw" ip link set "port${i}" up
      shape "$ns" eth0 "$rate"
      shape "$sw" "port${i}" "$rate"
    done
    ;;
  rate)
    nodes=${2:?nodes}; rate=${3:?rate}; p=${4:-mxn}
    for ((i = 0; i < nodes; i++)); do
      shape "${p}${i}" eth0 "$rate"
      shape "${p}sw" "port${i}" "$rate"
    done
    ;;
  down)
    nodes=${2:?nodes}; p=${3:-mxn}
    for ((i = 0; i < nodes; i++)); do
      ip netns del "${p}${i}" 2>/dev/null || true
    done
    ip netns del "${p}sw" 2>/dev/null || true
    ;;
  addr)
    echo "10.77.0.$((${2:?node} + 1))"
    ;;
  *)
    echo "unknown command $cmd" >&2; exit 2 ;;
esac

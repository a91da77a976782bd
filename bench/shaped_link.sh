#!/usr/bin/env bash
# Run a command in a fresh network namespace whose loopback is shaped to RATE (tc tbf), so that
# processes talking over 127.0.0.1 see a LAN-like link instead of memory-speed loopback. Root only.
#   bench/shaped_link.sh 1gbit python -m pytest bench/test_bench_torch.py --benchmark-only
set -euo pipefail
rate=$1; shift
ns="diloco-bench-$$"
ip netns add "$ns"
trap 'ip netns del "$ns"' EXIT
ip netns exec "$ns" ip link set lo up
ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst 512kb latency 200ms
ip netns exec "$ns" "$@"

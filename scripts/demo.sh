#!/usr/bin/env bash
# The README's main job: `kvroute-worker demo` on its built-in defaults. Starts 4 reference
# workers (CPU backend) on loopback, replays a multi-turn multi-tenant agent workload through
# round-robin, least-loaded, kvroute-approx and kvroute-precise (fed by the workers' real ZMQ KV
# events), prints TTFT p50/p90/p99, prefix-hit rate vs an oracle and throughput per policy, and
# writes kvroute-demo.svg. A few minutes on 2 cores.
# Installs what it needs when missing: Debian's libzmq3-dev and pkg-config (the worker's KV-event
# publisher links the system libzmq). Extra arguments go to the demo (`--help` lists them).
# Usage: ./scripts/demo.sh [--load 0.8] [--workers 4] [--quick] ...
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
for pkg in libzmq3-dev pkg-config; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"
fi
exec cargo run --release --locked -p kvroute-worker -- demo "$@"

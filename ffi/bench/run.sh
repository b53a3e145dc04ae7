#!/usr/bin/env bash
# The C-overhead bench of libkvroute, on the release build: the same request routed
# - from C through `kvroute_router_route` (ffi/bench/route_bench.c, a CLOCK_MONOTONIC timing
#   loop, median of 5 rounds), and
# - by criterion (ffi/benches/route_native.rs), both natively (`Router::route_http`) and through
#   the C API of the built libkvroute.so, in the same harness.
# The difference between the two criterion numbers is the per-call cost of the C boundary.
# Usage: ./ffi/bench/run.sh [C_ITERATIONS]
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p kvroute-ffi --locked
TARGET_DIR=$(realpath -m "${CARGO_TARGET_DIR:-target}")
LIBDIR="$TARGET_DIR/release"
mkdir -p "$TARGET_DIR/ffi-bench"
# shellcheck disable=SC2046
gcc -std=c11 -O2 -Wall -Wextra -Werror -o "$TARGET_DIR/ffi-bench/route_bench" ffi/bench/route_bench.c \
  $(PKG_CONFIG_PATH="$LIBDIR" pkg-config --cflags --libs kvroute)
echo "== C: kvroute_router_route through libkvroute.so"
LD_LIBRARY_PATH="$LIBDIR" "$TARGET_DIR/ffi-bench/route_bench" "${1:-20000}"
echo "== criterion: Router::route_http from Rust vs the C API of libkvroute.so (loaded by the bench)"
cargo bench -p kvroute-ffi --bench route_native --locked -- --noplot 2>&1 |
  grep -E '^route_|time:|not found'

#!/usr/bin/env bash
# Test procedure of the Envoy proxy-wasm filter (wasm-filter/): the filter crate kvroute-wasm, its
# wasmtime test host kvroute-wasm-host, the KV-event relay kvroute-relay and the filter's tests and
# bench kvroute-wasm-tests. Builds kvroute_filter.wasm (wasm-release profile) and prints its size,
# checks formatting, clippy (-D warnings, the filter also for wasm32-wasip1) and rustdoc
# (-D warnings), then runs every test, the 100k-request load test included, builds the filter
# without simd128 too (for runtimes without it) and replays the golden fixtures through that
# build, and runs the bench once in test mode. The bench's numbers: `cargo bench -p kvroute-wasm-tests --bench filter_vs_core`.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

# The relay links the system libzmq (rust-zmq finds it with pkg-config); the replica test across
# two Envoys (tests/tests/replica_nats.rs) starts a real nats-server on loopback.
for pkg in libzmq3-dev pkg-config nats-server; do
    dpkg -s "$pkg" >/dev/null 2>&1 || (apt-get update && apt-get install -y "$pkg")
done
rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1

CRATES=(-p kvroute-wasm -p kvroute-wasm-host -p kvroute-relay -p kvroute-wasm-tests)

step "build kvroute_filter.wasm (wasm32-wasip1, profile wasm-release)"
cargo build -p kvroute-wasm --target wasm32-wasip1 --profile wasm-release
wasm="${CARGO_TARGET_DIR:-target}/wasm32-wasip1/wasm-release/kvroute_filter.wasm"
size=$(stat -c %s "$wasm")
echo "kvroute_filter.wasm: $size bytes ($((size / 1024)) KiB)"

step "rustfmt"
cargo fmt "${CRATES[@]}" -- --check

step "clippy (native, all targets)"
cargo clippy "${CRATES[@]}" --all-targets -- -D warnings
step "clippy (the filter on wasm32-wasip1)"
cargo clippy -p kvroute-wasm --target wasm32-wasip1 -- -D warnings

step "rustdoc"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps "${CRATES[@]}"

step "tests (filter units, host ABI, relay, filter in the host: golden, requests, events, shared state, replicas over NATS, reconfiguration, 100k load)"
# The tests use the .wasm built above (no second build from inside the test processes).
KVROUTE_FILTER_NO_BUILD=1 cargo test "${CRATES[@]}"

step "the filter without simd128 (.cargo/config.toml enables it): build, golden fixtures through it"
# Absolute: the test runs in its crate's directory, not here.
target_dir="${CARGO_TARGET_DIR:-target}"
[[ "$target_dir" = /* ]] || target_dir="$PWD/$target_dir"
nosimd="$target_dir/no-simd128"
RUSTFLAGS="-C target-feature=-simd128" cargo build -p kvroute-wasm --target wasm32-wasip1 --profile wasm-release \
    --target-dir "$nosimd"
KVROUTE_FILTER_NO_BUILD=1 KVROUTE_FILTER_WASM="$nosimd/wasm32-wasip1/wasm-release/kvroute_filter.wasm" \
    cargo test -p kvroute-wasm-tests --test filter_golden --test filter_golden_flow

step "bench filter_vs_core in test mode (each benchmark once)"
KVROUTE_FILTER_NO_BUILD=1 cargo test -p kvroute-wasm-tests --bench filter_vs_core

#!/usr/bin/env bash
# Runs every kvroute test. Installs what it needs: the wasm32-wasip1 target, rustfmt and clippy,
# and Debian's libzmq (for the `zmq` feature).
# Usage: ./scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "toolchain components"
installed_targets=$(rustup target list --installed)
if ! grep -qx wasm32-wasip1 <<<"$installed_targets"; then
  rustup target add wasm32-wasip1
fi
rustup component list --installed | grep -q '^rustfmt' || rustup component add rustfmt
rustup component list --installed | grep -q '^clippy' || rustup component add clippy

step "system libraries (libzmq for kvroute's \`zmq\` feature)"
dpkg -s libzmq3-dev >/dev/null 2>&1 || (apt-get update && apt-get install -y libzmq3-dev pkg-config)

# The native-only features of the core, tested together (one build).
FEATURES="zmq,tokenizer"

step "format check"
cargo fmt --all -- --check

step "clippy (warnings denied; libs, bins, tests, benches; default and native features)"
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy -p kvroute --features "$FEATURES" --all-targets --locked -- -D warnings
cargo clippy -p kvroute-benches --features tokenizer --all-targets --locked -- -D warnings

step "rustdoc (warnings denied)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet
RUSTDOCFLAGS="-D warnings" cargo doc -p kvroute --features "$FEATURES" --no-deps --locked --quiet

step "tests (unit, integration, golden fixtures, property tests, doc tests)"
cargo test --workspace --locked

step "tests with the native features: ZMQ subscriber (loopback only) and tokenizer"
cargo test -p kvroute --features "$FEATURES" --locked

step "core builds for wasm32-wasip1"
cargo build -p kvroute --target wasm32-wasip1 --locked

step "all tests passed"

#!/usr/bin/env bash
# Runs every kvroute test. Installs what it needs (the wasm32-wasip1 target, rustfmt, clippy).
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

step "format check"
cargo fmt --all -- --check

step "clippy (warnings denied, all targets: libs, bins, tests, benches)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "rustdoc (warnings denied)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet

step "tests (unit, integration, golden fixtures, property tests, doc tests)"
cargo test --workspace --locked

step "core builds for wasm32-wasip1"
cargo build -p kvroute --target wasm32-wasip1 --locked

step "all tests passed"

#!/usr/bin/env bash
# Tests of the reference model-server worker (gpu-worker/, crate kvroute-worker): format,
# clippy and rustdoc with warnings denied (default build and `--features cuda`), then every test
# of the crate (unit, integration, doc tests; loopback only) and the CUDA parity test, which
# runs on a machine with an NVIDIA driver and skips with a message elsewhere.
# Installs what it needs: Debian's libzmq (the KV-event publisher links it), rustfmt and clippy.
# Usage: ./scripts/test-worker.sh
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "system libraries (libzmq for the KV-event publisher) and toolchain components"
dpkg -s libzmq3-dev >/dev/null 2>&1 || (apt-get update && apt-get install -y libzmq3-dev pkg-config)
dpkg -s pkg-config >/dev/null 2>&1 || (apt-get update && apt-get install -y pkg-config)
rustup component list --installed | grep -q '^rustfmt' || rustup component add rustfmt
rustup component list --installed | grep -q '^clippy' || rustup component add clippy

step "format check (kvroute-worker)"
cargo fmt -p kvroute-worker -- --check

step "clippy, warnings denied (default build, then the CUDA backend)"
cargo clippy -p kvroute-worker --all-targets --locked -- -D warnings
cargo clippy -p kvroute-worker --all-targets --features cuda --locked -- -D warnings

step "rustdoc, warnings denied (default build, then the CUDA backend)"
RUSTDOCFLAGS="-D warnings" cargo doc -p kvroute-worker --no-deps --locked --quiet
RUSTDOCFLAGS="-D warnings" cargo doc -p kvroute-worker --features cuda --no-deps --locked --quiet

step "tests: HTTP API, scheduler, prefix cache, KV events, KV transfer, demo --quick, doc tests"
cargo test -p kvroute-worker --locked

step "CUDA backend: parity with the CPU backend (skips with a message without a driver or device)"
cargo test -p kvroute-worker --features cuda --locked --test cuda_parity -- --nocapture

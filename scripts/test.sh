#!/usr/bin/env bash
# Runs every kvroute test. Installs what it needs: the wasm32-wasip1 target, rustfmt and clippy,
# Debian's libzmq (for the `zmq` feature), and a Python virtual environment (py/.venv) with
# pinned maturin, pytest and mypy for the `kvroute` wheel; the part scripts it calls at the end
# (scripts/test-{ffi,wasm,worker,fuzz}.sh) install Go and valgrind the same way.
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

step "system packages (libzmq for kvroute's \`zmq\` feature, nats-server for the replica tests)"
dpkg -s libzmq3-dev >/dev/null 2>&1 || (apt-get update && apt-get install -y libzmq3-dev pkg-config)
# The replica tests start their own nats-server (loopback, JetStream in a temporary directory).
dpkg -s nats-server >/dev/null 2>&1 || (apt-get update && apt-get install -y nats-server)

# The native-only features of the core, tested together (one build).
FEATURES="zmq,tokenizer,nats"
# The Python extension (py/, crate kvroute-py) enables FEATURES on the core; it is checked in its
# own step, so the workspace-wide steps leave it out (cargo would otherwise unify those features
# into every workspace build and the default-feature build would go untested).
NOT_PY="--exclude kvroute-py"

step "format check"
cargo fmt --all -- --check

step "lock files current (the workspace's, and core/fuzz's: a separate workspace whose lock file a new core dependency must reach too)"
cargo metadata --locked --offline --format-version 1 >/dev/null
cargo metadata --locked --offline --format-version 1 --manifest-path core/fuzz/Cargo.toml >/dev/null

step "clippy (warnings denied; libs, bins, tests, benches; default and native features)"
cargo clippy --workspace $NOT_PY --all-targets --locked -- -D warnings
cargo clippy -p kvroute --features "$FEATURES" --all-targets --locked -- -D warnings
cargo clippy -p kvroute-benches --features tokenizer,nats --all-targets --locked -- -D warnings

step "sans-IO guard: no clock, thread or socket in the core outside its feature-gated adapters"
# The clippy runs above deny core/clippy.toml's disallowed methods and types (-D warnings); this
# proves that rule still bites (grep of core/src, and clippy on a probe using every forbidden item).
./scripts/check-sans-io.sh

step "rustdoc (warnings denied)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace $NOT_PY --no-deps --locked --quiet
RUSTDOCFLAGS="-D warnings" cargo doc -p kvroute --features "$FEATURES" --no-deps --locked --quiet

step "tests (unit, integration, golden fixtures, property tests, doc tests; default features)"
# The crates that enable the core's native features (C library, worker, relay, filter tests) are
# tested in their own steps below, so this build keeps the core's default feature set.
cargo test -p kvroute -p kvroute-sim -p kvroute-benches -p kvroute-wasm --locked

step "tests with the native features: ZMQ subscriber, tokenizer, router replicas over a real nats-server (loopback only)"
cargo test -p kvroute --features "$FEATURES" --locked

step "core builds for wasm32-wasip1"
cargo build -p kvroute --target wasm32-wasip1 --locked

step "Python wheel kvroute (py/): clippy, rustdoc, maturin build, pip install ./py, pytest (with a real nats-server), mypy, stubtest"
cargo clippy -p kvroute-py --all-targets --locked -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc -p kvroute-py --no-deps --locked --quiet
PYTHON="${PYTHON:-python3}"
[ -x py/.venv/bin/python ] || "$PYTHON" -m venv py/.venv
py/.venv/bin/python -m pip install --quiet --disable-pip-version-check -r py/requirements-dev.txt
# --- real-engine check and example gateway (py/tests/test_vllm_engine.py, py/tests/test_gateway.py) ---
# vLLM's own KV-event publisher and block hashing, WITHOUT torch: its light dependencies, then
# vLLM itself with --no-deps (both idempotent); and aiohttp for py/examples/gateway.py.
py/.venv/bin/pip install --quiet --disable-pip-version-check -r py/requirements-vllm.txt -r py/examples/requirements.txt
py/.venv/bin/pip install --quiet --disable-pip-version-check --no-deps vllm==0.33.0
# --- end real-engine check and example gateway ---
# One release build of the extension (abi3 wheel) ...
rm -rf target/py-wheels
py/.venv/bin/maturin build --release --locked -m py/Cargo.toml --out target/py-wheels
py/.venv/bin/python -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps target/py-wheels/kvroute-*.whl
# ... and `pip install ./py` into a fresh virtual environment, from the source tree alone (its
# isolated build gets the pinned maturin, whose cargo build finds the artifacts just built).
rm -rf target/py-fresh-venv
"$PYTHON" -m venv target/py-fresh-venv
PIP_CONSTRAINT="$PWD/py/requirements-dev.txt" target/py-fresh-venv/bin/python -m pip install --quiet \
  --disable-pip-version-check ./py
target/py-fresh-venv/bin/python -c 'import kvroute; r = kvroute.Router(); r.upsert_endpoint("10.0.0.1:8000"); assert r.route(b"{\"model\":\"m\",\"prompt\":\"hi\"}", now=1).endpoint == "10.0.0.1:8000"'
target/py-fresh-venv/bin/kvroute check-config - <<<'{"index": {"mode": "hybrid"}}' >/dev/null
(cd py && .venv/bin/python -m pytest -q -p no:cacheprovider tests)
(cd py && .venv/bin/python -m mypy.stubtest kvroute._native && .venv/bin/python -m mypy)
# --- example gateway: strict type check (its test runs with the pytest line above) ---
(cd py && .venv/bin/python -m mypy examples/gateway.py)

step "C library libkvroute (ffi/): header drift, C tests under ASan and valgrind, C and Go examples"
./scripts/test-ffi.sh

step "Envoy filter (wasm-filter/): kvroute_filter.wasm, wasmtime proxy-wasm host tests, relay"
./scripts/test-wasm.sh

step "reference worker (gpu-worker/): HTTP API, KV events, metrics, KV transfer, demo"
./scripts/test-worker.sh

step "fuzz smoke: every libFuzzer target of core/fuzz for a few seconds"
./scripts/test-fuzz.sh

step "all tests passed"

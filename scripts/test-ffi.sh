#!/usr/bin/env bash
# Tests of the C library libkvroute (ffi/, crate kvroute-ffi; header generator ffi/header):
#   format, clippy and rustdoc (warnings denied); the Rust unit tests and the header drift check;
#   libkvroute.so, libkvroute.a (links to cargo's libkvroute_ffi.{so,a}; SONAME libkvroute.so) and
#   kvroute.pc built; the C tests (ffi/tests/*.c, built with
#   -Wall -Wextra -Werror) under AddressSanitizer + UndefinedBehaviorSanitizer against the static
#   library and under valgrind (memcheck, leaks are errors) against the shared library; the C
#   example (shared and static), the Go example (cgo) and the C bench program (a short smoke
#   run; the measured numbers come from ffi/bench/run.sh).
# Installs what it needs when missing: Debian's pkg-config, libzmq3-dev, libcjson-dev (the golden
# test reads the fixtures with cJSON), valgrind, golang-go and nats-server (the replica test runs
# against a real server this script starts on a free loopback port, storage in a temporary
# directory, killed on exit).
# Usage: ./scripts/test-ffi.sh
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "system packages"
missing=()
for pkg in gcc pkg-config libzmq3-dev libcjson-dev valgrind golang-go nats-server; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"
fi
rustup component list --installed | grep -q '^rustfmt' || rustup component add rustfmt
rustup component list --installed | grep -q '^clippy' || rustup component add clippy

CRATES=(-p kvroute-ffi -p kvroute-ffi-header)
TARGET_DIR=$(realpath -m "${CARGO_TARGET_DIR:-target}")
NATIVE="$TARGET_DIR/tmp/native-decisions.tsv"
NATIVE_FLOW="$TARGET_DIR/tmp/native-flow.tsv"

step "format, clippy, rustdoc (warnings denied)"
cargo fmt -p kvroute-ffi -p kvroute-ffi-header -- --check
cargo clippy "${CRATES[@]}" --all-targets --locked -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc "${CRATES[@]}" --no-deps --locked --quiet

step "Rust tests: unit tests, header drift check (ffi/include/kvroute.h == cbindgen output), native decisions"
# ffi/tests/native_decisions.rs writes <target>/tmp/native-decisions.tsv: the golden fixtures'
# decisions made by the core directly, which the C golden test must reproduce byte for byte;
# ffi/tests/native_flow.rs writes <target>/tmp/native-flow.tsv: the flow-control fixtures' trace
# made by the core directly, which the C flow replay (golden_flow.c) must reproduce line for line.
rm -f "$NATIVE" "$NATIVE_FLOW"
cargo test "${CRATES[@]}" --locked

step "libkvroute.so, libkvroute.a, kvroute.pc"
cargo build -p kvroute-ffi --locked
LIBDIR="$TARGET_DIR/debug"
# The crate's Rust lib is kvroute_ffi: cargo writes libkvroute_ffi.{so,a}; ffi/build.rs links the
# C names libkvroute.{so,a} to them and gives the shared library the SONAME libkvroute.so.
for f in libkvroute.so libkvroute.a; do
  [ "$(readlink "$LIBDIR/$f")" = "${f/libkvroute/libkvroute_ffi}" ] ||
    { echo "$LIBDIR/$f is not a link to ${f/libkvroute/libkvroute_ffi} (touch ffi/build.rs and build again)" >&2; exit 1; }
done
for f in libkvroute.so libkvroute.a kvroute.pc; do
  [ -f "$LIBDIR/$f" ] || { echo "missing $LIBDIR/$f" >&2; exit 1; }
done
soname=$(readelf -d "$LIBDIR/libkvroute.so" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[ "$soname" = libkvroute.so ] || { echo "SONAME of libkvroute.so is '$soname'" >&2; exit 1; }
export PKG_CONFIG_PATH="$LIBDIR${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
[ "$(pkg-config --modversion kvroute)" = "$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)" ]
# Written by ffi/build.rs for the features of the last build here (the default ones: zmq).
if [[ "$(pkg-config --static --libs kvroute)" != *-lzmq* ]]; then
  echo "$LIBDIR/kvroute.pc lacks -lzmq: it was written by a build without the zmq feature;" \
    "touch ffi/build.rs and build again" >&2
  exit 1
fi
# Every symbol the header declares is exported by both libraries, and nothing else is.
declared=$(grep -oE '\bkvroute_[a-z0-9_]+\(' ffi/include/kvroute.h | tr -d '(' | sort -u)
for lib in "$LIBDIR/libkvroute.so" "$LIBDIR/libkvroute.a"; do
  exported=$(nm -g --defined-only "$lib" 2>/dev/null | awk '{print $3}' | grep -E '^kvroute_' | sort -u)
  if [ "$declared" != "$exported" ]; then
    echo "symbols of $lib differ from the header:" >&2
    diff <(echo "$declared") <(echo "$exported") >&2 || true
    exit 1
  fi
done
echo "$(echo "$declared" | wc -l) functions, exported by both libraries"

OUT="$TARGET_DIR/ffi-tests"
mkdir -p "$OUT/asan" "$OUT/plain"
CFLAGS=(-std=c11 -Wall -Wextra -Werror -g)
CJSON=$(pkg-config --cflags --libs libcjson)
SHARED=$(pkg-config --cflags --libs kvroute)
# Static: pkg-config's flags, with the archive picked explicitly (the build directory holds the
# shared library too, which a plain -lkvroute would prefer).
STATIC=$(pkg-config --cflags --static --libs kvroute | sed 's/-lkvroute\b/-l:libkvroute.a/')
TESTS=(api errors golden golden_flow flow threads subscribe replicas)
args_of() {
  case "$1" in
    api) echo "fixtures" ;;
    golden) echo "fixtures/golden $NATIVE" ;;
    golden_flow) echo "fixtures/golden-flow $NATIVE_FLOW" ;;
    threads | flow) echo "${2:-200}" ;;
    # the bound of each convergence wait, seconds (valgrind serializes the replication threads)
    replicas) if [ -n "${2:-}" ]; then echo 120; else echo 30; fi ;;
    *) echo "" ;;
  esac
}

step "nats-server for ffi/tests/replicas.c (loopback, free port, token auth, temporary storage)"
NATS_DIR=$(mktemp -d)
NATS_PID=
stop_nats() {
  if [ -n "$NATS_PID" ]; then
    kill "$NATS_PID" 2>/dev/null || true
    wait "$NATS_PID" 2>/dev/null || true
  fi
  rm -rf "$NATS_DIR"
}
trap stop_nats EXIT
export KVROUTE_NATS_TOKEN="ffi-test-$$-$RANDOM"
# -p -1: a free port, written to the ports file.
nats-server -a 127.0.0.1 -p -1 -js -sd "$NATS_DIR/js" --auth "$KVROUTE_NATS_TOKEN" \
  --ports_file_dir "$NATS_DIR" >"$NATS_DIR/server.log" 2>&1 &
NATS_PID=$!
for _ in $(seq 200); do
  [ -s "$NATS_DIR/nats-server_$NATS_PID.ports" ] && break
  kill -0 "$NATS_PID" 2>/dev/null || { cat "$NATS_DIR/server.log" >&2; echo "nats-server exited" >&2; exit 1; }
  sleep 0.05
done
KVROUTE_NATS_URL=$(grep -o 'nats://127\.0\.0\.1:[0-9]*' "$NATS_DIR/nats-server_$NATS_PID.ports" | head -1) ||
  { cat "$NATS_DIR/server.log" >&2; echo "nats-server did not report its port within 10 s" >&2; exit 1; }
export KVROUTE_NATS_URL
echo "nats-server $NATS_PID on $KVROUTE_NATS_URL"

step "C tests under AddressSanitizer + UndefinedBehaviorSanitizer (static library)"
for t in "${TESTS[@]}"; do
  # shellcheck disable=SC2086 # flag lists
  gcc "${CFLAGS[@]}" -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
    -o "$OUT/asan/$t" "ffi/tests/$t.c" $STATIC $CJSON -lzmq -lpthread -lm
done
for t in "${TESTS[@]}"; do
  # detect_leaks: any block kvroute (Rust code included: it allocates with malloc) leaves is an error.
  # shellcheck disable=SC2046
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    timeout 120 "$OUT/asan/$t" $(args_of "$t")
done

step "C tests under valgrind memcheck (shared library; errors and leaks fail)"
for t in "${TESTS[@]}"; do
  # shellcheck disable=SC2086
  gcc "${CFLAGS[@]}" -O1 -o "$OUT/plain/$t" "ffi/tests/$t.c" $SHARED $CJSON -lzmq -lpthread -lm
done
# Suppressions (ffi/tests/valgrind.supp, reasons there): only "possibly lost" process-lifetime
# allocations of Rust std, minijinja and crossbeam-utils, never kvroute's own blocks.
# --fair-sched=yes: valgrind runs one thread at a time; its fair lock hands the CPU round-robin
# instead of back to the thread that just released it (the threads and flow tests hammer the
# router's locks from several threads).
VALGRIND=(valgrind -q --fair-sched=yes --error-exitcode=99 --leak-check=full
  --show-leak-kinds=definite,indirect,possible --errors-for-leak-kinds=definite,indirect,possible
  --suppressions=ffi/tests/valgrind.supp)
for t in "${TESTS[@]}"; do
  # threads, flow: fewer routes per thread (and random steps) under valgrind (it serializes threads).
  # shellcheck disable=SC2046
  LD_LIBRARY_PATH="$LIBDIR" timeout 300 "${VALGRIND[@]}" "$OUT/plain/$t" $(args_of "$t" 25)
done

step "examples: ffi/examples/route.c (shared and static) and the Go example (cgo)"
# shellcheck disable=SC2086
gcc "${CFLAGS[@]}" -o "$OUT/route" ffi/examples/route.c $SHARED
# shellcheck disable=SC2086
gcc "${CFLAGS[@]}" -o "$OUT/route-static" ffi/examples/route.c $STATIC
if ldd "$OUT/route-static" | grep -q libkvroute; then
  echo "route-static links libkvroute.so" >&2
  exit 1
fi
# Programs record the C name, not cargo's file name.
needed=$(readelf -d "$OUT/route" | sed -n 's/.*Shared library: \[\(libkvroute[^]]*\)\]/\1/p')
[ "$needed" = libkvroute.so ] || { echo "route needs '$needed', not libkvroute.so" >&2; exit 1; }
LD_LIBRARY_PATH="$LIBDIR" "$OUT/route" | tee "$OUT/route.txt"
"$OUT/route-static" >"$OUT/route-static.txt"
cmp "$OUT/route.txt" "$OUT/route-static.txt"
grep -q '^  mode: *decode-direct$' "$OUT/route.txt"
(
  cd ffi/examples/go
  # No network: the example has no dependencies. Caches under target/ when not set.
  export GOFLAGS=-mod=mod GOPROXY=off GOCACHE="${GOCACHE:-$TARGET_DIR/go-build}" \
    GOPATH="${GOPATH:-$TARGET_DIR/go}" LD_LIBRARY_PATH="$LIBDIR"
  [ -z "$(gofmt -l .)" ] || { gofmt -d . >&2; exit 1; }
  go vet .
  go run . | tee "$OUT/route-go.txt"
)
grep -q '^  mode: *decode-direct$' "$OUT/route-go.txt"
grep -q 'KVROUTE_RESULT_REQUEST_ERROR' "$OUT/route-go.txt"
grep -q '^flow control: queued ticket [0-9]*, dispatched after [0-9]* ms$' "$OUT/route-go.txt"

step "bench program builds and runs (smoke run; numbers: ffi/bench/run.sh)"
# shellcheck disable=SC2086
gcc "${CFLAGS[@]}" -O2 -o "$OUT/route_bench" ffi/bench/route_bench.c $SHARED
LD_LIBRARY_PATH="$LIBDIR" "$OUT/route_bench" 50

step "libkvroute: all tests passed"

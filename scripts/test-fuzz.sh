#!/usr/bin/env bash
# Fuzz smoke run: builds every cargo-fuzz target of core/fuzz (release, address sanitizer, the fuzz
# crate's own lock file) and runs each for a few seconds (FUZZ_SMOKE_SECONDS, default 5) from its
# seeds (core/fuzz/seeds/<target>; decode_batch: fixtures/events). Any crash fails the script.
# Installs cargo-fuzz (pinned) when missing; uses the stable toolchain with RUSTC_BOOTSTRAP=1 for
# the sanitizer flags. The build goes to $CARGO_TARGET_DIR/fuzz when CARGO_TARGET_DIR is set.
# Long runs: see the README (Fuzzing).
# Usage: ./scripts/test-fuzz.sh
set -euo pipefail
cd "$(dirname "$0")/../core/fuzz"

CARGO_FUZZ_VERSION=0.13.2
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"

export RUSTC_BOOTSTRAP=1
if [ -n "${CARGO_TARGET_DIR:-}" ]; then
  export CARGO_TARGET_DIR="$CARGO_TARGET_DIR/fuzz"
fi
seconds="${FUZZ_SMOKE_SECONDS:-5}"

# cargo fuzz has no --locked: check the lock file is current first (fails instead of updating it).
cargo fetch --locked
cargo fuzz build --release

# New inputs go to a scratch corpus under the target directory, never into the seeds.
scratch="${CARGO_TARGET_DIR:-target}/fuzz-smoke-corpus"
for t in $(cargo fuzz list); do
  seeds="seeds/$t"
  [ "$t" = decode_batch ] && seeds=../../fixtures/events
  dict=()
  case "$t" in
    decode_batch | event_apply) dict=(-dict=decode_batch.dict) ;;
    policy) dict=(-dict=policy.dict) ;;
    metrics) dict=(-dict=metrics.dict) ;;
  esac
  rm -rf "$scratch/$t"
  mkdir -p "$scratch/$t"
  log="$scratch/$t.log"
  if ! cargo fuzz run --release "$t" "$scratch/$t" "$seeds" -- "${dict[@]}" -max_total_time="$seconds" \
    -print_final_stats=1 >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz target $t failed (crash inputs: core/fuzz/artifacts/$t)" >&2
    exit 1
  fi
  echo "$t: $(grep -m1 '^stat::number_of_executed_units' "$log" | awk '{print $2}') runs in ${seconds} s"
done

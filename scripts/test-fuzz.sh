#!/usr/bin/env bash
# Fuzz smoke run: builds every libFuzzer target of core/fuzz (release, the fuzz crate's own lock
# file) and runs each for a few seconds (FUZZ_SMOKE_SECONDS, default 5) from its seeds
# (core/fuzz/seeds/<target>; decode_batch: fixtures/events). Any crash fails the script.
#
# The targets are built with plain `cargo build` and the coverage instrumentation cargo-fuzz
# would pass (stable rustc, nothing to install): no address sanitizer here — the core has no
# unsafe code on these paths, and the smoke run looks for panics, overflows and broken
# invariants. Long runs use cargo-fuzz with the sanitizer: see the README (Fuzzing).
# The build goes to $CARGO_TARGET_DIR/fuzz when CARGO_TARGET_DIR is set.
# Usage: ./scripts/test-fuzz.sh
set -euo pipefail
cd "$(dirname "$0")/../core/fuzz"

target_dir="${CARGO_TARGET_DIR:-$PWD/target}/fuzz"
seconds="${FUZZ_SMOKE_SECONDS:-5}"
triple="$(rustc -vV | sed -n 's/^host: //p')"
# --target keeps the instrumentation off build scripts and proc macros.
RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks" \
  cargo build --release --locked --bins --target "$triple" --target-dir "$target_dir"
bin="$target_dir/$triple/release"

# New inputs go to a scratch corpus under the target directory, never into the seeds.
scratch="$target_dir/smoke-corpus"
for src in fuzz_targets/*.rs; do
  t="$(basename "$src" .rs)"
  seeds="seeds/$t"
  [ "$t" = decode_batch ] && seeds=../../fixtures/events
  dict=()
  case "$t" in
    decode_batch | event_apply) dict=(-dict=decode_batch.dict) ;;
    policy) dict=(-dict=policy.dict) ;;
    metrics) dict=(-dict=metrics.dict) ;;
    token_ids) dict=(-dict=token_ids.dict) ;;
    body_reader) dict=(-dict=body_reader.dict) ;;
  esac
  rm -rf "${scratch:?}/$t"
  mkdir -p "$scratch/$t" "$scratch/artifacts"
  log="$scratch/$t.log"
  if ! "$bin/$t" "$scratch/$t" "$seeds" "${dict[@]}" -max_total_time="$seconds" -print_final_stats=1 \
    -artifact_prefix="$scratch/artifacts/$t-" >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz target $t failed (crash inputs: $scratch/artifacts/$t-*)" >&2
    exit 1
  fi
  echo "$t: $(grep -m1 '^stat::number_of_executed_units' "$log" | awk '{print $2}') runs in ${seconds} s"
done

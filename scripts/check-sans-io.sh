#!/usr/bin/env bash
# Sans-IO guard of the core (kvroute): the decision path reads no clock, starts no thread and
# opens no socket (see core/clippy.toml), and RouterCore holds no lock. A few seconds together:
#
# 1. grep: no forbidden call or type in core/src outside the feature-gated adapters allowed to
#    use them (ALLOWED below), and no `allow(clippy::disallowed_*)` outside them either (so the
#    clippy rule cannot be switched off quietly elsewhere). Comments are not code and are skipped.
# 2. clippy on a probe: a throwaway crate that uses every forbidden item once is linted with
#    core/clippy.toml (CLIPPY_CONF_DIR); each must be reported. This fails if an entry is dropped
#    from core/clippy.toml, if a path there stops resolving, or if the file stops being read.
#    The core itself is linted with that file by scripts/test.sh (`-D warnings`).
#
# Usage: ./scripts/check-sans-io.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# Files of core/src allowed to use the clock / threads, each with its reason at the allow.
ALLOWED=(
  core/src/clock.rs           # feature wall-clock: the one reading of the system clock
  core/src/precise/zmq_sub.rs # feature zmq: the receiver thread, replay deadlines, poll sleeps
  core/src/replica/nats.rs    # feature nats: the transport thread, its runtime's timers
)
FORBIDDEN='SystemTime::now|Instant::now|\.elapsed\(|thread::(spawn|scope|sleep|Builder)|\b(TcpStream|TcpListener|UdpSocket)\b|allow\(clippy::disallowed_'

fail=0

# --- 1. grep ---------------------------------------------------------------------------------
allowed_re="^($(IFS='|'; echo "${ALLOWED[*]}" | sed 's/\./\\./g')):"
hits=$(grep -rnE --include='*.rs' "$FORBIDDEN" core/src | grep -vE "$allowed_re" || true)
# Keep the hits whose code (the line before any `//`) still matches.
hits=$(printf '%s\n' "$hits" | FORBIDDEN="$FORBIDDEN" perl -ne '
  next unless /^([^:]+:\d+:)(.*)$/; my ($at, $line) = ($1, $2);
  (my $code = $line) =~ s{//.*}{}; print "$at$line\n" if $code =~ /$ENV{FORBIDDEN}/;')
if [ -n "$hits" ]; then
  echo "sans-IO: clock, thread or socket use (or an allow of the disallowed_* lints) in core/src outside ${ALLOWED[*]}:" >&2
  sed 's/^/  /' <<<"$hits" >&2
  echo "  time is a parameter (now_ms); see core/clippy.toml" >&2
  fail=1
fi

# --- 1b. RouterCore holds no lock ------------------------------------------------------------
# RouterCore is a plain single-threaded state machine: no Mutex, ArcSwap, atomics, thread-locals
# or RefCells in the router's files except router/mod.rs (Router, the thread-safe wrapper) and
# router/kv_cell.rs (the precise index's two copies, which only a Router turns on).
sync_hits=$(grep -nE 'Mutex|RwLock|ArcSwap|thread_local|RefCell|Atomic[A-Z]' core/src/router/*.rs \
  | grep -vE '^core/src/router/(mod|kv_cell)\.rs:' | perl -ne '/^([^:]+:\d+:)(.*)$/ or next; (my $c = $2) =~ s{//.*}{}; print if $c =~ /\S/ && $c =~ /Mutex|RwLock|ArcSwap|thread_local|RefCell|Atomic[A-Z]/' || true)
if [ -n "$sync_hits" ]; then
  echo "sans-IO: synchronization in RouterCore (core/src/router/, outside mod.rs):" >&2
  sed 's/^/  /' <<<"$sync_hits" >&2
  fail=1
fi

# --- 2. clippy on a probe --------------------------------------------------------------------
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
mkdir -p "$probe/src"
cat >"$probe/Cargo.toml" <<'EOF'
[package]
name = "sans-io-probe"
version = "0.0.0"
edition = "2021"
publish = false

[workspace]
EOF
cat >"$probe/src/lib.rs" <<'EOF'
//! Uses every item core/clippy.toml forbids (never run, only linted).
pub fn probe() {
    let _ = std::time::SystemTime::now();
    let _ = std::time::UNIX_EPOCH.elapsed();
    let t = std::time::Instant::now();
    let _ = t.elapsed();
    let _ = std::thread::spawn(|| {});
    let _ = std::thread::Builder::new().spawn(|| {});
    std::thread::scope(|_| {});
    std::thread::sleep(std::time::Duration::ZERO);
    let _ = std::net::TcpStream::connect("127.0.0.1:9");
    let _ = std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], 9).into(), std::time::Duration::ZERO);
    let _ = std::net::TcpListener::bind("127.0.0.1:0");
    let _ = std::net::UdpSocket::bind("127.0.0.1:0");
}
EOF
expected=(
  "disallowed method \`std::time::SystemTime::now\`"
  "disallowed method \`std::time::SystemTime::elapsed\`"
  "disallowed method \`std::time::Instant::now\`"
  "disallowed method \`std::time::Instant::elapsed\`"
  "disallowed method \`std::thread::spawn\`"
  "disallowed method \`std::thread::Builder::spawn\`"
  "disallowed method \`std::thread::scope\`"
  "disallowed method \`std::thread::sleep\`"
  "disallowed method \`std::net::TcpStream::connect\`"
  "disallowed method \`std::net::TcpStream::connect_timeout\`"
  "disallowed method \`std::net::TcpListener::bind\`"
  "disallowed method \`std::net::UdpSocket::bind\`"
  "disallowed type \`std::net::TcpStream\`"
  "disallowed type \`std::net::TcpListener\`"
  "disallowed type \`std::net::UdpSocket\`"
)
# A successful lint run is itself a failure: the probe must be rejected.
if out=$(CLIPPY_CONF_DIR="$PWD/core" cargo clippy --quiet --offline --manifest-path "$probe/Cargo.toml" \
  --target-dir "$probe/target" -- -D warnings 2>&1); then
  echo "sans-IO: clippy accepted the probe: core/clippy.toml no longer forbids anything" >&2
  fail=1
fi
for e in "${expected[@]}"; do
  if ! grep -qF "use of a $e" <<<"$out"; then
    echo "sans-IO: core/clippy.toml does not catch: $e" >&2
    fail=1
  fi
done
if grep -qiE "error reading Clippy's configuration|expected a (method|type)|does not refer to|unknown field" <<<"$out"; then
  echo "sans-IO: core/clippy.toml has invalid entries:" >&2
  grep -iE -A3 "configuration|expected a|does not refer|unknown field" <<<"$out" >&2
  fail=1
fi

if [ "$fail" -ne 0 ]; then
  exit 1
fi
echo "sans-IO: core/src clean outside ${ALLOWED[*]}; RouterCore lock-free outside the precise index's two-copy cell; core/clippy.toml catches all ${#expected[@]} forbidden items"

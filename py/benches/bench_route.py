"""`Router.route()` from Python against the native criterion numbers, on the same workloads, and
against dynamo's `RadixTree.find_matches` (the `ai-dynamo-runtime` wheel) on the precise one.

Run manually (not in CI), after building the wheel into py/.venv and the criterion benches:

    cargo bench -p kvroute-benches --bench route -- parse_and_route/64
    cargo bench -p kvroute-benches --bench precise -- 'route_http/dual'
    py/.venv/bin/pip install --no-deps ai-dynamo-runtime==1.6.1     # optional: the peer
    py/.venv/bin/python py/benches/bench_route.py

Workloads (mirroring the Rust benches):

- approx (benches/benches/route.rs, `route_approx_8k/parse_and_route/64`): 64 decode endpoints,
  16 tenants with 2k-token system prompts, the index warmed by 256 earlier 8k-token requests;
  the routed request is a follow-up turn (system prompt + most of an earlier conversation + new
  text: a partial hit), sent as a completions JSON body with an `x-session-id` header.
- precise (benches/benches/precise.rs, `precise_route_8k_W64/route_http/dual`): 64 endpoints fed
  with the BlockStored events of 256 earlier 8k-token conversations (16-token blocks, dual keys);
  the request is a token-id prompt with 3/4 of conversation 3 cached on one endpoint; `now`
  advances 1 ms per request so speculative entries expire as in steady traffic.

Each timed iteration is `route()` then `complete()`, as in the Rust benches. The overhead is the
Python median minus criterion's median for the same workload.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

import kvroute

REPO = Path(__file__).resolve().parents[2]
CRITERION = REPO / "target" / "criterion"
MASK = (1 << 64) - 1
NOW = 1_000
W = 64


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def median_us(fn: Callable[[], object], *, iters: int = 2_000, rounds: int = 15) -> float:
    """Median over `rounds` of the mean time of `iters` calls, µs."""
    for _ in range(iters // 4):
        fn()
    samples = []
    for _ in range(rounds):
        t = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter_ns() - t) / iters / 1e3)
    return statistics.median(samples)


def criterion_us(*path: str) -> float | None:
    """criterion's median for a benchmark id, µs (None if that bench has not been run)."""
    f = CRITERION.joinpath(*path, "new", "estimates.json")
    if not f.exists():
        return None
    return float(json.loads(f.read_text())["median"]["point_estimate"]) / 1e3


# ----------------------------------------------------------------------------------------------
# approx workload (benches/benches/route.rs)
# ----------------------------------------------------------------------------------------------

PROMPT_BYTES = 8192 * 4
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda", "zeta"]


def text(seed: int, length: int) -> str:
    """route.rs's `text`: xorshift64 word salad, exactly."""
    x = ((seed * 0x9E3779B97F4A7C15) & MASK) | 1
    out: list[str] = []
    n = 0
    while n < length:
        x ^= (x << 13) & MASK
        x ^= x >> 7
        x ^= (x << 17) & MASK
        w = WORDS[x % 10]
        out.append(w + " ")
        n += len(w) + 1
    return "".join(out)[:length]


def approx_router() -> tuple[kvroute.Router, bytes]:
    router = kvroute.Router()
    for i in range(W):
        ep = f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}:8000"
        router.upsert_endpoint(ep, "decode")
        router.update_metrics(ep, waiting=i % 4, running=8, kv_usage=0.3 + (i % 5) * 0.05, now=NOW)
    systems = [text(1000 + t, 2048 * 4) for t in range(16)]
    warm = []
    for r in range(4 * W):
        tail = text(r, PROMPT_BYTES - len(systems[0]))
        warm.append(router.route({"model": "llama", "prompt": systems[r % 16] + tail}, now=NOW).request_id)
    for rid in warm:
        router.complete(rid)
    prior_tail = text(3, PROMPT_BYTES - len(systems[0]))
    prompt = systems[3] + prior_tail[: len(prior_tail) - 4096]
    prompt += text(99, PROMPT_BYTES - len(prompt))
    body = json.dumps({"model": "llama", "prompt": prompt, "max_tokens": 256}, separators=(",", ":")).encode()
    return router, body


# ----------------------------------------------------------------------------------------------
# precise workload (benches/benches/precise.rs)
# ----------------------------------------------------------------------------------------------

BLOCK = 16
TENANTS = 16
SYSTEM_TOKENS = 2048
PROMPT_TOKENS = 8192
DUAL = {"index": {"mode": "precise"}, "metrics": {"staleness_ms": 1_000_000_000_000}}


def splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def tokens(stream: int, n: int) -> list[int]:
    base = splitmix(stream)
    return [splitmix((base + i) & MASK) % 150_000 for i in range(n)]


def chain_hashes(toks: list[int]) -> list[int]:
    """Engine block hashes: a chain over the blocks' tokens (any consistent values serve the
    dual-key index, which learns engine key → request key from the events)."""
    out, h = [], 0
    for i in range(len(toks) // BLOCK):
        h = splitmix(h ^ hash(tuple(toks[i * BLOCK : (i + 1) * BLOCK])) & MASK)
        out.append(h)
    return out


def content_hashes(toks: list[int]) -> list[int]:
    """Position-independent block content hashes (dynamo's `LocalBlockHash`)."""
    return [hash(tuple(toks[i * BLOCK : (i + 1) * BLOCK])) & MASK for i in range(len(toks) // BLOCK)]


class Conversation:
    def __init__(self, r: int, systems: list[list[int]]) -> None:
        self.endpoint = r % W
        self.tenant = splitmix(r ^ 0x7E) % TENANTS
        self.tokens = systems[self.tenant] + tokens(0xC0 ^ (r << 20), PROMPT_TOKENS - SYSTEM_TOKENS)
        self.hashes = chain_hashes(self.tokens)


def conversations() -> list[Conversation]:
    systems = [tokens(0x5157 ^ (t << 32), SYSTEM_TOKENS) for t in range(TENANTS)]
    return [Conversation(r, systems) for r in range(4 * W)]


def store_events(convs: list[Conversation]) -> list[tuple[int, int, list[int], list[int]]]:
    """(endpoint, parent hash or -1, block hashes, token ids) per conversation: one that lands on an
    endpoint already holding its tenant's system prompt stores only its own blocks."""
    seen: set[tuple[int, int]] = set()
    out = []
    for c in convs:
        start = 0 if (c.endpoint, c.tenant) not in seen else SYSTEM_TOKENS // BLOCK
        seen.add((c.endpoint, c.tenant))
        parent = c.hashes[start - 1] if start else -1
        out.append((c.endpoint, parent, c.hashes[start:], c.tokens[start * BLOCK :]))
    return out


def precise_router(convs: list[Conversation]) -> tuple[kvroute.Router, bytes, list[int]]:
    ids = [f"10.0.{e // 256}.{e % 256}:8000" for e in range(W)]
    router = kvroute.Router(DUAL)
    for i, ep in enumerate(ids):
        router.upsert_endpoint(ep, "decode")
        router.update_metrics(ep, waiting=i % 4, running=8, kv_usage=0.3 + (i % 5) * 0.05, now=NOW)
    seq = [0] * W
    for e, parent, hashes, toks in store_events(convs):
        seq[e] += 1
        ev = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None if parent < 0 else parent,
            "token_ids": toks,
            "block_size": BLOCK,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        router.apply_events(ids[e], msgpack.packb([1.0, [ev], 0]), seq[e], now=NOW)
    cached = PROMPT_TOKENS * 3 // 4
    ids_in = convs[3].tokens[:cached] + tokens(0xBEEF, PROMPT_TOKENS - cached)
    d = router.route({"model": "llama", "prompt": ids_in, "max_tokens": 256}, now=NOW)
    assert d.endpoint == ids[convs[3].endpoint] and d.cached_tokens == cached, (d, d.cached_tokens)
    router.complete(d.request_id)
    body = json.dumps({"model": "llama", "prompt": ids_in, "max_tokens": 256}, separators=(",", ":")).encode()
    return router, body, ids_in


def dynamo_find_matches(convs: list[Conversation], ids_in: list[int]) -> float | None:
    """dynamo's RadixTree (ai-dynamo-runtime wheel) fed the same store events; µs per
    `find_matches` of the request's 512 block content hashes."""
    try:
        from dynamo._core import RadixTree  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    tree: Any = RadixTree()
    for i, (e, parent, hashes, toks) in enumerate(store_events(convs)):
        blocks = [{"block_hash": h, "tokens_hash": c} for h, c in zip(hashes, content_hashes(toks))]
        ev = {"event_id": i, "data": {"stored": {"parent_hash": None if parent < 0 else parent, "blocks": blocks}}}
        tree.apply_event(e, json.dumps(ev).encode())
    probe = content_hashes(ids_in)
    best = max(tree.find_matches(probe).scores.items(), key=lambda kv: kv[1])
    assert best == ((convs[3].endpoint, 0), PROMPT_TOKENS * 3 // 4 // BLOCK), best
    return median_us(lambda: tree.find_matches(probe), iters=500)


# ----------------------------------------------------------------------------------------------


def main() -> int:
    rows: list[tuple[str, float | None, float | None]] = []

    router, body = approx_router()
    d = router.route(body, [("x-session-id", "s")], now=NOW)
    assert d.prefix_hit > 0.5, d.prefix_hit
    router.complete(d.request_id)
    headers = [("x-session-id", "s")]

    def approx_once() -> None:
        router.complete(router.route(body, headers, now=NOW).request_id)

    rows.append(
        (
            "approx 8k, W=64: route(bytes body) + complete",
            median_us(approx_once),
            criterion_us("route_approx_8k", "parse_and_route", "64"),
        )
    )

    convs = conversations()
    prouter, pbody, ids_in = precise_router(convs)
    now = [NOW]

    def precise_once() -> None:
        now[0] += 1
        prouter.complete(prouter.route(pbody, None, now=now[0]).request_id)

    rows.append(
        (
            "precise 8k token ids, W=64, dual keys: route(bytes body) + complete",
            median_us(precise_once, iters=1_000),
            criterion_us("precise_route_8k_W64", "route_http_dual"),
        )
    )

    print(f"kvroute {kvroute.__version__}, Python {sys.version.split()[0]}")
    print()
    print("| workload | Python µs | native µs (criterion) | overhead µs |")
    print("|---|---:|---:|---:|")
    for name, py_us, native in rows:
        assert py_us is not None
        over = f"{py_us - native:.2f}" if native is not None else "run cargo bench first"
        nat = f"{native:.2f}" if native is not None else "—"
        print(f"| {name} | {py_us:.2f} | {nat} | {over} |")
    dyn = dynamo_find_matches(convs, ids_in)
    print()
    if dyn is None:
        print("dynamo RadixTree: not installed (pip install --no-deps ai-dynamo-runtime==1.6.1)")
    else:
        print(
            f"dynamo RadixTree.find_matches (ai-dynamo-runtime), same 256 conversations, 512-block probe, "
            f"from Python: {dyn:.2f} µs (index lookup only; kvroute's route() above is the whole decision)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``kvroute`` command.

``kvroute check-config FILE``
    Validate a policy file (JSON or YAML; ``-`` reads standard input) and print the normalized
    policy, every default spelled out. An invalid policy prints the error (naming the field)
    and exits with status 1.

``kvroute simulate [options]``
    Replay a workload (the built-in synthetic multi-turn agent workload, or a JSONL trace) over
    a simulated cluster under round-robin, least-loaded and kvroute, and print the comparison
    (what ``kvroute-sim`` does). ``kvroute simulate --help`` lists the options.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvroute._errors import KvrouteError
from kvroute._native import Policy, SimulationResult, simulate

PROG = "kvroute"
#: Sessions in a ``--quick`` run (as ``kvroute-sim --quick``).
QUICK_SESSIONS = 80


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="KV-cache-aware LLM routing: policy checks and the trace simulator."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = sub.add_parser(
        "check-config",
        help="validate a policy file and print it normalized",
        description="Validate a policy file (JSON or YAML) and print the normalized policy as JSON.",
    )
    check.add_argument("file", metavar="FILE", help="policy file, or - for standard input")

    sim = sub.add_parser(
        "simulate",
        help="compare routing policies on a simulated cluster",
        description=(
            "Replay the synthetic multi-turn agent workload (or a JSONL trace) over a simulated "
            "cluster with true prefix caches under each policy, and print the comparison."
        ),
    )
    sim.add_argument("--trace", type=Path, metavar="FILE", help="replay a JSONL trace instead")
    sim.add_argument("--write-trace", type=Path, metavar="FILE", help="also write the workload as a JSONL trace")
    sim.add_argument("--policy", type=Path, metavar="FILE", help="kvroute policy file (default: the defaults)")
    sim.add_argument(
        "--policies",
        default="round-robin,least-loaded,kvroute",
        metavar="LIST",
        help="policies to compare, comma-separated (default: %(default)s)",
    )
    sim.add_argument("--endpoints", type=int, metavar="N", help="endpoints (default: 8)")
    sim.add_argument("--tenants", type=int, metavar="N", help="tenants, each with its own system prompt (default: 4)")
    sim.add_argument("--sessions", type=int, metavar="N", help="sessions (default: 1000, or 80 with --quick)")
    sim.add_argument("--turns", metavar="RANGE", help="turns per session, A-B or N (default: 6-10)")
    sim.add_argument("--rate", type=float, metavar="PER_S", help="session arrivals per second (default: 2.5)")
    sim.add_argument("--seed", type=int, default=42, help="random seed (default: %(default)s)")
    sim.add_argument("--system-tokens", metavar="RANGE", help="system prompt tokens, A-B (default: 1500-3000)")
    sim.add_argument("--user-tokens", metavar="RANGE", help="user message tokens per turn, A-B (default: 100-600)")
    sim.add_argument("--output-tokens", metavar="RANGE", help="output tokens per response, A-B (default: 40-400)")
    sim.add_argument("--think-ms", type=float, metavar="MS", help="mean think time between turns (default: 3000)")
    sim.add_argument("--cache-tokens", type=int, metavar="TOKENS", help="prefix cache per endpoint (default: 150000)")
    sim.add_argument("--kv-tokens", type=int, metavar="TOKENS", help="KV memory per endpoint (default: cache)")
    sim.add_argument("--prefill-tps", type=float, metavar="TOK_S", help="prefill tokens/s per endpoint (default: 12000)")
    sim.add_argument("--tpot-ms", type=float, metavar="MS", help="time per output token (default: 15)")
    sim.add_argument("--metrics-interval-ms", type=int, metavar="MS", help="metrics push interval (default: 100)")
    sim.add_argument("--svg", type=Path, metavar="PATH", help="write the SVG chart to PATH")
    sim.add_argument("--json", type=Path, metavar="PATH", help="write the full results as JSON to PATH")
    sim.add_argument("--quick", action="store_true", help="small run (80 sessions unless --sessions is given)")
    return parser


def _check_config(file: str) -> int:
    try:
        policy = Policy(sys.stdin.read()) if file == "-" else Policy(Path(file))
    except (KvrouteError, OSError, UnicodeDecodeError) as e:
        print(f"{PROG} check-config: {file}: {e}", file=sys.stderr)
        return 1
    print(policy.to_json())
    return 0


def _versus(k: dict[str, object], other: dict[str, object]) -> str:
    def num(r: dict[str, object], key: str) -> float:
        v = r[key]
        return float(v) if isinstance(v, (int, float)) else 0.0

    def change(key: str) -> str:
        a, b = num(k, key), num(other, key)
        return f"{(a / b - 1) * 100:+.0f}%" if b > 0 else "n/a"

    return (
        f"kvroute vs {other['policy']}: hit ratio {(num(k, 'hit_ratio') - num(other, 'hit_ratio')) * 100:+.1f} pts, "
        f"TTFT p50 {change('ttft_p50_ms')}, p90 {change('ttft_p90_ms')}, p99 {change('ttft_p99_ms')}"
    )


def _print_result(result: SimulationResult) -> None:
    print(PROG + " simulate")
    print(f"  {result.workload}")
    print(f"  {result.cluster_description}")
    print(f"  {result.requests} requests")
    print()
    print(result.table, end="")
    reports = result.reports
    for r in reports:
        line = f"  {r['policy']}: prefill busy {float(r['prefill_utilization']) * 100:.0f}% of cluster capacity"
        if r.get("summary"):
            line += f"; {r['summary']}"
        print(line)
        if r["unrouted"]:
            print(f"  {r['policy']}: {r['unrouted']} requests not routed (shed)")
    k = next((r for r in reports if r["policy"] == "kvroute"), None)
    if k is not None:
        for other in reports:
            if other is not k:
                print("  " + _versus(k, other))


def _simulate(args: argparse.Namespace) -> int:
    sessions = QUICK_SESSIONS if args.sessions is None and args.quick else args.sessions
    try:
        result = simulate(
            policy=args.policy,
            trace=args.trace,
            write_trace=args.write_trace,
            policies=[p for p in args.policies.split(",") if p],
            endpoints=args.endpoints,
            tenants=args.tenants,
            sessions=sessions,
            turns=args.turns,
            rate=args.rate,
            seed=args.seed,
            system_tokens=args.system_tokens,
            user_tokens=args.user_tokens,
            output_tokens=args.output_tokens,
            think_ms=args.think_ms,
            cache_tokens=args.cache_tokens,
            kv_tokens=args.kv_tokens,
            prefill_tps=args.prefill_tps,
            tpot_ms=args.tpot_ms,
            metrics_interval_ms=args.metrics_interval_ms,
        )
    except (KvrouteError, OSError) as e:
        print(f"{PROG} simulate: error: {e}", file=sys.stderr)
        return 1
    _print_result(result)
    try:
        if args.svg is not None:
            args.svg.write_text(result.svg())
            print(f"chart: {args.svg}")
        if args.json is not None:
            args.json.write_text(json.dumps(result.to_dict(), indent=2))
            print(f"results: {args.json}")
    except OSError as e:
        print(f"{PROG} simulate: error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvroute`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.file)
    return _simulate(args)


if __name__ == "__main__":
    sys.exit(main())

"""Replays the binding-neutral flow-control fixtures (fixtures/golden-flow, format in its
README.md) through the Python ticket API (``Router.enqueue`` / ``take_releases`` / ``tick`` /
``cancel`` / ``shutdown_queue``): the same admissions and releases, in the same order, as the
Rust replay (core/tests/golden_flow.rs)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import kvroute
from conftest import FIXTURES

GOLDEN_FLOW = sorted((FIXTURES / "golden-flow").glob("*.json"))
DEFAULT_BODY = {"model": "m", "prompt": "hello", "max_tokens": 16}


def check(path: str, expect: Any, actual: Any, errors: list[str]) -> None:
    """`expect` matches `actual`: numbers within 1e-9, objects by subset, arrays element by
    element and of equal length (the fixture README's rules)."""
    number = (int, float)
    if isinstance(expect, number) and not isinstance(expect, bool):
        if (
            not isinstance(actual, number)
            or isinstance(actual, bool)
            or not math.isclose(expect, actual, rel_tol=0, abs_tol=1e-9)
        ):
            errors.append(f"{path}: expected {expect}, got {actual!r}")
    elif isinstance(expect, dict):
        if not isinstance(actual, dict):
            errors.append(f"{path}: expected {expect}, got {actual!r}")
            return
        for k, ev in expect.items():
            if k in actual:
                check(f"{path}.{k}", ev, actual[k], errors)
            else:
                errors.append(f"{path}.{k}: missing in {actual}")
    elif isinstance(expect, list):
        if not isinstance(actual, list) or len(expect) != len(actual):
            errors.append(f"{path}: expected {expect}, got {actual!r}")
            return
        for i, (ev, av) in enumerate(zip(expect, actual)):
            check(f"{path}[{i}]", ev, av, errors)
    elif expect != actual or type(expect) is not type(actual):
        errors.append(f"{path}: expected {expect!r}, got {actual!r}")


def admission_view(a: kvroute.Admission) -> Any:
    if a.outcome == "rejected":
        assert a.rejection is not None and a.ticket is None
        return {"rejected": {"status": a.rejection.status, "reason": a.rejection.reason}}
    assert (a.outcome == "queued") == (a.ticket is not None) and a.rejection is None
    return a.outcome


@dataclass
class Held:
    """A request the replayer holds under its fixture id."""

    body: str | dict[str, Any]
    headers: dict[str, str]
    ticket: int | None
    request_id: str | None = None


class Replay:
    def __init__(self, case: dict[str, Any]) -> None:
        self.router = kvroute.Router(case["policy"])
        self.held: dict[str, Held] = {}
        self.by_ticket: dict[int, str] = {}
        for e in case["endpoints"]:
            self.router.upsert_endpoint(e["id"], e["role"])

    def route(self, id: str, now: int) -> dict[str, Any]:
        """Route the request held under `id` (admitted at once, or dispatched)."""
        h = self.held[id]
        try:
            d = self.router.route(h.body, h.headers, now=now)
        except kvroute.KvrouteError as e:
            return {"error": str(e)}
        shed = d.shed is not None
        if not shed:
            h.request_id = d.request_id
        return {"endpoint": d.endpoint, "shed": shed}

    def release_view(self, r: kvroute.Release, now: int, route: bool) -> dict[str, Any]:
        id = self.by_ticket.pop(r.ticket, f"unknown ticket {r.ticket}")
        if r.outcome == "dispatched":
            assert r.rejection is None
            v: dict[str, Any] = {"id": id, "outcome": "dispatched", "waited_ms": r.waited_ms}
            if route:
                v["route"] = self.route(id, now)
            return v
        assert r.outcome == "dropped" and r.rejection is not None
        return {
            "id": id,
            "outcome": "dropped",
            "status": r.rejection.status,
            "reason": r.rejection.reason,
            "waited_ms": r.waited_ms,
        }

    def stats_view(self) -> dict[str, Any]:
        s = self.router.flow_stats()
        return {
            "queued": s["queued"],
            "queued_bytes": s["queued_bytes"],
            "bands": {str(b["priority"]): b["queued"] for b in s["bands"]},
            "counters": s["counters"],
        }


def run_case(case: dict[str, Any], *, dict_bodies: bool = False) -> list[str]:
    name = case["name"]
    default_body = case.get("body", DEFAULT_BODY)
    r = Replay(case)
    router = r.router
    errors: list[str] = []
    for i, step in enumerate(case["steps"]):
        at = f"{name} step {i}"
        op = step["op"]
        now: int | None = step.get("now_ms")
        if op == "metrics":
            m = step["metrics"]
            router.update_metrics(
                step["endpoint"],
                waiting=m.get("waiting", 0),
                running=m.get("running", 0),
                kv_usage=m.get("kv_usage", 0.0),
                now=m.get("updated_ms", 0),
            )
        elif op == "upsert_endpoint":
            router.upsert_endpoint(step["endpoint"], step["role"])
        elif op == "remove_endpoint":
            router.remove_endpoint(step["endpoint"])
        elif op == "set_healthy":
            router.set_healthy(step["endpoint"], step["healthy"])
        elif op == "reload":
            router.reload(step["policy"])
        elif op == "admit":
            assert now is not None
            id = step["id"]
            # Serialized compactly, as the Rust replay does (serde_json: sorted keys); the body's
            # length is its size for the byte limits.
            body: str | dict[str, Any] = step.get("body", default_body)
            if not dict_bodies:
                body = json.dumps(body, separators=(",", ":"), sort_keys=True)
            headers: dict[str, str] = step.get("headers", {})
            a = router.enqueue(body, headers, now=now)
            if a.ticket is not None:
                r.by_ticket[a.ticket] = id
            r.held[id] = Held(body, headers, a.ticket)
            check(f"{at} admission", step["expect"], admission_view(a), errors)
            if a.outcome == "admit" and step.get("route", True):
                v = r.route(id, now)
                if "expect_route" in step:
                    check(f"{at} route", step["expect_route"], v, errors)
        elif op == "tick":
            router.tick(now=now)
        elif op == "releases":
            assert now is not None
            route = step.get("route", True)
            views = [r.release_view(x, now, route) for x in router.take_releases(now=now)]
            check(f"{at} releases", step["expect"], views, errors)
        elif op == "complete":
            h = r.held.get(step["id"])
            if h is None or h.request_id is None:
                errors.append(f"{at}: {step['id']} was not routed")
            else:
                router.complete(h.request_id)
        elif op == "cancel":
            h = r.held.get(step["id"])
            # A request that never queued has no ticket: ticket 0 is never issued.
            ticket = h.ticket if h is not None and h.ticket is not None else 0
            got = router.cancel(ticket)
            if got:
                r.by_ticket.pop(ticket, None)
            check(f"{at} cancel", step["expect"], got, errors)
        elif op == "shutdown":
            router.shutdown_queue()
        elif op == "stats":
            check(f"{at} stats", step["expect"], r.stats_view(), errors)
        elif op == "saturation":
            check(f"{at} saturation", step["expect"], router.flow_saturation(now=now), errors)
        else:
            raise AssertionError(f"{at}: unknown op {op}")
    if r.by_ticket:
        errors.append(f"{name}: tickets still held at the end: {sorted(r.by_ticket.values())}")
    # Every ticket ended: nothing queued, no release left untaken.
    s = router.flow_stats()
    if s["queued"] != 0 or s["releases_waiting"] != 0:
        errors.append(f"{name}: flow control still holds requests at the end: {s}")
    return errors


def test_suite_is_there_and_uses_every_op() -> None:
    assert len(GOLDEN_FLOW) >= 6, f"the suite has at least 6 cases, found {len(GOLDEN_FLOW)}"
    ops = {s["op"] for f in GOLDEN_FLOW for s in json.loads(f.read_text())["steps"]}
    for op in ("admit", "releases", "tick", "complete", "cancel", "reload", "metrics", "shutdown", "stats"):
        assert op in ops, f"no fixture uses op {op}"


@pytest.mark.parametrize("path", GOLDEN_FLOW, ids=[p.stem for p in GOLDEN_FLOW])
def test_golden_flow_case(path: Path) -> None:
    errors = run_case(json.loads(path.read_text()))
    assert not errors, f"{len(errors)} mismatches:\n" + "\n".join(errors)


@pytest.mark.parametrize("path", GOLDEN_FLOW, ids=[p.stem for p in GOLDEN_FLOW])
def test_golden_flow_case_with_dict_bodies(path: Path) -> None:
    """Bodies given as dicts (serialized by the binding, keys in document order: the same
    length, so the same byte limits) replay identically."""
    errors = run_case(json.loads(path.read_text()), dict_bodies=True)
    assert not errors, f"{len(errors)} mismatches:\n" + "\n".join(errors)

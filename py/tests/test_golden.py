"""Replays the binding-neutral golden fixture suite (fixtures/golden, format in its README.md)
through the Python API: the same decisions as the Rust replay (core/tests/golden.rs)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import kvroute
from conftest import FIXTURES

GOLDEN = sorted((FIXTURES / "golden").glob("*.json"))
RULES = {
    "decode_direct",
    "colocated_fast_path",
    "disaggregated",
    "transfer_tax_veto",
    "no_prefill_pool",
    "disaggregation_disabled",
    "shed",
}


def view(d: kvroute.Decision) -> dict[str, Any]:
    """The decision as the fixtures see it (fixtures/golden/README.md)."""
    scores = d.scores
    j = d.judgment
    t = d.transfer
    return {
        "request_id": d.request_id,
        "policy_version": d.policy_version,
        "rule": d.rule,
        "mode": d.mode,
        "endpoint": d.endpoint,
        "prefill_endpoint": d.prefill_endpoint,
        "shed": d.shed is not None,
        "status": d.shed.status if d.shed is not None else None,
        "headers": d.headers,
        "prefix_hit": d.prefix_hit,
        "cached_tokens": d.cached_tokens,
        "input_tokens": d.input_tokens,
        "relaxed_filters": d.relaxed_filters,
        "judgment": {
            "horizon": j.horizon,
            "risk": j.risk,
            "bypass_probability": j.bypass_probability,
            "source": j.source,
        },
        "transfer_pays": t.pays if t is not None else None,
        "filtered": {e: s.filtered for e, s in scores.items()},
        "scores": {
            e: {
                "matched_blocks": s.matched_blocks,
                "cached_tokens": s.cached_tokens,
                "precise": s.precise,
                "prefix_hit": s.prefix_hit,
                "lora": s.lora,
                "queue": s.queue,
                "kv_usage": s.kv_usage,
                "session": s.session,
                "inflight": s.inflight,
                "total": s.total,
            }
            for e, s in scores.items()
        },
    }


def check(path: str, expect: Any, actual: Any, errors: list[str]) -> None:
    """`expect` matches `actual`: numbers within 1e-9, objects by subset except `headers`."""
    number = (int, float)
    if isinstance(expect, number) and not isinstance(expect, bool):
        if not isinstance(actual, number) or isinstance(actual, bool) or not math.isclose(
            expect, actual, rel_tol=0, abs_tol=1e-9
        ):
            errors.append(f"{path}: expected {expect}, got {actual}")
    elif isinstance(expect, dict):
        if not isinstance(actual, dict):
            errors.append(f"{path}: expected {expect}, got {actual}")
            return
        if path.endswith("headers") and len(expect) != len(actual):
            errors.append(f"{path}: expected exactly {expect}, got {actual}")
            return
        for k, ev in expect.items():
            if k in actual:
                check(f"{path}.{k}", ev, actual[k], errors)
            else:
                errors.append(f"{path}.{k}: missing in actual {actual}")
    elif expect != actual or type(expect) is not type(actual):
        errors.append(f"{path}: expected {expect!r}, got {actual!r}")


def error_kind(e: Exception) -> tuple[str, str | None, str | None]:
    if isinstance(e, kvroute.RequestError):
        return "request", e.field, e.header
    if isinstance(e, kvroute.NoEndpointsError):
        return "no_endpoints", None, None
    return "other", None, None


def run_case(case: dict[str, Any]) -> list[str]:
    name = case["name"]
    router = kvroute.Router(case.get("policy"))
    for e in case["endpoints"]:
        router.upsert_endpoint(e["id"], e["role"])
    errors: list[str] = []
    for i, step in enumerate(case["steps"]):
        at = f"{name} step {i}"
        op = step["op"]
        if op == "metrics":
            m = step["metrics"]
            router.update_metrics(
                step["endpoint"],
                waiting=m.get("waiting", 0),
                running=m.get("running", 0),
                kv_usage=m.get("kv_usage", 0.0),
                lora_running=m.get("lora_running", ()),
                lora_waiting=m.get("lora_waiting", ()),
                max_lora=m.get("max_lora"),
                kv_capacity_tokens=m.get("kv_capacity_tokens"),
                now=m.get("updated_ms", 0),
            )
        elif op == "upsert_endpoint":
            router.upsert_endpoint(step["id"], step["role"])
        elif op == "remove_endpoint":
            router.remove_endpoint(step["id"])
        elif op == "set_healthy":
            router.set_healthy(step["id"], step["healthy"])
        elif op == "reload":
            router.reload(step["policy"])
        elif op == "resync":
            router.resync_stream(step["endpoint"], now=step["now_ms"])
        elif op == "events":
            payload = bytes.fromhex(step["payload_hex"])
            try:
                out = router.apply_events(step["endpoint"], payload, step["seq"], now=step["now_ms"])
            except kvroute.EventError as e:
                if step.get("expect_error", {}).get("kind") != "decode":
                    errors.append(f"{at}: events raised {e!r}, expected {step.get('expect')}")
                continue
            if "expect_error" in step:
                errors.append(f"{at}: events gave {out!r}, expected an error")
            elif "expect" in step:
                actual: dict[str, Any] = {"verdict": out.verdict, "blocks": out.blocks, "events": out.events}
                if out.verdict == "gap":
                    actual.update(expected=out.expected, got=out.got)
                check(at, step["expect"], actual, errors)
        elif op == "reload_invalid":
            before = router.policy_version
            try:
                router.reload(step["policy"])
                errors.append(f"{at}: invalid policy was accepted")
            except kvroute.ConfigError:
                pass
            assert router.policy_version == before
        elif op == "complete":
            try:
                router.complete(step["request_id"])
                if "expect_error" in step:
                    errors.append(f"{at}: complete succeeded, expected {step['expect_error']}")
            except kvroute.StateError as e:
                if step.get("expect_error", {}).get("kind") != e.kind:
                    errors.append(f"{at}: complete raised {e!r}, expected {step.get('expect_error')}")
        elif op == "route":
            if "body" in step:
                # Serialized compactly, as the Rust replay does (serde_json: sorted keys).
                body: str | dict[str, Any] = json.dumps(step["body"], separators=(",", ":"), sort_keys=True)
            else:
                body = step["body_raw"]
            headers = step.get("headers", {})
            try:
                d = router.route(body, headers, now=step["now_ms"])
            except kvroute.KvrouteError as e:
                expect = step.get("expect_error")
                if expect is None:
                    errors.append(f"{at}: unexpected error {e!r}")
                    continue
                kind, field, header = error_kind(e)
                if expect["kind"] != kind:
                    errors.append(f"{at}: expected error {expect}, got {e!r}")
                if "field" in expect and expect["field"] != field:
                    errors.append(f"{at}: expected error field {expect['field']}, got {e!r}")
                if "header" in expect and expect["header"] != header:
                    errors.append(f"{at}: expected error header {expect['header']}, got {e!r}")
                continue
            if "expect_error" in step:
                errors.append(f"{at}: expected an error, got {view(d)}")
                continue
            if "expect" in step:
                check(at, step["expect"], view(d), errors)
            if step.get("complete", False) and d.shed is None:
                router.complete(d.request_id)
        else:
            raise AssertionError(f"{at}: unknown op {op}")
    return errors


def test_suite_is_there_and_covers_every_rule() -> None:
    assert len(GOLDEN) >= 25, f"the suite has at least 25 cases, found {len(GOLDEN)}"
    rules = {r for f in GOLDEN for r in RULES if f'"rule": "{r}"' in f.read_text()}
    assert rules == RULES


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_case(path: Path) -> None:
    errors = run_case(json.loads(path.read_text()))
    assert not errors, f"{len(errors)} mismatches:\n" + "\n".join(errors)


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_case_with_dict_bodies(path: Path) -> None:
    """Passing each body as a dict (serialized by the binding, keys in document order) gives
    the same decisions."""
    case = json.loads(path.read_text())
    for step in case["steps"]:
        if step["op"] == "route" and "body" in step:
            step["body_raw"] = step.pop("body")
    errors = run_case(case)
    assert not errors, f"{len(errors)} mismatches:\n" + "\n".join(errors)

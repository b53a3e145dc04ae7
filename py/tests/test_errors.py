"""Garbage in: every bad input raises the documented exception class with structured attributes,
wrong Python types raise TypeError, and nothing about the router's state changes."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pytest

import kvroute
from conftest import EP1, EP2, NOW, chat
from events import batch, stored


def snapshot(r: kvroute.Router) -> tuple[Any, ...]:
    """Everything observable about the router's state except the error counters."""
    s = r.stats()
    counters = {k: v for k, v in s["counters"].items() if k not in ("route_errors", "reload_failures")}
    return (r.policy_version, r.policy.to_json(), r.endpoints(), s["inflight_requests"], s["index"], s["precise"], counters)


def unchanged(r: kvroute.Router, call: Callable[[], object], exc: type[BaseException]) -> BaseException:
    """`call()` raises `exc` and leaves the router's state as it was."""
    before = snapshot(r)
    with pytest.raises(exc) as info:
        call()
    assert snapshot(r) == before, f"{exc.__name__} changed the state"
    return info.value


def test_hierarchy() -> None:
    for cls in (
        kvroute.ConfigError,
        kvroute.RequestError,
        kvroute.EventError,
        kvroute.StateError,
        kvroute.NoEndpointsError,
        kvroute.SubscribeError,
        kvroute.TokenizerError,
        kvroute.MetricsError,
        kvroute.SimulationError,
    ):
        assert issubclass(cls, kvroute.KvrouteError)
    assert issubclass(kvroute.NoEndpointsError, kvroute.StateError)
    for cls in (kvroute.ConfigError, kvroute.RequestError, kvroute.EventError):
        assert issubclass(cls, ValueError), "bad input values are ValueErrors too"


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "kind", "field", "in_message"),
    [
        ('{"modes": {', "parse", ".", "EOF"),
        ("{\"modes\": {\"nope\": 1}}", "parse", "modes.nope", "unknown field"),
        ({"modes": {"bypass_prefix_hit": 1.5}}, "invalid", "modes.bypass_prefix_hit", "1.5"),
        ({"scoring": {"weights": {"queue": "high"}}}, "parse", "scoring.weights.queue", "string"),
        ("modes: [1, 2\n", "parse", ".", "yaml"),
        ("just text", "parse", ".", "mapping"),
        ({"modes": []}, "parse", "modes", "mapping"),
        (b"\xff\xfe", None, None, None),
    ],
)
def test_bad_config(
    router: kvroute.Router, config: object, kind: str | None, field: str | None, in_message: str | None
) -> None:
    if kind is None:
        unchanged(router, lambda: router.reload(config), UnicodeDecodeError)  # type: ignore[arg-type]
        return
    for make in (kvroute.Router, kvroute.Policy):
        with pytest.raises(kvroute.ConfigError) as e:
            make(config)  # type: ignore[arg-type]
        assert (e.value.kind, e.value.field) == (kind, field), e.value
        assert in_message is not None and in_message in str(e.value)
        assert field is not None and field in str(e.value)
    err = unchanged(router, lambda: router.reload(config), kvroute.ConfigError)  # type: ignore[arg-type]
    assert isinstance(err, kvroute.ConfigError) and err.field == field
    assert router.stats()["counters"]["reload_failures"] >= 1
    # The old policy keeps serving.
    d = router.route(chat("x"), now=NOW)
    assert d.policy_version == 1


def test_invalid_value_names_field_value_and_reason() -> None:
    with pytest.raises(kvroute.ConfigError) as e:
        kvroute.Policy({"modes": {"bypass_prefix_hit": 1.5}})
    assert (e.value.kind, e.value.field, e.value.value) == ("invalid", "modes.bypass_prefix_hit", "1.5")
    assert e.value.reason


@pytest.mark.parametrize("config", [42, 1.5, ["modes"], object()])
def test_config_of_the_wrong_type(router: kvroute.Router, config: object) -> None:
    with pytest.raises(TypeError, match="config must be"):
        kvroute.Router(config)  # type: ignore[arg-type]
    unchanged(router, lambda: router.reload(config), TypeError)  # type: ignore[arg-type]
    unchanged(router, lambda: router.reload(None), TypeError)  # type: ignore[arg-type]


def test_missing_config_file(tmp_path: Any) -> None:
    with pytest.raises(FileNotFoundError):
        kvroute.Router(tmp_path / "nope.yaml")
    with pytest.raises(IsADirectoryError):
        kvroute.Policy(tmp_path)


# ----------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "headers", "kind", "attr", "value"),
    [
        (b'{"model": "m", "prompt": ', None, "json", "line", 1),
        (b"", None, "empty_body", "kind", "empty_body"),
        ("[1, 2]", None, "field", "field", "body"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, None, "field", "field", "messages[0].content"),
        ({"model": "m", "prompt": "x", "max_tokens": -1}, None, "field", "field", "max_tokens"),
        ({"model": "m", "prompt": [1, "two"]}, None, "field", "field", "prompt[1]"),
        ({"model": "m", "prompt": "x"}, {"x-kvroute-priority": "urgent"}, "header", "header", "x-kvroute-priority"),
        ({"model": "m", "prompt": "x"}, {"x-kvroute-risk": "9"}, "header", "header", "x-kvroute-risk"),
    ],
)
def test_bad_request(router: kvroute.Router, body: object, headers: object, kind: str, attr: str, value: object) -> None:
    err = unchanged(router, lambda: router.route(body, headers, now=NOW), kvroute.RequestError)  # type: ignore[arg-type]
    assert isinstance(err, kvroute.RequestError)
    assert err.kind == kind and getattr(err, attr) == value, repr(err)
    if isinstance(value, str) and attr != "kind":
        assert value in str(err), "the message names the field or header"
    assert router.stats()["counters"]["route_errors"] == 1


def test_huge_body() -> None:
    r = kvroute.Router()
    r.upsert_endpoint(EP1, "decode")
    big = b'{"model": "m", "prompt": "' + b"x" * (9 << 20) + b'"}'
    err = unchanged(r, lambda: r.route(big, now=NOW), kvroute.RequestError)
    assert isinstance(err, kvroute.RequestError)
    assert (err.kind, err.size, err.limit) == ("body_too_large", len(big), 8 << 20)
    small = kvroute.Router({"request": {"max_body_bytes": 100}})
    small.upsert_endpoint(EP1, "decode")
    with pytest.raises(kvroute.RequestError, match="over the limit of 100 bytes"):
        small.route(chat("x" * 200), now=NOW)


def test_invalid_utf8_body_and_headers(router: kvroute.Router) -> None:
    unchanged(router, lambda: router.route(b'{"model": "m", "prompt": "\xff"}', now=NOW), kvroute.RequestError)
    unchanged(router, lambda: router.route(chat("x"), [(b"x-session-id", b"\xff")], now=NOW), UnicodeDecodeError)


@pytest.mark.parametrize(
    ("body", "headers", "now", "exc", "match"),
    [
        (42, None, NOW, TypeError, "body must be bytes, str or dict"),
        (["model"], None, NOW, TypeError, "body must be"),
        (None, None, NOW, TypeError, "body must be"),
        ({"prompt": object()}, None, NOW, TypeError, "not JSON serializable"),
        ("{}", 42, NOW, TypeError, "headers must be a mapping"),
        ("{}", "x-session-id: s", NOW, TypeError, "headers must be a mapping"),
        ("{}", {"x-session-id": 1}, NOW, TypeError, "header values must be str or bytes"),
        ("{}", {1: "s"}, NOW, TypeError, "header names must be str or bytes"),
        ("{}", [("a", "b", "c")], NOW, TypeError, "pair"),
        ("{}", None, "soon", TypeError, None),
        ("{}", None, 1.5, TypeError, None),
        ("{}", None, -1, OverflowError, None),
    ],
)
def test_route_wrong_types(
    router: kvroute.Router, body: object, headers: object, now: object, exc: type[Exception], match: str | None
) -> None:
    err = unchanged(router, lambda: router.route(body, headers, now=now), exc)  # type: ignore[arg-type]
    if match:
        assert match in str(err)
    assert router.stats()["counters"]["route_errors"] == 0, "refused before reaching the core"


def test_no_endpoints() -> None:
    r = kvroute.Router()
    err = unchanged(r, lambda: r.route(chat("x"), now=NOW), kvroute.NoEndpointsError)
    assert isinstance(err, kvroute.NoEndpointsError) and err.kind == "no_endpoints" and err.reason
    r.upsert_endpoint("10.0.1.1:8000", "prefill")
    unchanged(r, lambda: r.route(chat("x"), now=NOW), kvroute.StateError)


def test_fail_open_endpoint_after_a_routing_error() -> None:
    r = kvroute.Router()
    assert r.fail_open_endpoint() is None
    r.upsert_endpoint("10.0.1.1:8000", "prefill")
    r.upsert_endpoint("10.0.0.1:8000", "decode")
    r.upsert_endpoint("10.0.0.2:8000", "decode")
    unchanged(r, lambda: r.route(b"{not json", now=NOW), kvroute.RequestError)
    # The core's fail-open pick: healthy decode-capable, fewest in flight, then id order.
    assert r.fail_open_endpoint() == "10.0.0.1:8000"
    d = r.route(chat("x"), now=NOW)
    other = "10.0.0.2:8000" if d.endpoint == "10.0.0.1:8000" else "10.0.0.1:8000"
    assert r.fail_open_endpoint() == other
    r.set_healthy("10.0.0.1:8000", False)
    r.set_healthy("10.0.0.2:8000", False)
    assert r.fail_open_endpoint() == "10.0.1.1:8000"
    assert r.stats()["inflight_requests"] == 1, "the fail-open pick records nothing"


def test_unknown_request(router: kvroute.Router) -> None:
    err = unchanged(router, lambda: router.complete("never-routed"), kvroute.StateError)
    assert isinstance(err, kvroute.StateError)
    assert (err.kind, err.request_id) == ("unknown_request", "never-routed")
    unchanged(router, lambda: router.complete(7), TypeError)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# Endpoint table
# ----------------------------------------------------------------------------------------------


def test_state_errors(router: kvroute.Router) -> None:
    cases: list[tuple[Callable[[], object], str, str, object]] = [
        (lambda: router.remove_endpoint("10.9.9.9:1"), "unknown_endpoint", "endpoint", "10.9.9.9:1"),
        (lambda: router.set_healthy("10.9.9.9:1", False), "unknown_endpoint", "endpoint", "10.9.9.9:1"),
        (
            lambda: router.update_metrics("10.9.9.9:1", waiting=0, running=0, kv_usage=0.1),
            "unknown_endpoint",
            "endpoint",
            "10.9.9.9:1",
        ),
        (lambda: router.upsert_endpoint("not an address", "decode"), "invalid_endpoint_id", "endpoint", "not an address"),
        (lambda: router.upsert_endpoint("10.0.0.1", "decode"), "invalid_endpoint_id", "endpoint", "10.0.0.1"),
        (lambda: router.update_metrics(EP1, waiting=0, running=0, kv_usage=2.0), "invalid_metrics", "field", "kv_usage"),
        (
            lambda: router.update_metrics(EP1, waiting=0, running=0, kv_usage=float("nan")),
            "invalid_metrics",
            "field",
            "kv_usage",
        ),
        (lambda: router.resync_stream("10.9.9.9:1"), "unknown_endpoint", "endpoint", "10.9.9.9:1"),
        (lambda: router.record_replay("10.9.9.9:1", True), "unknown_endpoint", "endpoint", "10.9.9.9:1"),
    ]
    for call, kind, attr, value in cases:
        err = unchanged(router, call, kvroute.StateError)
        assert isinstance(err, kvroute.StateError)
        assert (err.kind, getattr(err, attr)) == (kind, value), repr(err)
        assert str(value) in str(err)


def test_too_many_endpoints() -> None:
    r = kvroute.Router({"limits": {"max_endpoints": 1}})
    r.upsert_endpoint(EP1, "both")
    err = unchanged(r, lambda: r.upsert_endpoint(EP2, "both"), kvroute.StateError)
    assert isinstance(err, kvroute.StateError) and (err.kind, err.limit) == ("too_many_endpoints", 1)


def test_endpoint_argument_types(router: kvroute.Router) -> None:
    unchanged(router, lambda: router.upsert_endpoint(EP1, "boss"), ValueError)  # type: ignore[arg-type]
    unchanged(router, lambda: router.upsert_endpoint(42, "decode"), TypeError)  # type: ignore[arg-type]
    unchanged(router, lambda: router.set_healthy(EP1, "yes"), TypeError)  # type: ignore[arg-type]
    unchanged(router, lambda: router.update_metrics(EP1, waiting=-1, running=0, kv_usage=0.1), OverflowError)
    unchanged(router, lambda: router.update_metrics(EP1, waiting="3", running=0, kv_usage=0.1), TypeError)  # type: ignore[arg-type]
    unchanged(router, lambda: router.update_metrics(EP1, waiting=0, running=0, kv_usage="high"), TypeError)  # type: ignore[arg-type]
    unchanged(
        router, lambda: router.update_metrics(EP1, waiting=0, running=0, kv_usage=0.1, lora_running="sql"), TypeError
    )
    unchanged(router, lambda: router.update_metrics(EP1, 0, 0, 0.1), TypeError)  # type: ignore[call-arg]


# ----------------------------------------------------------------------------------------------
# KV events
# ----------------------------------------------------------------------------------------------


def precise_router() -> kvroute.Router:
    r = kvroute.Router({"index": {"mode": "precise"}})
    r.upsert_endpoint(EP1, "decode")
    return r


GOOD = batch(stored(list(range(64))))


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b"", "truncated"),
        (b"\xc1", "wrong_type"),
        (b"\x93\xcb\x3f\xf0", "truncated"),
        (GOOD[: len(GOOD) // 2], "truncated"),
        (GOOD + b"\x00", "trailing_bytes"),
        (b"\x91\x01", "batch_too_short"),
        (b"\xdd\xff\xff\xff\xff", "length_exceeds_input"),
        (batch({"type": "Nope"}), "unknown_event_type"),
        (batch({"type": "BlockStored", "block_hashes": [1]}), "missing_field"),
        (batch(stored(list(range(16)), medium="TAPE")), "unknown_medium"),
    ],
)
def test_broken_msgpack(payload: bytes, kind: str) -> None:
    r = precise_router()
    err = unchanged(r, lambda: r.apply_events(EP1, payload, 1, now=NOW), kvroute.EventError)
    assert isinstance(err, kvroute.EventError)
    assert err.kind == kind, repr(err)
    assert 0 <= err.offset <= len(payload)
    assert str(err).startswith(f"byte {err.offset}:"), "the message names the byte offset"
    assert r.stats()["precise"]["batches"] == 0


def test_event_error_names_event_and_field() -> None:
    r = precise_router()
    payload = batch(stored(list(range(16))), {"type": "BlockStored", "block_hashes": [1]})
    with pytest.raises(kvroute.EventError) as e:
        r.apply_events(EP1, payload, 1, now=NOW)
    assert (e.value.kind, e.value.event, e.value.field) == ("missing_field", 1, "token_ids")


def test_events_for_unknown_endpoint_and_wrong_types() -> None:
    r = precise_router()
    err = unchanged(r, lambda: r.apply_events(EP2, GOOD, 1, now=NOW), kvroute.StateError)
    assert isinstance(err, kvroute.StateError) and (err.kind, err.endpoint) == ("unknown_endpoint", EP2)
    unchanged(r, lambda: r.apply_events(EP1, GOOD.hex(), 1, now=NOW), TypeError)  # type: ignore[arg-type]
    unchanged(r, lambda: r.apply_events(EP1, GOOD, -1, now=NOW), OverflowError)
    unchanged(r, lambda: r.apply_events(EP1, GOOD, "1", now=NOW), TypeError)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# Metrics pages, subscriptions
# ----------------------------------------------------------------------------------------------


def test_bad_prometheus_pages(router: kvroute.Router) -> None:
    page = "# HELP x\nvllm:num_requests_waiting{engine=\"0\"} 3\nvllm:kv_cache_usage_perc{engine=\"0\"} 7\n"
    err = unchanged(router, lambda: router.update_metrics_from_prometheus(EP1, page, now=NOW), kvroute.MetricsError)
    assert isinstance(err, kvroute.MetricsError)
    assert (err.kind, err.line) == ("malformed", 3) and err.text and "[0, 1]" in (err.reason or "")
    err = unchanged(router, lambda: router.update_metrics_from_prometheus(EP1, "up 1\n", now=NOW), kvroute.MetricsError)
    assert isinstance(err, kvroute.MetricsError) and err.kind == "no_known_metrics"
    good = "vllm:num_requests_waiting 1\n"
    err = unchanged(
        router, lambda: router.update_metrics_from_prometheus("10.9.9.9:1", good, now=NOW), kvroute.StateError
    )
    assert isinstance(err, kvroute.StateError) and err.kind == "unknown_endpoint"
    unchanged(router, lambda: router.update_metrics_from_prometheus(EP1, good.encode(), now=NOW), TypeError)  # type: ignore[arg-type]


def test_bad_subscriptions(router: kvroute.Router) -> None:
    with pytest.raises(kvroute.SubscribeError) as e:
        router.subscribe(EP1, "localhost:5557")
    assert (e.value.kind, e.value.field) == ("invalid_config", "endpoint")
    with pytest.raises(kvroute.SubscribeError) as e:
        router.subscribe(EP1, "tcp://127.0.0.1:5557", poll_interval_ms=0)
    assert e.value.field == "poll_interval_ms"
    with pytest.raises(kvroute.SubscribeError) as e:
        router.subscribe(EP1, "tcp://bad host:1", mode="connect")
    assert e.value.kind == "socket" and e.value.op == "connect"
    with pytest.raises(kvroute.StateError):
        router.subscribe("not an id", "tcp://127.0.0.1:5557")
    with pytest.raises(ValueError, match="mode must be"):
        router.subscribe(EP1, "tcp://127.0.0.1:5557", mode="listen")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# The exceptions themselves
# ----------------------------------------------------------------------------------------------


def test_exceptions_pickle_with_their_attributes(router: kvroute.Router) -> None:
    errors: list[kvroute.KvrouteError] = []
    for call in (
        lambda: router.route(b'{"model": 1}', now=NOW),
        lambda: router.reload({"modes": {"bypass_prefix_hit": 2}}),
        lambda: router.complete("x"),
        lambda: precise_router().apply_events(EP1, b"\xc1", 1, now=NOW),
    ):
        with pytest.raises(kvroute.KvrouteError) as e:
            call()
        errors.append(e.value)
    for err in errors:
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and vars(back) == vars(err)
        assert repr(back) == repr(err) and repr(err).startswith(type(err).__name__ + "(")
    assert errors[0].field == "model"  # type: ignore[attr-defined]
    assert errors[3].offset == 0  # type: ignore[attr-defined]
    assert errors[2].field is None, "attributes that do not apply are None"  # type: ignore[attr-defined]

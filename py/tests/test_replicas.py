"""Router replicas over a real NATS server (`Router.replicate`).

The fixture starts Debian's `nats-server` (JetStream on, storage in a temporary directory,
token authentication) on a free loopback port and kills it at teardown. Convergence is polled
with bounded waits; no timing is asserted.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import pytest

import kvroute
from conftest import Nats, free_port

#: Bound of every convergence wait (seconds); the usual time is milliseconds.
WAIT_S = 30.0
ENDPOINTS = [f"10.0.1.{i}:8000" for i in range(4)]


def router() -> kvroute.Router:
    r = kvroute.Router()
    for ep in ENDPOINTS:
        r.upsert_endpoint(ep, "decode")
    return r


def options(nats: Nats, replica_id: str, fleet: str, **extra: Any) -> dict[str, Any]:
    return {"url": nats.url, "fleet": fleet, "replica_id": replica_id, "token": nats.token, **extra}


def body(tenant: int) -> dict[str, Any]:
    return {
        "model": "m",
        "prompt": "system prompt " * 40 + f"tenant {tenant} asks a long question about caches",
        "max_tokens": 8,
    }


def wait_until(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.01)


def inflight(r: kvroute.Router) -> int:
    n: int = r.stats()["inflight_requests"]
    return n


def test_two_replicas_share_inflight_prefixes_and_completions(nats: Nats) -> None:
    a, b = router(), router()
    with a.replicate(options(nats, "a", "share")) as ra, b.replicate(options(nats, "b", "share")) as rb:
        assert ra.running and rb.running and ra.replica_id == "a" and rb.fleet == "share"
        wait_until(lambda: bool(ra.stats()["connected"] and rb.stats()["inbound_ready"]), "both connected")
        d = a.route(body(1), {"x-request-id": "r1"}, now=kvroute.now_ms())
        ra.flush()
        wait_until(lambda: inflight(b) == 1, f"b sees a's request in flight: {rb.stats()}")
        # b routes the same prompt: a's decision told it where the prefix lives.
        d2 = b.route(body(1), {"x-request-id": "r2"}, now=kvroute.now_ms())
        assert d2.endpoint == d.endpoint
        assert d2.prefix_hit > 0.5, d2.prefix_hit
        a.complete(d.request_id)
        # a's completion reaches b (b's own request stays), b's request reaches a.
        wait_until(lambda: inflight(b) == 1 and inflight(a) == 1, f"completion applied: {rb.stats()}")
        s = rb.stats()
        assert s["replica"]["completions_applied"] == 1, s
        assert s["replica"]["effects_applied"] >= 1, s
        assert s["replica"]["malformed"] == 0 and s["publish_errors"] == 0, s
        assert s["last_error"] is None or "authorization" not in s["last_error"].lower(), s
        rs = b.replica_stats()
        assert rs is not None and rs["replica_id"] == "b" and rs["completions_applied"] == 1
    # the `with` blocks stopped both: replication is off, routing goes on
    assert not ra.running and not rb.running
    assert a.replica_stats() is None and b.replica_stats() is None
    assert a.route(body(2), now=kvroute.now_ms()).endpoint in ENDPOINTS
    # after the stop, the counters at the stop
    assert rb.stats()["replica"]["completions_applied"] == 1
    assert rb.stats()["connected"] is False


def test_wrong_token_never_connects_and_is_not_applied(nats: Nats) -> None:
    good, bad = router(), router()
    with good.replicate(options(nats, "good", "auth")) as rg:
        wait_until(lambda: bool(rg.stats()["inbound_ready"]), "the good replica is up")
        with bad.replicate({**options(nats, "bad", "auth"), "token": "not-the-token"}) as rbad:
            wait_until(
                lambda: rbad.stats()["server_errors"] > 0
                or "authorization" in (rbad.stats()["last_error"] or "").lower(),
                f"the server refuses the bad token: {rbad.stats()}",
            )
            for i in range(5):
                bad.route(body(10 + i), now=kvroute.now_ms())
            rbad.flush()
            # The good replica's own heartbeats come back and prove its inbound side runs; the
            # bad replica's requests never arrive.
            seen = rg.stats()["received"]
            wait_until(lambda: rg.stats()["received"] >= seen + 2, "the good replica keeps receiving")
            s = rbad.stats()
            assert s["connected"] is False and s["connects"] == 0, s
            assert s["published"] == 0, s
            assert inflight(good) == 0
            assert rg.stats()["replica"]["effects_applied"] == 0
            assert rg.stats()["replica"]["peers"] == 0


def test_bad_options_raise_typed_errors() -> None:
    r = router()
    cases: list[tuple[Any, str]] = [
        ("{not json", "options"),
        ({"replica_id": "x", "nope": 1}, "options"),
        ({"replica_id": 5}, "options"),
        ({"replica_id": "x", "flush_interval_ms": -1}, "options"),
        ({"url": "nats://127.0.0.1:1"}, "replica_id"),
        ({"replica_id": "has space"}, "replica_id"),
        ({"replica_id": "x", "flush_interval_ms": 0}, "flush_interval_ms"),
        ({"replica_id": "x", "password": "p"}, "password"),
        ({"replica_id": "x", "url": " "}, "url"),
        ({"replica_id": "x", "stream": {"max_age_s": 0}}, "stream"),
    ]
    for opts, field in cases:
        with pytest.raises(kvroute.ReplicationConfigError) as info:
            r.replicate(opts)
        e = info.value
        assert isinstance(e, kvroute.ConfigError) and isinstance(e, kvroute.ReplicationError)
        assert isinstance(e, ValueError)
        assert e.kind == "invalid_options" and e.field == field, (opts, repr(e))
        assert e.reason
    for wrong in (None, 5, b"{}", ["replica_id"]):
        with pytest.raises(TypeError):
            r.replicate(wrong)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        r.replicate({"replica_id": "x", "token": object()})
    assert r.replica_stats() is None, "nothing was enabled"
    assert issubclass(kvroute.ReplicationError, kvroute.KvrouteError)


def test_stop_is_idempotent_and_one_replication_at_a_time(nats: Nats) -> None:
    r = router()
    rep = r.replicate(options(nats, "solo", "stop"))
    assert "running=True" in repr(rep)
    with pytest.raises(kvroute.ReplicationError) as info:
        r.replicate(options(nats, "solo2", "stop"))
    assert info.value.kind == "already_replicating" and info.value.replica_id == "solo"
    assert r.replica_stats() is not None
    rep.stop()
    rep.stop()
    rep.flush()  # a no-op after the stop
    assert not rep.running and r.replica_stats() is None
    assert isinstance(rep.stats(), dict)
    # stopped: the router may join again, and dropping a running one stops it
    again = r.replicate(options(nats, "solo", "stop"))
    assert again.running
    del again
    gc.collect()
    wait_until(lambda: r.replica_stats() is None, "garbage collection stopped the replication")


def test_unreachable_server_is_no_error() -> None:
    # Nothing listens there: the thread keeps trying, routing goes on, stop() returns.
    r = router()
    rep = r.replicate({"url": f"nats://127.0.0.1:{free_port()}", "replica_id": "lonely", "connect_timeout_ms": 200})
    try:
        r.route(body(3), now=kvroute.now_ms())
        assert rep.stats()["connected"] is False
        assert r.replica_stats() is not None
    finally:
        rep.stop()
    assert not rep.running

"""Flow control from Python: ``await Router.admit()`` (the awaitable admission) and the ticket
API (``enqueue`` / ``take_releases`` / ``cancel``).

Every test that does not test the timer runs on a manual clock (``Router(flow_clock=...)``)
and passes ``now`` explicitly, so the core sees the same times on every run; the timer tests
use the real clock with TTLs of a few tens of milliseconds, bounded by ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import gc
import queue
import random
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

import kvroute
from kvroute._flow import Dispatcher

EP1 = "10.0.0.1:8000"
EP2 = "10.0.0.2:8000"
BODY = {"model": "m", "prompt": "hello", "max_tokens": 16}
#: Hard limit of one test's event loop.
TEST_TIMEOUT_S = 10.0


def flow_policy(per_endpoint: int = 1, **flow: Any) -> dict[str, Any]:
    """Flow control on, the concurrency detector: `per_endpoint` requests in flight each."""
    return {
        "flow_control": {
            "enabled": True,
            "saturation_detector": {"kind": "concurrency", "max_requests_per_endpoint": per_endpoint},
            **flow,
        }
    }


class Clock:
    """A manual clock for ``flow_clock``: milliseconds, moved by the test."""

    def __init__(self, t: int = 0) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def make_router(
    policy: dict[str, Any] | None = None, endpoints: tuple[str, ...] = (EP1,), clock: Callable[[], int] | None = None
) -> kvroute.Router:
    r = kvroute.Router(policy if policy is not None else flow_policy(), flow_clock=clock)
    for ep in endpoints:
        r.upsert_endpoint(ep, "decode")
    return r


def dispatcher(router: kvroute.Router) -> Dispatcher:
    d = router._flow_dispatcher
    assert d is not None
    return d


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(scenario(), TEST_TIMEOUT_S)

    asyncio.run(bounded())


async def settle() -> None:
    """Let every ready task run (each resolved admission resumes)."""
    for _ in range(5):
        await asyncio.sleep(0)


def assert_nothing_held(router: kvroute.Router) -> None:
    """No request queued, no release left untaken, no admission waiting, no timer armed."""
    s = router.flow_stats()
    assert (s["queued"], s["releases_waiting"]) == (0, 0), s
    d = router._flow_dispatcher
    if d is not None:
        assert (d.waiting, d.tickets(), d.timers()) == (0, [], 0)


# --------------------------------------------------------------------------------------------
# value classes and the ticket API
# --------------------------------------------------------------------------------------------


def test_value_classes_and_header() -> None:
    assert kvroute.HEADER_DROPPED_REASON == "x-llm-d-request-dropped-reason"
    r = make_router(flow_policy(max_requests=1))
    a = r.enqueue(BODY, now=0)
    assert (a.outcome, a.ticket, a.rejection) == ("admit", None, None)
    assert repr(a) == "Admission(outcome='admit')"
    r.route(BODY, now=0)
    q = r.enqueue(BODY, now=1)
    assert q.outcome == "queued" and isinstance(q.ticket, int) and q.ticket > 0 and q.rejection is None
    assert repr(q) == f"Admission(outcome='queued', ticket={q.ticket})"
    full = r.enqueue(BODY, now=2)
    assert full.outcome == "rejected" and full.ticket is None
    rej = full.rejection
    assert rej is not None
    assert (rej.status, rej.reason, rej.code) == (429, "rejected-saturated", 1)
    assert rej.header == ("x-llm-d-request-dropped-reason", "rejected-saturated")
    assert rej.headers == {"x-llm-d-request-dropped-reason": "rejected-saturated"}
    assert repr(rej) == "Rejection(status=429, reason='rejected-saturated')"
    assert rej == r.enqueue(BODY, now=3).rejection and hash(rej) == hash(full.rejection)
    r.shutdown_queue()
    (rel,) = r.take_releases(now=4)
    assert (rel.ticket, rel.outcome, rel.waited_ms) == (q.ticket, "dropped", 2)  # shut down at 3
    assert rel.rejection is not None and (rel.rejection.status, rel.rejection.reason) == (503, "rejected-shutting-down")
    assert repr(rel) == (
        f"Release(ticket={q.ticket}, outcome='dropped', "
        "rejection=Rejection(status=503, reason='rejected-shutting-down'), waited_ms=2)"
    )
    assert r.next_flow_deadline() is None
    assert r.flow_stats()["shutting_down"] is True
    assert r.flow_saturation(now=5)["decode_endpoints"] == 1


def test_ticket_api_dispatch_and_cancel() -> None:
    r = make_router(flow_policy(default_request_ttl_ms=100))
    assert r.enqueue(BODY, now=0).outcome == "admit"
    d = r.route(BODY, now=0)
    t1, t2 = r.enqueue(BODY, now=1).ticket, r.enqueue(BODY, now=2).ticket
    assert t1 is not None and t2 is not None and t1 != t2
    assert r.next_flow_deadline() == 101
    assert r.cancel(t2) is True and r.cancel(t2) is False and r.cancel(0) is False
    r.complete(d.request_id)  # with tickets, completions only change the core: releases wait
    assert r.flow_stats()["queued"] == 1
    r.tick(now=10)
    assert r.flow_stats()["releases_waiting"] == 1
    (rel,) = r.take_releases(now=11)
    assert (rel.ticket, rel.outcome, rel.rejection, rel.waited_ms) == (t1, "dispatched", None, 9)
    c = r.flow_stats()["counters"]
    assert (c["enqueued"], c["dispatched"], c["cancelled"]) == (2, 1, 1)


def test_flow_control_off_admits_everything() -> None:
    r = make_router({})
    assert r.enqueue(BODY, now=0).outcome == "admit"
    assert r.take_releases(now=0) == [] and r.next_flow_deadline() is None
    assert r.flow_stats()["enabled"] is False

    async def scenario() -> None:
        r2 = make_router({})
        for i in range(3):
            a = await r2.admit(BODY, now=i)
            assert a == kvroute.Admitted(None, 0) and not a.queued
        assert dispatcher(r2).waiting == 0

    run(scenario)


def test_bad_input_raises_typed_errors() -> None:
    r = make_router()
    with pytest.raises(kvroute.RequestError) as e:
        r.enqueue(b"{not json", now=0)
    assert e.value.kind == "json"
    with pytest.raises(kvroute.RequestError) as e:
        r.enqueue(BODY, {"x-kvroute-priority": "urgent"}, now=0)
    assert e.value.header == "x-kvroute-priority"
    with pytest.raises(TypeError):
        r.enqueue(42, now=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        r.cancel("7")  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        r.cancel(-1)
    with pytest.raises(TypeError, match="flow_clock must be a callable"):
        kvroute.Router(flow_clock=3)  # type: ignore[arg-type]
    assert r.flow_stats()["counters"]["enqueued"] == 0

    async def scenario() -> None:
        r2 = make_router()
        with pytest.raises(kvroute.RequestError):
            await r2.admit(b"", now=0)
        with pytest.raises(TypeError):
            await r2.admit(42, now=0)  # type: ignore[arg-type]
        assert_nothing_held(r2)

    run(scenario)


def test_one_way_per_router() -> None:
    """A router is driven with tickets or by `await admit()`, not both: the other party would
    take releases of tickets it does not hold."""
    r = make_router()
    r.enqueue(BODY, now=0)
    with pytest.raises(RuntimeError, match="driven with tickets"):
        _ = r.admit(BODY, now=0)  # refused at the call, before a coroutine exists

    async def scenario() -> None:
        r2 = make_router()
        await r2.admit(BODY, now=0)
        for call in (
            lambda: r2.enqueue(BODY, now=0),
            lambda: r2.take_releases(now=0),
            lambda: r2.cancel(1),
        ):
            with pytest.raises(RuntimeError, match="held by `await router.admit"):
                call()
        r2.tick(now=1)  # allowed both ways
        assert r2.flow_stats()["counters"]["admitted"] == 1

    run(scenario)


# --------------------------------------------------------------------------------------------
# the awaitable admission
# --------------------------------------------------------------------------------------------


def test_admitted_immediately() -> None:
    async def scenario() -> None:
        r = make_router(clock=Clock())
        a = await r.admit(BODY, now=0)
        assert a == kvroute.Admitted(ticket=None, waited_ms=0) and not a.queued
        assert r.route(BODY, now=0).endpoint == EP1
        assert r.flow_stats()["counters"]["admitted"] == 1
        assert_nothing_held(r)

    run(scenario)


def test_queued_then_released_by_a_completion() -> None:
    async def scenario() -> None:
        clock = Clock()
        r = make_router(clock=clock)
        await r.admit(BODY, now=0)
        first = r.route(BODY, now=0)
        waiting = asyncio.create_task(r.admit(BODY, {"x-llm-d-inference-fairness-id": "b"}, now=1))
        await settle()
        assert not waiting.done()
        assert r.flow_stats()["queued"] == 1 and dispatcher(r).waiting == 1
        clock.t = 5
        r.complete(first.request_id)  # a dispatch opportunity at the clock's 5
        admitted = await waiting
        assert admitted.queued and admitted.waited_ms == 4
        assert r.route(BODY, now=5).endpoint == EP1
        c = r.flow_stats()["counters"]
        assert (c["enqueued"], c["dispatched"]) == (1, 1)
        assert_nothing_held(r)

    run(scenario)


def test_released_by_metrics_updates_and_a_reload() -> None:
    """Metrics updates are dispatch opportunities that release waiting admissions at once
    (the utilization detector), and so is a reload (turning flow control off releases the
    rest)."""

    async def scenario() -> None:
        clock = Clock(1_000)
        # The utilization detector: saturated while the only endpoint's queue is long.
        r = make_router({"flow_control": {"enabled": True}}, clock=clock)
        r.update_metrics(EP1, waiting=50, running=8, kv_usage=0.9, now=1_000)
        tasks = [asyncio.create_task(r.admit(BODY, now=1_000 + i)) for i in range(12)]
        await settle()
        assert r.flow_stats()["queued"] == 12 and not any(t.done() for t in tasks)
        done = 0

        async def released(at: int) -> int:
            """Route what was released; how many."""
            nonlocal done
            await settle()
            now_done = sum(t.done() for t in tasks)
            new, done = now_done - done, now_done
            for _ in range(new):
                r.route(BODY, now=at)
            return new

        clock.t = 1_010
        r.update_metrics(EP1, waiting=0, running=0, kv_usage=0.0, now=1_010)
        # Each release counts as load until routed: one opportunity releases what saturation
        # allows (5 of 5 queue slots), not the whole queue.
        assert await released(1_010) == 5
        r.upsert_endpoint(EP2, "decode")  # no metrics yet: stale, saturated
        assert await released(1_010) == 0
        clock.t = 1_020
        r.update_metrics(EP2, waiting=0, running=0, kv_usage=0.0, now=1_020)
        assert await released(1_020) == 6
        r.reload({})  # flow control off: the rest goes
        assert await released(1_020) == 1
        for t in tasks:
            assert (await t).queued
        assert_nothing_held(r)

    run(scenario)


@pytest.mark.parametrize("opportunity", ["upsert_endpoint", "set_healthy", "reload", "tick", "remove_endpoint"])
def test_each_opportunity_releases_at_once(opportunity: str) -> None:
    """The concurrency detector, one request per endpoint: EP1 is busy, one admission waits;
    the change frees capacity (a new endpoint, one made healthy, a higher limit, the busy
    request's load lapsing at a tick) and the admission is released by that call, or dropped
    by it (the pool emptied by a removal: 503)."""

    async def scenario() -> None:
        clock = Clock(0)
        r = make_router(flow_policy(no_endpoints_ttl_ms=0), clock=clock)
        if opportunity == "set_healthy":
            r.upsert_endpoint(EP2, "decode")
            r.set_healthy(EP2, False)
        await r.admit(BODY, now=0)
        if opportunity != "tick":
            r.route(BODY, now=0)  # tick: admitted, never routed (its load lapses after 1 s)
        waiting = asyncio.create_task(r.admit(BODY, now=1))
        await settle()
        assert not waiting.done()
        clock.t = 5
        if opportunity == "upsert_endpoint":
            r.upsert_endpoint(EP2, "decode")
        elif opportunity == "set_healthy":
            r.set_healthy(EP2, True)
        elif opportunity == "reload":
            r.reload(flow_policy(per_endpoint=2))
        elif opportunity == "tick":
            r.tick(now=999)
            await settle()
            assert not waiting.done()
            r.tick(now=1_000)
        else:
            r.remove_endpoint(EP1)
        await settle()
        assert waiting.done()
        if opportunity == "remove_endpoint":
            e = waiting.exception()
            assert isinstance(e, kvroute.RejectedError) and (e.status, e.reason) == (503, "rejected-no-endpoints")
        else:
            assert waiting.result().queued
        assert_nothing_held(r)

    run(scenario)


def test_rejection_outcomes() -> None:
    async def scenario() -> None:
        clock = Clock()
        # A full queue: 429 rejected-saturated at admission.
        # (Pre-queue shedding off, so that a sheddable request queues.)
        r = make_router(flow_policy(max_requests=1, shedding={"enabled": False}), clock=clock)
        await r.admit(BODY, now=0)
        d = r.route(BODY, now=0)
        held = asyncio.create_task(r.admit(BODY, now=1))
        await settle()
        with pytest.raises(kvroute.RejectedError) as e:
            await r.admit(BODY, now=2)
        err = e.value
        assert (err.status, err.reason, err.kind, err.waited_ms, err.ticket) == (
            429,
            "rejected-saturated",
            "rejected_saturated",
            0,
            None,
        )
        assert err.headers == {kvroute.HEADER_DROPPED_REASON: "rejected-saturated"}
        assert isinstance(err, kvroute.KvrouteError) and "rejected-saturated (429)" in str(err)
        # A queued sheddable request is evicted to make room for a normal one (its release
        # comes out of the admission that evicted it).
        r.complete(d.request_id)
        await held
        r.route(BODY, now=1)
        shed = asyncio.create_task(r.admit(BODY, {"x-kvroute-priority": "-1"}, now=3))
        await settle()
        normal = asyncio.create_task(r.admit(BODY, now=4))
        await settle()
        assert shed.done() and not normal.done()
        with pytest.raises(kvroute.RejectedError) as e:
            await shed
        assert (e.value.status, e.value.reason, e.value.waited_ms) == (429, "evicted-priority", 1)
        assert e.value.ticket is not None
        # Shutdown: the waiting admission gets 503 at once, later ones too.
        r.shutdown_queue()
        with pytest.raises(kvroute.RejectedError) as e:
            await normal
        assert (e.value.status, e.value.reason) == (503, "rejected-shutting-down")
        with pytest.raises(kvroute.RejectedError) as e:
            await r.admit(BODY, now=5)
        assert (e.value.status, e.value.reason) == (503, "rejected-shutting-down")
        assert_nothing_held(r)

        # The TTL, at an explicit tick: 429 rejected-ttl-expired after waiting it.
        r = make_router(flow_policy(default_request_ttl_ms=100), clock=clock)
        await r.admit(BODY, now=0)
        r.route(BODY, now=0)
        ttl = asyncio.create_task(r.admit(BODY, now=1))
        await settle()
        r.tick(now=50)
        await settle()
        assert not ttl.done()
        r.tick(now=101)
        with pytest.raises(kvroute.RejectedError) as e:
            await ttl
        assert (e.value.status, e.value.reason, e.value.waited_ms) == (429, "rejected-ttl-expired", 100)
        assert_nothing_held(r)

        # No endpoint at all, no wait for one: 503 rejected-no-endpoints.
        r = make_router(flow_policy(no_endpoints_ttl_ms=0), endpoints=(), clock=clock)
        with pytest.raises(kvroute.RejectedError) as e:
            await r.admit(BODY, now=0)
        assert (e.value.status, e.value.reason) == (503, "rejected-no-endpoints")
        assert_nothing_held(r)

    run(scenario)


def test_cancellation_removes_the_ticket() -> None:
    async def scenario() -> None:
        clock = Clock()
        r = make_router(clock=clock)
        await r.admit(BODY, now=0)
        d = r.route(BODY, now=0)
        tasks = [asyncio.create_task(r.admit(BODY, now=1 + i)) for i in range(3)]
        await settle()
        assert r.flow_stats()["queued"] == 3 and dispatcher(r).waiting == 3
        tasks[0].cancel()  # the client of the first went away
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        s = r.flow_stats()
        assert s["queued"] == 2 and s["bands"][0]["queued"] == 2 and s["counters"]["cancelled"] == 1
        assert dispatcher(r).waiting == 2 and dispatcher(r).cancelled == 1
        # wait_for's timeout cancels the same way.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.admit(BODY, now=9), 0.001)
        assert r.flow_stats()["counters"]["cancelled"] == 2 and r.flow_stats()["queued"] == 2
        # The next completion releases the second, not the cancelled first.
        clock.t = 10
        r.complete(d.request_id)
        await settle()
        assert tasks[1].done() and not tasks[2].done()
        assert (await tasks[1]).waited_ms == 8
        tasks[2].cancel()
        await settle()
        assert tasks[2].cancelled()
        c = r.flow_stats()["counters"]
        assert (c["enqueued"], c["dispatched"], c["cancelled"]) == (4, 1, 3)
        assert_nothing_held(r)

    run(scenario)


def test_a_release_racing_a_cancellation_ends_the_ticket_once() -> None:
    """The release resolves the future, then the task is cancelled before it resumes: the
    ticket ended in the release (dispatched once), the cancellation finds nothing to remove;
    cancelled first, the completion releases nothing for it."""

    async def scenario() -> None:
        clock = Clock()
        r = make_router(clock=clock)
        await r.admit(BODY, now=0)
        d = r.route(BODY, now=0)
        late = asyncio.create_task(r.admit(BODY, now=1))
        await settle()
        clock.t = 2
        r.complete(d.request_id)  # resolves late's future (the task has not resumed yet)
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        c = r.flow_stats()["counters"]
        assert (c["dispatched"], c["cancelled"]) == (1, 0)
        assert (dispatcher(r).cancelled, dispatcher(r).cancelled_after_release) == (0, 1)
        assert_nothing_held(r)
        # The released request was not routed: its load lapses by itself (the core's rule).
        assert r.flow_stats()["pending_dispatch"] == 1

        r = make_router(clock=clock)
        await r.admit(BODY, now=2)
        d = r.route(BODY, now=2)
        early = asyncio.create_task(r.admit(BODY, now=3))
        await settle()
        early.cancel()
        r.complete(d.request_id)  # the cancellation has not run yet: the ticket is still held
        with pytest.raises(asyncio.CancelledError):
            await early
        c = r.flow_stats()["counters"]
        assert c["dispatched"] + c["cancelled"] == 1
        assert_nothing_held(r)

    run(scenario)


def test_a_closed_coroutine_leaves_the_queue() -> None:
    """An admission whose coroutine is closed (never resumed: its task was dropped, its loop
    stopped) takes its ticket out of the queue too."""

    async def scenario() -> None:
        r = make_router(clock=Clock())
        await r.admit(BODY, now=0)
        r.route(BODY, now=0)
        coro = r.admit(BODY, now=1)
        coro.send(None)  # runs up to the wait on its future
        assert r.flow_stats()["queued"] == 1
        coro.close()
        assert r.flow_stats()["counters"]["cancelled"] == 1
        assert_nothing_held(r)

    run(scenario)


def test_a_failing_clock_leaks_no_ticket(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `flow_clock` that raises: the admission that needed it raises that error and leaves
    the queue; a completion, whose opportunity needed it, still completes (the error is
    reported as unraisable, not raised from `complete`)."""
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    def broken() -> int:
        raise ZeroDivisionError("clock")

    async def scenario() -> None:
        r = make_router(clock=broken)
        await r.admit(BODY, now=0)
        d = r.route(BODY, now=0)
        with pytest.raises(ZeroDivisionError):
            await r.admit(BODY, now=1)  # queued, then the timer needs the clock
        assert r.flow_stats()["queued"] == 0 and r.flow_stats()["counters"]["cancelled"] == 1
        assert_nothing_held(r)
        # Without a TTL (no deadline, no timer), the admission queues without the clock.
        r.reload(flow_policy(default_request_ttl_ms=0))
        held = asyncio.create_task(r.admit(BODY, now=2))
        await settle()
        assert r.flow_stats()["queued"] == 1
        r.complete(d.request_id)
        assert r.stats()["inflight_requests"] == 0
        assert [type(u.exc_value) for u in unraisable] == [ZeroDivisionError]
        # That opportunity did not happen: the admission still waits, for the next one.
        await settle()
        assert not held.done()
        r.tick(now=3)
        assert (await held).waited_ms == 1
        assert_nothing_held(r)

    run(scenario)


@pytest.mark.parametrize("seed", range(8))
def test_no_ticket_lost_under_random_interleavings(seed: int) -> None:
    """Random admissions (tenants, priorities, sheddable ones), cancellations at random points
    (before and after a release), completions, ticks past TTLs, metrics, reloads: every
    admission ends exactly once (admitted and routed once, rejected, or cancelled), the core's
    counters balance, and nothing is left held."""
    rng = random.Random(seed)

    async def scenario() -> None:
        clock = Clock(1_000)
        shedding = {"enabled": True, "k": 0.3, "power": 2.0, "seed": seed}
        policy = flow_policy(per_endpoint=2, max_requests=6, default_request_ttl_ms=300, shedding=shedding)
        r = make_router(policy, endpoints=(EP1, EP2), clock=clock)
        tasks: list[asyncio.Task[kvroute.Admitted]] = []
        routed: list[str] = []
        seen_tickets: set[int] = set()
        n = {"admitted_at_once": 0, "admitted_queued": 0, "refused": 0, "dropped": 0, "cancelled": 0}

        def reap() -> None:
            for t in [t for t in tasks if t.done()]:
                tasks.remove(t)
                if t.cancelled():
                    n["cancelled"] += 1
                    continue
                e = t.exception()
                if isinstance(e, kvroute.RejectedError):
                    n["refused" if e.ticket is None else "dropped"] += 1
                    continue
                assert e is None, e
                a = t.result()
                if a.ticket is None:
                    n["admitted_at_once"] += 1
                else:
                    assert a.ticket not in seen_tickets, "a ticket was dispatched twice"
                    seen_tickets.add(a.ticket)
                    n["admitted_queued"] += 1
                routed.append(r.route(BODY, now=clock.t).request_id)

        created = 0
        for _ in range(400):
            op = rng.random()
            if op < 0.40:
                headers = {
                    "x-llm-d-inference-fairness-id": f"tenant-{rng.randrange(3)}",
                    "x-kvroute-priority": str(rng.choice([-1, 0, 0, 1])),
                }
                tasks.append(asyncio.create_task(r.admit(BODY, headers, now=clock.t)))
                created += 1
            elif op < 0.48 and tasks:
                rng.choice(tasks).cancel()
            elif op < 0.75 and routed:
                r.complete(routed.pop(rng.randrange(len(routed))))
            elif op < 0.85:
                clock.t += rng.choice([1, 10, 150])
                r.tick(now=clock.t)
            elif op < 0.90:
                r.update_metrics(rng.choice([EP1, EP2]), waiting=0, running=1, kv_usage=0.2, now=clock.t)
            elif op < 0.92:
                limits = {"per_endpoint": rng.choice([1, 2]), "max_requests": rng.choice([3, 6])}
                r.reload(flow_policy(**limits, default_request_ttl_ms=300, shedding=shedding))
            # Sometimes let the resolved admissions resume, sometimes not (a cancellation can
            # then land after a release resolved the future, or before the task started).
            for _ in range(rng.randrange(3)):
                await asyncio.sleep(0)
            reap()

        # Drain: complete everything routed, tick past the TTLs, until nothing is left.
        for _ in range(500):
            await settle()
            reap()
            if not tasks and not routed:
                break
            if routed:
                r.complete(routed.pop())
            else:
                clock.t += 500
                r.tick(now=clock.t)
        assert not tasks and not routed
        c = r.flow_stats()["counters"]
        d = dispatcher(r)
        # Every admission ended exactly once, as one of these.
        assert sum(n.values()) == created
        assert n["admitted_at_once"] == c["admitted"]
        # Every ticket ended exactly once in the core: dispatched, cancelled or dropped.
        dropped_from_queue = sum(c["rejections"].values()) - n["refused"]
        assert c["enqueued"] == c["dispatched"] + c["cancelled"] + dropped_from_queue
        # ... and in the binding: seen by its admission (dispatched or dropped), removed by its
        # cancellation, or cancelled after its release was taken.
        assert c["enqueued"] == n["admitted_queued"] + n["dropped"] + d.cancelled + d.cancelled_after_release
        assert d.cancelled == c["cancelled"]
        assert len(seen_tickets) == n["admitted_queued"] <= c["dispatched"]
        assert c["dispatched"] <= n["admitted_queued"] + d.cancelled_after_release
        # Cancelled admissions: removed from the queue, after their release, or before they
        # started (never enqueued).
        assert d.cancelled + d.cancelled_after_release <= n["cancelled"]
        assert_nothing_held(r)
        assert r.stats()["inflight_requests"] == 0

    run(scenario)


def test_no_ticket_lost_with_completions_on_a_thread() -> None:
    """Completions come from a worker thread (their releases are taken there and resolved on
    the loop with call_soon_threadsafe) while the loop admits and cancels: every admission ends
    once and nothing is left held."""
    rng = random.Random(7)
    done_ids: queue.Queue[str | None] = queue.Queue()
    r = make_router(flow_policy(per_endpoint=2), endpoints=(EP1, EP2))  # the real clock

    def completer() -> None:
        while (rid := done_ids.get()) is not None:
            r.complete(rid)

    async def client(i: int) -> str:
        try:
            await r.admit(BODY, {"x-llm-d-inference-fairness-id": f"t{i % 3}"})
        except kvroute.RejectedError:
            return "rejected"
        done_ids.put(r.route(BODY).request_id)
        return "admitted"

    async def scenario() -> None:
        tasks = []
        for i in range(300):
            tasks.append(asyncio.create_task(client(i)))
            if rng.random() < 0.3:
                rng.choice(tasks).cancel()
            await asyncio.sleep(0)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 8.0)
        cancelled = sum(isinstance(x, asyncio.CancelledError) for x in results)
        admitted = results.count("admitted")
        assert cancelled + admitted + results.count("rejected") == 300
        d = dispatcher(r)
        c = r.flow_stats()["counters"]
        assert c["admitted"] + c["dispatched"] >= admitted
        assert d.cancelled == c["cancelled"]
        assert c["enqueued"] == c["dispatched"] + c["cancelled"] + sum(c["rejections"].values())

    worker = threading.Thread(target=completer)
    worker.start()
    try:
        run(scenario)
    finally:
        done_ids.put(None)
        worker.join(5.0)
    assert not worker.is_alive()
    assert_nothing_held(r)
    assert r.stats()["inflight_requests"] == 0


# --------------------------------------------------------------------------------------------
# the timer, threads, several loops
# --------------------------------------------------------------------------------------------


def test_ttl_expiry_on_the_timer() -> None:
    """No completion, no tick: the dispatcher's timer (armed at next_flow_deadline) drops the
    request when its TTL runs out, then disarms; it does not spin meanwhile."""

    async def scenario() -> None:
        r = make_router(flow_policy(default_request_ttl_ms=40))
        await r.admit(BODY)
        r.route(BODY)
        waiting = asyncio.create_task(r.admit(BODY))
        await settle()
        assert dispatcher(r).timers() == 1
        with pytest.raises(kvroute.RejectedError) as e:
            await asyncio.wait_for(waiting, 5.0)
        assert (e.value.status, e.value.reason) == (429, "rejected-ttl-expired")
        assert e.value.waited_ms >= 40
        assert 1 <= dispatcher(r).timer_fired <= 3
        assert_nothing_held(r)

        # The no-endpoint TTL: queued while the pool is empty, then 503.
        r = make_router(flow_policy(no_endpoints_ttl_ms=30), endpoints=())
        with pytest.raises(kvroute.RejectedError) as e:
            await asyncio.wait_for(r.admit(BODY), 5.0)
        assert (e.value.status, e.value.reason) == (503, "rejected-no-endpoints")
        assert_nothing_held(r)

    run(scenario)


def test_the_timer_stops_with_the_last_waiter() -> None:
    async def scenario() -> None:
        r = make_router(flow_policy(default_request_ttl_ms=60_000))
        await r.admit(BODY)
        r.route(BODY)
        waiting = asyncio.create_task(r.admit(BODY))
        await settle()
        assert dispatcher(r).timers() == 1
        waiting.cancel()
        await settle()
        assert dispatcher(r).timers() == 0 and dispatcher(r).timer_fired == 0
        # shutdown_queue ends every waiter, and so every timer.
        more = [asyncio.create_task(r.admit(BODY)) for _ in range(3)]
        await settle()
        assert dispatcher(r).timers() == 1
        r.shutdown_queue()
        await settle()
        assert all(isinstance(t.exception(), kvroute.RejectedError) for t in more)
        assert_nothing_held(r)

    run(scenario)


def test_an_overdue_deadline_backs_the_timer_off() -> None:
    """Should flow control keep answering a deadline that is already due (its answer may be
    early), the timer backs off (1, 2, 4 … ms) instead of spinning. A stand-in router that
    queues everything, never releases and always reports deadline 0."""

    class Stuck:
        def __init__(self) -> None:
            self.cancelled: list[int] = []

        def _enqueue(self, body: Any, headers: Any, now: int) -> Any:
            return type("A", (), {"ticket": 1, "rejection": None, "outcome": "queued"})()

        def _take_releases(self, now: int) -> list[kvroute.Release]:
            return []

        def _cancel(self, ticket: int) -> bool:
            self.cancelled.append(ticket)
            return True

        def next_flow_deadline(self) -> int:
            return 0

    async def scenario() -> None:
        router = Stuck()
        d = Dispatcher(router, clock=lambda: 10)  # type: ignore[arg-type]
        waiting = asyncio.create_task(d.admit(router, BODY, None, 10))  # type: ignore[arg-type]
        await asyncio.sleep(0.3)
        assert 3 <= d.timer_fired <= 12, d.timer_fired  # spinning: ~300
        waiting.cancel()
        await settle()
        assert router.cancelled == [1] and d.timers() == 0 and d.waiting == 0

    run(scenario)


def test_completion_from_another_thread() -> None:
    """A completion made on a worker thread wakes the admission waiting on the loop."""

    async def scenario() -> None:
        clock = Clock()
        r = make_router(clock=clock)
        await r.admit(BODY, now=0)
        d = r.route(BODY, now=0)
        waiting = asyncio.create_task(r.admit(BODY, now=1))
        await settle()
        clock.t = 3
        await asyncio.get_running_loop().run_in_executor(None, r.complete, d.request_id)
        admitted = await asyncio.wait_for(waiting, 5.0)
        assert admitted.waited_ms == 2
        assert_nothing_held(r)

    run(scenario)


def test_admissions_on_two_event_loops() -> None:
    """Two threads, each with its own event loop, share a router: a completion on one loop
    releases the admission waiting on the other."""
    clock = Clock()
    r = make_router(clock=clock)
    queued = threading.Event()
    result: list[Any] = []

    async def other() -> None:
        t = asyncio.create_task(r.admit(BODY, now=1))
        await settle()
        assert not t.done()
        queued.set()
        result.append(await asyncio.wait_for(t, 5.0))

    thread = threading.Thread(target=asyncio.run, args=(other(),))

    async def main() -> None:
        await r.admit(BODY, now=0)
        d = r.route(BODY, now=0)
        thread.start()
        assert await asyncio.get_running_loop().run_in_executor(None, queued.wait, 5.0)
        clock.t = 4
        r.complete(d.request_id)

    run(main)
    thread.join(5.0)
    assert not thread.is_alive()
    assert result == [kvroute.Admitted(result[0].ticket, 3)] and result[0].queued
    assert_nothing_held(r)


def test_the_dispatcher_does_not_keep_the_router_alive() -> None:
    async def scenario() -> None:
        r = make_router(clock=Clock())
        await r.admit(BODY, now=0)
        d = dispatcher(r)
        del r
        gc.collect()
        assert d._router() is None
        d.opportunity(5)  # a dispatcher without its router does nothing

    run(scenario)

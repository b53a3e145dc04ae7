"""`Router.subscribe`: the native ZMQ subscriber fed by a vLLM-style publisher on loopback (XPUB
for the live stream, ROUTER for replay, vLLM's framing and replay protocol)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

import kvroute
from events import batch, stored, token_body

EP = "10.0.0.1:8000"
OTHER = "10.0.0.2:8000"
END_SEQ = (1 << 64) - 1
WAIT_S = 10.0


def wait_for(what: str, cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


class Publisher:
    """A vLLM-like publisher: XPUB live socket (bound to a free loopback port) and a ROUTER replay
    socket answering in vLLM >= 0.26's format from a buffer of every batch."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], topic: bytes = b"kv") -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic
        self.next_seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve_replay)
        self.thread.start()

    def _serve_replay(self) -> None:
        empty = b""
        while not self.stopping.is_set():
            if not self.replay.poll(10):
                continue
            frames = self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            self.replay_requests += 1
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    self.replay.send_multipart([ident, empty, self.topic, seq.to_bytes(8, "big"), payload])
            self.replay.send_multipart([ident, empty, empty, END_SEQ.to_bytes(8, "big"), empty])

    def wait_subscribed(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if self.sock.poll(20) and self.sock.recv()[:1] == b"\x01":
                return
        raise AssertionError("no subscriber connected")

    def publish(self, payload: bytes, *, lose: bool = False) -> None:
        seq = self.next_seq
        self.next_seq += 1
        if not lose:
            self.sock.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self.buffer.append((seq, payload))

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.sock.close()
        self.replay.close()


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    p = Publisher(ctx)
    yield p
    p.close()
    ctx.term()


def precise_router() -> kvroute.Router:
    r = kvroute.Router({"index": {"mode": "precise"}})
    for ep in (EP, OTHER):
        r.upsert_endpoint(ep, "decode")
        r.update_metrics(ep, waiting=0, running=0, kv_usage=0.1)  # on the shared default clock
    return r


def test_events_flow_in_and_route(publisher: Publisher) -> None:
    r = precise_router()
    tokens = list(range(2000, 2064))
    with r.subscribe(EP, publisher.endpoint, topic="kv", replay=publisher.replay_endpoint) as sub:
        assert sub.running and sub.endpoint == EP and sub.local_endpoint == publisher.endpoint
        assert repr(sub).startswith(f"Subscription(endpoint='{EP}'")
        publisher.wait_subscribed()
        publisher.publish(batch(stored(tokens)))
        wait_for("the batch", lambda: sub.stats()["applied"] == 1)
        d = r.route(token_body(tokens))  # default `now`: the subscriber's clock
        assert (d.endpoint, d.cached_tokens) == (EP, 64)
        assert d.scores[EP].precise
    assert not sub.running
    final = sub.stop()
    assert final == sub.stats() and final["applied"] == 1 and final["batches"] == 1
    assert [e["events_healthy"] for e in r.endpoints()] == [True, False]


def test_gap_is_replayed(publisher: Publisher) -> None:
    r = precise_router()
    a, b, c = (list(range(k * 1000, k * 1000 + 64)) for k in (1, 2, 3))
    sub = r.subscribe(EP, publisher.endpoint, replay=publisher.replay_endpoint)
    try:
        publisher.wait_subscribed()
        publisher.publish(batch(stored(a), ts=1.0))
        publisher.publish(batch(stored(b), ts=2.0), lose=True)  # never arrives live
        publisher.publish(batch(stored(c), ts=3.0))
        wait_for("three applied batches", lambda: sub.stats()["applied"] == 3)
        s = sub.stats()
        assert (s["gaps"], s["replays"], s["replayed_batches"], s["resyncs"]) == (1, 1, 1, 0)
        assert publisher.replay_requests == 1
        assert r.route(token_body(b)).endpoint == EP, "the replayed batch is in the index"
        assert "kvroute" in r.metrics_text()
        assert r.stats()["precise"]["replays"] == 1
    finally:
        sub.stop()
    assert sub.stop() == sub.stats(), "stopping twice is harmless"


def test_gap_without_replay_resyncs(publisher: Publisher) -> None:
    r = precise_router()
    sub = r.subscribe(EP, publisher.endpoint, poll_interval_ms=20)
    with sub:
        publisher.wait_subscribed()
        publisher.publish(batch(stored(list(range(64))), ts=1.0))
        publisher.publish(batch(stored(list(range(100, 164))), ts=2.0), lose=True)
        publisher.publish(batch(stored(list(range(200, 264))), ts=3.0))
        wait_for("the resync", lambda: sub.stats()["resyncs"] == 1)
        wait_for("the held batch", lambda: sub.stats()["applied"] == 2)
    assert r.stats()["precise"]["resyncs"] == 1


def test_bind_mode_and_unknown_endpoint() -> None:
    r = precise_router()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        # The router endpoint is not registered: batches are counted as router errors.
        sub = r.subscribe("10.0.0.9:8000", "tcp://127.0.0.1:*", mode="bind")
        port = sub.local_endpoint.rsplit(":", 1)[1]
        assert port != "*"
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(sub.local_endpoint)
        deadline = time.monotonic() + WAIT_S
        while not (pub.poll(20) and pub.recv()[:1] == b"\x01"):
            assert time.monotonic() < deadline
        pub.send_multipart([b"", (0).to_bytes(8, "big"), batch(stored(list(range(64))))])
        pub.send_multipart([b"only two frames", b"x"])
        wait_for("both messages", lambda: sub.stats()["messages"] == 2)
        stats = sub.stop()
        assert (stats["router_errors"], stats["malformed"], stats["applied"]) == (1, 1, 0)
        pub.close()
    finally:
        ctx.term()


def test_dropping_a_subscription_stops_it() -> None:
    """A subscription that is garbage-collected without `stop()` stops its thread and closes its
    socket: its port can be bound again at once."""
    import gc

    r = precise_router()
    sub = r.subscribe(EP, "tcp://127.0.0.1:*", mode="bind", poll_interval_ms=10)
    endpoint = sub.local_endpoint
    assert sub.running
    del sub
    gc.collect()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(endpoint)  # raises if the subscriber still held the port
        s.close()
    finally:
        ctx.term()

"""The example gateway (``py/examples/gateway.py``), in-process on loopback.

Stub upstreams (aiohttp servers on ephemeral 127.0.0.1 ports) play vLLM's OpenAI server: they
record every request they get (path, headers, body), serve ``/metrics`` in vLLM's Prometheus
format and stream Server-Sent Events. Every test runs one event loop with a hard time limit;
nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the gateway example needs aiohttp (py/examples/requirements.txt)")
from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

import kvroute  # noqa: E402
from conftest import Nats  # noqa: E402

GATEWAY_PY = Path(__file__).resolve().parents[1] / "examples" / "gateway.py"
#: Hard limit of one test's event loop.
TEST_TIMEOUT_S = 9.0
#: Upper bound of any wait for the gateway to catch up (loopback: normally milliseconds).
WAIT_S = 15.0


def _load_gateway() -> ModuleType:
    """Import the example by path (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("kvroute_example_gateway", GATEWAY_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gateway: Any = _load_gateway()


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run one test scenario on a fresh event loop, bounded in time."""

    async def bounded() -> None:
        await asyncio.wait_for(scenario(), TEST_TIMEOUT_S)

    asyncio.run(bounded())


async def eventually(what: str, cond: Callable[[], bool]) -> None:
    """Wait (at most WAIT_S) until `cond` holds."""
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


# --------------------------------------------------------------------------------------------
# stub model servers
# --------------------------------------------------------------------------------------------

#: A vLLM /metrics page (the lines kvroute reads, among others it must skip).
VLLM_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="llama"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="llama"}} {waiting}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="llama"}} {kv_usage}
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="llama"}} 4096.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="llama"}} 1024.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="2048"}} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="llama"}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="llama"}} 7.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="llama"}} 7.0
"""

UpstreamMode = Literal["ok", "error500", "break"]


@dataclass
class Received:
    """One request a stub upstream got."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class StubUpstream:
    """A vLLM-like OpenAI server on an ephemeral loopback port."""

    name: str
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.1
    mode: UpstreamMode = "ok"
    received: list[Received] = field(default_factory=list)
    #: Streams send their first chunk, then wait for this before the rest.
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when a request's handler was cancelled (the gateway dropped the connection).
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    metrics_reads: int = 0
    server: TestServer | None = None

    def __post_init__(self) -> None:
        self.gate.set()

    @property
    def endpoint(self) -> str:
        assert self.server is not None and self.server.port is not None
        return f"127.0.0.1:{self.server.port}"

    def chunks(self) -> list[bytes]:
        """The SSE stream this upstream sends for a streamed request."""
        out = []
        for i in range(3):
            event = {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": "llama",
                "choices": [{"index": 0, "text": f"{self.name}-tok{i}", "finish_reason": None}],
            }
            out.append(f"data: {json.dumps(event)}\n\n".encode())
        out.append(b"data: [DONE]\n\n")
        return out

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._inference)
        app.router.add_post("/v1/chat/completions", self._inference)
        self.server = TestServer(app, host="127.0.0.1", handler_cancellation=True)
        await self.server.start_server()

    async def close(self) -> None:
        self.gate.set()
        if self.server is not None:
            await self.server.close()

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.metrics_reads += 1
        page = VLLM_METRICS.format(waiting=self.waiting, running=self.running, kv_usage=self.kv_usage)
        return web.Response(text=page, content_type="text/plain", charset="utf-8")

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(request.path, {k.lower(): v for k, v in request.headers.items()}, body))
        if self.mode == "error500":
            return web.json_response({"error": {"message": "engine dead", "code": 500}}, status=500)
        if not body.get("stream"):
            return web.json_response({"object": "text_completion", "served_by": self.name, "choices": []})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i, chunk in enumerate(self.chunks()):
                if i == 1:
                    await self.gate.wait()
                await response.write(chunk)
                if self.mode == "break":
                    assert request.transport is not None
                    request.transport.close()  # the engine dies mid-stream
                    return response
            await response.write_eof()
        except asyncio.CancelledError:
            self.aborted.set()
            raise
        return response


@dataclass
class Harness:
    gw: Any  # gateway.Gateway
    client: TestClient[web.Request, web.Application]
    upstreams: list[StubUpstream]

    @property
    def router(self) -> kvroute.Router:
        router: kvroute.Router = self.gw.router
        return router

    def inflight(self) -> tuple[int, list[int]]:
        """The router's in-flight total and per-endpoint counters."""
        return self.router.stats()["inflight_requests"], [e["inflight"] for e in self.router.endpoints()]

    def by_endpoint(self, endpoint: str) -> StubUpstream:
        return next(u for u in self.upstreams if u.endpoint == endpoint)


@contextlib.asynccontextmanager
async def harness(
    upstreams: Sequence[StubUpstream] = (),
    *,
    n: int = 2,
    roles: Sequence[str] = (),
    policy: dict[str, Any] | None = None,
    extra_endpoints: Sequence[str] = (),
    metrics_interval_s: float = 0.05,
) -> AsyncIterator[Harness]:
    """Start stub upstreams and the gateway in front of them."""
    ups = list(upstreams) or [StubUpstream(f"u{i}") for i in range(n)]
    for u in ups:
        await u.start()
    specs = [u.endpoint + (f"={roles[i]}" if roles else "") for i, u in enumerate(ups)] + list(extra_endpoints)
    config = gateway.GatewayConfig(
        upstreams=[gateway.Upstream.parse(s) for s in specs],
        policy=policy,
        metrics_interval_s=metrics_interval_s,
        metrics_timeout_s=1.0,
        connect_timeout_s=1.0,
        read_timeout_s=5.0,
    )
    gw = gateway.Gateway(config)
    client: TestClient[web.Request, web.Application] = TestClient(
        TestServer(gw.app(), host="127.0.0.1", handler_cancellation=True)
    )
    await client.start_server()
    try:
        yield Harness(gw, client, ups)
    finally:
        await client.close()
        for u in ups:
            await u.close()


def chat(system: str, user: str = "hi", **extra: Any) -> dict[str, Any]:
    return {
        "model": "llama",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 32,
        **extra,
    }


LONG_SYSTEM = "You are a careful assistant for the kvroute test suite. " * 60  # ~3.4 kB


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


def test_repeated_prompt_sticks_to_one_upstream() -> None:
    """A repeated prompt goes where its prefix is cached; the upstream that got each request is
    the one named by the destination header; the body arrives unchanged."""

    async def scenario() -> None:
        async with harness() as h:
            body = chat(LONG_SYSTEM)
            served: list[str] = []
            for i in range(4):
                # Routing headers sent by a client are not trusted: dropped or overwritten.
                spoofed = {"x-gateway-destination-endpoint": "10.9.9.9:1", "x-prefiller-host-port": "10.9.9.9:2"}
                headers = spoofed if i == 0 else {}
                r = await h.client.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status == 200, await r.text()
                served.append((await r.json())["served_by"])
            assert len(set(served)) == 1, served
            target = next(u for u in h.upstreams if u.name == served[0])
            other = next(u for u in h.upstreams if u is not target)
            assert len(target.received) == 4 and other.received == []
            for rec in target.received:
                assert rec.path == "/v1/chat/completions" and rec.body == body
                assert rec.headers["x-gateway-destination-endpoint"] == target.endpoint
                assert rec.headers["x-kvroute-mode"] in ("colocated", "decode-direct")
                assert "x-prefiller-host-port" not in rec.headers

            # The completions API, token-id prompt: the destination header always names the
            # upstream that received the request.
            for k in range(6):
                tokens = list(range(k, k + 40))
                r = await h.client.post("/v1/completions", json={"model": "llama", "prompt": tokens, "max_tokens": 4})
                assert r.status == 200
                name = (await r.json())["served_by"]
                got = next(u for u in h.upstreams if u.name == name)
                assert got.received[-1].path == "/v1/completions"
                assert got.received[-1].headers["x-gateway-destination-endpoint"] == got.endpoint
            assert h.inflight() == (0, [0, 0])
            assert h.router.stats()["counters"]["routed"] == 10

    run(scenario)


def test_disaggregated_decision_adds_the_prefiller_header() -> None:
    """A long prompt on a busy decode endpoint is served disaggregated: the decode upstream gets
    the request with x-prefiller-host-port naming the prefill upstream."""

    async def scenario() -> None:
        decode, prefill = StubUpstream("decode", running=8), StubUpstream("prefill", running=8)
        policy = {"modes": {"colocated_input_max_tokens": 64}}
        async with harness([decode, prefill], roles=["decode", "prefill"], policy=policy) as h:
            r = await h.client.post("/v1/completions", json={"model": "llama", "prompt": "x" * 8000, "max_tokens": 512})
            assert r.status == 200 and (await r.json())["served_by"] == "decode"
            (rec,) = decode.received
            assert prefill.received == []
            assert rec.headers["x-kvroute-mode"] == "disaggregated"
            assert rec.headers["x-prefiller-host-port"] == prefill.endpoint
            assert rec.headers["x-gateway-destination-endpoint"] == decode.endpoint
            assert h.inflight() == (0, [0, 0])

    run(scenario)


def test_streaming_passes_through_chunk_by_chunk() -> None:
    """The first SSE chunk reaches the client while the upstream is still holding the rest; the
    request stays in flight until the stream ends, then its counters return to 0."""

    async def scenario() -> None:
        async with harness(n=1) as h:
            (up,) = h.upstreams
            up.gate.clear()
            body = {"model": "llama", "prompt": "hello", "max_tokens": 8, "stream": True}
            r = await h.client.post("/v1/completions", json=body)
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            chunks = up.chunks()
            first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), WAIT_S)
            assert first == chunks[0], "the first chunk must arrive before the upstream sends the rest"
            assert h.inflight() == (1, [1])
            up.gate.set()
            rest = await r.content.read()
            assert first + rest == b"".join(chunks)
            await eventually("the request to complete", lambda: h.inflight() == (0, [0]))
            assert up.received[0].body["stream"] is True

    run(scenario)


def test_client_disconnect_mid_stream_completes_the_request() -> None:
    """A client that leaves mid-stream: the gateway drops the upstream request and completes
    the routed request."""

    async def scenario() -> None:
        async with harness(n=1) as h:
            (up,) = h.upstreams
            up.gate.clear()  # the upstream never sends more than the first chunk
            body = {"model": "llama", "prompt": "hi", "max_tokens": 8, "stream": True}
            r = await h.client.post("/v1/completions", json=body)
            assert await asyncio.wait_for(r.content.readuntil(b"\n\n"), WAIT_S) == up.chunks()[0]
            assert h.inflight() == (1, [1])
            r.close()  # drop the connection
            await eventually("the request to complete", lambda: h.inflight() == (0, [0]))
            await asyncio.wait_for(up.aborted.wait(), WAIT_S)

    run(scenario)


def test_upstream_failures_complete_the_request() -> None:
    """An upstream error status passes through; an upstream dying mid-stream cuts the client's
    stream short; an unreachable upstream gives 502 and is marked unhealthy. In-flight counters
    return to 0 every time."""

    async def scenario() -> None:
        async with harness(n=1, metrics_interval_s=60.0) as h:
            (up,) = h.upstreams
            up.mode = "error500"
            r = await h.client.post("/v1/completions", json={"model": "llama", "prompt": "hi"})
            assert r.status == 500 and (await r.json())["error"]["message"] == "engine dead"
            assert h.inflight() == (0, [0])

            up.mode = "break"
            r = await h.client.post("/v1/completions", json={"model": "llama", "prompt": "hi", "stream": True})
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.content.read()
            await eventually("the request to complete", lambda: h.inflight() == (0, [0]))

            await up.close()  # the port now refuses connections
            r = await h.client.post("/v1/completions", json={"model": "llama", "prompt": "hi"})
            assert r.status == 502 and "unreachable" in (await r.json())["error"]["message"]
            assert h.inflight() == (0, [0])
            assert [e["healthy"] for e in h.router.endpoints()] == [False]
            r = await h.client.post("/v1/completions", json={"model": "llama", "prompt": "hi"})
            assert r.status == 503

    run(scenario)


def test_shed_when_saturated() -> None:
    """Negative priority on a saturated pool: 429 with kvroute's reason, nothing forwarded;
    priority 0 is still served."""

    async def scenario() -> None:
        ups = [StubUpstream(f"u{i}", waiting=50, running=64, kv_usage=0.97) for i in range(2)]
        async with harness(ups) as h:
            body = {"model": "llama", "prompt": "summarize this", "max_tokens": 16}
            r = await h.client.post("/v1/completions", json=body, headers={"x-kvroute-priority": "-1"})
            assert r.status == 429
            error = (await r.json())["error"]
            assert error["type"] == "request_shed"
            assert "saturated" in error["message"] and "sheddable" in error["message"]
            assert all(u.received == [] for u in ups)
            r = await h.client.post("/v1/completions", json=body, headers={"x-kvroute-priority": "0"})
            assert r.status == 200
            assert sum(len(u.received) for u in ups) == 1
            assert h.inflight() == (0, [0, 0])

    run(scenario)


def test_malformed_requests_get_400() -> None:
    """kvroute's request errors become 400 with its message; nothing is forwarded."""

    async def scenario() -> None:
        async with harness() as h:
            cases: list[tuple[bytes, dict[str, str], str]] = [
                (b"{not json", {}, "not valid JSON"),
                (b'{"model": "llama"}', {}, "prompt"),
                (b'{"model": "llama", "messages": "hi"}', {}, "messages"),
                (b'{"model": "llama", "prompt": "hi"}', {"x-kvroute-priority": "urgent"}, "x-kvroute-priority"),
            ]
            for body, headers, needle in cases:
                headers = {"content-type": "application/json", **headers}
                r = await h.client.post("/v1/chat/completions", data=body, headers=headers)
                assert r.status == 400, (body, await r.text())
                error = (await r.json())["error"]
                assert error["type"] == "invalid_request_error" and needle in error["message"], error
            assert all(u.received == [] for u in h.upstreams)
            assert h.inflight() == (0, [0, 0])

    run(scenario)


def test_no_endpoints_gives_503() -> None:
    """No endpoint configured, or none healthy (its /metrics is unreachable): 503."""

    def closed_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        return port

    async def scenario() -> None:
        async with harness(n=0) as h:
            r = await h.client.post("/v1/completions", json={"model": "llama", "prompt": "hi"})
            assert r.status == 503 and (await r.json())["error"]["type"] == "no_endpoints"
            assert (await h.client.get("/healthz")).status == 503
        async with harness(n=0, extra_endpoints=[f"127.0.0.1:{closed_port()}"]) as h:
            assert [e["healthy"] for e in h.router.endpoints()] == [False]
            r = await h.client.post("/v1/completions", json={"model": "llama", "prompt": "hi"})
            assert r.status == 503 and "no healthy endpoint" in (await r.json())["error"]["message"]

    run(scenario)


def test_metrics_are_polled_into_the_router() -> None:
    """Each upstream's /metrics (vLLM format) reaches the router at startup and on every poll;
    the gateway serves kvroute's own metrics."""

    async def scenario() -> None:
        u0 = StubUpstream("u0", waiting=3, running=5, kv_usage=0.42)
        u1 = StubUpstream("u1", waiting=0, running=1, kv_usage=0.05)
        async with harness([u0, u1]) as h:

            def metrics(up: StubUpstream) -> dict[str, Any]:
                m: dict[str, Any] = next(e["metrics"] for e in h.router.endpoints() if e["id"] == up.endpoint)
                return m

            assert (metrics(u0)["waiting"], metrics(u0)["running"], metrics(u0)["kv_usage"]) == (3, 5, 0.42)
            assert metrics(u0)["kv_capacity_tokens"] == 2048 * 16
            assert (metrics(u1)["waiting"], metrics(u1)["running"]) == (0, 1)
            u0.waiting = 9
            await eventually("the next poll", lambda: metrics(u0)["waiting"] == 9)
            await eventually("the poll round to end", lambda: h.gw.metrics_rounds >= 2)
            assert u0.metrics_reads >= 2
            r = await h.client.get("/metrics")
            assert r.status == 200 and "kvroute_" in await r.text()
            r = await h.client.get("/healthz")
            assert r.status == 200
            assert sorted((await r.json())["healthy_endpoints"]) == sorted([u0.endpoint, u1.endpoint])

    run(scenario)


def test_command_line_and_environment() -> None:
    """Endpoints, roles, KV-event addresses and the listen address from argv or environment."""
    cl = gateway.parse_args(
        [
            "--endpoint", "10.0.0.1:8000",
            "--endpoint", "10.0.1.1:8000=prefill",
            "--kv-events", "10.0.0.1:8000=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558",
        ],
        env={},
    )
    assert (cl.host, cl.port, cl.log_level) == ("127.0.0.1", 8080, "INFO")
    assert [(u.endpoint, u.role, u.kv_events, u.kv_replay) for u in cl.config.upstreams] == [
        ("10.0.0.1:8000", "decode", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
        ("10.0.1.1:8000", "prefill", None, None),
    ]
    cl = gateway.parse_args(
        [],
        env={
            "KVROUTE_ENDPOINTS": "10.0.0.1:8000=both,10.0.0.2:8000",
            "KVROUTE_LISTEN": "[::1]:9000",
            "KVROUTE_METRICS_INTERVAL_S": "0.5",
        },
    )
    assert [(u.endpoint, u.role) for u in cl.config.upstreams] == [
        ("10.0.0.1:8000", "both"),
        ("10.0.0.2:8000", "decode"),
    ]
    assert (cl.host, cl.port, cl.config.metrics_interval_s) == ("::1", 9000, 0.5)
    with pytest.raises(SystemExit):
        gateway.parse_args(["--endpoint", "10.0.0.1:8000=leader"], env={})
    with pytest.raises(SystemExit):
        gateway.parse_args(["--endpoint", "10.0.0.1:8000", "--kv-events", "10.0.0.9:8000=tcp://x:1"], env={})



def test_command_line_fleet_options() -> None:
    """--nats-url, --replica-id, --fleet, --nats-token (or the environment) give the options of
    `Router.replicate`; none: no replication."""
    cl = gateway.parse_args(
        ["--nats-url", "nats://10.0.9.1:4222", "--replica-id", "gw-1", "--fleet", "prod", "--nats-token", "t"], env={}
    )
    assert cl.config.replication == {"url": "nats://10.0.9.1:4222", "replica_id": "gw-1", "fleet": "prod", "token": "t"}
    cl = gateway.parse_args([], env={"KVROUTE_NATS_URL": "nats://10.0.9.1:4222", "KVROUTE_REPLICA_ID": "gw-2"})
    assert cl.config.replication == {"url": "nats://10.0.9.1:4222", "replica_id": "gw-2"}
    assert gateway.parse_args([], env={}).config.replication is None
    with pytest.raises(SystemExit):
        gateway.parse_args(["--nats-url", "nats://10.0.9.1:4222"], env={})
    with pytest.raises(SystemExit):
        gateway.parse_args(["--replica-id", "gw-1"], env={})


def test_gateway_joins_its_fleet(nats: Nats) -> None:
    """With `replication` set, the gateway replicates from startup (reported by /healthz) to
    cleanup; bad options are logged and the gateway routes alone."""
    config = gateway.GatewayConfig(
        upstreams=[gateway.Upstream.parse("10.0.0.1:8000")],
        replication={"url": nats.url, "token": nats.token, "fleet": "gw", "replica_id": "gw-1"},
    )
    gw = gateway.Gateway(config)
    gw.start_replication()
    try:
        assert gw.replication is not None and gw.replication.running
        deadline = time.monotonic() + WAIT_S
        while not gw.replication.stats()["connected"] and time.monotonic() < deadline:
            time.sleep(0.01)
        body = json.loads(asyncio.run(gw.handle_health(None)).text)
        assert body["replication"]["replica_id"] == "gw-1" and body["replication"]["connected"] is True
        assert gw.router.replica_stats()["replica_id"] == "gw-1"
    finally:
        gw.stop_replication()
    assert gw.replication is None and gw.router.replica_stats() is None
    bad = gateway.Gateway(gateway.GatewayConfig(replication={"replica_id": "no spaces allowed"}))
    bad.start_replication()
    assert bad.replication is None


# --------------------------------------------------------------------------------------------
# flow control
# --------------------------------------------------------------------------------------------

#: Flow control on; one request in flight per endpoint (the concurrency detector, no metrics
#: involved), at most one queued.
FLOW_POLICY: dict[str, Any] = {
    "flow_control": {
        "enabled": True,
        "max_requests": 1,
        "saturation_detector": {"kind": "concurrency", "max_requests_per_endpoint": 1},
    }
}


def test_flow_control_queues_then_answers_429_with_the_dropped_reason() -> None:
    """A busy pool: the next request waits in the gateway (not forwarded), the one after finds
    the queue full and gets 429 with x-llm-d-request-dropped-reason; when the first answer
    ends, the completion releases the waiting request, which is then served."""

    async def scenario() -> None:
        async with harness(n=1, policy=FLOW_POLICY) as h:
            (up,) = h.upstreams
            up.gate.clear()
            stream = {"model": "llama", "prompt": "first", "max_tokens": 8, "stream": True}
            first = await h.client.post("/v1/completions", json=stream)
            assert await asyncio.wait_for(first.content.readuntil(b"\n\n"), WAIT_S) == up.chunks()[0]
            waiting = asyncio.create_task(
                h.client.post("/v1/completions", json={"model": "llama", "prompt": "second", "max_tokens": 8})
            )
            await eventually("the second request to queue", lambda: h.router.flow_stats()["queued"] == 1)
            assert len(up.received) == 1 and not waiting.done()

            r = await h.client.post("/v1/completions", json={"model": "llama", "prompt": "third", "max_tokens": 8})
            assert r.status == 429
            assert r.headers[kvroute.HEADER_DROPPED_REASON] == "rejected-saturated"
            error = (await r.json())["error"]
            assert error["type"] == "request_dropped" and error["reason"] == "rejected-saturated"
            assert len(up.received) == 1

            up.gate.set()  # the first answer ends: its completion releases the second
            assert first.status == 200 and (await first.content.read()).endswith(b"[DONE]\n\n")
            second = await asyncio.wait_for(waiting, WAIT_S)
            assert second.status == 200 and (await second.json())["served_by"] == "u0"
            assert [rec.body["prompt"] for rec in up.received] == ["first", "second"]
            await eventually("the requests to complete", lambda: h.inflight() == (0, [0]))
            c = h.router.flow_stats()["counters"]
            assert (c["admitted"], c["enqueued"], c["dispatched"], c["rejections"]["rejected_saturated"]) == (1, 1, 1, 1)

    run(scenario)


def test_client_disconnect_while_queued_leaves_the_queue() -> None:
    """A client that goes away while its request waits in the queue: the handler is cancelled,
    its ticket removed; it is never forwarded, and the queue is free for the next request."""

    async def scenario() -> None:
        async with harness(n=1, policy=FLOW_POLICY) as h:
            (up,) = h.upstreams
            up.gate.clear()
            stream = {"model": "llama", "prompt": "first", "max_tokens": 8, "stream": True}
            first = await h.client.post("/v1/completions", json=stream)
            assert await asyncio.wait_for(first.content.readuntil(b"\n\n"), WAIT_S) == up.chunks()[0]
            gone = asyncio.create_task(
                h.client.post("/v1/completions", json={"model": "llama", "prompt": "gone", "max_tokens": 8})
            )
            await eventually("the request to queue", lambda: h.router.flow_stats()["queued"] == 1)
            gone.cancel()  # the client drops its connection
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            await eventually("the ticket to be cancelled", lambda: h.router.flow_stats()["counters"]["cancelled"] == 1)
            assert h.router.flow_stats()["queued"] == 0
            up.gate.set()
            assert (await first.content.read()).endswith(b"[DONE]\n\n")
            await eventually("the first request to complete", lambda: h.inflight() == (0, [0]))
            r = await h.client.post("/v1/completions", json={"model": "llama", "prompt": "next", "max_tokens": 8})
            assert r.status == 200
            assert [rec.body["prompt"] for rec in up.received] == ["first", "next"]
            assert h.router.flow_stats()["counters"]["dispatched"] == 0

    run(scenario)


def test_requests_queued_at_shutdown_get_503() -> None:
    """Stopping the gateway answers the requests still queued with 503 rejected-shutting-down."""

    async def scenario() -> None:
        async with harness(n=1, policy=FLOW_POLICY) as h:
            (up,) = h.upstreams
            up.gate.clear()
            stream = {"model": "llama", "prompt": "first", "max_tokens": 8, "stream": True}
            first = await h.client.post("/v1/completions", json=stream)
            assert await asyncio.wait_for(first.content.readuntil(b"\n\n"), WAIT_S) == up.chunks()[0]
            waiting = asyncio.create_task(
                h.client.post("/v1/completions", json={"model": "llama", "prompt": "second", "max_tokens": 8})
            )
            await eventually("the request to queue", lambda: h.router.flow_stats()["queued"] == 1)
            await h.gw._on_shutdown(h.client.app)
            r = await asyncio.wait_for(waiting, WAIT_S)
            assert r.status == 503
            assert r.headers[kvroute.HEADER_DROPPED_REASON] == "rejected-shutting-down"
            up.gate.set()
            await first.content.read()

    run(scenario)

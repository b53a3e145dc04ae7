#!/usr/bin/env python3
"""A small OpenAI-compatible gateway that routes every inference request with kvroute.

    client ──POST /v1/completions──▶ gateway ──(kvroute decision)──▶ chosen model server
                                      │  ▲
                                      │  └── GET /metrics of every model server, periodically
                                      ├───── ZMQ KV events of the model servers (optional)
                                      └───── the other gateways of the fleet over NATS (optional)

For each ``POST /v1/completions`` and ``POST /v1/chat/completions`` the gateway:

1. reads the body and awaits :meth:`kvroute.Router.admit` with the body bytes and the request
   headers: with flow control on (the policy's ``flow_control``), the request waits there,
   in its tenant's queue (``x-llm-d-inference-fairness-id``) and priority band
   (``x-llm-d-inference-objective``, ``x-kvroute-priority``), until the pool has room; a
   refusal or a drop from the queue is answered with its status (**429**, or **503** when the
   pool is empty or the gateway is stopping) and the ``x-llm-d-request-dropped-reason``
   header. A client that disconnects while it waits cancels the handler (the server runs with
   ``handler_cancellation=True``), and so leaves the queue. With flow control off, ``admit``
   lets every request through at once;
2. calls :meth:`kvroute.Router.route` with the same body and headers (priority, session,
   request id and judgment-hint headers are read by kvroute), and answers **429** (or the shed
   decision's status) with kvroute's reason when the request is shed (flow control off),
   **400** with kvroute's message when the request cannot be understood, **503** when no
   healthy endpoint can serve it;
3. forwards the request to ``decision.endpoint`` over HTTP, adding the decision's headers
   (``x-gateway-destination-endpoint``, ``x-kvroute-mode`` and, for a disaggregated decision,
   ``x-prefiller-host-port``: the decode endpoint's sidecar runs the remote prefill there);
4. streams the upstream answer back as it comes (Server-Sent Events for ``"stream": true``
   requests, the JSON body otherwise) with the upstream's status code;
5. calls :meth:`kvroute.Router.complete` when the answer has ended, the client went away or the
   upstream failed (``try``/``finally``), so the router's in-flight counters stay exact; each
   completion (and each metrics read) is a dispatch opportunity that releases the next queued
   requests. When the gateway stops, :meth:`kvroute.Router.shutdown_queue` answers every
   request still queued with 503.

An upstream that refuses connections is marked unhealthy (502 for that request) until its
``/metrics`` answers again. Metrics are read with
:meth:`kvroute.Router.update_metrics_from_prometheus` (vLLM's and SGLang's Prometheus names).

Several gateways in front of the same model servers can share their routing state (requests in
flight, where each prompt's prefix was sent) over NATS: give each ``--nats-url`` and its own
``--replica-id`` (``--fleet`` and ``--nats-token`` as needed); :meth:`kvroute.Router.replicate`
runs the replication on a native thread. A replication that cannot start is logged and the
gateway routes on its own state; ``GET /healthz`` reports whether it is connected.
Other paths: ``GET /metrics`` (kvroute's own Prometheus metrics), ``GET /healthz``.

Usage::

    pip install ./py -r py/examples/requirements.txt
    python py/examples/gateway.py --policy policy.yaml \\
        --endpoint 10.0.0.1:8000 --endpoint 10.0.0.2:8000=decode --endpoint 10.0.1.1:8000=prefill \\
        --kv-events 10.0.0.1:8000=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558 --listen 0.0.0.0:8080

Every option can come from the environment instead: ``KVROUTE_POLICY``, ``KVROUTE_ENDPOINTS``
(comma-separated endpoint specs), ``KVROUTE_KV_EVENTS`` (space-separated ``--kv-events`` specs),
``KVROUTE_LISTEN``, ``KVROUTE_METRICS_INTERVAL_S``, ``KVROUTE_NATS_URL``, ``KVROUTE_REPLICA_ID``,
``KVROUTE_FLEET``, ``KVROUTE_NATS_TOKEN``. Endpoint ids are ``ip:port`` (kvroute's
endpoint ids); the gateway talks plain HTTP to them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import aiohttp
from aiohttp import web

import kvroute

__all__ = ["CommandLine", "Gateway", "GatewayConfig", "Upstream", "main", "parse_args"]

log = logging.getLogger("kvroute.gateway")

Role = Literal["prefill", "decode", "both"]
_ROLES: Final[tuple[Role, ...]] = ("prefill", "decode", "both")

#: The OpenAI paths routed with kvroute.
ROUTED_PATHS: Final[tuple[str, ...]] = ("/v1/completions", "/v1/chat/completions")

#: Headers that describe one HTTP connection, not the message (RFC 9110 §7.6.1), and the
#: framing headers aiohttp recomputes: never copied from one side to the other.
_HOP_BY_HOP: Final[frozenset[str]] = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)

#: Headers only the routing decision may set: a client's own values are dropped.
_DECISION_HEADERS: Final[frozenset[str]] = frozenset(
    {"x-gateway-destination-endpoint", "x-prefiller-host-port", "x-kvroute-mode", "x-kvroute-score"}
)


@dataclass(frozen=True)
class Upstream:
    """One model server: its kvroute endpoint id (``ip:port``), role and optional KV-event
    publisher (vLLM ``--kv-events-config`` endpoint and replay endpoint)."""

    endpoint: str
    role: Role = "decode"
    kv_events: str | None = None
    kv_replay: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Upstream:
        """``ip:port`` or ``ip:port=role`` (role: prefill, decode or both; default decode)."""
        endpoint, sep, role = spec.strip().partition("=")
        if not endpoint:
            raise ValueError(f"empty endpoint in {spec!r}")
        if not sep:
            return cls(endpoint)
        if role not in _ROLES:
            raise ValueError(f"endpoint {endpoint!r}: role {role!r} is not one of {', '.join(_ROLES)}")
        return cls(endpoint, role)


@dataclass
class GatewayConfig:
    """What the gateway serves and how.

    ``policy`` is anything :class:`kvroute.Router` accepts (a dict, JSON/YAML text, a path) or
    ``None`` for kvroute's defaults.
    """

    upstreams: list[Upstream] = field(default_factory=list)
    policy: Mapping[str, Any] | str | Path | None = None
    #: Seconds between two reads of every upstream's ``/metrics``.
    metrics_interval_s: float = 1.0
    #: Timeout of one ``/metrics`` read.
    metrics_timeout_s: float = 2.0
    #: Timeout to connect to an upstream.
    connect_timeout_s: float = 5.0
    #: Longest silence of an upstream while its answer is read (None: no limit).
    read_timeout_s: float | None = 600.0
    #: ``http`` (or ``https``) to reach the upstreams.
    scheme: str = "http"
    #: Join a fleet of gateways over NATS: the options of :meth:`kvroute.Router.replicate`
    #: (``url``, ``replica_id``, ``fleet``, ``token``, ...); ``None``: route alone.
    replication: Mapping[str, Any] | None = None


def _json_error(
    status: int, message: str, kind: str, *, headers: Mapping[str, str] | None = None, **extra: str
) -> web.Response:
    """An OpenAI-style error body (with response ``headers``, e.g. the dropped-reason header)."""
    body = {"error": {"message": message, "type": kind, "code": status, **extra}}
    return web.json_response(body, status=status, headers=headers)


def _copy_headers(headers: Mapping[str, str], *, drop: frozenset[str] = frozenset()) -> dict[str, str]:
    """End-to-end headers of a message (hop-by-hop and `drop` removed, names lower-cased)."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        low = name.lower()
        if low not in _HOP_BY_HOP and low not in drop:
            out[low] = value
    return out


class Gateway:
    """The gateway: one :class:`kvroute.Router`, one HTTP client session, one metrics poller.

    :meth:`app` builds the aiohttp application; serve it with ``handler_cancellation=True``
    (as :func:`main` does) so a client that disconnects while the upstream is silent cancels
    the forwarded request at once (otherwise that is noticed at the next chunk written).
    """

    def __init__(self, config: GatewayConfig, router: kvroute.Router | None = None) -> None:
        self.config = config
        self.router = router if router is not None else kvroute.Router(config.policy)
        for up in config.upstreams:
            self.router.upsert_endpoint(up.endpoint, up.role)
        self._session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self._subscriptions: list[kvroute.Subscription] = []
        #: The fleet replication, when configured and started.
        self.replication: kvroute.Replication | None = None
        #: The health each endpoint was last marked with (transitions are logged).
        self._healthy: dict[str, bool] = {}
        #: Number of completed metrics rounds (tests wait on it).
        self.metrics_rounds = 0

    # ----------------------------------------------------------------------------------------
    # application and lifecycle
    # ----------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application (its startup reads every upstream's metrics once before the
        first request is served, and starts the poller and the KV-event subscriptions)."""
        max_body = int(self.router.policy.to_dict()["request"]["max_body_bytes"])
        app = web.Application(client_max_size=max_body)
        for path in ROUTED_PATHS:
            app.router.add_post(path, self.handle_inference)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/healthz", self.handle_health)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.config.connect_timeout_s, sock_read=self.config.read_timeout_s
        )
        # auto_decompress=False: bodies pass through byte for byte, Content-Encoding with them.
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        for up in self.config.upstreams:
            if up.kv_events is None:
                continue
            try:
                self._subscriptions.append(self.router.subscribe(up.endpoint, up.kv_events, replay=up.kv_replay))
            except kvroute.KvrouteError as e:  # fail open: route without this endpoint's events
                log.error("KV events of %s (%s): %s", up.endpoint, up.kv_events, e)
        self.start_replication()
        await self.poll_metrics()
        self._poller = asyncio.create_task(self._poll_forever(), name="kvroute-metrics-poller")

    async def _on_shutdown(self, _app: web.Application) -> None:
        # Requests still queued by flow control are answered 503 rejected-shutting-down.
        self.router.shutdown_queue()

    async def _on_cleanup(self, _app: web.Application) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for sub in self._subscriptions:
            sub.stop()
        self._subscriptions.clear()
        self.stop_replication()
        if self._session is not None:
            await self._session.close()

    def start_replication(self) -> None:
        """Join the fleet (``config.replication``), unless already joined. Fails open: an error is
        logged and the gateway routes on its own state."""
        if self.config.replication is None or self.replication is not None:
            return
        try:
            self.replication = self.router.replicate(dict(self.config.replication))
        except kvroute.KvrouteError as e:
            log.error("replication over NATS: %s", e)

    def stop_replication(self) -> None:
        """Leave the fleet (publishes what waits, then stops the replication thread)."""
        if self.replication is not None:
            self.replication.stop()
            self.replication = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the gateway application has not started")
        return self._session

    # ----------------------------------------------------------------------------------------
    # metrics
    # ----------------------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            try:
                await self.poll_metrics()
            except Exception:  # never let the poller die
                log.exception("metrics round failed")

    async def poll_metrics(self) -> None:
        """Read every upstream's ``/metrics`` once (concurrently) and feed the router."""
        await asyncio.gather(*(self._poll_one(up.endpoint) for up in self.config.upstreams))
        self.metrics_rounds += 1

    async def _poll_one(self, endpoint: str) -> None:
        url = f"{self.config.scheme}://{endpoint}/metrics"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=self.config.metrics_timeout_s)) as r:
                if r.status != 200:
                    raise aiohttp.ClientResponseError(
                        r.request_info, r.history, status=r.status, message=r.reason or ""
                    )
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._mark(endpoint, False, f"/metrics failed: {e or type(e).__name__}")
            return
        try:
            self.router.update_metrics_from_prometheus(endpoint, text)
        except kvroute.MetricsError as e:  # the page is up but unusable: keep the old snapshot
            log.warning("metrics of %s: %s", endpoint, e)
            return
        self._mark(endpoint, True, "/metrics answered")

    def _mark(self, endpoint: str, healthy: bool, why: str) -> None:
        """Set an endpoint's health in the router; log changes only."""
        self.router.set_healthy(endpoint, healthy)
        if self._healthy.get(endpoint) != healthy:
            self._healthy[endpoint] = healthy
            state, level = ("healthy", logging.INFO) if healthy else ("unhealthy", logging.WARNING)
            log.log(level, "%s %s: %s", endpoint, state, why)

    # ----------------------------------------------------------------------------------------
    # requests
    # ----------------------------------------------------------------------------------------

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        """kvroute's Prometheus metrics."""
        return web.Response(text=self.router.metrics_text(), content_type="text/plain", charset="utf-8")

    async def handle_health(self, _request: web.Request) -> web.Response:
        """200 while at least one endpoint is healthy, else 503."""
        healthy = [e["id"] for e in self.router.endpoints() if e["healthy"]]
        body: dict[str, Any] = {"healthy_endpoints": healthy}
        if self.replication is not None:
            s = self.replication.stats()
            body["replication"] = {
                "replica_id": self.replication.replica_id,
                "connected": s["connected"],
                "last_error": s["last_error"],
            }
        return web.json_response(body, status=200 if healthy else 503)

    async def handle_inference(self, request: web.Request) -> web.StreamResponse:
        """Route one OpenAI request with kvroute and proxy it to the chosen endpoint."""
        body = await request.read()
        headers = list(request.headers.items())
        try:
            # Flow control holds the request here while the pool is saturated. The client going
            # away cancels this handler, and the cancellation takes the request out of the queue.
            await self.router.admit(body, headers)
        except kvroute.RejectedError as e:  # refused, or dropped from the queue
            return _json_error(e.status, str(e), "request_dropped", headers=e.headers, reason=e.reason)
        except kvroute.RequestError as e:
            return _json_error(400, str(e), "invalid_request_error")
        try:
            decision = self.router.route(body, headers)
        except kvroute.NoEndpointsError as e:
            return _json_error(503, str(e), "no_endpoints")
        except kvroute.RequestError as e:
            return _json_error(400, str(e), "invalid_request_error")
        except kvroute.KvrouteError as e:  # e.g. a tokenizer failure: not the client's fault
            log.error("routing failed: %s", e)
            return _json_error(500, str(e), "routing_error")
        if decision.shed is not None:
            return _json_error(decision.shed.status, decision.shed.reason, "request_shed")
        endpoint = decision.endpoint
        if endpoint is None:  # a routed decision always names its endpoint
            return _json_error(503, "kvroute chose no endpoint", "no_endpoints")
        try:
            return await self._forward(request, body, endpoint, decision.headers)
        finally:
            # Response finished, client gone (CancelledError) or upstream failed.
            with contextlib.suppress(kvroute.StateError):  # already expired from tracking
                self.router.complete(decision.request_id)

    async def _forward(
        self, request: web.Request, body: bytes, endpoint: str, decision_headers: Mapping[str, str]
    ) -> web.StreamResponse:
        url = f"{self.config.scheme}://{endpoint}{request.path_qs}"
        headers = _copy_headers(request.headers, drop=_DECISION_HEADERS)
        headers.update(decision_headers)
        try:
            upstream_cm = self.session.request(request.method, url, data=body, headers=headers)
            async with upstream_cm as upstream:
                out_headers = _copy_headers(upstream.headers)
                if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    return web.Response(status=upstream.status, body=await upstream.read(), headers=out_headers)
                return await self._stream(request, upstream, out_headers)
        except aiohttp.ClientConnectorError as e:
            self._mark(endpoint, False, f"connection failed: {e}")
            return _json_error(502, f"upstream {endpoint} is unreachable: {e}", "upstream_error")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _json_error(502, f"upstream {endpoint} failed: {e or type(e).__name__}", "upstream_error")

    async def _stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, headers: dict[str, str]
    ) -> web.StreamResponse:
        """Pass an event stream through chunk by chunk, as the upstream sends it."""
        headers.setdefault("cache-control", "no-cache")
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                try:
                    await response.write(chunk)
                except ConnectionResetError:  # the client went away (ClientConnectionResetError)
                    log.info("client left %s before the end of the stream", request.path)
                    return response
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # The status line is gone: the only way to tell the client is to cut the stream short.
            log.warning("upstream stream broke: %s", e or type(e).__name__)
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write_eof()
        return response


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


def _kv_events(specs: Sequence[str], upstreams: list[Upstream]) -> list[Upstream]:
    """Attach ``ENDPOINT=PUB[,REPLAY]`` KV-event specs to their upstreams."""
    by_id = {u.endpoint: u for u in upstreams}
    for spec in specs:
        endpoint, sep, addrs = spec.partition("=")
        if not sep or endpoint not in by_id:
            raise ValueError(f"--kv-events {spec!r}: expected ENDPOINT=PUB[,REPLAY] for a listed --endpoint")
        pub, _, replay = addrs.partition(",")
        u = by_id[endpoint]
        by_id[endpoint] = Upstream(u.endpoint, u.role, pub, replay or None)
    return [by_id[u.endpoint] for u in upstreams]


@dataclass(frozen=True)
class CommandLine:
    """What :func:`parse_args` read."""

    config: GatewayConfig
    host: str
    port: int
    log_level: str


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> CommandLine:
    """The gateway's configuration and listen address from the command line (``argv``, default
    ``sys.argv[1:]``) and the environment (``env``, default ``os.environ``); exits with a usage
    message on invalid input."""
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default=env.get("KVROUTE_POLICY"), help="kvroute policy file (JSON or YAML)")
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="IP:PORT[=ROLE]",
        help="a model server (repeat); role prefill, decode (default) or both",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="IP:PORT=PUB[,REPLAY]",
        help="subscribe to an endpoint's ZMQ KV events (repeat)",
    )
    p.add_argument("--listen", default=env.get("KVROUTE_LISTEN", "127.0.0.1:8080"), metavar="HOST:PORT")
    p.add_argument("--metrics-interval", type=float, default=float(env.get("KVROUTE_METRICS_INTERVAL_S", "1.0")))
    p.add_argument("--log-level", default=env.get("KVROUTE_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--nats-url",
        default=env.get("KVROUTE_NATS_URL"),
        metavar="URL",
        help="join a fleet of gateways over NATS (nats://host:4222); needs --replica-id",
    )
    p.add_argument("--replica-id", default=env.get("KVROUTE_REPLICA_ID"), help="this gateway's id in the fleet")
    p.add_argument("--fleet", default=env.get("KVROUTE_FLEET"), help="the fleet's name (default kvroute's)")
    p.add_argument("--nats-token", default=env.get("KVROUTE_NATS_TOKEN"), help="NATS token authentication")
    a = p.parse_args(argv)
    specs: list[str] = a.endpoint or [s for s in env.get("KVROUTE_ENDPOINTS", "").split(",") if s.strip()]
    try:
        upstreams = [Upstream.parse(s) for s in specs]
        upstreams = _kv_events(a.kv_events or env.get("KVROUTE_KV_EVENTS", "").split(), upstreams)
    except ValueError as e:
        p.error(str(e))
    host, _, port = a.listen.rpartition(":")
    if not host or not port.isdigit():
        p.error(f"--listen {a.listen!r}: expected HOST:PORT")
    policy = Path(a.policy) if a.policy else None
    replication: dict[str, Any] | None = None
    if a.nats_url:
        if not a.replica_id:
            p.error("--nats-url needs --replica-id (or KVROUTE_REPLICA_ID)")
        replication = {"url": a.nats_url, "replica_id": a.replica_id}
        if a.fleet:
            replication["fleet"] = a.fleet
        if a.nats_token:
            replication["token"] = a.nats_token
    elif a.replica_id or a.nats_token or a.fleet:
        p.error("--replica-id, --fleet and --nats-token need --nats-url (or KVROUTE_NATS_URL)")
    config = GatewayConfig(
        upstreams=upstreams, policy=policy, metrics_interval_s=a.metrics_interval, replication=replication
    )
    return CommandLine(config, host.strip("[]"), int(port), a.log_level.upper())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the gateway until interrupted."""
    cl = parse_args(argv)
    config, host, port = cl.config, cl.host, cl.port
    logging.basicConfig(level=cl.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        gateway = Gateway(config)
    except kvroute.KvrouteError as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 1
    if not config.upstreams:
        log.warning("no endpoints configured: every request will be answered 503")
    log.info("kvroute %s: %d endpoint(s), listening on %s:%d", kvroute.__version__, len(config.upstreams), host, port)
    web.run_app(gateway.app(), host=host, port=port, handler_cancellation=True, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

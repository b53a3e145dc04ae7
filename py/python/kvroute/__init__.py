"""kvroute: KV-cache-aware routing for LLM serving.

For every inference request, :meth:`Router.route` picks the endpoint(s) and the serving mode:
``decode-direct`` (a decode endpoint already holds the prompt's KV cache), ``colocated`` or
``disaggregated`` (a prefill endpoint computes the KV cache and ships it to a decode endpoint).

The routing engine is the Rust core (``kvroute._native``); this package re-exports it and
defines the exception hierarchy. Every call releases the GIL while the core works, and one
:class:`Router` is meant to be shared by all threads.

>>> import kvroute
>>> router = kvroute.Router({"modes": {"colocated_input_max_tokens": 256}})
>>> router.upsert_endpoint("10.0.0.1:8000", "decode")
>>> router.update_metrics("10.0.0.1:8000", waiting=0, running=0, kv_usage=0.1)
>>> d = router.route({"model": "m", "prompt": "hello", "max_tokens": 16})
>>> d.endpoint, d.mode
('10.0.0.1:8000', 'colocated')
>>> router.complete(d.request_id)

With flow control on (``flow_control`` in the policy), admit each request before routing it:
``await router.admit(body, headers)`` returns once the request may be routed (an
:class:`Admitted`) or raises :class:`RejectedError` (answer ``e.status`` with ``e.headers``);
cancelling the awaiting task takes the request out of the queue. ``Router.enqueue``,
``take_releases`` and ``cancel`` are the same protocol with tickets, for callers that hold the
waiting requests themselves.

To share in-flight requests and routed prefixes with the other routers of a fleet, join it
over NATS: ``with router.replicate({"url": "nats://...", "replica_id": "gw-1"}) as rep:`` (a
native thread; :class:`Replication`).

Every ``now`` argument is milliseconds on the router's clock; it defaults to :func:`now_ms`
(UNIX milliseconds), the clock :meth:`Router.subscribe` feeds events with.
"""

from __future__ import annotations

from kvroute._errors import (
    ConfigError,
    RejectedError,
    EventError,
    KvrouteError,
    MetricsError,
    NoEndpointsError,
    ReplicationConfigError,
    ReplicationError,
    RequestError,
    SimulationError,
    StateError,
    SubscribeError,
    TokenizerError,
)
from kvroute._flow import Admitted
from kvroute._native import (
    HEADER_DROPPED_REASON,
    Admission,
    ApplyOutcome,
    Decision,
    EndpointScore,
    Judgment,
    Policy,
    Rejection,
    Release,
    Replication,
    Router,
    Shed,
    SimulationResult,
    Subscription,
    TransferEstimate,
    __version__,
    now_ms,
    simulate,
)

__all__ = [
    "HEADER_DROPPED_REASON",
    "Admission",
    "Admitted",
    "ApplyOutcome",
    "ConfigError",
    "Decision",
    "EndpointScore",
    "EventError",
    "Judgment",
    "KvrouteError",
    "MetricsError",
    "NoEndpointsError",
    "Policy",
    "RejectedError",
    "Rejection",
    "Release",
    "Replication",
    "ReplicationConfigError",
    "ReplicationError",
    "RequestError",
    "Router",
    "Shed",
    "SimulationError",
    "SimulationResult",
    "StateError",
    "SubscribeError",
    "Subscription",
    "TokenizerError",
    "TransferEstimate",
    "__version__",
    "now_ms",
    "simulate",
]

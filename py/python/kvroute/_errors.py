"""kvroute's exception hierarchy.

Every error kvroute raises on bad input or refused state changes is a :class:`KvrouteError`;
passing a value of the wrong Python type raises :class:`TypeError` instead. Each class carries
structured attributes (``kind`` always; ``field``, ``offset``, ``endpoint``, … where they apply),
so callers never need to parse messages. Attributes that do not apply are ``None``.

The native module raises these classes (it imports this module on its first error).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "KvrouteError",
    "ConfigError",
    "RequestError",
    "EventError",
    "StateError",
    "NoEndpointsError",
    "SubscribeError",
    "TokenizerError",
    "MetricsError",
    "SimulationError",
    "RejectedError",
    "ReplicationError",
    "ReplicationConfigError",
]

#: The response header that carries why flow control refused or dropped a request (llm-d's;
#: ``kvroute.HEADER_DROPPED_REASON``, from the core).
HEADER_DROPPED_REASON = "x-llm-d-request-dropped-reason"

#: What each reason means (the value of ``x-llm-d-request-dropped-reason``).
_REASONS = {
    "rejected-saturated": "the queue is full, or the sheddable request was shed",
    "rejected-ttl-expired": "the request waited its whole queue TTL",
    "rejected-no-endpoints": "the pool has no healthy endpoint that can serve it",
    "rejected-shutting-down": "the router is shutting down",
    "evicted-priority": "a higher-priority request took its place in the queue",
    "evicted-queue-pressure": "a reload lowered the queue limits below what was queued",
}


class KvrouteError(Exception):
    """Base class of every kvroute error.

    ``str(error)`` is the core's message; ``kind`` names the variant (snake case), e.g.
    ``"unknown_endpoint"`` or ``"body_too_large"``.
    """

    kind: str = "other"

    def __init__(self, message: str, **attributes: Any) -> None:
        super().__init__(message)
        for name, value in attributes.items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in sorted(vars(self).items()))
        return f"{type(self).__name__}({str(self)!r}{extra})"


class ConfigError(KvrouteError, ValueError):
    """A policy document could not be read or is invalid; the previous policy keeps serving.

    ``kind`` is ``"parse"`` (syntax, wrong type, unknown field) or ``"invalid"`` (a value out of
    range). ``field`` is the dotted path of the offending field (``"."`` for the document root).
    """

    format: str | None = None
    field: str | None = None
    value: str | None = None
    reason: str | None = None


class RequestError(KvrouteError, ValueError):
    """An inference request (body or headers) could not be understood.

    ``kind``: ``"body_too_large"`` (``size``, ``limit``), ``"empty_body"``, ``"json"``
    (``line``, ``column``), ``"field"`` (``field``, e.g. ``"messages[2].content"``) or
    ``"header"`` (``header``, ``value``).
    """

    field: str | None = None
    header: str | None = None
    value: str | None = None
    reason: str | None = None
    line: int | None = None
    column: int | None = None
    size: int | None = None
    limit: int | None = None


class EventError(KvrouteError, ValueError):
    """A KV-event payload is not a valid event batch; nothing of it was applied.

    ``offset`` is the byte offset of the value at fault; ``event`` the index of the event at
    fault (``None`` for the batch envelope); ``field`` the wire field when one is missing.
    """

    offset: int = 0
    event: int | None = None
    field: str | None = None


class StateError(KvrouteError):
    """An endpoint-table or request-tracking operation was refused.

    ``kind``: ``"invalid_endpoint_id"``, ``"unknown_endpoint"``, ``"too_many_endpoints"``
    (``limit``), ``"invalid_metrics"`` (``field``, ``value``) or ``"unknown_request"``
    (``request_id``). ``endpoint`` names the endpoint concerned.
    """

    endpoint: str | None = None
    request_id: str | None = None
    field: str | None = None
    value: str | None = None
    reason: str | None = None
    limit: int | None = None


class NoEndpointsError(StateError):
    """No healthy endpoint can serve the request (none registered, all unhealthy, or none that
    can decode). ``kind`` is ``"no_endpoints"``; ``reason`` says what was missing."""


class SubscribeError(KvrouteError):
    """A KV-event subscription could not be started or ended badly.

    ``kind``: ``"invalid_config"`` (``field``), ``"endpoint_id"``, ``"socket"`` (``op``,
    ``endpoint``), ``"spawn"`` or ``"worker_panicked"``.
    """

    field: str | None = None
    op: str | None = None
    endpoint: str | None = None
    reason: str | None = None


class TokenizerError(KvrouteError):
    """A tokenizer (``tokenizer.json``, chat template, tokenizer config) could not be loaded."""

    path: str | None = None


class MetricsError(KvrouteError, ValueError):
    """A Prometheus metrics page could not be used; nothing was stored.

    ``kind``: ``"malformed"`` (``line``, 1-based, ``text`` and ``reason``) or
    ``"no_known_metrics"`` (no vLLM or SGLang engine metric on the page).
    """

    line: int | None = None
    text: str | None = None
    reason: str | None = None


class SimulationError(KvrouteError, ValueError):
    """The trace simulator refused its settings or workload: ``field`` names the setting,
    ``line`` the trace line, ``path`` the file that could not be read or written."""

    field: str | None = None
    line: int | None = None
    path: str | None = None
    reason: str | None = None


class RejectedError(KvrouteError):
    """Flow control refused the request or dropped it from its queue (``await Router.admit()``).

    Answer the client with ``status`` (429, or 503 when the pool is empty or the router is
    shutting down) and ``headers`` (``x-llm-d-request-dropped-reason: reason``). ``reason`` is
    llm-d's (``"rejected-saturated"``, ``"rejected-ttl-expired"``, ``"rejected-no-endpoints"``,
    ``"rejected-shutting-down"``, ``"evicted-priority"``, ``"evicted-queue-pressure"``) and
    ``kind`` the same in snake case; ``waited_ms`` is how long it was queued (0 when refused at
    admission) and ``ticket`` its queue ticket (``None`` when refused at admission).
    """

    status: int = 429
    reason: str = ""
    waited_ms: int = 0
    ticket: int | None = None

    @classmethod
    def of(cls, status: int, reason: str, *, waited_ms: int = 0, ticket: int | None = None) -> RejectedError:
        """The error for a rejection with ``status`` and ``reason``."""
        what = _REASONS.get(reason, "flow control dropped it")
        message = f"{reason} ({status}): {what}"
        return cls(
            message, kind=reason.replace("-", "_"), status=status, reason=reason, waited_ms=waited_ms, ticket=ticket
        )

    @property
    def headers(self) -> dict[str, str]:
        """The response headers to answer with: ``{"x-llm-d-request-dropped-reason": reason}``."""
        return {HEADER_DROPPED_REASON: self.reason}


class ReplicationError(KvrouteError):
    """Router replication (``Router.replicate``) was refused or could not start.

    ``kind``: ``"invalid_options"`` (a :class:`ReplicationConfigError`: ``field``, ``reason``),
    ``"already_replicating"`` (``replica_id``: the router already replicates; stop that
    replication first), ``"transport"`` (``reason``: the NATS client or its thread could not
    start), ``"not_enabled"`` or ``"malformed"``. An unreachable server or refused credentials
    are not errors: see ``Replication.stats()``.
    """

    field: str | None = None
    reason: str | None = None
    replica_id: str | None = None


class ReplicationConfigError(ReplicationError, ConfigError):
    """The replication options are invalid: malformed JSON, an unknown key, a wrong type or a
    value out of range. ``kind`` is ``"invalid_options"``; ``field`` names the setting
    (``"options"`` when the document itself does not parse, the message then says where)."""


# Shown (and pickled) as `kvroute.ConfigError` etc.: this module is an implementation detail.
for _cls in (
    KvrouteError,
    ConfigError,
    RequestError,
    EventError,
    StateError,
    NoEndpointsError,
    SubscribeError,
    TokenizerError,
    MetricsError,
    SimulationError,
    RejectedError,
    ReplicationError,
    ReplicationConfigError,
):
    _cls.__module__ = "kvroute"
del _cls

"""Real-engine check: kvroute follows the KV events of vLLM's OWN publisher.

Every batch here is built with vLLM's event classes (``KVEventBatch``, ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared`` from ``vllm.distributed.kv_events``) exactly as vLLM's
``BlockPool`` builds them, and put on the wire by vLLM's ``ZmqEventPublisher`` thread (its PUB
socket and its ROUTER replay socket, bound to ephemeral loopback ports). Block hashes come from
vLLM's own request block hasher (``vllm.v1.core.kv_cache_utils.get_request_block_hasher`` with
``vllm.utils.hashing.get_hash_fn_by_name``), converted by ``maybe_convert_block_hash`` as the
engine does before publishing. kvroute receives them through ``Router.subscribe`` (its native ZMQ
subscriber thread), and the tests assert that the precise index and the routing decisions for
token-id prompts change as the events say.

vLLM is installed without torch (``py/requirements-vllm.txt``); ``vllm_shim`` imports the few
modules needed. Without vLLM the module is skipped.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq

import kvroute
import vllm_shim

try:
    VLLM = vllm_shim.load()
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"vLLM {vllm_shim.VLLM_VERSION} is not importable: {exc} (scripts/test.sh installs it)",
        allow_module_level=True,
    )

KV: Any = VLLM.kv_events
KCU: Any = VLLM.kv_cache_utils

#: vLLM's default ``--block-size`` (and kvroute's ``engine_block_tokens``).
BLOCK = 16
#: Router endpoint ids (identities only: nothing connects to them).
A = "127.0.0.1:18001"
B = "127.0.0.1:18002"
TOPIC = "kv"
#: Upper bound of every wait on the subscriber thread (loopback: normally a few milliseconds).
WAIT_S = 15.0

PRECISE_DUAL: dict[str, Any] = {"index": {"mode": "precise"}}
PRECISE_ENGINE_SHA256_CBOR: dict[str, Any] = {
    "index": {"mode": "precise", "precise": {"keys": "engine", "engine": {"algo": "sha256_cbor"}}}
}


def test_vllm_is_the_expected_release() -> None:
    """The wire format and hashing asserted here are vLLM 0.33's."""
    assert VLLM.version == vllm_shim.VLLM_VERSION
    assert KV.ZmqEventPublisher.__module__ == "vllm.distributed.kv_events"


# --------------------------------------------------------------------------------------------
# vLLM side: its publisher, its hashing, its event shapes
# --------------------------------------------------------------------------------------------


class _LoopbackPublisher(KV.ZmqEventPublisher):  # type: ignore[misc]
    """vLLM's ``ZmqEventPublisher``, unchanged, plus a record of the addresses its sockets were
    bound to: ``tcp://127.0.0.1:*`` makes vLLM bind (its heuristic binds on ``*``) to an
    ephemeral loopback port, whose number only the socket knows. Read in ``_socket_setup``
    (called by ``__init__`` before the publisher thread starts, so no socket is shared)."""

    bound_endpoint: str
    bound_replay_endpoint: str

    def _socket_setup(self) -> None:
        super()._socket_setup()
        self.bound_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bound_replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)


class VllmPublisher:
    """One engine's KV-event publisher: vLLM's ``ZmqEventPublisher`` with a replay socket."""

    def __init__(self) -> None:
        self._pub: Any = _LoopbackPublisher(
            data_parallel_rank=0,
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            buffer_steps=1_000,
            topic=TOPIC,
        )
        self.endpoint: str = self._pub.bound_endpoint
        self.replay_endpoint: str = self._pub.bound_replay_endpoint
        #: Batches handed to ``publish()``.
        self.published = 0

    def publish(self, *events: Any) -> None:
        """Publish one ``KVEventBatch`` (vLLM's ``publish()`` fills in the rank; its thread
        numbers and encodes the batch)."""
        self._pub.publish(KV.KVEventBatch(ts=time.time(), events=list(events)))
        self.published += 1

    def sent(self) -> int:
        """Batches the publisher thread has sent (and keeps for replay)."""
        return len(self._pub._buffer)

    def close(self) -> None:
        self._pub.shutdown()


@dataclass
class _EngineRequest:
    """The attributes of ``vllm.v1.request.Request`` that vLLM's block hasher and
    ``generate_block_hash_extra_keys`` read (a plain prompt: no LoRA, multimodal input, cache
    salt or prompt embeddings)."""

    all_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None
    _prompt_embeds_per_block_hashes: dict[Any, Any] = field(default_factory=dict)
    lora_request: Any = None
    cache_salt: str | None = None
    session_id: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class EngineSequence:
    """A token sequence as a vLLM engine with ``--prefix-caching-hash-algo algo`` caches it:
    block digests from vLLM's request block hasher, events shaped as ``BlockPool`` emits them.

    ``PYTHONHASHSEED`` must be unset (tests use ``monkeypatch``), so ``NONE_HASH`` is vLLM's
    fixed seed for the sha256 variants — what kvroute assumes without ``python_hash_seed``."""

    def __init__(self, tokens: list[int], algo: str = "sha256") -> None:
        assert "PYTHONHASHSEED" not in os.environ
        hash_fn = VLLM.hashing.get_hash_fn_by_name(algo)
        KCU.init_none_hash(hash_fn)
        self.tokens = tokens
        self.request = _EngineRequest(list(tokens))
        self.digests: list[bytes] = list(KCU.get_request_block_hasher(BLOCK, hash_fn)(self.request))
        assert len(self.digests) == len(tokens) // BLOCK

    def key(self, i: int) -> Any:
        """The published form of block ``i``'s hash (u64 int, or the digest bytes when
        ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""
        return KCU.maybe_convert_block_hash(self.digests[i])

    def stored(self, first: int, last: int) -> Any:
        """``BlockStored`` for blocks ``first..last`` (exclusive), parent = block ``first - 1``."""
        extra = [
            KCU.generate_block_hash_extra_keys(self.request, i * BLOCK, (i + 1) * BLOCK, 0)[0] for i in range(first, last)
        ]
        return KV.BlockStored(
            block_hashes=[self.key(i) for i in range(first, last)],
            parent_block_hash=None if first == 0 else self.key(first - 1),
            token_ids=self.tokens[first * BLOCK : last * BLOCK],
            block_size=BLOCK,
            lora_id=None,
            medium=KV.MEDIUM_GPU,
            lora_name=None,
            extra_keys=KCU.to_event_extra_keys(extra),
            group_idx=0,
        )

    def removed(self, first: int, last: int) -> Any:
        """``BlockRemoved`` (evictions) for blocks ``first..last`` (exclusive)."""
        hashes = [self.key(i) for i in range(first, last)]
        return KV.BlockRemoved(block_hashes=hashes, medium=KV.MEDIUM_GPU, group_idx=0)


# --------------------------------------------------------------------------------------------
# kvroute side
# --------------------------------------------------------------------------------------------


def wait_for(what: str, cond: Callable[[], bool]) -> None:
    """Poll `cond` until it holds (at most WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {WAIT_S} s waiting for {what}"
        time.sleep(0.005)


def make_router(config: dict[str, Any]) -> kvroute.Router:
    """A router with two idle decode endpoints A and B (equal metrics: only the index differs)."""
    r = kvroute.Router(config)
    for ep in (A, B):
        r.upsert_endpoint(ep, "decode")
        r.update_metrics(ep, waiting=0, running=0, kv_usage=0.1)
    return r


def memberships(r: kvroute.Router) -> dict[str, int]:
    """Blocks each endpoint holds in the precise index, as its engine reported them."""
    return {e["id"]: e["precise_memberships"] for e in r.endpoints()}


def route(r: kvroute.Router, tokens: list[int]) -> kvroute.Decision:
    """Route a completions request with a token-id prompt (and complete it at once)."""
    d = r.route({"model": "llama", "prompt": tokens, "max_tokens": 16})
    r.complete(d.request_id)
    assert d.header("x-gateway-destination-endpoint") == d.endpoint
    return d


def matched(d: kvroute.Decision) -> dict[str, int]:
    return {ep: s.matched_blocks for ep, s in d.scores.items()}


Connect = Callable[[kvroute.Router, str, VllmPublisher], kvroute.Subscription]


@pytest.fixture
def publishers() -> Iterator[Callable[[], VllmPublisher]]:
    """Makes vLLM publishers; shuts them down after the test."""
    made: list[VllmPublisher] = []

    def make() -> VllmPublisher:
        p = VllmPublisher()
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def connect() -> Iterator[Connect]:
    """Subscribes a router endpoint to a vLLM publisher (live PUB + replay ROUTER) and waits
    until the stream flows; stops every subscription after the test."""
    with contextlib.ExitStack() as stack:

        def subscribe(r: kvroute.Router, endpoint: str, pub: VllmPublisher) -> kvroute.Subscription:
            sub = r.subscribe(endpoint, pub.endpoint, topic=TOPIC, replay=pub.replay_endpoint)
            stack.callback(sub.stop)
            assert sub.running and sub.local_endpoint == pub.endpoint
            # ZMQ's slow joiner: a PUB socket drops what it sends before the subscriber's
            # connection is up. Publish empty batches until one arrives; from then on nothing is
            # lost (a later loss would be a gap, recovered through vLLM's replay socket).
            deadline = time.monotonic() + WAIT_S
            while sub.stats()["applied"] == 0:
                assert time.monotonic() < deadline, "the subscriber never received a batch"
                pub.publish()
                wait_until = time.monotonic() + 0.05
                while sub.stats()["applied"] == 0 and time.monotonic() < wait_until:
                    time.sleep(0.002)
            return sub

        yield subscribe


@pytest.fixture(autouse=True)
def _fixed_none_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM seeds NONE_HASH from PYTHONHASHSEED when set: leave it unset (vLLM's default)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


def test_stored_removed_cleared_drive_routing(publishers: Callable[[], VllmPublisher], connect: Connect) -> None:
    """Dual keys (the default): kvroute learns vLLM's block hashes from BlockStored's token ids
    and parent hashes; removals and clears shrink what an endpoint is credited with."""
    r = make_router(PRECISE_DUAL)
    pa, pb = publishers(), publishers()
    sa, sb = connect(r, A, pa), connect(r, B, pb)
    prompt = EngineSequence([(7919 * i + 13) % 128_000 for i in range(4 * BLOCK)])  # vLLM default sha256
    assert memberships(r) == {A: 0, B: 0}

    # B's engine caches the prompt: two BlockStored, the second chained to the first by its parent.
    pb.publish(prompt.stored(0, 2))
    pb.publish(prompt.stored(2, 4))
    wait_for("B's 4 blocks", lambda: memberships(r)[B] == 4)
    d = route(r, prompt.tokens)
    assert d.endpoint == B and d.scores[B].precise
    assert matched(d) == {A: 0, B: 4}
    assert (d.cached_tokens, d.prefix_hit) == (64, 1.0)
    # The prompt plus a partial block: only full blocks are cached.
    d = route(r, prompt.tokens + [1, 2, 3])
    assert (d.endpoint, d.cached_tokens) == (B, 64) and matched(d)[B] == 4

    # A's engine caches the first half: B still holds more.
    pa.publish(prompt.stored(0, 2))
    wait_for("A's 2 blocks", lambda: memberships(r)[A] == 2)
    d = route(r, prompt.tokens)
    assert d.endpoint == B and matched(d) == {A: 2, B: 4}

    # B evicts blocks 1..3: A's two blocks now beat B's one.
    pb.publish(prompt.removed(1, 4))
    wait_for("B's eviction", lambda: memberships(r)[B] == 1)
    d = route(r, prompt.tokens)
    assert d.endpoint == A and matched(d) == {A: 2, B: 1}
    assert (d.cached_tokens, d.prefix_hit) == (32, 0.5)

    # A's engine resets its prefix cache: back to B.
    pa.publish(KV.AllBlocksCleared())
    wait_for("A's clear", lambda: memberships(r)[A] == 0)
    d = route(r, prompt.tokens)
    assert d.endpoint == B and matched(d) == {A: 0, B: 1}
    assert d.cached_tokens == 16

    pb.publish(KV.AllBlocksCleared())
    wait_for("B's clear", lambda: memberships(r)[B] == 0)
    d = route(r, prompt.tokens)
    assert matched(d) == {A: 0, B: 0} and d.cached_tokens == 0

    precise = r.stats()["precise"]
    assert (precise["blocks_stored"], precise["blocks_removed"]) == (6, 3)
    assert (precise["orphan_blocks"], precise["malformed_events"], precise["gaps"]) == (0, 0, 0)
    for sub in (sa, sb):
        s = sub.stats()
        assert (s["gaps"], s["malformed"], s["router_errors"], s["resyncs"]) == (0, 0, 0, 0)
    assert all(e["events_healthy"] for e in r.endpoints())


def test_missed_batch_is_replayed_from_vllm(publishers: Callable[[], VllmPublisher], connect: Connect) -> None:
    """A batch published while kvroute was not listening is fetched from vLLM's replay socket
    (vLLM ≥ 0.26 answer format) when the next live batch reveals the gap."""
    r = make_router(PRECISE_DUAL)
    pa = publishers()
    first = connect(r, A, pa)
    first.stop()
    prompt = EngineSequence(list(range(5000, 5000 + 4 * BLOCK)))
    pa.publish(prompt.stored(0, 4))  # nobody is listening: only vLLM's replay buffer keeps it
    wait_for("vLLM to send every batch", lambda: pa.sent() == pa.published)
    assert memberships(r)[A] == 0

    sub = connect(r, A, pa)  # its first live batch is a gap for the router's stream of A
    wait_for("the replayed blocks", lambda: memberships(r)[A] == 4)
    s = sub.stats()
    assert s["gaps"] >= 1 and s["replays"] >= 1 and s["replayed_batches"] >= 1
    assert (s["replay_failures"], s["resyncs"], s["malformed"]) == (0, 0, 0)
    d = route(r, prompt.tokens)
    assert d.endpoint == A and matched(d) == {A: 4, B: 0}
    # The subscriber counts a replay in the router's metrics once the replay has ended, which is
    # after the replayed batches were applied (the blocks above can be seen a moment earlier).
    wait_for("the router to count the replay", lambda: r.stats()["precise"]["replays"] >= 1)


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int-hashes", "bytes-hashes"])
def test_engine_keys_sha256_cbor(
    publishers: Callable[[], VllmPublisher], connect: Connect, monkeypatch: pytest.MonkeyPatch, int_hashes: bool
) -> None:
    """Engine keys: kvroute computes vLLM's sha256_cbor block hashes from the request's token
    ids and finds the hashes vLLM published. B's engine publishes the same token ids hashed
    with another algorithm (sha256 over pickle): stored, but never matched."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if int_hashes else "0")
    r = make_router(PRECISE_ENGINE_SHA256_CBOR)
    pa, pb = publishers(), publishers()
    connect(r, A, pa)
    connect(r, B, pb)
    tokens = [0, 23, 24, 255, 256, 65535, 65536, 151643, 2**31 - 1, 2**31, 2**32 - 1] * 6  # every CBOR width
    tokens = tokens[: 4 * BLOCK]
    right = EngineSequence(tokens, "sha256_cbor")
    wrong = EngineSequence(tokens, "sha256")
    assert isinstance(right.key(0), int if int_hashes else bytes)
    assert right.key(0) != wrong.key(0)

    pa.publish(right.stored(0, 2))
    pa.publish(right.stored(2, 4))
    pb.publish(wrong.stored(0, 4))
    wait_for("both engines' blocks", lambda: memberships(r) == {A: 4, B: 4})
    d = route(r, tokens)
    assert d.endpoint == A and d.scores[A].precise
    assert matched(d) == {A: 4, B: 0}
    assert (d.cached_tokens, d.prefix_hit) == (64, 1.0)
    # A prefix of the prompt (two full blocks and a partial one) matches two blocks.
    d = route(r, tokens[: 2 * BLOCK + 5])
    assert d.endpoint == A and matched(d) == {A: 2, B: 0}

    pa.publish(right.removed(3, 4))
    wait_for("A's eviction", lambda: memberships(r)[A] == 3)
    d = route(r, tokens)
    assert d.endpoint == A and matched(d) == {A: 3, B: 0} and d.cached_tokens == 48

    pa.publish(KV.AllBlocksCleared())
    wait_for("A's clear", lambda: memberships(r)[A] == 0)
    d = route(r, tokens)
    assert matched(d) == {A: 0, B: 0} and d.cached_tokens == 0
    assert r.stats()["precise"]["malformed_events"] == 0

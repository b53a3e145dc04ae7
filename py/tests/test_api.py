"""The Python API: construction, reload, endpoint table, route, complete, events, metrics,
tokenizer, simulator, and the value objects a decision hands out."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import pytest

import kvroute
from conftest import EP1, EP2, FIXTURES, NOW, chat
from events import batch, stored, token_body

SYSTEM = "You are a helpful assistant. " * 200


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------

YAML = "modes:\n  colocated_input_max_tokens: 300\n"
JSON = '{"modes": {"colocated_input_max_tokens": 300}}'


def test_router_accepts_every_config_form(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(YAML)
    (tmp_path / "p.json").write_text(JSON)
    forms: list[object] = [
        {"modes": {"colocated_input_max_tokens": 300}},
        JSON,
        YAML,
        JSON.encode(),
        tmp_path / "p.yaml",
        tmp_path / "p.json",
        kvroute.Policy(YAML),
    ]
    for form in forms:
        r = kvroute.Router(form)  # type: ignore[arg-type]
        assert r.policy.to_dict()["modes"]["colocated_input_max_tokens"] == 300, form
        assert r.policy_version == 1
    assert kvroute.Router().policy == kvroute.Policy()
    assert kvroute.Router(None).policy.to_dict()["modes"]["colocated_input_max_tokens"] == 512


def test_policy_normalizes_pickles_and_compares() -> None:
    p = kvroute.Policy({"modes": {"bypass_prefix_hit": 0.95}})
    doc = json.loads(p.to_json())
    assert doc["modes"]["bypass_prefix_hit"] == 0.95
    assert doc["modes"]["decode_kv_ceiling"] == 0.8, "defaults are spelled out"
    assert p.to_dict() == doc
    assert pickle.loads(pickle.dumps(p)) == p
    assert p != kvroute.Policy()
    assert p != "not a policy"
    assert repr(p).startswith("Policy({") and '"bypass_prefix_hit":0.95' in repr(p)
    assert kvroute.Policy(p.to_json()) == p, "the normalized form reads back as the same policy"


def test_reload_returns_the_version_and_switches_the_rule(router: kvroute.Router) -> None:
    body = chat("short", max_tokens=16)
    assert router.route(body, now=NOW).rule == "colocated_fast_path"
    assert router.reload({"modes": {"colocated_input_max_tokens": 1}}) == 2
    d = router.route(body, now=NOW)
    assert (d.rule, d.policy_version) == ("no_prefill_pool", 2)
    assert router.reload(kvroute.Policy()) == 3
    assert router.reload(YAML) == 4
    assert router.policy_version == 4
    assert router.stats()["counters"]["reloads"] == 3


def test_reload_from_a_path(router: kvroute.Router, tmp_path: Path) -> None:
    f = tmp_path / "policy.yaml"
    f.write_text("modes:\n  disaggregation: false\n")
    assert router.reload(f) == 2
    assert router.policy.to_dict()["modes"]["disaggregation"] is False
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        router.reload(tmp_path / "missing.yaml")
    assert router.policy_version == 2


# ----------------------------------------------------------------------------------------------
# Endpoints and metrics
# ----------------------------------------------------------------------------------------------


def test_endpoint_table(router: kvroute.Router) -> None:
    router.upsert_endpoint("10.0.1.1:8000", "prefill")
    router.set_healthy(EP2, False)
    eps = {e["id"]: e for e in router.endpoints()}
    assert list(eps) == [EP1, EP2, "10.0.1.1:8000"]
    assert eps["10.0.1.1:8000"]["role"] == "prefill"
    assert eps[EP2]["healthy"] is False
    assert eps[EP1]["metrics"] == {
        "waiting": 0,
        "running": 0,
        "kv_usage": 0.1,
        "lora_running": [],
        "lora_waiting": [],
        "max_lora": None,
        "kv_capacity_tokens": None,
        "updated_ms": NOW,
    }
    router.upsert_endpoint(EP2, "both")  # role change keeps the endpoint
    assert {e["id"]: e["role"] for e in router.endpoints()}[EP2] == "both"
    router.remove_endpoint("10.0.1.1:8000")
    assert [e["id"] for e in router.endpoints()] == [EP1, EP2]
    assert router.stats()["endpoints"] == 2


def test_update_metrics_fields(router: kvroute.Router) -> None:
    router.update_metrics(
        EP1, waiting=3, running=5, kv_usage=0.5, lora_running=["sql"], lora_waiting=("chat",), max_lora=4, now=7
    )
    m = router.endpoints()[0]["metrics"]
    assert (m["waiting"], m["running"], m["kv_usage"], m["updated_ms"]) == (3, 5, 0.5, 7)
    assert (m["lora_running"], m["lora_waiting"], m["max_lora"]) == (["sql"], ["chat"], 4)


VLLM_PAGE = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="0",model_name="llama"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 1.7e+09
vllm:cache_config_info{block_size="16",num_gpu_blocks="27000",cache_dtype="auto"} 1.0
"""


def test_update_metrics_from_prometheus(router: kvroute.Router) -> None:
    m = router.update_metrics_from_prometheus(EP1, VLLM_PAGE, now=5_000)
    assert (m["waiting"], m["running"], m["kv_usage"]) == (3, 7, 0.42)
    assert (m["lora_running"], m["max_lora"], m["kv_capacity_tokens"]) == (["sql", "chat"], 4, 16 * 27000)
    assert m["updated_ms"] == 5_000
    assert router.endpoints()[0]["metrics"] == m
    sglang = 'sglang:num_queue_reqs{model_name="m"} 4\nsglang:num_running_reqs{model_name="m"} 9\n'
    assert router.update_metrics_from_prometheus(EP2, sglang, now=5_000)["waiting"] == 4


def test_metrics_text_is_prometheus_exposition(router: kvroute.Router) -> None:
    d = router.route(chat(SYSTEM), now=NOW)
    router.complete(d.request_id)
    router.route(chat(SYSTEM), now=NOW + 1)
    with pytest.raises(kvroute.ConfigError):
        router.reload("{")
    text = router.metrics_text(now=NOW + 2)
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['kvroute_decisions_total{mode="decode-direct",rule="decode_direct"}'] == 1
    assert samples["kvroute_prefix_hit_ratio_count"] == 2
    assert "# TYPE kvroute_prefix_hit_ratio histogram" in text
    assert any(k.startswith("kvroute_index_memberships") for k in samples)
    failures = [v for k, v in samples.items() if "reload" in k and "fail" in k]
    assert failures == [1], text


def test_default_clock_is_shared(router: kvroute.Router) -> None:
    """`now` defaults to UNIX milliseconds everywhere: metrics stored without `now` are fresh for
    a route without `now`, and stale for one 10 s later."""
    before = int(time.time() * 1000)
    assert before - 5 <= kvroute.now_ms() <= int(time.time() * 1000) + 5
    router.update_metrics(EP1, waiting=0, running=0, kv_usage=0.1)
    router.update_metrics(EP2, waiting=0, running=0, kv_usage=0.1)
    assert router.route(chat("x")).score(EP1).filtered is None  # type: ignore[union-attr]
    late = router.route(chat("x"), now=kvroute.now_ms() + 10_000)
    assert late.score(EP1).filtered == "stale_metrics"  # type: ignore[union-attr]
    assert router.endpoints()[0]["metrics"]["updated_ms"] >= before


# ----------------------------------------------------------------------------------------------
# Route and complete
# ----------------------------------------------------------------------------------------------


def test_route_decision_fields(router: kvroute.Router) -> None:
    first = router.route(chat(SYSTEM), {"x-request-id": "r1"}, now=NOW)
    router.complete(first.request_id)
    d = router.route(chat(SYSTEM), {"x-request-id": "r2"}, now=NOW + 10)
    assert d.request_id == "r2"
    assert d.endpoint == first.endpoint
    assert (d.mode, d.rule, d.policy_version) == ("decode-direct", "decode_direct", 1)
    assert d.prefill_endpoint is None and d.shed is None and d.transfer is None
    assert d.headers == {"x-gateway-destination-endpoint": d.endpoint, "x-kvroute-mode": "decode-direct"}
    assert d.header("x-kvroute-mode") == "decode-direct" and d.header("nope") is None
    assert d.prefix_hit == 1.0
    assert 0 < d.cached_tokens <= d.input_tokens
    assert d.relaxed_filters is False and d.saturation >= 0
    j = d.judgment
    assert (j.horizon, j.risk, j.bypass_probability, j.source) == ("short", 0, None, "derived")
    assert d.endpoints == [EP1, EP2]
    assert list(d.scores) == [EP1, EP2]
    s = d.scores[d.endpoint]  # type: ignore[index]
    assert (s.endpoint, s.role, s.filtered, s.precise) == (d.endpoint, "decode", None, False)
    assert s.prefix_hit == 1.0 and s.matched_blocks > 0
    assert d.score(EP1) is not None and d.score("10.9.9.9:1") is None
    full = d.to_dict()
    assert full["request_id"] == "r2" and full["rule"] == "decode_direct" and len(full["scores"]) == 2
    assert json.loads(d.to_json()) == full
    assert repr(d).startswith("Decision(request_id='r2', rule='decode_direct', mode='decode-direct'")


def test_body_and_header_forms_agree(router: kvroute.Router) -> None:
    body = chat("Be brief. " * 50, max_tokens=500)
    text = json.dumps(body)
    forms: list[tuple[object, object]] = [
        (body, {"x-session-id": "s"}),
        (text, [("x-session-id", "s")]),
        (text.encode(), [(b"x-session-id", b"s")]),  # an ASGI scope's headers
        (bytearray(text.encode()), (("x-session-id", "s"),)),
        (memoryview(text.encode()), {"x-session-id": "s"}.items()),
    ]
    warm = router.route(body, now=NOW)
    router.complete(warm.request_id)
    decisions = []
    for b, h in forms:
        d = router.route(b, h, now=NOW)  # type: ignore[arg-type]
        decisions.append((d.endpoint, d.input_tokens, d.rule, d.prefix_hit))
        router.complete(d.request_id)
    assert decisions == [(warm.endpoint, warm.input_tokens, "decode_direct", 1.0)] * len(forms)


def test_disaggregated_decision_exposes_the_transfer_estimate() -> None:
    r = kvroute.Router()
    r.upsert_endpoint(EP1, "decode")
    r.upsert_endpoint("10.0.1.1:8000", "prefill")
    for ep in (EP1, "10.0.1.1:8000"):
        r.update_metrics(ep, waiting=0, running=8, kv_usage=0.3, now=NOW)
    d = r.route(chat("x" * 40_000, max_tokens=500), now=NOW)
    assert (d.mode, d.prefill_endpoint) == ("disaggregated", "10.0.1.1:8000")
    assert d.headers["x-prefiller-host-port"] == "10.0.1.1:8000"
    t = d.transfer
    assert t is not None and t.pays and t.tokens > 0 and t.kv_bytes > 0
    assert t.disaggregated_cost_s < t.colocated_cost_s


def test_shed_decision() -> None:
    r = kvroute.Router()
    r.upsert_endpoint(EP1, "decode")
    r.update_metrics(EP1, waiting=50, running=8, kv_usage=0.95, now=NOW)
    d = r.route(chat("x"), {"x-kvroute-priority": "-1"}, now=NOW)
    assert (d.rule, d.mode, d.endpoint) == ("shed", None, None)
    assert d.shed is not None and d.shed.status == 429 and d.shed.reason
    assert d.headers == {"x-kvroute-shed-reason": d.shed.reason}


def test_complete_balances_inflight(router: kvroute.Router) -> None:
    ds = [router.route(chat(f"prompt {i}"), now=NOW) for i in range(6)]
    assert sum(e["inflight"] for e in router.endpoints()) == 6
    assert router.stats()["inflight_requests"] == 6
    for d in ds:
        router.complete(d.request_id)
    assert sum(e["inflight"] for e in router.endpoints()) == 0
    with pytest.raises(kvroute.StateError) as e:
        router.complete(ds[0].request_id)
    assert (e.value.kind, e.value.request_id) == ("unknown_request", ds[0].request_id)


# ----------------------------------------------------------------------------------------------
# KV events (precise index)
# ----------------------------------------------------------------------------------------------


def precise_router() -> kvroute.Router:
    r = kvroute.Router({"index": {"mode": "precise"}})
    for ep in (EP1, EP2):
        r.upsert_endpoint(ep, "decode")
        r.update_metrics(ep, waiting=0, running=0, kv_usage=0.1, now=NOW)
    return r


def test_events_feed_the_precise_index() -> None:
    r = precise_router()
    tokens = list(range(1000, 1064))  # 4 engine blocks
    out = r.apply_events(EP2, batch(stored(tokens)), 1, now=NOW)
    assert (out.verdict, out.events, out.blocks, out.expected, out.got) == ("applied", 1, 4, None, None)
    assert repr(out) == "ApplyOutcome(verdict='applied', events=1, blocks=4)"
    d = r.route(token_body(tokens), now=NOW)
    assert (d.endpoint, d.cached_tokens) == (EP2, 64)
    assert d.scores[EP2].precise and d.scores[EP2].matched_blocks == 4
    assert r.stats()["precise"]["blocks_stored"] == 4


def test_event_stream_gap_duplicate_and_resync() -> None:
    r = precise_router()
    a, b = list(range(64)), list(range(500, 564))
    assert r.apply_events(EP1, batch(stored(a)), 1, now=NOW).verdict == "applied"
    assert r.apply_events(EP1, batch(stored(a)), 1, now=NOW).verdict == "duplicate"
    gap = r.apply_events(EP1, batch(stored(b), ts=2.0), 3, now=NOW)
    assert (gap.verdict, gap.expected, gap.got, gap.blocks) == ("gap", 2, 3, 0)
    r.resync_stream(EP1, now=NOW)
    assert r.apply_events(EP1, batch(stored(b), ts=2.0), 3, now=NOW).verdict == "applied"
    assert r.stats()["precise"]["gaps"] == 1 and r.stats()["precise"]["resyncs"] == 1


def test_recorded_engine_payloads_apply() -> None:
    r = precise_router()
    files = sorted((FIXTURES / "events").glob("vllm033_*.msgpack"))
    assert files
    for f in files:
        out = r.apply_events(EP1, f.read_bytes(), None, now=NOW)
        assert out.verdict == "applied", f


def test_record_replay_counts(router: kvroute.Router) -> None:
    router.record_replay(EP1, True)
    router.record_replay(EP1, False)
    assert router.stats()["precise"]["replays"] == 1, "successful replays"
    assert router.stats()["precise"]["replay_failures"] == 1


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def test_tokenizer_gives_precise_keys_to_chat_requests() -> None:
    """In precise mode a chat request has no token ids; with the tokenizer it gets exact ones,
    so the speculative entries of the first route make the second one a hit."""
    body = chat("You are a careful assistant. " * 40)

    def second_route_cached(r: kvroute.Router) -> tuple[int, int]:
        first = r.route(body, now=NOW)
        r.complete(first.request_id)
        d = r.route(body, now=NOW + 1)
        r.complete(d.request_id)
        return d.cached_tokens, d.input_tokens

    plain = precise_router()
    assert second_route_cached(plain)[0] == 0
    tok = precise_router()
    tok.set_tokenizer(FIXTURES / "tokenizer")
    cached, input_tokens = second_route_cached(tok)
    assert cached > 0 and input_tokens != second_route_cached(plain)[1]
    assert tok.stats()["counters"]["tokenize_errors"] == 0
    tok.set_tokenizer(str(FIXTURES / "tokenizer" / "tokenizer.json"))  # a file works too
    tok.set_tokenizer(None)


def test_tokenizer_errors() -> None:
    r = precise_router()
    with pytest.raises(kvroute.TokenizerError) as e:
        r.set_tokenizer("/nonexistent/tokenizer.json")
    assert e.value.kind == "io" and e.value.path == "/nonexistent/tokenizer.json"
    with pytest.raises(TypeError):
        r.set_tokenizer(42)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# Simulator
# ----------------------------------------------------------------------------------------------


def test_simulate_small_run(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    res = kvroute.simulate(sessions=12, endpoints=4, seed=7, turns="2-3", write_trace=trace)
    assert [r["policy"] for r in res.reports] == ["round-robin", "least-loaded", "kvroute"]
    assert res.requests == len(trace.read_text().splitlines()) > 12
    assert "| kvroute " in res.table and res.svg().startswith("<svg")
    assert res.cluster["endpoints"] == 4 and "4 endpoints" in res.cluster_description
    assert res.to_dict()["requests"] == res.requests
    again = kvroute.simulate(trace=trace, endpoints=4, policies=["kvroute"])
    assert again.requests == res.requests
    strip = ("mean_route_us",)
    a = {k: v for k, v in again.reports[0].items() if k not in strip}
    b = {k: v for k, v in res.reports[2].items() if k not in strip}
    assert a == b, "replaying the written trace gives the same kvroute report"


def test_simulate_errors() -> None:
    with pytest.raises(kvroute.SimulationError) as e:
        kvroute.simulate(endpoints=0, sessions=1)
    assert e.value.field == "endpoints"
    with pytest.raises(kvroute.SimulationError) as e:
        kvroute.simulate(turns="5-3")
    assert e.value.field == "turns"
    with pytest.raises(kvroute.SimulationError) as e:
        kvroute.simulate(policies=["random"])  # type: ignore[list-item]
    assert e.value.kind == "unknown_policy"
    with pytest.raises(kvroute.ConfigError):
        kvroute.simulate(policy={"modes": {"bypass_prefix_hit": 7}})
    with pytest.raises(TypeError):
        kvroute.simulate(turns=2.5)  # type: ignore[arg-type]


def test_version() -> None:
    assert kvroute.__version__.count(".") == 2


def test_package_docstring_example_runs() -> None:
    import doctest

    result = doctest.testmod(kvroute)
    assert result.attempted > 0 and result.failed == 0


def test_public_names_live_in_the_package() -> None:
    """Classes report themselves as `kvroute.X` (the native module is private), and pickling
    finds them there."""
    for name in kvroute.__all__:
        obj = getattr(kvroute, name)
        if isinstance(obj, type):
            assert obj.__module__ == "kvroute", name
            assert getattr(kvroute, obj.__qualname__) is obj

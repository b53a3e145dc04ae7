//! The OpenAI-compatible API: completions, chat, streaming, usage, errors, metrics read by
//! kvroute, and prefix-cache hits measured by the worker's counters.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kvroute_worker::{spawn, WorkerConfig};
use serde_json::json;

#[test]
fn completion_then_cache_hit_skips_prefill_compute() {
    let w = spawn(tiny(64)).unwrap();
    let addr = w.http_addr();
    let p = prompt(1, 70, 300);
    let first = complete(addr, &p, 5);
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["usage"]["prompt_tokens"], 70);
    assert_eq!(first["usage"]["completion_tokens"], 5);
    assert_eq!(first["usage"]["total_tokens"], 75);
    assert_eq!(cached_tokens(&first), 0);
    assert_eq!(output_ids(&first).len(), 5);
    let c1 = w.counters();
    assert_eq!(c1.prefill_tokens_computed, 70);
    assert_eq!(c1.decode_tokens_computed, 4, "the last sampled token is never computed");
    assert_eq!(c1.blocks_stored, 4, "70 prompt + 4 decoded positions = 4 full blocks of 16");

    // Same prompt again: 4 blocks (64 tokens) come from the cache, only 6 are computed.
    let again = complete(addr, &p, 5);
    assert_eq!(cached_tokens(&again), 64);
    assert_eq!(output_ids(&again), output_ids(&first), "deterministic output");
    let c2 = w.counters();
    assert_eq!(c2.prefill_tokens_computed - c1.prefill_tokens_computed, 6);
    assert_eq!(c2.cached_tokens_reused - c1.cached_tokens_reused, 64);
    assert_eq!(w.cached_prefix_blocks(&p, None).unwrap(), 4);
    w.shutdown();
}

#[test]
fn bad_requests_get_openai_style_errors() {
    let w = spawn(WorkerConfig { max_body_bytes: 4096, ..tiny(16) }).unwrap();
    let addr = w.http_addr();
    let raw = |path: &str, body: &[u8]| request(addr, "POST", path, &[("content-type", "application/json")], body);
    let cases: Vec<(&str, Resp, u16, Option<&str>)> = vec![
        ("invalid JSON", raw("/v1/completions", b"{\"prompt\": "), 400, None),
        ("not an object", raw("/v1/completions", b"[1, 2]"), 400, None),
        ("no prompt", post(addr, "/v1/completions", &json!({"max_tokens": 3})), 400, Some("prompt")),
        ("empty prompt", post(addr, "/v1/completions", &json!({"prompt": ""})), 400, Some("prompt")),
        ("prompt type", post(addr, "/v1/completions", &json!({"prompt": 7})), 400, Some("prompt")),
        ("token beyond vocab", post(addr, "/v1/completions", &json!({"prompt": [1, 2, 999_999]})), 400, Some("prompt")),
        ("negative token", post(addr, "/v1/completions", &json!({"prompt": [1, -2]})), 400, Some("prompt")),
        (
            "max_tokens 0",
            post(addr, "/v1/completions", &json!({"prompt": "hi", "max_tokens": 0})),
            400,
            Some("max_tokens"),
        ),
        (
            "max_tokens type",
            post(addr, "/v1/completions", &json!({"prompt": "hi", "max_tokens": "3"})),
            400,
            Some("max_tokens"),
        ),
        ("stream type", post(addr, "/v1/completions", &json!({"prompt": "hi", "stream": "yes"})), 400, Some("stream")),
        ("n > 1", post(addr, "/v1/completions", &json!({"prompt": "hi", "n": 2})), 400, Some("n")),
        (
            "context too long",
            post(addr, "/v1/completions", &json!({"prompt": vec![1; 1000], "max_tokens": 100})),
            400,
            Some("prompt"),
        ),
        (
            "pool too small",
            post(addr, "/v1/completions", &json!({"prompt": vec![1; 300], "max_tokens": 5})),
            400,
            Some("prompt"),
        ),
        ("no messages", post(addr, "/v1/chat/completions", &json!({"model": "kvroute-tiny"})), 400, Some("messages")),
        (
            "message role",
            post(addr, "/v1/chat/completions", &json!({"messages": [{"content": "x"}]})),
            400,
            Some("messages[0].role"),
        ),
        (
            "unknown model",
            post(addr, "/v1/completions", &json!({"prompt": "hi", "model": "gpt-9"})),
            404,
            Some("model"),
        ),
        ("body too large", raw("/v1/completions", &vec![b' '; 5000]), 413, None),
    ];
    for (what, r, status, param) in cases {
        assert_eq!(r.status, status, "{what}: {}", r.text());
        let v = r.json();
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {v}");
        assert_eq!(e["code"], status, "{what}: {v}");
        assert!(e["type"].as_str().is_some_and(|t| t.ends_with("Error")), "{what}: {v}");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{what}: {v}");
        }
        assert_eq!(r.header("content-type"), Some("application/json"), "{what}");
    }
    assert_eq!(get(addr, "/nope").status, 404);
    assert_eq!(get(addr, "/v1/completions").status, 405);
    // Nothing reached the engine, and the worker still serves.
    assert_eq!(w.counters().requests_submitted, 0);
    let ok = complete(addr, &prompt(3, 20, 300), 2);
    assert_eq!(ok["usage"]["completion_tokens"], 2);
    w.shutdown();
}

#[test]
fn health_models_and_chat() {
    let w = spawn(tiny(64)).unwrap();
    let addr = w.http_addr();
    let h = get(addr, "/health");
    assert_eq!(h.status, 200);
    assert!(h.body.is_empty());
    let m = get(addr, "/v1/models").json();
    assert_eq!(m["data"][0]["id"], "kvroute-tiny");

    let body = json!({"model": "kvroute-tiny", "max_tokens": 4, "messages": [
        {"role": "system", "content": "You are a helpful agent. ".repeat(4)},
        {"role": "user", "content": "List the files."},
    ]});
    let r = post(addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(cached_tokens(&v), 0);
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 100);
    // The same conversation again hits the prefix cache in whole blocks.
    let again = post(addr, "/v1/chat/completions", &body).json();
    assert_eq!(cached_tokens(&again), (prompt_tokens - 1) / 16 * 16);
    assert_eq!(again["choices"][0]["message"]["content"], v["choices"][0]["message"]["content"]);
    w.shutdown();
}

#[test]
fn streaming_completion_and_chat_match_the_non_streaming_answer() {
    let w = spawn(tiny(64)).unwrap();
    let addr = w.http_addr();
    let p = prompt(9, 40, 300);
    let plain = complete(addr, &p, 6);
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": p, "max_tokens": 6, "stream": true, "return_token_ids": true,
                "stream_options": {"include_usage": true}}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let events = r.sse();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<serde_json::Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let ids: Vec<u64> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["token_ids"].as_array())
        .flatten()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(ids, output_ids(&plain), "streamed tokens = non-streamed tokens");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, plain["choices"][0]["text"].as_str().unwrap());
    let usage = chunks.iter().find(|c| c.get("usage").is_some()).expect("usage chunk");
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    assert_eq!(cached_tokens(usage), 32, "the second run hits the first one's 2 full blocks");
    assert!(chunks.iter().filter(|c| c["choices"][0]["finish_reason"] == "length").count() == 1);

    let chat = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3, "stream": true}),
    );
    assert_eq!(chat.status, 200);
    let ev = chat.sse();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let first: serde_json::Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    w.shutdown();
}

#[test]
fn metrics_read_by_kvroute_match_the_worker_state() {
    let w = spawn(tiny(64)).unwrap();
    let addr = w.http_addr();
    let p = prompt(4, 50, 300);
    complete(addr, &p, 3);
    complete(addr, &p, 3);
    let page = get(addr, "/metrics");
    assert_eq!(page.status, 200);
    let text = page.text();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds_bucket",
    ] {
        assert!(text.contains(name), "{name} missing from /metrics");
    }
    let c = w.counters();
    let snap = kvroute::parse_prometheus(&text, 1).expect("kvroute reads the page");
    assert_eq!(u64::from(snap.waiting), c.waiting);
    assert_eq!(u64::from(snap.running), c.running);
    assert_eq!(snap.running, 0);
    assert!((snap.kv_usage - w.kv_usage()).abs() < 1e-9);
    assert_eq!(snap.kv_capacity_tokens, Some(64 * 16), "block_size x num_gpu_blocks");
    // Router side: the same page through Router::update_metrics_from_prometheus.
    let router = kvroute::Router::new(kvroute::Policy::default());
    let id = w.endpoint_id();
    router.upsert_endpoint(kvroute::EndpointSpec::new(id.clone(), kvroute::Role::Both)).unwrap();
    router.update_metrics_from_prometheus(&id, &text, 5).unwrap();
    let info = router.endpoints().into_iter().find(|e| *e.id == *id).expect("endpoint");
    assert_eq!(info.metrics.as_ref().map(|m| (m.waiting, m.running, m.updated_ms)), Some((0, 0, 5)));
    assert_eq!(c.prefix_cache_queries, 100);
    assert_eq!(c.cached_tokens_reused, 48);
    assert!(
        text.contains(&format!(
            "vllm:prefix_cache_hits_total{{model_name=\"kvroute-tiny\",engine=\"0\"}} {}",
            c.cached_tokens_reused
        )),
        "{text}"
    );
    w.shutdown();
}

#[test]
fn scheduler_respects_max_running_and_queues_the_rest() {
    let w = spawn(WorkerConfig { max_running: 1, ..tiny(64) }).unwrap();
    let addr = w.http_addr();
    // Hold the scheduler so all three requests are queued before any runs: the queueing is then
    // a fact of the scheduler, not of how fast the client threads happen to start.
    w.hold_scheduler(true).unwrap();
    let threads: Vec<_> =
        (0..3).map(|i| std::thread::spawn(move || complete(addr, &prompt(20 + i, 30, 300), 40))).collect();
    wait_until("three queued requests", || w.counters().waiting == 3);
    assert_eq!(w.counters().running, 0, "nothing runs while the scheduler is held");
    w.hold_scheduler(false).unwrap();
    wait_until("all requests finished", || {
        let c = w.counters();
        assert!(c.running <= 1, "running {} > max_running 1", c.running);
        c.requests_finished == 3
    });
    for t in threads {
        assert_eq!(t.join().unwrap()["usage"]["completion_tokens"], 40);
    }
    assert_eq!(w.counters().requests_finished, 3);
    w.shutdown();
}

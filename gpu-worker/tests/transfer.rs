//! Prefill/decode disaggregation over loopback TCP: a decode worker given
//! `x-prefiller-host-port` obtains the prompt's KV blocks from the prefill worker (post-prefill
//! pull, layer-by-layer push), computes only the tail, answers exactly what a colocated worker
//! answers, and reports the transfer; the byte count is what kvroute's transfer model predicts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kvroute_worker::{spawn, Role, TransferMode, WorkerConfig, PREFILLER_HEADER};
use serde_json::json;

fn role(role: Role, mode: TransferMode) -> WorkerConfig {
    WorkerConfig { role, transfer_mode: mode, ..tiny(128) }
}

fn disaggregated(mode: TransferMode) {
    let colocated = spawn(tiny(128)).unwrap();
    let prefill = spawn(role(Role::Prefill, mode)).unwrap();
    let decode = spawn(role(Role::Decode, mode)).unwrap();
    let p = prompt(11, 150, 300);
    let expect = complete(colocated.http_addr(), &p, 6);

    let pf = prefill.http_addr().to_string();
    let body = json!({"prompt": p, "max_tokens": 6, "return_token_ids": true});
    let r = post_h(decode.http_addr(), "/v1/completions", &[(PREFILLER_HEADER, pf.as_str())], &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(output_ids(&v), output_ids(&expect), "disaggregated output = colocated output");
    let t = &v["kv_transfer"];
    assert!(t.get("error").is_none(), "{t}");
    assert_eq!(t["mode"], mode.as_str());
    assert_eq!(t["prefill_host_port"], pf);
    // 150 tokens: the 9 whole blocks before the last token travel; the last 6 are computed here.
    assert_eq!(t["blocks"], 9);
    assert_eq!(t["tokens"], 144);
    let shape = prefill.config().model.shape();
    let kv_bytes = shape.kv_bytes_per_token() * 144;
    assert_eq!(t["bytes"].as_u64().unwrap(), kv_bytes, "V_KV = 2·L·H_kv·d_h·b·S from kvroute's ModelShape");
    assert!(t["wire_bytes"].as_u64().unwrap() > kv_bytes);
    let (transfer_ms, exposed_ms) = (t["transfer_ms"].as_f64().unwrap(), t["exposed_ms"].as_f64().unwrap());
    assert!(transfer_ms > 0.0 && t["remote_compute_ms"].as_f64().unwrap() > 0.0, "{t}");
    match mode {
        TransferMode::Pull => assert_eq!(exposed_ms, transfer_ms),
        TransferMode::Push => assert!(exposed_ms < transfer_ms, "push overlaps the prefill: {t}"),
    }
    assert_eq!(t["first_token"].as_u64(), output_ids(&expect).first().copied());
    assert_eq!(r.header("x-kvroute-kv-transfer-bytes"), Some(kv_bytes.to_string().as_str()));
    assert_eq!(cached_tokens(&v), 144, "transferred tokens count as cached");

    // Counters: the prefill worker computed the prompt, the decode worker only the tail.
    let (pc, dc) = (prefill.counters(), decode.counters());
    assert_eq!(pc.remote_prefills, 1);
    assert_eq!(pc.prefill_tokens_computed, 150);
    assert_eq!(pc.kv_transfers_out, 1);
    assert_eq!(pc.kv_transfer_out_bytes, kv_bytes);
    assert_eq!(dc.kv_transfers_in, 1);
    assert_eq!(dc.kv_transfer_in_tokens, 144);
    assert_eq!(dc.prefill_tokens_computed, 6);
    assert_eq!(dc.kv_transfer_failures, 0);
    wait_until("pinned blocks released", || prefill.counters().pinned_transfers == 0);

    // The decode worker cached the received blocks: a second request transfers nothing.
    let again = post_h(decode.http_addr(), "/v1/completions", &[(PREFILLER_HEADER, pf.as_str())], &body).json();
    assert_eq!(again["kv_transfer"]["skipped_blocks"], 9);
    assert_eq!(again["kv_transfer"]["blocks"], 0);
    assert_eq!(output_ids(&again), output_ids(&expect));
    assert_eq!(prefill.counters().remote_prefills, 1);
    for w in [colocated, prefill, decode] {
        w.shutdown();
    }
}

#[test]
fn pull_transfer_after_prefill() {
    disaggregated(TransferMode::Pull);
}

#[test]
fn layerwise_push_transfer() {
    disaggregated(TransferMode::Push);
}

#[test]
fn unreachable_prefiller_falls_back_to_local_compute() {
    let decode = spawn(role(Role::Decode, TransferMode::Pull)).unwrap();
    // A port nobody listens on (bound, then closed).
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let p = prompt(12, 60, 300);
    let body = json!({"prompt": p, "max_tokens": 2});
    let r = post_h(decode.http_addr(), "/v1/completions", &[(PREFILLER_HEADER, dead.as_str())], &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["kv_transfer"]["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    assert_eq!(decode.counters().kv_transfer_failures, 1);
    assert_eq!(decode.counters().prefill_tokens_computed, 60);
    // A decode-only worker refuses to prefill for others.
    let r = post(decode.http_addr(), "/kvroute/v1/prefill", &json!({"prompt_token_ids": [1, 2, 3]}));
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "BadRequestError");
    decode.shutdown();
}

#[test]
fn transfer_check_compares_measurement_with_kvroute_model() {
    let args = kvroute_worker::transfer_check::TransferCheckArgs {
        sizes: vec![64, 160],
        reps: 1,
        layers: 2,
        kv_heads: 2,
        head_dim: 16,
        hidden: 64,
        probe_bytes: 8 << 20,
        json: None,
    };
    let rows = kvroute_worker::transfer_check::run(args).unwrap();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        // 64 tokens: 3 whole blocks before the last token; 160: 9.
        assert_eq!(r.tokens, u64::from((r.prompt_tokens - 1) / 16 * 16));
        assert_eq!(r.kv_bytes, r.tokens * 2 * 2 * 2 * 16 * 4);
        assert_eq!(r.kv_bytes, r.predicted_kv_bytes);
        assert!(r.pull_ms > 0.0 && r.pull_predicted_ms > 0.0 && r.push_predicted_ms > 0.0, "{r:?}");
        assert!(r.push_predicted_ms < r.pull_predicted_ms, "layer-wise streaming exposes less: {r:?}");
    }
}

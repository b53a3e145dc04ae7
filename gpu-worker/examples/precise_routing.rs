//! kvroute in precise mode over three in-process workers: the router learns what each worker
//! caches from the workers' own ZMQ KV events, then sends a follow-up request to the worker that
//! holds its prefix; the worker's `cached_tokens` confirms the hit.
//!
//! `cargo run --release -p kvroute-worker --example precise_routing`
#![allow(clippy::print_stdout)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvroute::{unix_clock, unix_time_ms, SubscriberConfig, Subscription};
use kvroute::{EndpointSpec, Policy, Role, Router};
use kvroute_worker::{spawn, WorkerConfig};
use serde_json::{json, Value};

/// `POST /v1/completions` over a fresh connection; the JSON answer.
fn complete(addr: SocketAddr, body: &Value) -> anyhow::Result<Value> {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").context("malformed response")?;
    Ok(serde_json::from_slice(&raw[split + 4..])?)
}

fn main() -> anyhow::Result<()> {
    let workers = (0..3).map(|_| spawn(WorkerConfig::ephemeral())).collect::<Result<Vec<_>, _>>()?;
    let policy = Policy::from_json(
        r#"{"index": {"mode": "precise", "precise": {"keys": "dual", "engine_block_tokens": 16, "index_block_tokens": 16}}}"#,
    )?;
    let router = Arc::new(Router::new(policy));
    let mut subs = Vec::new();
    for w in &workers {
        router.upsert_endpoint(EndpointSpec::new(w.endpoint_id(), Role::Both))?;
        let mut cfg = SubscriberConfig::new(w.events_endpoint().context("events are on")?);
        cfg.replay_endpoint = w.replay_endpoint().map(str::to_owned);
        subs.push(Subscription::start(router.clone(), w.endpoint_id(), cfg, unix_clock())?);
        anyhow::ensure!(w.wait_for_event_subscribers(1, Duration::from_secs(10)), "no subscription");
    }

    // A long shared context, computed once on the last worker (not through the router).
    let context: Vec<u32> = (0..1000u32).map(|i| (i * 7919 + 13) % 512).collect();
    let warm = &workers[2];
    complete(warm.http_addr(), &json!({"prompt": context, "max_tokens": 4}))?;
    let held = warm.cached_block_keys()?.len();
    println!("{} now caches {held} blocks; waiting for its KV events to reach the router", warm.endpoint_id());
    let deadline = Instant::now() + Duration::from_secs(10);
    while router.endpoints().iter().find(|e| *e.id == *warm.endpoint_id()).map_or(0, |e| e.precise_memberships)
        < held as u32
    {
        anyhow::ensure!(Instant::now() < deadline, "the events did not arrive");
        std::thread::sleep(Duration::from_millis(10));
    }

    // A follow-up turn: the context plus a new message. kvroute picks the worker holding it.
    let mut turn = context;
    turn.extend((0..40u32).map(|i| (i * 31 + 7) % 512));
    let body = json!({"model": "kvroute-tiny", "prompt": turn, "max_tokens": 8});
    let d = router.route_http(body.to_string().as_bytes(), [("x-request-id", "turn-2")], unix_time_ms())?;
    let target = d.endpoint().map(str::to_owned).context("kvroute shed the request")?;
    println!("kvroute: {target} (rule {:?}, prefix hit {:.0}%)", d.rule, d.prefix_hit * 100.0);
    let addr: SocketAddr = target.parse()?;
    let answer = complete(addr, &body)?;
    router.complete(&d.request_id)?;
    println!(
        "worker {target}: {} prompt tokens, {} served from its prefix cache",
        answer["usage"]["prompt_tokens"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    );
    for s in subs {
        s.stop()?;
    }
    for w in workers {
        w.shutdown();
    }
    Ok(())
}

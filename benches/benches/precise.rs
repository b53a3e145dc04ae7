//! The event-fed precise index end to end, at 64 endpoints:
//!
//! - **route**: an 8k-token token-id request (a follow-up turn: a tenant's 2k-token system prompt,
//!   3/4 of an earlier conversation cached on one endpoint, then new tokens) through
//!   `Router::route` (pre-parsed `RouteRequest`) and `Router::route_http` (JSON body parsed too),
//!   with `{"index":{"mode":"precise"}}` (dual keys) and with engine keys
//!   (`{"index":{"mode":"precise","precise":{"keys":"engine","engine":{"algo":"sha256_cbor"}}}}`);
//!   plus, alone, the JSON body parse (token-id fast path, with `, ` separators, and serde alone)
//!   and the request-key computation of both schemes. The precise index is fed
//!   beforehand by `Router::apply_batch` with the `BlockStored` events vLLM would publish for 256
//!   earlier 8k-token conversations (block hashes computed with vLLM's `sha256_cbor` by
//!   `EngineHasher`, 16-token blocks);
//! - **apply**: the same events as msgpack payloads (vLLM ≥ 0.24 map-tagged form) applied to a
//!   fresh router through `Router::apply_events` (decode + apply), for both key schemes, and
//!   separately decode alone and `Router::apply_batch` on pre-decoded batches. Throughput is in
//!   blocks.
//!
//! Both configurations also set `metrics.staleness_ms` high: the bench advances `now` by 1 ms per
//! routed request so that speculative entries expire as in steady traffic, and the endpoints'
//! metrics (set once) must stay fresh meanwhile.
//!
//! A summary with the issues' goals (route ≤ 15 µs with dual keys, ≤ 200 µs with sha256_cbor;
//! route_http ≤ 60 µs with dual keys, the token-id body parse ≥ 3x faster than serde alone)
//! is printed after criterion's report. Run: `cargo bench -p kvroute-benches --bench precise`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::cell::Cell;
use std::collections::HashSet;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvroute::Prompt;
use kvroute::{decode_batch, BlockStored, EventBatch, KvEvent, Medium};
use kvroute::{BlockExtras, EngineHashSpec, EngineHasher, HashAlgo};
use kvroute::{DualKeyHashing, RequestKeys, RouteRequest, Router};
use kvroute_benches::timing::Samples;

const W: usize = 64;
const BLOCK: usize = 16;
const TENANTS: u64 = 16;
const SYSTEM_TOKENS: usize = 2048;
const PROMPT_TOKENS: usize = 8192;
const CONVERSATIONS: usize = 4 * W;
const NOW: u64 = 1_000;
const SAMPLES: usize = 30;

const DUAL: &str = r#"{"index":{"mode":"precise"},"metrics":{"staleness_ms":1000000000000}}"#;
const ENGINE: &str = r#"{"index":{"mode":"precise","precise":{"keys":"engine","engine":{"algo":"sha256_cbor"}}},"metrics":{"staleness_ms":1000000000000}}"#;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `n` token ids (a 150k vocabulary) drawn from `stream`.
fn tokens(stream: u64, n: usize, out: &mut Vec<u32>) {
    let base = splitmix(stream);
    out.extend((0..n as u64).map(|i| (splitmix(base.wrapping_add(i)) % 150_000) as u32));
}

/// An earlier conversation: its tokens, the engine's block hashes, and where it lives.
struct Conversation {
    endpoint: usize,
    tenant: u64,
    tokens: Vec<u32>,
    hashes: Vec<u64>,
}

fn endpoint_id(e: usize) -> String {
    format!("10.0.{}.{}:8000", e / 256, e % 256)
}

fn hasher() -> EngineHasher {
    EngineHasher::from_spec(&EngineHashSpec {
        algo: HashAlgo::Sha256Cbor,
        block_size: BLOCK as u32,
        ..Default::default()
    })
    .unwrap()
}

fn conversations(h: &EngineHasher) -> Vec<Conversation> {
    let systems: Vec<Vec<u32>> = (0..TENANTS)
        .map(|t| {
            let mut v = Vec::with_capacity(SYSTEM_TOKENS);
            tokens(0x5157 ^ (t << 32), SYSTEM_TOKENS, &mut v);
            v
        })
        .collect();
    let mut scratch = Vec::new();
    (0..CONVERSATIONS)
        .map(|r| {
            let tenant = splitmix(r as u64 ^ 0x7e) % TENANTS;
            let mut toks = systems[tenant as usize].clone();
            tokens(0xc0 ^ ((r as u64) << 20), PROMPT_TOKENS - SYSTEM_TOKENS, &mut toks);
            let mut hashes = Vec::new();
            h.block_keys(&toks, &BlockExtras::default(), &mut scratch, &mut hashes).unwrap();
            Conversation { endpoint: r % W, tenant, tokens: toks, hashes }
        })
        .collect()
}

/// The engine's events: a conversation on an endpoint that already holds its tenant's system
/// prompt stores only its own blocks, under the prompt's last block.
fn events(convs: &[Conversation]) -> Vec<(usize, EventBatch)> {
    let mut has_system = HashSet::new();
    convs
        .iter()
        .map(|c| {
            let start = if has_system.insert((c.endpoint, c.tenant)) { 0 } else { SYSTEM_TOKENS / BLOCK };
            let stored = BlockStored {
                block_hashes: c.hashes[start..].to_vec(),
                parent_block_hash: start.checked_sub(1).map(|i| c.hashes[i]),
                token_ids: c.tokens[start * BLOCK..].to_vec(),
                block_size: BLOCK as u32,
                lora_id: None,
                medium: Medium::Gpu,
                lora_name: None,
                group_idx: None,
                cache_salt: None,
                ..Default::default()
            };
            (
                c.endpoint,
                EventBatch { ts: 1.0, events: vec![KvEvent::BlockStored(stored)], data_parallel_rank: Some(0) },
            )
        })
        .collect()
}

/// vLLM ≥ 0.24's wire form: `[ts, [{"type": "BlockStored", ...}], rank]`.
fn payload(batch: &EventBatch) -> Vec<u8> {
    use rmp::encode::{write_array_len, write_f64, write_map_len, write_nil, write_sint, write_str, write_uint};
    let mut out = Vec::new();
    write_array_len(&mut out, 3).unwrap();
    write_f64(&mut out, batch.ts).unwrap();
    write_array_len(&mut out, batch.events.len() as u32).unwrap();
    for ev in &batch.events {
        let KvEvent::BlockStored(s) = ev else { unreachable!("only stores are generated") };
        write_map_len(&mut out, 8).unwrap();
        write_str(&mut out, "type").unwrap();
        write_str(&mut out, "BlockStored").unwrap();
        write_str(&mut out, "block_hashes").unwrap();
        write_array_len(&mut out, s.block_hashes.len() as u32).unwrap();
        for &h in &s.block_hashes {
            write_uint(&mut out, h).unwrap();
        }
        write_str(&mut out, "parent_block_hash").unwrap();
        if let Some(p) = s.parent_block_hash {
            write_uint(&mut out, p).unwrap();
        } else {
            write_nil(&mut out).unwrap();
        }
        write_str(&mut out, "token_ids").unwrap();
        write_array_len(&mut out, s.token_ids.len() as u32).unwrap();
        for &t in &s.token_ids {
            write_uint(&mut out, u64::from(t)).unwrap();
        }
        write_str(&mut out, "block_size").unwrap();
        write_uint(&mut out, u64::from(s.block_size)).unwrap();
        write_str(&mut out, "lora_id").unwrap();
        write_nil(&mut out).unwrap();
        write_str(&mut out, "medium").unwrap();
        write_str(&mut out, "GPU").unwrap();
        write_str(&mut out, "lora_name").unwrap();
        write_nil(&mut out).unwrap();
    }
    if let Some(r) = batch.data_parallel_rank {
        write_sint(&mut out, r).unwrap();
    } else {
        write_nil(&mut out).unwrap();
    }
    out
}

/// A router with `W` decode endpoints and fresh metrics, no events applied.
fn router(cfg: &str, ids: &[String]) -> Router {
    let router = Router::from_json(cfg).unwrap();
    kvroute_benches::fleet::add_decode_endpoints(&router, ids, NOW);
    router
}

/// Apply every batch (numbered per endpoint) with `apply`.
fn feed(ids: &[String], batches: &[(usize, EventBatch)], mut apply: impl FnMut(&str, usize, u64)) {
    let mut seq = [0u64; W];
    for (i, (e, _)) in batches.iter().enumerate() {
        seq[*e] += 1;
        apply(&ids[*e], i, seq[*e]);
    }
}

fn route_benches(
    c: &mut Criterion,
    ids: &[String],
    batches: &[(usize, EventBatch)],
    convs: &[Conversation],
) -> Vec<(String, Option<f64>)> {
    // The request: conversation 3's system prompt and first 3/4, then new tokens.
    let cached = PROMPT_TOKENS * 3 / 4;
    let mut ids_in = convs[3].tokens[..cached].to_vec();
    tokens(0xbeef, PROMPT_TOKENS - cached, &mut ids_in);
    let body = serde_json::json!({"model": "llama", "prompt": ids_in, "max_tokens": 256}).to_string();
    let mut req = RouteRequest::text("llama", "");
    req.prompts = vec![Prompt::Tokens(ids_in.clone())];
    req.max_tokens = Some(256);
    let no_headers = std::iter::empty::<(&str, &str)>;
    // The same request as a binary token-id body (little-endian u32s; the model in a header).
    let binary: Vec<u8> = ids_in.iter().flat_map(|t| t.to_le_bytes()).collect();
    let binary_headers = [
        ("content-type", "application/vnd.kvroute.token-ids"),
        ("x-kvroute-model", "llama"),
        ("x-kvroute-max-tokens", "256"),
    ];

    let mut results = Vec::new();
    let mut g = c.benchmark_group("precise_route_8k_W64");
    g.throughput(Throughput::Elements(1));
    for (label, cfg) in [("dual", DUAL), ("sha256_cbor", ENGINE)] {
        let r = router(cfg, ids);
        feed(ids, batches, |id, i, seq| {
            r.apply_batch(id, &batches[i].1, Some(seq), NOW).unwrap();
        });
        let d = r.route(&req, NOW).unwrap();
        assert_eq!(d.endpoint(), Some(ids[convs[3].endpoint].as_str()), "{label}: the cached endpoint wins");
        assert_eq!(d.cached_tokens, cached as u64, "{label}: 3/4 of the prompt is cached there");
        r.complete(&d.request_id).unwrap();
        let now = Cell::new(NOW);
        for (what, http) in [("route", 0), ("route_http", 1), ("route_http_binary", 2)] {
            if http == 2 && label != "dual" {
                continue;
            }
            let samples = Samples::new();
            g.bench_function(format!("{what}/{label}"), |b| {
                b.iter_custom(|iters| {
                    let t = Instant::now();
                    for _ in 0..iters {
                        // 1 ms per request: speculative entries expire as in steady traffic.
                        now.set(now.get() + 1);
                        let d = match http {
                            0 => r.route(black_box(&req), now.get()).unwrap(),
                            1 => r.route_http(black_box(body.as_bytes()), no_headers(), now.get()).unwrap(),
                            _ => r.route_http(black_box(&binary), binary_headers, now.get()).unwrap(),
                        };
                        r.complete(&d.request_id).unwrap();
                    }
                    let d = t.elapsed();
                    samples.record(iters, d);
                    d
                });
            });
            results.push((format!("{what}/{label}"), samples.median_us(SAMPLES)));
        }
    }

    // Parsing the JSON body alone (what route_http adds to route): the token-id fast path, the
    // same with Python's `json.dumps` separators (`, `), and serde alone (the reference parser,
    // what the body parse was before the fast path).
    let policy = kvroute::Policy::from_json(DUAL).unwrap();
    let spaced = body.replace(',', ", ").replace(':', ": ");
    type Parse = fn(&[u8], &kvroute::RequestConfig) -> Result<RouteRequest, kvroute::RequestError>;
    let fast: Parse = |b, cfg| RouteRequest::parse(b, std::iter::empty::<(&str, &str)>(), cfg);
    let serde_only: Parse = |b, cfg| RouteRequest::parse_serde_only(b, std::iter::empty::<(&str, &str)>(), cfg);
    let parsers = [
        ("parse_body", &body, fast),
        ("parse_body_spaced", &spaced, fast),
        ("parse_body_serde_only", &body, serde_only),
    ];
    for (name, text, parse) in parsers {
        assert_eq!(parse(text.as_bytes(), &policy.config().request).unwrap().prompts, req.prompts);
        let samples = Samples::new();
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    black_box(parse(black_box(text.as_bytes()), &policy.config().request).unwrap());
                }
                let d = t.elapsed();
                samples.record(iters, d);
                d
            });
        });
        results.push((name.to_owned(), samples.median_us(SAMPLES)));
    }

    // The request keys alone.
    let h = hasher();
    let (mut scratch, mut keys) = (Vec::new(), Vec::new());
    let samples = Samples::new();
    g.bench_function("keys/sha256_cbor", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                keys.clear();
                h.block_keys(black_box(&ids_in), &BlockExtras::default(), &mut scratch, &mut keys).unwrap();
            }
            let d = t.elapsed();
            samples.record(iters, d);
            d
        });
    });
    results.push(("keys/sha256_cbor".to_owned(), samples.median_us(SAMPLES)));
    let dual = DualKeyHashing { block_tokens: BLOCK as u32 };
    let mut rk = RequestKeys::default();
    let samples = Samples::new();
    g.bench_function("keys/dual", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                assert!(dual.request_keys(black_box(&req), &mut rk));
            }
            let d = t.elapsed();
            samples.record(iters, d);
            d
        });
    });
    results.push(("keys/dual".to_owned(), samples.median_us(SAMPLES)));
    g.finish();
    results
}

fn apply_benches(c: &mut Criterion, ids: &[String], batches: &[(usize, EventBatch)]) -> Vec<(String, Option<f64>)> {
    let payloads: Vec<Vec<u8>> = batches.iter().map(|(_, b)| payload(b)).collect();
    for (p, (_, b)) in payloads.iter().zip(batches) {
        assert_eq!(&decode_batch(p).unwrap(), b, "the payload decodes to the batch");
    }
    let blocks: u64 = batches
        .iter()
        .flat_map(|(_, b)| &b.events)
        .map(|e| match e {
            KvEvent::BlockStored(s) => s.block_hashes.len() as u64,
            _ => 0,
        })
        .sum();
    let bytes: usize = payloads.iter().map(Vec::len).sum();
    println!("apply workload: {} payloads, {blocks} blocks, {:.1} MB of msgpack", payloads.len(), bytes as f64 / 1e6);

    let mut results = Vec::new();
    let mut g = c.benchmark_group("precise_apply_W64");
    g.throughput(Throughput::Elements(blocks));
    g.sample_size(10);
    let samples = Samples::new();
    g.bench_function("decode_only", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                for p in &payloads {
                    black_box(decode_batch(black_box(p)).unwrap());
                }
            }
            let d = t.elapsed();
            samples.record(iters, d);
            d
        });
    });
    results.push(("decode_only".to_owned(), samples.median_us(10)));
    for (label, cfg) in [("sha256_cbor", ENGINE), ("dual", DUAL)] {
        for (what, decode) in [("apply_events", true), ("apply_batch", false)] {
            let samples = Samples::new();
            g.bench_function(format!("{what}/{label}"), |b| {
                b.iter_custom(|iters| {
                    // Each iteration fills a fresh router (built untimed) with every event.
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let r = router(cfg, ids);
                        let t = Instant::now();
                        feed(ids, batches, |id, i, seq| {
                            if decode {
                                r.apply_events(id, &payloads[i], Some(seq), NOW).unwrap();
                            } else {
                                r.apply_batch(id, &batches[i].1, Some(seq), NOW).unwrap();
                            }
                        });
                        total += t.elapsed();
                        assert_eq!(r.stats().precise.blocks_stored, blocks);
                    }
                    samples.record(iters, total);
                    total
                });
            });
            results.push((format!("{what}/{label}"), samples.median_us(10)));
        }
    }
    g.finish();
    results.into_iter().map(|(n, us)| (n, us.map(|us| blocks as f64 / us))).collect()
}

fn verdict(value: f64, target: f64) -> String {
    let met = if value <= target { "met" } else { "MISSED" };
    format!("{met}, {:.2}x of target", value / target)
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(SAMPLES)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let ids: Vec<String> = (0..W).map(endpoint_id).collect();
    let convs = conversations(&hasher());
    let batches = events(&convs);
    let route = route_benches(&mut c, &ids, &batches, &convs);
    let apply = apply_benches(&mut c, &ids, &batches);
    c.final_summary();

    println!();
    println!("## precise route, 8k-token token-id request, W={W} (median of criterion's samples)");
    println!();
    println!("| what | µs |");
    println!("|---|---|");
    for (name, us) in &route {
        println!("| {name} | {} |", us.map_or_else(|| "—".to_owned(), |u| format!("{u:.2}")));
    }
    println!();
    println!("| apply (decode + index) | M blocks/s |");
    println!("|---|---|");
    for (name, mbps) in &apply {
        println!("| {name} | {} |", mbps.map_or_else(|| "—".to_owned(), |m| format!("{m:.2}")));
    }
    println!();
    println!("targets:");
    // route_http/dual's goal is issue 16's 60 µs (below): parsing 8k token ids alone takes more
    // than 15 µs, so the 15 µs goal applies to `route()` only.
    for (name, target) in [("route/dual", 15.0), ("route/sha256_cbor", 200.0), ("route_http/sha256_cbor", 200.0)] {
        if let Some((_, Some(us))) = route.iter().find(|(n, _)| n == name) {
            println!("- {name} ≤ {target} µs: {us:.2} µs ({})", verdict(*us, target));
        }
    }
    let us = |name: &str| route.iter().find(|(n, _)| n == name).and_then(|(_, us)| *us);
    // Issue 16 (token-id fast path): route_http with dual keys ≤ 60 µs, the parse ≥ 3x faster.
    if let Some(http) = us("route_http/dual") {
        println!("- route_http/dual ≤ 60 µs (token-id fast path): {http:.2} µs ({})", verdict(http, 60.0));
    }
    // Issue 16: a binary token-id body routes within 2x of `route()`.
    if let (Some(bin), Some(route)) = (us("route_http_binary/dual"), us("route/dual")) {
        let ratio = bin / route;
        let met = if ratio <= 2.0 { "met" } else { "MISSED" };
        println!("- route_http_binary/dual within 2x of route/dual: {bin:.2} µs, {ratio:.2}x ({met})");
    }
    if let (Some(fast), Some(serde)) = (us("parse_body"), us("parse_body_serde_only")) {
        let ratio = serde / fast;
        let met = if ratio >= 3.0 { "met" } else { "MISSED" };
        println!("- parse_body ≥ 3x faster than serde alone: {ratio:.2}x ({met})");
    }
}

//! Helpers for the kvroute filter's tests and bench in the wasmtime test host
//! ([`kvroute_wasm_host`]): plugin configurations, metric pages served by a test cluster, request
//! and event-post drivers, the stats page, and single golden fixture cases (the whole suite is
//! replayed with `kvroute_sim::golden`, as the core's tests do).
//!
//! The filter is loaded with [`Host::load_kvroute_filter`] (it builds
//! `kvroute_filter.wasm` with `--profile wasm-release` when needed).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use kvroute_sim::golden;
pub use kvroute_wasm_host::{
    CalloutReply, CalloutRequest, HeaderMap, Host, HostError, HttpMessage, LocalReply, Plugin, Stream, StreamId,
    VmConfig, VmId,
};
use serde_json::{json, Value};

/// The ORIGINAL_DST cluster the filter polls metrics through (as in `wasm-filter/envoy.yaml`).
pub const CLUSTER: &str = "kvroute_endpoints";
/// The event path.
pub const EVENTS_PATH: &str = "/kvroute/v1/events";
/// The stats path.
pub const STATS_PATH: &str = "/kvroute/v1/stats";
/// The shared secret.
pub const SECRET: &str = "test-secret-0123456789";
/// The replica routes' path prefix (`filter.replica.path`'s default).
pub const REPLICA_PATH: &str = kvroute_filter::config::DEFAULT_REPLICA_PATH;
/// The replica routes' shared secret.
pub const REPLICA_SECRET: &str = "replica-secret-0123456789";
/// Envoy `vm_id` of every VM (they share shared data).
pub const VM_ID: &str = "kvroute";
/// Header with the decision JSON (the filter's `debug_decision_header`).
pub const DECISION: &str = kvroute_filter::config::HEADER_DECISION;
/// Header with the destination.
pub const DESTINATION: &str = kvroute::HEADER_DESTINATION;

/// Metric pages the test cluster serves, by endpoint (`:authority` of the poll): a page set with
/// [`Pages::once`] answers one poll, [`Pages::always`] every poll; endpoints without a page
/// answer 503.
#[derive(Clone, Default)]
pub struct Pages(Rc<RefCell<HashMap<String, (String, bool)>>>);

impl Pages {
    /// Serve `text` to the next poll of `endpoint`.
    pub fn once(&self, endpoint: &str, text: impl Into<String>) {
        self.0.borrow_mut().insert(endpoint.to_owned(), (text.into(), false));
    }

    /// Serve `text` to every poll of `endpoint`.
    pub fn always(&self, endpoint: &str, text: impl Into<String>) {
        self.0.borrow_mut().insert(endpoint.to_owned(), (text.into(), true));
    }

    /// Forget every page.
    pub fn clear(&self) {
        self.0.borrow_mut().clear();
    }

    /// The cluster's answer to a poll.
    pub fn answer(&self, req: &CalloutRequest) -> CalloutReply {
        let ep = req.headers.get(":authority").unwrap_or_default().to_owned();
        let mut pages = self.0.borrow_mut();
        match pages.get(&ep).cloned() {
            Some((text, keep)) => {
                if !keep {
                    pages.remove(&ep);
                }
                CalloutReply::ok(text)
            }
            None => CalloutReply::status(503),
        }
    }
}

/// A host whose clock starts at `start_ms` (milliseconds) with the metrics cluster serving `pages`.
pub fn host_at(start_ms: u64, pages: &Pages) -> Result<Host, HostError> {
    let p = pages.clone();
    Host::builder().start_time_ns(start_ms * 1_000_000).cluster(CLUSTER, move |req| p.answer(req)).build()
}

/// A host at the default start time (a realistic UNIX time).
pub fn host(pages: &Pages) -> Result<Host, HostError> {
    let p = pages.clone();
    Host::builder().cluster(CLUSTER, move |req| p.answer(req)).build()
}

/// The host's clock in milliseconds.
pub fn now_ms(host: &Host) -> u64 {
    host.now_ns() / 1_000_000
}

/// A plugin configuration: `policy` (a policy document) plus a `filter` section listing
/// `endpoints` (address, role), with metric polling through [`CLUSTER`] every 100 ms, event
/// ingestion at [`EVENTS_PATH`], the stats path and the decision header, then `extra` merged in
/// (its keys replace the defaults; `null` removes one).
pub fn plugin_config(policy: &Value, endpoints: &[(&str, &str)], extra: &Value) -> String {
    let mut filter = json!({
        "endpoints": endpoints.iter().map(|(a, r)| json!({"address": a, "role": r})).collect::<Vec<_>>(),
        "metrics": {"cluster": CLUSTER, "interval_ms": 100},
        "events": {"path": EVENTS_PATH, "secret": SECRET},
        "stats_path": STATS_PATH,
        "debug_decision_header": true,
    });
    if let (Some(f), Some(x)) = (filter.as_object_mut(), extra.as_object()) {
        for (k, v) in x {
            if v.is_null() {
                f.remove(k);
            } else {
                f.insert(k.clone(), v.clone());
            }
        }
    }
    let mut doc = policy.as_object().cloned().unwrap_or_default();
    doc.insert("filter".into(), filter);
    Value::Object(doc).to_string()
}

/// A VM configuration like `wasm-filter/envoy.yaml`'s (vm_id, root_id, plugin name).
pub fn vm_config(plugin_configuration: &str) -> VmConfig {
    VmConfig::new()
        .vm_id(VM_ID)
        .root_id("kvroute")
        .plugin_name("kvroute")
        .plugin_configuration(plugin_configuration.as_bytes().to_vec())
}

/// `/v1/chat/completions` for a body with `messages`, else `/v1/completions` (as a client would).
pub fn api_path(body: &[u8]) -> &'static str {
    let chat = serde_json::from_slice::<Value>(body).ok().is_some_and(|v| v.get("messages").is_some());
    if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    }
}

/// Send a request (headers, then the whole body with end of stream) on a new stream of `vm`;
/// the stream stays open (finish it with [`Host::finish_stream`] to complete the request).
pub fn send(host: &mut Host, vm: VmId, body: &[u8], headers: &[(&str, &str)]) -> Result<StreamId, HostError> {
    let s = host.new_stream(vm)?;
    let mut h: Vec<(&str, &str)> =
        vec![(":method", "POST"), (":path", api_path(body)), (":authority", "llm.local"), (":scheme", "http")];
    h.push(("content-type", "application/json"));
    h.extend_from_slice(headers);
    host.send_request_headers(s, h, body.is_empty())?;
    if !body.is_empty() {
        host.send_request_body(s, body, true)?;
    }
    Ok(s)
}

/// What became of a request.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The local reply's status, when the filter answered itself.
    pub local_status: Option<u32>,
    /// The local reply's headers (empty otherwise).
    pub local_headers: HeaderMap,
    /// The headers that went upstream (`None` when the request did not go).
    pub upstream: Option<HeaderMap>,
    /// The decision JSON (`x-kvroute-decision`), from upstream headers or the local reply.
    pub decision: Option<Value>,
}

impl Outcome {
    /// The upstream destination.
    pub fn destination(&self) -> Option<&str> {
        self.upstream.as_ref().and_then(|h| h.get(DESTINATION))
    }

    /// An upstream header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.upstream.as_ref().and_then(|h| h.get(name))
    }

    /// The decision's request id.
    pub fn request_id(&self) -> Option<&str> {
        self.decision.as_ref().and_then(|d| d["request_id"].as_str())
    }
}

/// Read a stream's outcome.
pub fn outcome(s: &Stream) -> Outcome {
    let local = s.local_reply();
    let upstream = s.upstream_headers().cloned();
    let raw = upstream
        .as_ref()
        .and_then(|h| h.get(DECISION).map(str::to_owned))
        .or_else(|| local.and_then(|l| l.headers.get(DECISION).map(str::to_owned)));
    Outcome {
        local_status: local.map(|l| l.status),
        local_headers: local.map(|l| l.headers.clone()).unwrap_or_default(),
        upstream,
        decision: raw.and_then(|r| serde_json::from_str(&r).ok()),
    }
}

/// Send a request and read its outcome (the stream stays open).
pub fn route(
    host: &mut Host,
    vm: VmId,
    body: &[u8],
    headers: &[(&str, &str)],
) -> Result<(StreamId, Outcome), HostError> {
    let s = send(host, vm, body, headers)?;
    let o = outcome(host.stream(s)?);
    Ok((s, o))
}

/// A local answer: status and JSON body (`Null` when not JSON).
pub fn answer(s: &Stream) -> (u32, Value) {
    match s.local_reply() {
        Some(l) => (l.status, serde_json::from_slice(&l.body).unwrap_or(Value::Null)),
        None => (0, Value::Null),
    }
}

/// The headers of a signed event post as the relay sends them (`x-kvroute-endpoint`,
/// `x-kvroute-kind`, `x-kvroute-seq` when given, `x-kvroute-timestamp` = the host's clock,
/// `x-kvroute-signature` keyed by `secret`), after `:method`, `:path` and `:authority`.
pub fn signed_event_headers(
    host: &Host,
    secret: &str,
    endpoint: &str,
    kind: &str,
    seq: Option<u64>,
    body: &[u8],
) -> Vec<(String, String)> {
    use kvroute_filter::ingest;
    let ts = now_ms(host);
    let mut h: Vec<(String, String)> = [
        (":method", "POST"),
        (":path", EVENTS_PATH),
        (":authority", "llm.local"),
        (":scheme", "http"),
        (ingest::HEADER_ENDPOINT, endpoint),
        (ingest::HEADER_KIND, kind),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    if let Some(s) = seq {
        h.push((ingest::HEADER_SEQ.into(), s.to_string()));
    }
    h.push((ingest::HEADER_TIMESTAMP.into(), ts.to_string()));
    h.push((ingest::HEADER_SIGNATURE.into(), ingest::signature(secret.as_bytes(), endpoint, kind, seq, ts, body)));
    h
}

/// POST an event batch (`seq` None: no sequence header) to `vm`'s event path, signed with
/// `secret` at the host's current time.
pub fn post_events(
    host: &mut Host,
    vm: VmId,
    endpoint: &str,
    seq: Option<u64>,
    payload: &[u8],
    secret: &str,
) -> Result<(u32, Value), HostError> {
    let mut h = signed_event_headers(host, secret, endpoint, "batch", seq, payload);
    h.push(("x-kvroute-topic".into(), "kv-events".into()));
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let st = host.round_trip(vm, &HttpMessage::new(h, payload.to_vec()), None)?;
    Ok(answer(&st))
}

/// POST a signed resync notice for `endpoint`.
pub fn post_resync(host: &mut Host, vm: VmId, endpoint: &str) -> Result<(u32, Value), HostError> {
    let h = signed_event_headers(host, SECRET, endpoint, "resync", None, &[]);
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let st = host.round_trip(vm, &HttpMessage::new(h, Vec::new()), None)?;
    Ok(answer(&st))
}

/// The stats page of `vm` (the router's metrics and the filter's counters as that VM sees them).
pub fn stats(host: &mut Host, vm: VmId) -> Result<String, HostError> {
    let h = [(":method", "GET"), (":path", STATS_PATH), (":authority", "llm.local")];
    let st = host.round_trip(vm, &HttpMessage::new(h, Vec::new()), None)?;
    Ok(st.local_reply().map(|l| String::from_utf8_lossy(&l.body).into_owned()).unwrap_or_default())
}

/// The value of the sample `series` (name with its labels, as written) in a stats page.
pub fn stat(page: &str, series: &str) -> Option<f64> {
    page.lines().find_map(|l| {
        l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.trim().parse().ok())
    })
}

/// A vLLM metrics page with these figures (the golden fixtures' `metrics` objects: `waiting`,
/// `running`, `kv_usage`, optional `lora_running`, `lora_waiting`, `max_lora`).
pub fn prometheus(m: &Value) -> String {
    let n = |k: &str| m.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let mut page =
        String::from("# HELP vllm:num_requests_waiting Requests waiting.\n# TYPE vllm:num_requests_waiting gauge\n");
    page += &format!("vllm:num_requests_waiting{{model_name=\"m\"}} {}\n", n("waiting"));
    page += &format!("vllm:num_requests_running{{model_name=\"m\"}} {}\n", n("running"));
    page += &format!("vllm:kv_cache_usage_perc{{model_name=\"m\"}} {}\n", n("kv_usage"));
    let list = |k: &str| {
        m.get(k)
            .and_then(Value::as_array)
            .map_or(String::new(), |a| a.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(","))
    };
    let has_lora = ["lora_running", "lora_waiting", "max_lora"].iter().any(|k| m.get(*k).is_some_and(|v| !v.is_null()));
    if has_lora {
        let max = m.get("max_lora").and_then(Value::as_u64).map(|x| format!("max_lora=\"{x}\","));
        page += &format!(
            "vllm:lora_requests_info{{{}running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} 1.0\n",
            max.unwrap_or_default(),
            list("lora_running"),
            list("lora_waiting")
        );
    }
    page
}

/// Bytes of a hex string (the fixtures' `payload_hex`); panics when it is not hex.
pub fn hex(s: &str) -> Vec<u8> {
    golden::hex(s).unwrap_or_else(|| panic!("not a hex string: {s:?}"))
}

/// A golden fixture case (`fixtures/golden/<name>.json`) as plain JSON, read from the repository.
pub fn golden_case(name: &str) -> Value {
    golden::case_json(name).unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

/// The `scores` entry of `endpoint` in a decision JSON (`Value::Null` when absent).
pub fn score(decision: &Value, endpoint: &str) -> Value {
    let ids = decision["endpoints"].as_array().cloned().unwrap_or_default();
    ids.iter()
        .position(|e| e.as_str() == Some(endpoint))
        .and_then(|i| decision["scores"].get(i).cloned())
        .unwrap_or(Value::Null)
}

/// The sum of the `kvroute_inflight_requests` samples of a stats page.
pub fn inflight_total(page: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with("kvroute_inflight_requests{"))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// Whether flow control holds the request of stream `s`: paused, nothing upstream, no answer.
pub fn is_held(host: &Host, s: StreamId) -> bool {
    host.stream(s).is_ok_and(|st| {
        st.request().state().is_paused() && st.upstream_headers().is_none() && st.local_reply().is_none()
    })
}

/// A flow-control answer: (status, `x-llm-d-request-dropped-reason`), when the filter answered
/// the stream with one.
pub fn dropped(host: &Host, s: StreamId) -> Option<(u32, String)> {
    let l = host.stream(s).ok()?.local_reply()?;
    Some((l.status, l.headers.get(kvroute::HEADER_DROPPED_REASON)?.to_owned()))
}

/// The `extra` of [`plugin_config`] for replica `replica_id` of `fleet` (secret
/// [`REPLICA_SECRET`]), with `more` merged into the replica section.
pub fn replica_extra(fleet: &str, replica_id: &str, more: &Value) -> Value {
    let mut r = json!({"fleet": fleet, "replica_id": replica_id, "secret": REPLICA_SECRET});
    if let (Some(r), Some(m)) = (r.as_object_mut(), more.as_object()) {
        for (k, v) in m {
            r.insert(k.clone(), v.clone());
        }
    }
    json!({ "replica": r })
}

/// A local answer with its headers: status, headers, body.
pub type Answer = (u32, HeaderMap, Vec<u8>);

/// `GET <replica path>/out` (from `cursor`) on `vm`, signed with `secret` at the host's time.
pub fn replica_out(host: &mut Host, vm: VmId, cursor: Option<u64>, secret: &str) -> Result<Answer, HostError> {
    use kvroute_filter::ingest;
    let ts = now_ms(host);
    let sig = ingest::replica_signature(secret.as_bytes(), "out", cursor, ts, &[]);
    let path = match cursor {
        Some(c) => format!("{REPLICA_PATH}/out?cursor={c}"),
        None => format!("{REPLICA_PATH}/out"),
    };
    let ts = ts.to_string();
    let h = [
        (":method", "GET"),
        (":path", path.as_str()),
        (":authority", "llm.local"),
        (ingest::HEADER_TIMESTAMP, ts.as_str()),
        (ingest::HEADER_SIGNATURE, sig.as_str()),
    ];
    let st = host.round_trip(vm, &HttpMessage::new(h, Vec::new()), None)?;
    Ok(full_answer(&st))
}

/// `POST <replica path>/in` of `batch` on `vm`, signed with `secret` at the host's time.
pub fn replica_in(host: &mut Host, vm: VmId, batch: &[u8], secret: &str) -> Result<(u32, Value), HostError> {
    use kvroute_filter::ingest;
    let ts = now_ms(host);
    let sig = ingest::replica_signature(secret.as_bytes(), "in", None, ts, batch);
    let path = format!("{REPLICA_PATH}/in");
    let ts = ts.to_string();
    let h = [
        (":method", "POST"),
        (":path", path.as_str()),
        (":authority", "llm.local"),
        (ingest::HEADER_TIMESTAMP, ts.as_str()),
        (ingest::HEADER_SIGNATURE, sig.as_str()),
    ];
    let st = host.round_trip(vm, &HttpMessage::new(h, batch.to_vec()), None)?;
    Ok(answer(&st))
}

/// A stream's local answer with its headers (status 0 when there is none).
pub fn full_answer(s: &Stream) -> Answer {
    match s.local_reply() {
        Some(l) => (l.status, l.headers.clone(), l.body.clone()),
        None => (0, HeaderMap::default(), Vec::new()),
    }
}

/// One HTTP request received by a [`loopback_listener`], and where its answer goes.
pub struct Incoming {
    /// The request (`:method`, `:path`, `:authority` and the headers, lowercase; the body).
    pub message: HttpMessage,
    /// Send the answer here.
    pub answer: std::sync::mpsc::Sender<Reply>,
}

/// An HTTP answer for a [`loopback_listener`]: status, headers, body.
pub type Reply = (u32, Vec<(String, String)>, Vec<u8>);

/// A keep-alive HTTP/1.1 listener on loopback standing in for Envoy's listener: every request
/// is passed to the test thread (which owns the host) and answered with what it sends back
/// (within 10 s, else the connection is closed). Returns its `http://` URL.
pub fn loopback_listener() -> std::io::Result<(String, std::sync::mpsc::Receiver<Incoming>)> {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let url = format!("http://{}", listener.local_addr()?);
    let (tx, rx) = std::sync::mpsc::channel::<Incoming>();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let tx = tx.clone();
            std::thread::spawn(move || {
                let Ok(read_half) = conn.try_clone() else { return };
                let mut r = BufReader::new(read_half);
                let mut w = conn;
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let mut parts = line.split_whitespace();
                    let (method, path) = (parts.next().unwrap_or("").to_owned(), parts.next().unwrap_or("").to_owned());
                    let mut headers = vec![(":method".to_owned(), method), (":path".to_owned(), path)];
                    loop {
                        let mut h = String::new();
                        if r.read_line(&mut h).unwrap_or(0) == 0 {
                            return;
                        }
                        let h = h.trim_end();
                        if h.is_empty() {
                            break;
                        }
                        let Some((k, v)) = h.split_once(':') else { return };
                        let k = k.trim().to_ascii_lowercase();
                        headers.push((if k == "host" { ":authority".to_owned() } else { k }, v.trim().to_owned()));
                    }
                    let n: usize = headers
                        .iter()
                        .find(|(k, _)| k == "content-length")
                        .and_then(|(_, v)| v.parse().ok())
                        .unwrap_or(0);
                    let mut body = vec![0; n];
                    if r.read_exact(&mut body).is_err() {
                        return;
                    }
                    let pairs: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                    let (atx, arx) = std::sync::mpsc::channel();
                    if tx.send(Incoming { message: HttpMessage::new(pairs, body), answer: atx }).is_err() {
                        return;
                    }
                    let Ok((status, headers, body)) = arx.recv_timeout(std::time::Duration::from_secs(10)) else {
                        return;
                    };
                    let mut head = format!("HTTP/1.1 {status} X\r\ncontent-length: {}\r\n", body.len());
                    for (k, v) in headers {
                        if k.starts_with(':') || k.eq_ignore_ascii_case("content-length") {
                            continue;
                        }
                        head += &format!("{k}: {v}\r\n");
                    }
                    head += "\r\n";
                    if w.write_all(head.as_bytes()).and_then(|()| w.write_all(&body)).is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok((url, rx))
}

/// Hand `inc` to `vm` of `host` and send back the filter's local answer (status 0 when the
/// filter let it go upstream). Returns the answer's status.
pub fn answer_incoming(host: &mut Host, vm: VmId, inc: Incoming) -> Result<u32, HostError> {
    let st = host.round_trip(vm, &inc.message, None)?;
    let (status, headers, body) = match st.local_reply() {
        Some(l) => (l.status, l.headers.to_pairs(), l.body.clone()),
        None => (0, Vec::new(), Vec::new()),
    };
    let _ = inc.answer.send((status, headers, body));
    Ok(status)
}

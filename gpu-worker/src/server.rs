//! The HTTP server (axum): OpenAI-compatible endpoints, `/metrics`, `/health`, and the worker's
//! own endpoints.
//!
//! | method | path | what |
//! |---|---|---|
//! | POST | `/v1/completions` | completions (JSON or SSE with `stream: true`) |
//! | POST | `/v1/chat/completions` | chat completions (fixed template) |
//! | GET | `/v1/models` | the served model |
//! | GET | `/metrics` | Prometheus text, vLLM names |
//! | GET | `/health` | 200, empty body (as vLLM) |
//! | POST | `/reset_prefix_cache` | forget the prefix cache (`AllBlocksCleared`); 409 while requests run |
//! | POST | `/kvroute/v1/prefill` | remote prefill for a decode worker (see [`crate::transfer`]) |
//! | GET | `/kvroute/v1/info` | role, shape, addresses |

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::config::{TransferMode, WorkerConfig};
use crate::engine::{Command, Completion, NewSeq, Reply, SeqEvent, SeqKind, TransferredKv};
use crate::metrics::{PageInfo, Shared};
use crate::openai::{parse_chat, parse_completion, parse_prefill, ApiError, GenerateRequest};
use crate::tokenizer::{self, Detokenizer};
use crate::transfer::{self, PendingPush, Shape, TransferReport};

/// The header kvroute sets for disaggregated decisions (the prefill worker's HTTP address).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

/// State of the HTTP handlers.
pub(crate) struct AppState {
    pub(crate) cfg: WorkerConfig,
    pub(crate) engine: std::sync::mpsc::Sender<Command>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) pending: Arc<PendingPush>,
    pub(crate) kv_addr: SocketAddr,
    pub(crate) backend: &'static str,
    pub(crate) events_endpoint: Option<String>,
    pub(crate) replay_endpoint: Option<String>,
    pub(crate) next_id: AtomicU64,
    pub(crate) id_base: u64,
}

impl AppState {
    async fn ask<T: Send + 'static>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, ApiError> {
        let (tx, rx) = tokio::sync::oneshot::channel::<T>();
        let reply: Reply<T> = Box::new(move |v| {
            let _ = tx.send(v);
        });
        self.engine.send(make(reply)).map_err(|_| ApiError::status(503, "the engine has stopped"))?;
        rx.await.map_err(|_| ApiError::status(503, "the engine has stopped"))
    }

    fn fresh_id(&self) -> u64 {
        self.id_base.wrapping_add(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    fn shape(&self) -> Shape {
        let m = &self.cfg.model;
        Shape {
            layers: m.layers as usize,
            kv_heads: m.kv_heads as usize,
            head_dim: m.head_dim as usize,
            block_size: self.cfg.block_size as usize,
        }
    }

    fn transfer_bounds(&self, prompt_len: usize, skip_blocks: usize) -> (usize, usize) {
        let bs = self.cfg.block_size as usize;
        let end = (prompt_len.saturating_sub(1) / bs) * bs;
        ((skip_blocks.saturating_mul(bs)).min(end), end)
    }
}

/// The application.
pub(crate) fn app(state: Arc<AppState>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/kvroute/v1/prefill", post(prefill))
        .route("/kvroute/v1/info", get(info))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        json_response(status, &self.body())
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    let mut r = Response::new(Body::from(v.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

async fn not_found() -> Response {
    ApiError::status(404, "Not Found: no such route").into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::status(405, "Method Not Allowed").into_response()
}

async fn health() -> StatusCode {
    StatusCode::OK
}

fn unix_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [{
            "id": st.cfg.model_name, "object": "model", "created": unix_secs(), "owned_by": "kvroute",
            "root": st.cfg.model_name, "max_model_len": st.cfg.max_model_len,
        }]}),
    )
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let info = PageInfo {
        model_name: &st.cfg.model_name,
        block_size: st.cfg.block_size,
        num_blocks: st.cfg.num_blocks,
        role: st.cfg.role.as_str(),
        backend: st.backend,
        kv_bytes_per_token: st.cfg.model.kv_bytes_per_token(),
    };
    let mut r = Response::new(Body::from(crate::metrics::render(&st.shared, &info)));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    r
}

async fn info(State(st): State<Arc<AppState>>) -> Response {
    let c = &st.cfg;
    json_response(
        StatusCode::OK,
        &json!({
            "model_name": c.model_name, "role": c.role, "backend": st.backend, "block_size": c.block_size,
            "num_blocks": c.num_blocks, "hash_algo": c.hash_algo, "max_model_len": c.max_model_len,
            "model": c.model, "kv_bytes_per_token": c.model.kv_bytes_per_token(),
            "kv_transfer_addr": st.kv_addr.to_string(), "transfer_mode": c.transfer_mode,
            "kv_events_endpoint": st.events_endpoint, "kv_events_replay_endpoint": st.replay_endpoint,
            "kv_events_topic": c.kv_events.topic, "kv_events_encoding": c.kv_events.encoding,
        }),
    )
}

async fn reset_prefix_cache(State(st): State<Arc<AppState>>) -> Response {
    match st.ask(|reply| Command::ResetPrefixCache { reply }).await {
        Ok(true) => json_response(StatusCode::OK, &json!({"reset": true})),
        Ok(false) => ApiError::status(409, "blocks are in use: the prefix cache cannot be reset now").into_response(),
        Err(e) => e.into_response(),
    }
}

/// Accept HTTP/1 connections on `listener` and serve `app` on each, with the bounds of `cfg`:
/// a request's headers must arrive within `header_read_timeout_ms` of the accept (or of the end
/// of the previous response on a keep-alive connection), else hyper closes the connection; at
/// most `max_connections` are open at once, a connection accepted beyond that gets a best-effort
/// 503 (one non-blocking write) and is closed at once. The body bound is [`read_body`]'s.
pub(crate) async fn serve(listener: tokio::net::TcpListener, app: axum::Router, cfg: &WorkerConfig) {
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections));
    let header_timeout = Duration::from_millis(cfg.header_read_timeout_ms);
    let busy = {
        let body = ApiError::status(503, format!("the worker has {} connections open", cfg.max_connections)).body();
        let body = body.to_string();
        format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // Out of file descriptors, or a connection reset before its accept: retry shortly.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            // One write on the non-blocking socket (a fresh send buffer takes it whole), no wait.
            if let Ok(mut s) = stream.into_std() {
                let _ = std::io::Write::write(&mut s, busy.as_bytes());
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            // Errors (the client went away, a header timeout, a malformed request) end just
            // this connection.
            let _ = conn.await;
            drop(permit);
        });
    }
}

/// Read a request body: at most `max_body_bytes` (else 413), all of it within
/// `body_read_timeout_ms` of the handler's start (else 408; the connection is then closed, its
/// unread rest is never read).
async fn read_body(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let limit = st.cfg.max_body_bytes;
    let too_large = || ApiError::status(413, format!("the request body exceeds {limit} bytes"));
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let bound = st.cfg.body_read_timeout_ms;
    match tokio::time::timeout(Duration::from_millis(bound), axum::body::to_bytes(body, limit)).await {
        Ok(read) => read.map_err(|_| too_large()),
        Err(_) => Err(ApiError::status(408, format!("the request body did not arrive within {bound} ms"))),
    }
}

async fn completions(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let req = match read_body(&st, &headers, body).await.and_then(|b| parse_completion(&b, st.cfg.model.vocab)) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    generate(st, &headers, req, false).await
}

async fn chat(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let req = match read_body(&st, &headers, body).await.and_then(|b| parse_chat(&b)) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    generate(st, &headers, req, true).await
}

/// Check a prompt of `n` tokens generating `max_tokens` against the limits.
fn check_lengths(cfg: &WorkerConfig, n: usize, max_tokens: usize, param: &str) -> Result<(), ApiError> {
    if n + max_tokens > cfg.max_model_len {
        return Err(ApiError::bad(
            Some(param),
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the \
                 prompt, {} in the completion). Please reduce the length of the prompt or completion.",
                cfg.max_model_len,
                n + max_tokens,
                n,
                max_tokens
            ),
        ));
    }
    let blocks = (n + max_tokens).div_ceil(cfg.block_size as usize);
    if blocks > cfg.num_blocks as usize {
        return Err(ApiError::bad(
            Some(param),
            format!("the request needs {blocks} KV blocks, the worker's pool has {}", cfg.num_blocks),
        ));
    }
    Ok(())
}

fn usage(c: &Completion) -> Value {
    json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
    })
}

async fn generate(st: Arc<AppState>, headers: &HeaderMap, req: GenerateRequest, chat: bool) -> Response {
    if let Some(m) = &req.model {
        if m != &st.cfg.model_name {
            return ApiError {
                status: 404,
                message: format!("The model `{m}` does not exist."),
                param: Some("model".into()),
            }
            .into_response();
        }
    }
    let tokens = req.tokens(st.cfg.model.vocab);
    let max_tokens = req.max_tokens.unwrap_or(st.cfg.default_max_tokens) as usize;
    let param = if chat { "messages" } else { "prompt" };
    if let Err(e) = check_lengths(&st.cfg, tokens.len(), max_tokens, param) {
        return e.into_response();
    }
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 256)
        .map_or_else(|| format!("{:016x}", st.fresh_id()), str::to_owned);
    let arrival = Instant::now();

    // Disaggregated: obtain the prompt's KV from the prefill worker first.
    let prefiller =
        headers.get(PREFILLER_HEADER).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty());
    let (preloaded, report) = match prefiller {
        Some(host) if st.cfg.role.pulls_kv() => {
            let (kv, rep) = remote_prefill(&st, host, &tokens, req.cache_salt.as_deref()).await;
            (kv, Some(rep))
        }
        _ => (None, None),
    };

    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let seq = NewSeq {
        tokens,
        max_tokens,
        cache_salt: req.cache_salt.clone(),
        sink: Some(tx),
        arrival,
        kind: SeqKind::Generate,
        preloaded,
    };
    if st.engine.send(Command::Submit(Box::new(seq))).is_err() {
        return ApiError::status(503, "the engine has stopped").into_response();
    }
    let mut extra = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        extra.insert("x-request-id", v);
    }
    if let Some(r) = &report {
        for (k, v) in [
            ("x-kvroute-kv-transfer-bytes", r.bytes.to_string()),
            ("x-kvroute-kv-transfer-blocks", r.blocks.to_string()),
            ("x-kvroute-kv-transfer-ms", format!("{:.3}", r.transfer_ms)),
        ] {
            if let Ok(v) = HeaderValue::from_str(&v) {
                extra.insert(k, v);
            }
        }
    }
    let ctx = ResponseCtx { model: st.cfg.model_name.clone(), request_id, chat, req, report, created: unix_secs() };
    let mut resp = if ctx.req.stream { stream_response(rx, ctx) } else { collect_response(rx, ctx).await };
    resp.headers_mut().extend(extra);
    resp
}

/// What the response bodies need.
struct ResponseCtx {
    model: String,
    request_id: String,
    chat: bool,
    req: GenerateRequest,
    report: Option<TransferReport>,
    created: u64,
}

impl ResponseCtx {
    fn id(&self) -> String {
        if self.chat {
            format!("chatcmpl-{}", self.request_id)
        } else {
            format!("cmpl-{}", self.request_id)
        }
    }

    fn object(&self) -> &'static str {
        match (self.chat, self.req.stream) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    /// One choice carrying `text`.
    fn choice(&self, text: &str, ids: &[u32], finish: Option<&str>, first: bool) -> Value {
        let mut c = if self.chat {
            if self.req.stream {
                let delta =
                    if first { json!({"role": "assistant", "content": text}) } else { json!({"content": text}) };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            } else {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null,
                       "finish_reason": finish})
            }
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null})
        };
        if self.req.return_token_ids {
            c["token_ids"] = json!(ids);
        }
        c
    }

    fn body(&self, choices: Value) -> Value {
        json!({"id": self.id(), "object": self.object(), "created": self.created, "model": self.model,
               "choices": choices})
    }
}

async fn collect_response(mut rx: UnboundedReceiver<SeqEvent>, ctx: ResponseCtx) -> Response {
    let mut ids = Vec::new();
    let done = loop {
        match rx.recv().await {
            Some(SeqEvent::Token(t)) => ids.push(t),
            Some(SeqEvent::Done(c)) => break c,
            Some(SeqEvent::Error(e)) => return ApiError::status(500, e).into_response(),
            None => return ApiError::status(503, "the engine has stopped").into_response(),
        }
    };
    let text = tokenizer::decode(&ids);
    let mut body = ctx.body(json!([ctx.choice(&text, &ids, Some("length"), true)]));
    body["usage"] = usage(&done);
    if let Some(r) = &ctx.report {
        body["kv_transfer"] = json!(r);
    }
    json_response(StatusCode::OK, &body)
}

/// A body fed by a channel of chunks.
struct ChannelBody(tokio::sync::mpsc::Receiver<Bytes>);

impl futures_core::Stream for ChannelBody {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|o| o.map(Ok))
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn stream_response(mut rx: UnboundedReceiver<SeqEvent>, ctx: ResponseCtx) -> Response {
    let (btx, brx) = tokio::sync::mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let mut detok = Detokenizer::new();
        let mut first = true;
        loop {
            let chunk = match rx.recv().await {
                Some(SeqEvent::Token(t)) => {
                    let text = detok.push(t);
                    let c = ctx.body(json!([ctx.choice(&text, &[t], None, first)]));
                    first = false;
                    sse(&c)
                }
                Some(SeqEvent::Done(done)) => {
                    let rest = detok.finish();
                    let mut last = ctx.body(json!([ctx.choice(&rest, &[], Some("length"), first)]));
                    if let Some(r) = &ctx.report {
                        last["kv_transfer"] = json!(r);
                    }
                    let mut out = format!("data: {last}\n\n");
                    if ctx.req.include_usage {
                        let mut u = ctx.body(json!([]));
                        u["usage"] = usage(&done);
                        out.push_str(&format!("data: {u}\n\n"));
                    }
                    out.push_str("data: [DONE]\n\n");
                    let _ = btx.send(Bytes::from(out)).await;
                    return;
                }
                Some(SeqEvent::Error(e)) => {
                    let err = ApiError::status(500, e).body();
                    let _ = btx.send(Bytes::from(format!("data: {err}\n\ndata: [DONE]\n\n"))).await;
                    return;
                }
                None => return,
            };
            if btx.send(chunk).await.is_err() {
                // The client is gone: dropping `rx` makes the engine abort the sequence.
                return;
            }
        }
    });
    let mut r = Response::new(Body::from_stream(ChannelBody(brx)));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// Decode side of a disaggregated request: probe the local cache, have the prefill worker
/// compute the rest, receive its blocks. On any failure the prompt is computed locally and the
/// report says why.
async fn remote_prefill(
    st: &AppState,
    host: &str,
    tokens: &[u32],
    salt: Option<&str>,
) -> (Option<TransferredKv>, TransferReport) {
    let mode = st.cfg.transfer_mode;
    let mut rep = TransferReport { prefill_host_port: host.to_owned(), mode: mode.as_str(), ..Default::default() };
    let bs = st.cfg.block_size as usize;
    let want_blocks = tokens.len().saturating_sub(1) / bs;
    let probe = st
        .ask(|reply| Command::ProbePrefix { tokens: tokens.to_vec(), cache_salt: salt.map(str::to_owned), reply })
        .await;
    let local = probe.unwrap_or(0);
    rep.skipped_blocks = local;
    if local >= want_blocks {
        return (None, rep);
    }
    let (start, end) = st.transfer_bounds(tokens.len(), local);
    let t0 = Instant::now();
    let work = async {
        let body = json!({"prompt_token_ids": tokens, "cache_salt": salt, "skip_blocks": local,
                          "transfer_mode": mode.as_str()})
        .to_string();
        let (status, resp) = transfer::http_post_json(host, "/kvroute/v1/prefill", body.as_bytes()).await?;
        let v: Value = serde_json::from_slice(&resp).map_err(|e| format!("prefill worker answered non-JSON: {e}"))?;
        if status != 200 {
            return Err(format!("prefill worker answered {status}: {}", v["error"]["message"].as_str().unwrap_or("")));
        }
        let id = v["transfer_id"].as_u64().ok_or("prefill worker's answer lacks transfer_id")?;
        let addr = v["kv_transfer_addr"].as_str().ok_or("prefill worker's answer lacks kv_transfer_addr")?;
        let addr = transfer::reachable(addr, host);
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t1 = Instant::now();
        let got = transfer::receive(&addr, transfer::op_of(mode), id, start, &tokens[start..end], st.shape()).await?;
        Ok::<_, String>((got, prefill_ms, t1.elapsed()))
    };
    let timeout = Duration::from_millis(st.cfg.kv_transfer_timeout_ms);
    let c = &st.shared.counters;
    match tokio::time::timeout(timeout, work).await {
        Ok(Ok(((kv, bytes, wire, first, compute_us), prefill_ms, took))) => {
            rep.prefill_ms = prefill_ms;
            rep.transfer_ms = took.as_secs_f64() * 1e3;
            rep.remote_compute_ms = compute_us as f64 / 1e3;
            rep.exposed_ms = match mode {
                TransferMode::Pull => rep.transfer_ms,
                TransferMode::Push => (rep.transfer_ms - rep.remote_compute_ms).max(0.0),
            };
            rep.bytes = bytes;
            rep.wire_bytes = wire;
            rep.tokens = end - start;
            rep.blocks = (end - start) / bs;
            rep.first_token = Some(first);
            Shared::add(&c.kv_transfers_in, 1);
            Shared::add(&c.kv_transfer_in_bytes, bytes);
            Shared::add(&c.kv_transfer_in_micros, u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
            st.shared.observe(|h| h.transfer.observe(took.as_secs_f64()));
            (Some(kv), rep)
        }
        Ok(Err(e)) => {
            Shared::add(&c.kv_transfer_failures, 1);
            rep.error = Some(e);
            (None, rep)
        }
        Err(_) => {
            Shared::add(&c.kv_transfer_failures, 1);
            rep.error = Some(format!("remote prefill and transfer took over {timeout:?}"));
            (None, rep)
        }
    }
}

async fn prefill(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    if !st.cfg.role.serves_prefill() {
        return ApiError::bad(
            None,
            format!("this worker's role is {}: it does not prefill for others", st.cfg.role.as_str()),
        )
        .into_response();
    }
    let req = match read_body(&st, &headers, body).await.and_then(|b| parse_prefill(&b, st.cfg.model.vocab)) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = check_lengths(&st.cfg, req.tokens.len(), 1, "prompt_token_ids") {
        return e.into_response();
    }
    let id = st.fresh_id();
    let (start, end) = st.transfer_bounds(req.tokens.len(), req.skip_blocks);
    let mut answer = json!({
        "transfer_id": id, "kv_transfer_addr": st.kv_addr.to_string(), "transfer_mode": req.mode.as_str(),
        "start": start, "num_tokens": end - start,
    });
    let timeout = Duration::from_millis(st.cfg.kv_transfer_timeout_ms);
    match req.mode {
        TransferMode::Push => {
            let (ptx, prx) = tokio::sync::mpsc::unbounded_channel();
            transfer::expire_pending(&st.pending, timeout);
            if let Ok(mut p) = st.pending.lock() {
                p.insert(id, (prx, Instant::now()));
            }
            let seq = NewSeq {
                tokens: req.tokens,
                max_tokens: 1,
                cache_salt: req.cache_salt,
                sink: None,
                arrival: Instant::now(),
                kind: SeqKind::Prefill { transfer_id: id, skip_blocks: req.skip_blocks, push: Some(ptx) },
                preloaded: None,
            };
            if st.engine.send(Command::Submit(Box::new(seq))).is_err() {
                return ApiError::status(503, "the engine has stopped").into_response();
            }
            json_response(StatusCode::OK, &answer)
        }
        TransferMode::Pull => {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            let seq = NewSeq {
                tokens: req.tokens,
                max_tokens: 1,
                cache_salt: req.cache_salt,
                sink: Some(tx),
                arrival: Instant::now(),
                kind: SeqKind::Prefill { transfer_id: id, skip_blocks: req.skip_blocks, push: None },
                preloaded: None,
            };
            if st.engine.send(Command::Submit(Box::new(seq))).is_err() {
                return ApiError::status(503, "the engine has stopped").into_response();
            }
            loop {
                match rx.recv().await {
                    Some(SeqEvent::Done(c)) => {
                        answer["cached_tokens"] = json!(c.local_hit_tokens);
                        answer["computed_tokens"] = json!(c.prompt_tokens - c.local_hit_tokens);
                        answer["first_token"] = json!(c.first_token);
                        return json_response(StatusCode::OK, &answer);
                    }
                    Some(SeqEvent::Token(_)) => {}
                    Some(SeqEvent::Error(e)) => return ApiError::status(500, e).into_response(),
                    None => return ApiError::status(503, "the engine has stopped").into_response(),
                }
            }
        }
    }
}

//! Public value types: ids, VM configuration, streams and their observable state, callouts, logs,
//! metrics and ABI violations.

use std::fmt;
use std::time::Duration;

use crate::abi::LogLevel;
use crate::headers::HeaderMap;

/// One VM (one wasmtime instance of a module: an Envoy worker thread's copy of the plugin).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VmId(pub(crate) usize);

impl VmId {
    /// The VM's index in start order (0 for the first VM of a host).
    pub fn index(self) -> usize {
        self.0
    }
}

impl fmt::Display for VmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "vm#{}", self.0)
    }
}

/// One HTTP stream: a VM and the stream's context id in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId {
    pub(crate) vm: VmId,
    pub(crate) context: u32,
}

impl StreamId {
    /// The VM the stream runs in.
    pub fn vm(self) -> VmId {
        self.vm
    }

    /// The stream's context id (the first argument of its HTTP callbacks).
    pub fn context_id(self) -> u32 {
        self.context
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/ctx#{}", self.vm, self.context)
    }
}

/// How a VM is started: Envoy's `VmConfig` + `PluginConfig` in one.
#[derive(Clone, Debug)]
pub struct VmConfig {
    pub(crate) vm_id: String,
    pub(crate) vm_config: Vec<u8>,
    pub(crate) plugin_config: Vec<u8>,
    pub(crate) plugin_name: String,
    pub(crate) root_id: String,
    pub(crate) allow_on_headers_stop_iteration: bool,
    pub(crate) fail_open: bool,
    pub(crate) properties: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Default for VmConfig {
    fn default() -> VmConfig {
        VmConfig {
            vm_id: String::new(),
            vm_config: Vec::new(),
            plugin_config: Vec::new(),
            plugin_name: String::new(),
            root_id: String::new(),
            allow_on_headers_stop_iteration: true,
            fail_open: false,
            properties: Vec::new(),
        }
    }
}

impl VmConfig {
    /// Defaults: empty `vm_id` (all such VMs share shared data and queues), empty configurations,
    /// `allow_on_headers_stop_iteration: true`, `fail_open: false`.
    pub fn new() -> VmConfig {
        VmConfig::default()
    }

    /// `vm_config.vm_id`: the namespace of shared data and shared queues (Envoy keys both by it).
    pub fn vm_id(mut self, vm_id: impl Into<String>) -> VmConfig {
        self.vm_id = vm_id.into();
        self
    }

    /// `vm_config.configuration`: the bytes of the `VM_CONFIGURATION` buffer in `proxy_on_vm_start`.
    pub fn vm_configuration(mut self, bytes: impl Into<Vec<u8>>) -> VmConfig {
        self.vm_config = bytes.into();
        self
    }

    /// `configuration`: the bytes of the `PLUGIN_CONFIGURATION` buffer in `proxy_on_configure`.
    pub fn plugin_configuration(mut self, bytes: impl Into<Vec<u8>>) -> VmConfig {
        self.plugin_config = bytes.into();
        self
    }

    /// `name`: the `plugin_name` property.
    pub fn plugin_name(mut self, name: impl Into<String>) -> VmConfig {
        self.plugin_name = name.into();
        self
    }

    /// `root_id`: the `plugin_root_id` property.
    pub fn root_id(mut self, root_id: impl Into<String>) -> VmConfig {
        self.root_id = root_id.into();
        self
    }

    /// `allow_on_headers_stop_iteration` (Envoy ≥ 1.35 wasm filter config). With `true` (the default
    /// here), Pause from `proxy_on_request_headers` holds the headers but still delivers the body to
    /// `proxy_on_request_body`; with `false` (Envoy's default) it stops everything: the body is
    /// buffered by the host and not shown to the filter until it calls `proxy_continue_stream`.
    pub fn allow_on_headers_stop_iteration(mut self, allow: bool) -> VmConfig {
        self.allow_on_headers_stop_iteration = allow;
        self
    }

    /// `fail_open`: once the VM has failed (trapped), pass streams through untouched instead of
    /// answering 503.
    pub fn fail_open(mut self, fail_open: bool) -> VmConfig {
        self.fail_open = fail_open;
        self
    }

    /// A property readable with `proxy_get_property` in every context of this VM. `path` is the
    /// property path with its parts joined by NUL (`"node\0id"`) or a single part.
    pub fn property(mut self, path: impl AsRef<[u8]>, value: impl Into<Vec<u8>>) -> VmConfig {
        self.properties.push((path.as_ref().to_vec(), value.into()));
        self
    }
}

/// Where one direction (request: downstream → upstream, or response: upstream → downstream) of a
/// stream stands after the filter's callbacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlowState {
    /// No headers yet.
    Idle,
    /// The filter returned Pause from the headers callback; the headers are held (and writable).
    /// `stop_all`: Envoy's StopAllIteration (`allow_on_headers_stop_iteration: false`): later body
    /// chunks are buffered by the host and not delivered to the filter until it continues the stream.
    HeadersPaused {
        /// Whether the body is withheld from the filter too.
        stop_all: bool,
    },
    /// Headers went on; the filter holds body data (Pause from the body callback) or trailers.
    DataPaused,
    /// Everything received so far went on; more is to come.
    Streaming,
    /// Everything went on, end of stream included.
    Complete,
    /// A local reply or a reset ended the stream.
    Closed,
}

impl FlowState {
    /// Whether the filter holds this direction (headers or data paused).
    pub fn is_paused(self) -> bool {
        matches!(self, FlowState::HeadersPaused { .. } | FlowState::DataPaused)
    }
}

/// One direction of a stream: what went on (upstream for the request, downstream for the response).
#[derive(Clone, Debug, Default)]
pub struct Flow {
    pub(crate) headers: HeaderMap,
    pub(crate) headers_state: HeadersState,
    /// `proxy_continue_stream` was called: Envoy drops the held headers at once.
    pub(crate) headers_released: bool,
    pub(crate) pending: Vec<u8>,
    pub(crate) body_paused: bool,
    pub(crate) trailers: Option<HeaderMap>,
    pub(crate) trailers_held: bool,
    pub(crate) eos_received: bool,
    pub(crate) unseen_body: Vec<u8>,
    pub(crate) unseen_body_event: bool,
    pub(crate) unseen_trailers: Option<HeaderMap>,
    pub(crate) out_headers: Option<HeaderMap>,
    pub(crate) out_body: Vec<u8>,
    pub(crate) out_trailers: Option<HeaderMap>,
    pub(crate) complete: bool,
    pub(crate) closed: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum HeadersState {
    #[default]
    NotReceived,
    Held {
        stop_all: bool,
    },
    Forwarded,
}

impl Flow {
    /// Where this direction stands.
    pub fn state(&self) -> FlowState {
        if self.closed {
            return FlowState::Closed;
        }
        if self.complete {
            return FlowState::Complete;
        }
        match self.headers_state {
            HeadersState::NotReceived => FlowState::Idle,
            HeadersState::Held { stop_all } => FlowState::HeadersPaused { stop_all },
            HeadersState::Forwarded if self.body_paused || self.trailers_held => FlowState::DataPaused,
            HeadersState::Forwarded => FlowState::Streaming,
        }
    }

    /// The headers as they went on (with everything the filter set), `None` while not forwarded.
    pub fn headers(&self) -> Option<&HeaderMap> {
        self.out_headers.as_ref()
    }

    /// The body bytes that went on so far.
    pub fn body(&self) -> &[u8] {
        &self.out_body
    }

    /// The trailers as they went on.
    pub fn trailers(&self) -> Option<&HeaderMap> {
        self.out_trailers.as_ref()
    }

    /// Body bytes received but held back (by a filter pause, or by the host under StopAllIteration).
    pub fn buffered(&self) -> usize {
        self.pending.len() + self.unseen_body.len()
    }

    /// The headers as the filter currently sees them (held or forwarded), for debugging.
    pub fn current_headers(&self) -> &HeaderMap {
        &self.headers
    }
}

/// A response the filter generated with `proxy_send_local_response`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalReply {
    /// HTTP status code.
    pub status: u32,
    /// `status_code_details` (Envoy's response code details), may be empty.
    pub details: String,
    /// Body.
    pub body: Vec<u8>,
    /// The additional headers the filter passed.
    pub headers: HeaderMap,
    /// gRPC status (`-1` from the Rust SDK's `send_http_response`).
    pub grpc_status: i32,
}

/// Which callback the host called, and what it returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallbackRecord {
    /// Export name (`proxy_on_request_headers`, ...).
    pub callback: &'static str,
    /// The size argument (header count or body bytes).
    pub size: usize,
    /// The `end_of_stream` argument (false for trailers).
    pub end_of_stream: bool,
    /// The returned action (`None` when the module does not export the callback: Envoy continues).
    pub action: Option<crate::abi::Action>,
}

/// An HTTP stream as the filter left it: both directions, a local reply, callback history.
#[derive(Clone, Debug)]
pub struct Stream {
    pub(crate) id: StreamId,
    pub(crate) root: u32,
    pub(crate) request: Flow,
    pub(crate) response: Flow,
    pub(crate) local_reply: Option<LocalReply>,
    pub(crate) reset: bool,
    pub(crate) failed: bool,
    pub(crate) callbacks: Vec<CallbackRecord>,
    pub(crate) properties: Vec<(Vec<u8>, Vec<u8>)>,
    pub(crate) in_log: bool,
    pub(crate) done: bool,
    pub(crate) encoding_local_reply: bool,
    /// Bumped by a local reply or a reset: a callback that ran across one no longer decides.
    pub(crate) epoch: u32,
}

impl Stream {
    pub(crate) fn new(id: StreamId, root: u32) -> Stream {
        Stream {
            id,
            root,
            request: Flow::default(),
            response: Flow::default(),
            local_reply: None,
            reset: false,
            failed: false,
            callbacks: Vec::new(),
            properties: Vec::new(),
            in_log: false,
            done: false,
            encoding_local_reply: false,
            epoch: 0,
        }
    }

    /// The stream's id.
    pub fn id(&self) -> StreamId {
        self.id
    }

    /// The root context the stream was created under.
    pub fn root_context_id(&self) -> u32 {
        self.root
    }

    /// The request direction: what went upstream.
    pub fn request(&self) -> &Flow {
        &self.request
    }

    /// The response direction: what went downstream (the upstream response, or the local reply,
    /// after the filter's response callbacks).
    pub fn response(&self) -> &Flow {
        &self.response
    }

    /// The local reply, if the filter sent one.
    pub fn local_reply(&self) -> Option<&LocalReply> {
        self.local_reply.as_ref()
    }

    /// Whether the filter reset the stream (`proxy_close_stream`), or a local reply came after the
    /// response headers had already gone downstream.
    pub fn was_reset(&self) -> bool {
        self.reset
    }

    /// Whether the VM had failed and the stream was failed (503) or passed through (fail open).
    pub fn failed_by_host(&self) -> bool {
        self.failed
    }

    /// Every HTTP callback the host made on this stream, in order.
    pub fn callbacks(&self) -> &[CallbackRecord] {
        &self.callbacks
    }

    /// The headers that went upstream (`None` while held, or when the request never went).
    pub fn upstream_headers(&self) -> Option<&HeaderMap> {
        self.request.headers()
    }

    /// `:status` of what went downstream.
    pub fn downstream_status(&self) -> Option<u32> {
        self.response.headers().and_then(|h| h.get(":status")).and_then(|s| s.parse().ok())
    }

    pub(crate) fn flow(&self, dir: Dir) -> &Flow {
        match dir {
            Dir::Request => &self.request,
            Dir::Response => &self.response,
        }
    }

    pub(crate) fn flow_mut(&mut self, dir: Dir) -> &mut Flow {
        match dir {
            Dir::Request => &mut self.request,
            Dir::Response => &mut self.response,
        }
    }
}

/// Request or response direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Dir {
    Request,
    Response,
}

/// An HTTP message for [`crate::Host::round_trip`]: headers, body, optional trailers.
#[derive(Clone, Debug, Default)]
pub struct HttpMessage {
    /// Headers (with the pseudo-headers: `:method`, `:path`, `:authority`, `:scheme` for a request,
    /// `:status` for a response).
    pub headers: HeaderMap,
    /// Body (sent as one chunk; empty: headers carry end of stream).
    pub body: Vec<u8>,
    /// Trailers (sent after the body, carrying end of stream).
    pub trailers: Option<HeaderMap>,
}

impl HttpMessage {
    /// A message with these headers and body.
    pub fn new(headers: impl Into<HeaderMap>, body: impl Into<Vec<u8>>) -> HttpMessage {
        HttpMessage { headers: headers.into(), body: body.into(), trailers: None }
    }

    /// A POST request with `:method`, `:path`, `:authority`, `:scheme` and `content-type: application/json`.
    pub fn post_json(authority: &str, path: &str, body: impl Into<Vec<u8>>) -> HttpMessage {
        let body = body.into();
        HttpMessage::new(
            [
                (":method", "POST"),
                (":path", path),
                (":authority", authority),
                (":scheme", "http"),
                ("content-type", "application/json"),
                ("content-length", body.len().to_string().as_str()),
            ],
            body,
        )
    }

    /// A response with `:status` and a body.
    pub fn response(status: u16, body: impl Into<Vec<u8>>) -> HttpMessage {
        let body = body.into();
        HttpMessage::new([(":status", status.to_string()), ("content-length", body.len().to_string())], body)
    }
}

/// An HTTP callout the filter dispatched with `proxy_http_call`, as the cluster handler sees it.
#[derive(Clone, Debug)]
pub struct CalloutRequest {
    /// The VM.
    pub vm: VmId,
    /// The root context that owns the call (Envoy dispatches callouts from the root context).
    pub root_context_id: u32,
    /// The token returned to the filter.
    pub token: u32,
    /// Cluster (upstream) name.
    pub cluster: String,
    /// Request headers (`:method`, `:path`, `:authority` guaranteed).
    pub headers: HeaderMap,
    /// Request body.
    pub body: Vec<u8>,
    /// Request trailers.
    pub trailers: HeaderMap,
    /// Timeout the filter asked for, in milliseconds (0: none).
    pub timeout_ms: u32,
    /// Virtual time of the dispatch, in ns.
    pub at_ns: u64,
}

/// What a cluster answers to a callout (see [`crate::HostBuilder::cluster`]).
#[derive(Clone, Debug)]
pub struct CalloutReply {
    pub(crate) outcome: CalloutOutcome,
    pub(crate) delay: Duration,
}

#[derive(Clone, Debug)]
pub(crate) enum CalloutOutcome {
    Response { status: u16, headers: HeaderMap, body: Vec<u8>, trailers: HeaderMap },
    Reset,
}

impl CalloutReply {
    /// A response with this status (the host adds `:status`), no body, delivered without delay (at
    /// the end of the host operation that dispatched the call).
    pub fn status(status: u16) -> CalloutReply {
        CalloutReply {
            outcome: CalloutOutcome::Response {
                status,
                headers: HeaderMap::new(),
                body: Vec::new(),
                trailers: HeaderMap::new(),
            },
            delay: Duration::ZERO,
        }
    }

    /// A 200 response with this body.
    pub fn ok(body: impl Into<Vec<u8>>) -> CalloutReply {
        CalloutReply::status(200).body(body)
    }

    /// A failed call (connection reset): `proxy_on_http_call_response` gets 0 headers, and
    /// `proxy_get_status` answers `BrokenConnection` / `"reset"`.
    pub fn reset() -> CalloutReply {
        CalloutReply { outcome: CalloutOutcome::Reset, delay: Duration::ZERO }
    }

    /// Adds a response header.
    pub fn header(mut self, name: &str, value: &str) -> CalloutReply {
        if let CalloutOutcome::Response { headers, .. } = &mut self.outcome {
            headers.append(name, value);
        }
        self
    }

    /// Sets the response body.
    pub fn body(mut self, bytes: impl Into<Vec<u8>>) -> CalloutReply {
        if let CalloutOutcome::Response { body, .. } = &mut self.outcome {
            *body = bytes.into();
        }
        self
    }

    /// Adds a response trailer.
    pub fn trailer(mut self, name: &str, value: &str) -> CalloutReply {
        if let CalloutOutcome::Response { trailers, .. } = &mut self.outcome {
            trailers.append(name, value);
        }
        self
    }

    /// Delivers the response after this much virtual time (see [`crate::Host::advance`]). When the
    /// delay exceeds the call's timeout, the filter gets Envoy's timeout answer instead: 504 with
    /// body `upstream request timeout`, at the timeout.
    pub fn after(mut self, delay: Duration) -> CalloutReply {
        self.delay = delay;
        self
    }
}

/// One log line of a guest (`proxy_log`, or stdout/stderr through WASI `fd_write`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEntry {
    /// The VM.
    pub vm: VmId,
    /// The effective context when the guest logged (0: during module start).
    pub context_id: u32,
    /// Level (stdout: Info, stderr: Error).
    pub level: LogLevel,
    /// Message (stdout/stderr: one trailing newline removed).
    pub message: String,
    /// Virtual time, ns.
    pub at_ns: u64,
}

/// Something a guest did that Envoy tolerates or answers with an error status, but that points at a
/// bug in the filter: an invalid pointer, a malformed serialized map, writing request headers after
/// they went upstream, continuing a stream that is not paused, ... Tests can assert there are none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbiViolation {
    /// The VM.
    pub vm: VmId,
    /// The effective context.
    pub context_id: u32,
    /// The hostcall or callback concerned.
    pub call: &'static str,
    /// What was wrong.
    pub message: String,
}

/// The value of a metric the filter defined with `proxy_define_metric`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetricValue {
    /// A counter.
    Counter(u64),
    /// A gauge.
    Gauge(u64),
    /// A histogram: the recorded values (at most the host's history cap, oldest dropped).
    Histogram(Vec<u64>),
}

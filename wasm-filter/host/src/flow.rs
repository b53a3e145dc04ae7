//! HTTP streams: what Envoy's filter manager does around one proxy-wasm HTTP filter.
//!
//! For each direction (request: decoding, response: encoding) the host keeps the headers the
//! filter sees, the body bytes it holds, and what went on. The callbacks' return values are
//! interpreted as Envoy does (`proxy-wasm-cpp-host` `convertVmCallResultTo*`, Envoy's wasm
//! `Context::decode*`/`encode*`):
//!
//! - headers: Continue forwards them; Pause is StopIteration when `allow_on_headers_stop_iteration`
//!   is set (body still delivered to the filter, headers held and writable until a body callback
//!   returns Continue), otherwise StopAllIteration (body buffered by the host, not delivered until
//!   the filter calls `proxy_continue_stream`, and then delivered to the filter first);
//! - body: Continue forwards the held headers and every held byte; Pause buffers (the next body
//!   callback sees all bytes held so far);
//! - trailers: Continue forwards everything, Pause holds;
//! - a local reply (`proxy_send_local_response`) makes the running callback a full stop, ends the
//!   request, and goes downstream through the filter's own response callbacks (as Envoy's
//!   `sendLocalReplyViaFilterChain`); after response headers went downstream it resets the stream.

use crate::abi::Action;
use crate::error::HostError;
use crate::headers::HeaderMap;
use crate::host::{action_of, len_arg, Host};
use crate::state::Context;
use crate::types::{
    CallbackRecord, Dir, Flow, FlowState, HeadersState, HttpMessage, LocalReply, Stream, StreamId, VmId,
};

/// Callbacks kept per stream in [`Stream::callbacks`].
const CALLBACK_HISTORY: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cb {
    Headers,
    Body,
    Trailers,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Continue,
    Pause,
    StopAll,
    Closed,
}

impl Flow {
    fn forward_headers(&mut self) {
        if self.headers_state != HeadersState::Forwarded {
            self.out_headers = Some(self.headers.clone());
            self.headers_state = HeadersState::Forwarded;
        }
    }

    fn forward_body(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        if self.out_body.is_empty() {
            // The whole body so far: it moves on as is (no copy).
            self.out_body = pending;
        } else {
            self.out_body.extend_from_slice(&pending);
        }
        self.body_paused = false;
    }

    fn forward_trailers(&mut self) {
        if self.trailers_held {
            self.out_trailers = self.trailers.clone();
            self.trailers_held = false;
        }
    }

    fn update_complete(&mut self) {
        if self.eos_received
            && self.headers_state == HeadersState::Forwarded
            && !self.body_paused
            && !self.trailers_held
            && self.pending.is_empty()
            && !self.unseen_body_event
            && self.unseen_trailers.is_none()
        {
            self.complete = true;
        }
    }

    /// Everything received goes on untouched (fail open).
    fn pass_through(&mut self) {
        if self.headers_state == HeadersState::NotReceived || self.closed {
            return;
        }
        let unseen = std::mem::take(&mut self.unseen_body);
        self.pending.extend_from_slice(&unseen);
        self.unseen_body_event = false;
        if let Some(t) = self.unseen_trailers.take() {
            self.trailers = Some(t);
            self.trailers_held = true;
        }
        self.forward_headers();
        self.forward_body();
        self.forward_trailers();
        self.update_complete();
    }
}

fn protocol(stream: StreamId, message: &str) -> HostError {
    HostError::Protocol { stream, message: message.to_string() }
}

impl Host {
    /// Creates an HTTP stream in `vm` under its current root context (`proxy_on_context_create`).
    pub fn new_stream(&mut self, vm: VmId) -> Result<StreamId, HostError> {
        self.top(|host| {
            let slot = host.slot_mut(vm.0)?;
            if slot.stopped {
                return Err(HostError::UnknownVm(vm));
            }
            let root = slot.root;
            let create = slot.exports.on_context_create.clone();
            let state = slot.store.data_mut();
            let context = state.alloc_context_id();
            let id = StreamId { vm, context };
            let failed = state.failed.is_some();
            state.contexts.insert(context, Context::Http(Box::new(Stream::new(id, root))));
            if let (Some(f), false) = (create, failed) {
                host.call(vm.0, context, "proxy_on_context_create", &f, (context as i32, root as i32))?;
                host.process_after_call(vm.0, None)?;
            }
            Ok(id)
        })
    }

    /// A live stream (created and not finished).
    pub fn stream(&self, stream: StreamId) -> Result<&Stream, HostError> {
        self.slot(stream.vm.0)
            .ok()
            .and_then(|slot| slot.store.data().stream(stream.context))
            .ok_or(HostError::UnknownStream(stream))
    }

    fn stream_mut(&mut self, stream: StreamId) -> Result<&mut Stream, HostError> {
        self.slot_mut(stream.vm.0)
            .ok()
            .and_then(|slot| slot.store.data_mut().stream_mut(stream.context))
            .ok_or(HostError::UnknownStream(stream))
    }

    /// Sets a property `proxy_get_property` answers in this stream's context (e.g. `source.address`
    /// as `"source\0address"`).
    pub fn set_stream_property(
        &mut self,
        stream: StreamId,
        path: impl AsRef<[u8]>,
        value: impl Into<Vec<u8>>,
    ) -> Result<(), HostError> {
        let path = path.as_ref().to_vec();
        let s = self.stream_mut(stream)?;
        s.properties.retain(|(k, _)| *k != path);
        s.properties.push((path, value.into()));
        Ok(())
    }

    /// Downstream sends the request headers (`proxy_on_request_headers`). Returns where the request
    /// direction stands afterwards (and after the events it caused, e.g. an immediate callout answer).
    pub fn send_request_headers(
        &mut self,
        stream: StreamId,
        headers: impl Into<HeaderMap>,
        end_of_stream: bool,
    ) -> Result<FlowState, HostError> {
        let headers = headers.into();
        self.top(|host| host.recv_headers(stream, Dir::Request, headers, end_of_stream))?;
        self.flow_state(stream, Dir::Request)
    }

    /// Downstream sends a request body chunk (`proxy_on_request_body`, unless the filter stopped all
    /// iteration at the headers).
    pub fn send_request_body(
        &mut self,
        stream: StreamId,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Result<FlowState, HostError> {
        self.top(|host| host.recv_body(stream, Dir::Request, chunk, end_of_stream))?;
        self.flow_state(stream, Dir::Request)
    }

    /// Downstream sends request trailers, ending the request (`proxy_on_request_trailers`).
    pub fn send_request_trailers(
        &mut self,
        stream: StreamId,
        trailers: impl Into<HeaderMap>,
    ) -> Result<FlowState, HostError> {
        let trailers = trailers.into();
        self.top(|host| host.recv_trailers(stream, Dir::Request, trailers))?;
        self.flow_state(stream, Dir::Request)
    }

    /// Upstream sends the response headers (`proxy_on_response_headers`); the request headers must
    /// have gone upstream. Ignored after a local reply or a reset.
    pub fn send_response_headers(
        &mut self,
        stream: StreamId,
        headers: impl Into<HeaderMap>,
        end_of_stream: bool,
    ) -> Result<FlowState, HostError> {
        let headers = headers.into();
        self.top(|host| host.recv_headers(stream, Dir::Response, headers, end_of_stream))?;
        self.flow_state(stream, Dir::Response)
    }

    /// Upstream sends a response body chunk (`proxy_on_response_body`).
    pub fn send_response_body(
        &mut self,
        stream: StreamId,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Result<FlowState, HostError> {
        self.top(|host| host.recv_body(stream, Dir::Response, chunk, end_of_stream))?;
        self.flow_state(stream, Dir::Response)
    }

    /// Upstream sends response trailers (`proxy_on_response_trailers`).
    pub fn send_response_trailers(
        &mut self,
        stream: StreamId,
        trailers: impl Into<HeaderMap>,
    ) -> Result<FlowState, HostError> {
        let trailers = trailers.into();
        self.top(|host| host.recv_trailers(stream, Dir::Response, trailers))?;
        self.flow_state(stream, Dir::Response)
    }

    fn flow_state(&self, stream: StreamId, dir: Dir) -> Result<FlowState, HostError> {
        Ok(self.stream(stream)?.flow(dir).state())
    }

    /// Ends the stream as Envoy does when it is destroyed: `proxy_on_done`, then (if it returned
    /// true) `proxy_on_log` (headers readable again) and `proxy_on_delete`. Returns the stream's final
    /// state; if `proxy_on_done` returned false, the context lives on until the filter calls
    /// `proxy_done` and a copy is returned.
    pub fn finish_stream(&mut self, stream: StreamId) -> Result<Stream, HostError> {
        self.top(|host| {
            let vm = stream.vm.0;
            let s = host.stream_mut(stream)?;
            if s.done {
                return Ok(s.clone());
            }
            s.done = true;
            let slot = host.slot_mut(vm)?;
            let failed = slot.store.data().failed.is_some();
            let done = match slot.exports.on_done.clone() {
                Some(f) if !failed => {
                    let done = host.call(vm, stream.context, "proxy_on_done", &f, stream.context as i32)? != 0;
                    host.process_after_call(vm, None)?;
                    done
                }
                _ => true,
            };
            if done {
                host.finalize_context(vm, stream.context)?.ok_or(HostError::UnknownStream(stream))
            } else {
                host.slot_mut(vm)?.store.data_mut().pending_done.push(stream.context);
                Ok(host.stream(stream)?.clone())
            }
        })
    }

    /// One request end to end, for tests and benchmarks: a new stream, the request (headers, body
    /// in one chunk, trailers), the upstream `response` if the request went upstream, then
    /// [`Host::finish_stream`]. Events due at the current virtual time run between the steps
    /// (immediate callout answers), the clock does not move.
    pub fn round_trip(
        &mut self,
        vm: VmId,
        request: &HttpMessage,
        response: Option<&HttpMessage>,
    ) -> Result<Stream, HostError> {
        let s = self.new_stream(vm)?;
        self.send_message(s, Dir::Request, request)?;
        if let Some(response) = response {
            let st = self.stream(s)?;
            if st.request.out_headers.is_some() && st.local_reply.is_none() && !st.reset {
                self.send_message(s, Dir::Response, response)?;
            }
        }
        self.finish_stream(s)
    }

    fn send_message(&mut self, s: StreamId, dir: Dir, message: &HttpMessage) -> Result<(), HostError> {
        let headers_only = message.body.is_empty() && message.trailers.is_none();
        self.top(|host| host.recv_headers(s, dir, message.headers.clone(), headers_only))?;
        if !message.body.is_empty() {
            self.top(|host| host.recv_body(s, dir, &message.body, message.trailers.is_none()))?;
        }
        if let Some(trailers) = &message.trailers {
            self.top(|host| host.recv_trailers(s, dir, trailers.clone()))?;
        }
        Ok(())
    }

    fn vm_failed(&self, vm: VmId) -> bool {
        self.slot(vm.0).is_ok_and(|s| s.store.data().failed.is_some())
    }

    /// Whether the direction no longer takes input (local reply, reset).
    fn ignores_input(stream: &Stream, dir: Dir) -> bool {
        stream.reset || stream.flow(dir).closed || (dir == Dir::Response && stream.local_reply.is_some())
    }

    fn recv_headers(&mut self, s: StreamId, dir: Dir, headers: HeaderMap, eos: bool) -> Result<(), HostError> {
        let failed = self.vm_failed(s.vm);
        let stream = self.stream_mut(s)?;
        if Self::ignores_input(stream, dir) {
            return Ok(());
        }
        if dir == Dir::Response && stream.request.out_headers.is_none() {
            return Err(protocol(s, "response headers before the request headers went upstream"));
        }
        let flow = stream.flow_mut(dir);
        if flow.headers_state != HeadersState::NotReceived {
            return Err(protocol(s, "headers sent twice"));
        }
        flow.headers = headers;
        flow.eos_received = eos;
        if failed {
            flow.headers_state = HeadersState::Held { stop_all: false };
            return self.fail_stream(s);
        }
        self.deliver_headers(s, dir, eos)
    }

    fn recv_body(&mut self, s: StreamId, dir: Dir, chunk: &[u8], eos: bool) -> Result<(), HostError> {
        let stream = self.stream_mut(s)?;
        if Self::ignores_input(stream, dir) {
            return Ok(());
        }
        let flow = stream.flow_mut(dir);
        if flow.headers_state == HeadersState::NotReceived {
            return Err(protocol(s, "body before headers"));
        }
        if flow.eos_received {
            return Err(protocol(s, "body after end of stream"));
        }
        if self.vm_failed(s.vm) {
            let flow = self.stream_mut(s)?.flow_mut(dir);
            flow.eos_received = eos;
            flow.pending.extend_from_slice(chunk);
            return self.fail_stream(s);
        }
        self.accept_body(s, dir, chunk, eos)
    }

    fn recv_trailers(&mut self, s: StreamId, dir: Dir, trailers: HeaderMap) -> Result<(), HostError> {
        let stream = self.stream_mut(s)?;
        if Self::ignores_input(stream, dir) {
            return Ok(());
        }
        let flow = stream.flow_mut(dir);
        if flow.headers_state == HeadersState::NotReceived {
            return Err(protocol(s, "trailers before headers"));
        }
        if flow.eos_received {
            return Err(protocol(s, "trailers after end of stream"));
        }
        if self.vm_failed(s.vm) {
            let flow = self.stream_mut(s)?.flow_mut(dir);
            flow.eos_received = true;
            flow.trailers = Some(trailers);
            flow.trailers_held = true;
            return self.fail_stream(s);
        }
        self.accept_trailers(s, dir, trailers)
    }

    /// Body data from the codec: withheld under StopAllIteration, else delivered to the filter.
    fn accept_body(&mut self, s: StreamId, dir: Dir, chunk: &[u8], eos: bool) -> Result<(), HostError> {
        let flow = self.stream_mut(s)?.flow_mut(dir);
        flow.eos_received = eos;
        if flow.headers_state == (HeadersState::Held { stop_all: true }) {
            flow.unseen_body.extend_from_slice(chunk);
            flow.unseen_body_event = true;
            return Ok(());
        }
        self.deliver_body(s, dir, chunk, eos)
    }

    fn accept_trailers(&mut self, s: StreamId, dir: Dir, trailers: HeaderMap) -> Result<(), HostError> {
        let flow = self.stream_mut(s)?.flow_mut(dir);
        flow.eos_received = true;
        if flow.headers_state == (HeadersState::Held { stop_all: true }) {
            flow.unseen_trailers = Some(trailers);
            return Ok(());
        }
        self.deliver_trailers(s, dir, trailers)
    }

    fn deliver_headers(&mut self, s: StreamId, dir: Dir, eos: bool) -> Result<(), HostError> {
        let allow_stop_iteration = self.slot(s.vm.0)?.store.data().allow_on_headers_stop_iteration;
        let flow = self.stream_mut(s)?.flow_mut(dir);
        flow.headers_state = HeadersState::Held { stop_all: false };
        flow.headers_released = false;
        let count = flow.headers.len();
        let verdict = self.http_cb(s, dir, Cb::Headers, count, eos)?;
        let Ok(stream) = self.stream_mut(s) else { return Ok(()) };
        let flow = stream.flow_mut(dir);
        match verdict {
            Verdict::Closed => {}
            Verdict::Continue => {
                flow.forward_headers();
                flow.update_complete();
            }
            Verdict::Pause => flow.headers_state = HeadersState::Held { stop_all: !allow_stop_iteration },
            Verdict::StopAll => flow.headers_state = HeadersState::Held { stop_all: true },
        }
        Ok(())
    }

    fn deliver_body(&mut self, s: StreamId, dir: Dir, chunk: &[u8], eos: bool) -> Result<(), HostError> {
        let flow = self.stream_mut(s)?.flow_mut(dir);
        flow.pending.extend_from_slice(chunk);
        let size = flow.pending.len();
        let verdict = self.http_cb(s, dir, Cb::Body, size, eos)?;
        let Ok(stream) = self.stream_mut(s) else { return Ok(()) };
        let flow = stream.flow_mut(dir);
        match verdict {
            Verdict::Closed => {}
            Verdict::Continue => {
                flow.forward_headers();
                flow.forward_body();
                flow.update_complete();
            }
            Verdict::Pause | Verdict::StopAll => flow.body_paused = true,
        }
        Ok(())
    }

    fn deliver_trailers(&mut self, s: StreamId, dir: Dir, trailers: HeaderMap) -> Result<(), HostError> {
        let flow = self.stream_mut(s)?.flow_mut(dir);
        let count = trailers.len();
        flow.trailers = Some(trailers);
        flow.trailers_held = true;
        let verdict = self.http_cb(s, dir, Cb::Trailers, count, false)?;
        let Ok(stream) = self.stream_mut(s) else { return Ok(()) };
        let flow = stream.flow_mut(dir);
        if verdict == Verdict::Continue {
            flow.forward_headers();
            flow.forward_body();
            flow.forward_trailers();
            flow.update_complete();
        }
        Ok(())
    }

    /// Calls one HTTP callback of the stream, runs the work it deferred, and says how the filter
    /// manager takes the result.
    fn http_cb(&mut self, s: StreamId, dir: Dir, cb: Cb, size: usize, eos: bool) -> Result<Verdict, HostError> {
        let vm = s.vm.0;
        let ctx = s.context as i32;
        let epoch = self.stream(s)?.epoch;
        let exports = &self.slot(vm)?.exports;
        let (name, three, two) = match (dir, cb) {
            (Dir::Request, Cb::Headers) => ("proxy_on_request_headers", exports.on_request_headers.clone(), None),
            (Dir::Request, Cb::Body) => ("proxy_on_request_body", exports.on_request_body.clone(), None),
            (Dir::Request, Cb::Trailers) => ("proxy_on_request_trailers", None, exports.on_request_trailers.clone()),
            (Dir::Response, Cb::Headers) => ("proxy_on_response_headers", exports.on_response_headers.clone(), None),
            (Dir::Response, Cb::Body) => ("proxy_on_response_body", exports.on_response_body.clone(), None),
            (Dir::Response, Cb::Trailers) => ("proxy_on_response_trailers", None, exports.on_response_trailers.clone()),
        };
        let result = match (three, two) {
            (Some(f), _) => Some(self.call(vm, s.context, name, &f, (ctx, len_arg(size), i32::from(eos)))),
            (None, Some(f)) => Some(self.call(vm, s.context, name, &f, (ctx, len_arg(size)))),
            (None, None) => None,
        };
        let code = match result {
            None => None,
            Some(Ok(code)) => Some(code),
            Some(Err(e)) => {
                if matches!(e, HostError::Trap { .. }) {
                    self.fail_stream(s)?;
                }
                return Err(e);
            }
        };
        let stop = self.slot(vm)?.store.data().stop_next_iteration;
        if let Ok(stream) = self.stream_mut(s) {
            if stream.callbacks.len() < CALLBACK_HISTORY {
                stream.callbacks.push(CallbackRecord {
                    callback: name,
                    size,
                    end_of_stream: eos,
                    action: code.map(action_of),
                });
            }
        }
        self.process_after_call(vm, Some((s.context, dir)))?;
        let Ok(stream) = self.stream(s) else { return Ok(Verdict::Closed) };
        if stream.epoch != epoch || stream.reset || stream.flow(dir).closed {
            return Ok(Verdict::Closed);
        }
        Ok(match code.map(action_of) {
            None | Some(Action::Continue) if !stop => Verdict::Continue,
            Some(Action::Pause) if !stop => Verdict::Pause,
            Some(Action::Other(value)) if !stop => {
                self.shared.borrow_mut().violation(
                    s.vm,
                    s.context,
                    name,
                    format!("returned {value}, not an ABI action"),
                );
                Verdict::StopAll
            }
            _ => Verdict::StopAll,
        })
    }

    /// `proxy_continue_stream`, run after the callback that asked for it.
    pub(crate) fn resume(&mut self, s: StreamId, dir: Dir) -> Result<(), HostError> {
        let Ok(stream) = self.stream_mut(s) else { return Ok(()) };
        let flow = stream.flow_mut(dir);
        let paused = !flow.closed
            && !flow.complete
            && match flow.headers_state {
                HeadersState::NotReceived => false,
                HeadersState::Held { .. } => true,
                HeadersState::Forwarded => flow.body_paused || flow.trailers_held,
            };
        if !paused {
            let message = format!("{dir:?} is not paused ({:?}): nothing to continue", flow.state());
            self.shared.borrow_mut().violation(s.vm, s.context, "proxy_continue_stream", message);
            return Ok(());
        }
        if flow.headers_state == (HeadersState::Held { stop_all: true }) {
            // Envoy's StopAllIteration: the headers go on, then the withheld data reaches the
            // filter first.
            flow.forward_headers();
            let body = std::mem::take(&mut flow.unseen_body);
            let had_body = std::mem::take(&mut flow.unseen_body_event);
            let trailers = flow.unseen_trailers.take();
            let body_eos = flow.eos_received && trailers.is_none();
            flow.update_complete();
            if had_body {
                self.deliver_body(s, dir, &body, body_eos)?;
            }
            if let Some(trailers) = trailers {
                if self.stream(s).is_ok_and(|st| !Self::ignores_input(st, dir)) {
                    self.deliver_trailers(s, dir, trailers)?;
                }
            }
            return Ok(());
        }
        flow.forward_headers();
        flow.forward_body();
        flow.forward_trailers();
        flow.update_complete();
        Ok(())
    }

    /// `proxy_close_stream`: the stream is reset.
    pub(crate) fn reset_stream(&mut self, s: StreamId) {
        if let Ok(stream) = self.stream_mut(s) {
            stream.reset = true;
            stream.epoch += 1;
            stream.request.closed = true;
            stream.response.closed = true;
        }
    }

    /// `proxy_send_local_response`, run after the callback that sent it.
    pub(crate) fn local_reply(&mut self, s: StreamId, reply: LocalReply) -> Result<(), HostError> {
        let failed = self.vm_failed(s.vm);
        let Ok(stream) = self.stream_mut(s) else { return Ok(()) };
        if stream.reset {
            return Ok(());
        }
        stream.epoch += 1;
        if stream.response.out_headers.is_some() && !stream.encoding_local_reply {
            // Response headers already went downstream: all Envoy can do is reset the stream.
            stream.local_reply = Some(reply);
            stream.reset = true;
            stream.request.closed = true;
            stream.response.closed = true;
            return Ok(());
        }
        let mut headers = HeaderMap::from([(":status", reply.status.to_string())]);
        if !reply.body.is_empty() {
            headers.append("content-length", reply.body.len().to_string());
            headers.append("content-type", "text/plain");
        }
        for (k, v) in reply.headers.iter() {
            headers.append(k, v);
        }
        let body = reply.body.clone();
        let direct = stream.encoding_local_reply || failed;
        stream.local_reply = Some(reply);
        if !stream.request.complete {
            stream.request.closed = true;
        }
        stream.response = Flow { headers, ..Flow::default() };
        if direct {
            // A reply while a reply is being encoded (or from a failed VM) bypasses the filter.
            let flow = &mut stream.response;
            flow.eos_received = true;
            flow.pending = body;
            flow.forward_headers();
            flow.forward_body();
            flow.complete = true;
            return Ok(());
        }
        stream.encoding_local_reply = true;
        stream.response.eos_received = body.is_empty();
        let epoch = stream.epoch;
        let mut result = self.deliver_headers(s, Dir::Response, body.is_empty());
        if result.is_ok() && !body.is_empty() && self.stream(s).is_ok_and(|st| st.epoch == epoch && !st.response.closed)
        {
            result = self.accept_body(s, Dir::Response, &body, true);
        }
        if let Ok(stream) = self.stream_mut(s) {
            stream.encoding_local_reply = false;
        }
        result
    }

    /// The VM failed: fail open (pass through) or answer 503 `wasm_fail_stream`, as Envoy does.
    fn fail_stream(&mut self, s: StreamId) -> Result<(), HostError> {
        let fail_open = self.slot(s.vm.0)?.store.data().fail_open;
        let Ok(stream) = self.stream_mut(s) else { return Ok(()) };
        stream.failed = true;
        if fail_open {
            stream.request.pass_through();
            stream.response.pass_through();
            return Ok(());
        }
        if stream.local_reply.is_some() || stream.reset {
            return Ok(());
        }
        self.local_reply(
            s,
            LocalReply {
                status: 503,
                details: "wasm_fail_stream".into(),
                body: Vec::new(),
                headers: HeaderMap::new(),
                grpc_status: 14,
            },
        )
    }
}

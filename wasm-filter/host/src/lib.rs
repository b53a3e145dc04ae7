//! A test host for proxy-wasm filters: Envoy's side of **proxy-wasm ABI 0.2.1**, on wasmtime, with
//! a virtual clock. It runs the kvroute Envoy filter (`wasm-filter/`, `kvroute_filter.wasm`) in
//! tests and benchmarks where no Envoy binary can be installed.
//!
//! # Model
//!
//! | Envoy | here |
//! | --- | --- |
//! | the proxy process (shared data, shared queues, clusters, stats, time) | [`Host`] |
//! | one worker thread's copy of the plugin (a wasm VM with its root context) | a VM ([`VmId`]), one wasmtime `Store`/`Instance` of a compiled [`Plugin`] |
//! | one HTTP request/response through the filter | a stream ([`StreamId`], observed as [`Stream`]) |
//! | an upstream cluster answering `dispatch_http_call` | a cluster handler ([`HostBuilder::cluster`]) |
//! | timers, time | a virtual clock moved by [`Host::advance`] |
//!
//! The host is single-threaded and deterministic. Work Envoy posts to a worker thread (queue
//! wake-ups, callout answers, `proxy_continue_stream`) runs after the callback that caused it:
//! queue wake-ups and callout answers without delay run at the end of the host operation that caused
//! them; delayed answers and ticks run when [`Host::advance`] reaches their time. Nothing runs
//! re-entrantly inside a guest callback.
//!
//! # Example
//!
//! ```
//! use kvroute_wasm_host::{Host, HttpMessage, VmConfig};
//!
//! // A filter that adds `x-seen: 1` to every request (any wasm module or WAT text works).
//! const FILTER: &str = r#"(module
//!   (import "env" "proxy_add_header_map_value" (func $add (param i32 i32 i32 i32 i32) (result i32)))
//!   (memory (export "memory") 1)
//!   (data (i32.const 16) "x-seen1")
//!   (global $heap (mut i32) (i32.const 1024))
//!   (func (export "proxy_abi_version_0_2_1"))
//!   (func (export "proxy_on_memory_allocate") (param $n i32) (result i32)
//!     (global.get $heap)
//!     (global.set $heap (i32.add (global.get $heap) (local.get $n))))
//!   (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
//!     (drop (call $add (i32.const 0) (i32.const 16) (i32.const 6) (i32.const 22) (i32.const 1)))
//!     (i32.const 0)))"#;
//!
//! let mut host = Host::new()?;
//! let plugin = host.compile(FILTER)?;
//! let vm = host.start_vm(&plugin, VmConfig::new().plugin_configuration(b"{}".to_vec()))?;
//! let request = HttpMessage::post_json("api.local", "/v1/completions", r#"{"prompt":"hi"}"#);
//! let stream = host.round_trip(vm, &request, Some(&HttpMessage::response(200, "ok")))?;
//! assert_eq!(stream.upstream_headers().and_then(|h| h.get("x-seen")), Some("1"));
//! assert_eq!(stream.downstream_status(), Some(200));
//! assert!(host.abi_violations().is_empty());
//! # Ok::<(), kvroute_wasm_host::HostError>(())
//! ```
//!
//! # Running the kvroute filter
//!
//! [`Host::load_kvroute_filter`] returns the compiled filter: it runs `cargo build -p kvroute-wasm
//! --target wasm32-wasip1 --profile wasm-release` (a no-op when up to date) and loads
//! `target/wasm32-wasip1/wasm-release/kvroute_filter.wasm`; `$KVROUTE_FILTER_WASM` points it at
//! another file, `$KVROUTE_FILTER_NO_BUILD` skips the build. The compiled module is cached for the
//! process, so every test can load it cheaply:
//!
//! ```no_run
//! use kvroute_wasm_host::{CalloutReply, Host, HttpMessage, VmConfig};
//! use std::time::Duration;
//!
//! let mut host = Host::builder()
//!     .cluster("kvroute-metrics", |req| CalloutReply::ok("vllm:num_requests_waiting 0\n").after(Duration::from_millis(3)))
//!     .build()?;
//! let filter = host.load_kvroute_filter()?;
//! let config = VmConfig::new().vm_id("kvroute").root_id("kvroute").plugin_name("kvroute")
//!     .plugin_configuration(std::fs::read("fixtures/envoy-plugin.json").unwrap_or_default());
//! let workers = [host.start_vm(&filter, config.clone())?, host.start_vm(&filter, config)?];
//! host.advance(Duration::from_secs(1))?;            // ticks on both VMs, callouts answered
//! let s = host.new_stream(workers[0])?;
//! host.send_request_headers(s, [(":method", "POST"), (":path", "/v1/completions"), (":authority", "api")], false)?;
//! host.send_request_body(s, br#"{"model":"m","prompt":"hello"}"#, true)?;
//! let upstream = host.stream(s)?.upstream_headers().cloned();
//! let done = host.finish_stream(s)?;
//! # Ok::<(), kvroute_wasm_host::HostError>(())
//! ```
//!
//! # VM lifecycle
//!
//! [`Host::start_vm`]: the imports are checked (a module importing anything this host — like
//! Envoy — does not provide fails with [`HostError::MissingImport`]); the module must export
//! `memory`, `proxy_abi_version_0_2_1` and `proxy_on_memory_allocate` (or `malloc`). Then
//! `_initialize` (+ `main` if exported) or `_start` runs (only logging, clocks and WASI are
//! allowed there, as in Envoy; any other hostcall traps), the root context is created
//! (`proxy_on_context_create(root, 0)`; `PLUGIN_CONFIGURATION` readable), `proxy_on_vm_start(root,
//! vm_configuration_size)` and `proxy_on_configure(root, plugin_configuration_size)`. False from
//! either is [`HostError::VmStartRejected`] / [`HostError::ConfigureRejected`].
//!
//! [`Host::reconfigure`] does what Envoy does on a configuration update: a *new* root context in
//! the same VM (create, vm_start, configure); accepted → new streams use it and the old root is
//! retired (`proxy_on_done`, `proxy_on_delete`); refused → `Ok(false)` and the old root keeps
//! serving. [`Host::configure_again`] calls `proxy_on_configure` again on the current root instead.
//! [`Host::shutdown_vm`] retires the root context. `proxy_on_done` returning false defers
//! `proxy_on_delete` until the filter calls `proxy_done`.
//!
//! A trap (a filter panic with `panic = "abort"`, an out-of-bounds access, fuel exhausted) returns
//! [`HostError::Trap`] from the host call that ran it (with the guest backtrace and the last error
//! line the guest logged — the SDK logs a panic's message) and marks the VM failed, as Envoy does:
//! its ticks, queue wake-ups and callout answers are dropped, its streams fail closed (503,
//! details `wasm_fail_stream`) or pass through untouched with [`VmConfig::fail_open`], and other
//! operations on it answer [`HostError::VmFailed`]. Other VMs are unaffected.
//!
//! # Streams
//!
//! [`Host::new_stream`] creates the context (`proxy_on_context_create(ctx, root)`); then the test
//! plays downstream and upstream: [`Host::send_request_headers`] (with the pseudo-headers
//! `:method`, `:path`, `:authority`, `:scheme`), [`Host::send_request_body`] (chunks,
//! `end_of_stream`), [`Host::send_request_trailers`], and the same for the response once the
//! request headers went upstream. Each returns the direction's [`FlowState`]; [`Host::stream`]
//! shows everything: what went upstream ([`Stream::request`]: headers with what the filter set,
//! body, trailers), what went downstream ([`Stream::response`]), the [`LocalReply`], resets, and
//! every callback with the action it returned. [`Host::finish_stream`] ends the stream
//! (`proxy_on_done`, `proxy_on_log`, `proxy_on_delete`) and returns its final state;
//! [`Host::round_trip`] does a whole exchange in one call.
//!
//! How return values are taken is described in the `flow` module: Continue forwards, Pause holds;
//! Pause from `proxy_on_request_headers` is StopIteration (body still delivered) with
//! [`VmConfig::allow_on_headers_stop_iteration`] (default `true` here; Envoy's default is `false`,
//! Envoy ≥ 1.35 needs it set for body-based routing), else StopAllIteration (the body reaches the
//! filter only after `proxy_continue_stream`). Request headers are readable and writable only while
//! the filter holds them: once they went upstream (a Continue, or `proxy_continue_stream`, which
//! drops them at once as Envoy does), `proxy_get_header_map_value`, `proxy_*_header_map_value` and
//! `proxy_set_header_map_pairs` answer **BadArgument** (the Rust SDK panics on that) and an
//! [`AbiViolation`] is recorded; `proxy_get_header_map_pairs` answers an empty map. They are
//! readable again in `proxy_on_log`. The same holds for response headers and trailers.
//! `proxy_send_local_response` ends the request, makes the running callback a full stop and sends
//! the reply downstream through the filter's own response callbacks (Envoy's
//! `sendLocalReplyViaFilterChain`; `:status`, and `content-length`/`content-type: text/plain` when
//! there is a body, come first); after response headers went downstream it resets the stream.
//! `proxy_continue_stream` / `proxy_close_stream` / `proxy_send_local_response` act on the
//! *effective* context, so a filter can resume or answer a paused stream from
//! `proxy_on_http_call_response` or `proxy_on_queue_ready` after `proxy_set_effective_context`.
//! A continue of a stream's own direction from inside that direction's callback has no effect
//! (Envoy ignores it too; the return value decides).
//!
//! # Shared state
//!
//! - **Shared data** is namespaced by [`VmConfig::vm_id`] as in Envoy. `proxy_get_shared_data`
//!   returns (value, cas); `proxy_set_shared_data` with cas 0 writes unconditionally, with a
//!   non-zero cas only if it matches (else CasMismatch); a new key is written whatever the cas.
//!   Every write gets a new cas from one host-wide counter that starts at 1 and skips 0.
//!   [`Host::force_cas_mismatch`] injects conflicting writes to test retry loops;
//!   [`Host::shared_data`] / [`Host::set_shared_data`] read and write from the test.
//! - **Shared queues**: `proxy_register_shared_queue(name)` creates or opens `(vm_id, name)` and
//!   makes the registering VM's root context the single consumer (the *last* registrant wins);
//!   `proxy_resolve_shared_queue(vm_id, name)` finds it (empty vm_id: the caller's);
//!   `proxy_enqueue_shared_queue` appends and schedules one `proxy_on_queue_ready(root, token)` on
//!   the consumer; any VM may dequeue (Empty when empty). [`Host::enqueue`] feeds a queue from the test.
//! - **Ticks**: `proxy_set_tick_period_milliseconds` (0 disables) arms a timer per root context;
//!   [`Host::advance`] calls `proxy_on_tick` each time a period elapses, in time order across VMs.
//! - **HTTP callouts**: `proxy_http_call` needs a registered cluster and `:method`, `:path`,
//!   `:authority` (else BadArgument, recorded as a violation); the cluster handler sees a
//!   [`CalloutRequest`] (also kept in [`Host::callouts`]) and returns a [`CalloutReply`] (status,
//!   headers, body, trailers, delay, or a reset). The answer is delivered to
//!   `proxy_on_http_call_response(root, token, headers, body_size, trailers)` of the root context
//!   that dispatched it (Envoy dispatches callouts from the root context; the SDK then switches to
//!   the calling stream with `proxy_set_effective_context`), with `HTTP_CALL_RESPONSE_HEADERS`,
//!   `_BODY` and `_TRAILERS` readable; a reset gives 0 headers and `proxy_get_status` =
//!   (BrokenConnection 11, "reset"); a delay beyond the call's timeout gives Envoy's 504
//!   `upstream request timeout` at the timeout.
//! - **Properties**: `plugin_name`, `plugin_root_id`, `plugin_vm_id`; in a stream `request.path`,
//!   `request.url_path`, `request.method`, `request.host`, `request.scheme`, `request.id`,
//!   `request.protocol`, `request.headers.<name>`, `response.code` (int64 LE),
//!   `response.headers.<name>`; whatever [`VmConfig::property`] and [`Host::set_stream_property`]
//!   add; `proxy_set_property` in a stream (root context: NotFound). Unknown paths: NotFound.
//! - **Logs** (`proxy_log`, stdout → Info, stderr → Error) are captured per VM and context with the
//!   virtual time ([`Host::logs`]); **metrics** (`proxy_define_metric` & co., Envoy's id scheme and
//!   counter/gauge/histogram rules) are shared by name ([`Host::metric`]).
//! - **Time**: `proxy_get_current_time_nanoseconds` and WASI `clock_time_get` (realtime and
//!   monotonic) read the virtual clock ([`DEFAULT_START_TIME_NS`] unless set). WASI `random_get`
//!   is deterministic.
//!
//! # Hostcalls
//!
//! Implemented (module `env`): `proxy_log`, `proxy_get_log_level`,
//! `proxy_get_current_time_nanoseconds`, `proxy_set_tick_period_milliseconds`,
//! `proxy_get_buffer_status`, `proxy_get_buffer_bytes`, `proxy_set_buffer_bytes`,
//! `proxy_get_header_map_pairs`, `proxy_set_header_map_pairs`, `proxy_get_header_map_size`,
//! `proxy_get_header_map_value`, `proxy_add_header_map_value`, `proxy_replace_header_map_value`,
//! `proxy_remove_header_map_value`, `proxy_get_property`, `proxy_set_property`,
//! `proxy_get_shared_data`, `proxy_set_shared_data`, `proxy_register_shared_queue`,
//! `proxy_resolve_shared_queue`, `proxy_enqueue_shared_queue`, `proxy_dequeue_shared_queue`,
//! `proxy_continue_stream`, `proxy_close_stream`, `proxy_send_local_response`, `proxy_http_call`,
//! `proxy_get_status`, `proxy_set_effective_context`, `proxy_done`, `proxy_define_metric`,
//! `proxy_increment_metric`, `proxy_record_metric`, `proxy_get_metric`,
//! `proxy_call_foreign_function` (no functions registered: NotFound). Module
//! `wasi_snapshot_preview1` (and `wasi_unstable`): the set Envoy provides, with Envoy's answers —
//! `fd_write`/`fd_pwrite` to stdout/stderr, `clock_time_get`, `clock_res_get`, `random_get`,
//! `environ_*` and `args_*` (empty), `fd_fdstat_get`, `poll_oneoff`, `sched_yield`, and stubs for
//! the file and socket calls; `proc_exit` traps.
//!
//! Not implemented: `proxy_grpc_call`, `proxy_grpc_stream`, `proxy_grpc_send`,
//! `proxy_grpc_cancel`, `proxy_grpc_close` answer **Unimplemented** (12); TCP streams and their
//! buffers (`DOWNSTREAM_DATA`, `UPSTREAM_DATA`), gRPC buffers and maps answer NotFound /
//! BadArgument / an empty map. ABI 0.1.0/0.2.0-only imports are not provided (as in Envoy for a
//! 0.2.1 module).
//!
//! # Fault injection
//!
//! [`Host::inject_fault`] makes any `env.proxy_*` import ([`PROXY_IMPORTS`]) answer any status
//! ([`Fault`]: every call, the k-th call, or from the k-th call on, counted over all VMs) without
//! doing its work, as a host that refuses the call would; [`Host::hostcall_count`] counts each
//! import's calls. A filter that traps on such a status shows as [`HostError::Trap`] and
//! [`Host::failure`]. The startup guard comes first: a call refused during `_initialize` still traps.
//!
//! # Safety against the guest
//!
//! The guest is untrusted input. Every pointer/size pair is checked against its linear memory
//! (InvalidMemoryAccess, WASI `EFAULT`, and an [`AbiViolation`]); serialized maps are parsed
//! strictly (a malformed one is taken as empty, as Envoy does, and recorded); values are returned
//! through the guest's own allocator, whose answer is checked. Memory is limited
//! ([`HostBuilder::memory_limit`], 1 GiB like Envoy) and execution can be metered
//! ([`HostBuilder::fuel_per_call`]). Guest behaviour never panics the host; traps are errors.
//! [`Host::abi_violations`] lists what a filter did wrong even where the ABI only answers a
//! status — a good final assertion of every filter test.
//!
//! # Benchmarks
//!
//! Time [`Host::round_trip`] (or a hand-driven stream) around `Instant::now()`; with a compiled
//! [`Plugin`] and a started VM, it measures the filter's callbacks plus the host's ABI work (map
//! serialization, memory copies) — an upper bound of the in-Envoy cost. [`Host::memory_size`]
//! before and after many requests shows leaks. With `$KVROUTE_HOST_PERFMAP` set, wasmtime writes
//! the JIT symbol map `perf` reads, so `perf record` / `perf report` show guest functions by name
//! (for a module built with its name section, e.g. `CARGO_PROFILE_WASM_RELEASE_STRIP=false`).

pub mod abi;
mod error;
mod fast_map;
mod faults;
mod filter;
mod flow;
mod headers;
mod host;
mod hostcalls;
mod state;
mod types;

pub use abi::{Action, LogLevel, Status};
pub use error::HostError;
pub use faults::{Fault, PROXY_IMPORTS};
pub use filter::{kvroute_filter_wasm_path, FILTER_NO_BUILD_ENV, FILTER_WASM_ENV};
pub use headers::HeaderMap;
pub use host::{
    Host, HostBuilder, Plugin, DEFAULT_HISTORY_CAP, DEFAULT_MEMORY_LIMIT, DEFAULT_START_TIME_NS, EVENT_STORM_LIMIT,
};
pub use types::{
    AbiViolation, CallbackRecord, CalloutReply, CalloutRequest, Flow, FlowState, HttpMessage, LocalReply, LogEntry,
    MetricValue, Stream, StreamId, VmConfig, VmId,
};

//! # kvroute-wasm
//!
//! The Envoy proxy-wasm HTTP filter of kvroute: KV-cache-aware routing inside the proxy. It is an
//! adapter: every routing decision is made by the core: each VM (one per Envoy worker thread,
//! single-threaded) holds a [`kvroute::RouterCore`] directly, with no lock. The filter buffers
//! the request body, asks the core, and sets the destination headers the fleet cluster's
//! `override_host` load-balancing policy follows (`x-gateway-destination-endpoint`, `x-prefiller-host-port`,
//! `x-kvroute-mode`), or answers 429 when the core sheds. With the core's flow control on, a
//! request the core queues stays paused until its release (routed then, or answered with the
//! core's status and `x-llm-d-request-dropped-reason`), and the VMs order their queues against
//! each other through the replicated log.
//!
//! Around the core it adds what only a proxy can do:
//! - [`config`]: the plugin configuration (the core policy JSON plus a `filter` section);
//! - [`sync`]: a replicated log in shared data, so the per-worker VMs share routing state;
//! - metric polling through HTTP callouts by one elected VM;
//! - [`ingest`]: authenticated KV-event ingestion (batches POSTed by `kvroute-relay`);
//!
//! Build: `cargo build -p kvroute-wasm --target wasm32-wasip1 --profile wasm-release`, which
//! writes `target/wasm32-wasip1/wasm-release/kvroute_filter.wasm`. `wasm-filter/README.md` is
//! the operator guide; `wasm-filter/envoy.yaml` a complete Envoy configuration.
//!
//! The pure parts (configuration, log protocol, ingestion protocol, counters) build and
//! are unit-tested natively; the proxy-wasm glue exists only on wasm32 and is tested through the
//! wasmtime host in `wasm-filter/tests`. The glue is the filter's own (module `host`: the ABI
//! imports and exports, no proxy-wasm SDK), so that no hostcall status can trap the VM.

pub mod config;
pub mod counters;
pub mod ingest;
pub mod sync;

#[cfg(target_arch = "wasm32")]
mod filter;
#[cfg(target_arch = "wasm32")]
mod host;
mod host_map;

/// Run once by the module's `_initialize` (in [`host`]): registers the root context factory.
#[cfg(target_arch = "wasm32")]
fn init() {
    host::set_root_context(|id| -> Box<dyn host::RootContext> { Box::new(filter::Root::new(id)) });
}

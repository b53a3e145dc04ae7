//! The host's error type.

use crate::{StreamId, VmId};

/// Everything that can go wrong in the host. Guest misbehaviour never panics the host: a trap, an
/// invalid module or a refused configuration comes back as one of these.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HostError {
    /// wasmtime could not be set up or could not compile the module.
    #[error("wasm module: {0}")]
    Compile(String),
    /// The module imports something this host (like Envoy) does not provide.
    #[error("wasm module imports {module}.{name}, which the host does not provide")]
    MissingImport {
        /// Import module (`env`, `wasi_snapshot_preview1`, ...).
        module: String,
        /// Import name.
        name: String,
    },
    /// The module does not export `proxy_abi_version_0_2_1`, or exports a callback with the wrong type.
    #[error("wasm module is not a proxy-wasm 0.2.1 module: {0}")]
    Abi(String),
    /// Instantiating the module failed (e.g. a start function trapped).
    #[error("instantiating the wasm module: {0}")]
    Instantiate(String),
    /// The guest trapped (a panic in the filter with `panic = "abort"`, an out-of-bounds access, a
    /// hostcall refused at start-up, fuel exhausted, ...). The VM is marked failed, as Envoy does.
    #[error("{vm}: the guest trapped in {function}: {message}")]
    Trap {
        /// The VM.
        vm: VmId,
        /// The export that was running (`proxy_on_request_headers`, ...).
        function: String,
        /// wasmtime's trap message with the guest backtrace, and the last critical/error log line of
        /// the VM (the SDK logs a panic's message before aborting).
        message: String,
    },
    /// An operation on a VM that trapped earlier (Envoy keeps such a VM out of service).
    #[error("{0} failed earlier and is out of service")]
    VmFailed(VmId),
    /// `proxy_on_vm_start` returned false.
    #[error("{0}: proxy_on_vm_start returned false (VM configuration rejected)")]
    VmStartRejected(VmId),
    /// `proxy_on_configure` returned false when the VM was started.
    #[error("{0}: proxy_on_configure returned false (plugin configuration rejected)")]
    ConfigureRejected(VmId),
    /// No VM with this id.
    #[error("no VM {0}")]
    UnknownVm(VmId),
    /// No live stream with this id (never created, or already finished).
    #[error("no stream {0}")]
    UnknownStream(StreamId),
    /// The test drove a stream out of HTTP order (body before headers, headers twice, a response
    /// before the request went upstream, data after end of stream, ...).
    #[error("{stream}: {message}")]
    Protocol {
        /// The stream.
        stream: StreamId,
        /// What was wrong.
        message: String,
    },
    /// Events kept scheduling more events at the same virtual instant (e.g. a queue consumer that
    /// enqueues into its own queue); the host stops after a fixed number.
    #[error("more than {0} events at one virtual instant: the guests keep waking each other up")]
    EventStorm(usize),
    /// [`crate::Host::inject_fault`] was given a name that is not one of [`crate::PROXY_IMPORTS`].
    #[error("no hostcall {0} to inject a fault into")]
    UnknownImport(String),
    /// Finding or building the kvroute filter wasm failed.
    #[error("kvroute filter wasm: {0}")]
    Filter(String),
    /// Reading a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
}

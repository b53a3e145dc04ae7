//! # kvroute-py
//!
//! The native module `kvroute._native` of the Python package `kvroute` (built by maturin as an
//! abi3 wheel for CPython ≥ 3.10). The pure-Python package `kvroute` (py/python/kvroute)
//! re-exports it and defines the exception classes.
//!
//! Every function here is an adapter: convert the Python inputs, make one core call with the
//! GIL released (`Python::detach`), convert the result back. No scoring, threshold or mode
//! logic lives here.
//!
//! - `Router` (src/router.rs) wraps an `Arc<kvroute::Router>` (`Send + Sync`) in a frozen pyclass, so
//!   Python threads share it without any lock of the binding's own;
//! - `Decision` (src/decision.rs) wraps the core `Decision`; its Python views (headers, scores, …) are
//!   built only when accessed, so `route()` costs one core call and one object allocation;
//! - `Admission`, `Rejection`, `Release` (src/flow.rs) carry flow control's answers; the router
//!   is driven either with tickets (`enqueue` / `take_releases` / `cancel`) or by
//!   `await router.admit(...)`, whose dispatcher (pure Python, `kvroute._flow`) holds a future per
//!   queued ticket and is called at every dispatch opportunity;
//! - `Subscription` (src/subscription.rs) runs the core's ZMQ subscriber: a native thread that feeds
//!   KV events to the router with no Python on the way;
//! - `Replication` (src/replication.rs) runs the core's NATS replica transport (`Router.replicate`):
//!   a native thread that publishes the router's replica batches and applies the fleet's, with
//!   no Python on the way;
//! - `simulate` (src/sim.rs) exposes the trace simulator of `kvroute-sim`.

mod convert;
mod decision;
mod errors;
mod flow;
mod policy;
mod replication;
mod router;
mod sim;
mod subscription;

use pyo3::prelude::*;

/// Milliseconds since the UNIX epoch: the clock every `now` argument defaults to, shared with
/// the ZMQ subscriber (`kvroute::unix_clock`).
#[pyfunction]
fn now_ms() -> u64 {
    kvroute::unix_time_ms()
}

/// The module `kvroute._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<router::Router>()?;
    m.add_class::<policy::Policy>()?;
    m.add_class::<decision::Decision>()?;
    m.add_class::<decision::Shed>()?;
    m.add_class::<decision::Judgment>()?;
    m.add_class::<decision::TransferEstimate>()?;
    m.add_class::<decision::EndpointScore>()?;
    m.add_class::<decision::ApplyOutcome>()?;
    m.add_class::<subscription::Subscription>()?;
    m.add_class::<replication::Replication>()?;
    m.add_class::<flow::Admission>()?;
    m.add_class::<flow::Rejection>()?;
    m.add_class::<flow::Release>()?;
    m.add("HEADER_DROPPED_REASON", kvroute::HEADER_DROPPED_REASON)?;
    m.add_class::<sim::SimulationResult>()?;
    m.add_function(wrap_pyfunction!(now_ms, m)?)?;
    m.add_function(wrap_pyfunction!(sim::simulate, m)?)?;
    Ok(())
}

//! Flow control's value classes (`Admission`, `Rejection`, `Release`) and the hold on the
//! Python side of a router's queued requests.
//!
//! The core decides everything (admit, queue, reject, which ticket is released and why); these
//! classes only carry its answers. A router is driven in one of two ways, chosen by its first
//! flow call and kept for its life ([`FlowHold::claim`]):
//!
//! - **tickets**: the caller uses `enqueue` / `take_releases` / `cancel` itself (as the golden
//!   flow replay does);
//! - **awaitable**: `await router.admit(...)`; the pure-Python dispatcher `kvroute._flow` holds
//!   a future per queued ticket, takes the releases itself at every dispatch opportunity (the
//!   router calls it after `complete`, metrics updates, endpoint changes, reloads, `tick` and
//!   `shutdown_queue`) and on a timer.
//!
//! Mixing them would hand releases to a party that does not hold the ticket, so the second way
//! is refused with `RuntimeError` once the first is in use.

use std::sync::atomic::{AtomicU8, Ordering};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;

use crate::convert::repr_str;

/// Why flow control refused or dropped a request: answer `status` with the header
/// `x-llm-d-request-dropped-reason: reason` (`header`, `headers`).
#[pyclass(frozen, eq, hash, get_all, module = "kvroute", name = "Rejection")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Rejection {
    /// HTTP status to answer with: 429, or 503 (no endpoints, shutting down).
    status: u16,
    /// The reason, as sent in `x-llm-d-request-dropped-reason` (`"rejected-saturated"`, …).
    reason: &'static str,
    /// The reason's stable number (1 `rejected-saturated` … 6 `evicted-queue-pressure`).
    code: u8,
}

impl Rejection {
    pub(crate) fn new(r: &kvroute::Rejection) -> Self {
        Rejection { status: r.status, reason: r.reason.as_str(), code: r.reason.code() }
    }
}

#[pymethods]
impl Rejection {
    /// The response header: `("x-llm-d-request-dropped-reason", reason)`.
    #[getter]
    fn header(&self) -> (&'static str, &'static str) {
        (kvroute::HEADER_DROPPED_REASON, self.reason)
    }

    /// The response headers to add, as a dict (the dropped-reason header).
    #[getter]
    fn headers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item(kvroute::HEADER_DROPPED_REASON, self.reason)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!("Rejection(status={}, reason={})", self.status, repr_str(self.reason))
    }
}

/// Flow control's answer to `Router.enqueue`: route the request now (`"admit"`), hold it until
/// its `ticket` is released (`"queued"`), or answer with `rejection` (`"rejected"`).
#[pyclass(frozen, eq, get_all, module = "kvroute", name = "Admission")]
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Admission {
    /// `"admit"`, `"queued"` or `"rejected"`.
    outcome: &'static str,
    /// The ticket to wait on (queued only).
    ticket: Option<u64>,
    /// Why it was refused (rejected only).
    rejection: Option<Rejection>,
}

impl Admission {
    pub(crate) fn new(a: &kvroute::Admission) -> Self {
        match a {
            kvroute::Admission::Admit => Admission { outcome: "admit", ticket: None, rejection: None },
            kvroute::Admission::Queued(t) => Admission { outcome: "queued", ticket: Some(t.0), rejection: None },
            kvroute::Admission::Rejected(r) => {
                Admission { outcome: "rejected", ticket: None, rejection: Some(Rejection::new(r)) }
            }
        }
    }
}

#[pymethods]
impl Admission {
    fn __repr__(&self) -> String {
        match (self.ticket, &self.rejection) {
            (Some(t), _) => format!("Admission(outcome='queued', ticket={t})"),
            (None, Some(r)) => format!("Admission(outcome='rejected', rejection={})", r.__repr__()),
            (None, None) => "Admission(outcome='admit')".to_owned(),
        }
    }
}

/// One ticket's end (from `Router.take_releases`): route the held request now
/// (`"dispatched"`) or answer its client with `rejection` (`"dropped"`).
#[pyclass(frozen, eq, get_all, module = "kvroute", name = "Release")]
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Release {
    /// The ticket `enqueue` returned.
    ticket: u64,
    /// `"dispatched"` or `"dropped"`.
    outcome: &'static str,
    /// Why it was dropped (dropped only).
    rejection: Option<Rejection>,
    /// How long it waited in the queue, milliseconds.
    waited_ms: u64,
}

impl Release {
    pub(crate) fn new(r: &kvroute::Release) -> Self {
        let (outcome, rejection) = match &r.outcome {
            kvroute::ReleaseOutcome::Dispatched => ("dispatched", None),
            kvroute::ReleaseOutcome::Dropped(rej) => ("dropped", Some(Rejection::new(rej))),
        };
        Release { ticket: r.ticket.0, outcome, rejection, waited_ms: r.waited_ms }
    }
}

#[pymethods]
impl Release {
    fn __repr__(&self) -> String {
        let rej = self.rejection.map_or_else(String::new, |r| format!(", rejection={}", r.__repr__()));
        format!(
            "Release(ticket={}, outcome={}{rej}, waited_ms={})",
            self.ticket,
            repr_str(self.outcome),
            self.waited_ms
        )
    }
}

/// Nothing used yet.
const MODE_NONE: u8 = 0;
/// `enqueue` / `take_releases` / `cancel` by the caller.
pub(crate) const MODE_TICKETS: u8 = 1;
/// `await admit(...)`: the dispatcher holds the tickets.
pub(crate) const MODE_AWAIT: u8 = 2;

/// A router's flow-control state on the Python side: which way it is driven, the dispatcher
/// of `await admit` (created on first use) and the clock it uses.
pub(crate) struct FlowHold {
    mode: AtomicU8,
    dispatcher: PyOnceLock<Py<PyAny>>,
    /// The clock of the dispatcher (`None`: `now_ms`).
    pub(crate) clock: Option<Py<PyAny>>,
}

impl FlowHold {
    pub(crate) fn new(clock: Option<Py<PyAny>>) -> Self {
        FlowHold { mode: AtomicU8::new(MODE_NONE), dispatcher: PyOnceLock::new(), clock }
    }

    /// Drive the router `mode`'s way from now on; `RuntimeError` when it is driven the other.
    pub(crate) fn claim(&self, mode: u8) -> PyResult<()> {
        match self.mode.compare_exchange(MODE_NONE, mode, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(()),
            Err(m) if m == mode => Ok(()),
            Err(_) if mode == MODE_TICKETS => Err(PyRuntimeError::new_err(
                "this router's queued requests are held by `await router.admit()`, which takes their \
                 releases itself: enqueue(), take_releases() and cancel() are for routers driven \
                 with tickets only (use one way per router)",
            )),
            Err(_) => Err(PyRuntimeError::new_err(
                "this router is driven with tickets (enqueue / take_releases / cancel): \
                 `await router.admit()` would take the releases of tickets it does not hold \
                 (use one way per router)",
            )),
        }
    }

    /// Whether `await admit` drives the router.
    pub(crate) fn awaitable(&self) -> bool {
        self.mode.load(Ordering::Acquire) == MODE_AWAIT
    }

    /// The dispatcher, when `await admit` has been used.
    pub(crate) fn dispatcher<'a>(&'a self, py: Python<'_>) -> Option<&'a Py<PyAny>> {
        self.dispatcher.get(py)
    }

    /// The dispatcher, made on first use (`kvroute._flow.Dispatcher(router, clock)`).
    pub(crate) fn dispatcher_or_init<'py>(&self, router: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let py = router.py();
        let d = self.dispatcher.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
            let module = py.import("kvroute._flow")?;
            let clock = self.clock.as_ref().map(|c| c.bind(py).clone());
            Ok(module.getattr("Dispatcher")?.call1((router, clock))?.unbind())
        })?;
        Ok(d.bind(py).clone())
    }

    /// A dispatch opportunity (after a completion, a metrics update, an endpoint change, a
    /// reload, a tick, a shutdown): the dispatcher, if any, takes the releases and wakes their
    /// waiters. The change that made the opportunity has happened already, so a failure here
    /// (a bug) is reported as unraisable rather than raised from that call.
    pub(crate) fn opportunity(&self, py: Python<'_>, now: Option<u64>) {
        if let Some(d) = self.dispatcher.get(py) {
            if let Err(e) = d.call_method1(py, "opportunity", (now,)) {
                e.write_unraisable(py, Some(d.bind(py)));
            }
        }
    }
}

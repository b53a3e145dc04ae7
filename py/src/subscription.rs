//! `Subscription`: a running ZMQ KV-event subscription (the core's `zmq_sub::Subscription`).

use std::sync::{Mutex, PoisonError};

use pyo3::prelude::*;

use kvroute::SubscriberStats;

use crate::convert::{self, repr_bool, repr_str};
use crate::errors;

/// A running KV-event subscription: one native thread receiving an engine's event stream and
/// applying it to the router (gap replay and resync included), with no Python on the way.
/// `stop()` ends it (also on garbage collection, and at the end of a `with` block).
#[pyclass(frozen, module = "kvroute", name = "Subscription")]
pub(crate) struct Subscription {
    running: Mutex<Option<kvroute::Subscription>>,
    /// Counters when it was stopped.
    last: Mutex<SubscriberStats>,
    endpoint_id: String,
    local_endpoint: String,
}

impl Subscription {
    pub(crate) fn new(s: kvroute::Subscription) -> Self {
        Subscription {
            endpoint_id: s.endpoint_id().to_owned(),
            local_endpoint: s.local_endpoint().to_owned(),
            running: Mutex::new(Some(s)),
            last: Mutex::new(SubscriberStats::default()),
        }
    }

    fn snapshot(&self) -> SubscriberStats {
        match &*self.running.lock().unwrap_or_else(PoisonError::into_inner) {
            Some(s) => s.stats(),
            None => *self.last.lock().unwrap_or_else(PoisonError::into_inner),
        }
    }
}

#[pymethods]
impl Subscription {
    /// The router endpoint this subscription feeds.
    #[getter]
    fn endpoint(&self) -> &str {
        &self.endpoint_id
    }

    /// The ZMQ endpoint the socket is bound or connected to, as ZMQ reports it (for a bind to
    /// port `*`, this names the port chosen).
    #[getter]
    fn local_endpoint(&self) -> &str {
        &self.local_endpoint
    }

    /// Whether the worker thread is running.
    #[getter]
    fn running(&self) -> bool {
        self.running.lock().unwrap_or_else(PoisonError::into_inner).as_ref().is_some_and(|s| s.is_running())
    }

    /// Counters (a dict: `messages`, `batches`, `decoded`, `applied`, `duplicates`, `resets`,
    /// `gaps`, `replays`, `replayed_batches`, `replay_failures`, `resyncs`, `decode_errors`,
    /// `malformed`, `router_errors`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let s = py.detach(|| self.snapshot());
        convert::serde_to_py(py, &s)
    }

    /// Stop the worker (within about one poll interval) and return the final counters.
    /// Stopping twice returns the same counters.
    fn stop<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let taken = self.running.lock().unwrap_or_else(PoisonError::into_inner).take();
        let stopped = match taken {
            Some(s) => py.detach(|| s.stop()),
            None => Ok(*self.last.lock().unwrap_or_else(PoisonError::into_inner)),
        };
        match stopped {
            Ok(stats) => {
                *self.last.lock().unwrap_or_else(PoisonError::into_inner) = stats;
                convert::serde_to_py(py, &stats)
            }
            Err(e) => Err(errors::subscribe(py, &e)),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*args))]
    fn __exit__(&self, py: Python<'_>, args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        // The exception (if any) is not swallowed.
        let _ = args;
        self.stop(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "Subscription(endpoint={}, local_endpoint={}, running={})",
            repr_str(&self.endpoint_id),
            repr_str(&self.local_endpoint),
            repr_bool(self.running())
        )
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        // The core's `Drop` stops and joins the worker (about one poll interval). The worker
        // never needs the GIL, so join with it released; at interpreter shutdown, join as is.
        let mut taken = self.running.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if taken.is_some() {
            let _ = Python::try_attach(|py| {
                let sub = taken.take();
                py.detach(move || drop(sub));
            });
        }
        drop(taken);
    }
}

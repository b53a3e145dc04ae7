//! `Replication`: a router's membership in its fleet over NATS (the core's `Replicator`).

use std::sync::{Mutex, PoisonError};

use pyo3::prelude::*;

use kvroute::{Replicator, ReplicatorStats};

use crate::convert::{self, repr_bool, repr_str};

/// A running router replica: one native thread connected to a NATS server that publishes this
/// router's routing effects and completions and applies those of the fleet's other replicas,
/// with no Python on the way. `stop()` ends it (also on garbage collection, and at the end of a
/// `with` block).
#[pyclass(frozen, module = "kvroute", name = "Replication")]
pub(crate) struct Replication {
    running: Mutex<Option<Replicator>>,
    /// Counters when it was stopped.
    last: Mutex<Option<ReplicatorStats>>,
    replica_id: String,
    fleet: String,
}

impl Replication {
    pub(crate) fn new(r: Replicator, replica_id: String, fleet: String) -> Self {
        Replication { running: Mutex::new(Some(r)), last: Mutex::new(None), replica_id, fleet }
    }

    fn snapshot(&self) -> ReplicatorStats {
        match &*self.running.lock().unwrap_or_else(PoisonError::into_inner) {
            Some(r) => r.stats(),
            None => self.last.lock().unwrap_or_else(PoisonError::into_inner).clone().unwrap_or_default(),
        }
    }

    /// Stop and join (call with the GIL released); the counters read just before.
    fn stop_now(&self) {
        let taken = self.running.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(r) = taken {
            let s = r.stop();
            *self.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(s);
        }
    }
}

#[pymethods]
impl Replication {
    /// This replica's id in the fleet.
    #[getter]
    fn replica_id(&self) -> &str {
        &self.replica_id
    }

    /// The fleet.
    #[getter]
    fn fleet(&self) -> &str {
        &self.fleet
    }

    /// Whether the replication thread is running (false after `stop()`).
    #[getter]
    fn running(&self) -> bool {
        self.running.lock().unwrap_or_else(PoisonError::into_inner).is_some()
    }

    /// Counters (a dict): the transport's (`connected`, `connects`, `disconnects`,
    /// `published`, `published_bytes`, `publish_errors`, `received`, `received_bytes`,
    /// `inbound_ready`, `inbound_restarts`, `server_errors`, `last_error`: a str or None) and
    /// the router's under `replica` (`replica_id`, `epoch`, `effects_applied`,
    /// `completions_applied`, `malformed`, `unknown_replica`, `duplicates`, `gaps`, `peers`,
    /// ...). After `stop()`, the counters at the stop.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let s = py.detach(|| self.snapshot());
        convert::serde_to_py(py, &s)
    }

    /// Publish what waits now instead of at the next flush tick (returns at once). A no-op after
    /// `stop()`.
    fn flush(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(r) = &*self.running.lock().unwrap_or_else(PoisonError::into_inner) {
                r.flush();
            }
        });
    }

    /// Publish what waits (bounded: about a second), stop the thread and turn replication off on
    /// the router (it keeps routing on its own state). Stopping twice is a no-op.
    fn stop(&self, py: Python<'_>) {
        py.detach(|| self.stop_now());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*args))]
    fn __exit__(&self, py: Python<'_>, args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        // The exception (if any) is not swallowed.
        let _ = args;
        self.stop(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "Replication(fleet={}, replica_id={}, running={})",
            repr_str(&self.fleet),
            repr_str(&self.replica_id),
            repr_bool(self.running())
        )
    }
}

impl Drop for Replication {
    fn drop(&mut self) {
        // The core's `Drop` stops and joins the thread (up to about a second). The thread never
        // needs the GIL, so join with it released; at interpreter shutdown, join as is.
        let mut taken = self.running.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if taken.is_some() {
            let _ = Python::try_attach(|py| {
                let r = taken.take();
                py.detach(move || drop(r));
            });
        }
        drop(taken);
    }
}

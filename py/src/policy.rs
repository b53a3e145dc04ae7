//! `Policy`: a validated policy document (the core's `Policy`).

use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple, PyType};

use crate::convert;

/// A validated routing policy. `Policy(config)` accepts what `Router(config)` accepts: `None`
/// (the defaults), a dict, JSON or YAML text, or a path to a JSON or YAML file; it raises
/// `ConfigError` naming the offending field. Immutable; equal when the normalized documents are
/// equal; pickles as its normalized JSON.
#[pyclass(frozen, module = "kvroute", name = "Policy")]
pub(crate) struct Policy {
    pub(crate) inner: kvroute::Policy,
}

#[pymethods]
impl Policy {
    #[new]
    #[pyo3(signature = (config = None))]
    fn new(py: Python<'_>, config: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        Ok(Policy { inner: convert::policy(py, config)? })
    }

    /// The normalized policy as pretty JSON, every default spelled out (what
    /// `kvroute check-config` prints).
    fn to_json(&self) -> String {
        self.inner.to_json_pretty()
    }

    /// The normalized policy as a dict.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        convert::serde_to_py(py, self.inner.config())
    }

    fn __repr__(&self) -> String {
        let compact = serde_json::to_string(self.inner.config()).unwrap_or_default();
        format!("Policy({compact})")
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<Policy>().is_ok_and(|o| o.get().inner == self.inner)
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let cls: Bound<'py, PyType> = slf.get_type();
        let json = PyString::new(py, &slf.get().inner.to_json_pretty());
        PyTuple::new(py, [cls.into_any(), PyTuple::new(py, [json])?.into_any()])
    }
}

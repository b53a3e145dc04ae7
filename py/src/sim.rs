//! `simulate()`: the trace simulator of the `kvroute-sim` crate (what its binary runs), from Python.

use std::path::PathBuf;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyString};

use kvroute_sim::sim::{
    DEFAULT_BATCH_REFERENCE, DEFAULT_CACHE_TOKENS, DEFAULT_ENDPOINTS, DEFAULT_METRICS_INTERVAL_MS,
    DEFAULT_PREFILL_OVERHEAD_MS, DEFAULT_PREFILL_TOKENS_PER_S, DEFAULT_TPOT_MS,
};
use kvroute_sim::workload::{
    DEFAULT_OUTPUT_TOKENS, DEFAULT_RATE, DEFAULT_SESSIONS, DEFAULT_SYSTEM_TOKENS, DEFAULT_TENANTS, DEFAULT_THINK_MS,
    DEFAULT_TURNS, DEFAULT_USER_TOKENS,
};
use kvroute_sim::{
    compare, load_trace, prepare, report, save_trace, svg, synthetic, ClusterConfig, PolicyKind, PolicyReport,
    SimError, Span, SyntheticConfig,
};

use crate::{convert, errors};

/// A `Span` argument: an int `N` or a string `"N"` / `"A-B"`; `None` is `default`.
fn span(py: Python<'_>, name: &'static str, v: Option<&Bound<'_, PyAny>>, default: Span) -> PyResult<Span> {
    let Some(v) = v.filter(|v| !v.is_none()) else { return Ok(default) };
    let text = if v.is_instance_of::<PyInt>() {
        v.str()?.to_string()
    } else if let Ok(s) = v.cast::<PyString>() {
        s.to_str()?.to_owned()
    } else {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int or a \"A-B\" range string, not {}",
            convert::type_name(v)
        )));
    };
    text.parse::<Span>().map_err(|reason| errors::sim_setting(py, name, &text, &reason))
}

/// The result of a simulation: one report per policy, plus the workload and cluster described.
#[pyclass(frozen, module = "kvroute", name = "SimulationResult")]
pub(crate) struct SimulationResult {
    workload: String,
    cluster: ClusterConfig,
    requests: usize,
    reports: Vec<PolicyReport>,
}

#[pymethods]
impl SimulationResult {
    /// The workload, in words.
    #[getter]
    fn workload(&self) -> &str {
        &self.workload
    }

    /// The cluster model, in words.
    #[getter]
    fn cluster_description(&self) -> String {
        self.cluster.describe()
    }

    /// The cluster model's settings (a dict).
    #[getter]
    fn cluster<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        convert::serde_to_py(py, &self.cluster)
    }

    /// Requests in the workload.
    #[getter]
    fn requests(&self) -> usize {
        self.requests
    }

    /// One dict per policy (`policy`, `hit_ratio`, `ttft_p50_ms`, … as `kvroute-sim --json`).
    #[getter]
    fn reports<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for r in &self.reports {
            list.append(convert::serde_to_py(py, r)?)?;
        }
        Ok(list)
    }

    /// The comparison as a Markdown table (what `kvroute-sim` prints).
    #[getter]
    fn table(&self) -> String {
        report::table(&self.reports)
    }

    /// The comparison as an SVG chart (what `kvroute-sim` writes).
    #[pyo3(signature = (title = None))]
    fn svg(&self, title: Option<&str>) -> String {
        let default_title = format!("kvroute-sim: {} requests on {} endpoints", self.requests, self.cluster.endpoints);
        let cluster = self.cluster.describe();
        svg::render(&self.reports, title.unwrap_or(&default_title), &[&self.workload, &cluster])
    }

    /// Everything as plain data (`workload`, `cluster`, `requests`, `reports`: the document
    /// `kvroute-sim --json` writes).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let doc = serde_json::json!({
            "workload": self.workload, "cluster": self.cluster, "requests": self.requests, "reports": self.reports,
        });
        convert::to_py(py, &doc)
    }

    fn __repr__(&self) -> String {
        let names: Vec<String> = self.reports.iter().map(|r| convert::repr_str(&r.policy)).collect();
        format!("SimulationResult(requests={}, policies=[{}])", self.requests, names.join(", "))
    }
}

/// Replay a workload (the synthetic multi-turn agent workload, or a JSONL `trace` file) over a
/// simulated cluster under each of `policies` (`"round-robin"`, `"least-loaded"`, `"kvroute"`),
/// as `kvroute-sim` does. `policy` is the kvroute policy (what `Router()` accepts). Runs with the
/// GIL released. Raises `SimulationError` (naming the setting or trace line) or `ConfigError`.
/// Settings left `None` take the simulator's defaults (those of `kvroute-sim --help`).
#[pyfunction]
#[pyo3(signature = (
    *, policy = None, trace = None, write_trace = None, policies = None, endpoints = None, tenants = None,
    sessions = None, turns = None, rate = None, seed = 42, system_tokens = None, user_tokens = None,
    output_tokens = None, think_ms = None, cache_tokens = None, kv_tokens = None, prefill_tps = None,
    tpot_ms = None, metrics_interval_ms = None
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn simulate(
    py: Python<'_>,
    policy: Option<&Bound<'_, PyAny>>,
    trace: Option<PathBuf>,
    write_trace: Option<PathBuf>,
    policies: Option<Vec<String>>,
    endpoints: Option<u32>,
    tenants: Option<u32>,
    sessions: Option<u32>,
    turns: Option<&Bound<'_, PyAny>>,
    rate: Option<f64>,
    seed: u64,
    system_tokens: Option<&Bound<'_, PyAny>>,
    user_tokens: Option<&Bound<'_, PyAny>>,
    output_tokens: Option<&Bound<'_, PyAny>>,
    think_ms: Option<f64>,
    cache_tokens: Option<u64>,
    kv_tokens: Option<u64>,
    prefill_tps: Option<f64>,
    tpot_ms: Option<f64>,
    metrics_interval_ms: Option<u64>,
) -> PyResult<SimulationResult> {
    let policy = convert::policy(py, policy)?;
    let kinds = match policies {
        None => PolicyKind::ALL.to_vec(),
        Some(names) => names
            .iter()
            .map(|n| n.parse::<PolicyKind>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| errors::sim(py, &e))?,
    };
    let synthetic_cfg = SyntheticConfig {
        tenants: tenants.unwrap_or(DEFAULT_TENANTS),
        sessions: sessions.unwrap_or(DEFAULT_SESSIONS),
        turns: span(py, "turns", turns, DEFAULT_TURNS)?,
        rate_per_s: rate.unwrap_or(DEFAULT_RATE),
        seed,
        system_tokens: span(py, "system_tokens", system_tokens, DEFAULT_SYSTEM_TOKENS)?,
        user_tokens: span(py, "user_tokens", user_tokens, DEFAULT_USER_TOKENS)?,
        output_tokens: span(py, "output_tokens", output_tokens, DEFAULT_OUTPUT_TOKENS)?,
        think_ms: think_ms.unwrap_or(DEFAULT_THINK_MS),
        ..Default::default()
    };
    let cluster = ClusterConfig {
        endpoints: endpoints.unwrap_or(DEFAULT_ENDPOINTS),
        cache_tokens: cache_tokens.unwrap_or(DEFAULT_CACHE_TOKENS),
        kv_tokens,
        prefill_tokens_per_s: prefill_tps.unwrap_or(DEFAULT_PREFILL_TOKENS_PER_S),
        prefill_overhead_ms: DEFAULT_PREFILL_OVERHEAD_MS,
        tpot_ms: tpot_ms.unwrap_or(DEFAULT_TPOT_MS),
        batch_reference: DEFAULT_BATCH_REFERENCE,
        metrics_interval_ms: metrics_interval_ms.unwrap_or(DEFAULT_METRICS_INTERVAL_MS),
    };
    let run = || -> Result<SimulationResult, SimError> {
        cluster.validate()?;
        let (workload, description) = match &trace {
            Some(path) => (load_trace(path)?, format!("trace {}", path.display())),
            None => (synthetic(&synthetic_cfg)?, synthetic_cfg.describe()),
        };
        if let Some(path) = &write_trace {
            save_trace(path, &workload)?;
        }
        let requests = prepare(workload, &policy.config().request)?;
        let reports = compare(&requests, &cluster, &kinds, &policy, &mut |_| {})?;
        Ok(SimulationResult { workload: description, cluster: cluster.clone(), requests: requests.len(), reports })
    };
    py.detach(run).map_err(|e| errors::sim(py, &e))
}

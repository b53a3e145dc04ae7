//! Python values → core inputs, core outputs → Python values. Pure conversion: no policy logic.

use std::path::{Path, PathBuf};

use pyo3::exceptions::{
    PyFileNotFoundError, PyIsADirectoryError, PyOSError, PyPermissionError, PyTypeError, PyUnicodeDecodeError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyDict, PyList, PyMemoryView, PyString, PyTuple};

use crate::errors;

/// The `now` every call defaults to: UNIX milliseconds, as the ZMQ subscriber's clock.
pub(crate) fn now_or_clock(now: Option<u64>) -> u64 {
    now.unwrap_or_else(kvroute::unix_time_ms)
}

/// `s` as Python writes a `str` literal in a repr (`'…'`).
pub(crate) fn repr_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('\'');
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            '\n' => out.push_str("\\n"),
            c if c.is_control() => out.push_str(&format!("\\x{:02x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// An optional `str` as Python writes it in a repr (`None` or `'…'`).
pub(crate) fn repr_opt(s: Option<&str>) -> String {
    s.map_or_else(|| "None".to_owned(), repr_str)
}

/// A bool as Python writes it.
pub(crate) fn repr_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

/// The name of `obj`'s type, for error messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

static JSON_DUMPS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// `json.dumps(obj, separators=(",", ":"), ensure_ascii=False)`: a dict as compact JSON text.
pub(crate) fn json_dumps<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    let py = obj.py();
    let dumps = JSON_DUMPS.get_or_try_init(py, || py.import("json")?.getattr("dumps").map(Bound::unbind))?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("separators", (",", ":"))?;
    kwargs.set_item("ensure_ascii", false)?;
    Ok(dumps.bind(py).call((obj,), Some(&kwargs))?.cast_into::<PyString>()?)
}

/// Text or bytes held by Python objects (borrowed) or made here (owned), readable while the GIL
/// is released: `bytes` and `str` are immutable and the references keep them alive.
pub(crate) enum Buf<'py> {
    /// A `bytes` object.
    Bytes(Bound<'py, PyBytes>),
    /// A `str` object (its UTF-8 form).
    Str(Bound<'py, PyString>),
    /// A copy (from a mutable buffer).
    Owned(Vec<u8>),
}

impl Buf<'_> {
    /// The bytes (for a `str`, its UTF-8 encoding; fails only for lone surrogates).
    pub(crate) fn as_slice(&self) -> PyResult<&[u8]> {
        match self {
            Buf::Bytes(b) => Ok(b.as_bytes()),
            Buf::Str(s) => Ok(s.to_str()?.as_bytes()),
            Buf::Owned(v) => Ok(v),
        }
    }
}

/// A request body: `bytes`, `bytearray`, `memoryview`, `str` (sent as UTF-8) or a `dict` (sent
/// as compact JSON).
pub(crate) fn body<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Buf<'py>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Buf::Bytes(b.clone()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Buf::Str(s.clone()));
    }
    if obj.is_instance_of::<PyDict>() {
        return Ok(Buf::Str(json_dumps(obj)?));
    }
    if let Some(b) = buffer(obj)? {
        return Ok(b);
    }
    Err(PyTypeError::new_err(format!("body must be bytes, str or dict (a JSON object), not {}", type_name(obj))))
}

/// A payload of bytes: `bytes`, `bytearray` or `memoryview`.
pub(crate) fn payload<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Buf<'py>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Buf::Bytes(b.clone()));
    }
    if let Some(b) = buffer(obj)? {
        return Ok(b);
    }
    Err(PyTypeError::new_err(format!("{what} must be bytes, bytearray or memoryview, not {}", type_name(obj))))
}

/// A copy of a mutable buffer (`bytearray`, `memoryview`), which could change while the GIL is
/// released.
fn buffer<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Buf<'py>>> {
    if let Ok(b) = obj.cast::<PyByteArray>() {
        return Ok(Some(Buf::Owned(b.to_vec())));
    }
    if obj.is_instance_of::<PyMemoryView>() {
        let bytes = obj.call_method0("tobytes")?.cast_into::<PyBytes>()?;
        return Ok(Some(Buf::Bytes(bytes)));
    }
    Ok(None)
}

/// A header name or value: `str`, or `bytes` holding UTF-8 (as in an ASGI scope).
pub(crate) enum StrLike<'py> {
    /// `str`.
    Str(Bound<'py, PyString>),
    /// `bytes`.
    Bytes(Bound<'py, PyBytes>),
}

impl StrLike<'_> {
    fn new<'py>(obj: Bound<'py, PyAny>, what: &str) -> PyResult<StrLike<'py>> {
        match obj.cast_into::<PyString>() {
            Ok(s) => Ok(StrLike::Str(s)),
            Err(e) => match e.into_inner().cast_into::<PyBytes>() {
                Ok(b) => Ok(StrLike::Bytes(b)),
                Err(e) => Err(PyTypeError::new_err(format!(
                    "header {what}s must be str or bytes, not {}",
                    type_name(&e.into_inner())
                ))),
            },
        }
    }

    /// The text (UTF-8 checked for bytes).
    pub(crate) fn as_str(&self) -> PyResult<&str> {
        match self {
            StrLike::Str(s) => s.to_str(),
            StrLike::Bytes(b) => {
                let bytes = b.as_bytes();
                std::str::from_utf8(bytes).map_err(|e| PyUnicodeDecodeError::new_err_from_utf8(b.py(), bytes, e))
            }
        }
    }
}

/// Request headers: `None`, a mapping (`dict` or anything with `items()`), or an iterable of
/// `(name, value)` pairs; names and values `str` or UTF-8 `bytes`.
pub(crate) fn headers<'py>(obj: Option<&Bound<'py, PyAny>>) -> PyResult<Vec<(StrLike<'py>, StrLike<'py>)>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    if let Ok(d) = obj.cast::<PyDict>() {
        out.reserve(d.len());
        for (k, v) in d.iter() {
            out.push((StrLike::new(k, "name")?, StrLike::new(v, "value")?));
        }
        return Ok(out);
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "headers must be a mapping or an iterable of (name, value) pairs, not {}",
            type_name(obj)
        )));
    }
    // Lists and tuples of pairs first: probing them for `items` would raise (and swallow) an
    // AttributeError on every call.
    let is_sequence = obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>();
    let pairs = if !is_sequence && obj.hasattr("items")? { obj.call_method0("items")? } else { obj.clone() };
    let iter = pairs.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "headers must be a mapping or an iterable of (name, value) pairs, not {}",
            type_name(obj)
        ))
    })?;
    for item in iter {
        let item = item?;
        let (k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item.extract().map_err(|_| {
            PyTypeError::new_err(format!("each header must be a (name, value) pair, not {}", type_name(&item)))
        })?;
        out.push((StrLike::new(k, "name")?, StrLike::new(v, "value")?));
    }
    Ok(out)
}

/// Where a policy comes from: the defaults, a `Policy` object, or a document's text.
pub(crate) enum ConfigSource<'py> {
    /// `None`: the default policy.
    Default,
    /// A `Policy` object.
    Policy(Box<kvroute::Policy>),
    /// JSON or YAML text (a `str`, the JSON of a `dict`, or UTF-8 `bytes`).
    Text(Buf<'py>),
    /// The contents of a file.
    File(String),
}

impl ConfigSource<'_> {
    /// The document text (`None` for `Default` and `Policy`).
    pub(crate) fn text(&self, py: Python<'_>) -> PyResult<Option<&str>> {
        match self {
            ConfigSource::Default | ConfigSource::Policy(_) => Ok(None),
            ConfigSource::Text(Buf::Str(s)) => s.to_str().map(Some),
            ConfigSource::Text(b) => {
                let bytes = b.as_slice()?;
                std::str::from_utf8(bytes).map(Some).map_err(|e| PyUnicodeDecodeError::new_err_from_utf8(py, bytes, e))
            }
            ConfigSource::File(t) => Ok(Some(t)),
        }
    }
}

/// Read a `config` argument: `None` (defaults), a `Policy`, a `dict`, JSON or YAML text (`str`
/// or `bytes`), or a path (`os.PathLike`) to a JSON or YAML file.
pub(crate) fn config_source<'py>(config: Option<&Bound<'py, PyAny>>) -> PyResult<ConfigSource<'py>> {
    let Some(config) = config.filter(|c| !c.is_none()) else { return Ok(ConfigSource::Default) };
    if let Ok(p) = config.cast::<crate::policy::Policy>() {
        return Ok(ConfigSource::Policy(Box::new(p.get().inner.clone())));
    }
    if let Ok(s) = config.cast::<PyString>() {
        return Ok(ConfigSource::Text(Buf::Str(s.clone())));
    }
    if config.is_instance_of::<PyDict>() {
        return Ok(ConfigSource::Text(Buf::Str(json_dumps(config)?)));
    }
    if let Ok(b) = config.cast::<PyBytes>() {
        return Ok(ConfigSource::Text(Buf::Bytes(b.clone())));
    }
    if config.hasattr("__fspath__")? {
        let path: PathBuf = config.extract()?;
        let text = config.py().detach(|| std::fs::read_to_string(&path)).map_err(|e| io_error(&path, &e))?;
        return Ok(ConfigSource::File(text));
    }
    Err(PyTypeError::new_err(format!(
        "config must be a dict, JSON or YAML text (str), a path (os.PathLike) or a Policy, not {}",
        type_name(config)
    )))
}

/// The policy a `config` argument designates (see [`config_source`]); `ConfigError` if invalid.
pub(crate) fn policy(py: Python<'_>, config: Option<&Bound<'_, PyAny>>) -> PyResult<kvroute::Policy> {
    let source = config_source(config)?;
    let parsed = match (&source, source.text(py)?) {
        (ConfigSource::Policy(p), _) => return Ok((**p).clone()),
        (_, Some(text)) => py.detach(|| kvroute::Policy::from_str_auto(text)),
        (_, None) => return Ok(kvroute::Policy::default()),
    };
    parsed.map_err(|e| errors::config(py, &e))
}

/// An `OSError` of the matching subclass naming the file.
pub(crate) fn io_error(path: &Path, e: &std::io::Error) -> PyErr {
    let msg = format!("{}: {e}", path.display());
    match e.kind() {
        std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(msg),
        std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err(msg),
        std::io::ErrorKind::IsADirectory => PyIsADirectoryError::new_err(msg),
        _ => PyOSError::new_err(msg),
    }
}

/// A serde value as plain Python data (dict, list, str, int, float, bool, None).
pub(crate) fn to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                u.into_pyobject(py)?.into_any()
            } else if let Some(i) = n.as_i64() {
                i.into_pyobject(py)?.into_any()
            } else {
                n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any()
            }
        }
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Array(a) => {
            let list = PyList::empty(py);
            for x in a {
                list.append(to_py(py, x)?)?;
            }
            list.into_any()
        }
        Value::Object(o) => {
            let dict = PyDict::new(py);
            for (k, x) in o {
                dict.set_item(k, to_py(py, x)?)?;
            }
            dict.into_any()
        }
    })
}

/// Any serializable core value as plain Python data.
pub(crate) fn serde_to_py<'py, T: serde::Serialize>(py: Python<'py>, v: &T) -> PyResult<Bound<'py, PyAny>> {
    let value = serde_json::to_value(v)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("cannot convert to Python: {e}")))?;
    to_py(py, &value)
}

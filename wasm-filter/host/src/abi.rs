//! Proxy-wasm ABI 0.2.1: the numeric values that cross the boundary, and the serialized form of
//! header maps (`proxy_get_header_map_pairs`, `proxy_http_call`, `proxy_send_local_response`).
//!
//! The values follow the specification (`proxy-wasm/spec`, `abi-versions/v0.2.1`) and the Rust SDK
//! (`proxy-wasm` 0.2.x, `src/types.rs`). All integers are little-endian, all pointers and sizes are
//! 32-bit (wasm32).

/// `proxy_status_t`: what every `proxy_*` hostcall returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// Success.
    Ok = 0,
    /// The key, queue, buffer or property does not exist.
    NotFound = 1,
    /// An argument is out of range or not available in this context (e.g. request headers after
    /// they went upstream, an unknown cluster, a callout without `:method`/`:path`/`:authority`).
    BadArgument = 2,
    /// The host could not serialize a value.
    SerializationFailure = 3,
    /// The host could not parse a value.
    ParseFailure = 4,
    /// A pointer/size pair does not lie inside the guest's linear memory.
    InvalidMemoryAccess = 6,
    /// Nothing to dequeue.
    Empty = 7,
    /// The compare-and-swap value of `proxy_set_shared_data` does not match.
    CasMismatch = 8,
    /// The host failed (e.g. the guest's allocator returned 0).
    InternalFailure = 10,
    /// Status of a failed HTTP callout (`proxy_get_status` in `proxy_on_http_call_response`); Envoy's
    /// `WasmResult::BrokenConnection`.
    BrokenConnection = 11,
    /// The hostcall is not implemented by this host.
    Unimplemented = 12,
}

impl Status {
    /// The value as the guest sees it.
    pub const fn code(self) -> i32 {
        self as i32
    }
}

/// `proxy_log_level_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    /// 0
    Trace = 0,
    /// 1
    Debug = 1,
    /// 2
    Info = 2,
    /// 3
    Warn = 3,
    /// 4
    Error = 4,
    /// 5
    Critical = 5,
}

impl LogLevel {
    /// The level for an ABI value, `None` when out of range (the hostcall answers BadArgument).
    pub const fn from_code(code: u32) -> Option<LogLevel> {
        Some(match code {
            0 => LogLevel::Trace,
            1 => LogLevel::Debug,
            2 => LogLevel::Info,
            3 => LogLevel::Warn,
            4 => LogLevel::Error,
            5 => LogLevel::Critical,
            _ => return None,
        })
    }
}

/// `proxy_action_t`: what the HTTP callbacks return.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// 0: forward what the callback was about.
    Continue,
    /// 1: hold it (see [`crate::FlowState`] for how the host treats a pause from each callback).
    Pause,
    /// Any other value (not part of ABI 0.2.1; the host treats it like Envoy, as a full stop, and
    /// records an [`crate::AbiViolation`]).
    Other(i32),
}

impl Action {
    /// The action for a callback's return value.
    pub const fn from_code(code: i32) -> Action {
        match code {
            0 => Action::Continue,
            1 => Action::Pause,
            other => Action::Other(other),
        }
    }
}

/// `proxy_buffer_type_t` values.
pub mod buffer {
    /// HTTP request body (in `proxy_on_request_body`, or while the request is paused).
    pub const HTTP_REQUEST_BODY: u32 = 0;
    /// HTTP response body.
    pub const HTTP_RESPONSE_BODY: u32 = 1;
    /// TCP downstream data (not supported by this host: NotFound).
    pub const DOWNSTREAM_DATA: u32 = 2;
    /// TCP upstream data (not supported by this host: NotFound).
    pub const UPSTREAM_DATA: u32 = 3;
    /// Body of an HTTP callout response (in `proxy_on_http_call_response`).
    pub const HTTP_CALL_RESPONSE_BODY: u32 = 4;
    /// gRPC message (not supported by this host: NotFound).
    pub const GRPC_CALL_MESSAGE: u32 = 5;
    /// VM configuration (any time).
    pub const VM_CONFIGURATION: u32 = 6;
    /// Plugin configuration (in `proxy_on_configure`).
    pub const PLUGIN_CONFIGURATION: u32 = 7;
    /// Foreign-function arguments (not supported: NotFound).
    pub const FOREIGN_FUNCTION_ARGUMENTS: u32 = 8;
    /// Largest valid value.
    pub const MAX: u32 = 8;
}

/// `proxy_map_type_t` values.
pub mod map {
    /// HTTP request headers.
    pub const HTTP_REQUEST_HEADERS: u32 = 0;
    /// HTTP request trailers.
    pub const HTTP_REQUEST_TRAILERS: u32 = 1;
    /// HTTP response headers.
    pub const HTTP_RESPONSE_HEADERS: u32 = 2;
    /// HTTP response trailers.
    pub const HTTP_RESPONSE_TRAILERS: u32 = 3;
    /// gRPC initial metadata (not supported: empty / BadArgument).
    pub const GRPC_CALL_INITIAL_METADATA: u32 = 4;
    /// gRPC trailing metadata (not supported: empty / BadArgument).
    pub const GRPC_CALL_TRAILING_METADATA: u32 = 5;
    /// Headers of an HTTP callout response (read-only, in `proxy_on_http_call_response`).
    pub const HTTP_CALL_RESPONSE_HEADERS: u32 = 6;
    /// Trailers of an HTTP callout response (read-only, in `proxy_on_http_call_response`).
    pub const HTTP_CALL_RESPONSE_TRAILERS: u32 = 7;
    /// Largest valid value.
    pub const MAX: u32 = 7;
}

/// `proxy_stream_type_t` values.
pub mod stream {
    /// The HTTP request (decoding) direction.
    pub const HTTP_REQUEST: u32 = 0;
    /// The HTTP response (encoding) direction.
    pub const HTTP_RESPONSE: u32 = 1;
    /// TCP downstream (not supported).
    pub const DOWNSTREAM: u32 = 2;
    /// TCP upstream (not supported).
    pub const UPSTREAM: u32 = 3;
}

/// `proxy_metric_type_t` values.
pub mod metric {
    /// Counter.
    pub const COUNTER: u32 = 0;
    /// Gauge.
    pub const GAUGE: u32 = 1;
    /// Histogram.
    pub const HISTOGRAM: u32 = 2;
}

/// Largest serialized map the host accepts from the guest (Envoy's `PROXY_WASM_HOST_PAIRS_MAX_BYTES`).
pub const PAIRS_MAX_BYTES: usize = 1024 * 1024;
/// Most pairs the host accepts in one serialized map (Envoy's `PROXY_WASM_HOST_PAIRS_MAX_COUNT`).
pub const PAIRS_MAX_COUNT: usize = 1024;

/// Serializes pairs the way the ABI does: `u32` count, then a `u32` key length and a `u32` value
/// length per pair, then each key and value followed by a NUL byte. An empty list is the 4-byte
/// count `0` (what the Rust SDK sends); the host sends an empty map as no bytes at all.
pub fn serialize_pairs<'a, I>(pairs: I) -> Vec<u8>
where
    I: IntoIterator<Item = (&'a [u8], &'a [u8])>,
    I::IntoIter: Clone,
{
    let pairs = pairs.into_iter();
    let mut size = 4;
    let mut count: u32 = 0;
    for (k, v) in pairs.clone() {
        size += 8 + k.len() + v.len() + 2;
        count = count.saturating_add(1);
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&count.to_le_bytes());
    for (k, v) in pairs.clone() {
        out.extend_from_slice(&len_u32(k.len()).to_le_bytes());
        out.extend_from_slice(&len_u32(v.len()).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// Why [`parse_pairs`] rejected a serialized map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PairsError {
    /// Larger than [`PAIRS_MAX_BYTES`].
    TooLarge,
    /// More pairs than [`PAIRS_MAX_COUNT`].
    TooManyPairs,
    /// The sizes run past the end of the data.
    Truncated,
    /// A key or value is not followed by its NUL byte.
    MissingNul,
    /// Bytes left after the last pair.
    TrailingBytes,
}

impl std::fmt::Display for PairsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PairsError::TooLarge => "serialized map larger than 1 MiB",
            PairsError::TooManyPairs => "serialized map with more than 1024 pairs",
            PairsError::Truncated => "serialized map truncated",
            PairsError::MissingNul => "serialized map: key or value not NUL-terminated",
            PairsError::TrailingBytes => "serialized map: bytes after the last pair",
        })
    }
}

/// Name/value pairs of a serialized header map, in order.
pub type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// Parses a serialized map (see [`serialize_pairs`]). Empty input, and a lone zero count, are the
/// empty map. Strict like Envoy's `PairsUtil::toPairs` (which turns any error into an empty map;
/// the host does the same and records an [`crate::AbiViolation`]).
pub fn parse_pairs(data: &[u8]) -> Result<Pairs, PairsError> {
    if data.is_empty() {
        return Ok(Vec::new());
    }
    if data.len() > PAIRS_MAX_BYTES {
        return Err(PairsError::TooLarge);
    }
    let count = read_u32(data, 0).ok_or(PairsError::Truncated)? as usize;
    if count > PAIRS_MAX_COUNT {
        return Err(PairsError::TooManyPairs);
    }
    let mut sizes = Vec::with_capacity(count);
    for i in 0..count {
        let at = 4 + i * 8;
        let k = read_u32(data, at).ok_or(PairsError::Truncated)? as usize;
        let v = read_u32(data, at + 4).ok_or(PairsError::Truncated)? as usize;
        sizes.push((k, v));
    }
    let mut pos = 4 + count * 8;
    let mut out = Vec::with_capacity(count);
    for (k, v) in sizes {
        let key = take_nul_terminated(data, &mut pos, k)?;
        let value = take_nul_terminated(data, &mut pos, v)?;
        out.push((key.to_vec(), value.to_vec()));
    }
    if pos != data.len() {
        return Err(PairsError::TrailingBytes);
    }
    Ok(out)
}

fn read_u32(data: &[u8], at: usize) -> Option<u32> {
    let bytes = data.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
}

fn take_nul_terminated<'a>(data: &'a [u8], pos: &mut usize, len: usize) -> Result<&'a [u8], PairsError> {
    let end = pos.checked_add(len).ok_or(PairsError::Truncated)?;
    let bytes = data.get(*pos..end).ok_or(PairsError::Truncated)?;
    match data.get(end) {
        Some(0) => {}
        Some(_) => return Err(PairsError::MissingNul),
        None => return Err(PairsError::Truncated),
    }
    *pos = end + 1;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_example_round_trips() {
        // The spec's example: {"a": "1"}, {"b": "22"}.
        let bytes = serialize_pairs([(&b"a"[..], &b"1"[..]), (&b"b"[..], &b"22"[..])]);
        assert_eq!(
            bytes,
            [2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, b'a', 0, b'1', 0, b'b', 0, b'2', b'2', 0]
        );
        let pairs = parse_pairs(&bytes).unwrap();
        assert_eq!(pairs, vec![(b"a".to_vec(), b"1".to_vec()), (b"b".to_vec(), b"22".to_vec())]);
    }

    #[test]
    fn empty_forms() {
        assert_eq!(parse_pairs(&[]).unwrap(), vec![]);
        assert_eq!(parse_pairs(&[0, 0, 0, 0]).unwrap(), vec![]);
        assert_eq!(serialize_pairs(std::iter::empty::<(&[u8], &[u8])>()), vec![0, 0, 0, 0]);
    }

    #[test]
    fn malformed_maps_are_rejected() {
        assert_eq!(parse_pairs(&[1, 0, 0]), Err(PairsError::Truncated));
        assert_eq!(parse_pairs(&[1, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, b'a', 0, 0]), Err(PairsError::Truncated));
        assert_eq!(parse_pairs(&[1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, b'a', b'x', 0]), Err(PairsError::MissingNul));
        assert_eq!(parse_pairs(&[1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, b'a', 0, 0, 9]), Err(PairsError::TrailingBytes));
        assert_eq!(parse_pairs(&[0xff, 0xff, 0xff, 0xff]), Err(PairsError::TooManyPairs));
        // sizes that overflow usize arithmetic on 32-bit hosts must not panic either
        assert_eq!(parse_pairs(&[1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]), Err(PairsError::Truncated));
    }
}

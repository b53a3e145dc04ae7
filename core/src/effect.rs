//! Replication of routing decisions: the state changes a decision made, in a compact binary form
//! another router instance can apply (e.g. the other worker VMs of an Envoy filter, which share
//! state through a replicated log).

use std::sync::Arc;

/// The state changes one routing decision made (see `Router::record_effects` and
/// `Router::apply_effect`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingEffect {
    /// Request id the decision tracks in flight.
    pub request_id: String,
    /// Target endpoint id.
    pub target: Arc<str>,
    /// Prefill endpoint id (disaggregated).
    pub prefill: Option<Arc<str>>,
    /// Decision time (ms).
    pub now_ms: u64,
    /// Session affinity key (hash of the session id), when the request had one.
    pub session_key: Option<u64>,
    /// Fingerprint of the approximate-key parameters the keys were made under.
    pub approx_fingerprint: u64,
    /// Approximate block keys (flattened) and the start of each prompt sequence.
    pub approx_keys: Vec<u64>,
    /// Sequence starts of `approx_keys`.
    pub approx_seq_starts: Vec<u32>,
    /// Fingerprint of the precise-key parameters.
    pub precise_fingerprint: u64,
    /// Precise block keys (flattened; empty when the request had none).
    pub precise_keys: Vec<u64>,
    /// Sequence starts of `precise_keys`.
    pub precise_seq_starts: Vec<u32>,
    /// Leading precise keys the target (and the prefill endpoint) already held, not speculated.
    pub precise_skip: [u32; 2],
    /// When the speculation expires (ms).
    pub speculative_expires_ms: u64,
}

/// An encoded effect could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EffectDecodeError {
    /// The bytes end early or carry an impossible length.
    #[error("routing effect truncated or malformed at byte {offset}")]
    Malformed {
        /// Where reading stopped.
        offset: usize,
    },
    /// An unknown format version.
    #[error("unknown routing effect version {0}")]
    Version(u8),
}

const VERSION: u8 = 1;

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u32(u32::try_from(s.len()).unwrap_or(u32::MAX));
        self.0.extend_from_slice(s.as_bytes());
    }
    fn u64s(&mut self, v: &[u64]) {
        self.u32(u32::try_from(v.len()).unwrap_or(u32::MAX));
        for &x in v {
            self.u64(x);
        }
    }
    fn u32s(&mut self, v: &[u32]) {
        self.u32(u32::try_from(v.len()).unwrap_or(u32::MAX));
        for &x in v {
            self.u32(x);
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], EffectDecodeError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        match end {
            Some(end) => {
                let s = &self.b[self.at..end];
                self.at = end;
                Ok(s)
            }
            None => Err(EffectDecodeError::Malformed { offset: self.at }),
        }
    }
    fn u8(&mut self) -> Result<u8, EffectDecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, EffectDecodeError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, EffectDecodeError> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn len(&mut self, elem: usize) -> Result<usize, EffectDecodeError> {
        let at = self.at;
        let n = self.u32()? as usize;
        if n.saturating_mul(elem) > self.b.len() - self.at {
            return Err(EffectDecodeError::Malformed { offset: at });
        }
        Ok(n)
    }
    fn string(&mut self) -> Result<String, EffectDecodeError> {
        let at = self.at;
        let n = self.len(1)?;
        std::str::from_utf8(self.take(n)?).map(str::to_owned).map_err(|_| EffectDecodeError::Malformed { offset: at })
    }
    fn u64s(&mut self) -> Result<Vec<u64>, EffectDecodeError> {
        let n = self.len(8)?;
        (0..n).map(|_| self.u64()).collect()
    }
    fn u32s(&mut self) -> Result<Vec<u32>, EffectDecodeError> {
        let n = self.len(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
}

impl RoutingEffect {
    /// The binary form (little-endian, length-prefixed; about 8 bytes per block key).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer(Vec::with_capacity(
            64 + self.request_id.len() + 8 * (self.approx_keys.len() + self.precise_keys.len()),
        ));
        w.u8(VERSION);
        w.str(&self.request_id);
        w.str(&self.target);
        match &self.prefill {
            Some(p) => {
                w.u8(1);
                w.str(p);
            }
            None => w.u8(0),
        }
        w.u64(self.now_ms);
        match self.session_key {
            Some(k) => {
                w.u8(1);
                w.u64(k);
            }
            None => w.u8(0),
        }
        w.u64(self.approx_fingerprint);
        w.u32s(&self.approx_seq_starts);
        w.u64s(&self.approx_keys);
        w.u64(self.precise_fingerprint);
        w.u32s(&self.precise_seq_starts);
        w.u64s(&self.precise_keys);
        w.u32(self.precise_skip[0]);
        w.u32(self.precise_skip[1]);
        w.u64(self.speculative_expires_ms);
        w.0
    }

    /// Read the binary form. Malformed input is an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<RoutingEffect, EffectDecodeError> {
        let mut r = Reader { b: bytes, at: 0 };
        let v = r.u8()?;
        if v != VERSION {
            return Err(EffectDecodeError::Version(v));
        }
        let request_id = r.string()?;
        let target: Arc<str> = Arc::from(r.string()?);
        let prefill = match r.u8()? {
            0 => None,
            _ => Some(Arc::from(r.string()?)),
        };
        let now_ms = r.u64()?;
        let session_key = match r.u8()? {
            0 => None,
            _ => Some(r.u64()?),
        };
        let approx_fingerprint = r.u64()?;
        let approx_seq_starts = r.u32s()?;
        let approx_keys = r.u64s()?;
        let precise_fingerprint = r.u64()?;
        let precise_seq_starts = r.u32s()?;
        let precise_keys = r.u64s()?;
        let precise_skip = [r.u32()?, r.u32()?];
        let speculative_expires_ms = r.u64()?;
        if r.at != bytes.len() {
            return Err(EffectDecodeError::Malformed { offset: r.at });
        }
        Ok(RoutingEffect {
            request_id,
            target,
            prefill,
            now_ms,
            session_key,
            approx_fingerprint,
            approx_keys,
            approx_seq_starts,
            precise_fingerprint,
            precise_keys,
            precise_seq_starts,
            precise_skip,
            speculative_expires_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RoutingEffect {
        RoutingEffect {
            request_id: "r-1".into(),
            target: Arc::from("10.0.0.1:8000"),
            prefill: Some(Arc::from("10.0.1.1:8000")),
            now_ms: 42,
            session_key: Some(7),
            approx_fingerprint: 1,
            approx_keys: vec![1, 2, 3],
            approx_seq_starts: vec![0],
            precise_fingerprint: 2,
            precise_keys: vec![9, 8],
            precise_seq_starts: vec![0],
            precise_skip: [1, 0],
            speculative_expires_ms: 2042,
        }
    }

    #[test]
    fn round_trip() {
        let e = sample();
        assert_eq!(RoutingEffect::decode(&e.encode()).unwrap(), e);
        let e = RoutingEffect { prefill: None, session_key: None, precise_keys: vec![], ..sample() };
        assert_eq!(RoutingEffect::decode(&e.encode()).unwrap(), e);
    }

    #[test]
    fn malformed_bytes_are_errors() {
        let bytes = sample().encode();
        for cut in 0..bytes.len() {
            assert!(RoutingEffect::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(RoutingEffect::decode(&extra).is_err());
        let mut v = bytes;
        v[0] = 9;
        assert_eq!(RoutingEffect::decode(&v), Err(EffectDecodeError::Version(9)));
        // a huge declared length
        let mut huge = vec![VERSION];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(RoutingEffect::decode(&huge).is_err());
    }
}

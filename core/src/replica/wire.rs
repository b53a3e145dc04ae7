//! The replica batch: a header naming the fleet, the replica, its incarnation and the batch's
//! sequence number, then length-prefixed entries.
//!
//! ```text
//! "KVRB" | version u8 = 1 | fleet: u8 len + bytes | replica: u8 len + bytes
//!        | epoch u64 | seq u64 | sent_ms u64 | count u32
//!        | count × (kind u8 | len u32 | bytes)      kind 1: RoutingEffect (its own encoding)
//!                                                   kind 2: completion (request id, UTF-8)
//! ```
//!
//! Little-endian throughout. A batch with no entries is a heartbeat. Decoding checks every length
//! and every entry before returning, so a batch is applied whole or not at all.

use crate::effect::RoutingEffect;

use super::{validate_id, ReplicaError};

/// The first four bytes of every batch.
pub const BATCH_MAGIC: &[u8; 4] = b"KVRB";
const VERSION: u8 = 1;
pub(super) const KIND_EFFECT: u8 = 1;
pub(super) const KIND_COMPLETE: u8 = 2;
/// Fixed header bytes besides the two ids.
pub(super) const HEADER_FIXED: usize = 4 + 1 + 1 + 1 + 8 + 8 + 8 + 4;
/// Per-entry framing bytes.
pub(super) const ENTRY_FRAMING: usize = 5;

/// One replicated state change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaEntry {
    /// A routed decision's effect (in flight, cached prefix, speculation, session).
    Effect(RoutingEffect),
    /// A request finished.
    Complete(String),
}

/// An entry as it is encoded (borrowed), for building batches by hand (tests, relays).
#[derive(Debug, Clone, Copy)]
pub enum ReplicaEntryRef<'a> {
    /// The encoded bytes of a [`RoutingEffect`].
    EncodedEffect(&'a [u8]),
    /// A completed request id.
    Complete(&'a str),
}

/// A decoded batch of one replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaBatch {
    /// The fleet it was published in.
    pub fleet: String,
    /// The publishing replica.
    pub replica: String,
    /// Its incarnation.
    pub epoch: u64,
    /// The batch's number within the incarnation (1, 2, …; heartbeats are numbered too).
    pub seq: u64,
    /// The publisher's clock when it was taken (ms).
    pub sent_ms: u64,
    /// The state changes, in the order they happened.
    pub entries: Vec<ReplicaEntry>,
}

pub(super) fn header(out: &mut Vec<u8>, fleet: &str, replica: &str, epoch: u64, seq: u64, sent_ms: u64, count: u32) {
    out.extend_from_slice(BATCH_MAGIC);
    out.push(VERSION);
    out.push(fleet.len() as u8);
    out.extend_from_slice(fleet.as_bytes());
    out.push(replica.len() as u8);
    out.extend_from_slice(replica.as_bytes());
    out.extend_from_slice(&epoch.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&sent_ms.to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
}

pub(super) fn entry(out: &mut Vec<u8>, kind: u8, bytes: &[u8]) {
    out.push(kind);
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

impl ReplicaBatch {
    /// Encode a batch from already encoded entries (see [`ReplicaEntryRef`]). Ids must be valid
    /// (see [`validate_replica_id`](crate::validate_replica_id)).
    pub fn encode_entries(
        fleet: &str,
        replica: &str,
        epoch: u64,
        seq: u64,
        sent_ms: u64,
        entries: &[ReplicaEntryRef<'_>],
    ) -> Result<Vec<u8>, ReplicaError> {
        validate_id("fleet", fleet)?;
        validate_id("replica_id", replica)?;
        let count = u32::try_from(entries.len())
            .map_err(|_| ReplicaError::Config { field: "entries", reason: "too many".into() })?;
        let mut out = Vec::new();
        header(&mut out, fleet, replica, epoch, seq, sent_ms, count);
        for e in entries {
            match e {
                ReplicaEntryRef::EncodedEffect(b) => entry(&mut out, KIND_EFFECT, b),
                ReplicaEntryRef::Complete(id) => entry(&mut out, KIND_COMPLETE, id.as_bytes()),
            }
        }
        Ok(out)
    }

    /// The binary form of this batch.
    pub fn encode(&self) -> Result<Vec<u8>, ReplicaError> {
        let effects: Vec<Vec<u8>> = self
            .entries
            .iter()
            .filter_map(|e| match e {
                ReplicaEntry::Effect(fx) => Some(fx.encode()),
                ReplicaEntry::Complete(_) => None,
            })
            .collect();
        let mut fx = effects.iter();
        let refs: Vec<ReplicaEntryRef<'_>> = self
            .entries
            .iter()
            .map(|e| match e {
                ReplicaEntry::Effect(_) => ReplicaEntryRef::EncodedEffect(fx.next().map_or(&[][..], |v| v.as_slice())),
                ReplicaEntry::Complete(id) => ReplicaEntryRef::Complete(id),
            })
            .collect();
        ReplicaBatch::encode_entries(&self.fleet, &self.replica, self.epoch, self.seq, self.sent_ms, &refs)
    }

    /// Read a batch. Anything malformed (bad magic or version, a length past the end, an invalid
    /// id, a bad entry, trailing bytes) is an error and nothing is returned.
    pub fn decode(bytes: &[u8]) -> Result<ReplicaBatch, ReplicaError> {
        let mut r = Reader { b: bytes, at: 0 };
        if r.take(4)? != BATCH_MAGIC {
            return Err(ReplicaError::Malformed("not a replica batch (magic)".into()));
        }
        let v = r.u8()?;
        if v != VERSION {
            return Err(ReplicaError::Malformed(format!("unknown batch version {v}")));
        }
        let fleet = r.id()?;
        let replica = r.id()?;
        let epoch = r.u64()?;
        let seq = r.u64()?;
        let sent_ms = r.u64()?;
        let count = r.u32()? as usize;
        // Every entry takes at least its framing: a count beyond what the bytes can hold is a lie.
        if count.saturating_mul(ENTRY_FRAMING) > bytes.len() - r.at {
            return Err(ReplicaError::Malformed(format!("entry count {count} exceeds the batch")));
        }
        let mut entries = Vec::with_capacity(count);
        for i in 0..count {
            let kind = r.u8()?;
            let n = r.u32()? as usize;
            let body = r.take(n)?;
            entries.push(match kind {
                KIND_EFFECT => ReplicaEntry::Effect(
                    RoutingEffect::decode(body).map_err(|e| ReplicaError::Malformed(format!("entry {i}: {e}")))?,
                ),
                KIND_COMPLETE => ReplicaEntry::Complete(
                    std::str::from_utf8(body)
                        .map_err(|_| ReplicaError::Malformed(format!("entry {i}: request id not UTF-8")))?
                        .to_owned(),
                ),
                k => return Err(ReplicaError::Malformed(format!("entry {i}: unknown kind {k}"))),
            });
        }
        if r.at != bytes.len() {
            return Err(ReplicaError::Malformed(format!("{} trailing bytes", bytes.len() - r.at)));
        }
        Ok(ReplicaBatch { fleet, replica, epoch, seq, sent_ms, entries })
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], ReplicaError> {
        match self.at.checked_add(n).filter(|&e| e <= self.b.len()) {
            Some(end) => {
                let s = &self.b[self.at..end];
                self.at = end;
                Ok(s)
            }
            None => Err(ReplicaError::Malformed(format!("truncated at byte {}", self.at))),
        }
    }
    fn u8(&mut self) -> Result<u8, ReplicaError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, ReplicaError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, ReplicaError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn id(&mut self) -> Result<String, ReplicaError> {
        let n = self.u8()? as usize;
        let s = std::str::from_utf8(self.take(n)?).map_err(|_| ReplicaError::Malformed("id not UTF-8".into()))?;
        validate_id("replica_id", s).map_err(|e| ReplicaError::Malformed(e.to_string()))?;
        Ok(s.to_owned())
    }
}

//! The msgpack decoder of KV-event payloads: [`decode_batch`] and the zero-copy reader under it.

// Why `rmp` and not `rmpv`/`rmp-serde`: `rmpv` materialises every value (a boxed `Value` per token
// id, a `String` per key) before we could look at it, which would cost more than the rest of
// routing per block; `rmp-serde` would need `deserialize_any` tricks for the two event encodings and
// reports no byte offsets. `rmp`'s low-level readers over `rmp::decode::Bytes` decode markers,
// lengths and integers straight from the slice, so we keep a zero-copy cursor, exact offsets and
// full control over allocation.
use rmp::decode::bytes::BytesReadError;
use rmp::decode::{self as mp, Bytes, NumValueReadError, ValueReadError};
use rmp::Marker;
use xxhash_rust::xxh3::Xxh3;

use super::{BlockRemoved, BlockStored, EngineBlockHash, ErrorSite, EventBatch, EventError, KvEvent, Medium};

/// Seed of the fingerprint in [`BlockStored::content_keys`] (fixed: the same bytes always give the
/// same key, on every platform).
const CONTENT_KEY_SEED: u64 = 0x6b76_726f_7574_6530;

/// Shortest valid encoded event: `["AllBlocksCleared"]` (fixarray + fixstr header + 16 bytes).
/// Bounds the `events` pre-allocation by the payload size.
const MIN_EVENT_BYTES: usize = 18;

/// Decodes one KV-event payload (the msgpack frame of a ZMQ message) as published by vLLM
/// (array- or map-tagged events) or SGLang.
///
/// Returns the whole batch or an [`EventError`]; never a partial batch and never a panic,
/// whatever the input. See [`EventBatch`](crate::EventBatch) for what is accepted and how values are
/// mapped.
///
/// ```
/// use kvroute::{decode_batch, KvEvent, Medium};
///
/// // vLLM ≥ 0.24: [ts, [{"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}], 0]
/// let payload = b"\x93\xcb\x41\xda\x13\x86\x3e\x00\x00\x00\x91\x83\xa4type\xacBlockRemoved\
///                 \xacblock_hashes\x91\x07\xa6medium\xa3CPU\x00";
/// let batch = decode_batch(payload)?;
/// assert_eq!(batch.data_parallel_rank, Some(0));
/// match &batch.events[0] {
///     KvEvent::BlockRemoved(r) => {
///         assert_eq!(r.block_hashes, vec![7]);
///         assert_eq!(r.medium, Medium::Cpu);
///     }
///     other => panic!("unexpected {other:?}"),
/// }
/// // Truncated input is an error, not a partial batch.
/// assert!(decode_batch(&payload[..payload.len() - 2]).is_err());
/// # Ok::<(), kvroute::EventError>(())
/// ```
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, EventError> {
    let mut r = Reader::new(payload);
    let batch_site = ErrorSite::batch("batch");
    let len = r.array_len(batch_site)?;
    if len < 2 {
        return Err(EventError::BatchTooShort { offset: 0, len });
    }
    let ts = r.float(ErrorSite::batch("ts"))?;
    let events_site = ErrorSite::batch("events");
    let n_events = r.array_len(events_site)?;
    let mut events = Vec::with_capacity(n_events.min(r.remaining() / MIN_EVENT_BYTES));
    for index in 0..n_events {
        events.push(decode_event(&mut r, index)?);
    }
    let data_parallel_rank = if len >= 3 { r.opt_i64(ErrorSite::batch("data_parallel_rank"))? } else { None };
    for _ in 3..len {
        r.skip(batch_site)?;
    }
    if r.remaining() != 0 {
        return Err(EventError::TrailingBytes { offset: r.offset(), remaining: r.remaining() });
    }
    Ok(EventBatch { ts, events, data_parallel_rank })
}

fn decode_event(r: &mut Reader<'_>, index: usize) -> Result<KvEvent, EventError> {
    let site = ErrorSite::event(index, "event");
    match r.peek(site)? {
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => decode_array_event(r, index),
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => decode_map_event(r, index),
        other => Err(r.wrong_type(r.offset(), site, "array or map", other)),
    }
}

/// Event kinds by wire tag.
#[derive(Clone, Copy)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

fn kind_of(tag: &[u8], offset: usize, event: usize) -> Result<Kind, EventError> {
    match tag {
        b"BlockStored" => Ok(Kind::Stored),
        b"BlockRemoved" => Ok(Kind::Removed),
        b"AllBlocksCleared" => Ok(Kind::Cleared),
        other => match std::str::from_utf8(other) {
            Ok(tag) => Err(EventError::UnknownEventType { offset, event, tag: tag.to_owned() }),
            Err(_) => Err(EventError::InvalidUtf8 { offset, site: ErrorSite::event(event, "type") }),
        },
    }
}

/// vLLM ≤ 0.23 `array_like` positions after the tag.
const STORED_FIELDS: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const STORED_REQUIRED: usize = 4;
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];
const REMOVED_REQUIRED: usize = 1;

fn decode_array_event(r: &mut Reader<'_>, event: usize) -> Result<KvEvent, EventError> {
    let start = r.offset();
    let len = r.array_len(ErrorSite::event(event, "event"))?;
    if len == 0 {
        return Err(EventError::MissingField { offset: start, event, field: "type" });
    }
    let (tag_offset, tag) = r.raw_str(ErrorSite::event(event, "type"))?;
    let fields = len - 1;
    let kind = kind_of(tag, tag_offset, event)?;
    let (names, required): (&[&'static str], usize) = match kind {
        Kind::Stored => (&STORED_FIELDS, STORED_REQUIRED),
        Kind::Removed => (&REMOVED_FIELDS, REMOVED_REQUIRED),
        Kind::Cleared => (&[], 0),
    };
    if fields < required {
        return Err(EventError::MissingField { offset: start, event, field: names[fields] });
    }
    let mut f = Fields::default();
    for &name in names.iter().take(fields) {
        f.read(r, event, name)?;
    }
    for _ in names.len()..fields {
        r.skip(ErrorSite::event(event, "event"))?;
    }
    f.finish(kind, start, event)
}

fn decode_map_event(r: &mut Reader<'_>, event: usize) -> Result<KvEvent, EventError> {
    let start = r.offset();
    let len = r.map_len(ErrorSite::event(event, "event"))?;
    let mut kind = None;
    let mut f = Fields::default();
    for _ in 0..len {
        // Keys are matched as bytes (the known ones are ASCII); others are checked, then skipped.
        let key_site = ErrorSite::event(event, "key");
        let (key_offset, key) = r.raw_str(key_site)?;
        match key {
            b"type" => {
                let (offset, tag) = r.raw_str(ErrorSite::event(event, "type"))?;
                kind = Some(kind_of(tag, offset, event)?);
            }
            b"block_hashes" => f.read(r, event, "block_hashes")?,
            b"parent_block_hash" => f.read(r, event, "parent_block_hash")?,
            b"token_ids" => f.read(r, event, "token_ids")?,
            b"block_size" => f.read(r, event, "block_size")?,
            b"lora_id" => f.read(r, event, "lora_id")?,
            b"medium" => f.read(r, event, "medium")?,
            b"lora_name" => f.read(r, event, "lora_name")?,
            b"group_idx" => f.read(r, event, "group_idx")?,
            b"extra_keys" => f.read(r, event, "extra_keys")?,
            b"cache_salt" => f.read(r, event, "cache_salt")?,
            b"locality" => f.read(r, event, "locality")?,
            b"ownership" => f.read(r, event, "ownership")?,
            b"session_id" => f.read(r, event, "session_id")?,
            b"lookahead_token_ids" => f.read(r, event, "lookahead_token_ids")?,
            other => {
                std::str::from_utf8(other)
                    .map_err(|_| EventError::InvalidUtf8 { offset: key_offset, site: key_site })?;
                r.skip(key_site)?;
            }
        }
    }
    let Some(kind) = kind else {
        return Err(EventError::MissingField { offset: start, event, field: "type" });
    };
    f.finish(kind, start, event)
}

/// Fields gathered from either event encoding.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<EngineBlockHash>>,
    parent_block_hash: Option<EngineBlockHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<Medium>,
    lora_name: Option<String>,
    group_idx: Option<u32>,
    /// Top-level strings of the first block's extra keys (LoRA name and/or cache_salt).
    first_extra_strings: Vec<String>,
    /// Per block: fingerprint of the extra keys that are not strings (0: none).
    content_keys: Vec<u64>,
    cache_salt: Option<String>,
    remote: bool,
    ownership: Option<String>,
    session_id: Option<String>,
    lookahead_token_ids: Vec<Vec<u32>>,
}

impl Fields {
    /// Reads the value of wire field `name`; fields we do not keep are skipped.
    #[inline]
    fn read(&mut self, r: &mut Reader<'_>, event: usize, name: &'static str) -> Result<(), EventError> {
        let site = ErrorSite::event(event, name);
        match name {
            "block_hashes" => self.block_hashes = Some(r.hashes(site)?),
            "parent_block_hash" => self.parent_block_hash = r.opt_hash(site)?,
            "token_ids" => self.token_ids = Some(r.token_ids(site)?),
            "block_size" => self.block_size = Some(r.u32(site)?),
            "lora_id" => self.lora_id = r.opt_i64(site)?,
            "medium" => self.medium = r.medium(site)?,
            "lora_name" => self.lora_name = r.opt_str(site)?.map(str::to_owned),
            "group_idx" => self.group_idx = r.opt_u32(site)?,
            "extra_keys" => (self.first_extra_strings, self.content_keys) = r.extra_keys(site)?,
            "cache_salt" => self.cache_salt = r.opt_str(site)?.map(str::to_owned),
            "locality" => self.remote = r.opt_str(site)?.is_some_and(|l| l.eq_ignore_ascii_case("REMOTE")),
            "ownership" => self.ownership = r.opt_str(site)?.map(str::to_owned),
            "session_id" => self.session_id = r.opt_str(site)?.map(str::to_owned),
            "lookahead_token_ids" => self.lookahead_token_ids = r.lookahead(site)?,
            _ => r.skip(site)?,
        }
        Ok(())
    }

    fn finish(self, kind: Kind, offset: usize, event: usize) -> Result<KvEvent, EventError> {
        let missing = |field| EventError::MissingField { offset, event, field };
        // vLLM's untagged extra keys of a first block: (lora_name if set, multimodal tuples...,
        // cache_salt if set, prompt-embeds bytes...): the top-level strings are the LoRA name
        // (first, when the blocks have one) and then the salt.
        // SGLang's `cache_salt` field wins; an empty salt (from either place) is no salt, as
        // vLLM hashes it.
        let cache_salt = self.cache_salt.filter(|s| !s.is_empty()).or_else(|| {
            let skip = usize::from(self.lora_name.is_some());
            self.first_extra_strings.into_iter().nth(skip).filter(|s| !s.is_empty())
        });
        // Blocks a publisher reports as REMOTE are not in its own memory: count them at the
        // storage tier (reachable, slowest).
        let medium = |m: Option<Medium>| if self.remote { Medium::Storage } else { m.unwrap_or(Medium::Gpu) };
        Ok(match kind {
            Kind::Stored => KvEvent::BlockStored(BlockStored {
                block_hashes: self.block_hashes.ok_or_else(|| missing("block_hashes"))?,
                parent_block_hash: self.parent_block_hash,
                token_ids: self.token_ids.ok_or_else(|| missing("token_ids"))?,
                block_size: self.block_size.ok_or_else(|| missing("block_size"))?,
                lora_id: self.lora_id,
                medium: medium(self.medium),
                lora_name: self.lora_name,
                group_idx: self.group_idx,
                cache_salt,
                content_keys: self.content_keys,
                lookahead_token_ids: self.lookahead_token_ids,
                ownership: self.ownership,
                session_id: self.session_id,
            }),
            Kind::Removed => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: self.block_hashes.ok_or_else(|| missing("block_hashes"))?,
                medium: medium(self.medium),
                group_idx: self.group_idx,
                ownership: self.ownership,
            }),
            Kind::Cleared => KvEvent::AllBlocksCleared,
        })
    }
}

/// Forward-only cursor over the payload; offsets are relative to its start.
struct Reader<'a> {
    input_len: usize,
    rest: Bytes<'a>,
}

impl<'a> Reader<'a> {
    fn new(input: &'a [u8]) -> Self {
        Reader { input_len: input.len(), rest: Bytes::new(input) }
    }

    #[inline]
    fn remaining(&self) -> usize {
        self.rest.remaining_slice().len()
    }

    #[inline]
    fn offset(&self) -> usize {
        self.input_len - self.remaining()
    }

    /// Drops `n` bytes (callers have checked `n <= remaining`).
    #[inline]
    fn advance(&mut self, n: usize) {
        let rest = self.rest.remaining_slice();
        self.rest = Bytes::new(rest.get(n..).unwrap_or_default());
    }

    #[inline]
    fn peek(&self, site: ErrorSite) -> Result<Marker, EventError> {
        match self.rest.remaining_slice().first() {
            Some(&b) => Ok(Marker::from_u8(b)),
            None => Err(EventError::Truncated { offset: self.offset(), site }),
        }
    }

    /// Consumes a nil if one is next.
    #[inline]
    fn take_nil(&mut self) -> bool {
        if self.rest.remaining_slice().first() == Some(&0xc0) {
            self.advance(1);
            true
        } else {
            false
        }
    }

    #[cold]
    fn wrong_type(&self, offset: usize, site: ErrorSite, expected: &'static str, found: Marker) -> EventError {
        EventError::WrongType { offset, site, expected, found: marker_name(found) }
    }

    #[cold]
    fn value_error(
        &self,
        offset: usize,
        site: ErrorSite,
        expected: &'static str,
        e: ValueReadError<BytesReadError>,
    ) -> EventError {
        match e {
            ValueReadError::TypeMismatch(m) => self.wrong_type(offset, site, expected, m),
            ValueReadError::InvalidMarkerRead(_) | ValueReadError::InvalidDataRead(_) => {
                EventError::Truncated { offset, site }
            }
        }
    }

    /// A declared element count or byte length, checked against the bytes left.
    #[inline]
    fn check_len(
        &self,
        offset: usize,
        site: ErrorSite,
        declared: u64,
        min_bytes_each: u64,
    ) -> Result<usize, EventError> {
        let remaining = self.remaining();
        match usize::try_from(declared) {
            Ok(n) if declared.saturating_mul(min_bytes_each) <= remaining as u64 => Ok(n),
            _ => Err(EventError::LengthExceedsInput { offset, site, declared, remaining }),
        }
    }

    #[inline]
    fn array_len(&mut self, site: ErrorSite) -> Result<usize, EventError> {
        let offset = self.offset();
        let n = mp::read_array_len(&mut self.rest).map_err(|e| self.value_error(offset, site, "array", e))?;
        self.check_len(offset, site, u64::from(n), 1)
    }

    #[inline]
    fn map_len(&mut self, site: ErrorSite) -> Result<usize, EventError> {
        let offset = self.offset();
        let n = mp::read_map_len(&mut self.rest).map_err(|e| self.value_error(offset, site, "map", e))?;
        self.check_len(offset, site, u64::from(n), 2)
    }

    /// A msgpack str's bytes, not yet checked for UTF-8, with the offset of its header.
    #[inline]
    fn raw_str(&mut self, site: ErrorSite) -> Result<(usize, &'a [u8]), EventError> {
        let offset = self.offset();
        let n = mp::read_str_len(&mut self.rest).map_err(|e| self.value_error(offset, site, "str", e))?;
        let n = self.check_len(offset, site, u64::from(n), 1)?;
        let rest = self.rest.remaining_slice();
        let (bytes, tail) = rest.split_at_checked(n).ok_or(EventError::Truncated { offset, site })?;
        self.rest = Bytes::new(tail);
        Ok((offset, bytes))
    }

    #[inline]
    fn str(&mut self, site: ErrorSite) -> Result<&'a str, EventError> {
        let (offset, bytes) = self.raw_str(site)?;
        std::str::from_utf8(bytes).map_err(|_| EventError::InvalidUtf8 { offset, site })
    }

    #[inline]
    fn opt_str(&mut self, site: ErrorSite) -> Result<Option<&'a str>, EventError> {
        if self.take_nil() {
            return Ok(None);
        }
        self.str(site).map(Some)
    }

    /// Any msgpack integer, widened.
    #[inline]
    fn int(&mut self, site: ErrorSite, expected: &'static str) -> Result<(usize, i128), EventError> {
        let offset = self.offset();
        match mp::read_int::<i128, _>(&mut self.rest) {
            Ok(v) => Ok((offset, v)),
            Err(NumValueReadError::TypeMismatch(m)) => Err(self.wrong_type(offset, site, expected, m)),
            // i128 holds every msgpack integer, so OutOfRange cannot happen; treat it like a read error.
            Err(_) => Err(EventError::Truncated { offset, site }),
        }
    }

    #[inline]
    fn u32(&mut self, site: ErrorSite) -> Result<u32, EventError> {
        let (offset, v) = self.int(site, "int")?;
        u32::try_from(v).map_err(|_| EventError::IntOutOfRange { offset, site, value: v, range: "0..=4294967295" })
    }

    #[inline]
    fn opt_u32(&mut self, site: ErrorSite) -> Result<Option<u32>, EventError> {
        if self.take_nil() {
            return Ok(None);
        }
        self.u32(site).map(Some)
    }

    #[inline]
    fn opt_i64(&mut self, site: ErrorSite) -> Result<Option<i64>, EventError> {
        if self.take_nil() {
            return Ok(None);
        }
        let (offset, v) = self.int(site, "int or nil")?;
        i64::try_from(v).map(Some).map_err(|_| EventError::IntOutOfRange { offset, site, value: v, range: "i64" })
    }

    fn float(&mut self, site: ErrorSite) -> Result<f64, EventError> {
        let offset = self.offset();
        match self.peek(site)? {
            Marker::F64 => mp::read_f64(&mut self.rest).map_err(|e| self.value_error(offset, site, "float", e)),
            Marker::F32 => {
                mp::read_f32(&mut self.rest).map(f64::from).map_err(|e| self.value_error(offset, site, "float", e))
            }
            _ => self.int(site, "float").map(|(_, v)| v as f64),
        }
    }

    /// One block hash: uint, negative int (bits kept), or a digest (last 8 bytes big-endian).
    #[inline]
    fn hash(&mut self, site: ErrorSite) -> Result<EngineBlockHash, EventError> {
        let offset = self.offset();
        match self.peek(site)? {
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let n = mp::read_bin_len(&mut self.rest).map_err(|e| self.value_error(offset, site, "bin", e))?;
                let n = self.check_len(offset, site, u64::from(n), 1)?;
                let rest = self.rest.remaining_slice();
                let (digest, tail) = rest.split_at_checked(n).ok_or(EventError::Truncated { offset, site })?;
                let last8: [u8; 8] = digest
                    .get(n.saturating_sub(8)..)
                    .and_then(|s| s.try_into().ok())
                    .ok_or(EventError::ShortHashDigest { offset, site, len: n })?;
                self.rest = Bytes::new(tail);
                Ok(u64::from_be_bytes(last8))
            }
            _ => {
                let (offset, v) = self.int(site, "int or bin block hash")?;
                // msgpack ints span i64::MIN..=u64::MAX: non-negative ones are the u64 itself,
                // negative ones (SGLang's signed int64) keep their two's-complement bits.
                u64::try_from(v)
                    .or_else(|_| i64::try_from(v).map(|x| x as u64))
                    .map_err(|_| EventError::IntOutOfRange { offset, site, value: v, range: "i64 or u64" })
            }
        }
    }

    #[inline]
    fn opt_hash(&mut self, site: ErrorSite) -> Result<Option<EngineBlockHash>, EventError> {
        if self.take_nil() {
            return Ok(None);
        }
        self.hash(site).map(Some)
    }

    fn hashes(&mut self, site: ErrorSite) -> Result<Vec<EngineBlockHash>, EventError> {
        let n = self.array_len(site)?;
        let mut out = Vec::with_capacity(n);
        let mut rest = self.rest.remaining_slice();
        for _ in 0..n {
            // Fast path: vLLM's int form is a uint64 for all but 1 in 2^32 hashes.
            if let [0xcf, b0, b1, b2, b3, b4, b5, b6, b7, ref tail @ ..] = *rest {
                out.push(u64::from_be_bytes([b0, b1, b2, b3, b4, b5, b6, b7]));
                rest = tail;
            } else {
                self.rest = Bytes::new(rest);
                out.push(self.hash(site)?);
                rest = self.rest.remaining_slice();
            }
        }
        self.rest = Bytes::new(rest);
        Ok(out)
    }

    fn token_ids(&mut self, site: ErrorSite) -> Result<Vec<u32>, EventError> {
        let n = self.array_len(site)?;
        // `n <= remaining bytes` was checked: at most 4 bytes reserved per input byte.
        let mut out = Vec::with_capacity(n);
        // The decoder's hot loop. While 8 bytes are left, a token id in one of the encodings ids
        // actually use (fixint, uint8/16/32) is decoded without a branch on its width: its
        // length comes from its marker by arithmetic and its value from the 4 bytes after the
        // marker. With a large vocabulary uint16 and uint32 ids mix at random, and a branch per
        // width mispredicts about every other id: about 9 ns per id on the project's machine
        // against about 4 for this loop (`--bench precise`, `decode_only`; a length looked up
        // in a table instead measured about 6, the lookup being on the loop's dependency
        // chain). Any other marker, and the ids in the payload's last 7 bytes, go through
        // `token` (the same values and errors as before).
        let mut rest = self.rest.remaining_slice();
        let mut done = 0;
        while done < n {
            let Some(window) = rest.first_chunk::<8>() else { break };
            let m = u32::from(window[0]);
            if m >= 0x80 && !(0xcc..=0xce).contains(&m) {
                self.rest = Bytes::new(rest);
                out.push(self.token(site)?);
                rest = self.rest.remaining_slice();
            } else {
                // The length from the marker by arithmetic (on the loop's dependency chain:
                // where the next id starts), then the value from the bytes after the marker.
                let len = if m < 0x80 { 1 } else { m - 0xca + u32::from(m == 0xce) };
                let after = u32::from_be_bytes([window[1], window[2], window[3], window[4]]);
                let wide = (u64::from(after) >> ((5 - len) * 8)) as u32;
                out.push(if m < 0x80 { m } else { wide });
                rest = rest.get(len as usize..).unwrap_or_default();
            }
            done += 1;
        }
        // The ids in the payload's last 7 bytes.
        self.rest = Bytes::new(rest);
        for _ in done..n {
            out.push(self.token(site)?);
        }
        Ok(out)
    }

    /// One token id (slow path): any int in `0..=u32::MAX`, or an SGLang bigram pair
    /// `[t, t_next]` (→ `t`).
    fn token(&mut self, site: ErrorSite) -> Result<u32, EventError> {
        if self.rest.remaining_slice().first() == Some(&0x92) {
            // SGLang EAGLE bigram page entry: keep the first token, validate the second.
            self.advance(1);
            let first = self.u32(site)?;
            self.u32(site)?;
            return Ok(first);
        }
        let (offset, v) = self.int(site, "int token id (or [int, int] pair)")?;
        u32::try_from(v).map_err(|_| EventError::IntOutOfRange { offset, site, value: v, range: "0..=4294967295" })
    }

    /// Medium string → tier; nil → GPU (`None` here, defaulted by the caller).
    fn medium(&mut self, site: ErrorSite) -> Result<Option<Medium>, EventError> {
        if self.take_nil() {
            return Ok(None);
        }
        let (offset, s) = self.raw_str(site)?;
        const TABLE: [(&[u8], Medium); 6] = [
            (b"GPU", Medium::Gpu),
            (b"CPU", Medium::Cpu),
            (b"CPU_PINNED", Medium::Cpu),
            (b"STORAGE", Medium::Storage),
            (b"DISK", Medium::Storage),
            (b"EXTERNAL", Medium::Storage),
        ];
        match TABLE.iter().find(|(name, _)| name.eq_ignore_ascii_case(s)) {
            Some(&(_, m)) => Ok(Some(m)),
            None => match std::str::from_utf8(s) {
                Ok(s) => Err(EventError::UnknownMedium {
                    offset,
                    event: site.event.unwrap_or_default(),
                    medium: s.to_owned(),
                }),
                Err(_) => Err(EventError::InvalidUtf8 { offset, site }),
            },
        }
    }

    /// `extra_keys`: nil or an array (one entry per block) of nil or arrays of values, in vLLM's
    /// untagged form: the LoRA name (a str, when the blocks have one), `(mm_hash, offset)` pairs
    /// (arrays), the cache_salt (a str, first block only), prompt-embeds digests (bin).
    ///
    /// Returns the top-level strings of the first entry, and per block a fingerprint of the raw
    /// msgpack bytes of every non-string value (0 when a block has none; an empty vector when no
    /// block has any).
    fn extra_keys(&mut self, site: ErrorSite) -> Result<(Vec<String>, Vec<u64>), EventError> {
        if self.take_nil() {
            return Ok((Vec::new(), Vec::new()));
        }
        let blocks = self.array_len(site)?;
        let mut strings = Vec::new();
        let mut content: Vec<u64> = Vec::new();
        for b in 0..blocks {
            if self.take_nil() {
                if !content.is_empty() {
                    content.push(0);
                }
                continue;
            }
            let n = self.array_len(site)?;
            let mut fp: Option<Xxh3> = None;
            for _ in 0..n {
                match self.peek(site)? {
                    Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                        let s = self.str(site)?;
                        if b == 0 {
                            strings.push(s.to_owned());
                        }
                    }
                    _ => {
                        let before = self.rest.remaining_slice();
                        self.skip(site)?;
                        let raw = &before[..before.len() - self.remaining()];
                        fp.get_or_insert_with(|| Xxh3::with_seed(CONTENT_KEY_SEED)).update(raw);
                    }
                }
            }
            if let Some(fp) = fp {
                // 0 means "none": a fingerprint that happens to be 0 becomes 1.
                let key = fp.digest().max(1);
                if content.is_empty() {
                    content.resize(b, 0);
                }
                content.push(key);
            } else if !content.is_empty() {
                content.push(0);
            }
        }
        Ok((strings, content))
    }

    /// `lookahead_token_ids`: nil or an array (one entry per block) of token-id arrays.
    fn lookahead(&mut self, site: ErrorSite) -> Result<Vec<Vec<u32>>, EventError> {
        if self.take_nil() {
            return Ok(Vec::new());
        }
        let blocks = self.array_len(site)?;
        let mut out = Vec::with_capacity(blocks);
        for _ in 0..blocks {
            out.push(if self.take_nil() { Vec::new() } else { self.token_ids(site)? });
        }
        Ok(out)
    }

    /// Skips one value of any type, iteratively (no recursion: nesting depth costs no stack).
    fn skip(&mut self, site: ErrorSite) -> Result<(), EventError> {
        // Values still to skip; every one needs at least a byte, so `pending <= remaining`.
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            let offset = self.offset();
            let rest = self.rest.remaining_slice();
            let Some((&b, after)) = rest.split_first() else {
                return Err(EventError::Truncated { offset, site });
            };
            let be = |k: usize| -> Result<u64, EventError> {
                after
                    .get(..k)
                    .map(|s| s.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
                    .ok_or(EventError::Truncated { offset, site })
            };
            // (header bytes after the marker, payload bytes, child values)
            let (header, payload, children): (usize, u64, u64) = match Marker::from_u8(b) {
                Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => (0, 0, 0),
                Marker::U8 | Marker::I8 => (0, 1, 0),
                Marker::U16 | Marker::I16 => (0, 2, 0),
                Marker::U32 | Marker::I32 | Marker::F32 => (0, 4, 0),
                Marker::U64 | Marker::I64 | Marker::F64 => (0, 8, 0),
                Marker::FixStr(n) => (0, u64::from(n), 0),
                Marker::Str8 | Marker::Bin8 => (1, be(1)?, 0),
                Marker::Str16 | Marker::Bin16 => (2, be(2)?, 0),
                Marker::Str32 | Marker::Bin32 => (4, be(4)?, 0),
                Marker::FixArray(n) => (0, 0, u64::from(n)),
                Marker::Array16 => (2, 0, be(2)?),
                Marker::Array32 => (4, 0, be(4)?),
                Marker::FixMap(n) => (0, 0, 2 * u64::from(n)),
                Marker::Map16 => (2, 0, 2 * be(2)?),
                Marker::Map32 => (4, 0, 2 * be(4)?),
                // ext: type byte + data
                Marker::FixExt1 => (0, 2, 0),
                Marker::FixExt2 => (0, 3, 0),
                Marker::FixExt4 => (0, 5, 0),
                Marker::FixExt8 => (0, 9, 0),
                Marker::FixExt16 => (0, 17, 0),
                Marker::Ext8 => (1, be(1)? + 1, 0),
                Marker::Ext16 => (2, be(2)? + 1, 0),
                Marker::Ext32 => (4, be(4)? + 1, 0),
                Marker::Reserved => return Err(self.wrong_type(offset, site, "a msgpack value", Marker::Reserved)),
            };
            let left = (after.len() - header) as u64;
            pending += children;
            if payload > left || pending > left - payload {
                return Err(EventError::LengthExceedsInput {
                    offset,
                    site,
                    declared: payload.max(children),
                    remaining: after.len() - header,
                });
            }
            // `1 + header + payload <= rest.len()` was just checked.
            self.advance(1 + header + payload as usize);
        }
        Ok(())
    }
}

fn marker_name(m: Marker) -> &'static str {
    match m {
        Marker::Null => "nil",
        Marker::True | Marker::False => "bool",
        Marker::FixPos(_)
        | Marker::FixNeg(_)
        | Marker::U8
        | Marker::U16
        | Marker::U32
        | Marker::U64
        | Marker::I8
        | Marker::I16
        | Marker::I32
        | Marker::I64 => "int",
        Marker::F32 | Marker::F64 => "float",
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => "str",
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => "bin",
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => "array",
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => "map",
        Marker::FixExt1
        | Marker::FixExt2
        | Marker::FixExt4
        | Marker::FixExt8
        | Marker::FixExt16
        | Marker::Ext8
        | Marker::Ext16
        | Marker::Ext32 => "ext",
        Marker::Reserved => "reserved byte 0xc1",
    }
}

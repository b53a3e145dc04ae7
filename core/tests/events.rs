//! KV-event decoding: payloads captured from vLLM's and SGLang's own publishers decode to the
//! values their sidecars record; malformed payloads are typed errors (never a panic, never a
//! partial batch, never a huge allocation).
#![allow(clippy::unwrap_used, clippy::expect_used)]
// Sans-IO is the library's rule (core/clippy.toml): the ignored throughput report here times
// the decoder with Instant.
#![allow(clippy::disallowed_methods)]
// The only unsafe code: a pass-through global allocator that records the largest allocation.
#![allow(unsafe_code)]

use kvroute::{decode_batch, BlockRemoved, BlockStored, ErrorSite, EventBatch, EventError, KvEvent, Medium};
use proptest::prelude::*;
use serde_json::Value;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------------------------------------
// Largest single allocation made by this thread (to prove length headers are checked first).
// ---------------------------------------------------------------------------------------------

struct TrackLargest;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for TrackLargest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LARGEST.try_with(|m| m.set(m.get().max(layout.size())));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = LARGEST.try_with(|m| m.set(m.get().max(new_size)));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: TrackLargest = TrackLargest;

/// Decodes and reports the largest single allocation the decode made.
fn decode_tracked(payload: &[u8]) -> (Result<EventBatch, EventError>, usize) {
    LARGEST.with(|m| m.set(0));
    let r = decode_batch(payload);
    (r, LARGEST.with(Cell::get))
}

// ---------------------------------------------------------------------------------------------
// A tiny msgpack writer for hand-made payloads.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum V {
    Nil,
    Bool(bool),
    Int(i128),
    F64(f64),
    Str(&'static str),
    Bin(Vec<u8>),
    Arr(Vec<V>),
    Map(Vec<(V, V)>),
    /// Bytes written as they are (for headers lying about lengths, ext values, ...).
    Raw(Vec<u8>),
}

fn enc(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::Bool(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        V::Int(i) => {
            let i = *i;
            if (0..=0x7f).contains(&i) {
                out.push(i as u8);
            } else if (-32..0).contains(&i) {
                out.push(i as i8 as u8);
            } else if (0..=0xff).contains(&i) {
                out.extend([0xcc, i as u8]);
            } else if (0..=0xffff).contains(&i) {
                out.push(0xcd);
                out.extend((i as u16).to_be_bytes());
            } else if (0..=0xffff_ffff).contains(&i) {
                out.push(0xce);
                out.extend((i as u32).to_be_bytes());
            } else if i >= 0 {
                out.push(0xcf);
                out.extend((i as u64).to_be_bytes());
            } else {
                out.push(0xd3);
                out.extend((i as i64).to_be_bytes());
            }
        }
        V::F64(f) => {
            out.push(0xcb);
            out.extend(f.to_be_bytes());
        }
        V::Str(s) => {
            if s.len() < 32 {
                out.push(0xa0 | s.len() as u8);
            } else {
                out.push(0xd9);
                out.push(s.len() as u8);
            }
            out.extend(s.as_bytes());
        }
        V::Bin(b) => {
            out.extend([0xc4, b.len() as u8]);
            out.extend(b);
        }
        V::Arr(items) => {
            if items.len() < 16 {
                out.push(0x90 | items.len() as u8);
            } else {
                out.push(0xdc);
                out.extend((items.len() as u16).to_be_bytes());
            }
            items.iter().for_each(|x| enc(x, out));
        }
        V::Map(kv) => {
            if kv.len() < 16 {
                out.push(0x80 | kv.len() as u8);
            } else {
                out.push(0xde);
                out.extend((kv.len() as u16).to_be_bytes());
            }
            for (k, v) in kv {
                enc(k, out);
                enc(v, out);
            }
        }
        V::Raw(b) => out.extend(b),
    }
}

fn bytes(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    enc(v, &mut out);
    out
}

fn s(x: &'static str) -> V {
    V::Str(x)
}
fn i(x: i128) -> V {
    V::Int(x)
}
fn arr(x: impl IntoIterator<Item = V>) -> V {
    V::Arr(x.into_iter().collect())
}
fn map(x: impl IntoIterator<Item = (&'static str, V)>) -> V {
    V::Map(x.into_iter().map(|(k, v)| (V::Str(k), v)).collect())
}
fn ints(x: impl IntoIterator<Item = i128>) -> V {
    arr(x.into_iter().map(V::Int))
}
fn batch(events: Vec<V>, rank: V) -> Vec<u8> {
    bytes(&arr([V::F64(1.5), V::Arr(events), rank]))
}

/// A vLLM ≥ 0.24 map-encoded BlockStored (required fields, nil where vLLM sends nil).
fn stored_map(hashes: V, parent: V, tokens: V) -> Vec<(&'static str, V)> {
    vec![
        ("type", s("BlockStored")),
        ("block_hashes", hashes),
        ("parent_block_hash", parent),
        ("token_ids", tokens),
        ("block_size", i(2)),
        ("lora_id", V::Nil),
        ("medium", s("GPU")),
        ("lora_name", V::Nil),
    ]
}

fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, block_size: u32, medium: Medium) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: tokens,
        block_size,
        lora_id: None,
        medium,
        lora_name: None,
        group_idx: None,
        cache_salt: None,
        ..Default::default()
    })
}

fn err(payload: &[u8]) -> EventError {
    match decode_batch(payload) {
        Ok(b) => panic!("expected an error, decoded {b:?}"),
        Err(e) => e,
    }
}

fn site(event: usize, field: &'static str) -> ErrorSite {
    ErrorSite { event: Some(event), field }
}

// ---------------------------------------------------------------------------------------------
// Fixtures captured from the engines' own publishers (fixtures/events, see its README).
// ---------------------------------------------------------------------------------------------

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/events")
}

struct Fixture {
    name: String,
    payload: Vec<u8>,
    doc: Value,
}

fn fixtures() -> &'static [Fixture] {
    static ALL: std::sync::OnceLock<Vec<Fixture>> = std::sync::OnceLock::new();
    ALL.get_or_init(load_fixtures)
}

fn load_fixtures() -> Vec<Fixture> {
    let mut out: Vec<Fixture> = std::fs::read_dir(fixture_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            let doc: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            let payload = std::fs::read(fixture_dir().join(doc["payload"].as_str().unwrap())).unwrap();
            Fixture { name: p.file_stem().unwrap().to_string_lossy().into_owned(), payload, doc }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    assert!(out.len() >= 18, "fixtures/events has only {} fixtures", out.len());
    out
}

fn opt_u64(v: &Value) -> Option<u64> {
    v.as_u64().or_else(|| assert_null(v))
}
fn opt_i64(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| assert_null(v))
}
fn opt_u32(v: &Value) -> Option<u32> {
    v.as_u64().map(|x| u32::try_from(x).unwrap()).or_else(|| assert_null(v))
}
fn assert_null<T>(v: &Value) -> Option<T> {
    assert!(v.is_null(), "expected null, got {v}");
    None
}
fn opt_string(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned).or_else(|| assert_null(v))
}
fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}
fn medium(v: &Value) -> Medium {
    match v.as_str().unwrap() {
        "gpu" => Medium::Gpu,
        "cpu" => Medium::Cpu,
        "storage" => Medium::Storage,
        other => panic!("medium {other}"),
    }
}

/// The sidecar's `expected` object as the crate's types (independent of their Serialize form).
fn expected(doc: &Value) -> EventBatch {
    let e = &doc["expected"];
    let events = e["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ev| match ev["type"].as_str().unwrap() {
            "BlockStored" => KvEvent::BlockStored(BlockStored {
                block_hashes: u64s(&ev["block_hashes"]),
                parent_block_hash: opt_u64(&ev["parent_block_hash"]),
                token_ids: u64s(&ev["token_ids"]).into_iter().map(|t| u32::try_from(t).unwrap()).collect(),
                block_size: u32::try_from(ev["block_size"].as_u64().unwrap()).unwrap(),
                lora_id: opt_i64(&ev["lora_id"]),
                medium: medium(&ev["medium"]),
                lora_name: ev["lora_name"].as_str().map(str::to_owned).or_else(|| assert_null(&ev["lora_name"])),
                group_idx: opt_u32(&ev["group_idx"]),
                cache_salt: ev["cache_salt"].as_str().map(str::to_owned).or_else(|| assert_null(&ev["cache_salt"])),
                content_keys: u64s(&ev["content_keys"]),
                lookahead_token_ids: ev["lookahead_token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|b| u64s(b).into_iter().map(|t| u32::try_from(t).unwrap()).collect())
                    .collect(),
                ownership: opt_string(&ev["ownership"]),
                session_id: opt_string(&ev["session_id"]),
            }),
            "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: u64s(&ev["block_hashes"]),
                medium: medium(&ev["medium"]),
                group_idx: opt_u32(&ev["group_idx"]),
                ownership: opt_string(&ev["ownership"]),
            }),
            "AllBlocksCleared" => KvEvent::AllBlocksCleared,
            other => panic!("type {other}"),
        })
        .collect();
    EventBatch { ts: e["ts"].as_f64().unwrap(), events, data_parallel_rank: opt_i64(&e["data_parallel_rank"]) }
}

#[test]
fn every_fixture_decodes_to_its_expected_values() {
    for f in fixtures() {
        let got = decode_batch(&f.payload).unwrap_or_else(|e| panic!("{}: {e}", f.name));
        assert_eq!(got, expected(&f.doc), "{}", f.name);
        assert_eq!(got.ts.to_bits(), expected(&f.doc).ts.to_bits(), "{}", f.name);
    }
}

#[test]
fn fixtures_cover_both_vllm_encodings_and_sglang() {
    let all = fixtures();
    let first_event_kind = |f: &Fixture| {
        // [ts(9 bytes: 0xcb + f64), [events...]]: batch fixarray, ts, events header, then event 0.
        assert_eq!(f.payload[1], 0xcb, "{}: ts is a float64", f.name);
        match f.payload[11] {
            0x90..=0x9f | 0xdc | 0xdd => "array",
            // msgspec writes map16 (0xde) for structs with more than 15 fields (vLLM 0.33's
            // BlockStored), whatever omit_defaults leaves out.
            0x80..=0x8f | 0xde | 0xdf => "map",
            other => panic!("{}: event 0 starts with {other:#x}", f.name),
        }
    };
    for f in all {
        let engine = f.doc["engine"].as_str().unwrap();
        let version = f.doc["engine_version"].as_str().unwrap();
        match (engine, version) {
            ("vllm", "0.23.0") => assert_eq!(first_event_kind(f), "array", "{}", f.name),
            ("vllm", "0.33.0") | ("sglang", _) => assert_eq!(first_event_kind(f), "map", "{}", f.name),
            other => panic!("{}: unexpected source {other:?}", f.name),
        }
    }
    for name in ["vllm023_stored_bytes_hashes", "vllm033_stored_bytes_hashes"] {
        let f = all.iter().find(|f| f.name == name).unwrap();
        assert!(f.payload.windows(2).any(|w| w == [0xc4, 32]), "{name}: 32-byte sha256 digests as bin8");
        assert!(f.payload.windows(2).any(|w| w == [0xc4, 16]), "{name}: 16-byte xxh3-128 digests as bin8");
    }
    let sg = all.iter().find(|f| f.name == "sglang_stored_pages").unwrap();
    assert!(sg.payload.contains(&0xd3), "SGLang negative hashes are int64");
}

/// The same inputs published by vLLM 0.23 (array events) and 0.33 (map events) decode alike.
#[test]
fn array_and_map_encodings_decode_to_the_same_batches() {
    let all = fixtures();
    let mut pairs = 0;
    for f in all.iter().filter(|f| f.name.starts_with("vllm023_")) {
        let twin = all.iter().find(|g| g.name == f.name.replace("vllm023_", "vllm033_")).unwrap();
        assert_ne!(f.payload, twin.payload);
        // 0.33 adds ownership, session_id and lookahead_token_ids (set in one fixture only).
        let mut new = decode_batch(&twin.payload).unwrap();
        let mut stripped = 0;
        for ev in &mut new.events {
            if let KvEvent::BlockStored(s) = ev {
                if s.ownership.is_some() || s.session_id.is_some() || !s.lookahead_token_ids.is_empty() {
                    stripped += 1;
                }
                (s.ownership, s.session_id, s.lookahead_token_ids) = (None, None, Vec::new());
            }
        }
        assert_eq!(stripped, usize::from(f.name.ends_with("optional_fields")), "{}", f.name);
        assert_eq!(decode_batch(&f.payload).unwrap(), new, "{}", f.name);
        pairs += 1;
    }
    assert_eq!(pairs, 7);
}

#[test]
fn bytes_hashes_reduce_to_the_int_form() {
    // vLLM's int form is int.from_bytes(digest, "big") & (2**64 - 1): the same blocks published
    // with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 and =0 must decode to the same u64.
    let all = fixtures();
    let by_name = |n: &str| decode_batch(&all.iter().find(|f| f.name == n).unwrap().payload).unwrap();
    let ints = by_name("vllm033_stored_int_root");
    let bytes = by_name("vllm033_stored_bytes_hashes");
    let hashes = |b: &EventBatch| match &b.events[0] {
        KvEvent::BlockStored(s) => s.block_hashes.clone(),
        e => panic!("{e:?}"),
    };
    assert_eq!(hashes(&ints), hashes(&bytes));
}

#[test]
fn every_truncation_of_every_fixture_is_an_error() {
    for f in fixtures() {
        for cut in 0..f.payload.len() {
            match decode_batch(&f.payload[..cut]) {
                Err(EventError::Truncated { offset, .. }) | Err(EventError::LengthExceedsInput { offset, .. }) => {
                    assert!(offset <= cut, "{} cut at {cut}: offset {offset}", f.name);
                }
                other => panic!("{} cut at {cut}: {other:?}", f.name),
            }
        }
    }
}

#[test]
fn trailing_bytes_after_a_fixture_are_an_error() {
    for f in fixtures() {
        let mut p = f.payload.clone();
        p.extend([0xc0, 0x01]);
        assert_eq!(err(&p), EventError::TrailingBytes { offset: f.payload.len(), remaining: 2 }, "{}", f.name);
    }
}

#[test]
fn bit_flips_never_panic_and_errors_point_inside_the_payload() {
    let mut decoded = 0usize;
    let mut rejected = 0usize;
    for f in fixtures() {
        for pos in 0..f.payload.len() {
            for bit in 0..8 {
                let mut p = f.payload.clone();
                p[pos] ^= 1 << bit;
                let (r, largest) = decode_tracked(&p);
                assert!(largest <= 64 * p.len() + 4096, "{} flip {pos}.{bit}: allocated {largest} bytes", f.name);
                match r {
                    Ok(_) => decoded += 1,
                    Err(e) => {
                        rejected += 1;
                        assert!(e.offset() <= p.len(), "{} flip {pos}.{bit}: {e}", f.name);
                    }
                }
            }
        }
    }
    // Both outcomes occur: flips in values (token ids, hashes) decode, flips in markers do not.
    assert!(decoded > 1000 && rejected > 1000, "decoded {decoded}, rejected {rejected}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(p in proptest::collection::vec(any::<u8>(), 0..256)) {
        let (r, largest) = decode_tracked(&p);
        prop_assert!(largest <= 64 * p.len() + 4096);
        if let Err(e) = r {
            prop_assert!(e.offset() <= p.len());
        }
    }

    #[test]
    fn spliced_fixtures_never_panic(which in 0usize..64, at in any::<prop::sample::Index>(),
                                    junk in proptest::collection::vec(any::<u8>(), 1..16)) {
        let all = fixtures();
        let f = &all[which % all.len()];
        let at = at.index(f.payload.len());
        let mut p = f.payload[..at].to_vec();
        p.extend(&junk);
        p.extend(&f.payload[at..]);
        let (r, largest) = decode_tracked(&p);
        prop_assert!(largest <= 64 * p.len() + 4096);
        if let Err(e) = r {
            prop_assert!(e.offset() <= p.len());
        }
    }
}

/// Token id `v` in msgpack encoding `form` (0..9: positive fixint, uint8/16/32/64, int8/16/32/64),
/// or the smallest encoding when `form` cannot hold `v`.
fn token_encoding(v: u32, form: u8, out: &mut Vec<u8>) {
    let v64 = u64::from(v);
    match form {
        0 if v < 0x80 => out.push(v as u8),
        1 if v <= 0xff => out.extend([0xcc, v as u8]),
        2 if v <= 0xffff => {
            out.push(0xcd);
            out.extend((v as u16).to_be_bytes());
        }
        3 => {
            out.push(0xce);
            out.extend(v.to_be_bytes());
        }
        4 => {
            out.push(0xcf);
            out.extend(v64.to_be_bytes());
        }
        5 if v < 0x80 => out.extend([0xd0, v as u8]),
        6 if v < 0x8000 => {
            out.push(0xd1);
            out.extend((v as i16).to_be_bytes());
        }
        7 if v < 0x8000_0000 => {
            out.push(0xd2);
            out.extend((v as i32).to_be_bytes());
        }
        8 => {
            out.push(0xd3);
            out.extend((v64 as i64).to_be_bytes());
        }
        _ => enc(&i(i128::from(v)), out),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    /// The decoder's token-id loop takes fixint and uint8/16/32 ids without a branch on their
    /// width while 8 bytes are left, the rest of the encodings and the last bytes of the payload
    /// another way: every encoding of every width, at every distance from the payload's end
    /// (the token list is the last value before the batch's final nil), decodes to the ids.
    #[test]
    fn token_ids_decode_in_every_encoding_and_position(
        tokens in proptest::collection::vec(
            (prop_oneof![0u32..0x80, 0x80u32..0x100, 0x100u32..0x1_0000, 0x1_0000u32..=u32::MAX], 0u8..10),
            0..40,
        ),
    ) {
        let mut list = Vec::new();
        if tokens.len() < 16 {
            list.push(0x90 | tokens.len() as u8);
        } else {
            list.push(0xdc);
            list.extend((tokens.len() as u16).to_be_bytes());
        }
        for &(v, form) in &tokens {
            token_encoding(v, form, &mut list);
        }
        let mut fields = stored_map(ints([1]), V::Nil, V::Nil);
        fields.retain(|(k, _)| *k != "token_ids");
        fields.push(("token_ids", V::Raw(list)));
        let p = batch(vec![map(fields)], V::Nil);
        let decoded = decode_batch(&p).unwrap();
        let KvEvent::BlockStored(st) = &decoded.events[0] else { panic!("not a BlockStored") };
        prop_assert_eq!(&st.token_ids, &tokens.iter().map(|&(v, _)| v).collect::<Vec<_>>());
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-made payloads: encodings older/newer releases send, and each error.
// ---------------------------------------------------------------------------------------------

#[test]
fn old_vllm_short_arrays_and_two_element_batches() {
    // vLLM 0.8-era BlockStored had no medium / lora_name / extra_keys; batches had no rank.
    let p = bytes(&arr([
        V::F64(2.0),
        arr([
            arr([s("BlockStored"), ints([1, 2]), V::Nil, ints([5, 6, 7, 8]), i(2)]),
            arr([s("BlockStored"), ints([3]), i(2), ints([9, 10]), i(2), i(4)]),
            arr([s("BlockRemoved"), ints([1])]),
        ]),
    ]));
    let b = decode_batch(&p).unwrap();
    assert_eq!(b.data_parallel_rank, None);
    assert_eq!(b.events[0], stored(vec![1, 2], None, vec![5, 6, 7, 8], 2, Medium::Gpu));
    let KvEvent::BlockStored(second) = &b.events[1] else { panic!() };
    assert_eq!((second.parent_block_hash, second.lora_id, second.medium), (Some(2), Some(4), Medium::Gpu));
    assert_eq!(
        b.events[2],
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![1],
            medium: Medium::Gpu,
            group_idx: None,
            ..Default::default()
        })
    );
}

#[test]
fn extra_trailing_positions_are_skipped() {
    // A future release appending fields to the array forms or to the batch array.
    let p = bytes(&arr([
        V::F64(2.0),
        arr([
            arr([
                s("BlockStored"),
                ints([1]),
                V::Nil,
                ints([5, 6]),
                i(2),
                V::Nil,
                s("CPU"),
                s("lora-x"),
                arr([arr([s("lora-x")])]),
                i(3),
                s("full_attention"),
                V::Nil,
                map([("future", ints([1, 2]))]),
                V::F64(0.5),
            ]),
            arr([s("BlockRemoved"), ints([1]), s("CPU"), i(3), s("LOCAL")]),
            arr([s("AllBlocksCleared"), V::Nil]),
        ]),
        i(5),
        s("future batch field"),
        arr([]),
    ]));
    let b = decode_batch(&p).unwrap();
    assert_eq!(b.data_parallel_rank, Some(5));
    let KvEvent::BlockStored(st) = &b.events[0] else { panic!() };
    assert_eq!((st.medium, st.lora_name.as_deref(), st.group_idx), (Medium::Cpu, Some("lora-x"), Some(3)));
    assert_eq!(
        b.events[1],
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![1],
            medium: Medium::Cpu,
            group_idx: Some(3),
            ..Default::default()
        })
    );
    assert_eq!(b.events[2], KvEvent::AllBlocksCleared);
}

#[test]
fn cache_salt_and_remote_locality_are_read() {
    // vLLM's untagged extra keys of the first block: (lora_name, mm tuple, cache_salt).
    let mut m = stored_map(ints([9]), V::Nil, ints([1, 2]));
    m.retain(|(k, _)| *k != "lora_name");
    m.extend([
        ("lora_name", s("lora")),
        ("extra_keys", arr([arr([s("lora"), arr([s("mm"), i(0)]), s("salt")]), V::Nil])),
        ("locality", s("REMOTE")),
    ]);
    let b = decode_batch(&batch(vec![map(m)], i(0))).unwrap();
    let KvEvent::BlockStored(st) = &b.events[0] else { panic!() };
    assert_eq!(st.cache_salt.as_deref(), Some("salt"));
    assert_eq!(st.lora_name.as_deref(), Some("lora"));
    assert_eq!(st.medium, Medium::Storage, "REMOTE blocks count at the storage tier");
    // Without a LoRA name the first string is the salt; an empty salt counts as none.
    for (extra, want) in [(arr([arr([s("t1")])]), Some("t1")), (arr([arr([s("")])]), None), (V::Nil, None)] {
        let mut m = stored_map(ints([9]), V::Nil, ints([1, 2]));
        m.push(("extra_keys", extra));
        let b = decode_batch(&batch(vec![map(m)], i(0))).unwrap();
        let KvEvent::BlockStored(st) = &b.events[0] else { panic!() };
        assert_eq!(st.cache_salt.as_deref(), want);
    }
}

#[test]
fn unknown_map_keys_are_ignored_whatever_their_value() {
    let plain = batch(vec![map(stored_map(ints([9]), V::Nil, ints([1, 2])))], i(0));
    let mut noisy = vec![("zzz_first", map([("nested", arr([arr([arr([V::Nil])])]))]))];
    noisy.extend(stored_map(ints([9]), V::Nil, ints([1, 2])));
    noisy.extend([
        ("kv_cache_spec_kind", s("sliding_window")),
        ("locality", s("LOCAL")),
        ("block_offsets", arr([ints([1, 2])])),
        ("a_float", V::F64(1.0)),
        ("a_bool", V::Bool(true)),
        ("a_bin", V::Bin(vec![0; 40])),
        // fixext4, ext8 (len 3) and a negative int64
        ("an_ext", V::Raw(vec![0xd6, 0x01, 1, 2, 3, 4])),
    ]);
    assert!(noisy.len() >= 16, "exercises map16 too");
    let noisy = map(noisy);
    let p = batch(vec![noisy], i(0));
    assert_eq!(decode_batch(&p).unwrap(), decode_batch(&plain).unwrap());
    let ext8 = batch(
        vec![map([("type", s("AllBlocksCleared")), ("x", V::Raw(vec![0xc7, 3, 0x05, 1, 2, 3])), ("y", i(-1 << 40))])],
        i(0),
    );
    assert_eq!(decode_batch(&ext8).unwrap().events, vec![KvEvent::AllBlocksCleared]);
}

#[test]
fn deeply_nested_unknown_values_are_skipped_without_recursion() {
    let depth = 200_000;
    let mut raw = vec![0x91; depth];
    raw.push(0xc0);
    let p = batch(vec![map([("type", s("AllBlocksCleared")), ("deep", V::Raw(raw.clone()))])], V::Nil);
    assert_eq!(decode_batch(&p).unwrap().events, vec![KvEvent::AllBlocksCleared]);
    // The same nesting with its innermost value missing is a truncation, not a stack overflow.
    raw.pop();
    let mut p = batch(vec![map([("type", s("AllBlocksCleared")), ("deep", V::Raw(raw))])], V::Nil);
    p.pop(); // drop the rank so the nesting really runs out of input
    assert!(matches!(err(&p), EventError::Truncated { .. } | EventError::LengthExceedsInput { .. }));
}

#[test]
fn map_keys_in_any_order_and_defaults() {
    // `type` last, no parent key, no medium key: root chain on GPU.
    let p = batch(
        vec![map([
            ("token_ids", ints([3, 4])),
            ("block_size", i(2)),
            ("block_hashes", ints([7])),
            ("type", s("BlockStored")),
        ])],
        V::Nil,
    );
    let b = decode_batch(&p).unwrap();
    assert_eq!(b.events, vec![stored(vec![7], None, vec![3, 4], 2, Medium::Gpu)]);
    assert_eq!(b.data_parallel_rank, None);
}

#[test]
fn block_hash_forms() {
    let sha = (0u8..32).collect::<Vec<_>>();
    let xxh = (100u8..116).collect::<Vec<_>>();
    let p = batch(
        vec![map([
            ("type", s("BlockRemoved")),
            (
                "block_hashes",
                arr([
                    i(0),
                    i(i128::from(u64::MAX)),
                    i(-1),
                    i(i128::from(i64::MIN)),
                    i(-2),
                    V::Bin(sha.clone()),
                    V::Bin(xxh.clone()),
                    V::Bin(vec![1, 2, 3, 4, 5, 6, 7, 8]),
                ]),
            ),
        ])],
        V::Nil,
    );
    let b = decode_batch(&p).unwrap();
    let KvEvent::BlockRemoved(r) = &b.events[0] else { panic!() };
    let last8 = |d: &[u8]| u64::from_be_bytes(d[d.len() - 8..].try_into().unwrap());
    assert_eq!(
        r.block_hashes,
        vec![0, u64::MAX, u64::MAX, 1 << 63, u64::MAX - 1, last8(&sha), last8(&xxh), 0x0102030405060708]
    );
    // Shorter than 8 bytes: typed error naming the event and field.
    let p = batch(vec![map([("type", s("BlockRemoved")), ("block_hashes", arr([V::Bin(vec![1; 7])]))])], V::Nil);
    assert!(
        matches!(err(&p), EventError::ShortHashDigest { len: 7, site, .. } if site == self::site(0, "block_hashes"))
    );
    // Floats and strings are not hashes.
    let p = batch(vec![map([("type", s("BlockRemoved")), ("block_hashes", arr([V::F64(1.0)]))])], V::Nil);
    assert!(matches!(err(&p), EventError::WrongType { found: "float", .. }));
    let p = batch(vec![map(stored_map(ints([1]), s("abc"), ints([1, 2])))], V::Nil);
    assert!(
        matches!(err(&p), EventError::WrongType { found: "str", site, .. } if site == self::site(0, "parent_block_hash"))
    );
}

#[test]
fn token_ids_must_fit_u32() {
    let ok = batch(
        vec![map(stored_map(ints([1]), V::Nil, ints([0, 127, 128, 255, 65535, 65536, i128::from(u32::MAX)])))],
        V::Nil,
    );
    let KvEvent::BlockStored(st) = &decode_batch(&ok).unwrap().events[0] else { panic!() };
    assert_eq!(st.token_ids, vec![0, 127, 128, 255, 65535, 65536, u32::MAX]);
    // uint64 and int64 encodings of in-range values are fine too.
    let wide = batch(
        vec![map(stored_map(ints([1]), V::Nil, V::Raw(vec![0x92, 0xcf, 0, 0, 0, 0, 0, 0, 0, 9, 0xd0, 5])))],
        V::Nil,
    );
    let KvEvent::BlockStored(st) = &decode_batch(&wide).unwrap().events[0] else { panic!() };
    assert_eq!(st.token_ids, vec![9, 5]);

    let second_event =
        |tokens: V| batch(vec![arr([s("AllBlocksCleared")]), map(stored_map(ints([1]), V::Nil, tokens))], V::Nil);
    let e = err(&second_event(ints([1, -1])));
    assert!(
        matches!(e, EventError::IntOutOfRange { value: -1, site, .. } if site == self::site(1, "token_ids")),
        "{e:?}"
    );
    assert!(e.to_string().contains("event 1 field `token_ids`"), "{e}");
    let e = err(&second_event(ints([1 << 32])));
    assert!(matches!(e, EventError::IntOutOfRange { value: 4294967296, .. }), "{e:?}");
    let e = err(&second_event(arr([s("7")])));
    assert!(matches!(e, EventError::WrongType { found: "str", .. }), "{e:?}");
    let e = err(&second_event(arr([V::Nil])));
    assert!(matches!(e, EventError::WrongType { found: "nil", .. }), "{e:?}");
}

#[test]
fn sglang_bigram_pages_keep_the_first_token_of_each_pair() {
    let p = batch(vec![map(stored_map(ints([1]), V::Nil, arr([ints([10, 11]), ints([11, 12])])))], i(0));
    let KvEvent::BlockStored(st) = &decode_batch(&p).unwrap().events[0] else { panic!() };
    assert_eq!(st.token_ids, vec![10, 11]);
    let p = batch(vec![map(stored_map(ints([1]), V::Nil, arr([ints([10, 11, 12])])))], i(0));
    assert!(matches!(err(&p), EventError::WrongType { found: "array", .. }));
    let p = batch(vec![map(stored_map(ints([1]), V::Nil, arr([ints([10, -11])])))], i(0));
    assert!(matches!(err(&p), EventError::IntOutOfRange { value: -11, .. }));
}

#[test]
fn media_and_their_aliases() {
    let with_medium =
        |m: V| batch(vec![map([("type", s("BlockRemoved")), ("block_hashes", ints([1])), ("medium", m)])], V::Nil);
    for (name, want) in [
        ("GPU", Medium::Gpu),
        ("gpu", Medium::Gpu),
        ("CPU", Medium::Cpu),
        ("cpu", Medium::Cpu),
        ("CPU_PINNED", Medium::Cpu),
        ("STORAGE", Medium::Storage),
        ("DISK", Medium::Storage),
        ("EXTERNAL", Medium::Storage),
    ] {
        let KvEvent::BlockRemoved(r) = &decode_batch(&with_medium(s(name))).unwrap().events[0] else { panic!() };
        assert_eq!(r.medium, want, "{name}");
    }
    let KvEvent::BlockRemoved(r) = &decode_batch(&with_medium(V::Nil)).unwrap().events[0] else { panic!() };
    assert_eq!(r.medium, Medium::Gpu);
    let p = with_medium(s("TAPE"));
    let at = p.windows(5).position(|w| w == b"\xa4TAPE").unwrap();
    assert_eq!(err(&p), EventError::UnknownMedium { offset: at, event: 0, medium: "TAPE".into() });
    assert!(matches!(err(&with_medium(i(1))), EventError::WrongType { found: "int", .. }));
}

#[test]
fn unknown_tags_and_missing_fields() {
    let p = batch(vec![arr([s("AllBlocksCleared")]), arr([s("BlockMoved"), ints([1])])], V::Nil);
    assert!(matches!(err(&p), EventError::UnknownEventType { event: 1, ref tag, .. } if tag == "BlockMoved"));
    let p = batch(vec![map([("type", s("blockstored"))])], V::Nil);
    assert!(matches!(err(&p), EventError::UnknownEventType { event: 0, .. }));
    let p = batch(vec![map([("block_hashes", ints([1]))])], V::Nil);
    assert!(matches!(err(&p), EventError::MissingField { event: 0, field: "type", .. }));
    let p = batch(vec![arr([])], V::Nil);
    assert!(matches!(err(&p), EventError::MissingField { event: 0, field: "type", .. }));
    let p = batch(vec![arr([s("BlockStored"), ints([1]), V::Nil])], V::Nil);
    assert!(matches!(err(&p), EventError::MissingField { event: 0, field: "token_ids", .. }));
    let p = batch(vec![arr([s("BlockRemoved")])], V::Nil);
    assert!(matches!(err(&p), EventError::MissingField { event: 0, field: "block_hashes", .. }));
    let p =
        batch(vec![map([("type", s("BlockStored")), ("block_hashes", ints([1])), ("token_ids", ints([1]))])], V::Nil);
    assert!(matches!(err(&p), EventError::MissingField { event: 0, field: "block_size", .. }));
    let p = batch(vec![map([("type", s("BlockRemoved"))])], V::Nil);
    assert!(matches!(err(&p), EventError::MissingField { event: 0, field: "block_hashes", .. }));
}

#[test]
fn wrong_types_name_the_field() {
    let cases: Vec<(Vec<u8>, ErrorSite, &str)> = vec![
        (bytes(&map([("ts", V::F64(1.0))])), ErrorSite { event: None, field: "batch" }, "map"),
        (bytes(&arr([s("1.5"), arr([]), V::Nil])), ErrorSite { event: None, field: "ts" }, "str"),
        (bytes(&arr([V::F64(1.5), map([]), V::Nil])), ErrorSite { event: None, field: "events" }, "map"),
        (bytes(&arr([V::F64(1.5), arr([]), s("0")])), ErrorSite { event: None, field: "data_parallel_rank" }, "str"),
        (batch(vec![i(3)], V::Nil), site(0, "event"), "int"),
        (batch(vec![arr([i(1)])], V::Nil), site(0, "type"), "int"),
        (batch(vec![V::Map(vec![(i(1), i(2))])], V::Nil), site(0, "key"), "int"),
        (batch(vec![map(stored_map(i(1), V::Nil, ints([1])))], V::Nil), site(0, "block_hashes"), "int"),
        (batch(vec![map([("type", s("BlockStored")), ("block_size", V::Nil)])], V::Nil), site(0, "block_size"), "nil"),
        (batch(vec![map([("type", s("BlockStored")), ("lora_id", s("1"))])], V::Nil), site(0, "lora_id"), "str"),
        (batch(vec![map([("type", s("BlockStored")), ("lora_name", i(1))])], V::Nil), site(0, "lora_name"), "int"),
        (
            batch(vec![map([("type", s("BlockStored")), ("group_idx", V::F64(1.0))])], V::Nil),
            site(0, "group_idx"),
            "float",
        ),
        (batch(vec![V::Raw(vec![0xc1])], V::Nil), site(0, "event"), "reserved byte 0xc1"),
        // Fields decoded since vLLM 0.33 / SGLang: wrong types are typed errors too.
        (batch(vec![map([("type", s("BlockStored")), ("ownership", i(1))])], V::Nil), site(0, "ownership"), "int"),
        (
            batch(vec![map([("type", s("BlockStored")), ("session_id", arr([]))])], V::Nil),
            site(0, "session_id"),
            "array",
        ),
        (batch(vec![map([("type", s("BlockStored")), ("locality", i(2))])], V::Nil), site(0, "locality"), "int"),
        (batch(vec![map([("type", s("BlockStored")), ("cache_salt", i(2))])], V::Nil), site(0, "cache_salt"), "int"),
        (
            batch(vec![map([("type", s("BlockStored")), ("lookahead_token_ids", s("x"))])], V::Nil),
            site(0, "lookahead_token_ids"),
            "str",
        ),
        (batch(vec![map([("type", s("BlockStored")), ("extra_keys", i(7))])], V::Nil), site(0, "extra_keys"), "int"),
        (
            batch(vec![map([("type", s("BlockRemoved")), ("ownership", V::F64(1.0))])], V::Nil),
            site(0, "ownership"),
            "float",
        ),
    ];
    for (p, want_site, want_found) in cases {
        match err(&p) {
            EventError::WrongType { site, found, .. } => {
                assert_eq!((site, found), (want_site, want_found), "{p:02x?}");
            }
            other => panic!("{p:02x?}: {other:?}"),
        }
    }
}

#[test]
fn integer_ranges() {
    let p = batch(vec![map([("type", s("BlockStored")), ("block_size", i(-16))])], V::Nil);
    assert!(
        matches!(err(&p), EventError::IntOutOfRange { value: -16, site, .. } if site == self::site(0, "block_size"))
    );
    let p = batch(vec![map([("type", s("BlockRemoved")), ("group_idx", i(1 << 32))])], V::Nil);
    assert!(matches!(err(&p), EventError::IntOutOfRange { site, .. } if site == self::site(0, "group_idx")));
    let p = batch(vec![], i(i128::from(u64::MAX)));
    assert!(matches!(err(&p), EventError::IntOutOfRange { site, .. } if site.field == "data_parallel_rank"));
    // Negative ranks and LoRA ids fit i64 and are passed through.
    let b = decode_batch(&batch(vec![], i(-1))).unwrap();
    assert_eq!(b.data_parallel_rank, Some(-1));
    // An integer timestamp is accepted.
    let b = decode_batch(&bytes(&arr([i(1_750_000_000), arr([])]))).unwrap();
    assert_eq!(b.ts, 1_750_000_000.0);
}

#[test]
fn envelope_errors() {
    assert_eq!(err(&[]), EventError::Truncated { offset: 0, site: ErrorSite { event: None, field: "batch" } });
    assert!(matches!(err(&bytes(&arr([V::F64(1.0)]))), EventError::BatchTooShort { len: 1, .. }));
    assert!(matches!(err(&bytes(&arr([]))), EventError::BatchTooShort { len: 0, .. }));
    let mut p = batch(vec![], V::Nil);
    p.push(0x00);
    assert_eq!(err(&p), EventError::TrailingBytes { offset: p.len() - 1, remaining: 1 });
    // Invalid UTF-8 in a tag.
    let p = batch(vec![V::Raw(vec![0x91, 0xa2, 0xff, 0xfe])], V::Nil);
    assert!(matches!(err(&p), EventError::InvalidUtf8 { site, .. } if site == self::site(0, "type")));
}

#[test]
fn oversize_length_headers_are_rejected_before_allocating() {
    let huge32 = |marker: u8| [marker, 0xff, 0xff, 0xff, 0xff];
    let events_hdr = {
        let mut p = vec![0x93, 0xcb];
        p.extend(1.5f64.to_be_bytes());
        p.extend(huge32(0xdd)); // array32 of 4 billion events
        p
    };
    let in_event = |value: Vec<u8>| {
        let mut ev = vec![0x84, 0xa4];
        ev.extend(b"type");
        ev.push(0xab);
        ev.extend(b"BlockStored");
        ev.extend([0xa9]);
        ev.extend(b"block_siz");
        ev.push(0x10);
        ev.push(0xa8);
        ev.extend(b"token_id");
        ev.extend(value);
        batch(vec![V::Raw(ev)], V::Nil)
    };
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("batch array32", huge32(0xdd).to_vec(), "batch"),
        ("events array32", events_hdr, "events"),
        ("unknown key: array32", in_event(huge32(0xdd).to_vec()), "key"),
        ("unknown key: map32", in_event(huge32(0xdf).to_vec()), "key"),
        ("unknown key: str32", in_event(huge32(0xdb).to_vec()), "key"),
        ("unknown key: bin32", in_event(huge32(0xc6).to_vec()), "key"),
        ("unknown key: ext32", in_event(huge32(0xc9).to_vec()), "key"),
        (
            "block_hashes array32",
            batch(vec![map([("type", s("BlockRemoved")), ("block_hashes", V::Raw(huge32(0xdd).to_vec()))])], V::Nil),
            "block_hashes",
        ),
        (
            "token_ids array32",
            batch(vec![map([("type", s("BlockStored")), ("token_ids", V::Raw(huge32(0xdd).to_vec()))])], V::Nil),
            "token_ids",
        ),
        (
            "hash bin32",
            batch(
                vec![map([
                    ("type", s("BlockRemoved")),
                    ("block_hashes", V::Raw([&[0x91][..], &huge32(0xc6)].concat())),
                ])],
                V::Nil,
            ),
            "block_hashes",
        ),
        ("tag str32", batch(vec![V::Raw([&[0x91][..], &huge32(0xdb)].concat())], V::Nil), "type"),
        ("event map32", batch(vec![V::Raw(huge32(0xdf).to_vec())], V::Nil), "event"),
        (
            "array16 of 65535 tokens",
            batch(vec![map([("type", s("BlockStored")), ("token_ids", V::Raw(vec![0xdc, 0xff, 0xff, 1, 2]))])], V::Nil),
            "token_ids",
        ),
    ];
    for (what, p, field) in cases {
        let (r, largest) = decode_tracked(&p);
        match r {
            Err(EventError::LengthExceedsInput { site, declared, remaining, .. }) => {
                assert_eq!(site.field, field, "{what}");
                assert!(declared > remaining as u64, "{what}");
            }
            other => panic!("{what}: {other:?}"),
        }
        assert!(largest < 4096, "{what}: allocated {largest} bytes for a {}-byte payload", p.len());
    }
}

#[test]
fn no_partial_batch_when_a_later_event_is_bad() {
    let good = map(stored_map(ints([1]), V::Nil, ints([1, 2])));
    let p = batch(vec![good.clone(), good, arr([s("Nope")])], V::Nil);
    assert!(matches!(err(&p), EventError::UnknownEventType { event: 2, .. }));
}

#[test]
fn display_names_offset_event_and_field() {
    let p = batch(vec![arr([s("AllBlocksCleared")]), map(stored_map(ints([1]), V::Nil, ints([1, -5])))], V::Nil);
    let e = err(&p);
    assert_eq!(e.event(), Some(1));
    assert_eq!(p[e.offset()], 0xfb, "offset points at the fixint -5");
    let msg = e.to_string();
    assert!(msg.starts_with("byte "), "{msg}");
    assert!(msg.contains("event 1 field `token_ids`") && msg.contains("-5"), "{msg}");
    let e = err(&[0x92, 0xcb, 0x41]);
    assert_eq!((e.event(), e.offset()), (None, 1));
    let msg = e.to_string();
    assert_eq!(msg, "byte 1: payload truncated inside batch field `ts`");
}

// ---------------------------------------------------------------------------------------------
// Throughput report (not a timed assertion): cargo test --release -p kvroute --test events --
//   --ignored --nocapture decode_throughput
// ---------------------------------------------------------------------------------------------

/// 64 BlockStored × 16 blocks × 16 tokens, uint64 hashes. `vocab` bounds the token ids: with
/// 151,936 (Qwen) uint16 and uint32 ids mix at random; with 60,000 they are all uint16.
fn big_batch(map_events: bool, vocab: u64) -> Vec<u8> {
    let mut events = Vec::new();
    for e in 0..64u64 {
        let hashes: Vec<V> = (0..16u64)
            .map(|b| V::Int(i128::from((e * 16 + b).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1 << 63)))
            .collect();
        let tokens: Vec<V> = (0..256u64).map(|t| V::Int(i128::from((e * 7919 + t * 104_729) % vocab))).collect();
        let parent = V::Int(i128::from(e.wrapping_mul(0x1234_5678_9abc_def1) >> 1));
        if map_events {
            events.push(map([
                ("type", s("BlockStored")),
                ("block_hashes", V::Arr(hashes)),
                ("parent_block_hash", parent),
                ("token_ids", V::Arr(tokens)),
                ("block_size", i(16)),
                ("lora_id", V::Nil),
                ("medium", s("GPU")),
                ("lora_name", V::Nil),
                ("group_idx", i(0)),
            ]));
        } else {
            events.push(arr([
                s("BlockStored"),
                V::Arr(hashes),
                parent,
                V::Arr(tokens),
                i(16),
                V::Nil,
                s("GPU"),
                V::Nil,
                V::Nil,
                i(0),
                V::Nil,
                V::Nil,
            ]));
        }
    }
    bytes(&arr([V::F64(1.75e9), V::Arr(events), i(0)]))
}

/// 64 BlockRemoved × 16 uint64 hashes (map events).
fn removed_batch() -> Vec<u8> {
    let events = (0..64u64)
        .map(|e| {
            let hashes =
                (0..16u64).map(|b| V::Int(i128::from((e * 16 + b).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1 << 63)));
            map([("type", s("BlockRemoved")), ("block_hashes", arr(hashes)), ("medium", s("GPU"))])
        })
        .collect();
    bytes(&arr([V::F64(1.75e9), V::Arr(events), i(0)]))
}

#[test]
fn big_batches_decode() {
    for map_events in [false, true] {
        let b = decode_batch(&big_batch(map_events, 151_936)).unwrap();
        assert_eq!(b.events.len(), 64);
        let blocks: usize = b
            .events
            .iter()
            .map(|e| match e {
                KvEvent::BlockStored(s) => {
                    assert_eq!(s.token_ids.len(), 256);
                    s.block_hashes.len()
                }
                _ => 0,
            })
            .sum();
        assert_eq!(blocks, 1024);
    }
}

#[test]
fn removed_batch_decodes() {
    let b = decode_batch(&removed_batch()).unwrap();
    assert_eq!(b.events.len(), 64);
    assert!(b.events.iter().all(|e| matches!(e, KvEvent::BlockRemoved(r) if r.block_hashes.len() == 16)));
}

#[test]
#[ignore = "throughput report; run in release with --ignored --nocapture"]
fn decode_throughput() {
    let cases = [
        ("stored, array events, mixed uint16/32 tokens", big_batch(false, 151_936)),
        ("stored, map events, mixed uint16/32 tokens", big_batch(true, 151_936)),
        ("stored, map events, uint16 tokens", big_batch(true, 60_000)),
        ("removed, map events (hashes only)", removed_batch()),
    ];
    for (what, p) in cases {
        let iters = 2000;
        let mut best = f64::MAX;
        for _ in 0..5 {
            let start = std::time::Instant::now();
            for _ in 0..iters {
                std::hint::black_box(decode_batch(std::hint::black_box(&p)).unwrap());
            }
            best = best.min(start.elapsed().as_secs_f64() / f64::from(iters));
        }
        println!(
            "{what}: {} bytes, 1024 blocks: {:.2} us/batch, {:.1} M blocks/s, {:.0} MB/s",
            p.len(),
            best * 1e6,
            1024.0 / best / 1e6,
            p.len() as f64 / best / 1e6
        );
    }
}

#[test]
fn multimodal_and_prompt_embeds_extra_keys_become_content_keys() {
    let content = |extra: V| {
        let mut m = stored_map(ints([1, 2, 3]), V::Nil, ints(0..6));
        m.push(("extra_keys", extra));
        let b = decode_batch(&batch(vec![map(m)], i(0))).unwrap();
        let KvEvent::BlockStored(st) = &b.events[0] else { panic!() };
        (st.content_keys.clone(), st.cache_salt.clone())
    };
    let pair = |h: &'static str, off: i128| arr([s(h), i(off)]);
    // Text only (LoRA names, salts, nil blocks): no content keys at all.
    assert_eq!(content(arr([arr([s("lora"), s("salt")]), arr([s("lora")]), V::Nil])), (vec![], Some("lora".into())));
    assert_eq!(content(V::Nil), (vec![], None));
    // An image over blocks 1 and 2: keys there, 0 elsewhere; the same pair gives the same key,
    // another offset or image another one; strings beside it do not change it.
    let (k, salt) = content(arr([V::Nil, arr([pair("img", 5)]), arr([s("x"), pair("img", 5), pair("img2", -11)])]));
    assert_eq!(salt, None);
    assert_eq!(k.len(), 3);
    assert_eq!(k[0], 0);
    assert!(k[1] != 0 && k[2] != 0 && k[1] != k[2]);
    let (k2, _) =
        content(arr([arr([pair("img", 5)]), arr([pair("img", 6)]), arr([s("y"), pair("img", 5), pair("img2", -11)])]));
    assert_eq!((k2[0], k2[2]), (k[1], k[2]));
    assert_ne!(k2[1], k[1], "offset matters");
    // Prompt-embeds digests (bin) count too; so would any other non-string value.
    let (k, _) = content(arr([arr([V::Bin(vec![7; 32])]), V::Nil]));
    assert_eq!((k.len(), k[1]), (2, 0));
    assert_ne!(k[0], 0);
}

#[test]
fn vllm_033_lookahead_ownership_session_and_sglang_salts_are_decoded() {
    let mut m = stored_map(ints([1, 2]), V::Nil, ints(0..4));
    m.extend([
        ("lookahead_token_ids", arr([ints([2, 3]), ints([4, 5])])),
        ("ownership", s("kvcr")),
        ("session_id", s("sess-1")),
        ("locality", s("LOCAL")),
    ]);
    let b = decode_batch(&batch(vec![map(m)], i(0))).unwrap();
    let KvEvent::BlockStored(st) = &b.events[0] else { panic!() };
    assert_eq!(st.lookahead_token_ids, vec![vec![2, 3], vec![4, 5]]);
    assert_eq!((st.ownership.as_deref(), st.session_id.as_deref()), (Some("kvcr"), Some("sess-1")));
    assert_eq!(st.medium, Medium::Gpu);
    let rm = map([
        ("type", s("BlockRemoved")),
        ("block_hashes", ints([1])),
        ("medium", s("STORAGE")),
        ("ownership", s("kvcr")),
    ]);
    let b = decode_batch(&batch(vec![rm], i(0))).unwrap();
    assert_eq!(
        b.events[0],
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![1],
            medium: Medium::Storage,
            group_idx: None,
            ownership: Some("kvcr".into())
        })
    );
    // Bad values are typed errors naming the field.
    let mut m = stored_map(ints([1]), V::Nil, ints(0..2));
    m.push(("lookahead_token_ids", arr([arr([s("x")])])));
    assert!(matches!(
        err(&batch(vec![map(m)], i(0))),
        EventError::WrongType { site: ErrorSite { field: "lookahead_token_ids", .. }, .. }
    ));
    let mut m = stored_map(ints([1]), V::Nil, ints(0..2));
    m.push(("session_id", i(3)));
    assert!(matches!(
        err(&batch(vec![map(m)], i(0))),
        EventError::WrongType { site: ErrorSite { field: "session_id", .. }, .. }
    ));
    // SGLang: an empty `cache_salt` is no salt; a salt in block 0's extra keys is read.
    let salt_of = |extra: Vec<(&'static str, V)>| {
        let mut m = stored_map(ints([1]), V::Nil, ints(0..2));
        m.extend(extra);
        let b = decode_batch(&batch(vec![map(m)], i(0))).unwrap();
        let KvEvent::BlockStored(st) = &b.events[0] else { panic!() };
        st.cache_salt.clone()
    };
    assert_eq!(salt_of(vec![("cache_salt", s(""))]), None);
    assert_eq!(salt_of(vec![("cache_salt", s("t"))]), Some("t".into()));
    assert_eq!(salt_of(vec![("extra_keys", arr([arr([s("t")])]))]), Some("t".into()));
    assert_eq!(salt_of(vec![("cache_salt", s("")), ("extra_keys", arr([arr([s("")])]))]), None);
}

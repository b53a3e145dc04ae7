//! vLLM-exact block hashes: replay the vectors that `fixtures/hash-vectors/generate.py` produced by
//! running vLLM's own hashing code, and check the typed errors.

#![allow(clippy::unwrap_used, clippy::expect_used)]
// The only unsafe code: a pass-through global allocator that counts this thread's allocations.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

use kvroute::{
    encode_cbor, encode_pickle, event_key, BlockDigest, BlockExtras, EngineHashError, EngineHashSpec, EngineHasher,
    ExtraKeysForm, ExtraValue, HashAlgo, LoraAdapter, NoneHashSeed,
};
use serde_json::Value;
use sha2::{Digest as _, Sha256};

struct CountAllocs;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for CountAllocs {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|n| n.set(n.get() + 1));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|n| n.set(n.get() + 1));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: CountAllocs = CountAllocs;

fn vectors_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hash-vectors")
}

/// Every vector file, parsed. There must be one per extra-key form at least.
fn vector_files() -> Vec<(String, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(vectors_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    let parsed: Vec<(String, Value)> = files
        .iter()
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap(),
            )
        })
        .collect();
    let forms: Vec<&str> = parsed.iter().map(|(_, v)| v["extra_keys_form"].as_str().unwrap()).collect();
    assert!(forms.contains(&"tagged") && forms.contains(&"untagged"), "vector files: {forms:?}");
    parsed
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// A string given inline or as `{"repeat": s, "times": n}`.
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Object(o) => {
            o["repeat"].as_str().unwrap().repeat(usize::try_from(o["times"].as_u64().unwrap()).unwrap())
        }
        other => panic!("not a string spec: {other}"),
    }
}

/// Token ids given as a list or as `{"affine": {"len", "start", "step"}}` (mod 2^32).
fn tokens(seq: &Value) -> Vec<u32> {
    if let Some(list) = seq.get("tokens") {
        return list.as_array().unwrap().iter().map(|t| u32::try_from(t.as_u64().unwrap()).unwrap()).collect();
    }
    let a = &seq["affine"];
    let (len, start, step) = (a["len"].as_u64().unwrap(), a["start"].as_u64().unwrap(), a["step"].as_u64().unwrap());
    (0..len).map(|i| ((start + i * step) % (1 << 32)) as u32).collect()
}

fn form_of(doc: &Value) -> ExtraKeysForm {
    match doc["extra_keys_form"].as_str().unwrap() {
        "tagged" => ExtraKeysForm::Tagged,
        "untagged" => ExtraKeysForm::Untagged,
        other => panic!("unknown form {other}"),
    }
}

fn seed_of(v: &Value) -> NoneHashSeed {
    NoneHashSeed::from_env_value(v.as_str())
}

fn algo_of(name: &str) -> HashAlgo {
    name.parse().unwrap()
}

#[test]
fn none_hash_matches_vllm() {
    let mut checked = 0;
    for (file, doc) in vector_files() {
        for (algo, entries) in doc["none_hash"].as_object().unwrap() {
            let algo = algo_of(algo);
            for e in entries.as_array().unwrap() {
                let made = EngineHasher::new(algo, form_of(&doc), seed_of(&e["python_hash_seed"]), 16);
                if e["random"].as_bool().unwrap() {
                    assert_eq!(made, Err(EngineHashError::UnreproducibleNoneHash { algo }), "{file} {algo}");
                    assert!(!algo.is_cryptographic());
                } else {
                    let h = made.unwrap();
                    assert_eq!(h.none_hash().to_string(), e["none_hash"].as_str().unwrap(), "{file} {algo} {e}");
                    assert_eq!(h.none_hash().as_bytes().len(), algo.digest_len());
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 2 * 10, "only {checked} NONE_HASH values checked");
}

#[test]
fn replays_every_vllm_block_hash() {
    let mut scratch = Vec::new();
    let (mut digests, mut keys) = (Vec::new(), Vec::new());
    for (file, doc) in vector_files() {
        let form = form_of(&doc);
        let mut checked = 0usize;
        for (algo, per_seed) in doc["chains"].as_object().unwrap() {
            let algo = algo_of(algo);
            for entry in per_seed.as_array().unwrap() {
                let seed = seed_of(&entry["python_hash_seed"]);
                for case in entry["cases"].as_array().unwrap() {
                    let name = format!("{file} {algo} seed={} {}", entry["python_hash_seed"], case["name"]);
                    let seq = &doc["sequences"][case["sequence"].as_str().unwrap()];
                    let block_size = u32::try_from(seq["block_size"].as_u64().unwrap()).unwrap();
                    let tokens = tokens(seq);
                    let hasher = EngineHasher::new(algo, form, seed.clone(), block_size).unwrap();
                    assert_eq!(hasher.none_hash().to_string(), entry["none_hash"].as_str().unwrap(), "{name}");

                    let ex = &case["extras"];
                    let (lora_name, lora_path) = match ex.get("lora") {
                        Some(l) => (Some(text(&l["name"])), text(&l["path"])),
                        None => (None, String::new()),
                    };
                    let salt = ex.get("cache_salt").map(text);
                    let extras = BlockExtras {
                        lora: lora_name.as_deref().map(|name| LoraAdapter { name, path: &lora_path }),
                        cache_salt: salt.as_deref(),
                    };

                    digests.clear();
                    keys.clear();
                    let n = hasher.block_digests(&tokens, &extras, &mut scratch, &mut digests).unwrap();
                    let nk = hasher.block_keys(&tokens, &extras, &mut scratch, &mut keys).unwrap();
                    let want = case["blocks"].as_array().unwrap();
                    assert_eq!(
                        (n, nk, digests.len()),
                        (want.len(), want.len(), tokens.len() / block_size as usize),
                        "{name}"
                    );
                    for (i, (w, (d, k))) in want.iter().zip(digests.iter().zip(&keys)).enumerate() {
                        assert_eq!(d.to_string(), w["digest"].as_str().unwrap(), "{name} block {i}");
                        assert_eq!(*k, w["event_key"].as_u64().unwrap(), "{name} block {i} event key");
                        assert_eq!(d.event_key(), *k);
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 1000, "{file}: only {checked} blocks checked");
    }
}

/// vLLM 0.33 lookahead hashing (`num_hash_lookahead_tokens` = L): vectors from vLLM's own
/// `get_request_block_hasher(block_size, hash_fn, L)`.
#[test]
fn replays_vllm_lookahead_block_hashes() {
    let mut scratch = Vec::new();
    let mut keys = Vec::new();
    let mut checked = 0usize;
    let mut files = 0;
    for (file, doc) in vector_files() {
        let Some(sections) = doc.get("lookahead").and_then(Value::as_object) else { continue };
        files += 1;
        let form = form_of(&doc);
        for (algo, entries) in sections {
            let algo = algo_of(algo);
            for entry in entries.as_array().unwrap() {
                let seed = seed_of(&entry["python_hash_seed"]);
                let l = u32::try_from(entry["lookahead_tokens"].as_u64().unwrap()).unwrap();
                for case in entry["cases"].as_array().unwrap() {
                    let name = format!("{file} {algo} L={l} {}", case["name"]);
                    let seq = &doc["sequences"][case["sequence"].as_str().unwrap()];
                    let block_size = u32::try_from(seq["block_size"].as_u64().unwrap()).unwrap();
                    let tokens = tokens(seq);
                    let hasher = EngineHasher::new(algo, form, seed.clone(), block_size).unwrap().with_lookahead(l);
                    let ex = &case["extras"];
                    let (lora_name, lora_path) = match ex.get("lora") {
                        Some(x) => (Some(text(&x["name"])), text(&x["path"])),
                        None => (None, String::new()),
                    };
                    let salt = ex.get("cache_salt").map(text);
                    let extras = BlockExtras {
                        lora: lora_name.as_deref().map(|name| LoraAdapter { name, path: &lora_path }),
                        cache_salt: salt.as_deref(),
                    };
                    keys.clear();
                    let n = hasher.block_keys(&tokens, &extras, &mut scratch, &mut keys).unwrap();
                    let want: Vec<u64> =
                        case["blocks"].as_array().unwrap().iter().map(|b| b["event_key"].as_u64().unwrap()).collect();
                    assert_eq!(n, want.len(), "{name}");
                    assert_eq!(keys, want, "{name}");
                    // Without lookahead the keys differ from block 0 on: a router configured
                    // without it never claims a lookahead engine's blocks.
                    let mut plain = Vec::new();
                    EngineHasher::new(algo, form, seed.clone(), block_size)
                        .unwrap()
                        .block_keys(&tokens, &extras, &mut scratch, &mut plain)
                        .unwrap();
                    assert!(want.iter().all(|k| !plain.contains(k)), "{name}");
                    checked += n;
                }
            }
        }
    }
    assert!(files >= 1, "no vector file has a lookahead section");
    assert!(checked > 100, "only {checked} lookahead blocks checked");
}

#[test]
fn lookahead_is_part_of_the_spec() {
    let spec: EngineHashSpec = serde_json::from_str(r#"{"algo": "sha256", "lookahead_tokens": 2}"#).unwrap();
    let h = EngineHasher::from_spec(&spec).unwrap();
    assert_eq!(h.lookahead_tokens(), 2);
    // A block is hashed only once its lookahead tokens exist: 33 tokens → 1 block (16 + 2 ≤ 33,
    // 32 + 2 > 33).
    let (mut scratch, mut keys) = (Vec::new(), Vec::new());
    let ids: Vec<u32> = (0..33).collect();
    assert_eq!(h.block_keys(&ids, &BlockExtras::default(), &mut scratch, &mut keys).unwrap(), 1);
    assert_eq!(EngineHashSpec::default().lookahead_tokens, 0);
}

/// The extra keys vLLM recorded for the first two blocks have the documented form.
#[test]
fn recorded_extra_keys_have_the_documented_form() {
    let mut seen = 0;
    for (_, doc) in vector_files() {
        let form = form_of(&doc);
        for case in doc["chains"]["sha256"][0]["cases"].as_array().unwrap() {
            if !case["name"].as_str().unwrap().starts_with("widths/") {
                continue;
            }
            let ex = &case["extras"];
            let lora = ex.get("lora").map(|l| (l["name"].clone(), l["path"].clone()));
            let salt = ex.get("cache_salt").cloned();
            for (i, block) in case["blocks"].as_array().unwrap().iter().take(2).enumerate() {
                let mut want = Vec::new();
                if let Some((name, path)) = &lora {
                    want.push(match form {
                        ExtraKeysForm::Tagged => serde_json::json!(["lora", name, path]),
                        _ => name.clone(),
                    });
                }
                if let (Some(s), 0) = (&salt, i) {
                    want.push(match form {
                        ExtraKeysForm::Tagged => serde_json::json!(["cache_salt", s]),
                        _ => s.clone(),
                    });
                }
                let want = if want.is_empty() { Value::Null } else { Value::Array(want) };
                assert_eq!(block["extra_keys"], want, "{} block {i}", case["name"]);
                seen += 1;
            }
        }
    }
    assert!(seen >= 16);
}

fn leak_value(v: &Value) -> ExtraValue<'static> {
    let kind = v[0].as_str().unwrap();
    let payload = &v[1];
    match kind {
        "str" => ExtraValue::Str(Box::leak(text(payload).into_boxed_str())),
        "int" => ExtraValue::Int(payload.as_i64().unwrap()),
        "bytes" => ExtraValue::Bytes(Box::leak(unhex(payload.as_str().unwrap()).into_boxed_slice())),
        "tuple" => {
            let items: Vec<ExtraValue<'static>> = payload.as_array().unwrap().iter().map(leak_value).collect();
            ExtraValue::Tuple(Box::leak(items.into_boxed_slice()))
        }
        other => panic!("unknown value kind {other}"),
    }
}

fn assert_bytes(got: &[u8], want: &Value, what: &str) {
    if let Some(h) = want.get("hex") {
        assert_eq!(hex(got), h.as_str().unwrap(), "{what}");
    } else {
        assert_eq!(got.len() as u64, want["len"].as_u64().unwrap(), "{what} length");
        assert_eq!(hex(&Sha256::digest(got)), want["sha256"].as_str().unwrap(), "{what} sha256");
    }
}

#[test]
fn serializers_match_cpython_pickle_and_cbor2() {
    let mut out = Vec::new();
    let (mut checked, mut seeds) = (0, 0);
    for (file, doc) in vector_files() {
        for case in doc["serializer"]["blocks"].as_array().unwrap() {
            let name = format!("{file} {}", case["name"]);
            let parent = unhex(case["parent"].as_str().unwrap());
            let toks = tokens(case);
            let extra: Option<Vec<ExtraValue<'static>>> =
                case["extra"].as_array().map(|vs| vs.iter().map(leak_value).collect());
            encode_pickle(&parent, &toks, extra.as_deref(), &mut out);
            assert_bytes(&out, &case["pickle"], &format!("{name} pickle"));
            encode_cbor(&parent, &toks, extra.as_deref(), &mut out);
            assert_bytes(&out, &case["cbor"], &format!("{name} cbor"));
            checked += 1;
        }
        // NONE_HASH is H(serialized seed string); check it through the hasher's own path.
        for s in doc["serializer"]["seed_strings"].as_array().unwrap() {
            let seed = text(&s["seed"]);
            for (algo, key) in [(HashAlgo::Sha256, "pickle"), (HashAlgo::Sha256Cbor, "cbor")] {
                let want = match s[key].get("hex") {
                    Some(h) => Sha256::digest(unhex(h.as_str().unwrap())).to_vec(),
                    None => unhex(s[key]["sha256"].as_str().unwrap()),
                };
                let h = EngineHasher::new(algo, ExtraKeysForm::Tagged, NoneHashSeed::PythonHashSeed(seed.clone()), 16)
                    .unwrap();
                assert_eq!(h.none_hash().as_bytes(), &want[..], "{file} {algo} seed of {} bytes", seed.len());
                seeds += 1;
            }
        }
    }
    assert!(checked >= 2 * 15 && seeds >= 2 * 16, "{checked} blocks, {seeds} seeds");
}

#[test]
fn xxhash_without_python_hash_seed_is_refused_with_guidance() {
    for algo in [HashAlgo::Xxhash, HashAlgo::XxhashCbor] {
        let err = EngineHasher::new(algo, ExtraKeysForm::Tagged, NoneHashSeed::Default, 16).unwrap_err();
        assert_eq!(err, EngineHashError::UnreproducibleNoneHash { algo });
        let msg = err.to_string();
        assert!(msg.contains("PYTHONHASHSEED") && msg.contains("dual-key") && msg.contains(algo.name()), "{msg}");
        // With a seed it works.
        assert!(EngineHasher::new(algo, ExtraKeysForm::Tagged, NoneHashSeed::PythonHashSeed("0".into()), 16).is_ok());
    }
    for algo in [HashAlgo::Sha256, HashAlgo::Sha256Cbor] {
        assert!(EngineHasher::new(algo, ExtraKeysForm::Untagged, NoneHashSeed::Default, 16).is_ok());
    }
}

#[test]
fn zero_block_size_is_refused() {
    let err = EngineHasher::new(HashAlgo::Sha256, ExtraKeysForm::Tagged, NoneHashSeed::Default, 0).unwrap_err();
    assert_eq!(err, EngineHashError::ZeroBlockSize);
}

#[test]
fn tagged_form_needs_the_lora_path() {
    let h = EngineHasher::new(HashAlgo::Sha256, ExtraKeysForm::Tagged, NoneHashSeed::Default, 4).unwrap();
    let extras = BlockExtras { lora: Some(LoraAdapter { name: "sql", path: "" }), cache_salt: None };
    let (mut scratch, mut out) = (Vec::new(), Vec::new());
    let err = h.block_digests(&[1, 2, 3, 4], &extras, &mut scratch, &mut out).unwrap_err();
    assert_eq!(err, EngineHashError::MissingLoraPath { name: "sql".into() });
    assert!(out.is_empty());
    // The untagged form (vLLM <= 0.30) does not hash the path.
    let h = EngineHasher::new(HashAlgo::Sha256, ExtraKeysForm::Untagged, NoneHashSeed::Default, 4).unwrap();
    assert_eq!(h.block_digests(&[1, 2, 3, 4], &extras, &mut scratch, &mut out), Ok(1));
    let with_path = BlockExtras { lora: Some(LoraAdapter { name: "sql", path: "/elsewhere" }), cache_salt: None };
    let mut other = Vec::new();
    h.block_digests(&[1, 2, 3, 4], &with_path, &mut scratch, &mut other).unwrap();
    assert_eq!(out, other);
}

#[test]
fn algorithm_names_match_vllm() {
    for (algo, name) in [
        (HashAlgo::Sha256, "sha256"),
        (HashAlgo::Sha256Cbor, "sha256_cbor"),
        (HashAlgo::Xxhash, "xxhash"),
        (HashAlgo::XxhashCbor, "xxhash_cbor"),
    ] {
        assert_eq!(algo.to_string(), name);
        assert_eq!(name.parse::<HashAlgo>(), Ok(algo));
        assert_eq!(serde_json::to_string(&algo).unwrap(), format!("\"{name}\""));
        assert_eq!(serde_json::from_str::<HashAlgo>(&format!("\"{name}\"")).unwrap(), algo);
    }
    assert_eq!("sha512".parse::<HashAlgo>(), Err(EngineHashError::UnknownAlgo("sha512".into())));
    assert_eq!(serde_json::to_string(&ExtraKeysForm::Untagged).unwrap(), "\"untagged\"");
}

#[test]
fn spec_round_trips_and_rejects_unknown_fields() {
    let spec: EngineHashSpec =
        serde_json::from_str(r#"{"algo": "xxhash_cbor", "extra_keys": "untagged", "python_hash_seed": "0"}"#).unwrap();
    assert_eq!(spec.block_size, 16);
    let h = EngineHasher::from_spec(&spec).unwrap();
    assert_eq!((h.algo(), h.extra_keys_form(), h.block_size()), (HashAlgo::XxhashCbor, ExtraKeysForm::Untagged, 16));
    assert!(serde_json::from_str::<EngineHashSpec>(r#"{"algorithm": "sha256"}"#).is_err());
    let unseeded = EngineHashSpec { algo: HashAlgo::Xxhash, ..EngineHashSpec::default() };
    assert!(matches!(EngineHasher::from_spec(&unseeded), Err(EngineHashError::UnreproducibleNoneHash { .. })));
}

#[test]
fn extend_chain_continues_a_prefix_and_salts_only_the_first_block() {
    let tokens: Vec<u32> = (0..16 * 5 + 3).map(|i| i * 7919 % 200_000).collect();
    let extras = BlockExtras { lora: Some(LoraAdapter { name: "a", path: "/a" }), cache_salt: Some("salt") };
    for algo in HashAlgo::ALL {
        let h = EngineHasher::new(algo, ExtraKeysForm::Tagged, NoneHashSeed::PythonHashSeed("7".into()), 16).unwrap();
        let (mut scratch, mut all) = (Vec::new(), Vec::new());
        assert_eq!(h.block_digests(&tokens, &extras, &mut scratch, &mut all), Ok(5));
        let mut split = all[..2].to_vec();
        assert_eq!(h.extend_chain(Some(&all[1]), &tokens[32..], &extras, &mut scratch, &mut split), Ok(3));
        assert_eq!(split, all);
        // hash_block with explicit extra keys gives the same first block.
        let lora = [ExtraValue::Str("lora"), ExtraValue::Str("a"), ExtraValue::Str("/a")];
        let salt = [ExtraValue::Str("cache_salt"), ExtraValue::Str("salt")];
        let extra = [ExtraValue::Tuple(&lora), ExtraValue::Tuple(&salt)];
        assert_eq!(h.hash_block(None, &tokens[..16], Some(&extra), &mut scratch), all[0]);
        assert_eq!(h.hash_block(Some(&all[0]), &tokens[16..32], Some(&extra[..1]), &mut scratch), all[1]);
        // The salt changes the whole chain; an empty salt is no salt.
        let mut unsalted = Vec::new();
        let no_salt = BlockExtras { cache_salt: None, ..extras };
        h.block_digests(&tokens, &no_salt, &mut scratch, &mut unsalted).unwrap();
        assert!(unsalted.iter().zip(&all).all(|(a, b)| a != b));
        let mut empty_salt = Vec::new();
        h.block_digests(&tokens, &BlockExtras { cache_salt: Some(""), ..extras }, &mut scratch, &mut empty_salt)
            .unwrap();
        assert_eq!(empty_salt, unsalted);
    }
}

#[test]
fn digests_and_event_keys() {
    let d = BlockDigest::from_bytes(&[0xab; 16]).unwrap();
    assert_eq!(d.as_bytes(), &[0xab; 16]);
    assert_eq!(d.event_key(), 0xabab_abab_abab_abab);
    assert_eq!(BlockDigest::from_bytes(&[0; 20]), Err(EngineHashError::BadDigestLength(20)));
    let mut sha = [0u8; 32];
    sha[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    assert_eq!(event_key(&sha), 0x0102_0304_0506_0708);
    assert_eq!(
        format!("{:?}", BlockDigest::from_bytes(&[1; 16]).unwrap()),
        format!("BlockDigest({})", "01".repeat(16))
    );
    // A partial block has no hash; fewer tokens than a block give none at all.
    let h = EngineHasher::new(HashAlgo::Sha256, ExtraKeysForm::Tagged, NoneHashSeed::Default, 16).unwrap();
    let (mut scratch, mut out) = (Vec::new(), Vec::new());
    assert_eq!(h.block_keys(&[1; 15], &BlockExtras::default(), &mut scratch, &mut out), Ok(0));
    assert_eq!(h.block_keys(&[1; 31], &BlockExtras::default(), &mut scratch, &mut out), Ok(1));
}

/// With warm buffers, hashing a long prompt allocates nothing (the router's hot path), including
/// the shared one-character strings the pickler tracks for its memo.
#[test]
fn warm_hashing_does_not_allocate() {
    let tokens: Vec<u32> = (0..8192u32).map(|i| i.wrapping_mul(2_654_435_761) % 152_000).collect();
    let extras = BlockExtras { lora: Some(LoraAdapter { name: "a", path: "/loras/a" }), cache_salt: Some("é") };
    for algo in HashAlgo::ALL {
        for form in [ExtraKeysForm::Tagged, ExtraKeysForm::Untagged] {
            let h = EngineHasher::new(algo, form, NoneHashSeed::PythonHashSeed("0".into()), 16).unwrap();
            let (mut scratch, mut keys, mut digests) = (Vec::new(), Vec::new(), Vec::new());
            h.block_keys(&tokens, &extras, &mut scratch, &mut keys).unwrap();
            h.block_digests(&tokens, &extras, &mut scratch, &mut digests).unwrap();
            let before = ALLOCS.with(Cell::get);
            for _ in 0..3 {
                keys.clear();
                digests.clear();
                assert_eq!(h.block_keys(&tokens, &extras, &mut scratch, &mut keys), Ok(512));
                assert_eq!(h.block_digests(&tokens, &extras, &mut scratch, &mut digests), Ok(512));
            }
            assert_eq!(ALLOCS.with(Cell::get) - before, 0, "{algo} {form:?}");
            assert!(keys.iter().zip(&digests).all(|(k, d)| *k == d.event_key()));
        }
    }
}

//! KV events as vLLM publishes them, encoded byte for byte as vLLM's msgspec encoder writes them.
//!
//! A batch is the msgpack array `[ts (float64), events, data_parallel_rank]`. Events:
//!
//! | encoding | BlockStored | BlockRemoved | AllBlocksCleared |
//! |---|---|---|---|
//! | `map` (vLLM ≥ 0.24) | map16 (msgspec writes map16 for this struct even with 8 keys): `type`, `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`, then `extra_keys` when set | fixmap `type`, `block_hashes`, `medium` | fixmap `type` |
//! | `array` (vLLM ≤ 0.23) | 12 elements: `"BlockStored"`, the same 7 fields, `extra_keys`, `group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window` (nil when unset) | `["BlockRemoved", block_hashes, medium, group_idx]` | `["AllBlocksCleared"]` |
//!
//! Block hashes are vLLM's default integer form: the last 8 bytes of the digest, big-endian
//! (msgpack uint, smallest width). `lora_id` and `lora_name` are nil (no adapters), `medium` is
//! `"GPU"`. A salted prompt's first block carries its `cache_salt` in `extra_keys` (vLLM's
//! untagged per-block form: `[["salt"], nil, …]`), which is how kvroute's dual keys learn it.

use crate::config::EventEncoding;

/// One event of the worker's block pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerEvent {
    /// Full blocks were computed (or transferred) and cached.
    BlockStored {
        /// Event keys of the blocks, in chain order.
        block_hashes: Vec<u64>,
        /// Event key of the block before the first one (`None`: they start the prompt).
        parent_block_hash: Option<u64>,
        /// Token ids of all the blocks.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The request's `cache_salt`, set only when the first block starts the prompt.
        cache_salt: Option<String>,
    },
    /// Cached blocks were evicted.
    BlockRemoved {
        /// Event keys of the blocks.
        block_hashes: Vec<u64>,
    },
    /// The prefix cache was reset.
    AllBlocksCleared,
}

/// A minimal msgpack writer with msgspec's choices of widths.
struct Mp<'a>(&'a mut Vec<u8>);

impl Mp<'_> {
    fn uint(&mut self, v: u64) {
        let o = &mut *self.0;
        if v < 0x80 {
            o.push(v as u8);
        } else if v <= 0xff {
            o.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= 0xffff {
            o.push(0xcd);
            o.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= 0xffff_ffff {
            o.push(0xce);
            o.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            o.push(0xcf);
            o.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_bits().to_be_bytes());
    }

    fn nil(&mut self) {
        self.0.push(0xc0);
    }

    fn str(&mut self, s: &str) {
        let n = s.len();
        let o = &mut *self.0;
        if n < 32 {
            o.push(0xa0 | n as u8);
        } else if n <= 0xff {
            o.extend_from_slice(&[0xd9, n as u8]);
        } else if n <= 0xffff {
            o.push(0xda);
            o.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            o.push(0xdb);
            o.extend_from_slice(&(n as u32).to_be_bytes());
        }
        o.extend_from_slice(s.as_bytes());
    }

    fn array(&mut self, n: usize) {
        let o = &mut *self.0;
        if n < 16 {
            o.push(0x90 | n as u8);
        } else if n <= 0xffff {
            o.push(0xdc);
            o.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            o.push(0xdd);
            o.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }

    fn fixmap(&mut self, n: u8) {
        self.0.push(0x80 | n);
    }

    fn map16(&mut self, n: u16) {
        self.0.push(0xde);
        self.0.extend_from_slice(&n.to_be_bytes());
    }

    fn opt_uint(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }

    fn uints(&mut self, v: impl ExactSizeIterator<Item = u64>) {
        self.array(v.len());
        for x in v {
            self.uint(x);
        }
    }

    /// vLLM's untagged per-block extra keys: the salt on the first block, nil on the others.
    fn extra_keys(&mut self, blocks: usize, salt: &str) {
        self.array(blocks);
        for i in 0..blocks {
            if i == 0 {
                self.array(1);
                self.str(salt);
            } else {
                self.nil();
            }
        }
    }
}

/// Encode one batch `[ts, events, data_parallel_rank]`.
pub fn encode_batch(ts: f64, events: &[WorkerEvent], rank: Option<u32>, encoding: EventEncoding) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + events.len() * 64);
    let mut w = Mp(&mut buf);
    w.array(3);
    w.f64(ts);
    w.array(events.len());
    for ev in events {
        match (ev, encoding) {
            (WorkerEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, cache_salt }, enc) => {
                let salt = cache_salt.as_deref().filter(|s| !s.is_empty() && parent_block_hash.is_none());
                match enc {
                    EventEncoding::Map => {
                        w.map16(if salt.is_some() { 9 } else { 8 });
                        w.str("type");
                        w.str("BlockStored");
                        w.str("block_hashes");
                    }
                    EventEncoding::Array => {
                        w.array(12);
                        w.str("BlockStored");
                    }
                }
                let map = enc == EventEncoding::Map;
                w.uints(block_hashes.iter().copied());
                if map {
                    w.str("parent_block_hash");
                }
                w.opt_uint(*parent_block_hash);
                if map {
                    w.str("token_ids");
                }
                w.uints(token_ids.iter().map(|&t| u64::from(t)));
                if map {
                    w.str("block_size");
                }
                w.uint(u64::from(*block_size));
                if map {
                    w.str("lora_id");
                }
                w.nil();
                if map {
                    w.str("medium");
                }
                w.str("GPU");
                if map {
                    w.str("lora_name");
                }
                w.nil();
                match (map, salt) {
                    (true, Some(s)) => {
                        w.str("extra_keys");
                        w.extra_keys(block_hashes.len(), s);
                    }
                    (true, None) => {}
                    (false, salt) => {
                        match salt {
                            Some(s) => w.extra_keys(block_hashes.len(), s),
                            None => w.nil(),
                        }
                        // group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
                        w.nil();
                        w.nil();
                        w.nil();
                    }
                }
            }
            (WorkerEvent::BlockRemoved { block_hashes }, EventEncoding::Map) => {
                w.fixmap(3);
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                w.uints(block_hashes.iter().copied());
                w.str("medium");
                w.str("GPU");
            }
            (WorkerEvent::BlockRemoved { block_hashes }, EventEncoding::Array) => {
                w.array(4);
                w.str("BlockRemoved");
                w.uints(block_hashes.iter().copied());
                w.str("GPU");
                w.nil();
            }
            (WorkerEvent::AllBlocksCleared, EventEncoding::Map) => {
                w.fixmap(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
            (WorkerEvent::AllBlocksCleared, EventEncoding::Array) => {
                w.array(1);
                w.str("AllBlocksCleared");
            }
        }
    }
    w.opt_uint(rank.map(u64::from));
    buf
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::{decode_batch, KvEvent};
    use serde_json::Value;

    fn fixture(name: &str) -> (Value, Vec<u8>) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/events");
        let json: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap()).unwrap();
        let bytes = std::fs::read(dir.join(format!("{name}.msgpack"))).unwrap();
        (json, bytes)
    }

    fn events_of(expected: &Value) -> Vec<WorkerEvent> {
        let u64s = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect::<Vec<u64>>();
        expected["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| match e["type"].as_str().unwrap() {
                "BlockStored" => WorkerEvent::BlockStored {
                    block_hashes: u64s(&e["block_hashes"]),
                    parent_block_hash: e["parent_block_hash"].as_u64(),
                    token_ids: u64s(&e["token_ids"]).into_iter().map(|t| t as u32).collect(),
                    block_size: e["block_size"].as_u64().unwrap() as u32,
                    cache_salt: None,
                },
                "BlockRemoved" => WorkerEvent::BlockRemoved { block_hashes: u64s(&e["block_hashes"]) },
                _ => WorkerEvent::AllBlocksCleared,
            })
            .collect()
    }

    /// The worker's encoder reproduces vLLM's own publisher's bytes (fixtures captured from
    /// vLLM 0.23 and 0.33, see fixtures/events/README.md).
    #[test]
    fn byte_identical_to_vllm_captures() {
        for (name, enc) in [
            ("vllm033_stored_int_root", EventEncoding::Map),
            ("vllm033_many_events", EventEncoding::Map),
            ("vllm033_no_rank", EventEncoding::Map),
            ("vllm023_stored_int_root", EventEncoding::Array),
            ("vllm023_many_events", EventEncoding::Array),
            ("vllm023_no_rank", EventEncoding::Array),
        ] {
            let (json, bytes) = fixture(name);
            let exp = &json["expected"];
            let rank = exp["data_parallel_rank"].as_u64().map(|r| r as u32);
            let ours = encode_batch(exp["ts"].as_f64().unwrap(), &events_of(exp), rank, enc);
            assert_eq!(ours, bytes, "{name}");
        }
    }

    #[test]
    fn salted_first_block_carries_its_salt_for_kvroute() {
        let ev = WorkerEvent::BlockStored {
            block_hashes: vec![1, 2],
            parent_block_hash: None,
            token_ids: (0..32).collect(),
            block_size: 16,
            cache_salt: Some("tenant-a".into()),
        };
        for enc in [EventEncoding::Map, EventEncoding::Array] {
            let b = decode_batch(&encode_batch(1.5, std::slice::from_ref(&ev), Some(0), enc)).unwrap();
            let KvEvent::BlockStored(s) = &b.events[0] else { panic!("{b:?}") };
            assert_eq!(s.cache_salt.as_deref(), Some("tenant-a"), "{enc:?}");
            assert_eq!(s.block_hashes.len(), 2);
        }
    }
}

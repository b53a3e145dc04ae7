//! The host's own maps (contexts, shared data, call counters) are looked up on every hostcall:
//! they hash with FxHash's multiply-rotate mixing instead of the standard library's SipHash,
//! which showed in the filter's profile. The test host needs no protection against adversarial
//! keys (a collision only costs a probe).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` with [`FastHasher`].
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// FxHash's word mixing (rustc's hasher): fast, deterministic, not keyed.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FastHasher {
    hash: u64,
}

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FastHasher {
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    fn finish(&self) -> u64 {
        self.hash
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_that_differ_hash_apart_and_maps_find_them() {
        let mut m: FastMap<Vec<u8>, u32> = FastMap::default();
        for i in 0..1000u32 {
            m.insert(format!("kvroute/r8192/e/{i}").into_bytes(), i);
        }
        for i in 0..1000u32 {
            assert_eq!(m.get(format!("kvroute/r8192/e/{i}").as_bytes()), Some(&i));
        }
        let h = |b: &[u8]| {
            let mut s = FastHasher::default();
            s.write(b);
            s.finish()
        };
        assert_ne!(h(b"proxy_get_shared_data"), h(b"proxy_set_shared_data"));
    }
}

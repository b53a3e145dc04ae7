//! Byte mutations of JSON bodies for the property tests that compare a body reader with
//! serde_json's verdict (`core/tests/token_ids.rs`, and the direct reader's unit tests in
//! `core/src/request/scan.rs`, which include this file by path).

/// Apply `muts` to `b`: each inserts, replaces or deletes one byte at a position (taken modulo
/// the length), the byte drawn from `bytes` (JSON's significant bytes, to favour near misses).
pub fn mutate(mut b: Vec<u8>, muts: Vec<(usize, u8, u8)>, bytes: &[u8]) -> Vec<u8> {
    for (at, op, byte) in muts {
        let at = at % (b.len() + 1);
        let byte = bytes[usize::from(byte) % bytes.len()];
        match op % 3 {
            0 => b.insert(at, byte),
            1 if at < b.len() => b[at] = byte,
            _ if at < b.len() => {
                b.remove(at);
            }
            _ => {}
        }
    }
    b
}

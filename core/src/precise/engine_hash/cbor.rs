//! CBOR, as `cbor2.dumps(obj, canonical=True)` writes this shape: tuples are arrays, shortest heads.

use super::{push_words, ExtraValue};

/// One token's CBOR head (major type 0, big-endian argument) in a word: `(word, bytes used)`.
#[inline(always)]
fn cbor_token_word(t: u32) -> (u64, usize) {
    let words = [
        u64::from(t),
        24 | u64::from(t) << 8,
        25 | u64::from((t as u16).swap_bytes()) << 8,
        26 | u64::from(t.swap_bytes()) << 8,
    ];
    const LENS: [usize; 4] = [1, 2, 3, 5];
    let i = usize::from(t >= 24) + usize::from(t > 0xff) + usize::from(t > 0xffff);
    (words[i], LENS[i])
}

/// Serialize `(parent, tuple(tokens), extra)` exactly as `cbor2.dumps(obj, canonical=True)` does
/// (vLLM's `sha256_cbor` and `xxhash_cbor` preimage): `[bytes, [uint...], null | [extra...]]`.
/// Replaces the contents of `out`.
pub fn encode_cbor(parent: &[u8], tokens: &[u32], extra: Option<&[ExtraValue<'_>]>, out: &mut Vec<u8>) {
    out.clear();
    out.reserve(parent.len() + tokens.len() * 5 + 16);
    let mut c = Cbor { out };
    c.head(4, 3);
    c.bytes(parent);
    c.head(4, tokens.len() as u64);
    push_words(c.out, tokens, cbor_token_word);
    match extra {
        None => c.out.push(0xf6),
        Some(values) => c.array(values),
    }
}

pub(super) struct Cbor<'o> {
    pub(super) out: &'o mut Vec<u8>,
}

impl Cbor<'_> {
    #[inline]
    fn head(&mut self, major: u8, v: u64) {
        let m = major << 5;
        if v < 24 {
            self.out.push(m | v as u8);
        } else if v <= 0xff {
            self.out.extend_from_slice(&[m | 24, v as u8]);
        } else if v <= 0xffff {
            let b = (v as u16).to_be_bytes();
            self.out.extend_from_slice(&[m | 25, b[0], b[1]]);
        } else if v <= 0xffff_ffff {
            let b = (v as u32).to_be_bytes();
            self.out.extend_from_slice(&[m | 26, b[0], b[1], b[2], b[3]]);
        } else {
            self.out.push(m | 27);
            self.out.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn bytes(&mut self, b: &[u8]) {
        self.head(2, b.len() as u64);
        self.out.extend_from_slice(b);
    }

    pub(super) fn str(&mut self, s: &str) {
        self.head(3, s.len() as u64);
        self.out.extend_from_slice(s.as_bytes());
    }

    fn array(&mut self, values: &[ExtraValue<'_>]) {
        self.head(4, values.len() as u64);
        for v in values {
            match *v {
                ExtraValue::Str(s) => self.str(s),
                // Major type 1 encodes -1 - v, which is !v in two's complement.
                ExtraValue::Int(i) if i < 0 => self.head(1, !(i as u64)),
                ExtraValue::Int(i) => self.head(0, i as u64),
                ExtraValue::Bytes(b) => self.bytes(b),
                ExtraValue::Tuple(items) => self.array(items),
                ExtraValue::None => self.out.push(0xf6),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn cbor_hex(parent: &[u8], tokens: &[u32], extra: Option<&[ExtraValue<'_>]>) -> String {
        let mut out = Vec::new();
        encode_cbor(parent, tokens, extra, &mut out);
        hex(&out)
    }

    // Expected bytes below are from `cbor2.dumps(obj, canonical=True)`.

    #[test]
    fn cbor_heads_switch_at_integer_widths() {
        let tokens = [0, 23, 24, 255, 256, 65535, 65536, u32::MAX];
        let ints = [-1, -24, -25, -256, -257, -65536, -65537, i64::MIN];
        let values: Vec<ExtraValue<'_>> = ints.iter().map(|&i| ExtraValue::Int(i)).collect();
        let extra = [ExtraValue::Tuple(&values), ExtraValue::Int(1 << 32)];
        let want = concat!(
            "8342010288",
            "0017181818ff19010019ffff1a000100001affffffff",
            "82882037381838ff39010039ffff3a000100003b7fffffffffffffff",
            "1b0000000100000000",
        );
        assert_eq!(cbor_hex(&[1, 2], &tokens, Some(&extra)), want);
    }
}

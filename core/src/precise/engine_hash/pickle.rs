//! Pickle, protocol 5, byte-exact with CPython's C pickler (`Modules/_pickle.c`) for this shape.

use super::{push_words, ExtraValue};

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const EMPTY_TUPLE: u8 = b')';
const TUPLE1: u8 = 0x85;
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const BINBYTES8: u8 = 0x8e;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

const FRAME_HEADER_SIZE: usize = 9;
const FRAME_SIZE_MIN: usize = 4;
const FRAME_SIZE_TARGET: usize = 64 * 1024;
const NO_FRAME: usize = usize::MAX;

/// Serialize `(parent, tuple(tokens), extra)` exactly as `pickle.dumps(obj, protocol=5)` does in
/// CPython (vLLM's `sha256` and `xxhash` preimage). `extra: None` is Python's `None`, otherwise a
/// tuple of the given values. Equal strings are each written in full, as vLLM's values arrive from
/// the wire as distinct Python objects, except CPython's shared objects (the empty and
/// one-character Latin-1 strings, the empty and one-byte bytes), which become memo references
/// (`BINGET`) after their first occurrence. Replaces the contents of `out`.
pub fn encode_pickle(parent: &[u8], tokens: &[u32], extra: Option<&[ExtraValue<'_>]>, out: &mut Vec<u8>) {
    out.clear();
    out.reserve(parent.len() + tokens.len() * 7 + 32);
    let mut p = Pickler::new(out);
    // save((parent, tokens, extra)): a 3-tuple saves its items, then TUPLE3 and MEMOIZE.
    p.boundary();
    p.save_bytes(parent);
    p.save_tokens(tokens);
    match extra {
        None => {
            p.boundary();
            p.write(&[NONE]);
        }
        Some(values) => p.save_tuple(values),
    }
    p.write(&[TUPLE1 + 2]);
    p.memoize();
    p.finish();
}

/// CPython objects that are shared singletons: the empty and one-character Latin-1 `str`, the
/// empty and one-byte `bytes`. Key: `kind << 9 | (256 for empty, else the character/byte)`.
fn singleton_key_str(s: &str) -> Option<u16> {
    if s.len() > 2 {
        return None;
    }
    let mut chars = s.chars();
    match (chars.next(), chars.next()) {
        (None, _) => Some(256),
        (Some(c), None) if u32::from(c) < 256 => Some(u32::from(c) as u16),
        _ => None,
    }
}

fn singleton_key_bytes(b: &[u8]) -> Option<u16> {
    match b {
        [] => Some(512 | 256),
        [x] => Some(512 | u16::from(*x)),
        _ => None,
    }
}

pub(super) struct Pickler<'o> {
    out: &'o mut Vec<u8>,
    /// Start of the open frame's header in `out`, or `NO_FRAME`.
    frame_start: usize,
    framing: bool,
    /// Number of memoized objects so far (the next MEMOIZE's index).
    memo_len: u32,
    /// Memo indices of the singletons seen so far: inline for the handful a block has, then
    /// `overflow` (which allocates only past 8 distinct singletons).
    singletons: [(u16, u32); 8],
    n_singletons: usize,
    overflow: Vec<(u16, u32)>,
}

impl<'o> Pickler<'o> {
    pub(super) fn new(out: &'o mut Vec<u8>) -> Self {
        out.clear();
        out.extend_from_slice(&[PROTO, 5]);
        Pickler {
            out,
            frame_start: NO_FRAME,
            framing: true,
            memo_len: 0,
            singletons: [(0, 0); 8],
            n_singletons: 0,
            overflow: Vec::new(),
        }
    }

    pub(super) fn finish(mut self) {
        self.write(&[STOP]);
        self.commit_frame();
    }

    /// `_Pickler_Write`: opens a frame if none is open.
    #[inline]
    fn write(&mut self, data: &[u8]) {
        if self.framing && self.frame_start == NO_FRAME {
            self.frame_start = self.out.len();
            self.out.extend_from_slice(&[0u8; FRAME_HEADER_SIZE]);
        }
        self.out.extend_from_slice(data);
    }

    /// `_Pickler_CommitFrame`: fill in the header, or drop it for a frame under 4 bytes.
    fn commit_frame(&mut self) {
        if !self.framing || self.frame_start == NO_FRAME {
            return;
        }
        let start = self.frame_start;
        let len = self.out.len() - start - FRAME_HEADER_SIZE;
        if len >= FRAME_SIZE_MIN {
            self.out[start] = FRAME;
            self.out[start + 1..start + FRAME_HEADER_SIZE].copy_from_slice(&(len as u64).to_le_bytes());
        } else {
            self.out.copy_within(start + FRAME_HEADER_SIZE.., start);
            self.out.truncate(self.out.len() - FRAME_HEADER_SIZE);
        }
        self.frame_start = NO_FRAME;
    }

    /// `_Pickler_OpcodeBoundary`, called at the start of every `save()`: close a frame that has
    /// reached 64 KiB.
    #[inline]
    fn boundary(&mut self) {
        if self.frame_start != NO_FRAME && self.out.len() - self.frame_start - FRAME_HEADER_SIZE >= FRAME_SIZE_TARGET {
            self.commit_frame();
        }
    }

    /// `_Pickler_write_bytes`: payloads of 64 KiB or more go outside any frame.
    fn write_payload(&mut self, header: &[u8], data: &[u8]) {
        if data.len() >= FRAME_SIZE_TARGET {
            self.commit_frame();
            self.framing = false;
            self.write(header);
            self.write(data);
            self.framing = true;
        } else {
            self.write(header);
            self.write(data);
        }
    }

    fn memoize(&mut self) {
        self.memo_len += 1;
        self.write(&[MEMOIZE]);
    }

    /// BINGET if this singleton was memoized already; otherwise remember where it will be.
    fn memo_singleton(&mut self, key: Option<u16>) -> bool {
        let Some(key) = key else { return false };
        let seen = self.singletons[..self.n_singletons].iter().chain(&self.overflow).find(|(k, _)| *k == key);
        if let Some(&(_, idx)) = seen {
            if idx < 256 {
                self.write(&[BINGET, idx as u8]);
            } else {
                let b = idx.to_le_bytes();
                self.write(&[LONG_BINGET, b[0], b[1], b[2], b[3]]);
            }
            return true;
        }
        if self.n_singletons < self.singletons.len() {
            self.singletons[self.n_singletons] = (key, self.memo_len);
            self.n_singletons += 1;
        } else {
            self.overflow.push((key, self.memo_len));
        }
        false
    }

    fn save_bytes(&mut self, data: &[u8]) {
        self.boundary();
        if self.memo_singleton(singleton_key_bytes(data)) {
            return;
        }
        let n = data.len();
        if n <= 0xff {
            self.write_payload(&[SHORT_BINBYTES, n as u8], data);
        } else if let Ok(n32) = u32::try_from(n) {
            let b = n32.to_le_bytes();
            self.write_payload(&[BINBYTES, b[0], b[1], b[2], b[3]], data);
        } else {
            let mut h = [BINBYTES8, 0, 0, 0, 0, 0, 0, 0, 0];
            h[1..].copy_from_slice(&(n as u64).to_le_bytes());
            self.write_payload(&h, data);
        }
        self.memoize();
    }

    pub(super) fn save_str(&mut self, s: &str) {
        self.boundary();
        if self.memo_singleton(singleton_key_str(s)) {
            return;
        }
        let n = s.len();
        if n <= 0xff {
            self.write_payload(&[SHORT_BINUNICODE, n as u8], s.as_bytes());
        } else if let Ok(n32) = u32::try_from(n) {
            let b = n32.to_le_bytes();
            self.write_payload(&[BINUNICODE, b[0], b[1], b[2], b[3]], s.as_bytes());
        } else {
            let mut h = [BINUNICODE8, 0, 0, 0, 0, 0, 0, 0, 0];
            h[1..].copy_from_slice(&(n as u64).to_le_bytes());
            self.write_payload(&h, s.as_bytes());
        }
        self.memoize();
    }

    /// `save_long` for a value that needs no LONG1 (fits a signed 32-bit int).
    #[inline]
    fn save_small_int(&mut self, v: i32) {
        let b = v.to_le_bytes();
        if b[2] != 0 || b[3] != 0 {
            self.write(&[BININT, b[0], b[1], b[2], b[3]]);
        } else if b[1] != 0 {
            self.write(&[BININT2, b[0], b[1]]);
        } else {
            self.write(&[BININT1, b[0]]);
        }
    }

    fn save_int(&mut self, v: i64) {
        self.boundary();
        if let Ok(small) = i32::try_from(v) {
            self.save_small_int(small);
            return;
        }
        // LONG1: minimal little-endian two's complement.
        let b = v.to_le_bytes();
        let mut n = 8;
        while n > 1 {
            let (top, sign_below) = (b[n - 1], b[n - 2] & 0x80 != 0);
            if (top == 0 && !sign_below) || (top == 0xff && sign_below) {
                n -= 1;
            } else {
                break;
            }
        }
        self.write(&[LONG1, n as u8]);
        self.write(&b[..n]);
    }

    #[inline]
    fn save_token(&mut self, t: u32) {
        self.boundary();
        match i32::try_from(t) {
            Ok(v) => self.save_small_int(v),
            Err(_) => {
                // 2^31 ≤ t < 2^32: five bytes, the last one a zero sign byte.
                let b = t.to_le_bytes();
                self.write(&[LONG1, 5, b[0], b[1], b[2], b[3], 0]);
            }
        }
    }

    fn save_tokens(&mut self, tokens: &[u32]) {
        self.boundary();
        let open = self.frame_start != NO_FRAME;
        if open && self.out.len() - self.frame_start - FRAME_HEADER_SIZE + 2 + 7 * tokens.len() < FRAME_SIZE_TARGET {
            // The whole tuple fits in the open frame, so no frame boundary can fall inside it:
            // write the tokens in one pass.
            let n = tokens.len();
            if n > 3 {
                self.out.push(MARK);
            }
            push_words(self.out, tokens, pickle_token_word);
            match n {
                0 => self.out.push(EMPTY_TUPLE),
                1..=3 => self.out.push(TUPLE1 + (n as u8 - 1)),
                _ => self.out.push(TUPLE),
            }
            if n > 0 {
                self.memoize();
            }
            return;
        }
        match tokens.len() {
            0 => self.write(&[EMPTY_TUPLE]),
            n @ 1..=3 => {
                tokens.iter().for_each(|&t| self.save_token(t));
                self.write(&[TUPLE1 + (n as u8 - 1)]);
                self.memoize();
            }
            _ => {
                self.write(&[MARK]);
                tokens.iter().for_each(|&t| self.save_token(t));
                self.write(&[TUPLE]);
                self.memoize();
            }
        }
    }

    fn save_value(&mut self, v: &ExtraValue<'_>) {
        match *v {
            ExtraValue::Str(s) => self.save_str(s),
            ExtraValue::Int(i) => self.save_int(i),
            ExtraValue::Bytes(b) => self.save_bytes(b),
            ExtraValue::Tuple(items) => self.save_tuple(items),
            ExtraValue::None => {
                self.boundary();
                self.write(&[NONE]);
            }
        }
    }

    fn save_tuple(&mut self, items: &[ExtraValue<'_>]) {
        self.boundary();
        match items.len() {
            0 => self.write(&[EMPTY_TUPLE]),
            n @ 1..=3 => {
                items.iter().for_each(|v| self.save_value(v));
                self.write(&[TUPLE1 + (n as u8 - 1)]);
                self.memoize();
            }
            _ => {
                self.write(&[MARK]);
                items.iter().for_each(|v| self.save_value(v));
                self.write(&[TUPLE]);
                self.memoize();
            }
        }
    }
}

/// One token's pickle opcode and little-endian argument in a word: `(word, bytes used)`.
/// Branch-free: token widths vary at random, so branches would mispredict.
#[inline(always)]
fn pickle_token_word(t: u32) -> (u64, usize) {
    let v = u64::from(t);
    let words = [
        u64::from(BININT1) | v << 8,
        u64::from(BININT2) | v << 8,
        u64::from(BININT) | v << 8,
        // LONG1, 5 bytes: the value and a zero sign byte (already zero in the word).
        u64::from(LONG1) | 5 << 8 | v << 16,
    ];
    const LENS: [usize; 4] = [2, 3, 5, 7];
    let i = usize::from(t > 0xff) + usize::from(t > 0xffff) + usize::from(t > 0x7fff_ffff);
    (words[i], LENS[i])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn pickle_hex(parent: &[u8], tokens: &[u32], extra: Option<&[ExtraValue<'_>]>) -> String {
        let mut out = Vec::new();
        encode_pickle(parent, tokens, extra, &mut out);
        hex(&out)
    }

    // Expected bytes below are from CPython 3.11 `pickle.dumps(obj, protocol=5)`.

    #[test]
    fn pickle_token_opcodes_switch_at_integer_widths() {
        // (b'', (0, 255, 256, 65535, 65536, 2**31-1, 2**31, 2**32-1), None)
        let got = pickle_hex(b"", &[0, 255, 256, 65535, 65536, 0x7fff_ffff, 0x8000_0000, u32::MAX], None);
        let want = concat!(
            "8005952c00000000000000", // PROTO 5, FRAME 44
            "430094",                 // SHORT_BINBYTES b'', MEMOIZE
            "28",                     // MARK
            "4b004bff",               // BININT1 0, 255
            "4d00014dffff",           // BININT2 256, 65535
            "4a000001004affffff7f",   // BININT 65536, 2**31-1
            "8a050000008000",         // LONG1 2**31 (5 bytes, zero sign byte)
            "8a05ffffffff00",         // LONG1 2**32-1
            "74944e87942e",           // TUPLE MEMOIZE, NONE, TUPLE3 MEMOIZE, STOP
        );
        assert_eq!(got, want);
    }

    #[test]
    fn pickle_small_tuples_use_tuple_n_opcodes() {
        // (b'\xaa'*16, (1,), None) and (b'\xaa'*16, (1, 2, 3), None)
        let p = [0xaa; 16];
        assert_eq!(
            pickle_hex(&p, &[1], None),
            "8005951b000000000000004310aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa944b0185944e87942e"
        );
        assert_eq!(
            pickle_hex(&p, &[1, 2, 3], None),
            "8005951f000000000000004310aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa944b014b024b0387944e87942e"
        );
    }

    #[test]
    fn pickle_ints_in_extras_cover_long1_and_negatives() {
        // (b'', (1,), ((-1, -256, 2**31, -2**31-1, 2**39, -2**39, 2**63-1, -2**63),))
        let ints = [-1, -256, 1 << 31, -(1 << 31) - 1, 1 << 39, -(1 << 39), i64::MAX, i64::MIN];
        let values: Vec<ExtraValue<'_>> = ints.iter().map(|&i| ExtraValue::Int(i)).collect();
        let extra = [ExtraValue::Tuple(&values)];
        let want = concat!(
            "8005954a000000000000004300944b01859428",
            "4affffffff4a00ffffff",           // -1, -256: BININT (4 bytes, sign-extended)
            "8a0500000080008a05ffffff7fff",   // 2**31, -2**31-1: LONG1 5 bytes
            "8a060000000080008a050000000080", // 2**39 (6 bytes), -2**39 (5 bytes)
            "8a08ffffffffffffff7f8a080000000000000080",
            "7494859487942e",
        );
        assert_eq!(pickle_hex(b"", &[1], Some(&extra)), want);
    }

    #[test]
    fn pickle_shares_singleton_strings_only() {
        // (b'', (1,), ('a', 'a', 'ab', 'ab')) where the two 'ab' are distinct objects
        let extra = [ExtraValue::Str("a"), ExtraValue::Str("a"), ExtraValue::Str("ab"), ExtraValue::Str("ab")];
        let want = concat!(
            "8005951d000000000000004300944b01859428",
            "8c0161946802", // 'a' is memo 2; the second 'a' is BINGET 2
            "8c026162948c02616294",
            "749487942e",
        );
        assert_eq!(pickle_hex(b"", &[1], Some(&extra)), want);
    }
}

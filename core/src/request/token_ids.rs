//! The token-id fast path of the JSON body: a completions body whose `prompt` is a plain list of
//! token ids (or of token-id lists) is read without serde walking the ids one by one.
//!
//! [`parse_fast`] finds the top-level `prompt` value by skimming the body (strings and bracket
//! depth only), reads it with a specialized integer-array scanner that accepts only the plain
//! form (`[` ids `]`, ids in `0..=4294967295` without sign, fraction, exponent or leading zero,
//! JSON whitespace between tokens), and lets serde parse the rest of the body with that value
//! replaced by `null`. It answers `None` whenever anything is not that plain form, or serde
//! rejects the rest: the caller then parses the original body with serde alone, so every error
//! (text, JSON path, line and column) is the serde path's own. A `Some` is exactly the value the
//! serde path gives: the ids it accepted are ones serde reads the same way, and the rest of the
//! body is the same bytes (the property and fuzz tests check this against the serde path).

use super::body::{parse_body_plain, RawBody, RawPrompt};
use super::Prompt;

/// The body as the serde path would read it, when its prompt is a plain token-id list (or list
/// of token-id lists); `None` for anything else (the serde path then decides).
pub(super) fn parse_fast(body: &[u8]) -> Option<RawBody> {
    let start = locate_prompt(body)?;
    let (prompts, end) = scan_prompt(body, start)?;
    let mut patched = Vec::with_capacity(body.len() - (end - start) + 4);
    patched.extend_from_slice(&body[..start]);
    patched.extend_from_slice(b"null");
    patched.extend_from_slice(&body[end..]);
    let mut raw = parse_body_plain(&patched)?;
    if raw.prompt.is_some() {
        return None; // cannot happen: the patched body's prompt is `null`
    }
    raw.prompt = Some(RawPrompt(prompts));
    Some(raw)
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\r' | b'\t')
}

fn skip_ws(body: &[u8], mut i: usize) -> usize {
    while body.get(i).is_some_and(|&b| is_ws(b)) {
        i += 1;
    }
    i
}

/// `i` is just past an opening quote: the index just past the closing one.
fn skip_string(body: &[u8], mut i: usize) -> Option<usize> {
    loop {
        match *body.get(i)? {
            b'"' => return Some(i + 1),
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
}

/// Skips one value (skimmed: strings and bracket depth only); the index of the `,` or `}` that
/// follows it at the top level.
fn skip_value(body: &[u8], mut i: usize) -> Option<usize> {
    let mut depth = 0usize;
    loop {
        match *body.get(i)? {
            b'"' => i = skip_string(body, i + 1)?,
            b'[' | b'{' => {
                depth += 1;
                i += 1;
            }
            b']' | b'}' if depth == 0 => return Some(i),
            b']' | b'}' => {
                depth -= 1;
                i += 1;
            }
            b',' if depth == 0 => return Some(i),
            _ => i += 1,
        }
    }
}

/// Where the value of the top-level `prompt` key starts, when that value is a list. `None` when
/// the body is no object, has no such key before its end or before `messages` (a chat body),
/// or has a key with an escape before it (serde would decode it; the skim does not).
fn locate_prompt(body: &[u8]) -> Option<usize> {
    let mut i = skip_ws(body, 0);
    if body.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = skip_ws(body, i);
        if body.get(i) != Some(&b'"') {
            return None;
        }
        let key_start = i + 1;
        let mut j = key_start;
        loop {
            match *body.get(j)? {
                b'"' => break,
                b'\\' => return None,
                _ => j += 1,
            }
        }
        let key = &body[key_start..j];
        i = skip_ws(body, j + 1);
        if body.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(body, i + 1);
        match key {
            b"prompt" => return (body.get(i) == Some(&b'[')).then_some(i),
            b"messages" => return None,
            _ => {}
        }
        i = skip_value(body, i)?;
        if body[i] != b',' {
            return None;
        }
        i += 1;
    }
}

/// Reads the list at `start` (`body[start] == b'['`): its prompts and the index just past it.
fn scan_prompt(body: &[u8], start: usize) -> Option<(Vec<Prompt>, usize)> {
    let i = skip_ws(body, start + 1);
    match *body.get(i)? {
        b'[' => {
            let mut prompts = Vec::new();
            let mut i = i;
            loop {
                let (ids, end) = scan_ids(body, i, 0)?;
                prompts.push(Prompt::Tokens(ids));
                i = skip_ws(body, end);
                match *body.get(i)? {
                    b']' => return Some((prompts, i + 1)),
                    b',' => {
                        i = skip_ws(body, i + 1);
                        if body.get(i) != Some(&b'[') {
                            return None;
                        }
                    }
                    _ => return None,
                }
            }
        }
        b'0'..=b'9' => {
            // At least two bytes an id (a digit and a comma); six on average for a large vocabulary.
            let (ids, end) = scan_ids(body, start, (body.len() - start) / 6)?;
            Some((vec![Prompt::Tokens(ids)], end))
        }
        _ => None,
    }
}

/// Reads a non-empty list of token ids at `start` (`body[start] == b'['`): the ids and the index
/// just past its `]`; `capacity` is reserved first.
fn scan_ids(body: &[u8], start: usize, capacity: usize) -> Option<(Vec<u32>, usize)> {
    let mut ids = Vec::with_capacity(capacity);
    let mut i = skip_ws(body, start + 1);
    loop {
        // The common case from one 8-byte load: an id of one to seven digits without a leading
        // zero, then `,` and perhaps one space (compact JSON, Python's `json.dumps`). Everything
        // else goes the general way below.
        if let Some(chunk) = body.get(i..i + 8) {
            let w = u64::from_le_bytes(<[u8; 8]>::try_from(chunk).ok()?);
            // The id's length is where the next id's load starts from, so it comes from the
            // shortest computation: the first byte below `'0'` (`,`, space or `]` after an id;
            // exact for the lowest such byte, where no borrow has come from below). That its
            // bytes are all digits is checked beside it, off that path.
            let below = w.wrapping_sub(0x30 * ONES) & !w & HIGHS;
            let n = (below.trailing_zeros() / 8) as usize;
            if (1..8).contains(&n)
                && (w >> (8 * n)) as u8 == b','
                && non_digit_bytes(w) & ((1 << (8 * n)) - 1) == 0
                && (n == 1 || w as u8 != b'0')
            {
                ids.push(swar_digits(w ^ (0x30 * ONES), n) as u32);
                i += n + 1;
                let after = if n < 7 { (w >> (8 * (n + 1))) as u8 } else { body.get(i).copied().unwrap_or(0) };
                if is_ws(after) {
                    i = skip_ws(body, i + 1);
                }
                continue;
            }
        }
        let (id, end) = scan_id(body, i)?;
        ids.push(id);
        i = end;
        // The common separators first: `,` right after the id, then `, `.
        match *body.get(i)? {
            b',' => i += 1,
            b']' => return Some((ids, i + 1)),
            _ => {
                i = skip_ws(body, i);
                match *body.get(i)? {
                    b',' => i += 1,
                    b']' => return Some((ids, i + 1)),
                    _ => return None,
                }
            }
        }
        if body.get(i).is_some_and(|&b| is_ws(b)) {
            i = skip_ws(body, i + 1);
        }
    }
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;
const LOWS: u64 = 0x7f7f_7f7f_7f7f_7f7f;

/// Per-byte top bit set iff the byte is no ASCII digit: `t` holds each byte xor `'0'` (each
/// digit's value, for digits), and a byte is a digit iff that is below 10, i.e. neither `t` nor
/// its low seven bits plus 0x76 has the top bit (exact for every byte: that sum never carries
/// into the next byte).
fn non_digit_bytes(w: u64) -> u64 {
    let t = w ^ (0x30 * ONES);
    (((t & LOWS) + 0x76 * ONES) | t) & HIGHS
}

/// The value of the first `n` (1..=8) digit values in `t` (one a byte, the most significant in
/// the lowest byte): shifted so that the bytes below them are zeros (leading zero digits), then
/// combined pairwise.
fn swar_digits(t: u64, n: usize) -> u64 {
    let d = t << (8 * (8 - n));
    let d = (d & (0x0f * ONES)).wrapping_mul(10 * 256 + 1) >> 8;
    let d = (d & 0x00ff_00ff_00ff_00ff).wrapping_mul(100 * 65_536 + 1) >> 16;
    (d & 0x0000_ffff_0000_ffff).wrapping_mul(10_000 * (1 << 32) + 1) >> 32
}

/// One token id at `i`: a plain JSON integer (`0`, or a non-zero digit then digits) in
/// `0..=u32::MAX`, followed by a byte that is no digit, `.`, `e` or `E` (anything else is
/// left to the serde path: a float, a leading zero, a sign, an id out of range).
fn scan_id(body: &[u8], i: usize) -> Option<(u32, usize)> {
    let (mut v, mut n) = match body.get(i..i + 8) {
        Some(chunk) => {
            // Eight bytes at once: the digits run up to the first non-digit byte.
            let w = u64::from_le_bytes(<[u8; 8]>::try_from(chunk).ok()?);
            let t = w ^ (0x30 * ONES);
            let non_digit = non_digit_bytes(w);
            let n = (non_digit.trailing_zeros() / 8) as usize;
            if n == 0 {
                return None;
            }
            (swar_digits(t, n), n)
        }
        None => {
            let mut v = 0u64;
            let mut n = 0;
            while let Some(&b @ b'0'..=b'9') = body.get(i + n) {
                v = v * 10 + u64::from(b - b'0');
                n += 1;
                if n == 8 {
                    break;
                }
            }
            if n == 0 {
                return None;
            }
            (v, n)
        }
    };
    // Up to ten digits in all (u32::MAX has ten).
    while let Some(&b @ b'0'..=b'9') = body.get(i + n) {
        if n == 10 {
            return None;
        }
        v = v * 10 + u64::from(b - b'0');
        n += 1;
    }
    if body[i] == b'0' && n > 1 {
        return None; // a leading zero: not JSON
    }
    match body.get(i + n) {
        Some(b'.' | b'e' | b'E') | None => None,
        Some(_) => Some((u32::try_from(v).ok()?, i + n)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(s: &str) -> Option<Vec<u32>> {
        scan_ids(s.as_bytes(), 0, 0).map(|(v, end)| {
            assert_eq!(end, s.len());
            v
        })
    }

    #[test]
    fn scans_plain_ids() {
        assert_eq!(ids("[0]"), Some(vec![0]));
        assert_eq!(
            ids("[1,22,333,4444,55555,666666,7777777,88888888,999999999,4294967295]"),
            Some(vec![1, 22, 333, 4444, 55555, 666666, 7777777, 88888888, 999999999, 4294967295])
        );
        assert_eq!(ids("[ 1 , 2\n,\t3\r]"), Some(vec![1, 2, 3]));
        assert_eq!(ids("[12345678901234,0]"), None);
        for bad in ["[4294967296]", "[01]", "[1.0]", "[1e3]", "[-1]", "[+1]", "[1,]", "[]", "[1 2]", "[\"1\"]", "[1"] {
            assert_eq!(ids(bad), None, "{bad}");
        }
        // Long lists, in various separators, with a bad id somewhere.
        for sep in [",", ", ", " ,", ",\n", ",  "] {
            let want: Vec<u32> = (0..300u32).map(|k| k.wrapping_mul(2_654_435_761) >> (k % 32)).collect();
            let items: Vec<String> = want.iter().map(u32::to_string).collect();
            assert_eq!(ids(&format!("[{}]", items.join(sep))), Some(want.clone()), "{sep:?}");
            for (at, bad) in [(17, "01"), (40, "4294967296"), (90, "1.5"), (150, "-1"), (299, "12345678901")] {
                let mut items = items.clone();
                items[at] = bad.to_owned();
                assert_eq!(ids(&format!("[{}]", items.join(sep))), None, "{sep:?} {bad}");
            }
        }
        // Every length of id at every offset around the 8-byte load.
        for n in 1..=10u32 {
            let id = 10u64.pow(n - 1) + 7;
            for pad in 0..10 {
                let s = format!("[{}{id}]", " ".repeat(pad));
                let want = u32::try_from(id).ok().map(|v| vec![v]);
                assert_eq!(ids(&s), want, "{s}");
            }
        }
    }

    /// The one-load common case and the general path against serde's reading: ids of every
    /// length at every offset, the separators it takes (`,`, `, `) and others it leaves to the
    /// general path, and an id it must not take (a leading zero, eight or more digits, a float, a
    /// sign, an exponent) anywhere.
    #[test]
    fn the_common_case_reads_what_serde_reads() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..3000 {
            let sep = [",", ", ", ",", ", ", " ,", ",\n", ",  ", ", \t"][round % 8];
            let pad = " ".repeat(round % 11);
            let mut items: Vec<String> = (0..(1 + next() % 40))
                .map(|_| {
                    let digits = 1 + next() % 9;
                    (next() % 10u64.pow(digits as u32)).to_string()
                })
                .collect();
            if round % 3 == 0 {
                let at = (next() % items.len() as u64) as usize;
                let bad = ["01", "007", "12345678", "4294967296", "1.5", "-3", "1e2", "99999999999", "1a", "1\"", "1:"];
                items[at] = bad[(next() % bad.len() as u64) as usize].to_owned();
            }
            let s = format!("[{pad}{}]", items.join(sep));
            let serde: Option<Vec<u32>> = serde_json::from_str(&s).ok();
            let plain = items.iter().all(|t| t.bytes().all(|b| b.is_ascii_digit()));
            match ids(&s) {
                Some(v) => assert_eq!(Some(v), serde, "{s}"),
                None => assert!(serde.is_none() || !plain, "{s}: serde reads it, the scanner does not"),
            }
        }
    }

    #[test]
    fn the_fast_path_takes_plain_token_id_bodies() {
        for body in [
            r#"{"model":"m","prompt":[1,2,3]}"#,
            r#" { "max_tokens" : 5 , "model" : "m\"x" , "prompt" : [ 1 , 2 ] } "#,
            r#"{"tools":[{"a":"]"}],"prompt":[[1],[2, 3]],"model":"m"}"#,
        ] {
            assert!(parse_fast(body.as_bytes()).is_some(), "{body}");
        }
        for body in [
            r#"{"model":"m","prompt":"text"}"#,
            r#"{"model":"m","messages":[],"prompt":[1]}"#,
            r#"{"model":"m","prompt":[1,-2]}"#,
            r#"{"model":"m","prompt":[1],"prompt":[2]}"#,
            r#"{"m\u006fdel":"m","prompt":[1]}"#,
        ] {
            assert!(parse_fast(body.as_bytes()).is_none(), "{body}");
        }
    }
}

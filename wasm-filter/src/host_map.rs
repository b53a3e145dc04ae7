//! The serialized header-map form of proxy-wasm ABI 0.2.1, as the filter writes it (local replies,
//! callouts) and reads it (`proxy_get_header_map_pairs`): a little-endian u32 count, a (key size,
//! value size) u32 pair per entry, then each key and each value followed by a NUL. Pure, so it is
//! unit-tested natively; the hostcalls that use it are in `host` (wasm32 only).
#![cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]

/// The ABI form of `pairs`.
pub(crate) fn serialize_map(pairs: &[(&str, &str)]) -> Vec<u8> {
    let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    let data: usize = pairs.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    let mut out = Vec::with_capacity(4 + 8 * pairs.len() + data);
    out.extend_from_slice(&len(pairs.len()));
    for (k, v) in pairs {
        out.extend_from_slice(&len(k.len()));
        out.extend_from_slice(&len(v.len()));
    }
    for (k, v) in pairs {
        for part in [k.as_bytes(), v.as_bytes()] {
            out.extend_from_slice(part);
            out.push(0);
        }
    }
    out
}

/// The pairs of a serialized map, as slices of it; `None` when the form is malformed (a count or
/// size past the end). Empty input is the empty map.
pub(crate) fn parse_map(bytes: &[u8]) -> Option<Vec<(&[u8], &[u8])>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let u32_at = |at: usize| -> Option<usize> {
        let b = bytes.get(at..at.checked_add(4)?)?;
        usize::try_from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])).ok()
    };
    let n = u32_at(0)?;
    let mut at = n.checked_mul(8)?.checked_add(4)?;
    if at > bytes.len() {
        return None;
    }
    let mut pairs = Vec::with_capacity(n);
    for i in 0..n {
        let mut part = |size: usize| -> Option<&[u8]> {
            let end = at.checked_add(size)?;
            let v = bytes.get(at..end)?;
            at = end.checked_add(1)?;
            Some(v)
        };
        let (ks, vs) = (u32_at(4 + 8 * i)?, u32_at(8 + 8 * i)?);
        let k = part(ks)?;
        let v = part(vs)?;
        pairs.push((k, v));
    }
    Some(pairs)
}

/// Header pairs as text, all in one buffer: a request's headers cost two allocations, not two
/// per header.
#[derive(Default)]
pub(crate) struct HeaderList {
    text: String,
    /// Per pair, where its key and its value end in `text` (each starts where the one before
    /// ends).
    ends: Vec<(usize, usize)>,
}

impl HeaderList {
    /// Room for `pairs` pairs of `bytes` bytes in all.
    pub(crate) fn with_capacity(pairs: usize, bytes: usize) -> HeaderList {
        HeaderList { text: String::with_capacity(bytes), ends: Vec::with_capacity(pairs) }
    }

    pub(crate) fn push(&mut self, key: &str, value: &str) {
        self.text.push_str(key);
        let k = self.text.len();
        self.text.push_str(value);
        self.ends.push((k, self.text.len()));
    }

    /// The pairs, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        let mut start = 0;
        self.ends.iter().map(move |&(k, v)| {
            let pair = (self.text.get(start..k).unwrap_or_default(), self.text.get(k..v).unwrap_or_default());
            start = v;
            pair
        })
    }

    /// The first value of `name` (matched exactly).
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.iter().find(|(k, _)| *k == name).map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_matches_the_spec_layout() {
        let m = serialize_map(&[(":path", "/v1"), ("x", "")]);
        let mut want = vec![2, 0, 0, 0, 5, 0, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0];
        want.extend_from_slice(b":path\0/v1\0x\0\0");
        assert_eq!(m, want);
        assert_eq!(parse_map(&m), Some(vec![(&b":path"[..], &b"/v1"[..]), (&b"x"[..], &b""[..])]));
        assert_eq!(parse_map(&serialize_map(&[])), Some(Vec::new()));
        assert_eq!(parse_map(&[]), Some(Vec::new()));
    }

    #[test]
    fn malformed_forms_are_none_never_a_panic() {
        let good = serialize_map(&[("key", "value")]);
        for cut in 0..good.len() {
            // Every truncation but the one that only drops the final NUL is malformed.
            let r = parse_map(&good[..cut]);
            assert!(cut == 0 || cut == good.len() - 1 || r.is_none(), "cut {cut}: {r:?}");
        }
        assert_eq!(parse_map(&[0xff, 0xff, 0xff, 0xff]), None, "a count past the end");
        let mut huge = good;
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(parse_map(&huge), None, "a size past the end");
        let mut bad_utf8 = serialize_map(&[("k", "v")]);
        bad_utf8[12] = 0xff;
        assert_eq!(parse_map(&bad_utf8), Some(vec![(&b"\xff"[..], &b"v"[..])]));
    }

    #[test]
    fn header_lists_keep_pairs_in_order() {
        let mut h = HeaderList::with_capacity(3, 8);
        h.push(":path", "/v1");
        h.push("x", "");
        h.push("", "y");
        h.push("x", "2");
        assert_eq!(h.iter().collect::<Vec<_>>(), vec![(":path", "/v1"), ("x", ""), ("", "y"), ("x", "2")]);
        assert_eq!((h.get("x"), h.get(""), h.get("z")), (Some(""), Some("y"), None));
        assert_eq!(HeaderList::default().iter().count(), 0);
    }
}

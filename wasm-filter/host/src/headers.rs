//! Header maps as Envoy keeps them: lower-case keys, several values per key allowed, pseudo-headers
//! (`:method`, `:path`, ...) ahead of the others, insertion order otherwise.

use crate::abi;

/// An ordered multi-map of header names to values, as the filter sees it through the ABI.
///
/// Keys are lower-cased on the way in (Envoy's `LowerCaseString`); values are bytes (Envoy allows
/// any byte but NUL, CR and LF; the host does not check). [`HeaderMap::get`] returns the first value,
/// as `proxy_get_header_map_value` does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeaderMap {
    entries: Vec<(Vec<u8>, Vec<u8>)>,
}

impl HeaderMap {
    /// An empty map.
    pub fn new() -> HeaderMap {
        HeaderMap::default()
    }

    /// Number of entries (what `num_headers` of the HTTP callbacks counts).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sum of key and value lengths (`proxy_get_header_map_size`, Envoy's `byteSize()`).
    pub fn byte_size(&self) -> usize {
        self.entries.iter().map(|(k, v)| k.len() + v.len()).sum()
    }

    /// The first value of `name` (case-insensitive) as text; `None` when absent or not UTF-8.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.get_bytes(name.as_bytes()).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// The first value of `name` (case-insensitive).
    pub fn get_bytes(&self, name: &[u8]) -> Option<&[u8]> {
        self.entries.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
    }

    /// Every value of `name` (case-insensitive), in order.
    pub fn get_all(&self, name: &str) -> Vec<&[u8]> {
        self.entries
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v.as_slice())
            .collect()
    }

    /// Whether `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.get_bytes(name.as_bytes()).is_some()
    }

    /// Entries in order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> + Clone {
        self.entries.iter().map(|(k, v)| (k.as_slice(), v.as_slice()))
    }

    /// Entries as text (invalid UTF-8 replaced), handy in assertions.
    pub fn to_pairs(&self) -> Vec<(String, String)> {
        self.iter()
            .map(|(k, v)| (String::from_utf8_lossy(k).into_owned(), String::from_utf8_lossy(v).into_owned()))
            .collect()
    }

    /// Adds an entry (`proxy_add_header_map_value`): pseudo-headers go after the last pseudo-header,
    /// others at the end.
    pub fn append(&mut self, name: impl AsRef<[u8]>, value: impl AsRef<[u8]>) {
        let key = name.as_ref().to_ascii_lowercase();
        let value = value.as_ref().to_vec();
        if key.first() == Some(&b':') {
            let at = self.entries.iter().position(|(k, _)| k.first() != Some(&b':')).unwrap_or(self.entries.len());
            self.entries.insert(at, (key, value));
        } else {
            self.entries.push((key, value));
        }
    }

    /// Removes every entry of `name`, then adds one (`proxy_replace_header_map_value`; Envoy's
    /// `setCopy`).
    pub fn set(&mut self, name: impl AsRef<[u8]>, value: impl AsRef<[u8]>) {
        self.remove(name.as_ref());
        self.append(name, value);
    }

    /// Removes every entry of `name` (`proxy_remove_header_map_value`).
    pub fn remove(&mut self, name: impl AsRef<[u8]>) {
        let name = name.as_ref();
        self.entries.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    }

    /// The ABI serialization (see [`abi::serialize_pairs`]); empty map → no bytes.
    pub fn serialize(&self) -> Vec<u8> {
        if self.entries.is_empty() {
            return Vec::new();
        }
        abi::serialize_pairs(self.iter())
    }

    /// Parses the ABI serialization; keys are lower-cased as Envoy does on insertion.
    pub fn deserialize(data: &[u8]) -> Result<HeaderMap, abi::PairsError> {
        let mut map = HeaderMap::new();
        for (k, v) in abi::parse_pairs(data)? {
            map.append(k, v);
        }
        Ok(map)
    }
}

impl<K: AsRef<[u8]>, V: AsRef<[u8]>> FromIterator<(K, V)> for HeaderMap {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in iter {
            map.append(k, v);
        }
        map
    }
}

impl<K: AsRef<[u8]>, V: AsRef<[u8]>, const N: usize> From<[(K, V); N]> for HeaderMap {
    fn from(pairs: [(K, V); N]) -> HeaderMap {
        pairs.into_iter().collect()
    }
}

impl<K: AsRef<[u8]>, V: AsRef<[u8]>> From<&[(K, V)]> for HeaderMap {
    fn from(pairs: &[(K, V)]) -> HeaderMap {
        pairs.iter().map(|(k, v)| (k.as_ref(), v.as_ref())).collect()
    }
}

impl<K: AsRef<[u8]>, V: AsRef<[u8]>> From<Vec<(K, V)>> for HeaderMap {
    fn from(pairs: Vec<(K, V)>) -> HeaderMap {
        pairs.into_iter().collect()
    }
}

impl From<&HeaderMap> for HeaderMap {
    fn from(map: &HeaderMap) -> HeaderMap {
        map.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_cases_keys_and_orders_pseudo_headers_first() {
        let mut map = HeaderMap::from([("Content-Type", "application/json"), (":path", "/v1")]);
        map.append(":method", "POST");
        assert_eq!(
            map.to_pairs(),
            vec![
                (":path".into(), "/v1".into()),
                (":method".into(), "POST".into()),
                ("content-type".into(), "application/json".into())
            ]
        );
        assert_eq!(map.get("CONTENT-TYPE"), Some("application/json"));
    }

    #[test]
    fn set_replaces_every_value() {
        let mut map = HeaderMap::from([("x", "1"), ("y", "2"), ("x", "3")]);
        map.set("X", "4");
        assert_eq!(map.to_pairs(), vec![("y".into(), "2".into()), ("x".into(), "4".into())]);
        assert_eq!(map.byte_size(), 4);
    }

    #[test]
    fn serialization_round_trips() {
        let map = HeaderMap::from([(":authority", "a"), ("k", "")]);
        assert_eq!(HeaderMap::deserialize(&map.serialize()).unwrap(), map);
        assert!(HeaderMap::new().serialize().is_empty());
    }
}

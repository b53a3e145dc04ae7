//! Segmenting: where tokenization provably restarts (see the `tokenize` module docs), so that the
//! prefix cache can tokenize each segment on its own.

use daachorse::{DoubleArrayAhoCorasick, DoubleArrayAhoCorasickBuilder, MatchKind};

/// Finds the cuts (see the module docs) with the automaton `tokenizers` itself uses.
pub(super) struct Segmenter {
    /// Every non-normalized added token, leftmost-longest, as in `AddedVocabulary`.
    trie: DoubleArrayAhoCorasick<u32>,
    /// Sorted ids of the added tokens after which a cut is allowed.
    cut_after: Vec<u32>,
}

impl Segmenter {
    pub(super) fn new(tok: &tokenizers::Tokenizer) -> Option<Segmenter> {
        if !position_independent(tok) {
            return None;
        }
        let decoder = tok.get_added_tokens_decoder();
        let encode_special = tok.get_encode_special_tokens();
        let mut patterns: Vec<(String, u32)> = Vec::new();
        let mut cut_after = Vec::new();
        for (id, t) in &decoder {
            if t.normalized {
                continue;
            }
            patterns.push((t.content.clone(), *id));
            let last_ok = t
                .content
                .chars()
                .last()
                .is_some_and(|c| c.is_ascii_graphic() && !c.is_ascii_alphanumeric() && c != '_');
            let skipped = encode_special && t.special;
            if last_ok && !t.rstrip && !t.single_word && !skipped {
                cut_after.push(*id);
            }
        }
        if cut_after.is_empty() {
            return None;
        }
        cut_after.sort_unstable();
        let trie = DoubleArrayAhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build_with_values(patterns.iter().map(|(p, id)| (p.as_str(), *id)))
            .ok()?;
        Some(Segmenter { trie, cut_after })
    }

    /// Appends the end offsets of the segments of `text` (the last one is `text.len()`).
    pub(super) fn cuts(&self, text: &str, out: &mut Vec<usize>) {
        out.clear();
        for m in self.trie.leftmost_find_iter(text) {
            if self.cut_after.binary_search(&m.value()).is_ok() {
                out.push(m.end());
            }
        }
        if out.last() != Some(&text.len()) {
            out.push(text.len());
        }
    }
}

/// False when a pipeline component depends on where a piece sits in the whole text, or is random.
fn position_independent(tok: &tokenizers::Tokenizer) -> bool {
    if let tokenizers::models::ModelWrapper::BPE(bpe) = tok.get_model() {
        if bpe.dropout.is_some_and(|p| p > 0.0) {
            return false;
        }
    }
    fn has_first_scheme(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::Object(o) => {
                (o.get("type").and_then(|t| t.as_str()) == Some("Metaspace")
                    && o.get("prepend_scheme").and_then(|s| s.as_str()) == Some("first"))
                    || o.values().any(has_first_scheme)
            }
            serde_json::Value::Array(a) => a.iter().any(has_first_scheme),
            _ => false,
        }
    }
    match tok.get_pre_tokenizer().map(serde_json::to_value) {
        None => true,
        Some(Ok(v)) => !has_first_scheme(&v),
        Some(Err(_)) => false,
    }
}

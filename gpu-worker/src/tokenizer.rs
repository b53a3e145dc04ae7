//! A deterministic stand-in for a real tokenizer: every UTF-8 byte of the text is one token
//! (`byte % vocab`), chat messages are rendered with a fixed template first, and generated ids
//! turn back into text (ids below 256 as bytes, the others as short words).

/// Words that generated ids ≥ 256 stand for (`WORDS[(id - 256) % WORDS.len()]`, after a space).
const WORDS: [&str; 32] = [
    "the", "cache", "block", "token", "route", "prefix", "decode", "prefill", "batch", "layer", "head", "key", "value",
    "query", "model", "worker", "queue", "event", "hash", "page", "pool", "step", "chunk", "stream", "hit", "miss",
    "load", "store", "evict", "send", "pull", "push",
];

/// Token ids of `text`: its UTF-8 bytes, each `byte % vocab`.
pub fn encode(text: &str, vocab: u32) -> Vec<u32> {
    text.bytes().map(|b| u32::from(b) % vocab.max(1)).collect()
}

/// One chat message as the template sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// The text content.
    pub content: String,
}

/// The fixed chat template: `<|role|>\ncontent\n` per message, then `<|assistant|>\n`.
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str("<|");
        out.push_str(&m.role);
        out.push_str("|>\n");
        out.push_str(&m.content);
        out.push('\n');
    }
    out.push_str("<|assistant|>\n");
    out
}

/// Turns generated ids into text incrementally (a character split over several byte tokens is
/// emitted once complete; invalid bytes become U+FFFD).
#[derive(Debug, Default, Clone)]
pub struct Detokenizer {
    pending: Vec<u8>,
}

impl Detokenizer {
    /// A detokenizer with nothing pending.
    pub fn new() -> Self {
        Detokenizer::default()
    }

    /// Text completed by token `id` (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let mut out = String::new();
        if id < 256 {
            self.pending.push(id as u8);
            self.drain_valid(&mut out);
        } else {
            self.flush_into(&mut out);
            out.push(' ');
            out.push_str(WORDS[(id as usize - 256) % WORDS.len()]);
        }
        out
    }

    /// Whatever is still pending (an incomplete character), lossily.
    pub fn finish(&mut self) -> String {
        let mut out = String::new();
        self.flush_into(&mut out);
        out
    }

    fn flush_into(&mut self, out: &mut String) {
        if !self.pending.is_empty() {
            out.push_str(&String::from_utf8_lossy(&self.pending));
            self.pending.clear();
        }
    }

    fn drain_valid(&mut self, out: &mut String) {
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    if let Ok(s) = std::str::from_utf8(&self.pending[..valid]) {
                        out.push_str(s);
                    }
                    match e.error_len() {
                        // Incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return;
                        }
                        Some(bad) => {
                            out.push('\u{fffd}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }
}

/// The whole text of `ids`.
pub fn decode(ids: &[u32]) -> String {
    let mut d = Detokenizer::new();
    let mut out: String = ids.iter().map(|&i| d.push(i)).collect();
    out.push_str(&d.finish());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_vocab_wraps() {
        let ids = encode("héllo", 512);
        assert_eq!(ids.len(), "héllo".len());
        assert_eq!(decode(&ids), "héllo");
        assert_eq!(encode("A", 10), vec![65 % 10]);
    }

    #[test]
    fn split_characters_come_out_once_complete() {
        let mut d = Detokenizer::new();
        let bytes = "é".as_bytes();
        assert_eq!(d.push(u32::from(bytes[0])), "");
        assert_eq!(d.push(u32::from(bytes[1])), "é");
        assert_eq!(d.push(0xff), "\u{fffd}");
        assert_eq!(d.push(300), format!(" {}", WORDS[44 % 32]));
        assert_eq!(d.push(0xc3), "");
        assert_eq!(d.finish(), "\u{fffd}");
    }

    #[test]
    fn chat_template() {
        let m = [ChatMessage { role: "user".into(), content: "hi".into() }];
        assert_eq!(render_chat(&m), "<|user|>\nhi\n<|assistant|>\n");
    }
}

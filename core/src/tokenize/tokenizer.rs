//! The tokenizer: `tokenizer.json` (Hugging Face `tokenizers`), its chat template, and the prefix
//! cache it encodes through.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;

use super::cache::{Part, PrefixCache, PrefixCacheConfig, PrefixCacheStats, Segment};
use super::segment::Segmenter;
use super::template::{chat_options, ChatOptions, ChatTemplate};
use super::{ChatMessage, TokenizeError};

fn tk_error(e: tokenizers::Error) -> String {
    e.to_string()
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    match p.downcast::<String>() {
        Ok(s) => format!("panicked: {s}"),
        Err(p) => match p.downcast::<&'static str>() {
            Ok(s) => format!("panicked: {s}"),
            Err(_) => "panicked".to_owned(),
        },
    }
}

/// Stands in for the content of the message where a chat request's keys end
/// ([`Tokenizer::keyable_token_ids`]): control characters no template strips, and no text a
/// client would send.
const KEY_LIMIT_SENTINEL: &str = "\u{1}kvroute-key-limit\u{1}";

/// A model's tokenizer (and chat template), with an optional prefix cache. `Send + Sync`: share
/// one per model across threads.
///
/// ---
///
/// Exact token ids for routing (feature `tokenizer`, native only): Hugging Face `tokenizers` for
/// the model's `tokenizer.json`, minijinja for its chat template, and a prefix tokenization cache
/// so that turn N of a conversation only tokenizes what is new.
///
/// The ids are the ones the engine computes. vLLM renders a chat request with transformers'
/// `apply_chat_template` (Jinja2 with `trim_blocks`, `lstrip_blocks`, loop controls and the
/// `raise_exception`, `tojson` and `strftime_now` helpers) and tokenizes the text with
/// `add_special_tokens=False`; a completions prompt is tokenized with `add_special_tokens=True`.
/// [`Tokenizer::encode_chat`] and [`Tokenizer::encode_prompt`] do the same.
///
/// `strftime_now` writes the request's time, never the system clock's: the caller passes it
/// ([`ChatOptions::now_unix_s`], [`Tokenizer::keyable_token_ids`]'s `now_ms`; the router passes
/// the `now_ms` of the route call), so a rendering is a function of its inputs.
///
/// # Multimodal requests
///
/// Images, audio, video and embeddings become placeholder tokens that the model's processor
/// writes and whose blocks vLLM hashes with the media's own hash, none of which a router has. The
/// router therefore keys only what comes before them: [`Tokenizer::keyable_token_ids`] renders
/// the conversation with the content of the first message holding such a part replaced by a
/// sentinel, cuts the text where the sentinel starts, tokenizes that prefix and drops its last
/// token (the text after the cut may merge with it). See `request` for why the cut is at the
/// message's content rather than at the part.
///
/// # The prefix cache
///
/// Hugging Face tokenizers first cut the text at *added tokens* (`<|im_start|>`, `<|im_end|>`, …)
/// and tokenize each piece between them on its own. So the text can be cut after an added token
/// and each *segment* tokenized alone, provided the cut cannot change which added tokens match or
/// how they strip whitespace. A cut is made only after an added token that
///
/// - is matched on the raw text (`normalized: false`), so the cut is also a piece boundary;
/// - has no `rstrip` (which would eat whitespace after the cut) and no `single_word` (which looks
///   at the character after it);
/// - ends with an ASCII character that is neither a word character nor whitespace (so the
///   `single_word` and `lstrip` checks of a token right after the cut see the same thing as at
///   the start of a text, and an earlier token's `rstrip` stops before the cut);
/// - is not skipped (`encode_special_tokens` off for special tokens).
///
/// Matches are found with the same automaton `tokenizers` uses (daachorse, leftmost-longest, over
/// every non-normalized added token), so the cuts are exactly among the places where `tokenizers`
/// itself cuts. The cache is disabled (everything is tokenized in full) when a component depends on
/// a piece's position in the whole text: a `Metaspace` pre-tokenizer with `prepend_scheme: first`,
/// or BPE dropout. With these rules the ids of a text are the concatenation of the ids of its
/// segments, each of which depends only on the segment's own text; the cache maps segment text →
/// ids (hash lookup, then a byte comparison, so a hash collision can only cost a miss). The tests
/// in `core/tests/tokenize.rs` check the equality on many conversations and random texts.
///
/// ```
/// use kvroute::{ChatMessage, PrefixCacheConfig, Tokenizer};
///
/// // A Hugging Face model directory: tokenizer.json, tokenizer_config.json, chat_template.jinja.
/// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/tokenizer");
/// let tok = Tokenizer::from_dir(dir)?.with_prefix_cache(PrefixCacheConfig::default());
/// let mut chat = vec![ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi!")];
/// let turn1 = tok.encode_chat(&chat, true)?;
/// chat.push(ChatMessage::new("assistant", "Hello."));
/// chat.push(ChatMessage::new("user", "What is a KV cache?"));
/// let turn2 = tok.encode_chat(&chat, true)?; // only the new messages are tokenized
/// // Same prefix up to turn 1's generation header `<|im_start|>assistant\n` (3 tokens).
/// assert_eq!(turn2[..turn1.len() - 3], turn1[..turn1.len() - 3]);
/// let stats = tok.prefix_cache_stats().unwrap_or_default();
/// assert!(stats.hit_tokens > 0);
/// # Ok::<(), kvroute::TokenizeError>(())
/// ```
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
    segmenter: Option<Segmenter>,
    cache: Option<PrefixCache>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .field("chat_template", &self.template.is_some())
            .field("prefix_cache_supported", &self.segmenter.is_some())
            .field("prefix_cache", &self.cache.as_ref().map(|c| c.config))
            .finish()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TokenizeError> {
    std::fs::read(path).map_err(|e| TokenizeError::Io { path: path.display().to_string(), message: e.to_string() })
}

fn utf8(bytes: Vec<u8>, path: &Path) -> Result<String, TokenizeError> {
    String::from_utf8(bytes)
        .map_err(|_| TokenizeError::Io { path: path.display().to_string(), message: "not UTF-8 text".to_owned() })
}

impl Tokenizer {
    /// Loads a `tokenizer.json`. Truncation and padding settings in it are dropped (transformers
    /// drops them too unless a call asks for them).
    pub fn from_json(json: &[u8]) -> Result<Tokenizer, TokenizeError> {
        let loaded = catch_unwind(AssertUnwindSafe(|| tokenizers::Tokenizer::from_bytes(json)));
        let mut inner = match loaded {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => return Err(TokenizeError::Tokenizer { message: tk_error(e) }),
            Err(p) => return Err(TokenizeError::Tokenizer { message: panic_message(p) }),
        };
        inner.with_truncation(None).map_err(|e| TokenizeError::Tokenizer { message: tk_error(e) })?;
        inner.with_padding(None);
        let segmenter = Segmenter::new(&inner);
        Ok(Tokenizer { inner, template: None, segmenter, cache: None })
    }

    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer, TokenizeError> {
        Tokenizer::from_json(&read(path.as_ref())?)
    }

    /// Loads a Hugging Face model directory: `tokenizer.json`, plus the chat template from
    /// `chat_template.jinja` or `tokenizer_config.json` and the special tokens from
    /// `tokenizer_config.json`, when present.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Tokenizer, TokenizeError> {
        let dir = dir.as_ref();
        let tok = Tokenizer::from_file(dir.join("tokenizer.json"))?;
        let jinja_path = dir.join("chat_template.jinja");
        let jinja = if jinja_path.exists() { Some(utf8(read(&jinja_path)?, &jinja_path)?) } else { None };
        let config_path = dir.join("tokenizer_config.json");
        let template = if config_path.exists() {
            match ChatTemplate::from_tokenizer_config(&utf8(read(&config_path)?, &config_path)?, jinja.as_deref()) {
                Ok(t) => Some(t),
                Err(TokenizeError::NoChatTemplate) => None,
                Err(e) => return Err(e),
            }
        } else {
            jinja.as_deref().map(ChatTemplate::new).transpose()?
        };
        Ok(match template {
            Some(t) => tok.with_chat_template(t),
            None => tok,
        })
    }

    /// Sets the chat template.
    pub fn with_chat_template(mut self, template: ChatTemplate) -> Tokenizer {
        self.template = Some(template);
        self
    }

    /// Turns on the prefix cache (a no-op when [`Tokenizer::prefix_cache_supported`] is false).
    pub fn with_prefix_cache(mut self, config: PrefixCacheConfig) -> Tokenizer {
        self.cache = Some(PrefixCache::new(config));
        self
    }

    /// The chat template, if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Whether this tokenizer has added tokens after which tokenization provably restarts (see
    /// the module docs); without them the prefix cache never splits a text.
    pub fn prefix_cache_supported(&self) -> bool {
        self.segmenter.is_some()
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Id of a token (vocabulary or added), if it exists.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Renders a conversation with the chat template (`strftime_now` at
    /// [`ChatOptions::now_unix_s`]).
    pub fn render_chat(&self, messages: &[ChatMessage], options: &ChatOptions) -> Result<String, TokenizeError> {
        self.template.as_ref().ok_or(TokenizeError::NoChatTemplate)?.render(messages, options)
    }

    /// Token ids of a chat request as the engine computes them: the rendered template, tokenized
    /// without adding special tokens (the template writes them). No time is given: a template
    /// that calls `strftime_now` needs [`Tokenizer::encode_chat_with`] and
    /// [`ChatOptions::with_now_ms`].
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.encode_chat_with(messages, &ChatOptions::new(add_generation_prompt))
    }

    /// [`Tokenizer::encode_chat`] with tools, template kwargs and the request's time.
    pub fn encode_chat_with(&self, messages: &[ChatMessage], options: &ChatOptions) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(messages, options)?;
        self.encode(&text, false)
    }

    /// Token ids of a completions prompt: special tokens added as the post-processor says (BOS for
    /// Llama-style tokenizers), as vLLM does for `/v1/completions`.
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_prompt_impl(prompt)
    }

    /// The token ids the engine will see for a parsed request, one sequence per prompt: a chat
    /// request through the chat template (with its `tools`, `chat_template_kwargs`,
    /// `add_generation_prompt`, `continue_final_message`), completions text with special tokens
    /// (as vLLM tokenizes it), token-id prompts as given. Content parts other than text (images,
    /// audio, …) are left out: their placeholder tokens are the model processor's business, so
    /// for such a request these are not the engine's ids; key with
    /// [`Tokenizer::keyable_token_ids`].
    ///
    /// `now_ms` is the request's time (the `now_ms` of the route call, milliseconds since the
    /// UNIX epoch): the date a template's `strftime_now` writes (see
    /// [`ChatOptions::with_now_ms`]). The system clock is never read.
    pub fn request_token_ids(
        &self,
        req: &crate::request::RouteRequest,
        now_ms: u64,
    ) -> Result<Vec<Vec<u32>>, TokenizeError> {
        if let Some(chat) = &req.chat {
            return Ok(vec![self.encode_chat_with(&chat.messages.to_vec(), &chat_options(chat, now_ms))?]);
        }
        req.prompts
            .iter()
            .map(|p| match p {
                crate::request::Prompt::Tokens(ids) => Ok(ids.clone()),
                crate::request::Prompt::Text(bytes) => self.encode_prompt_impl(&String::from_utf8_lossy(bytes)),
            })
            .collect()
    }

    /// The token ids the router may key for a parsed request, one sequence per prompt: those of
    /// [`Tokenizer::request_token_ids`] up to the first media message of a chat
    /// ([`ChatInput::media`](crate::request::ChatInput::media)) or the request's
    /// [`KeyLimit`](crate::request::KeyLimit) (all of them without either).
    ///
    /// A chat request is rendered with the content of its first media message replaced by a sentinel
    /// (every other message, the tools and the options as they are, so the template takes the
    /// same branches), the text is cut where the sentinel starts (where vLLM puts the message's
    /// first media placeholder or, with interleaving, something before it), and that prefix is
    /// tokenized. Its last token is dropped: the text after the cut could merge with it (BPE,
    /// whitespace pre-tokenization), and the tokens before it are fixed. A template that does not
    /// render the content at all yields no ids. Completions sequences are cut the same way at the
    /// limit; sequences after it yield no ids.
    ///
    /// `now_ms` is the request's time, as for [`Tokenizer::request_token_ids`].
    pub fn keyable_token_ids(
        &self,
        req: &crate::request::RouteRequest,
        now_ms: u64,
    ) -> Result<Vec<Vec<u32>>, TokenizeError> {
        use crate::request::Prompt;
        if let Some((chat, at)) = req.chat.as_ref().and_then(|c| c.media.map(|m| (c, m.message))) {
            let mut messages = chat.messages.to_vec();
            let Some(m) = messages.get_mut(at) else { return Ok(vec![Vec::new()]) };
            m.content = Some(KEY_LIMIT_SENTINEL.to_owned());
            let text = self.render_chat(&messages, &chat_options(chat, now_ms))?;
            let Some(cut) = text.find(KEY_LIMIT_SENTINEL) else { return Ok(vec![Vec::new()]) };
            let mut ids = self.encode(&text[..cut], false)?;
            ids.pop();
            return Ok(vec![ids]);
        }
        let Some(limit) = req.key_limit else { return self.request_token_ids(req, now_ms) };
        req.prompts
            .iter()
            .enumerate()
            .map(|(i, p)| match (p, i.cmp(&limit.prompt)) {
                (_, std::cmp::Ordering::Greater) => Ok(Vec::new()),
                (Prompt::Tokens(ids), std::cmp::Ordering::Equal) => Ok(ids[..limit.keyed_len.min(ids.len())].to_vec()),
                (Prompt::Tokens(ids), std::cmp::Ordering::Less) => Ok(ids.clone()),
                (Prompt::Text(bytes), std::cmp::Ordering::Equal) => {
                    let head = &bytes[..limit.keyed_len.min(bytes.len())];
                    // A limit inside a UTF-8 sequence: cut before that character.
                    let head = match std::str::from_utf8(head) {
                        Ok(s) => s,
                        Err(e) => std::str::from_utf8(&head[..e.valid_up_to()]).unwrap_or_default(),
                    };
                    let mut ids = self.encode_prompt_impl(head)?;
                    ids.pop();
                    Ok(ids)
                }
                (Prompt::Text(bytes), std::cmp::Ordering::Less) => {
                    self.encode_prompt_impl(&String::from_utf8_lossy(bytes))
                }
            })
            .collect()
    }

    fn encode_prompt_impl(&self, prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode(prompt, true)
    }

    /// Token ids of `text`, through the prefix cache when it is on. Always equal to
    /// [`Tokenizer::encode_uncached`].
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        match (&self.cache, &self.segmenter) {
            (Some(cache), Some(seg)) => self.encode_cached(cache, seg, text, add_special_tokens),
            _ => self.encode_uncached(text, add_special_tokens),
        }
    }

    /// Token ids of `text`, tokenized in full (no cache).
    pub fn encode_uncached(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        Ok(self.hf_encode(text, add_special_tokens)?.get_ids().to_vec())
    }

    fn hf_encode(&self, text: &str, add_special_tokens: bool) -> Result<tokenizers::Encoding, TokenizeError> {
        match catch_unwind(AssertUnwindSafe(|| self.inner.encode_fast(text, add_special_tokens))) {
            Ok(Ok(e)) => Ok(e),
            Ok(Err(e)) => Err(TokenizeError::Encode { message: tk_error(e) }),
            Err(p) => Err(TokenizeError::Encode { message: panic_message(p) }),
        }
    }

    fn encode_cached(
        &self,
        cache: &PrefixCache,
        seg: &Segmenter,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut ends = Vec::new();
        seg.cuts(text, &mut ends);
        let mut starts = 0;
        let mut parts: Vec<Part<'_>> = Vec::with_capacity(ends.len());
        for &end in &ends {
            let s = &text[starts..end];
            parts.push((s, xxhash_rust::xxh3::xxh3_64(s.as_bytes()), None));
            starts = end;
        }
        {
            let mut st = cache.lock();
            let st = &mut *st;
            for (s, key, slot) in &mut parts {
                if let Some(hit) = st.lru.get(key) {
                    if *hit.text == **s {
                        st.stats.hits += 1;
                        st.stats.hit_tokens += hit.ids.len() as u64;
                        *slot = Some(Arc::clone(&hit.ids));
                    }
                }
            }
        }
        let mut ids: Vec<u32> = Vec::with_capacity(text.len() / 3 + 8);
        let mut fresh: Vec<(u64, Segment)> = Vec::new();
        let (mut dup_hits, mut dup_tokens) = (0u64, 0u64);
        for (s, key, slot) in &parts {
            if let Some(hit) = slot {
                ids.extend_from_slice(hit);
            } else if let Some((_, seen)) = fresh.iter().find(|(k, seg)| k == key && *seg.text == **s) {
                // The same segment earlier in this text (e.g. `\n<|im_start|>` between turns).
                ids.extend_from_slice(&seen.ids);
                dup_hits += 1;
                dup_tokens += seen.ids.len() as u64;
            } else {
                let enc = self.hf_encode(s, false)?;
                ids.extend_from_slice(enc.get_ids());
                fresh.push((*key, Segment { text: (*s).into(), ids: enc.get_ids().into() }));
            }
        }
        if !fresh.is_empty() {
            let mut st = cache.lock();
            let st = &mut *st;
            st.stats.hits += dup_hits;
            st.stats.hit_tokens += dup_tokens;
            for (key, segment) in fresh {
                st.stats.misses += 1;
                st.stats.miss_tokens += segment.ids.len() as u64;
                if segment.text.len() > cache.config.max_segment_bytes || segment.cost() > cache.config.max_bytes {
                    continue;
                }
                st.stats.bytes += segment.cost();
                if let Some((_, old)) = st.lru.push(key, segment) {
                    st.stats.bytes -= old.cost();
                }
                while st.stats.bytes > cache.config.max_bytes {
                    match st.lru.pop_lru() {
                        Some((_, old)) => {
                            st.stats.bytes -= old.cost();
                            st.stats.evictions += 1;
                        }
                        None => break,
                    }
                }
            }
            st.stats.entries = st.lru.len();
        }
        if add_special_tokens {
            return self.post_process(ids);
        }
        Ok(ids)
    }

    /// Applies the post-processor (special tokens) to ids tokenized without it, as `encode` does.
    fn post_process(&self, ids: Vec<u32>) -> Result<Vec<u32>, TokenizeError> {
        if self.inner.get_post_processor().is_none() {
            return Ok(ids);
        }
        let n = ids.len();
        let enc = tokenizers::Encoding::new(
            ids,
            vec![0; n],
            vec![String::new(); n],
            vec![None; n],
            vec![(0, 0); n],
            vec![0; n],
            vec![1; n],
            Vec::new(),
            Default::default(),
        );
        match catch_unwind(AssertUnwindSafe(|| self.inner.post_process(enc, None, true))) {
            Ok(Ok(e)) => Ok(e.get_ids().to_vec()),
            Ok(Err(e)) => Err(TokenizeError::Encode { message: tk_error(e) }),
            Err(p) => Err(TokenizeError::Encode { message: panic_message(p) }),
        }
    }

    /// Counters of the prefix cache, if it is on.
    pub fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        self.cache.as_ref().map(|c| {
            let st = c.lock();
            PrefixCacheStats { entries: st.lru.len(), ..st.stats }
        })
    }

    /// Empties the prefix cache (counters other than `entries` and `bytes` are kept).
    pub fn clear_prefix_cache(&self) {
        if let Some(c) = &self.cache {
            let mut st = c.lock();
            st.lru.clear();
            st.stats.entries = 0;
            st.stats.bytes = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_inside_a_completions_prompt_cuts_before_its_character() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/tokenizer");
        let tok = Tokenizer::from_dir(dir).unwrap();
        let text = "Grüße aus Köln, und noch viel mehr Text danach.";
        let mut req = crate::request::RouteRequest::text("m", text);
        let at = text.find('ö').unwrap() + 1; // inside the two bytes of 'ö'
        req.key_limit = Some(crate::request::KeyLimit { prompt: 0, keyed_len: at, message: None, media_parts: 1 });
        let keyable = tok.keyable_token_ids(&req, 0).unwrap();
        let full = tok.encode_prompt(text).unwrap();
        assert_eq!(keyable.len(), 1);
        assert!(!keyable[0].is_empty() && full.starts_with(&keyable[0]));
        let head = tok.encode_prompt(&text[..at - 1]).unwrap();
        assert_eq!(keyable[0].len() + 1, head.len());
        // A second sequence after the limit yields no ids; one before it all of them.
        req.prompts.push(crate::request::Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(tok.keyable_token_ids(&req, 0).unwrap()[1], Vec::<u32>::new());
        req.key_limit = Some(crate::request::KeyLimit { prompt: 1, keyed_len: 2, message: None, media_parts: 0 });
        assert_eq!(tok.keyable_token_ids(&req, 0).unwrap(), vec![full, vec![1, 2]]);
    }
}

//! Request parsing: OpenAI `/v1/completions` and `/v1/chat/completions` bodies plus headers →
//! [`RouteRequest`].
//!
//! The module is private: its full description is the documentation of [`RouteRequest`].

mod body;
mod chat;
mod headers;
mod media;
mod scan;
mod token_ids;

pub use chat::{ChatInput, ChatMessage, ChatMessageRef, ChatMessages, ChatMessagesIter, RawJson};
pub use media::{ChatMedia, KeyLimit, MediaKey, MEDIA_PART_TOKENS};

use crate::config::RequestConfig;
use crate::error::RequestError;

use body::{parse_body, parse_body_serde, PromptEmbeds, RawBody};
use headers::HeaderValues;
use media::render_chat;

/// Which OpenAI API the body belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    ChatCompletions,
}

/// One prompt sequence as the router sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Prompt bytes (a text prompt, or a rendered chat conversation).
    Text(Vec<u8>),
    /// Token ids supplied by the client.
    Tokens(Vec<u32>),
}

impl Prompt {
    /// Input length in tokens: token count, or `ceil(bytes / bytes_per_token)` for text.
    pub fn tokens(&self, bytes_per_token: u32) -> u64 {
        match self {
            Prompt::Text(b) => (b.len() as u64).div_ceil(u64::from(bytes_per_token.max(1))),
            Prompt::Tokens(t) => t.len() as u64,
        }
    }
}

/// Generation horizon of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Horizon {
    /// Short output.
    Short,
    /// Medium output.
    Medium,
    /// Long or unbounded output.
    Long,
}

impl Horizon {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Horizon::Short => "short",
            Horizon::Medium => "medium",
            Horizon::Long => "long",
        }
    }
}

/// Optional judgment from an external classifier (e.g. a fast non-generative judge in front of
/// the router). Each field given overrides the one the core would derive.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct JudgmentHint {
    /// Generation horizon.
    pub horizon: Option<Horizon>,
    /// Memory-pressure risk 0–3.
    pub risk: Option<u8>,
    /// Probability (0–1) that bypassing the prefill pool is right.
    pub bypass_probability: Option<f64>,
}

/// A parsed inference request: everything routing needs, nothing else.
///
/// ---
///
/// Request parsing: OpenAI `/v1/completions` and `/v1/chat/completions` bodies plus headers →
/// [`RouteRequest`].
///
/// Chat requests are rendered (without a tokenizer) into a canonical byte string: optional `tools`
/// (canonical JSON), then every message as `\x01 role [\x1f name] \x02 content [\x1f tool data] \x03`.
/// Content parts are joined with `\n`, as vLLM joins them for a chat template. A conversation
/// that grows by appending messages therefore grows its rendering by appending bytes, which is
/// what prefix matching needs.
///
/// # Media parts
///
/// Text content parts (`text`, `input_text`, `output_text`, `refusal`, `thinking`, the types
/// vLLM reads as text) are keyed like string content. Any other part (`image_url`,
/// `input_audio`, `video_url`, `file`, `prompt_embeds`, …) is *media*: vLLM turns it into
/// placeholder tokens and hashes the media's identity (the decoded bytes, or the part's `uuid`,
/// with the request's `mm_processor_kwargs` and `media_io_kwargs`) into the blocks that cover
/// them, and every later block chains on those. vLLM puts a message's media placeholders in front
/// of its text by default (at the part's place with `--interleave-mm-strings`), so the router
/// treats a message holding media as a whole, from the start of its content:
///
/// - **approximate keys**: a media message whose every media part carries a stable identity (a
///   `uuid`, or inline data: a `data:` URL, `input_audio`) is keyed, its identity (a hash of all
///   its parts and the request's media kwargs) mixed into the block where its content starts
///   ([`RouteRequest::media_keys`]), so two messages share keys from there on only when they
///   are identical. The first media message with a part that has no stable identity (an
///   `http(s)` URL may serve other bytes each time) ends the keys at the start of its content
///   ([`RouteRequest::key_limit`]).
/// - **tokenizer keys** end at the start of the content of the first media message of any kind
///   ([`ChatInput::media`]): how many placeholder tokens a medium becomes is the model
///   processor's business.
///
/// Whatever is past a limit still counts in the prefix-hit denominator, each media part there at
/// [`MEDIA_PART_TOKENS`] tokens, so two chats that differ only in an image share exactly the prefix
/// before it and are never a full hit. A completions body with `prompt_embeds` (vLLM) gets a limit
/// too: the embeddings are extra sequences the router cannot key.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteRequest {
    /// The API.
    pub api: Api,
    /// Requested model name.
    pub model: String,
    /// LoRA adapter the model name maps to (config `request.lora_adapters`).
    pub lora_adapter: Option<String>,
    /// Tenant isolation salt (`cache_salt` in the body). An empty `cache_salt` parses as `None`:
    /// vLLM hashes it as no salt.
    pub cache_salt: Option<String>,
    /// `max_completion_tokens` or `max_tokens`.
    pub max_tokens: Option<u32>,
    /// Streaming requested.
    pub stream: bool,
    /// Caller-supplied request id (header `request.request_id_header`).
    pub request_id: Option<String>,
    /// Session id (header `request.session_header`).
    pub session_id: Option<String>,
    /// Fairness id (header `request.fairness_header`, else `request.fairness_alias_header`).
    pub fairness_id: Option<String>,
    /// Priority, negative = sheddable: the priority of the inference objective (header
    /// `request.objective_header`, mapped by `request.objectives`) or the direct priority
    /// (header `request.priority_header`), the higher when both are given; default 0.
    pub priority: i32,
    /// Inference objective named by the request (header `request.objective_header`), listed in
    /// `request.objectives` or not.
    pub objective: Option<String>,
    /// Time-to-first-token objective in milliseconds (header `request.slo_ttft_header`, else
    /// `request.slo_ttft_alias_header`): flow control's SLO-deadline ordering.
    pub slo_ttft_ms: Option<u64>,
    /// The request's own queue TTL in milliseconds (header `request.queue_ttl_header`, a Go
    /// duration): replaces the default TTL of flow control for this request.
    pub queue_ttl_ms: Option<u64>,
    /// Judgment hint headers.
    pub hint: JudgmentHint,
    /// Prompt sequences (several for a batched completions request). Chat requests have one,
    /// the tokenizer-free rendering of the conversation.
    pub prompts: Vec<Prompt>,
    /// Chat requests: the template inputs (for exact tokenization).
    pub chat: Option<ChatInput>,
    /// Where the approximate block keys must end (a content part or sequence the router cannot
    /// key), if anywhere.
    pub key_limit: Option<KeyLimit>,
    /// Media messages the approximate keys cover, in rendering order (see the module docs).
    pub media_keys: Vec<MediaKey>,
    /// Media parts (and `prompt_embeds` sequences) in the request, each counted as
    /// [`MEDIA_PART_TOKENS`] input tokens.
    pub media_parts: u32,
}

impl RouteRequest {
    /// A completions request for one text prompt with default everything else (handy in tests).
    pub fn text(model: &str, prompt: &str) -> RouteRequest {
        RouteRequest {
            api: Api::Completions,
            model: model.to_owned(),
            lora_adapter: None,
            cache_salt: None,
            max_tokens: None,
            stream: false,
            request_id: None,
            session_id: None,
            fairness_id: None,
            priority: 0,
            objective: None,
            slo_ttft_ms: None,
            queue_ttl_ms: None,
            hint: JudgmentHint::default(),
            prompts: vec![Prompt::Text(prompt.as_bytes().to_vec())],
            chat: None,
            key_limit: None,
            media_keys: Vec::new(),
            media_parts: 0,
        }
    }

    /// Total input tokens over all prompt sequences, plus [`MEDIA_PART_TOKENS`] for each part the
    /// router cannot key.
    pub fn input_tokens(&self, bytes_per_token: u32) -> u64 {
        self.prompts.iter().map(|p| p.tokens(bytes_per_token)).sum::<u64>()
            + u64::from(self.media_parts) * u64::from(MEDIA_PART_TOKENS)
    }

    /// Input tokens past [`RouteRequest::key_limit`] (estimated; 0 without a limit): the rest of
    /// the sequence it ends in, every later sequence and the media parts.
    pub fn unkeyed_tokens(&self, bytes_per_token: u32) -> u64 {
        let Some(l) = self.key_limit else { return 0 };
        let rest: u64 = self
            .prompts
            .iter()
            .enumerate()
            .skip(l.prompt)
            .map(|(i, p)| {
                let skip = if i == l.prompt { l.keyed_len } else { 0 };
                match p {
                    Prompt::Text(b) => {
                        (b.len().saturating_sub(skip) as u64).div_ceil(u64::from(bytes_per_token.max(1)))
                    }
                    Prompt::Tokens(t) => t.len().saturating_sub(skip) as u64,
                }
            })
            .sum();
        rest + l.media_tokens()
    }

    /// Input tokens past the start of the first media message (estimated), where keys from the
    /// chat template end; for other requests [`RouteRequest::unkeyed_tokens`].
    pub fn unkeyed_tokens_past_media(&self, bytes_per_token: u32) -> u64 {
        let Some(m) = self.chat.as_ref().and_then(|c| c.media) else { return self.unkeyed_tokens(bytes_per_token) };
        let rest = match self.prompts.first() {
            Some(Prompt::Text(b)) => {
                (b.len().saturating_sub(m.rendered_at) as u64).div_ceil(u64::from(bytes_per_token.max(1)))
            }
            Some(Prompt::Tokens(t)) => t.len().saturating_sub(m.rendered_at) as u64,
            None => 0,
        };
        rest + u64::from(m.parts) * u64::from(MEDIA_PART_TOKENS)
    }

    /// The output-token budget: `max_tokens` if given, else the API default (16 for completions,
    /// unbounded = `None` for chat).
    pub fn effective_max_tokens(&self) -> Option<u32> {
        match (self.max_tokens, self.api) {
            (Some(m), _) => Some(m),
            (None, Api::Completions) => Some(16),
            (None, Api::ChatCompletions) => None,
        }
    }

    /// Parse an HTTP request body and its headers. Header names are matched case-insensitively;
    /// when a header repeats, the first occurrence wins. A `:path` pseudo-header, when present,
    /// selects the API; otherwise `messages` means chat and `prompt` means completions.
    pub fn parse<K, V>(
        body: &[u8],
        headers: impl IntoIterator<Item = (K, V)>,
        cfg: &RequestConfig,
    ) -> Result<RouteRequest, RequestError>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        Self::parse_with(body, headers, cfg, parse_body)
    }

    /// [`RouteRequest::parse`] without the token-id fast path: serde reads the whole body. Its
    /// result is the reference the fast path must equal (the differential tests and the
    /// `token_ids` fuzz target); no caller needs it otherwise.
    #[doc(hidden)]
    pub fn parse_serde_only<K, V>(
        body: &[u8],
        headers: impl IntoIterator<Item = (K, V)>,
        cfg: &RequestConfig,
    ) -> Result<RouteRequest, RequestError>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        Self::parse_with(body, headers, cfg, parse_body_serde)
    }

    /// [`RouteRequest::parse`] through the direct reader of the common body shape alone (the
    /// path wasm32 takes first: a string prompt, or messages with string content; see
    /// `request/scan.rs`): `None` when the reader declines the body, else what `parse` gives.
    /// For the differential tests and the `body_reader` fuzz target, which check that whatever
    /// the reader takes, [`RouteRequest::parse_serde_only`] reads the same.
    #[doc(hidden)]
    pub fn parse_direct_reader<K, V>(
        body: &[u8],
        headers: impl IntoIterator<Item = (K, V)>,
        cfg: &RequestConfig,
    ) -> Option<Result<RouteRequest, RequestError>>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        fn read(body: &[u8]) -> Result<RawBody, RequestError> {
            scan::parse(body).ok_or_else(|| RequestError::field("body", "declined by the direct reader"))
        }
        scan::parse(body)?;
        Some(Self::parse_with(body, headers, cfg, read))
    }

    fn parse_with<K, V>(
        body: &[u8],
        headers: impl IntoIterator<Item = (K, V)>,
        cfg: &RequestConfig,
        parse_body: fn(&[u8]) -> Result<RawBody, RequestError>,
    ) -> Result<RouteRequest, RequestError>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        if body.len() > cfg.max_body_bytes {
            return Err(RequestError::BodyTooLarge { size: body.len(), limit: cfg.max_body_bytes });
        }
        let h = HeaderValues::collect(headers, cfg)?;
        if h.binary_tokens {
            return Self::from_binary_token_ids(body, h, cfg);
        }
        if body.iter().all(u8::is_ascii_whitespace) {
            return Err(RequestError::EmptyBody);
        }
        let raw = parse_body(body)?;
        let api = match (h.path_api, &raw.messages, &raw.prompt) {
            (Some(api), _, _) => api,
            (None, Some(_), None) => Api::ChatCompletions,
            (None, None, Some(_)) => Api::Completions,
            (None, Some(_), Some(_)) => {
                return Err(RequestError::field("messages", "a body may carry `messages` or `prompt`, not both"))
            }
            (None, None, None) => {
                return Err(RequestError::field(
                    "prompt",
                    "missing: a completions body needs `prompt`, a chat body `messages`",
                ))
            }
        };
        let model = match raw.model {
            Some(m) if !m.is_empty() => m,
            Some(_) => return Err(RequestError::field("model", "must not be empty")),
            None => return Err(RequestError::field("model", "missing")),
        };
        let (mut key_limit, mut media_keys, mut media_parts) = (None, Vec::new(), 0);
        let (prompts, chat) = match api {
            Api::Completions => match raw.prompt {
                Some(p) => {
                    // vLLM runs `prompt_embeds` as further sequences of embeddings, no token ids.
                    let embeds = raw.prompt_embeds.as_ref().map_or(0, PromptEmbeds::count);
                    if embeds > 0 {
                        key_limit =
                            Some(KeyLimit { prompt: p.0.len(), keyed_len: 0, message: None, media_parts: embeds });
                        media_parts = embeds;
                    }
                    (p.0, None)
                }
                None => return Err(RequestError::field("prompt", "missing (required for /v1/completions)")),
            },
            Api::ChatCompletions => match raw.messages {
                Some(msgs) if msgs.msgs.is_empty() => return Err(RequestError::field("messages", "must not be empty")),
                Some(msgs) => {
                    let kwargs = [raw.mm_processor_kwargs.as_deref(), raw.media_io_kwargs.as_deref()];
                    let r = render_chat(&msgs, raw.tools.as_deref(), kwargs);
                    (key_limit, media_keys, media_parts) = (r.limit, r.media_keys, r.media_parts);
                    let prompt = Prompt::Text(r.bytes);
                    let chat = ChatInput {
                        messages: msgs.msgs,
                        tools: raw.tools.as_deref().map(|t| RawJson(t.get().into())),
                        chat_template_kwargs: raw
                            .chat_template_kwargs
                            .unwrap_or_default()
                            .into_iter()
                            .map(|(k, v)| (k, RawJson(v.get().into())))
                            .collect(),
                        add_generation_prompt: raw.add_generation_prompt.unwrap_or(true),
                        continue_final_message: raw.continue_final_message.unwrap_or(false),
                        media: r.first_media,
                    };
                    (vec![prompt], Some(chat))
                }
                None => return Err(RequestError::field("messages", "missing (required for /v1/chat/completions)")),
            },
        };
        let max_tokens = raw.max_completion_tokens.or(raw.max_tokens).map(|m| u32::try_from(m).unwrap_or(u32::MAX));
        Ok(RouteRequest {
            api,
            lora_adapter: cfg.lora_adapters.get(&model).cloned(),
            model,
            // vLLM hashes an empty salt as no salt; every surface sees `None` for it.
            cache_salt: raw.cache_salt.filter(|s| !s.is_empty()),
            max_tokens,
            stream: raw.stream.unwrap_or(false),
            ..Self::with_headers(h, prompts, chat, key_limit, media_keys, media_parts)
        })
    }

    /// A binary token-id body (`request.token_ids_content_type`): little-endian `u32` token ids,
    /// the model in `request.model_header`, a completions request.
    fn from_binary_token_ids(body: &[u8], h: HeaderValues, cfg: &RequestConfig) -> Result<RouteRequest, RequestError> {
        if body.is_empty() {
            return Err(RequestError::EmptyBody);
        }
        if body.len() % 4 != 0 {
            return Err(RequestError::field(
                "body",
                format!("a token-id body is little-endian u32 token ids: {} bytes is not a multiple of 4", body.len()),
            ));
        }
        if h.path_api == Some(Api::ChatCompletions) {
            return Err(RequestError::field("body", "a token-id body is a completions request, not chat"));
        }
        let model = match &h.model {
            Some(m) => m.clone(),
            None => {
                return Err(RequestError::Header {
                    header: cfg.model_header.clone(),
                    value: String::new(),
                    reason: "missing: a token-id body names its model in this header".into(),
                })
            }
        };
        let ids = body.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Ok(RouteRequest {
            api: Api::Completions,
            lora_adapter: cfg.lora_adapters.get(&model).cloned(),
            model,
            cache_salt: None,
            max_tokens: h.max_tokens,
            stream: false,
            ..Self::with_headers(h, vec![Prompt::Tokens(ids)], None, None, Vec::new(), 0)
        })
    }

    /// The fields every body kind takes from the headers, with the prompts (the body's fields
    /// are the caller's to set).
    fn with_headers(
        h: HeaderValues,
        prompts: Vec<Prompt>,
        chat: Option<ChatInput>,
        key_limit: Option<KeyLimit>,
        media_keys: Vec<MediaKey>,
        media_parts: u32,
    ) -> RouteRequest {
        RouteRequest {
            api: Api::Completions,
            lora_adapter: None,
            model: String::new(),
            cache_salt: None,
            max_tokens: None,
            stream: false,
            request_id: h.request_id,
            session_id: h.session_id,
            fairness_id: h.fairness_id,
            priority: h.priority,
            objective: h.objective,
            slo_ttft_ms: h.slo_ttft_ms,
            queue_ttl_ms: h.queue_ttl_ms,
            hint: h.hint,
            prompts,
            chat,
            key_limit,
            media_keys,
            media_parts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `RouteRequest::parse` with the default config (the tests of every file use it).
    pub(super) fn parse(body: &str, headers: &[(&str, &str)]) -> Result<RouteRequest, RequestError> {
        RouteRequest::parse(body.as_bytes(), headers.iter().copied(), &RequestConfig::default())
    }

    #[test]
    fn completions_string_prompt() {
        let r = parse(r#"{"model":"m","prompt":"hello world","max_tokens":5,"stream":true}"#, &[]).unwrap();
        assert_eq!(r.api, Api::Completions);
        assert_eq!(r.model, "m");
        assert_eq!(r.prompts, vec![Prompt::Text(b"hello world".to_vec())]);
        assert_eq!(r.max_tokens, Some(5));
        assert!(r.stream);
        assert_eq!(r.input_tokens(4), 3);
    }

    #[test]
    fn token_ids_with_media_features_are_not_a_completions_body() {
        // vLLM's `/inference/v1/generate` body (token ids plus multimodal features) has no
        // `prompt`: it is an error, never a token-id prompt keyed past its media.
        let e =
            parse(r#"{"model":"m","token_ids":[1,2,3],"features":{"mm_hashes":{"image":["h"]}}}"#, &[]).unwrap_err();
        assert!(matches!(&e, RequestError::Field { field, .. } if field == "prompt"), "{e:?}");
    }

    #[test]
    fn path_selects_the_api() {
        let e = parse(r#"{"model":"m","prompt":"x"}"#, &[(":path", "/v1/chat/completions?x=1")]).unwrap_err();
        assert!(matches!(&e, RequestError::Field { field, .. } if field == "messages"));
        let r = parse(r#"{"model":"m","prompt":"x"}"#, &[(":path", "/v1/completions")]).unwrap();
        assert_eq!(r.api, Api::Completions);
    }
}

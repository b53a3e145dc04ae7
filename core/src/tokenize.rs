//! Exact token ids for routing (feature `tokenizer`, native only): Hugging Face `tokenizers` for
//! the model's `tokenizer.json`, minijinja for its chat template, and a prefix tokenization cache
//! so that turn N of a conversation only tokenizes what is new.
//!
//! The ids are the ones the engine computes. vLLM renders a chat request with transformers'
//! `apply_chat_template` (Jinja2 with `trim_blocks`, `lstrip_blocks`, loop controls and the
//! `raise_exception`, `tojson` and `strftime_now` helpers) and tokenizes the text with
//! `add_special_tokens=False`; a completions prompt is tokenized with `add_special_tokens=True`.
//! [`Tokenizer::encode_chat`] and [`Tokenizer::encode_prompt`] do the same.
//!
//! # Multimodal requests
//!
//! Images, audio, video and embeddings become placeholder tokens that the model's processor
//! writes and whose blocks vLLM hashes with the media's own hash, none of which a router has. The
//! router therefore keys only what comes before them: [`Tokenizer::keyable_token_ids`] renders
//! the conversation with the content of the first message holding such a part replaced by a
//! sentinel, cuts the text where the sentinel starts, tokenizes that prefix and drops its last
//! token (the text after the cut may merge with it). See `request` for why the cut is at the
//! message's content rather than at the part.
//!
//! # The prefix cache
//!
//! Hugging Face tokenizers first cut the text at *added tokens* (`<|im_start|>`, `<|im_end|>`, …)
//! and tokenize each piece between them on its own. So the text can be cut after an added token
//! and each *segment* tokenized alone, provided the cut cannot change which added tokens match or
//! how they strip whitespace. A cut is made only after an added token that
//!
//! - is matched on the raw text (`normalized: false`), so the cut is also a piece boundary;
//! - has no `rstrip` (which would eat whitespace after the cut) and no `single_word` (which looks
//!   at the character after it);
//! - ends with an ASCII character that is neither a word character nor whitespace (so the
//!   `single_word` and `lstrip` checks of a token right after the cut see the same thing as at
//!   the start of a text, and an earlier token's `rstrip` stops before the cut);
//! - is not skipped (`encode_special_tokens` off for special tokens).
//!
//! Matches are found with the same automaton `tokenizers` uses (daachorse, leftmost-longest, over
//! every non-normalized added token), so the cuts are exactly among the places where `tokenizers`
//! itself cuts. The cache is disabled (everything is tokenized in full) when a component depends on
//! a piece's position in the whole text: a `Metaspace` pre-tokenizer with `prepend_scheme: first`,
//! or BPE dropout. With these rules the ids of a text are the concatenation of the ids of its
//! segments, each of which depends only on the segment's own text; the cache maps segment text →
//! ids (hash lookup, then a byte comparison, so a hash collision can only cost a miss). The tests
//! in `core/tests/tokenize.rs` check the equality on many conversations and random texts.
//!
//! ```
//! use kvroute::tokenize::{ChatMessage, PrefixCacheConfig, Tokenizer};
//!
//! // A Hugging Face model directory: tokenizer.json, tokenizer_config.json, chat_template.jinja.
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/tokenizer");
//! let tok = Tokenizer::from_dir(dir)?.with_prefix_cache(PrefixCacheConfig::default());
//! let mut chat = vec![ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi!")];
//! let turn1 = tok.encode_chat(&chat, true)?;
//! chat.push(ChatMessage::new("assistant", "Hello."));
//! chat.push(ChatMessage::new("user", "What is a KV cache?"));
//! let turn2 = tok.encode_chat(&chat, true)?; // only the new messages are tokenized
//! // Same prefix up to turn 1's generation header `<|im_start|>assistant\n` (3 tokens).
//! assert_eq!(turn2[..turn1.len() - 3], turn1[..turn1.len() - 3]);
//! let stats = tok.prefix_cache_stats().unwrap_or_default();
//! assert!(stats.hit_tokens > 0);
//! # Ok::<(), kvroute::tokenize::TokenizeError>(())
//! ```

use std::borrow::Cow;
use std::fmt::Write as _;
use std::hash::{BuildHasherDefault, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use daachorse::{DoubleArrayAhoCorasick, DoubleArrayAhoCorasickBuilder, MatchKind};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind, State};

/// A tokenizer file, chat template or tokenizer config could not be used, or tokenization or
/// rendering failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizeError {
    /// A file could not be read.
    #[error("cannot read `{path}`: {message}")]
    Io {
        /// The path.
        path: String,
        /// What the OS said.
        message: String,
    },
    /// `tokenizer.json` could not be loaded.
    #[error("invalid tokenizer.json: {message}")]
    Tokenizer {
        /// What `tokenizers` said.
        message: String,
    },
    /// `tokenizer_config.json` (or another JSON input) is malformed.
    #[error("invalid {what}: {message}")]
    Json {
        /// Which input.
        what: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The chat template does not compile.
    #[error("invalid chat template: {message}")]
    Template {
        /// What minijinja said (with line information).
        message: String,
    },
    /// Rendering the chat template failed (undefined value, wrong type, …).
    #[error("chat template rendering failed: {message}")]
    Render {
        /// What minijinja said.
        message: String,
    },
    /// The template itself rejected the conversation with `raise_exception(message)`.
    #[error("chat template rejected the conversation: {message}")]
    Rejected {
        /// The template's message.
        message: String,
    },
    /// A chat was given to a tokenizer that has no chat template.
    #[error("no chat template: the tokenizer config has none and none was given")]
    NoChatTemplate,
    /// `tokenizers` failed to encode the text.
    #[error("tokenization failed: {message}")]
    Encode {
        /// What `tokenizers` said.
        message: String,
    },
}

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

// ---------------------------------------------------------------------------------------------
// Plain-data inputs
// ---------------------------------------------------------------------------------------------

pub use crate::request::{ChatMessage, RawJson};

fn json_value(raw: &RawJson) -> Result<Value, TokenizeError> {
    serde_json::from_str::<Value>(raw.as_str())
        .map_err(|e| TokenizeError::Json { what: "JSON value", message: e.to_string() })
}

/// A message as the template sees it: absent fields are not passed at all (transformers drops
/// `None` values before rendering).
fn message_value(m: &ChatMessage, parse_tool_call_arguments: bool) -> Result<Value, TokenizeError> {
    let mut fields: Vec<(&str, Value)> = Vec::with_capacity(6);
    fields.push(("role", Value::from(m.role.as_str())));
    if let Some(c) = &m.content {
        fields.push(("content", Value::from(c.as_str())));
    }
    if let Some(n) = &m.name {
        fields.push(("name", Value::from(n.as_str())));
    }
    if let Some(t) = &m.tool_calls {
        let calls = json_value(t)?;
        if parse_tool_call_arguments && m.role == "assistant" {
            if let Some(calls) = vllm_tool_calls(&calls)? {
                fields.push(("tool_calls", calls));
            }
        } else {
            fields.push(("tool_calls", calls));
        }
    }
    if let Some(t) = &m.tool_call_id {
        fields.push(("tool_call_id", Value::from(t.as_str())));
    }
    if let Some(r) = &m.reasoning_content {
        fields.push(("reasoning_content", Value::from(r.as_str())));
    }
    Ok(Value::from_pairs(fields))
}

/// vLLM's `_postprocess_messages` for an assistant message's `tool_calls`: an empty list is
/// dropped (`None`); every call must be an object of type `function` with a `function` object,
/// whose `arguments` JSON string is parsed into an object (`{}` when empty, invalid or not an
/// object). Anything but a list is kept as it is.
fn vllm_tool_calls(calls: &Value) -> Result<Option<Value>, TokenizeError> {
    let bad = |message: &str| TokenizeError::Json { what: "tool_calls", message: message.to_owned() };
    if calls.kind() != ValueKind::Seq {
        return Ok(Some(calls.clone()));
    }
    let items: Vec<Value> = calls.try_iter().map_err(|e| bad(&e.to_string()))?.collect();
    if items.is_empty() {
        return Ok(None);
    }
    let empty = || Value::from_pairs(std::iter::empty::<(&str, Value)>());
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        if item.kind() != ValueKind::Map {
            return Err(bad("assistant tool_calls entries must be objects"));
        }
        let function = item.get_attr("function").unwrap_or_default();
        let kind = item.get_attr("type").unwrap_or_default();
        if !(kind.is_undefined() || kind.as_str() == Some("function")) || function.kind() != ValueKind::Map {
            return Err(bad("chat completions only support assistant tool_calls of type 'function'"));
        }
        let args = function.get_attr("arguments").unwrap_or_default();
        let parsed = match (args.kind(), args.as_str()) {
            (ValueKind::Map, _) => args,
            (ValueKind::String, Some(s)) if !s.is_empty() => match serde_json::from_str::<Value>(s) {
                Ok(v) if v.kind() == ValueKind::Map => v,
                _ => empty(),
            },
            _ => empty(),
        };
        let mut f: Vec<(Value, Value)> = Vec::new();
        let mut has_args = false;
        for k in function.try_iter().map_err(|e| bad(&e.to_string()))? {
            if k.as_str() == Some("arguments") {
                has_args = true;
                f.push((k, parsed.clone()));
            } else {
                let v = function.get_item(&k).unwrap_or_default();
                f.push((k, v));
            }
        }
        if !has_args {
            f.push((Value::from("arguments"), parsed));
        }
        let function = Value::from_pairs(f);
        let mut it: Vec<(Value, Value)> = Vec::new();
        for k in item.try_iter().map_err(|e| bad(&e.to_string()))? {
            let v =
                if k.as_str() == Some("function") { function.clone() } else { item.get_item(&k).unwrap_or_default() };
            it.push((k, v));
        }
        out.push(Value::from_pairs(it));
    }
    Ok(Some(Value::from(out)))
}

/// Options of one chat rendering besides the messages.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChatOptions {
    /// Append the assistant header (`add_generation_prompt`); vLLM's default for chat requests is
    /// `true`.
    pub add_generation_prompt: bool,
    /// The request's `tools` (a JSON array), passed to the template as `tools` (else `none`).
    pub tools: Option<RawJson>,
    /// Extra template variables (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`); they
    /// override the special-token variables.
    pub kwargs: Vec<(String, RawJson)>,
    /// Unix time in seconds for `strftime_now` (UTC). `None` reads the system clock.
    pub now_unix_s: Option<i64>,
    /// Rewrite assistant `tool_calls` as vLLM does before rendering: `function.arguments` JSON
    /// strings become objects, an empty list is dropped (default `true`; `false` renders the
    /// messages as transformers' `apply_chat_template` alone would).
    pub parse_tool_call_arguments: bool,
    /// Render the final message open-ended so the model continues it (`continue_final_message`;
    /// excludes `add_generation_prompt`).
    pub continue_final_message: bool,
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions {
            add_generation_prompt: false,
            tools: None,
            kwargs: Vec::new(),
            now_unix_s: None,
            parse_tool_call_arguments: true,
            continue_final_message: false,
        }
    }
}

impl ChatOptions {
    /// Options with `add_generation_prompt` set and nothing else.
    pub fn new(add_generation_prompt: bool) -> ChatOptions {
        ChatOptions { add_generation_prompt, ..ChatOptions::default() }
    }
}

// ---------------------------------------------------------------------------------------------
// Chat template
// ---------------------------------------------------------------------------------------------

const TEMPLATE_NAME: &str = "chat_template";
const NOW_VAR: &str = "__kvroute_now_unix_s";
const RAISE_MARKER: &str = "\u{1}kvroute-raise\u{1}";
/// Special-token variables transformers passes to a chat template (`special_tokens_map`).
const SPECIAL_TOKEN_KEYS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// A compiled chat template with the variables transformers gives it (`bos_token`, `eos_token`, …)
/// and transformers' helpers: `raise_exception`, `tojson` (Python `json.dumps`, no HTML
/// escaping), `strftime_now`, loop controls, Python string/dict methods (`.strip()`,
/// `.startswith()`, `.items()`, …), `trim_blocks` and `lstrip_blocks`. `{% generation %}` blocks
/// (transformers' assistant-mask marker) render their body.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    vars: Vec<(String, Value)>,
}

impl ChatTemplate {
    /// Compiles a Jinja chat template.
    pub fn new(source: &str) -> Result<ChatTemplate, TokenizeError> {
        let mut env = Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(syntax.build().map_err(|e| TokenizeError::Template { message: e.to_string() })?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let source = rewrite_generation_tags(source).into_owned();
        env.add_template_owned(TEMPLATE_NAME, source).map_err(|e| TokenizeError::Template { message: describe(&e) })?;
        Ok(ChatTemplate { env, vars: Vec::new() })
    }

    /// Compiles the template of a `tokenizer_config.json` (`chat_template`: a string, or a list of
    /// `{name, template}` from which `default` is taken) or `template` when given (e.g. the
    /// model's `chat_template.jinja`), and takes its special tokens as template variables.
    pub fn from_tokenizer_config(config_json: &str, template: Option<&str>) -> Result<ChatTemplate, TokenizeError> {
        let bad = |message: String| TokenizeError::Json { what: "tokenizer_config.json", message };
        let config: serde_json::Value = serde_json::from_str(config_json).map_err(|e| bad(e.to_string()))?;
        let serde_json::Value::Object(config) = config else {
            return Err(bad("must be a JSON object".to_owned()));
        };
        let source: Cow<'_, str> = match (template, config.get("chat_template")) {
            (Some(t), _) => Cow::Borrowed(t),
            (None, Some(serde_json::Value::String(s))) => Cow::Owned(s.clone()),
            (None, Some(serde_json::Value::Array(list))) => {
                let named = |want: &str| {
                    list.iter().find_map(|t| match (t.get("name"), t.get("template")) {
                        (Some(serde_json::Value::String(n)), Some(serde_json::Value::String(s))) if n == want => {
                            Some(s.clone())
                        }
                        _ => None,
                    })
                };
                match named("default") {
                    Some(s) => Cow::Owned(s),
                    None => return Err(bad("`chat_template` list has no template named \"default\"".to_owned())),
                }
            }
            (None, Some(serde_json::Value::Null) | None) => return Err(TokenizeError::NoChatTemplate),
            (None, Some(_)) => return Err(bad("`chat_template` must be a string or a list".to_owned())),
        };
        let mut out = ChatTemplate::new(&source)?;
        for key in SPECIAL_TOKEN_KEYS {
            match config.get(key) {
                None | Some(serde_json::Value::Null) => {}
                Some(serde_json::Value::String(s)) => out = out.with_variable(key, Value::from(s.as_str())),
                Some(serde_json::Value::Object(o)) => match o.get("content") {
                    Some(serde_json::Value::String(s)) => out = out.with_variable(key, Value::from(s.as_str())),
                    _ => return Err(bad(format!("`{key}` object needs a string `content`"))),
                },
                Some(_) => return Err(bad(format!("`{key}` must be a string, an object or null"))),
            }
        }
        if let Some(serde_json::Value::Array(extra)) = config.get("additional_special_tokens") {
            let names: Vec<Value> = extra
                .iter()
                .filter_map(|t| match t {
                    serde_json::Value::String(s) => Some(Value::from(s.as_str())),
                    serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(Value::from),
                    _ => None,
                })
                .collect();
            out = out.with_variable("additional_special_tokens", Value::from(names));
        }
        Ok(out)
    }

    /// Sets a special-token variable such as `bos_token` (what transformers takes from the
    /// tokenizer config).
    pub fn with_special_token(self, name: &str, content: &str) -> ChatTemplate {
        self.with_variable(name, Value::from(content))
    }

    fn with_variable(mut self, name: &str, value: Value) -> ChatTemplate {
        self.vars.retain(|(n, _)| n != name);
        self.vars.push((name.to_owned(), value));
        self
    }

    /// Renders a conversation to the prompt text the engine tokenizes.
    pub fn render(&self, messages: &[ChatMessage], options: &ChatOptions) -> Result<String, TokenizeError> {
        let render_err = |message: &str| TokenizeError::Render { message: message.to_owned() };
        let mut msgs = messages
            .iter()
            .map(|m| message_value(m, options.parse_tool_call_arguments))
            .collect::<Result<Vec<_>, _>>()?;
        // continue_final_message, as transformers does it: tag the final content, render, cut at the tag.
        let final_content = match (options.continue_final_message, messages.last()) {
            (false, _) => None,
            (true, _) if options.add_generation_prompt => {
                return Err(render_err("continue_final_message and add_generation_prompt are not compatible"))
            }
            (true, None) => return Err(render_err("continue_final_message is set but the conversation is empty")),
            (true, Some(ChatMessage { content: None, .. })) => {
                return Err(render_err("continue_final_message is set but the final message has no content"))
            }
            (true, Some(last @ ChatMessage { content: Some(c), .. })) => {
                let tagged = ChatMessage { content: Some(format!("{c}{CONTINUE_TAG}")), ..last.clone() };
                if let Some(v) = msgs.last_mut() {
                    *v = message_value(&tagged, options.parse_tool_call_arguments)?;
                }
                Some(c.as_str())
            }
        };
        let tools = match &options.tools {
            Some(t) => json_value(t)?,
            None => Value::from(()),
        };
        let mut ctx: Vec<(&str, Value)> = Vec::with_capacity(6 + self.vars.len() + options.kwargs.len());
        ctx.push(("messages", Value::from(msgs)));
        ctx.push(("tools", tools));
        ctx.push(("documents", Value::from(())));
        ctx.push(("add_generation_prompt", Value::from(options.add_generation_prompt)));
        for (k, v) in &self.vars {
            ctx.push((k.as_str(), v.clone()));
        }
        for (k, v) in &options.kwargs {
            ctx.push((k.as_str(), json_value(v)?));
        }
        if let Some(now) = options.now_unix_s {
            ctx.push((NOW_VAR, Value::from(now)));
        }
        let tmpl =
            self.env.get_template(TEMPLATE_NAME).map_err(|e| TokenizeError::Template { message: describe(&e) })?;
        let mut out = tmpl.render(Value::from_pairs(ctx)).map_err(|e| match raised(&e) {
            Some(message) => TokenizeError::Rejected { message },
            None => TokenizeError::Render { message: describe(&e) },
        })?;
        if let Some(final_content) = final_content {
            let tag = CONTINUE_TAG.trim_end();
            let at = match out.rfind(tag) {
                Some(at) if out.contains(final_content.trim_matches(py_space)) => at,
                _ => {
                    return Err(render_err(
                        "continue_final_message is set but the final message does not appear in the rendered chat",
                    ))
                }
            };
            let spaced = out[at..].starts_with(CONTINUE_TAG);
            out.truncate(at);
            if !spaced {
                // The template trimmed the message's trailing spacing.
                out.truncate(out.trim_end_matches(py_space).len());
            }
        }
        Ok(out)
    }
}

/// The options a parsed chat request renders with (vLLM's defaults for what it does not say).
fn chat_options(chat: &crate::request::ChatInput) -> ChatOptions {
    ChatOptions {
        add_generation_prompt: chat.add_generation_prompt && !chat.continue_final_message,
        tools: chat.tools.clone(),
        kwargs: chat.chat_template_kwargs.clone(),
        continue_final_message: chat.continue_final_message,
        ..ChatOptions::default()
    }
}

/// Stands in for the content of the message where a chat request's keys end
/// ([`Tokenizer::keyable_token_ids`]): control characters no template strips, and no text a
/// client would send.
const KEY_LIMIT_SENTINEL: &str = "\u{1}kvroute-key-limit\u{1}";

/// What transformers appends to the final message for `continue_final_message`.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Python's `str.isspace` for one character (Unicode White_Space plus the \x1c–\x1f separators).
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        let _ = write!(s, ": {inner}");
        src = inner.source();
    }
    s
}

fn raised(e: &minijinja::Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(m) = err.downcast_ref::<minijinja::Error>() {
            if let Some(msg) = m.detail().and_then(|d| d.strip_prefix(RAISE_MARKER)) {
                return Some(msg.to_owned());
            }
        }
        cur = err.source();
    }
    None
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' assistant-mask extension) become an
/// always-true `if`, keeping their whitespace-control markers.
fn rewrite_generation_tags(src: &str) -> Cow<'_, str> {
    if !src.contains("generation") {
        return Cow::Borrowed(src);
    }
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(open) = rest.find("{%") {
        let (before, tag) = rest.split_at(open);
        out.push_str(before);
        let Some(close) = tag.find("%}") else {
            out.push_str(tag);
            return Cow::Owned(out);
        };
        let inner = &tag[2..close];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.trim_end().strip_suffix(['-', '+']) {
            Some(b) => (b, &body.trim_end()[b.len()..]),
            None => (body, ""),
        };
        match body.trim() {
            "generation" => {
                let _ = write!(out, "{{%{lead} if true {trail}%}}");
            }
            "endgeneration" => {
                let _ = write!(out, "{{%{lead} endif {trail}%}}");
            }
            _ => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    Cow::Owned(out)
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("{RAISE_MARKER}{message}")))
}

// --- tojson: Python's json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)

fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, minijinja::Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent: Option<String> = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => Some(" ".repeat(usize::try_from(i64::try_from(v)?.max(0)).unwrap_or(0))),
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
            _ => {
                return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or str"))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if !s.is_none() => {
            let a = s.get_item(&Value::from(0))?;
            let b = s.get_item(&Value::from(1))?;
            match (a.as_str(), b.as_str()) {
                (Some(a), Some(b)) => (a.to_owned(), b.to_owned()),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(out)
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn json_newline(out: &mut String, opts: &JsonOpts, depth: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn write_json(out: &mut String, v: &Value, opts: &JsonOpts, depth: usize) -> Result<(), minijinja::Error> {
    let not_serializable = |what: &str| {
        minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {what} is not JSON serializable"))
    };
    if depth > 512 {
        return Err(not_serializable("a value nested this deep"));
    }
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Undefined => return Err(not_serializable("undefined")),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_json_number(out, v)?,
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                json_newline(out, opts, depth + 1);
                write_json(out, item, opts, depth + 1)?;
            }
            json_newline(out, opts, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for k in v.try_iter()? {
                let val = v.get_item(&k)?;
                let key = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or_default().to_owned(),
                    ValueKind::None => "null".to_owned(),
                    ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).to_owned(),
                    ValueKind::Number => {
                        let mut s = String::new();
                        write_json_number(&mut s, &k)?;
                        s
                    }
                    _ => return Err(not_serializable("a map key of this type")),
                };
                entries.push((key, val));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, val)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                json_newline(out, opts, depth + 1);
                write_json_str(out, key, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_json(out, val, opts, depth + 1)?;
            }
            json_newline(out, opts, depth);
            out.push('}');
        }
        _ => return Err(not_serializable("this value")),
    }
    Ok(())
}

fn write_json_number(out: &mut String, v: &Value) -> Result<(), minijinja::Error> {
    if v.is_integer() {
        let _ = write!(out, "{v}");
        return Ok(());
    }
    let f = f64::try_from(v.clone())?;
    out.push_str(&py_float_repr(f));
    Ok(())
}

/// Python's `repr(float)` (and `json.dumps` of a float): shortest round-trip digits, positional
/// for exponents -4..16, else `d.ddde±XX`.
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let sci = format!("{f:e}"); // e.g. "-1.2345e-7", shortest round-trip digits
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mant) = match mant.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mant),
    };
    let digits: String = mant.chars().filter(char::is_ascii_digit).collect();
    let mut s = String::new();
    if neg {
        s.push('-');
    }
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        if exp < 0 {
            s.push_str("0.");
            for _ in 0..(-exp - 1) {
                s.push('0');
            }
            s.push_str(&digits);
        } else if exp + 1 >= n {
            s.push_str(&digits);
            for _ in 0..(exp + 1 - n) {
                s.push('0');
            }
            s.push_str(".0");
        } else {
            let (a, b) = digits.split_at((exp + 1) as usize);
            s.push_str(a);
            s.push('.');
            s.push_str(b);
        }
    } else {
        let (a, b) = digits.split_at(1);
        s.push_str(a);
        if !b.is_empty() {
            s.push('.');
            s.push_str(b);
        }
        let _ = write!(s, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    s
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// --- strftime_now: Python's datetime.now().strftime(format), in UTC

fn strftime_now(state: &State<'_, '_>, format: String) -> Result<String, minijinja::Error> {
    let now = match state.lookup(NOW_VAR).and_then(|v| i64::try_from(v).ok()) {
        Some(t) => t,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
            .unwrap_or(0),
    };
    Ok(strftime(&format, now))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// `(year, month 1-12, day 1-31)` of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The strftime directives chat templates use (`%d %b %Y`, `%B`, `%A`, `%H:%M`, …) on a Unix time
/// in UTC; a `-` flag drops zero padding (glibc); unknown directives are kept as written.
fn strftime(format: &str, unix_s: i64) -> String {
    let days = unix_s.div_euclid(86_400);
    let secs = unix_s.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (secs / 3600, (secs / 60) % 60, secs % 60);
    let wd = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (Monday = 0)
    let is_leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + u32::from(is_leap && m > 2);
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            if no_pad {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{y}");
            }
            Some('y') => num(&mut out, y.rem_euclid(100), 2),
            Some('m') => num(&mut out, i64::from(m), 2),
            Some('d') => num(&mut out, i64::from(d), 2),
            Some('e') => {
                let _ = write!(out, "{d:2}");
            }
            Some('j') => num(&mut out, i64::from(yday), 3),
            Some('H') => num(&mut out, hh, 2),
            Some('I') => num(&mut out, if hh % 12 == 0 { 12 } else { hh % 12 }, 2),
            Some('M') => num(&mut out, mm, 2),
            Some('S') => num(&mut out, ss, 2),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(month),
            Some('b') | Some('h') => out.push_str(&month[..3]),
            Some('A') => out.push_str(WEEKDAYS[wd]),
            Some('a') => out.push_str(&WEEKDAYS[wd][..3]),
            Some('u') => num(&mut out, wd as i64 + 1, 1),
            Some('w') => num(&mut out, (wd as i64 + 1) % 7, 1),
            Some('F') => {
                let _ = write!(out, "{y}-{m:02}-{d:02}");
            }
            Some('T') => {
                let _ = write!(out, "{hh:02}:{mm:02}:{ss:02}");
            }
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Segmenting: where tokenization provably restarts
// ---------------------------------------------------------------------------------------------

/// Finds the cuts (see the module docs) with the automaton `tokenizers` itself uses.
struct Segmenter {
    /// Every non-normalized added token, leftmost-longest, as in `AddedVocabulary`.
    trie: DoubleArrayAhoCorasick<u32>,
    /// Sorted ids of the added tokens after which a cut is allowed.
    cut_after: Vec<u32>,
}

impl Segmenter {
    fn new(tok: &tokenizers::Tokenizer) -> Option<Segmenter> {
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
    fn cuts(&self, text: &str, out: &mut Vec<usize>) {
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

// ---------------------------------------------------------------------------------------------
// Prefix cache
// ---------------------------------------------------------------------------------------------

/// Prefix tokenization cache settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PrefixCacheConfig {
    /// Memory budget in bytes (segment text + 4 bytes per id + [`SEGMENT_OVERHEAD_BYTES`] per
    /// segment); least recently used segments are dropped beyond it.
    pub max_bytes: usize,
    /// Segments longer than this (bytes of text) are tokenized every time and not kept.
    pub max_segment_bytes: usize,
}

/// Default [`PrefixCacheConfig::max_bytes`]: 64 MiB.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 64 << 20;
/// Default [`PrefixCacheConfig::max_segment_bytes`]: 1 MiB.
pub const DEFAULT_MAX_SEGMENT_BYTES: usize = 1 << 20;
/// Bookkeeping bytes counted per cached segment on top of its text and ids (LRU node, hash slot,
/// allocation headers).
pub const SEGMENT_OVERHEAD_BYTES: usize = 96;

impl Default for PrefixCacheConfig {
    fn default() -> Self {
        PrefixCacheConfig { max_bytes: DEFAULT_PREFIX_CACHE_BYTES, max_segment_bytes: DEFAULT_MAX_SEGMENT_BYTES }
    }
}

impl PrefixCacheConfig {
    /// A cache with a memory budget of `max_bytes`.
    pub fn with_max_bytes(max_bytes: usize) -> PrefixCacheConfig {
        PrefixCacheConfig { max_bytes, ..PrefixCacheConfig::default() }
    }
}

/// Counters of a prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PrefixCacheStats {
    /// Segments found in the cache (or earlier in the same text).
    pub hits: u64,
    /// Segments tokenized.
    pub misses: u64,
    /// Ids served without tokenizing; `hit_tokens + miss_tokens` is every id returned (before
    /// post-processor special tokens).
    pub hit_tokens: u64,
    /// Ids produced by tokenizing.
    pub miss_tokens: u64,
    /// Segments dropped to stay within the budget.
    pub evictions: u64,
    /// Segments held now.
    pub entries: usize,
    /// Bytes accounted now (see [`PrefixCacheConfig::max_bytes`]).
    pub bytes: usize,
}

struct Segment {
    text: Box<str>,
    ids: Arc<[u32]>,
}

impl Segment {
    fn cost(&self) -> usize {
        self.text.len() + 4 * self.ids.len() + SEGMENT_OVERHEAD_BYTES
    }
}

/// Keys are already xxh3 hashes: the map uses them as they are.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// One segment of a text being encoded: its text, its hash, and its ids when the cache had them.
type Part<'a> = (&'a str, u64, Option<Arc<[u32]>>);

struct CacheState {
    lru: lru::LruCache<u64, Segment, BuildHasherDefault<PassThrough>>,
    stats: PrefixCacheStats,
}

struct PrefixCache {
    config: PrefixCacheConfig,
    state: Mutex<CacheState>,
}

impl PrefixCache {
    fn new(config: PrefixCacheConfig) -> PrefixCache {
        PrefixCache {
            config,
            state: Mutex::new(CacheState {
                lru: lru::LruCache::unbounded_with_hasher(BuildHasherDefault::default()),
                stats: PrefixCacheStats::default(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheState> {
        // The lock is never held across tokenization or user code, so a poisoned state is whole.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

// ---------------------------------------------------------------------------------------------
// Tokenizer
// ---------------------------------------------------------------------------------------------

/// A model's tokenizer (and chat template), with an optional prefix cache. `Send + Sync`: share
/// one per model across threads.
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

    /// Renders a conversation with the chat template.
    pub fn render_chat(&self, messages: &[ChatMessage], options: &ChatOptions) -> Result<String, TokenizeError> {
        self.template.as_ref().ok_or(TokenizeError::NoChatTemplate)?.render(messages, options)
    }

    /// Token ids of a chat request as the engine computes them: the rendered template, tokenized
    /// without adding special tokens (the template writes them).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.encode_chat_with(messages, &ChatOptions::new(add_generation_prompt))
    }

    /// [`Tokenizer::encode_chat`] with tools, template kwargs and a fixed time.
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
    pub fn request_token_ids(&self, req: &crate::request::RouteRequest) -> Result<Vec<Vec<u32>>, TokenizeError> {
        if let Some(chat) = &req.chat {
            return Ok(vec![self.encode_chat_with(&chat.messages.to_vec(), &chat_options(chat))?]);
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
    pub fn keyable_token_ids(&self, req: &crate::request::RouteRequest) -> Result<Vec<Vec<u32>>, TokenizeError> {
        use crate::request::Prompt;
        if let Some((chat, at)) = req.chat.as_ref().and_then(|c| c.media.map(|m| (c, m.message))) {
            let mut messages = chat.messages.to_vec();
            let Some(m) = messages.get_mut(at) else { return Ok(vec![Vec::new()]) };
            m.content = Some(KEY_LIMIT_SENTINEL.to_owned());
            let text = self.render_chat(&messages, &chat_options(chat))?;
            let Some(cut) = text.find(KEY_LIMIT_SENTINEL) else { return Ok(vec![Vec::new()]) };
            let mut ids = self.encode(&text[..cut], false)?;
            ids.pop();
            return Ok(vec![ids]);
        }
        let Some(limit) = req.key_limit else { return self.request_token_ids(req) };
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
    fn strftime_matches_python() {
        // 2026-11-29 13:05:09 UTC, a Sunday; python: datetime(2026,11,29,13,5,9).strftime(...)
        let t = 1_795_957_509;
        assert_eq!(strftime("%d %b %Y", t), "29 Nov 2026");
        assert_eq!(strftime("%A %B %-d, %H:%M:%S %p %j %y %%", t), "Sunday November 29, 13:05:09 PM 333 26 %");
        assert_eq!(strftime("%Y-%m-%d %a %I %Q", 0), "1970-01-01 Thu 12 %Q");
        assert_eq!(strftime("%d %b %Y", 951_782_400), "29 Feb 2000");
        assert_eq!(strftime("%F %T", -1), "1969-12-31 23:59:59");
    }

    #[test]
    fn float_repr_matches_python() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1.5e300, "1.5e+300"),
            (f64::INFINITY, "Infinity"),
        ] {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn a_limit_inside_a_completions_prompt_cuts_before_its_character() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/tokenizer");
        let tok = Tokenizer::from_dir(dir).unwrap();
        let text = "Grüße aus Köln, und noch viel mehr Text danach.";
        let mut req = crate::request::RouteRequest::text("m", text);
        let at = text.find('ö').unwrap() + 1; // inside the two bytes of 'ö'
        req.key_limit = Some(crate::request::KeyLimit { prompt: 0, keyed_len: at, message: None, media_parts: 1 });
        let keyable = tok.keyable_token_ids(&req).unwrap();
        let full = tok.encode_prompt(text).unwrap();
        assert_eq!(keyable.len(), 1);
        assert!(!keyable[0].is_empty() && full.starts_with(&keyable[0]));
        let head = tok.encode_prompt(&text[..at - 1]).unwrap();
        assert_eq!(keyable[0].len() + 1, head.len());
        // A second sequence after the limit yields no ids; one before it all of them.
        req.prompts.push(crate::request::Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(tok.keyable_token_ids(&req).unwrap()[1], Vec::<u32>::new());
        req.key_limit = Some(crate::request::KeyLimit { prompt: 1, keyed_len: 2, message: None, media_parts: 0 });
        assert_eq!(tok.keyable_token_ids(&req).unwrap(), vec![full, vec![1, 2]]);
    }

    #[test]
    fn generation_tags_become_ifs() {
        let src = "{%- generation -%}x{% endgeneration %}{% if a %}{% endif %}";
        assert_eq!(rewrite_generation_tags(src), "{%- if true -%}x{% endif %}{% if a %}{% endif %}");
        assert!(matches!(rewrite_generation_tags("{{ x }}"), Cow::Borrowed(_)));
    }
}

//! OpenAI-compatible request parsing and validation, and the error body.
//!
//! Errors are OpenAI-shaped, with vLLM's type names:
//! `{"error": {"message": "...", "type": "BadRequestError", "param": "max_tokens", "code": 400}}`.

use serde_json::{json, Map, Value};

use crate::tokenizer::{self, ChatMessage};

/// An HTTP error with an OpenAI-style body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// Human-readable message.
    pub message: String,
    /// The request field at fault, if any.
    pub param: Option<String>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn bad(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError { status: 400, message: message.into(), param: param.map(str::to_owned) }
    }

    /// An error with another status.
    pub fn status(status: u16, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None }
    }

    /// vLLM's error type name for the status.
    pub fn kind(&self) -> &'static str {
        match self.status {
            400 => "BadRequestError",
            404 => "NotFoundError",
            405 => "MethodNotAllowedError",
            408 => "RequestTimeoutError",
            409 => "ConflictError",
            413 => "RequestEntityTooLargeError",
            503 => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "param": self.param, "code": self.status}})
    }
}

/// A prompt: text (tokenized by the worker) or token ids (used as is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// A validated completion or chat request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerateRequest {
    /// Requested model (checked against the served name by the caller).
    pub model: Option<String>,
    /// The prompt (chat: the rendered template).
    pub prompt: PromptInput,
    /// `max_tokens` (`max_completion_tokens` for chat), if given.
    pub max_tokens: Option<u32>,
    /// Server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `cache_salt` (vLLM): isolates the prompt's prefix-cache blocks.
    pub cache_salt: Option<String>,
    /// `return_token_ids` (vLLM): add the generated token ids to the response.
    pub return_token_ids: bool,
}

impl GenerateRequest {
    /// The prompt's token ids (text: UTF-8 bytes `% vocab`).
    pub fn tokens(&self, vocab: u32) -> Vec<u32> {
        match &self.prompt {
            PromptInput::Text(t) => tokenizer::encode(t, vocab),
            PromptInput::Tokens(t) => t.clone(),
        }
    }
}

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad(None, format!("Invalid JSON body: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::bad(None, format!("The request body must be a JSON object, not {}", type_name(&other)))),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong(param: &str, want: &str, got: &Value) -> ApiError {
    ApiError::bad(Some(param), format!("`{param}` must be {want}, not {}", type_name(got)))
}

fn opt_str(m: &Map<String, Value>, k: &str) -> Result<Option<String>, ApiError> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(wrong(k, "a string", v)),
    }
}

fn opt_bool(m: &Map<String, Value>, k: &str) -> Result<bool, ApiError> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(wrong(k, "a boolean", v)),
    }
}

fn opt_count(m: &Map<String, Value>, k: &str) -> Result<Option<u32>, ApiError> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Number(n)) => match n.as_u64() {
            Some(0) => Err(ApiError::bad(Some(k), format!("`{k}` must be at least 1, got 0"))),
            Some(x) => Ok(Some(u32::try_from(x).unwrap_or(u32::MAX))),
            None => Err(wrong(k, "a positive integer", v)),
        },
        Some(v) => Err(wrong(k, "a positive integer", v)),
    }
}

fn check_number(m: &Map<String, Value>, k: &str) -> Result<(), ApiError> {
    match m.get(k) {
        None | Some(Value::Null) | Some(Value::Number(_)) => Ok(()),
        Some(v) => Err(wrong(k, "a number", v)),
    }
}

/// Fields common to both APIs.
fn common(m: &Map<String, Value>, prompt: PromptInput, max_keys: &[&str]) -> Result<GenerateRequest, ApiError> {
    let model = opt_str(m, "model")?;
    let mut max_tokens = None;
    for k in max_keys {
        if let Some(v) = opt_count(m, k)? {
            max_tokens = Some(v);
            break;
        }
    }
    let stream = opt_bool(m, "stream")?;
    let include_usage = match m.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => opt_bool(o, "include_usage").map_err(|mut e| {
            e.param = Some("stream_options.include_usage".into());
            e
        })?,
        Some(v) => return Err(wrong("stream_options", "an object", v)),
    };
    match m.get("n") {
        None | Some(Value::Null) => {}
        Some(Value::Number(n)) if n.as_u64() == Some(1) => {}
        Some(_) => return Err(ApiError::bad(Some("n"), "only `n` = 1 is supported")),
    }
    for k in ["temperature", "top_p", "presence_penalty", "frequency_penalty", "seed"] {
        check_number(m, k)?;
    }
    let cache_salt = opt_str(m, "cache_salt")?;
    if cache_salt.as_deref() == Some("") {
        return Err(ApiError::bad(Some("cache_salt"), "`cache_salt` must not be empty"));
    }
    let return_token_ids = opt_bool(m, "return_token_ids")?;
    Ok(GenerateRequest { model, prompt, max_tokens, stream, include_usage, cache_salt, return_token_ids })
}

fn token_ids(param: &str, items: &[Value], vocab: u32) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_u64() {
            Some(t) if t < u64::from(vocab) => Ok(t as u32),
            Some(t) => Err(ApiError::bad(
                Some(param),
                format!("token id {t} at `{param}[{i}]` is out of vocabulary (vocab size {vocab})"),
            )),
            None => Err(ApiError::bad(Some(param), format!("`{param}[{i}]` must be a token id (integer >= 0)"))),
        })
        .collect()
}

/// Parse a `POST /v1/completions` body.
pub fn parse_completion(body: &[u8], vocab: u32) -> Result<GenerateRequest, ApiError> {
    let m = parse_object(body)?;
    let prompt = match m.get("prompt") {
        None | Some(Value::Null) => return Err(ApiError::bad(Some("prompt"), "`prompt` is required")),
        Some(Value::String(s)) => PromptInput::Text(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => return Err(ApiError::bad(Some("prompt"), "`prompt` must not be empty")),
            [Value::String(s)] => PromptInput::Text(s.clone()),
            [Value::Array(ids)] => PromptInput::Tokens(token_ids("prompt[0]", ids, vocab)?),
            [Value::String(_) | Value::Array(_), ..] => {
                return Err(ApiError::bad(Some("prompt"), "only one prompt per request is supported"))
            }
            ids => PromptInput::Tokens(token_ids("prompt", ids, vocab)?),
        },
        Some(v) => return Err(wrong("prompt", "a string or an array of token ids", v)),
    };
    let empty = match &prompt {
        PromptInput::Text(t) => t.is_empty(),
        PromptInput::Tokens(t) => t.is_empty(),
    };
    if empty {
        return Err(ApiError::bad(Some("prompt"), "`prompt` must not be empty"));
    }
    common(&m, prompt, &["max_tokens"])
}

/// Parse a `POST /v1/chat/completions` body (messages rendered with the fixed template).
pub fn parse_chat(body: &[u8]) -> Result<GenerateRequest, ApiError> {
    let m = parse_object(body)?;
    let items = match m.get("messages") {
        None | Some(Value::Null) => return Err(ApiError::bad(Some("messages"), "`messages` is required")),
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::bad(Some("messages"), "`messages` must not be empty"))
        }
        Some(Value::Array(a)) => a,
        Some(v) => return Err(wrong("messages", "an array", v)),
    };
    let mut msgs = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Value::Object(o) = it else { return Err(wrong(&p, "an object", it)) };
        let role = match o.get("role") {
            Some(Value::String(r)) if !r.is_empty() => r.clone(),
            Some(Value::String(_)) => {
                return Err(ApiError::bad(Some(&format!("{p}.role")), format!("`{p}.role` must not be empty")))
            }
            Some(v) => return Err(wrong(&format!("{p}.role"), "a string", v)),
            None => return Err(ApiError::bad(Some(&format!("{p}.role")), format!("`{p}.role` is required"))),
        };
        let content = match o.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    let pp = format!("{p}.content[{j}]");
                    match (part.get("type").and_then(Value::as_str), part.get("text")) {
                        (Some("text"), Some(Value::String(t))) => text.push_str(t),
                        _ => {
                            return Err(ApiError::bad(
                                Some(&pp),
                                format!("`{pp}` must be {{\"type\": \"text\", \"text\": string}}"),
                            ))
                        }
                    }
                }
                text
            }
            Some(v) => return Err(wrong(&format!("{p}.content"), "a string or an array of text parts", v)),
        };
        msgs.push(ChatMessage { role, content });
    }
    let prompt = PromptInput::Text(tokenizer::render_chat(&msgs));
    common(&m, prompt, &["max_completion_tokens", "max_tokens"])
}

/// Body of `POST /kvroute/v1/prefill` (a decode worker asking this worker to prefill).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillRequest {
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// The request's `cache_salt`.
    pub cache_salt: Option<String>,
    /// Leading blocks the decode worker has already.
    pub skip_blocks: usize,
    /// Pull or push.
    pub mode: crate::config::TransferMode,
}

/// Parse a `POST /kvroute/v1/prefill` body.
pub fn parse_prefill(body: &[u8], vocab: u32) -> Result<PrefillRequest, ApiError> {
    let m = parse_object(body)?;
    let tokens = match m.get("prompt_token_ids") {
        Some(Value::Array(a)) if !a.is_empty() => token_ids("prompt_token_ids", a, vocab)?,
        Some(v) => return Err(wrong("prompt_token_ids", "a non-empty array of token ids", v)),
        None => return Err(ApiError::bad(Some("prompt_token_ids"), "`prompt_token_ids` is required")),
    };
    let cache_salt = opt_str(&m, "cache_salt")?;
    let skip_blocks = match m.get("skip_blocks") {
        None | Some(Value::Null) => 0,
        Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| wrong("skip_blocks", "an integer >= 0", v))?,
    };
    let mode = match opt_str(&m, "transfer_mode")?.as_deref() {
        None | Some("pull") => crate::config::TransferMode::Pull,
        Some("push") => crate::config::TransferMode::Push,
        Some(other) => {
            return Err(ApiError::bad(Some("transfer_mode"), format!("unknown transfer_mode {other:?} (pull or push)")))
        }
    };
    Ok(PrefillRequest { tokens, cache_salt, skip_blocks, mode })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(r: Result<GenerateRequest, ApiError>) -> ApiError {
        r.unwrap_err()
    }

    #[test]
    fn prompts_in_every_form() {
        let t = |b: &str| parse_completion(b.as_bytes(), 300).unwrap().prompt;
        assert_eq!(t(r#"{"prompt":"hi"}"#), PromptInput::Text("hi".into()));
        assert_eq!(t(r#"{"prompt":["hi"]}"#), PromptInput::Text("hi".into()));
        assert_eq!(t(r#"{"prompt":[1,2,3]}"#), PromptInput::Tokens(vec![1, 2, 3]));
        assert_eq!(t(r#"{"prompt":[[4,5]]}"#), PromptInput::Tokens(vec![4, 5]));
        let r = parse_completion(
            br#"{"prompt":"x","max_tokens":3,"stream":true,"stream_options":{"include_usage":true},"cache_salt":"s"}"#,
            300,
        )
        .unwrap();
        assert_eq!(
            (r.max_tokens, r.stream, r.include_usage, r.cache_salt.as_deref()),
            (Some(3), true, true, Some("s"))
        );
    }

    #[test]
    fn bad_requests_name_the_field() {
        let p = |b: &str| err(parse_completion(b.as_bytes(), 300));
        assert_eq!(p("{").param, None);
        assert!(p("{").message.starts_with("Invalid JSON"));
        assert_eq!(p("[1]").status, 400);
        assert_eq!(p("{}").param.as_deref(), Some("prompt"));
        assert_eq!(p(r#"{"prompt":5}"#).param.as_deref(), Some("prompt"));
        assert_eq!(p(r#"{"prompt":""}"#).param.as_deref(), Some("prompt"));
        assert_eq!(p(r#"{"prompt":[1,-2]}"#).param.as_deref(), Some("prompt"));
        assert_eq!(p(r#"{"prompt":[1,300]}"#).param.as_deref(), Some("prompt"));
        assert_eq!(p(r#"{"prompt":["a","b"]}"#).param.as_deref(), Some("prompt"));
        assert_eq!(p(r#"{"prompt":"a","max_tokens":"3"}"#).param.as_deref(), Some("max_tokens"));
        assert_eq!(p(r#"{"prompt":"a","max_tokens":0}"#).param.as_deref(), Some("max_tokens"));
        assert_eq!(p(r#"{"prompt":"a","max_tokens":1.5}"#).param.as_deref(), Some("max_tokens"));
        assert_eq!(p(r#"{"prompt":"a","stream":"yes"}"#).param.as_deref(), Some("stream"));
        assert_eq!(p(r#"{"prompt":"a","n":2}"#).param.as_deref(), Some("n"));
        assert_eq!(p(r#"{"prompt":"a","temperature":"hot"}"#).param.as_deref(), Some("temperature"));
        assert_eq!(p(r#"{"prompt":"a","model":1}"#).param.as_deref(), Some("model"));
        let e = p(r#"{"prompt":"a","stream_options":{"include_usage":1}}"#);
        assert_eq!(e.param.as_deref(), Some("stream_options.include_usage"));
        assert_eq!(e.body()["error"]["type"], "BadRequestError");
        assert_eq!(e.body()["error"]["code"], 400);
    }

    #[test]
    fn chat_messages() {
        let r = parse_chat(br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"max_completion_tokens":2}"#).unwrap();
        assert_eq!(r.prompt, PromptInput::Text("<|user|>\nab\n<|assistant|>\n".into()));
        assert_eq!(r.max_tokens, Some(2));
        let c = |b: &str| parse_chat(b.as_bytes()).unwrap_err().param;
        assert_eq!(c("{}").as_deref(), Some("messages"));
        assert_eq!(c(r#"{"messages":[]}"#).as_deref(), Some("messages"));
        assert_eq!(c(r#"{"messages":[1]}"#).as_deref(), Some("messages[0]"));
        assert_eq!(c(r#"{"messages":[{"content":"x"}]}"#).as_deref(), Some("messages[0].role"));
        assert_eq!(c(r#"{"messages":[{"role":"user","content":5}]}"#).as_deref(), Some("messages[0].content"));
        assert_eq!(
            c(r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#).as_deref(),
            Some("messages[0].content[0]")
        );
    }

    #[test]
    fn prefill_body() {
        let r = parse_prefill(br#"{"prompt_token_ids":[1,2],"skip_blocks":1,"transfer_mode":"push"}"#, 10).unwrap();
        assert_eq!((r.tokens, r.skip_blocks, r.mode), (vec![1, 2], 1, crate::config::TransferMode::Push));
        assert!(parse_prefill(br#"{"prompt_token_ids":[]}"#, 10).is_err());
        assert!(parse_prefill(br#"{"prompt_token_ids":[1],"transfer_mode":"x"}"#, 10).is_err());
    }
}

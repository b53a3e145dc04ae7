//! Chat templates: minijinja set up as transformers' `apply_chat_template` (trim and lstrip
//! blocks, loop controls, Python methods), its helpers (`raise_exception`, `tojson`,
//! `strftime_now`), `{% generation %}` tags, and the messages and options a template renders.

use std::borrow::Cow;
use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind};

use super::py_json::{write_json, JsonOpts};
use super::strftime::strftime_now;
use super::{ChatMessage, RawJson, TokenizeError};

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
    /// Unix time in seconds for `strftime_now` (UTC): the request's time, given by the caller
    /// (see [`ChatOptions::with_now_ms`]); the core reads no clock. `None` (the default): a
    /// template that calls `strftime_now` fails to render ([`TokenizeError::Render`]).
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

    /// These options rendering at `now_ms`, the request's time in milliseconds since the UNIX
    /// epoch (the `now_ms` of a route call): [`ChatOptions::now_unix_s`] becomes its whole
    /// seconds, so `strftime_now` writes that time's date.
    #[must_use]
    pub fn with_now_ms(mut self, now_ms: u64) -> ChatOptions {
        self.now_unix_s = Some(i64::try_from(now_ms / 1000).unwrap_or(i64::MAX));
        self
    }
}

const TEMPLATE_NAME: &str = "chat_template";
pub(super) const NOW_VAR: &str = "__kvroute_now_unix_s";
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

/// The options a parsed chat request renders with at `now_ms` (vLLM's defaults for what it does
/// not say).
pub(super) fn chat_options(chat: &crate::request::ChatInput, now_ms: u64) -> ChatOptions {
    ChatOptions {
        add_generation_prompt: chat.add_generation_prompt && !chat.continue_final_message,
        tools: chat.tools.clone(),
        kwargs: chat.chat_template_kwargs.clone(),
        continue_final_message: chat.continue_final_message,
        ..ChatOptions::default()
    }
    .with_now_ms(now_ms)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_ifs() {
        let src = "{%- generation -%}x{% endgeneration %}{% if a %}{% endif %}";
        assert_eq!(rewrite_generation_tags(src), "{%- if true -%}x{% endif %}{% if a %}{% endif %}");
        assert!(matches!(rewrite_generation_tags("{{ x }}"), Cow::Borrowed(_)));
    }
}

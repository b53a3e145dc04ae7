//! Chat messages as a chat template sees them ([`ChatMessage`], [`ChatInput`]) and their packed
//! storage ([`ChatMessages`]): every field's text in one buffer, the message shapes in another,
//! lengths as LEB128 (`put_len` / `get_len`, which the media list packs with too).

use std::fmt;

use super::media::ChatMedia;

/// A JSON value kept as its source text, so object keys keep the order the client wrote them in
/// (a chat template's `tojson` prints them in that order, as Python does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawJson(pub(super) Box<str>);

impl RawJson {
    /// Validates `text` as one JSON value.
    pub fn new(text: &str) -> Result<RawJson, serde_json::Error> {
        serde_json::from_str::<serde::de::IgnoredAny>(text)?;
        Ok(RawJson(text.into()))
    }

    /// The JSON text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&serde_json::Value> for RawJson {
    /// From a parsed value. `serde_json` without `preserve_order` has sorted object keys, so
    /// `tojson` output can differ from the client's key order; prefer [`RawJson::new`] on the
    /// request's own text.
    fn from(v: &serde_json::Value) -> RawJson {
        RawJson(v.to_string().into())
    }
}

/// One OpenAI chat message as a chat template sees it. `None` fields are absent.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// Text content (for content parts, the text parts joined with `"\n"`, as vLLM does for
    /// templates that take string content).
    pub content: Option<String>,
    /// `name`.
    pub name: Option<String>,
    /// `tool_calls` (a JSON array, as the client sent it).
    pub tool_calls: Option<RawJson>,
    /// `tool_call_id`.
    pub tool_call_id: Option<String>,
    /// `reasoning_content` (earlier reasoning that some templates render).
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A message with a role and text content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(content.into()),
            name: None,
            tool_calls: None,
            tool_call_id: None,
            reasoning_content: None,
        }
    }

    /// A message with a role and no content (e.g. an assistant message with only tool calls).
    pub fn without_content(role: impl Into<String>) -> ChatMessage {
        ChatMessage { content: None, ..ChatMessage::new(role, "") }
    }
}

/// A borrowed view of one message in [`ChatMessages`]. `None` fields are absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChatMessageRef<'a> {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: &'a str,
    /// Text content (see [`ChatMessage::content`]).
    pub content: Option<&'a str>,
    /// `name`.
    pub name: Option<&'a str>,
    /// `tool_calls` (JSON text, as the client sent it).
    pub tool_calls: Option<&'a str>,
    /// `tool_call_id`.
    pub tool_call_id: Option<&'a str>,
    /// `reasoning_content`.
    pub reasoning_content: Option<&'a str>,
}

impl ChatMessageRef<'_> {
    /// An owned copy.
    pub fn to_message(&self) -> ChatMessage {
        ChatMessage {
            role: self.role.to_owned(),
            content: self.content.map(str::to_owned),
            name: self.name.map(str::to_owned),
            tool_calls: self.tool_calls.map(|t| RawJson(t.into())),
            tool_call_id: self.tool_call_id.map(str::to_owned),
            reasoning_content: self.reasoning_content.map(str::to_owned),
        }
    }
}

/// A chat's messages in two buffers: every field's text one after the other, and per message a
/// byte saying which optional fields it has followed by the lengths of its role and of each
/// field it has (LEB128). A message costs its text plus a few bytes, never a struct of heap
/// strings: a body of many tiny messages stays about its own size (wasm linear memory never
/// shrinks, so a filter keeps whatever a request made it allocate).
///
/// Read it with [`ChatMessages::iter`] (borrowed views) or [`ChatMessages::to_vec`] (what the
/// tokenizer takes); build it from [`ChatMessage`]s with `collect` or `From`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ChatMessages {
    text: String,
    shape: Vec<u8>,
    len: usize,
}

const HAS_CONTENT: u8 = 1;
const HAS_NAME: u8 = 2;
const HAS_TOOL_CALLS: u8 = 4;
const HAS_TOOL_CALL_ID: u8 = 8;
const HAS_REASONING: u8 = 16;

impl ChatMessages {
    /// No messages.
    pub fn new() -> ChatMessages {
        ChatMessages::default()
    }

    /// Number of messages.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no messages.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends a message.
    pub fn push(&mut self, m: ChatMessageRef<'_>) {
        let fields = [
            (HAS_CONTENT, m.content),
            (HAS_NAME, m.name),
            (HAS_TOOL_CALLS, m.tool_calls),
            (HAS_TOOL_CALL_ID, m.tool_call_id),
            (HAS_REASONING, m.reasoning_content),
        ];
        self.shape.push(fields.iter().filter(|(_, f)| f.is_some()).fold(0, |a, (bit, _)| a | bit));
        for t in std::iter::once(m.role).chain(fields.iter().filter_map(|(_, f)| *f)) {
            put_len(&mut self.shape, t.len());
            self.text.push_str(t);
        }
        self.len += 1;
    }

    /// The messages, in order.
    pub fn iter(&self) -> ChatMessagesIter<'_> {
        ChatMessagesIter { msgs: self, shape: 0, text: 0 }
    }

    /// Message `i` (found by walking the messages before it).
    pub fn get(&self, i: usize) -> Option<ChatMessageRef<'_>> {
        self.iter().nth(i)
    }

    /// Owned copies of the messages (what the `tokenizer` feature's `Tokenizer::render_chat` takes).
    pub fn to_vec(&self) -> Vec<ChatMessage> {
        self.iter().map(|m| m.to_message()).collect()
    }

    pub(super) fn shrink_to_fit(&mut self) {
        self.text.shrink_to_fit();
        self.shape.shrink_to_fit();
    }
}

impl fmt::Debug for ChatMessages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<'a> IntoIterator for &'a ChatMessages {
    type Item = ChatMessageRef<'a>;
    type IntoIter = ChatMessagesIter<'a>;
    fn into_iter(self) -> ChatMessagesIter<'a> {
        self.iter()
    }
}

impl ChatMessage {
    /// A borrowed view.
    pub fn as_ref(&self) -> ChatMessageRef<'_> {
        ChatMessageRef {
            role: &self.role,
            content: self.content.as_deref(),
            name: self.name.as_deref(),
            tool_calls: self.tool_calls.as_ref().map(RawJson::as_str),
            tool_call_id: self.tool_call_id.as_deref(),
            reasoning_content: self.reasoning_content.as_deref(),
        }
    }
}

impl<'a> FromIterator<&'a ChatMessage> for ChatMessages {
    fn from_iter<I: IntoIterator<Item = &'a ChatMessage>>(iter: I) -> ChatMessages {
        let mut out = ChatMessages::new();
        for m in iter {
            out.push(m.as_ref());
        }
        out
    }
}

impl FromIterator<ChatMessage> for ChatMessages {
    fn from_iter<I: IntoIterator<Item = ChatMessage>>(iter: I) -> ChatMessages {
        let mut out = ChatMessages::new();
        for m in iter {
            out.push(m.as_ref());
        }
        out
    }
}

impl From<&[ChatMessage]> for ChatMessages {
    fn from(msgs: &[ChatMessage]) -> ChatMessages {
        msgs.iter().collect()
    }
}

impl From<Vec<ChatMessage>> for ChatMessages {
    fn from(msgs: Vec<ChatMessage>) -> ChatMessages {
        msgs.iter().collect()
    }
}

/// Iterator over [`ChatMessages`].
#[derive(Debug, Clone)]
pub struct ChatMessagesIter<'a> {
    msgs: &'a ChatMessages,
    shape: usize,
    text: usize,
}

impl<'a> ChatMessagesIter<'a> {
    fn field(&mut self) -> Option<&'a str> {
        let n = get_len(&self.msgs.shape, &mut self.shape)?;
        let t = self.msgs.text.get(self.text..self.text.checked_add(n)?)?;
        self.text += n;
        Some(t)
    }
}

impl<'a> Iterator for ChatMessagesIter<'a> {
    type Item = ChatMessageRef<'a>;

    fn next(&mut self) -> Option<ChatMessageRef<'a>> {
        let flags = *self.msgs.shape.get(self.shape)?;
        self.shape += 1;
        let role = self.field()?;
        let mut opt = |bit: u8| if flags & bit != 0 { self.field().map(Some) } else { Some(None) };
        Some(ChatMessageRef {
            role,
            content: opt(HAS_CONTENT)?,
            name: opt(HAS_NAME)?,
            tool_calls: opt(HAS_TOOL_CALLS)?,
            tool_call_id: opt(HAS_TOOL_CALL_ID)?,
            reasoning_content: opt(HAS_REASONING)?,
        })
    }
}

/// A chat request's inputs to the model's chat template (kept so a tokenizer can produce the
/// engine's exact token ids).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatInput {
    /// The messages.
    pub messages: ChatMessages,
    /// `tools`, as sent.
    pub tools: Option<RawJson>,
    /// `chat_template_kwargs` (vLLM), name → value.
    pub chat_template_kwargs: Vec<(String, RawJson)>,
    /// `add_generation_prompt` (vLLM; default true).
    pub add_generation_prompt: bool,
    /// `continue_final_message` (vLLM; default false).
    pub continue_final_message: bool,
    /// Where the media parts begin, if the conversation has any.
    pub media: Option<ChatMedia>,
}

/// Appends `n` as LEB128.
pub(super) fn put_len(out: &mut Vec<u8>, mut n: usize) {
    while n >= 0x80 {
        out.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// Reads a LEB128 number written by [`put_len`] at `at`, moving `at` past it.
pub(super) fn get_len(bytes: &[u8], at: &mut usize) -> Option<usize> {
    let mut n = 0usize;
    for shift in (0..usize::BITS).step_by(7) {
        let b = *bytes.get(*at)?;
        *at += 1;
        n |= usize::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(n);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::{ChatMessage, ChatMessages, RawJson};

    #[test]
    fn chat_messages_are_packed_and_read_back() {
        let mut tool = ChatMessage::new("tool", "é".repeat(200));
        tool.tool_call_id = Some("call_1".into());
        let mut asst = ChatMessage::without_content("assistant");
        asst.name = Some("bot".into());
        asst.tool_calls = Some(RawJson::new(r#"[{"id":"call_1","type":"function"}]"#).unwrap());
        asst.reasoning_content = Some(String::new());
        let all = vec![ChatMessage::new("", ""), asst, tool, ChatMessage::new("user", "x".repeat(70_000))];
        let packed = ChatMessages::from(all.clone());
        assert_eq!((packed.len(), packed.is_empty()), (4, false));
        assert_eq!(packed.to_vec(), all);
        assert_eq!(packed.get(2).map(|m| m.to_message()), Some(all[2].clone()));
        assert_eq!(packed.get(4), None);
        assert_eq!(packed, all.iter().collect::<ChatMessages>());
        assert_ne!(packed, ChatMessages::from(&all[..3]));
        assert!(ChatMessages::new().is_empty() && ChatMessages::new().iter().next().is_none());
        assert!(format!("{packed:?}").contains("call_1"));
    }
}

//! Chat content parts and media (see the `request` module docs): reading `messages` (text parts
//! joined, media parts hashed into a message identity when every one has a stable identity), the
//! tokenizer-free chat rendering, and where a request's keys must end ([`KeyLimit`],
//! [`MediaKey`], [`ChatMedia`]).

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use super::body::ObjectOnly;
use super::chat::{get_len, put_len, ChatMessageRef, ChatMessages};

/// Tokens a content part the router cannot key (an image, an audio clip, a video, embeddings,
/// …) is assumed to take in the engine's prompt, for the input length and the prefix-hit
/// denominator. The real count depends on the model and the media (vLLM: 576 per LLaVA-1.5
/// image, 256 per Gemma 3 image, hundreds to thousands for Qwen2-VL).
pub const MEDIA_PART_TOKENS: u32 = 256;

/// Where a request's approximate block keys must end: before the first part the router cannot
/// key (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyLimit {
    /// The prompt sequence the keys end in (`prompts.len()` when every sequence is keyed in full
    /// and only further, unkeyable sequences follow, e.g. `prompt_embeds`).
    pub prompt: usize,
    /// Bytes (text) or token ids of that sequence that can be keyed.
    pub keyed_len: usize,
    /// Chat requests: the message whose content holds the first part without a stable identity.
    pub message: Option<usize>,
    /// Media parts (or `prompt_embeds` sequences) from the limit on, each counted as
    /// [`MEDIA_PART_TOKENS`] tokens.
    pub media_parts: u32,
}

/// The identity of a chat message holding media that all carry a stable identity, mixed into
/// the approximate key of the block holding byte `at` of the rendering (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MediaKey {
    /// Byte offset of the message's content in the rendering (`prompts[0]`).
    pub at: usize,
    /// Hash of the message's content parts and the request's media kwargs.
    pub key: u64,
}

/// Where a chat request's media begin: tokenizer keys end there (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChatMedia {
    /// The first message holding a media part.
    pub message: usize,
    /// Byte offset of its content in the rendering (`prompts[0]`).
    pub rendered_at: usize,
    /// Media parts from that message on.
    pub parts: u32,
}

impl KeyLimit {
    /// Tokens of the media parts (estimated).
    pub fn media_tokens(&self) -> u64 {
        u64::from(self.media_parts) * u64::from(MEDIA_PART_TOKENS)
    }
}

/// `messages`, read one message at a time straight into [`ChatMessages`] (no list of parsed
/// messages in between), with what rendering needs of the media messages.
pub(super) struct RawMessages {
    pub(super) msgs: ChatMessages,
    /// The messages holding media parts.
    media: MediaList,
}

impl RawMessages {
    /// Messages without content parts (so without media), as the body's fast reader
    /// (`super::scan`) reads them.
    pub(super) fn text_only(msgs: ChatMessages) -> RawMessages {
        RawMessages { msgs, media: MediaList::default() }
    }
}

/// A message holding media parts (content parts vLLM does not read as text).
struct MediaMessage<'a> {
    /// Its index in `messages`.
    index: usize,
    /// Its content as rendered: the parts joined with `\n`, text parts as their text, media
    /// parts as a 0x1e marker.
    rendered: &'a [u8],
    /// Its media parts.
    parts: u32,
    /// The hash of its parts (see [`media_key`]) when every media part has a stable identity.
    identity: Option<u128>,
}

/// The media messages of a chat, in order, packed as the messages are (see [`ChatMessages`]):
/// per message its index, rendering length and media parts (LEB128) and a byte saying whether
/// the 16 bytes of its identity follow; the renderings one after the other.
#[derive(Default)]
struct MediaList {
    shape: Vec<u8>,
    text: Vec<u8>,
}

impl MediaList {
    fn push(&mut self, m: MediaMessage<'_>) {
        for n in [m.index, m.rendered.len(), m.parts as usize] {
            put_len(&mut self.shape, n);
        }
        match m.identity {
            Some(h) => {
                self.shape.push(1);
                self.shape.extend_from_slice(&h.to_le_bytes());
            }
            None => self.shape.push(0),
        }
        self.text.extend_from_slice(m.rendered);
    }

    fn iter(&self) -> impl Iterator<Item = MediaMessage<'_>> {
        let (mut at, mut text) = (0usize, 0usize);
        std::iter::from_fn(move || {
            let index = get_len(&self.shape, &mut at)?;
            let len = get_len(&self.shape, &mut at)?;
            let parts = u32::try_from(get_len(&self.shape, &mut at)?).ok()?;
            let identity = match self.shape.get(at)? {
                0 => None,
                _ => {
                    let h = self.shape.get(at + 1..at + 17)?;
                    at += 16;
                    Some(u128::from_le_bytes(h.try_into().ok()?))
                }
            };
            at += 1;
            let rendered = self.text.get(text..text.checked_add(len)?)?;
            text += len;
            Some(MediaMessage { index, rendered, parts, identity })
        })
    }
}

impl<'de> Deserialize<'de> for RawMessages {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawMessages;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawMessages, A::Error> {
                let mut out = RawMessages { msgs: ChatMessages::new(), media: MediaList::default() };
                while let Some(ObjectOnly(m)) = seq.next_element::<ObjectOnly<RawMessage<'de>>>()? {
                    let content = match m.content {
                        RawContent::None => None,
                        RawContent::Text(t) => Some(t),
                        RawContent::Parts(p) => {
                            if p.media > 0 {
                                out.media.push(MediaMessage {
                                    index: out.msgs.len(),
                                    rendered: &p.rendered,
                                    parts: p.media,
                                    identity: p.identity.map(|h| h.digest128()),
                                });
                            }
                            Some(std::borrow::Cow::Owned(p.text))
                        }
                    };
                    out.msgs.push(ChatMessageRef {
                        role: &m.role,
                        content: content.as_deref(),
                        name: m.name.as_deref(),
                        tool_calls: m.tool_calls.as_deref().map(serde_json::value::RawValue::get),
                        tool_call_id: m.tool_call_id.as_deref(),
                        reasoning_content: m.reasoning_content.as_deref(),
                    });
                }
                out.msgs.shrink_to_fit();
                out.media.shape.shrink_to_fit();
                out.media.text.shrink_to_fit();
                Ok(out)
            }
        }
        d.deserialize_seq(V)
    }
}

/// One message as read, borrowing from the body where JSON escapes allow.
#[derive(Deserialize)]
struct RawMessage<'a> {
    #[serde(borrow)]
    role: std::borrow::Cow<'a, str>,
    #[serde(default, borrow)]
    content: RawContent<'a>,
    name: Option<String>,
    tool_calls: Option<Box<serde_json::value::RawValue>>,
    tool_call_id: Option<String>,
    reasoning_content: Option<String>,
}

/// Message content: absent/null, a string, or an array of content parts.
#[derive(Default)]
enum RawContent<'a> {
    #[default]
    None,
    Text(std::borrow::Cow<'a, str>),
    Parts(Parts),
}

/// Content parts, as read: the text parts joined, and what rendering needs of the media parts.
/// Each part is dropped once read, so a long list of parts costs its text and no more.
struct Parts {
    /// The text parts joined with `\n`, as vLLM joins them for templates that take string
    /// content (media parts cannot be rendered here: see `RouteRequest::key_limit`).
    text: String,
    /// The rendering (see [`MediaMessage::rendered`]), built only once a media part shows up.
    rendered: Vec<u8>,
    /// Text parts.
    text_parts: usize,
    /// Media parts.
    media: u32,
    /// The parts' hash so far while every media part has a stable identity (see [`media_key`]).
    identity: Option<Box<xxhash_rust::xxh3::Xxh3>>,
}

impl<'de: 'a, 'a> Deserialize<'de> for RawContent<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = RawContent<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, an array of content parts, or null")
            }
            fn visit_unit<E: de::Error>(self) -> Result<RawContent<'a>, E> {
                Ok(RawContent::None)
            }
            fn visit_none<E: de::Error>(self) -> Result<RawContent<'a>, E> {
                Ok(RawContent::None)
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<RawContent<'a>, E> {
                Ok(RawContent::Text(std::borrow::Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawContent<'a>, E> {
                Ok(RawContent::Text(std::borrow::Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<RawContent<'a>, E> {
                Ok(RawContent::Text(std::borrow::Cow::Owned(v)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawContent<'a>, A::Error> {
                let mut out = Parts {
                    text: String::new(),
                    rendered: Vec::new(),
                    text_parts: 0,
                    media: 0,
                    identity: Some(Box::new(xxhash_rust::xxh3::Xxh3::new())),
                };
                let mut n = 0usize;
                while let Some(p) = seq.next_element::<serde_json::Value>()? {
                    match &p {
                        serde_json::Value::Object(m) => match m.get("type") {
                            Some(serde_json::Value::String(t)) if t == "text" => {
                                if !matches!(m.get("text"), Some(serde_json::Value::String(_))) {
                                    return Err(de::Error::custom(format!(
                                        "content part {n} of type \"text\" needs a string `text`"
                                    )));
                                }
                            }
                            Some(serde_json::Value::String(_)) => {}
                            _ => return Err(de::Error::custom(format!("content part {n} needs a string `type`"))),
                        },
                        _ => return Err(de::Error::custom(format!("content part {n} must be an object"))),
                    }
                    out.add(n, &p);
                    n += 1;
                }
                if out.media == 0 {
                    out.identity = None;
                }
                Ok(RawContent::Parts(out))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

impl Parts {
    /// Adds part `n`.
    fn add(&mut self, n: usize, p: &serde_json::Value) {
        if self.media > 0 && n > 0 {
            self.rendered.push(b'\n');
        }
        match part_text(p) {
            Some(t) => {
                if self.text_parts > 0 {
                    self.text.push('\n');
                }
                self.text.push_str(t);
                self.text_parts += 1;
                if self.media > 0 {
                    self.rendered.extend_from_slice(t.as_bytes());
                }
            }
            None => {
                if self.media == 0 {
                    // The first media part: every part before it is text, so the rendering so
                    // far is the text so far.
                    self.rendered = self.text.as_bytes().to_vec();
                    if n > 0 {
                        self.rendered.push(b'\n');
                    }
                }
                // Media are never rendered: a marker keeps the length honest.
                self.rendered.push(0x1e);
                self.media = self.media.saturating_add(1);
                if !stable_identity(p) {
                    self.identity = None;
                }
            }
        }
        if let Some(h) = &mut self.identity {
            feed_part(h, p);
        }
    }
}

/// The text of a content part vLLM reads as text, `None` for any other part.
fn part_text(p: &serde_json::Value) -> Option<&str> {
    let field = match p.get("type").and_then(|t| t.as_str())? {
        "text" | "input_text" | "output_text" => "text",
        "refusal" => "refusal",
        "thinking" => "thinking",
        _ => return None,
    };
    p.get(field).and_then(|t| t.as_str())
}

/// Whether a media part carries a stable identity: a `uuid` (vLLM's media identifier) or its
/// data inline (same bytes, same media, same placeholder tokens).
fn stable_identity(p: &serde_json::Value) -> bool {
    use serde_json::Value;
    if p.get("uuid").and_then(Value::as_str).is_some_and(|u| !u.is_empty()) {
        return true;
    }
    let url = |field: &str| p.get(field).and_then(|v| v.get("url").and_then(Value::as_str).or(v.as_str()));
    match p.get("type").and_then(Value::as_str) {
        Some(t @ ("image_url" | "audio_url" | "video_url")) => url(t).is_some_and(|u| u.starts_with("data:")),
        Some("input_image") => url("image_url").is_some_and(|u| u.starts_with("data:")),
        Some("input_audio") => {
            p.get("input_audio").and_then(|a| a.get("data")).and_then(Value::as_str).is_some_and(|d| !d.is_empty())
        }
        _ => false,
    }
}

/// Feeds content part `p` to a media message's identity: its JSON (as `serde_json` writes it,
/// without building the string: inline media are large), then 0x1e.
fn feed_part(h: &mut xxhash_rust::xxh3::Xxh3, p: &serde_json::Value) {
    struct Feed<'a>(&'a mut xxhash_rust::xxh3::Xxh3);
    impl std::io::Write for Feed<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.update(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    // Writing a parsed JSON value into a sink that never fails cannot fail.
    let _ = serde_json::to_writer(Feed(h), p);
    h.update(&[0x1e]);
}

/// The identity of a media message: the 128-bit hash of its parts (fed with [`feed_part`]) and
/// the request's media kwargs.
fn media_key(parts: u128, kwargs: [Option<&serde_json::value::RawValue>; 2]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&parts.to_le_bytes());
    for k in kwargs {
        h.update(&[0x1f]);
        if let Some(k) = k {
            h.update(k.get().as_bytes());
        }
    }
    h.digest()
}

/// A chat rendering and what it says about media.
pub(super) struct Rendered {
    pub(super) bytes: Vec<u8>,
    pub(super) limit: Option<KeyLimit>,
    pub(super) media_keys: Vec<MediaKey>,
    pub(super) first_media: Option<ChatMedia>,
    pub(super) media_parts: u32,
}

pub(super) fn render_chat(
    msgs: &RawMessages,
    tools: Option<&serde_json::value::RawValue>,
    media_kwargs: [Option<&serde_json::value::RawValue>; 2],
) -> Rendered {
    // The exact length, so the rendering is allocated once.
    let mut media = msgs.media.iter().peekable();
    let mut len = tools.map_or(0, |t| 8 + t.get().len());
    for (i, m) in msgs.msgs.iter().enumerate() {
        let content = match media.next_if(|x| x.index == i) {
            Some(x) => x.rendered.len(),
            None => m.content.map_or(0, str::len),
        };
        let opt = |f: Option<&str>| f.map_or(0, |f| 1 + f.len());
        len += 3 + m.role.len() + opt(m.name) + content + opt(m.tool_calls) + opt(m.tool_call_id);
    }
    let mut out = Vec::with_capacity(len);
    let (mut limit, mut media_keys, mut first_media, mut media_parts) = (None::<KeyLimit>, Vec::new(), None, 0u32);
    if let Some(t) = tools {
        out.extend_from_slice(b"\x01tools\x02");
        out.extend_from_slice(t.get().as_bytes());
        out.push(0x03);
    }
    let mut media = msgs.media.iter().peekable();
    for (i, m) in msgs.msgs.iter().enumerate() {
        out.push(0x01);
        out.extend_from_slice(m.role.as_bytes());
        if let Some(n) = m.name {
            out.push(0x1f);
            out.extend_from_slice(n.as_bytes());
        }
        out.push(0x02);
        match media.next_if(|x| x.index == i) {
            None => out.extend_from_slice(m.content.unwrap_or("").as_bytes()),
            Some(x) => {
                let content_start = out.len();
                out.extend_from_slice(x.rendered);
                media_parts = media_parts.saturating_add(x.parts);
                let first = first_media.get_or_insert(ChatMedia { message: i, rendered_at: content_start, parts: 0 });
                first.parts = first.parts.saturating_add(x.parts);
                match (&mut limit, x.identity) {
                    (Some(l), _) => l.media_parts = l.media_parts.saturating_add(x.parts),
                    (None, Some(h)) => media_keys.push(MediaKey { at: content_start, key: media_key(h, media_kwargs) }),
                    (None, None) => {
                        limit = Some(KeyLimit {
                            prompt: 0,
                            keyed_len: content_start,
                            message: Some(i),
                            media_parts: x.parts,
                        });
                    }
                }
            }
        }
        if let Some(tc) = m.tool_calls {
            out.push(0x1f);
            out.extend_from_slice(tc.as_bytes());
        }
        if let Some(id) = m.tool_call_id {
            out.push(0x1f);
            out.extend_from_slice(id.as_bytes());
        }
        out.push(0x03);
    }
    Rendered { bytes: out, limit, media_keys, first_media, media_parts }
}

#[cfg(test)]
mod tests {
    use crate::error::RequestError;
    use crate::request::tests::parse;
    use crate::request::{Api, ChatMedia, KeyLimit, Prompt, MEDIA_PART_TOKENS};

    #[test]
    fn chat_messages_and_parts() {
        let a = parse(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"http://x/y.png"}}]}],"max_completion_tokens":7,"max_tokens":99}"#,
            &[],
        )
        .unwrap();
        assert_eq!(a.api, Api::ChatCompletions);
        assert_eq!(a.max_tokens, Some(7), "max_completion_tokens wins");
        let Prompt::Text(bytes) = &a.prompts[0] else { panic!() };
        let s = String::from_utf8_lossy(bytes);
        assert_eq!(s, "\u{1}system\u{2}be brief\u{3}\u{1}user\u{2}hi\n\u{1e}\u{3}");
        let head = "\u{1}system\u{2}be brief\u{3}\u{1}user\u{2}".len();
        assert_eq!(a.key_limit, Some(KeyLimit { prompt: 0, keyed_len: head, message: Some(1), media_parts: 1 }));
        assert_eq!(a.effective_max_tokens(), Some(7));
        assert_eq!(a.input_tokens(4), (s.len() as u64).div_ceil(4) + u64::from(MEDIA_PART_TOKENS));
        assert_eq!(a.unkeyed_tokens(4), (s.len() as u64 - head as u64).div_ceil(4) + u64::from(MEDIA_PART_TOKENS));
        assert_eq!(a.chat.unwrap().messages.get(1).unwrap().content, Some("hi"));
    }

    #[test]
    fn parts_the_router_cannot_key_limit_the_keys() {
        let body = |user: &str| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"S"}},{{"role":"user","content":{user}}},{{"role":"user","content":[{{"type":"input_audio","input_audio":{{"data":"AAAA","format":"wav"}}}}]}}]}}"#
            )
        };
        let a = parse(
            &body(r#"[{"type":"image_url","image_url":{"url":"http://x/a.png"}},{"type":"text","text":"q"}]"#),
            &[],
        )
        .unwrap();
        let b = parse(
            &body(r#"[{"type":"image_url","image_url":{"url":"http://x/b.png"}},{"type":"text","text":"q"}]"#),
            &[],
        )
        .unwrap();
        // Only the marker is rendered, never the part itself, and the limit is the user content.
        assert_eq!(a.prompts, b.prompts);
        let l = a.key_limit.unwrap();
        assert_eq!((l.prompt, l.message, l.media_parts), (0, Some(1), 2));
        let Prompt::Text(bytes) = &a.prompts[0] else { panic!() };
        assert!(bytes[..l.keyed_len].ends_with(b"\x01user\x02"));
        assert!(!bytes.windows(5).any(|w| w == b"a.png"));
        // Text-typed parts vLLM reads as text are keyed like string content, joined with "\n".
        let t = parse(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"input_text","text":"a"},{"type":"text","text":"b"}]}]}"#,
            &[],
        )
        .unwrap();
        let s = parse(r#"{"model":"m","messages":[{"role":"user","content":"a\nb"}]}"#, &[]).unwrap();
        assert_eq!((t.prompts.clone(), t.key_limit), (s.prompts, None));
        assert_eq!(t.chat.unwrap().messages.get(0).unwrap().content, Some("a\nb"));
        // Two text parts are not one: "a","b" renders as "a\nb", not "ab".
        let ab = parse(r#"{"model":"m","messages":[{"role":"user","content":"ab"}]}"#, &[]).unwrap();
        assert_ne!(t.prompts, ab.prompts);
        // prompt_embeds (vLLM completions): the embeddings are sequences the router cannot key.
        let e = parse(r#"{"model":"m","prompt":[1,2,3],"prompt_embeds":["AAAA","BBBB"]}"#, &[]).unwrap();
        assert_eq!(e.key_limit, Some(KeyLimit { prompt: 1, keyed_len: 0, message: None, media_parts: 2 }));
        assert_eq!(e.input_tokens(4), 3 + 2 * u64::from(MEDIA_PART_TOKENS));
        assert_eq!(e.unkeyed_tokens(4), 2 * u64::from(MEDIA_PART_TOKENS));
        let e = parse(r#"{"model":"m","prompt":"x","prompt_embeds":null}"#, &[]).unwrap();
        assert_eq!(e.key_limit, None);
        let e = parse(r#"{"model":"m","prompt":"x","prompt_embeds":"AAAA"}"#, &[]).unwrap();
        assert_eq!(e.key_limit.map(|l| l.media_parts), Some(1));
        let e = parse(r#"{"model":"m","prompt":"x","prompt_embeds":5}"#, &[]).unwrap_err();
        assert!(matches!(&e, RequestError::Field { field, .. } if field == "prompt_embeds"), "{e:?}");
    }

    #[test]
    fn chat_fields_are_read_as_sent() {
        let r = parse(
            r#"{"model":"m","messages":[{"role":"assistant","name":"n","content":null,"tool_calls":[ {"id":"c"} ],"reasoning_content":"r"},{"role":"tool","content":"caf\u00e9 \"q\"","tool_call_id":"c"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"data:x"}},{"type":"refusal","refusal":"b"}]}]}"#,
            &[],
        )
        .unwrap();
        let chat = r.chat.unwrap();
        let m: Vec<_> = chat.messages.iter().collect();
        assert_eq!((m[0].role, m[0].name, m[0].content), ("assistant", Some("n"), None));
        assert_eq!((m[0].tool_calls, m[0].reasoning_content), (Some(r#"[ {"id":"c"} ]"#), Some("r")));
        assert_eq!((m[1].content, m[1].tool_call_id), (Some("café \"q\""), Some("c")));
        assert_eq!(m[2].content, Some("a\nb"), "text parts only");
        let Prompt::Text(bytes) = &r.prompts[0] else { panic!() };
        assert_eq!(
            String::from_utf8_lossy(bytes),
            "\u{1}assistant\u{1f}n\u{2}\u{1f}[ {\"id\":\"c\"} ]\u{3}\u{1}tool\u{2}café \"q\"\u{1f}c\u{3}\u{1}user\u{2}a\n\u{1e}\nb\u{3}"
        );
        assert_eq!(r.media_keys.len(), 1);
        assert_eq!(chat.media.map(|m| (m.message, m.parts)), Some((2, 1)));
    }

    #[test]
    fn chat_rendering_is_append_only() {
        let t1 =
            parse(r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"q1"}]}"#, &[])
                .unwrap();
        let t2 = parse(
            r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"q1"},{"role":"assistant","content":"a1"},{"role":"user","content":"q2"}]}"#,
            &[],
        )
        .unwrap();
        let (Prompt::Text(a), Prompt::Text(b)) = (&t1.prompts[0], &t2.prompts[0]) else { panic!() };
        assert!(b.starts_with(a));
        assert_eq!(t2.effective_max_tokens(), None, "chat without a limit is unbounded");
    }

    #[test]
    fn chat_errors_name_the_field() {
        let e = parse(r#"{"model":"m","messages":[{"role":"user","content":5}]}"#, &[]).unwrap_err();
        assert!(matches!(&e, RequestError::Field { field, .. } if field == "messages[0].content"), "{e:?}");
        let e = parse(r#"{"model":"m","messages":[{"content":"x"}]}"#, &[]).unwrap_err();
        assert!(
            matches!(&e, RequestError::Field { field, message } if field == "messages[0]" && message.contains("role")),
            "{e:?}"
        );
        let e = parse(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}"#, &[]).unwrap_err();
        assert!(matches!(&e, RequestError::Field { field, .. } if field == "messages[0].content"), "{e:?}");
        let e = parse(r#"{"model":"m","messages":[]}"#, &[]).unwrap_err();
        assert_eq!(e, RequestError::field("messages", "must not be empty"));
    }

    #[test]
    fn media_with_a_stable_identity_are_keyed_by_it() {
        let chat = |user: &str, extra: &str| {
            parse(
                &format!(r#"{{"model":"m","messages":[{{"role":"system","content":"S"}},{{"role":"user","content":{user}}},{{"role":"assistant","content":"A"}}]{extra}}}"#),
                &[],
            )
            .unwrap()
        };
        let img = |url: &str, uuid: &str| {
            let uuid = if uuid.is_empty() { String::new() } else { format!(r#","uuid":"{uuid}""#) };
            format!(r#"[{{"type":"text","text":"q"}},{{"type":"image_url","image_url":{{"url":"{url}"}}{uuid}}}]"#)
        };
        let head = "\u{1}system\u{2}S\u{3}\u{1}user\u{2}".len();
        let a = chat(&img("data:image/png;base64,AAAA", ""), "");
        assert_eq!(a.key_limit, None, "inline data is its own identity");
        assert_eq!(a.media_keys.len(), 1);
        assert_eq!(a.media_keys[0].at, head);
        assert_eq!(a.media_parts, 1);
        assert_eq!(a.chat.as_ref().unwrap().media, Some(ChatMedia { message: 1, rendered_at: head, parts: 1 }));
        assert_eq!(a.input_tokens(4), (a.prompts[0].tokens(4)) + u64::from(MEDIA_PART_TOKENS));
        // Same bytes, same key; other bytes, other key; the rendering is the same either way.
        let same = chat(&img("data:image/png;base64,AAAA", ""), "");
        let other = chat(&img("data:image/png;base64,BBBB", ""), "");
        assert_eq!(same.media_keys, a.media_keys);
        assert_ne!(other.media_keys[0].key, a.media_keys[0].key);
        assert_eq!(other.prompts, a.prompts);
        // The request's media kwargs are part of the identity (vLLM hashes them with the media).
        let kw = chat(&img("data:image/png;base64,AAAA", ""), r#","mm_processor_kwargs":{"max_pixels":1000}"#);
        assert_ne!(kw.media_keys[0].key, a.media_keys[0].key);
        let io = chat(&img("data:image/png;base64,AAAA", ""), r#","media_io_kwargs":{"video":{"num_frames":8}}"#);
        assert_ne!(io.media_keys[0].key, a.media_keys[0].key);
        // A uuid is vLLM's identifier for the media, whatever the URL.
        let u = chat(&img("https://example.invalid/a.png", "img-1"), "");
        assert_eq!((u.key_limit, u.media_keys.len()), (None, 1));
        // input_audio carries its data.
        let audio = chat(r#"[{"type":"input_audio","input_audio":{"data":"UklGRg==","format":"wav"}}]"#, "");
        assert_eq!((audio.key_limit, audio.media_keys.len()), (None, 1));
        // One part without an identity makes the whole message unkeyable, and every later one.
        let mixed = chat(
            r#"[{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"image_url","image_url":{"url":"https://x/y.png"}}]"#,
            "",
        );
        assert_eq!(mixed.key_limit, Some(KeyLimit { prompt: 0, keyed_len: head, message: Some(1), media_parts: 2 }));
        assert!(mixed.media_keys.is_empty());
        assert_eq!(mixed.media_parts, 2);
        let empty_uuid = chat(&img("https://example.invalid/a.png", ""), "");
        assert!(empty_uuid.key_limit.is_some());
    }
}

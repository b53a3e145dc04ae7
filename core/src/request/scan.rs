//! A direct reader of the common JSON body: a completions body with a string `prompt`, or a chat
//! body whose messages have string content, with the scalar fields routing reads
//! (`model`, `max_tokens`, `max_completion_tokens`, `cache_salt`, `stream`,
//! `add_generation_prompt`, `continue_final_message`) and any other member ignored.
//!
//! [`parse`] reads such a body without serde: strings are borrowed from the body where they have
//! no escape (serde_json borrows them too, but reaches them through its visitor machinery), and
//! the string scan finds the end of a plain run 16 bytes at a time with `simd128` on wasm32 (the
//! Envoy filter), 8 bytes at a time elsewhere.
//!
//! It accepts a subset of what serde accepts and answers `None` for anything else: a body that is
//! not valid UTF-8, a key with an escape, a member it does not read itself (`tools`,
//! `chat_template_kwargs`, `prompt_embeds`, the media kwargs), a list `prompt`, content parts,
//! `tool_calls`, a lone or unpaired surrogate escape, a value of another type than the field's,
//! a duplicate field, an ignored value nested deeper than [`MAX_DEPTH`], and of course any JSON
//! syntax error. The caller then parses the body with serde, so every error (text, JSON path, line
//! and column) is serde's own. A `Some` is exactly the [`RawBody`] serde gives for the same body:
//! JSON's grammar is checked as strictly as serde_json checks it (strings, escapes, control
//! characters, numbers, literals, whitespace, trailing bytes), and the property test
//! `fast_reader_agrees_with_serde` compares the two on generated and mutated bodies.

use std::borrow::Cow;

use super::body::{RawBody, RawPrompt};
use super::chat::{ChatMessageRef, ChatMessages};
use super::media::RawMessages;
use super::Prompt;

/// Nesting deeper than this inside an ignored value is left to serde (whose own limit is 128).
const MAX_DEPTH: u32 = 32;

/// The body as serde would read it, when it has the common shape (see the module docs); `None`
/// for anything else.
pub(super) fn parse(body: &[u8]) -> Option<RawBody> {
    let text = utf8(body)?;
    let mut s = Scanner { text, b: body, i: 0 };
    s.ws();
    s.eat(b'{')?;
    let mut raw = RawBody {
        model: None,
        prompt: None,
        messages: None,
        max_tokens: None,
        max_completion_tokens: None,
        cache_salt: None,
        stream: None,
        tools: None,
        chat_template_kwargs: None,
        add_generation_prompt: None,
        continue_final_message: None,
        prompt_embeds: None,
        mm_processor_kwargs: None,
        media_io_kwargs: None,
    };
    let mut seen = 0u16;
    s.ws();
    if s.peek() == Some(b'}') {
        s.i += 1;
    } else {
        loop {
            s.ws();
            let key = s.key()?;
            s.ws();
            s.eat(b':')?;
            s.ws();
            let bit = match key {
                b"model" => 1,
                b"prompt" => 2,
                b"messages" => 4,
                b"max_tokens" => 8,
                b"max_completion_tokens" => 16,
                b"cache_salt" => 32,
                b"stream" => 64,
                b"add_generation_prompt" => 128,
                b"continue_final_message" => 256,
                // Fields only serde reads.
                b"tools" | b"chat_template_kwargs" | b"prompt_embeds" | b"mm_processor_kwargs" | b"media_io_kwargs" => {
                    return None
                }
                _ => 0,
            };
            if seen & bit != 0 {
                return None; // serde: "duplicate field"
            }
            seen |= bit;
            match key {
                b"model" => raw.model = s.opt_string()?.map(Cow::into_owned),
                b"prompt" => {
                    raw.prompt = s.opt_string()?.map(|p| RawPrompt(vec![Prompt::Text(p.into_owned().into_bytes())]));
                }
                b"messages" => raw.messages = s.opt_messages()?,
                b"max_tokens" => raw.max_tokens = s.opt_u64()?,
                b"max_completion_tokens" => raw.max_completion_tokens = s.opt_u64()?,
                b"cache_salt" => raw.cache_salt = s.opt_string()?.map(Cow::into_owned),
                b"stream" => raw.stream = s.opt_bool()?,
                b"add_generation_prompt" => raw.add_generation_prompt = s.opt_bool()?,
                b"continue_final_message" => raw.continue_final_message = s.opt_bool()?,
                _ => s.skip_value(0)?,
            }
            s.ws();
            match s.next()? {
                b',' => {}
                b'}' => break,
                _ => return None,
            }
        }
    }
    s.ws();
    (s.i == body.len()).then_some(raw)
}

/// The body as text: validated 16 bytes at a time with `simdutf8` on wasm32 with `simd128` (see
/// `body::parse_body_plain`), by `std` elsewhere.
fn utf8(body: &[u8]) -> Option<&str> {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    return simdutf8::basic::from_utf8(body).ok();
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    return std::str::from_utf8(body).ok();
}

#[inline(always)]
fn word(c: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&c[..8]);
    u64::from_le_bytes(w)
}

/// Whether JSON ends a plain run of string bytes at `c`: `"`, `\` or a control character (which
/// JSON does not allow in a string).
#[inline(always)]
fn special(c: u8) -> bool {
    matches!(c, b'"' | b'\\' | 0..=0x1f)
}

/// The index of the first [`special`] byte at or after `i`, or `b.len()`.
#[inline]
fn run_end(b: &[u8], i: usize) -> usize {
    let rest = b.get(i..).unwrap_or_default();
    i + run_len(rest)
}

/// The length of the plain run `s` starts with.
fn run_len(s: &[u8]) -> usize {
    let mut n = 0;
    // Thirty-two bytes at a time with simd128 (on the wasm runtimes, a few SSE instructions), the
    // sixteen-byte halves tested together. A control character is a byte whose top three bits
    // are zero.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        use core::arch::wasm32::{u64x2, u8x16_bitmask, u8x16_eq, u8x16_splat, v128, v128_and, v128_or};
        let (quote, backslash, top3, zero) = (u8x16_splat(b'"'), u8x16_splat(b'\\'), u8x16_splat(0xe0), u8x16_splat(0));
        let hits =
            |v: v128| v128_or(v128_or(u8x16_eq(v, quote), u8x16_eq(v, backslash)), u8x16_eq(v128_and(v, top3), zero));
        for c in s.chunks_exact(32) {
            let lo = hits(u64x2(word(c), word(&c[8..])));
            let hi = hits(u64x2(word(&c[16..]), word(&c[24..])));
            let bits = u32::from(u8x16_bitmask(lo)) | (u32::from(u8x16_bitmask(hi)) << 16);
            if bits != 0 {
                return n + bits.trailing_zeros() as usize;
            }
            n += 32;
        }
    }
    // Eight bytes at a time: a byte's high bit is set in `hit` when it is special, and the lowest
    // such byte is always exact (borrows only run upwards from a byte that hit).
    const ONES: u64 = u64::MAX / 255;
    for c in s[n..].chunks_exact(8) {
        let w = word(c);
        let ctrl = w.wrapping_sub(ONES * 0x20) & !w;
        let q = w ^ (ONES * u64::from(b'"'));
        let q = q.wrapping_sub(ONES) & !q;
        let bs = w ^ (ONES * u64::from(b'\\'));
        let bs = bs.wrapping_sub(ONES) & !bs;
        let hit = (ctrl | q | bs) & (ONES << 7);
        if hit != 0 {
            return n + (hit.trailing_zeros() / 8) as usize;
        }
        n += 8;
    }
    n + s[n..].iter().position(|&c| special(c)).unwrap_or(s.len() - n)
}

fn hex4(b: &[u8], at: usize) -> Option<u32> {
    let mut n = 0u32;
    for &c in b.get(at..at + 4)? {
        n = (n << 4) | char::from(c).to_digit(16)?;
    }
    Some(n)
}

struct Scanner<'a> {
    /// The body (valid UTF-8), to borrow strings from.
    text: &'a str,
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    #[inline]
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    #[inline]
    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    #[inline]
    fn eat(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    /// JSON whitespace.
    #[inline]
    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            self.i += 1;
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.i.checked_add(word.len())?;
        (self.b.get(self.i..end)? == word).then(|| self.i = end)
    }

    /// An object key without escapes (serde matches field names after decoding them: a key with
    /// an escape is left to it).
    fn key(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let start = self.i;
        let end = run_end(self.b, start);
        if self.b.get(end) != Some(&b'"') {
            return None;
        }
        self.i = end + 1;
        Some(&self.b[start..end])
    }

    /// A string value (at its opening quote), decoded: borrowed from the body when it has no
    /// escape.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        self.eat(b'"')?;
        let start = self.i;
        let end = run_end(self.b, start);
        match *self.b.get(end)? {
            b'"' => {
                self.i = end + 1;
                // Both ends are next to ASCII quotes: char boundaries of the validated text.
                return self.text.get(start..end).map(Cow::Borrowed);
            }
            b'\\' => {}
            _ => return None, // a control character
        }
        let mut out = String::with_capacity(end - start + 16);
        out.push_str(self.text.get(start..end)?);
        self.i = end;
        loop {
            // At a backslash.
            self.i += 1;
            let c = match self.next()? {
                b'"' => '"',
                b'\\' => '\\',
                b'/' => '/',
                b'b' => '\x08',
                b'f' => '\x0c',
                b'n' => '\n',
                b'r' => '\r',
                b't' => '\t',
                b'u' => {
                    let n = hex4(self.b, self.i)?;
                    self.i += 4;
                    match n {
                        0xd800..=0xdbff => {
                            // Only a leading surrogate followed by a trailing one (serde refuses
                            // the other cases).
                            if self.b.get(self.i..self.i + 2)? != b"\\u" {
                                return None;
                            }
                            let n2 = hex4(self.b, self.i + 2)?;
                            if !(0xdc00..=0xdfff).contains(&n2) {
                                return None;
                            }
                            self.i += 6;
                            char::from_u32(0x1_0000 + (((n - 0xd800) << 10) | (n2 - 0xdc00)))?
                        }
                        0xdc00..=0xdfff => return None,
                        _ => char::from_u32(n)?,
                    }
                }
                _ => return None,
            };
            out.push(c);
            let start = self.i;
            let end = run_end(self.b, start);
            out.push_str(self.text.get(start..end)?);
            self.i = end;
            match *self.b.get(end)? {
                b'"' => {
                    self.i = end + 1;
                    return Some(Cow::Owned(out));
                }
                b'\\' => {}
                _ => return None,
            }
        }
    }

    /// A string that is not kept: checked as serde_json checks a string it ignores (escapes
    /// well-formed, `\u` with four hex digits, no control character).
    fn skip_string(&mut self) -> Option<()> {
        self.eat(b'"')?;
        loop {
            let end = run_end(self.b, self.i);
            self.i = end;
            match self.next()? {
                b'"' => return Some(()),
                b'\\' => match self.next()? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                    b'u' => {
                        hex4(self.b, self.i)?;
                        self.i += 4;
                    }
                    _ => return None,
                },
                _ => return None,
            }
        }
    }

    /// `null` or a string.
    fn opt_string(&mut self) -> Option<Option<Cow<'a, str>>> {
        match self.peek()? {
            b'n' => self.literal(b"null").map(|()| None),
            b'"' => self.string().map(Some),
            _ => None,
        }
    }

    /// `null`, `true` or `false`.
    fn opt_bool(&mut self) -> Option<Option<bool>> {
        match self.peek()? {
            b'n' => self.literal(b"null").map(|()| None),
            b't' => self.literal(b"true").map(|()| Some(true)),
            b'f' => self.literal(b"false").map(|()| Some(false)),
            _ => None,
        }
    }

    /// `null` or an integer in `0..=u64::MAX` written plainly (no sign, fraction or exponent: serde
    /// reads those as other types, or as floats past `u64::MAX`). A leading zero ends the number,
    /// and the byte after it is then refused by the caller, as serde refuses it.
    fn opt_u64(&mut self) -> Option<Option<u64>> {
        match self.peek()? {
            b'n' => self.literal(b"null").map(|()| None),
            b'0' => {
                self.i += 1;
                Some(Some(0))
            }
            b'1'..=b'9' => {
                let mut n = 0u64;
                while let Some(d @ b'0'..=b'9') = self.peek() {
                    n = n.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
                    self.i += 1;
                }
                if matches!(self.peek(), Some(b'.' | b'e' | b'E')) {
                    return None;
                }
                Some(Some(n))
            }
            _ => None,
        }
    }

    /// `null` or a list of messages, each an object with a string `role` and optional string
    /// `content`, `name`, `tool_call_id` and `reasoning_content` (other members ignored; content
    /// parts and `tool_calls` are left to serde).
    fn opt_messages(&mut self) -> Option<Option<RawMessages>> {
        match self.peek()? {
            b'n' => return self.literal(b"null").map(|()| None),
            b'[' => self.i += 1,
            _ => return None,
        }
        let mut msgs = ChatMessages::new();
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
        } else {
            loop {
                self.ws();
                self.message(&mut msgs)?;
                self.ws();
                match self.next()? {
                    b',' => {}
                    b']' => break,
                    _ => return None,
                }
            }
        }
        msgs.shrink_to_fit();
        Some(Some(RawMessages::text_only(msgs)))
    }

    fn message(&mut self, msgs: &mut ChatMessages) -> Option<()> {
        self.eat(b'{')?;
        let (mut role, mut content, mut name, mut tool_call_id, mut reasoning) = (None, None, None, None, None);
        let mut seen = 0u8;
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
        } else {
            loop {
                self.ws();
                let key = self.key()?;
                self.ws();
                self.eat(b':')?;
                self.ws();
                let bit = match key {
                    b"role" => 1,
                    b"content" => 2,
                    b"name" => 4,
                    b"tool_call_id" => 8,
                    b"reasoning_content" => 16,
                    b"tool_calls" => return None,
                    _ => 0,
                };
                if seen & bit != 0 {
                    return None;
                }
                seen |= bit;
                match key {
                    // A role is a string (`null` is refused).
                    b"role" => role = Some(self.string()?),
                    b"content" => content = self.opt_string()?,
                    b"name" => name = self.opt_string()?,
                    b"tool_call_id" => tool_call_id = self.opt_string()?,
                    b"reasoning_content" => reasoning = self.opt_string()?,
                    _ => self.skip_value(1)?,
                }
                self.ws();
                match self.next()? {
                    b',' => {}
                    b'}' => break,
                    _ => return None,
                }
            }
        }
        msgs.push(ChatMessageRef {
            role: role.as_deref()?,
            content: content.as_deref(),
            name: name.as_deref(),
            tool_calls: None,
            tool_call_id: tool_call_id.as_deref(),
            reasoning_content: reasoning.as_deref(),
        });
        Some(())
    }

    /// Any JSON value, checked and ignored; `depth`: the arrays and objects around it below the
    /// body.
    fn skip_value(&mut self, depth: u32) -> Option<()> {
        match self.peek()? {
            b'"' => self.skip_string(),
            b'n' => self.literal(b"null"),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'-' | b'0'..=b'9' => self.skip_number(),
            open @ (b'[' | b'{') => {
                if depth >= MAX_DEPTH {
                    return None;
                }
                self.i += 1;
                let close = if open == b'[' { b']' } else { b'}' };
                self.ws();
                if self.peek() == Some(close) {
                    self.i += 1;
                    return Some(());
                }
                loop {
                    self.ws();
                    if open == b'{' {
                        self.skip_string()?;
                        self.ws();
                        self.eat(b':')?;
                        self.ws();
                    }
                    self.skip_value(depth + 1)?;
                    self.ws();
                    match self.next()? {
                        b',' => {}
                        c if c == close => return Some(()),
                        _ => return None,
                    }
                }
            }
            _ => None,
        }
    }

    /// A number by JSON's grammar: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
    fn skip_number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            self.some_digits()?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            self.some_digits()?;
        }
        Some(())
    }

    fn digits(&mut self) {
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.i += 1;
        }
    }

    fn some_digits(&mut self) -> Option<()> {
        let start = self.i;
        self.digits();
        (self.i > start).then_some(())
    }
}

/// Shared with the token-id reader's property tests (`core/tests/token_ids.rs`).
#[cfg(test)]
#[path = "../../tests/json_mutation/mod.rs"]
mod json_mutation;

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use crate::config::RequestConfig;
    use crate::error::RequestError;
    use crate::request::{body, RouteRequest};

    /// What the reader gives for `body` (`None`: it declined), and that it is what serde gives:
    /// the same request from the same body, with the same headers and configuration.
    fn check(body: &[u8]) -> Option<Result<RouteRequest, RequestError>> {
        let headers = [("x-session-id", "s")];
        let cfg = RequestConfig::default();
        let fast = RouteRequest::parse_direct_reader(body, headers, &cfg)?;
        let serde = body::parse_body_plain(body);
        assert!(serde.is_some(), "the reader took a body serde refuses: {:?}", String::from_utf8_lossy(body));
        let slow = RouteRequest::parse_serde_only(body, headers, &cfg);
        assert_eq!(fast, slow, "body: {:?}", String::from_utf8_lossy(body));
        Some(fast)
    }

    #[test]
    fn reads_the_common_bodies() {
        let r = check(br#"{"model":"m","prompt":"hello world","max_tokens":5,"stream":true,"cache_salt":"t"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(r.prompts, vec![crate::request::Prompt::Text(b"hello world".to_vec())]);
        assert_eq!((r.max_tokens, r.stream, r.cache_salt.as_deref()), (Some(5), true, Some("t")));
        let r = check(
            br#" {"model" : "m", "messages" : [ {"role":"system","content":"be \"brief\"\n"}, {"role":"user","content":"caf\u00e9 \ud83d\ude00 \/ \\ \b\f\r\t", "name":"x"}, {"role":"assistant","content":null,"reasoning_content":"r","tool_call_id":"t"} ], "max_completion_tokens":18446744073709551615, "user":{"a":[1,-2.5e-3,true,false,null,"\u0000"]}} "#,
        )
        .unwrap()
        .unwrap();
        let chat = r.chat.as_ref().unwrap();
        let msgs: Vec<_> = chat.messages.iter().collect();
        assert_eq!(msgs.len(), 3);
        assert_eq!(msgs[0].content, Some("be \"brief\"\n"));
        assert_eq!(msgs[1].content, Some("café 😀 / \\ \x08\x0c\r\t"));
        assert_eq!((msgs[1].name, msgs[2].content, msgs[2].reasoning_content), (Some("x"), None, Some("r")));
        assert_eq!(r.max_tokens, Some(u32::MAX));
        // Ignored numbers are checked by their syntax alone, as serde_json ignores them.
        let big = br#"{"model":"m","prompt":"x","a":1e400,"b":-1e-400,"c":123456789012345678901234567890,"d":[0.0000000000000000000000000001e-99999]}"#;
        assert!(check(big).unwrap().is_ok());
        assert!(check(br#"{}"#).unwrap().is_err());
        assert!(check(br#"{"model":null,"prompt":null,"messages":null,"stream":null,"max_tokens":null}"#).is_some());
        assert!(check(br#"{"model":"m","messages":[]}"#).unwrap().is_err());
    }

    #[test]
    fn declines_what_it_does_not_read_or_serde_refuses() {
        for body in [
            // Left to serde: it reads these itself.
            r#"{"model":"m","prompt":["a","b"]}"#,
            r#"{"model":"m","prompt":[1,2]}"#,
            r#"{"model":"m","prompt":"x","tools":[]}"#,
            r#"{"model":"m","prompt":"x","chat_template_kwargs":{}}"#,
            r#"{"model":"m","prompt":"x","prompt_embeds":"AAAA"}"#,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
            r#"{"model":"m","messages":[{"role":"assistant","tool_calls":[]}]}"#,
            r#"{"m\u006fdel":"m","prompt":"x"}"#,
            r#"{"model":"m","prompt":"x","user":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}"#,
            // Refused by serde.
            r#"{"model":"m","prompt":"x","model":"n"}"#,
            r#"{"model":"m","messages":[{"role":"user","role":"user"}]}"#,
            r#"{"model":"m","messages":[{"content":"x"}]}"#,
            r#"{"model":"m","messages":[{"role":null}]}"#,
            r#"{"model":"m","messages":[["user"]]}"#,
            r#"{"model":"m","messages":[{"role":"u"},]}"#,
            r#"{"model":"m","prompt":"\ud800"}"#,
            r#"{"model":"m","prompt":"\udc00"}"#,
            r#"{"model":"m","prompt":"\ud800\u0041"}"#,
            r#"{"model":"m","prompt":"\ud800x"}"#,
            r#"{"model":"m","prompt":"\x"}"#,
            r#"{"model":"m","prompt":"\u12g4"}"#,
            r#"{"model":"m","prompt":"x","max_tokens":-1}"#,
            r#"{"model":"m","prompt":"x","max_tokens":1.0}"#,
            r#"{"model":"m","prompt":"x","max_tokens":1e3}"#,
            r#"{"model":"m","prompt":"x","max_tokens":01}"#,
            r#"{"model":"m","prompt":"x","max_tokens":18446744073709551616}"#,
            r#"{"model":"m","prompt":"x","max_tokens":"5"}"#,
            r#"{"model":"m","prompt":"x","stream":1}"#,
            r#"{"model":"m","prompt":"x","user":01}"#,
            r#"{"model":"m","prompt":"x","user":1.}"#,
            r#"{"model":"m","prompt":"x","user":.5}"#,
            r#"{"model":"m","prompt":"x","user":1e}"#,
            r#"{"model":"m","prompt":"x","user":-}"#,
            r#"{"model":"m","prompt":"x","user":tru}"#,
            r#"{"model":"m","prompt":"x","user":"\q"}"#,
            r#"{"model":"m","prompt":"x","user":{"a"}}"#,
            r#"{"model":"m","prompt":"x","user":{1:2}}"#,
            r#"{"model":"m","prompt":"x",}"#,
            r#"{"model":"m","prompt":"x"} x"#,
            r#"{"model":"m","prompt":"x""#,
            r#"{"model":"m","prompt":"x"#,
            r#"["m","x"]"#,
            "{\"model\":\"m\",\"prompt\":\"tab\tinside\"}",
            "{\"model\":\"m\",\"prompt\":\"x\"}\u{0}",
            "\u{feff}{\"model\":\"m\",\"prompt\":\"x\"}",
        ] {
            assert!(super::parse(body.as_bytes()).is_none(), "{body}");
        }
        assert!(super::parse(b"{\"model\":\"m\xff\",\"prompt\":\"x\"}").is_none());
    }

    /// The plain-run scan at every offset around its 16- and 8-byte steps.
    #[test]
    fn run_end_finds_the_first_special_byte() {
        for len in 0..40 {
            for special in [b'"', b'\\', 0u8, 0x1f] {
                for at in 0..=len {
                    let mut b: Vec<u8> = (0..len).map(|i| b"a \x7f\xc3\xa9~!#"[i % 8]).collect();
                    if at < len {
                        b[at] = special;
                    }
                    assert_eq!(super::run_end(&b, 0), at, "{len} {special} {at}");
                    assert_eq!(super::run_end(&b, at.min(len)), at);
                }
            }
        }
    }

    /// JSON text for a string: plain runs and every kind of escape, some of them invalid.
    fn string() -> impl Strategy<Value = String> {
        let atom = prop_oneof![
            8 => "[a-z ]{0,40}",
            2 => Just("é日😀".to_owned()),
            1 => Just(r#"\""#.to_owned()),
            1 => Just(r"\\".to_owned()),
            1 => Just(r"\n\t\r\b\f\/".to_owned()),
            1 => Just(r"\u00e9\u0041\u65e5".to_owned()),
            1 => Just(r"\ud83d\ude00".to_owned()),
            1 => Just(r"\uD83D\uDE00".to_owned()),
            1 => Just("[]{},:".to_owned()),
            // Refused by serde when decoded (a lone or unpaired surrogate, a bad escape, a raw
            // control character).
            1 => prop_oneof![
                Just(r"\ud800".to_owned()),
                Just(r"\udc00".to_owned()),
                Just(r"\ud800\u0041".to_owned()),
                Just(r"\q".to_owned()),
                Just(r"\u12".to_owned()),
                Just("\t".to_owned()),
                Just("\u{1}".to_owned()),
            ],
        ];
        prop::collection::vec(atom, 0..6).prop_map(|v| format!("\"{}\"", v.concat()))
    }

    fn number() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => (0u64..100_000).prop_map(|n| n.to_string()),
            1 => any::<u64>().prop_map(|n| n.to_string()),
            1 => prop_oneof![
                Just("0".to_owned()),
                Just("-0".to_owned()),
                Just("-7".to_owned()),
                Just("1.5".to_owned()),
                Just("2e3".to_owned()),
                Just("2E-3".to_owned()),
                Just("-0.5e+7".to_owned()),
                Just("18446744073709551616".to_owned()),
                Just("007".to_owned()),
                Just("1.".to_owned()),
                Just("1e".to_owned()),
            ],
        ]
    }

    /// Any JSON value (ignored members), a few levels deep.
    fn value() -> impl Strategy<Value = String> {
        let leaf =
            prop_oneof![string(), number(), Just("true".to_owned()), Just("false".to_owned()), Just("null".to_owned())];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec((string(), inner), 0..4).prop_map(|v| {
                    let m: Vec<String> = v.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
                    format!("{{{}}}", m.join(","))
                }),
            ]
        })
    }

    fn ws() -> impl Strategy<Value = &'static str> {
        prop_oneof![4 => Just(""), 2 => Just(" "), 1 => Just("\n  "), 1 => Just("\t"), 1 => Just("\r\n")]
    }

    /// An object of members from `members`, in any order, whitespace anywhere.
    fn object(members: Vec<(String, String)>, ws: Vec<&'static str>) -> String {
        let w = |i: usize| ws[i % ws.len().max(1)];
        let m: Vec<String> = members
            .iter()
            .enumerate()
            .map(|(i, (k, v))| format!("{}{k}{}:{}{v}{}", w(i), w(i + 1), w(i + 2), w(i + 3)))
            .collect();
        format!("{{{}}}", m.join(","))
    }

    fn message() -> impl Strategy<Value = String> {
        let member = prop_oneof![
            8 => string().prop_map(|s| ("\"content\"".to_owned(), s)),
            1 => Just(("\"content\"".to_owned(), "null".to_owned())),
            1 => string().prop_map(|s| ("\"name\"".to_owned(), s)),
            1 => string().prop_map(|s| ("\"tool_call_id\"".to_owned(), s)),
            1 => string().prop_map(|s| ("\"reasoning_content\"".to_owned(), s)),
            1 => value().prop_map(|v| ("\"metadata\"".to_owned(), v)),
            1 => value().prop_map(|v| ("\"content\"".to_owned(), v)),
            1 => value().prop_map(|v| ("\"role\"".to_owned(), v)),
        ];
        let role = prop_oneof![Just("\"user\""), Just("\"system\""), Just("\"assistant\"")];
        (role, prop::collection::vec(member, 0..3), any::<bool>(), prop::collection::vec(ws(), 1..4)).prop_map(
            |(role, mut members, with_role, ws)| {
                if with_role {
                    members.insert(0, ("\"role\"".to_owned(), role.to_owned()));
                }
                object(members, ws)
            },
        )
    }

    /// A body: the fields routing reads (well formed or not), ignored members, in any order.
    fn body() -> impl Strategy<Value = Vec<u8>> {
        let messages = prop_oneof![
            6 => prop::collection::vec(message(), 0..4).prop_map(|v| format!("[{}]", v.join(", "))),
            1 => value(),
        ];
        let member = prop_oneof![
            2 => string().prop_map(|s| ("\"model\"".to_owned(), s)),
            4 => string().prop_map(|s| ("\"prompt\"".to_owned(), s)),
            4 => messages.prop_map(|m| ("\"messages\"".to_owned(), m)),
            2 => number().prop_map(|n| ("\"max_tokens\"".to_owned(), n)),
            1 => number().prop_map(|n| ("\"max_completion_tokens\"".to_owned(), n)),
            1 => string().prop_map(|s| ("\"cache_salt\"".to_owned(), s)),
            1 => prop_oneof![Just("true"), Just("false"), Just("null"), Just("1")]
                .prop_map(|b| ("\"stream\"".to_owned(), b.to_owned())),
            1 => prop_oneof![Just("true"), Just("false")].prop_map(|b| ("\"add_generation_prompt\"".to_owned(), b.to_owned())),
            1 => prop_oneof![Just("true"), Just("null")].prop_map(|b| ("\"continue_final_message\"".to_owned(), b.to_owned())),
            2 => value().prop_map(|v| ("\"temperature\"".to_owned(), v)),
            1 => value().prop_map(|v| ("\"user\"".to_owned(), v)),
            1 => value().prop_map(|v| ("\"model\"".to_owned(), v)),
            1 => value().prop_map(|v| ("\"prompt\"".to_owned(), v)),
            1 => value().prop_map(|v| ("\"tools\"".to_owned(), v)),
            1 => string().prop_map(|s| ("\"m\\u006fdel\"".to_owned(), s)),
        ];
        (string(), prop::collection::vec(member, 0..5), prop::collection::vec(ws(), 1..5), ws()).prop_map(
            |(model, mut members, ws, outer)| {
                members.insert(0, ("\"model\"".to_owned(), model));
                format!("{outer}{}{outer}", object(members, ws)).into_bytes()
            },
        )
    }

    /// JSON's significant bytes and a few others, for the mutations.
    const MUTATION_BYTES: &[u8] = b"-+.eE0123456789,[]{}\" \n\\:unx\x00\x1f\xff";

    fn mutate(b: Vec<u8>, muts: Vec<(usize, u8, u8)>) -> Vec<u8> {
        super::json_mutation::mutate(b, muts, MUTATION_BYTES)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        /// Whatever the reader takes, serde takes and reads the same; it takes most of the bodies
        /// whose strings and fields are well formed.
        #[test]
        fn fast_reader_agrees_with_serde(b in body()) {
            let _ = check(&b);
        }

        #[test]
        fn fast_reader_agrees_with_serde_on_mutated_bodies(
            b in body(),
            muts in prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..4),
        ) {
            let _ = check(&mutate(b, muts));
        }
    }

    /// The generated bodies exercise both answers: the reader takes many and declines many.
    #[test]
    fn generated_bodies_are_taken_and_declined() {
        use proptest::strategy::ValueTree;
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let (mut taken, mut declined) = (0, 0);
        for _ in 0..2000 {
            let b = body().new_tree(&mut runner).unwrap().current();
            match check(&b) {
                Some(_) => taken += 1,
                None => declined += 1,
            }
        }
        assert!(taken > 200 && declined > 200, "taken {taken}, declined {declined}");
    }
}

//! The JSON body: the fields routing reads ([`RawBody`]), parsed on a fast path and again with
//! path tracking only when that fails (so errors name the field), and the forms of `prompt` and
//! `prompt_embeds`. `messages` is read by `RawMessages`.

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use crate::error::RequestError;

use super::media::RawMessages;
use super::Prompt;

#[derive(Deserialize)]
pub(super) struct RawBody {
    pub(super) model: Option<String>,
    pub(super) prompt: Option<RawPrompt>,
    pub(super) messages: Option<RawMessages>,
    pub(super) max_tokens: Option<u64>,
    pub(super) max_completion_tokens: Option<u64>,
    pub(super) cache_salt: Option<String>,
    pub(super) stream: Option<bool>,
    pub(super) tools: Option<Box<serde_json::value::RawValue>>,
    pub(super) chat_template_kwargs: Option<std::collections::BTreeMap<String, Box<serde_json::value::RawValue>>>,
    pub(super) add_generation_prompt: Option<bool>,
    pub(super) continue_final_message: Option<bool>,
    pub(super) prompt_embeds: Option<PromptEmbeds>,
    pub(super) mm_processor_kwargs: Option<Box<serde_json::value::RawValue>>,
    pub(super) media_io_kwargs: Option<Box<serde_json::value::RawValue>>,
}

/// vLLM's `prompt_embeds`: one base64 tensor or a list of them (only their number matters).
pub(super) struct PromptEmbeds(u32);

impl PromptEmbeds {
    pub(super) fn count(&self) -> u32 {
        self.0
    }
}

impl<'de> Deserialize<'de> for PromptEmbeds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptEmbeds;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a base64 string or a list of them")
            }
            fn visit_unit<E: de::Error>(self) -> Result<PromptEmbeds, E> {
                Ok(PromptEmbeds(0))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<PromptEmbeds, E> {
                Ok(PromptEmbeds(1))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptEmbeds, A::Error> {
                let mut n = 0u32;
                while seq.next_element::<de::IgnoredAny>()?.is_some() {
                    n = n.saturating_add(1);
                }
                Ok(PromptEmbeds(n))
            }
        }
        d.deserialize_any(V)
    }
}

/// Deserializes `T` only from a JSON object: serde's derived structs also accept arrays of
/// field values, which an OpenAI body never is.
pub(super) struct ObjectOnly<T>(pub(super) T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for ObjectOnly<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = ObjectOnly<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<ObjectOnly<T>, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(ObjectOnly)
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// The body: the direct reader ([`super::scan`]) when it has the common shape (a string prompt,
/// or messages with string content), the token-id fast path ([`super::token_ids`]) when the
/// prompt is a plain token-id list, else serde alone ([`parse_body_serde`]), which also gives
/// every error.
pub(super) fn parse_body(body: &[u8]) -> Result<RawBody, RequestError> {
    #[cfg(target_arch = "wasm32")]
    if let Some(raw) = super::scan::parse(body) {
        return Ok(raw);
    }
    match super::token_ids::parse_fast(body) {
        Some(raw) => Ok(raw),
        None => parse_body_serde(body),
    }
}

/// Plain serde_json, no path tracking: `None` when the body is not valid.
///
/// On wasm32 with `simd128` the body's UTF-8 is validated once, 16 bytes at a time
/// (`simdutf8`), and serde_json reads it as a `&str`; otherwise serde_json validates each string
/// with `std`'s `from_utf8`, which on wasm32 checks 4 bytes at a time (5% of the Envoy filter's
/// time per request). For valid UTF-8 both readers give the same result (serde_json's `str`
/// reader is its slice reader without the per-string check; `str_and_slice_readers_agree`); a
/// body that is not valid UTF-8 takes the slice reader, as everywhere else.
pub(super) fn parse_body_plain(body: &[u8]) -> Option<RawBody> {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    if let Ok(text) = simdutf8::basic::from_utf8(body) {
        return parse_plain(serde_json::Deserializer::from_str(text));
    }
    parse_plain(serde_json::Deserializer::from_slice(body))
}

/// [`parse_body_plain`] with either of serde_json's readers.
fn parse_plain<'de, R: serde_json::de::Read<'de>>(mut de: serde_json::Deserializer<R>) -> Option<RawBody> {
    let ObjectOnly(raw) = ObjectOnly::<RawBody>::deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(raw)
}

/// The body read by serde alone (the reference the token-id fast path must agree with).
pub(super) fn parse_body_serde(body: &[u8]) -> Result<RawBody, RequestError> {
    // Fast path: plain serde_json. Only a body that fails is parsed again with path tracking,
    // so errors still name the field and valid bodies do not pay for it.
    if let Some(raw) = parse_body_plain(body) {
        return Ok(raw);
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let raw: RawBody = match serde_path_to_error::deserialize(&mut de) {
        Ok(ObjectOnly(raw)) => raw,
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            return Err(json_error(path, inner));
        }
    };
    de.end().map_err(|e| json_error(".".into(), e))?;
    Ok(raw)
}

fn json_error(path: String, e: serde_json::Error) -> RequestError {
    use serde_json::error::Category;
    match e.classify() {
        Category::Data => {
            let field = if path == "." { "body".to_owned() } else { path };
            // serde_json appends " at line L column C"; the path already says where.
            let msg = e.to_string();
            let msg = msg.split(" at line ").next().unwrap_or(&msg).to_owned();
            RequestError::Field { field, message: msg }
        }
        Category::Syntax | Category::Eof | Category::Io => {
            let msg = e.to_string();
            let msg = msg.split(" at line ").next().unwrap_or(&msg).to_owned();
            RequestError::Json { line: e.line(), column: e.column(), message: msg }
        }
    }
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of token-id lists.
pub(super) struct RawPrompt(pub(super) Vec<Prompt>);

impl<'de> Deserialize<'de> for RawPrompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawPrompt;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a list of strings, a list of token ids or a list of token-id lists")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawPrompt, E> {
                Ok(RawPrompt(vec![Prompt::Text(v.as_bytes().to_vec())]))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<RawPrompt, E> {
                Ok(RawPrompt(vec![Prompt::Text(v.into_bytes())]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawPrompt, A::Error> {
                let mut texts: Vec<Prompt> = Vec::new();
                let mut tokens: Vec<u32> = Vec::new();
                let mut kind: Option<u8> = None; // 0 = strings, 1 = ids, 2 = id lists
                                                 // A token-id list (the common large case) is read id by id without the
                                                 // element enum once its first element shows what it is.
                if let Some(first) = seq.next_element::<PromptElem>()? {
                    match first {
                        PromptElem::Id(t) => {
                            tokens.reserve(seq.size_hint().unwrap_or(0).min(1 << 20));
                            tokens.push(t);
                            while let Some(IdInList(t)) = seq.next_element::<IdInList>()? {
                                tokens.push(t);
                            }
                            return Ok(RawPrompt(vec![Prompt::Tokens(tokens)]));
                        }
                        PromptElem::Text(s) => {
                            kind = Some(0);
                            texts.push(Prompt::Text(s.into_bytes()));
                        }
                        PromptElem::Ids(ids) => {
                            kind = Some(2);
                            texts.push(Prompt::Tokens(ids));
                        }
                    }
                }
                while let Some(el) = seq.next_element::<PromptElem>()? {
                    let k = match &el {
                        PromptElem::Text(_) => 0,
                        PromptElem::Id(_) => 1,
                        PromptElem::Ids(_) => 2,
                    };
                    if *kind.get_or_insert(k) != k {
                        return Err(de::Error::custom(MIXED));
                    }
                    match el {
                        PromptElem::Text(s) => texts.push(Prompt::Text(s.into_bytes())),
                        PromptElem::Id(t) => tokens.push(t),
                        PromptElem::Ids(ids) => texts.push(Prompt::Tokens(ids)),
                    }
                }
                match kind {
                    None => Err(de::Error::custom("must not be an empty list")),
                    Some(1) => Ok(RawPrompt(vec![Prompt::Tokens(tokens)])),
                    Some(_) => Ok(RawPrompt(texts)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

enum PromptElem {
    Text(String),
    Id(u32),
    Ids(Vec<u32>),
}

fn token_id<E: de::Error>(v: u64) -> Result<u32, E> {
    u32::try_from(v).map_err(|_| E::custom(format!("token id {v} is out of range (0..=4294967295)")))
}

impl<'de> Deserialize<'de> for PromptElem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptElem;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a token id or a list of token ids")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptElem, E> {
                Ok(PromptElem::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<PromptElem, E> {
                Ok(PromptElem::Text(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<PromptElem, E> {
                token_id(v).map(PromptElem::Id)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<PromptElem, E> {
                Err(E::custom(format!("token id {v} is negative")))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptElem, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(TokenId(t)) = seq.next_element()? {
                    ids.push(t);
                }
                Ok(PromptElem::Ids(ids))
            }
        }
        d.deserialize_any(V)
    }
}

/// A token id inside a list of token ids: anything else is the "mixed element types" error.
struct IdInList(u32);

impl<'de> Deserialize<'de> for IdInList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'v> Visitor<'v> for V {
            type Value = IdInList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id (integer 0..=4294967295)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<IdInList, E> {
                token_id(v).map(IdInList)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<IdInList, E> {
                Err(E::custom(format!("token id {v} is negative")))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<IdInList, E> {
                Err(E::custom(MIXED))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<IdInList, E> {
                Err(E::custom(format!("token id {v} is not an integer")))
            }
            fn visit_seq<A: SeqAccess<'v>>(self, _: A) -> Result<IdInList, A::Error> {
                Err(de::Error::custom(MIXED))
            }
        }
        d.deserialize_any(V)
    }
}

const MIXED: &str = "mixed element types: use all strings, all token ids, or all token-id lists";

struct TokenId(u32);

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = TokenId;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id (integer 0..=4294967295)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<TokenId, E> {
                token_id(v).map(TokenId)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<TokenId, E> {
                Err(E::custom(format!("token id {v} is negative")))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::RequestConfig;
    use crate::error::RequestError;
    use crate::request::tests::parse;
    use crate::request::{Prompt, RouteRequest};

    #[test]
    fn completions_prompt_forms() {
        let r = parse(r#"{"model":"m","prompt":["a","bc"]}"#, &[]).unwrap();
        assert_eq!(r.prompts, vec![Prompt::Text(b"a".to_vec()), Prompt::Text(b"bc".to_vec())]);
        let r = parse(r#"{"model":"m","prompt":[1,2,4294967295]}"#, &[]).unwrap();
        assert_eq!(r.prompts, vec![Prompt::Tokens(vec![1, 2, u32::MAX])]);
        let r = parse(r#"{"model":"m","prompt":[[1,2],[3]]}"#, &[]).unwrap();
        assert_eq!(r.prompts, vec![Prompt::Tokens(vec![1, 2]), Prompt::Tokens(vec![3])]);
        assert_eq!(r.input_tokens(4), 3);
        assert_eq!(r.effective_max_tokens(), Some(16));
    }

    #[test]
    fn bad_prompts_name_the_element() {
        let e = parse(r#"{"model":"m","prompt":[1,-2]}"#, &[]).unwrap_err();
        assert!(
            matches!(&e, RequestError::Field { field, message } if field == "prompt[1]" && message.contains("negative")),
            "{e:?}"
        );
        let e = parse(r#"{"model":"m","prompt":[1,"x"]}"#, &[]).unwrap_err();
        assert!(
            matches!(&e, RequestError::Field { field, message } if field.starts_with("prompt") && message.contains("mixed")),
            "{e:?}"
        );
        let e = parse(r#"{"model":"m","prompt":[[1,5000000000]]}"#, &[]).unwrap_err();
        assert!(
            matches!(&e, RequestError::Field { field, message } if field == "prompt[0][1]" && message.contains("out of range")),
            "{e:?}"
        );
        let e = parse(r#"{"model":"m","prompt":[]}"#, &[]).unwrap_err();
        assert!(matches!(&e, RequestError::Field { field, .. } if field == "prompt"), "{e:?}");
        let e = parse(r#"{"model":"m","prompt":{"a":1}}"#, &[]).unwrap_err();
        assert!(matches!(&e, RequestError::Field { field, .. } if field == "prompt"), "{e:?}");
    }

    /// serde_json's `str` reader (the body's path on wasm32 with simd128) and its slice reader
    /// give the same request from the same body, and refuse the same bodies.
    #[test]
    fn str_and_slice_readers_agree() {
        fn refused() -> RequestError {
            RequestError::field("body", "refused")
        }
        fn via_str(body: &[u8]) -> Result<super::RawBody, RequestError> {
            let text = std::str::from_utf8(body).map_err(|_| refused())?;
            super::parse_plain(serde_json::Deserializer::from_str(text)).ok_or_else(refused)
        }
        fn via_slice(body: &[u8]) -> Result<super::RawBody, RequestError> {
            super::parse_plain(serde_json::Deserializer::from_slice(body)).ok_or_else(refused)
        }
        let bodies = [
            r#"{"model":"m","prompt":"hello world","max_tokens":5,"stream":true,"cache_salt":"t"}"#,
            r#"{"model":"m","prompt":"caf\u00e9 \ud83d\ude00 \"q\" \\ \n é 日本 😀"}"#,
            r#"{"model":"m","prompt":["a","bc"]}"#,
            r#"{"model":"m","prompt":[[1,2],[3]]}"#,
            r#"{"model":"m","prompt":"x","prompt_embeds":["AAAA","BBBB"]}"#,
            r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:x"}}]}],"tools":[{"type":"function","function":{"name":"f","parameters":{"a":[1,2.5e3,null]}}}],"chat_template_kwargs":{"k":{"v":true}},"add_generation_prompt":false}"#,
            r#"{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]}]}"#,
            "{\"model\":\"m\",\"prompt\":\"tab\tinside\"}",
            r#"{"model":"m","prompt":"\ud800"}"#,
            r#"{"model":"m","prompt":"x","model":"n"}"#,
            r#"{"model":"m","prompt":"x"} trailing"#,
            r#"{"model":"m","prompt":"x","max_tokens":1e3}"#,
            r#"["m","x"]"#,
            r#"{"model":"m","prompt":"unterminated"#,
        ];
        let cfg = RequestConfig::default();
        let mut accepted = 0;
        for body in bodies {
            let headers: [(&str, &str); 0] = [];
            let a = RouteRequest::parse_with(body.as_bytes(), headers, &cfg, via_str);
            let b = RouteRequest::parse_with(body.as_bytes(), headers, &cfg, via_slice);
            assert_eq!(a, b, "{body}");
            accepted += usize::from(a.is_ok());
        }
        assert_eq!(accepted, 7);
    }

    #[test]
    fn body_level_errors() {
        assert_eq!(parse("", &[]).unwrap_err(), RequestError::EmptyBody);
        assert!(matches!(parse("{\"model\":", &[]).unwrap_err(), RequestError::Json { line: 1, .. }));
        assert!(matches!(parse("[1,2]", &[]).unwrap_err(), RequestError::Field { field, .. } if field == "body"));
        assert!(matches!(parse("{} {}", &[]).unwrap_err(), RequestError::Json { .. }));
        assert_eq!(parse(r#"{"prompt":"x"}"#, &[]).unwrap_err(), RequestError::field("model", "missing"));
        assert!(
            matches!(parse(r#"{"model":3,"prompt":"x"}"#, &[]).unwrap_err(), RequestError::Field { field, .. } if field == "model")
        );
        assert!(
            matches!(parse(r#"{"model":"m","prompt":"x","max_tokens":-1}"#, &[]).unwrap_err(), RequestError::Field { field, .. } if field == "max_tokens")
        );
        assert!(
            matches!(parse(r#"{"model":"m","prompt":"x","messages":[]}"#, &[]).unwrap_err(), RequestError::Field { field, .. } if field == "messages")
        );
        assert!(
            matches!(parse(r#"{"model":"m"}"#, &[]).unwrap_err(), RequestError::Field { field, .. } if field == "prompt")
        );
        let cfg = RequestConfig { max_body_bytes: 10, ..RequestConfig::default() };
        let e = RouteRequest::parse(br#"{"model":"m","prompt":"x"}"#, [("a", "b")], &cfg).unwrap_err();
        assert_eq!(e, RequestError::BodyTooLarge { size: 26, limit: 10 });
        assert!(matches!(parse("\u{0}\u{1}garbage", &[]).unwrap_err(), RequestError::Json { .. }));
    }
}

//! The token-id fast path of the JSON body against the serde-only path: for token-id bodies,
//! their mutations and near misses, `RouteRequest::parse` must give exactly what
//! `RouteRequest::parse_serde_only` gives (the same request, or the same error with the same
//! text, path, line and column).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod json_mutation;

use kvroute::{Prompt, RequestConfig, RouteRequest};
use proptest::prelude::*;

fn check(body: &[u8]) {
    let cfg = RequestConfig::default();
    let headers = [("x-session-id", "s")];
    let fast = RouteRequest::parse(body, headers, &cfg);
    let serde = RouteRequest::parse_serde_only(body, headers, &cfg);
    assert_eq!(fast, serde, "body: {:?}", String::from_utf8_lossy(body));
}

#[test]
fn fast_path_reads_token_ids() {
    let r =
        RouteRequest::parse(br#"{"model":"m","prompt":[1, 2,3 ,4294967295]}"#, [("a", "b")], &RequestConfig::default())
            .unwrap();
    assert_eq!(r.prompts, vec![Prompt::Tokens(vec![1, 2, 3, u32::MAX])]);
    let r = RouteRequest::parse(br#"{"prompt":[[1,2], [3]],"model":"m"}"#, [("a", "b")], &RequestConfig::default())
        .unwrap();
    assert_eq!(r.prompts, vec![Prompt::Tokens(vec![1, 2]), Prompt::Tokens(vec![3])]);
}

#[test]
fn near_misses_agree() {
    let cases: &[&str] = &[
        r#"{"model":"m","prompt":[1,2,3]}"#,
        r#"{"model":"m","prompt":[1,-2]}"#,
        r#"{"model":"m","prompt":[1,2.0]}"#,
        r#"{"model":"m","prompt":[1,2e3]}"#,
        r#"{"model":"m","prompt":[1,2E3]}"#,
        r#"{"model":"m","prompt":[1,02]}"#,
        r#"{"model":"m","prompt":[1,4294967296]}"#,
        r#"{"model":"m","prompt":[1,99999999999999999999999]}"#,
        r#"{"model":"m","prompt":[1,"x"]}"#,
        r#"{"model":"m","prompt":[1,[2]]}"#,
        r#"{"model":"m","prompt":[[1],2]}"#,
        r#"{"model":"m","prompt":[[1],[]]}"#,
        r#"{"model":"m","prompt":[[]]}"#,
        r#"{"model":"m","prompt":[]}"#,
        r#"{"model":"m","prompt":[1,]}"#,
        r#"{"model":"m","prompt":[1 2]}"#,
        r#"{"model":"m","prompt":[1,2]"#,
        r#"{"model":"m","prompt":[1,2]}}"#,
        r#"{"model":"m","prompt":[1,2]} x"#,
        r#"{"model":"m","prompt":[1,2],"prompt":[3]}"#,
        r#"{"model":"m","prompt":[1,2],"pro\u006dpt":[3]}"#,
        r#"{"model":"m","pro\u006dpt":[3],"prompt":[1,2]}"#,
        r#"{"model":"m","prompt":[1,2],"messages":[]}"#,
        r#"{"model":"m","messages":[],"prompt":[1,2]}"#,
        r#"{"model":"m\"prompt\":[1]","prompt":[2]}"#,
        r#"{"model":"m","x":{"prompt":[1]},"prompt":[2]}"#,
        r#"{"model":"m","x":["]",{"prompt":[1]}],"prompt":[2]}"#,
        r#"{"model":"m","prompt":[1,2],"max_tokens":-1}"#,
        r#"{"model":"","prompt":[1,2]}"#,
        r#"{"prompt":[1,2]}"#,
        r#"{"model":"m","prompt":[1,2],"model":"n"}"#,
        r#"{"model":"m","prompt":[1,2],"prompt_embeds":"abc"}"#,
        r#"{"model":"m","prompt":[1,2],"stream":1}"#,
        "{\"model\":\"m\",\"prompt\":[1,\u{a0}2]}",
        "{\"model\":\"m\",\"prompt\":[1,\u{c}2]}",
        "{\"model\":\"m\",\"prompt\":[1,\t\r\n 2]}",
        "{\"model\":\"\u{1}\",\"prompt\":[1,2]}",
        "[1,2]",
        "{\"model\":\"m\",\"prompt\":[1,2]\u{0}}",
    ];
    for c in cases {
        check(c.as_bytes());
    }
    check(b"{\"model\":\"m\xff\",\"prompt\":[1,2]}");
}

/// A token-id body: keys in varying order, varying whitespace, ids of every length.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let id = prop_oneof![0u32..10, 0u32..1000, 0u32..200_000, any::<u32>()];
    let ws = prop_oneof![Just(""), Just(""), Just(" "), Just("\n  "), Just("\t"), Just("\r\n")];
    let list = prop::collection::vec((id.clone(), ws.clone()), 1..40).prop_map(|v| {
        let items: Vec<String> = v.into_iter().map(|(i, w)| format!("{w}{i}{w}")).collect();
        format!("[{}]", items.join(","))
    });
    // Python's `json.dumps` separators: `, ` between ids, nothing else.
    let spaced = prop::collection::vec(id, 1..60).prop_map(|v| {
        let items: Vec<String> = v.iter().map(u32::to_string).collect();
        format!("[{}]", items.join(", "))
    });
    let prompt = prop_oneof![
        3 => list.clone(),
        2 => spaced,
        1 => prop::collection::vec(list, 1..4).prop_map(|v| format!("[{}]", v.join(", "))),
    ];
    (prompt, ws, any::<bool>(), 0u8..4).prop_map(|(p, w, model_first, extra)| {
        let mut fields = vec![format!("{w}\"prompt\"{w}:{w}{p}"), "\"model\":\"llama\"".to_owned()];
        if !model_first {
            fields.reverse();
        }
        match extra {
            0 => {}
            1 => fields.insert(0, r#""max_tokens":256"#.to_owned()),
            2 => fields.insert(0, r#""cache_salt":"a\"b\\[{","stream":true"#.to_owned()),
            _ => fields.push(r#""tools":[{"a":"]"}]"#.to_owned()),
        }
        format!("{w}{{{}}}{w}", fields.join(",")).into_bytes()
    })
}

/// JSON's significant bytes and a few others, for the mutations.
const MUTATION_BYTES: &[u8] = b"-+.eE0123456789,[]{}\" \n\\:x\x00\xff";

fn mutate(b: Vec<u8>, muts: Vec<(usize, u8, u8)>) -> Vec<u8> {
    json_mutation::mutate(b, muts, MUTATION_BYTES)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn token_id_bodies_agree(b in body()) {
        check(&b);
        let cfg = RequestConfig::default();
        prop_assert!(RouteRequest::parse(&b, [("a", "b")], &cfg).is_ok());
    }

    #[test]
    fn mutated_bodies_agree(b in body(), muts in prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..4)) {
        check(&mutate(b, muts));
    }
}

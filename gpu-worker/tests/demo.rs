//! `kvroute-worker demo --quick` end to end: real in-process workers, real HTTP, real ZMQ KV
//! events into kvroute's precise index; checks every policy served every request, the prefix-hit
//! ordering the policies are built for, and the chart and JSON files.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use clap::Parser;
use kvroute_worker::demo::{self, DemoArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    demo: DemoArgs,
}

/// A minimal well-formedness check: every tag opened is closed in order, attributes quoted.
fn assert_well_formed_xml(text: &str) {
    let mut stack: Vec<String> = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find('<') {
        let after = &rest[open + 1..];
        let close = after.find('>').expect("unterminated tag");
        let tag = &after[..close];
        rest = &after[close + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            let top = stack.pop().unwrap_or_else(|| panic!("closing </{name}> with nothing open"));
            assert_eq!(top, name.trim(), "mismatched closing tag");
        } else if !tag.starts_with('?') && !tag.starts_with('!') {
            assert_eq!(tag.matches('"').count() % 2, 0, "unbalanced quotes in <{tag}>");
            let name = tag.split_whitespace().next().expect("empty tag").trim_end_matches('/').to_owned();
            if !tag.ends_with('/') {
                stack.push(name);
            }
        }
    }
    assert!(stack.is_empty(), "unclosed tags: {stack:?}");
}

#[test]
fn quick_demo_compares_every_policy() {
    let dir = std::env::temp_dir().join(format!("kvroute-demo-test-{}", std::process::id()));
    let svg = dir.join("chart.svg");
    let json = dir.join("results.json");
    let cli = Cli::parse_from([
        "demo",
        "--quick",
        "--out",
        svg.to_str().expect("utf-8 temp dir"),
        "--json",
        json.to_str().expect("utf-8 temp dir"),
    ]);
    demo::run(cli.demo).expect("the demo runs");

    let text = std::fs::read_to_string(&svg).expect("chart written");
    assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"));
    assert_well_formed_xml(&text);
    for name in ["round-robin", "least-loaded", "kvroute-approx", "kvroute-precise"] {
        assert!(text.contains(name), "{name} missing from the chart");
    }

    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).unwrap();
    let policies = v["policies"].as_array().expect("policies");
    assert_eq!(policies.len(), 4);
    let hit = |name: &str| {
        let p = policies.iter().find(|p| p["name"] == name).unwrap_or_else(|| panic!("{name} missing"));
        assert!(p["requests"].as_u64().unwrap() >= 10, "{name}: too few requests: {p}");
        assert_eq!(p["completed"], p["requests"], "{name} did not complete every request: {p}");
        assert!(p["ttft_p90_ms"].as_f64().unwrap() > 0.0);
        p["hit_rate"].as_f64().unwrap()
    };
    let (rr, ll, approx, precise) =
        (hit("round-robin"), hit("least-loaded"), hit("kvroute-approx"), hit("kvroute-precise"));
    let oracle = v["oracle_hit_rate"].as_f64().unwrap();
    // Cache-aware routing keeps conversations where their prefix is; round-robin scatters them.
    assert!(precise > rr, "precise {precise} <= round-robin {rr}");
    assert!(approx > rr, "approx {approx} <= round-robin {rr}");
    assert!(precise >= approx - 0.05, "precise {precise} well below approx {approx}");
    assert!(precise <= oracle + 0.02, "precise {precise} beats the oracle {oracle}");
    assert!(ll < precise, "least-loaded {ll} >= precise {precise}");
    let _ = std::fs::remove_dir_all(&dir);
}

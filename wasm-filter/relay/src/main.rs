//! `kvroute-relay`: relay engine KV events (ZMQ) to the kvroute Envoy filter (HTTP POST).
//!
//! ```sh
//! KVROUTE_EVENTS_SECRET=... kvroute-relay --config relay.json
//! kvroute-relay --config relay.json --check   # validate the configuration and the secret
//! # router replicas over NATS (the config's `replica` section; the flags override it)
//! KVROUTE_REPLICA_SECRET=... kvroute-relay --config relay.json \
//!     --nats-url nats://nats:4222 --fleet prod --replica-id envoy-a --nats-token-file /run/nats-token
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use kvroute_relay::{Relay, RelayConfig};

/// Relay vLLM/SGLang KV-event streams to the kvroute Envoy filter's event path.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Configuration file (JSON): targets, path, secret source, engines.
    #[arg(long)]
    config: PathBuf,
    /// Validate the configuration and the secret, then exit.
    #[arg(long)]
    check: bool,
    /// Print the counters to stderr this often (seconds; 0: never).
    #[arg(long, default_value_t = 60)]
    stats_every: u64,
    /// NATS server URL(s) of the replica side (overrides `replica.nats.url`).
    #[arg(long)]
    nats_url: Option<String>,
    /// The fleet (overrides `replica.nats.fleet`; the filter's `filter.replica.fleet`).
    #[arg(long)]
    fleet: Option<String>,
    /// This Envoy's replica id (overrides `replica.nats.replica_id`; the filter's
    /// `filter.replica.replica_id`).
    #[arg(long)]
    replica_id: Option<String>,
    /// File with the NATS token (overrides `replica.nats.token`; without either, the environment
    /// variable KVROUTE_NATS_TOKEN is used when set).
    #[arg(long)]
    nats_token_file: Option<PathBuf>,
    /// JetStream stream (replay of the fleet's recent batches on start): `on` or `off`
    /// (overrides `replica.nats.stream`).
    #[arg(long, value_parser = ["on", "off"])]
    nats_stream: Option<String>,
}

/// Apply the NATS flags and the token's environment variable to the configuration.
fn apply_flags(cfg: &mut RelayConfig, args: &Args) -> Result<(), String> {
    let flags = args.nats_url.is_some()
        || args.fleet.is_some()
        || args.replica_id.is_some()
        || args.nats_token_file.is_some()
        || args.nats_stream.is_some();
    let Some(r) = cfg.replica.as_mut() else {
        return if flags { Err("the NATS flags need a `replica` section in the configuration".into()) } else { Ok(()) };
    };
    let n = &mut r.nats;
    if let Some(u) = &args.nats_url {
        n.url.clone_from(u);
    }
    if let Some(f) = &args.fleet {
        n.fleet.clone_from(f);
    }
    if let Some(id) = &args.replica_id {
        n.replica_id.clone_from(id);
    }
    if let Some(p) = &args.nats_token_file {
        let t = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        n.token = Some(t.trim_end_matches(['\r', '\n']).to_owned());
    } else if n.token.is_none() {
        n.token = std::env::var(kvroute_relay::replica::NATS_TOKEN_ENV).ok().filter(|t| !t.is_empty());
    }
    match args.nats_stream.as_deref() {
        Some("off") => n.stream = None,
        Some(_) if n.stream.is_none() => n.stream = Some(kvroute::StreamOptions::default()),
        _ => {}
    }
    cfg.validate()
}

fn main() -> ExitCode {
    let args = Args::parse();
    let cfg = match std::fs::read_to_string(&args.config)
        .map_err(|e| format!("{}: {e}", args.config.display()))
        .and_then(|text| RelayConfig::from_json(&text))
        .and_then(|mut cfg| apply_flags(&mut cfg, &args).map(|()| cfg))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvroute-relay: {e}");
            return ExitCode::from(2);
        }
    };
    // The event secret is needed only to relay events; the replica side reads its own.
    let secret = if cfg.engines.is_empty() { Ok(String::new()) } else { cfg.secret() };
    let replica_secret = cfg.replica.as_ref().map(|r| r.secret()).transpose();
    let (secret, replica_secret) = match (secret, replica_secret) {
        (Ok(s), Ok(r)) => (s, r),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("kvroute-relay: {e}");
            return ExitCode::from(2);
        }
    };
    if args.check {
        let replica = cfg.replica.as_ref().map_or(String::new(), |r| {
            format!(", replica {} of fleet {} via {}", r.nats.replica_id, r.nats.fleet, r.nats.url)
        });
        eprintln!(
            "kvroute-relay: configuration OK ({} engines, {} targets{replica})",
            cfg.engines.len(),
            cfg.targets.len()
        );
        return ExitCode::SUCCESS;
    }
    let relay = match Relay::start_with(&cfg, &secret, replica_secret.as_deref()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvroute-relay: {e}");
            return ExitCode::FAILURE;
        }
    };
    eprintln!("kvroute-relay: relaying {} engines to {} targets", cfg.engines.len(), cfg.targets.len());
    let mut waited = 0u64;
    while relay.is_running() {
        std::thread::sleep(Duration::from_secs(1));
        waited += 1;
        if args.stats_every > 0 && waited % args.stats_every == 0 {
            let s = serde_json::to_string(&relay.stats()).unwrap_or_default();
            eprintln!("kvroute-relay: {s}");
            if let Some(r) = relay.replica_stats() {
                eprintln!("kvroute-relay: replica {}", serde_json::to_string(&r).unwrap_or_default());
            }
        }
    }
    eprintln!("kvroute-relay: a worker thread ended unexpectedly");
    ExitCode::FAILURE
}

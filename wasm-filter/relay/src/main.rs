//! `kvroute-relay`: relay engine KV events (ZMQ) to the kvroute Envoy filter (HTTP POST).
//!
//! ```sh
//! KVROUTE_EVENTS_SECRET=... kvroute-relay --config relay.json
//! kvroute-relay --config relay.json --check   # validate the configuration and the secret
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
}

fn main() -> ExitCode {
    let args = Args::parse();
    let cfg = match std::fs::read_to_string(&args.config)
        .map_err(|e| format!("{}: {e}", args.config.display()))
        .and_then(|text| RelayConfig::from_json(&text))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvroute-relay: {e}");
            return ExitCode::from(2);
        }
    };
    let secret = match cfg.secret() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvroute-relay: {e}");
            return ExitCode::from(2);
        }
    };
    if args.check {
        eprintln!("kvroute-relay: configuration OK ({} engines, {} targets)", cfg.engines.len(), cfg.targets.len());
        return ExitCode::SUCCESS;
    }
    let relay = match Relay::start(&cfg, &secret) {
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
        }
    }
    eprintln!("kvroute-relay: a worker thread ended unexpectedly");
    ExitCode::FAILURE
}

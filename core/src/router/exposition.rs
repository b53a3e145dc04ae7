//! The router's metrics page (Prometheus text exposition format).

use super::state::RouterCore;
use crate::decision::Rule;

impl RouterCore {
    /// The router's metrics in Prometheus text exposition format: decisions by mode and rule,
    /// the prefix-hit histogram, index sizes, event-stream health and lag, reloads.
    /// `kvroute_event_lag_seconds` compares publisher timestamps with `now_ms`, so it is
    /// meaningful when the router's clock is UNIX time (the bindings' default).
    pub fn metrics_text(&self, now_ms: u64) -> String {
        let version = self.active.version;
        let stats = self.stats();
        let st = self;
        let c = &stats.counters;
        let mut e = crate::metrics::Exposition::new();
        e.header("kvroute_decisions_total", "counter", "Routing decisions by serving mode and the rule that fired.");
        for (i, rule) in Rule::ALL.iter().enumerate() {
            let mode = match rule {
                Rule::DecodeDirect => "decode-direct",
                Rule::Disaggregated => "disaggregated",
                Rule::Shed => "none",
                _ => "colocated",
            };
            e.sample(
                "kvroute_decisions_total",
                &[("mode", mode), ("rule", rule.as_str())],
                c.decisions_by_rule[i] as f64,
            );
        }
        e.header("kvroute_route_errors_total", "counter", "Route calls that returned an error.");
        e.sample("kvroute_route_errors_total", &[], c.route_errors as f64);
        e.header(
            "kvroute_prefix_hit_ratio",
            "histogram",
            "Prefix hit ratio of the chosen endpoint, per routed request.",
        );
        for (i, b) in c.prefix_hit_buckets.iter().enumerate() {
            let le = format!("{:.1}", (i + 1) as f64 / 10.0);
            e.sample("kvroute_prefix_hit_ratio_bucket", &[("le", &le)], *b as f64);
        }
        e.sample("kvroute_prefix_hit_ratio_bucket", &[("le", "+Inf")], c.routed as f64);
        e.sample("kvroute_prefix_hit_ratio_sum", &[], c.prefix_hit_sum);
        e.sample("kvroute_prefix_hit_ratio_count", &[], c.routed as f64);
        e.header("kvroute_index_memberships", "gauge", "Live (block, endpoint) memberships per index.");
        e.sample("kvroute_index_memberships", &[("index", "approx")], stats.index.memberships as f64);
        e.sample("kvroute_index_memberships", &[("index", "precise")], stats.precise.index.memberships as f64);
        e.header("kvroute_index_bytes", "gauge", "Heap bytes held per index.");
        e.sample("kvroute_index_bytes", &[("index", "approx")], stats.index.memory_bytes as f64);
        e.sample("kvroute_index_bytes", &[("index", "precise")], stats.precise.memory_bytes() as f64);
        e.header("kvroute_speculative_blocks", "gauge", "Speculative (block, endpoint) memberships pending.");
        e.sample("kvroute_speculative_blocks", &[], stats.precise.speculative_blocks as f64);
        let p = &stats.precise;
        for (name, help, v) in [
            ("kvroute_event_batches_total", "KV-event batches applied.", p.batches),
            ("kvroute_event_blocks_stored_total", "Blocks reported stored.", p.blocks_stored),
            ("kvroute_event_blocks_removed_total", "Blocks reported removed.", p.blocks_removed),
            (
                "kvroute_event_orphan_blocks_total",
                "Stored blocks with an unknown parent (not indexed).",
                p.orphan_blocks,
            ),
            ("kvroute_event_duplicates_total", "Duplicate batches ignored.", p.duplicates),
            ("kvroute_event_gaps_total", "Sequence gaps detected.", p.gaps),
            ("kvroute_event_resets_total", "Publisher restarts detected.", p.resets),
            ("kvroute_event_resyncs_total", "Streams resynchronized after an unrecoverable gap.", p.resyncs),
            ("kvroute_event_replays_total", "Replays completed.", p.replays),
            ("kvroute_event_replay_failures_total", "Replays that failed.", p.replay_failures),
            ("kvroute_reloads_total", "Successful policy reloads.", c.reloads),
            ("kvroute_reload_failures_total", "Rejected policy reloads.", c.reload_failures),
            ("kvroute_index_resets_total", "Index resets caused by changed key parameters.", c.index_resets),
            (
                "kvroute_inflight_expired_total",
                "Requests dropped from in-flight tracking without complete.",
                c.inflight_expired,
            ),
            ("kvroute_tokenize_errors_total", "Requests the tokenizer failed on.", c.tokenize_errors),
            ("kvroute_effects_applied_total", "Routing effects of other router instances applied.", c.effects_applied),
        ] {
            e.header(name, "counter", help);
            e.sample(name, &[], v as f64);
        }
        e.header("kvroute_policy_version", "gauge", "Active policy version.");
        e.sample("kvroute_policy_version", &[], version as f64);
        e.header("kvroute_inflight_requests", "gauge", "Requests in flight, per endpoint.");
        let order: Vec<u16> = st.endpoints.order().to_vec();
        for &slot in &order {
            if let Some(ep) = st.endpoints.get(slot) {
                e.sample("kvroute_inflight_requests", &[("endpoint", &ep.id)], f64::from(ep.load.inflight()));
            }
        }
        e.header("kvroute_event_stream_healthy", "gauge", "1 when routing trusts the endpoint's KV-event stream.");
        for &slot in &order {
            if let Some(ep) = st.endpoints.get(slot) {
                let info = st.kv.read().stream_info(slot as usize, now_ms);
                e.sample("kvroute_event_stream_healthy", &[("endpoint", &ep.id)], if info.healthy { 1.0 } else { 0.0 });
            }
        }
        e.header(
            "kvroute_event_lag_seconds",
            "gauge",
            "Router receive time minus publisher timestamp of the last applied batch, per endpoint.",
        );
        for &slot in &order {
            if let Some(ep) = st.endpoints.get(slot) {
                let info = st.kv.read().stream_info(slot as usize, now_ms);
                if let Some(at) = info.last_applied_ms {
                    e.sample(
                        "kvroute_event_lag_seconds",
                        &[("endpoint", &ep.id)],
                        at as f64 / 1000.0 - info.last_publisher_ts,
                    );
                }
            }
        }
        e.header("kvroute_event_age_seconds", "gauge", "Seconds since the endpoint's last applied KV-event batch.");
        for &slot in &order {
            if let Some(ep) = st.endpoints.get(slot) {
                if let Some(at) = st.kv.read().stream_info(slot as usize, now_ms).last_applied_ms {
                    e.sample(
                        "kvroute_event_age_seconds",
                        &[("endpoint", &ep.id)],
                        now_ms.saturating_sub(at) as f64 / 1000.0,
                    );
                }
            }
        }
        if let Some(r) = self.replica_stats() {
            expose_replica(&r, &mut e);
        }
        if self.active.policy.config().flow_control.enabled {
            let ctx = crate::flow::Ctx { policy: self.active.policy.config(), endpoints: &self.endpoints };
            self.flow.expose(&ctx, now_ms, &mut e);
        }
        e.finish()
    }
}

/// Replication counters (when replication is enabled).
fn expose_replica(r: &crate::replica::ReplicaStats, e: &mut crate::metrics::Exposition) {
    let n = "kvroute_replica_batches_total";
    e.header(n, "counter", "Replica batches published (out, heartbeats included) and applied (in).");
    e.sample(n, &[("direction", "out")], r.batches_out as f64);
    e.sample(n, &[("direction", "in")], r.batches_in as f64);
    let n = "kvroute_replica_entries_total";
    e.header(n, "counter", "Replica entries published, and applied from other replicas, by kind.");
    e.sample(n, &[("direction", "out"), ("kind", "any")], r.entries_out as f64);
    e.sample(n, &[("direction", "in"), ("kind", "effect")], r.effects_applied as f64);
    e.sample(n, &[("direction", "in"), ("kind", "completion")], r.completions_applied as f64);
    let n = "kvroute_replica_skipped_total";
    e.header(
        n,
        "counter",
        "Entries of other replicas skipped: an unknown endpoint, a completion of a request not in flight.",
    );
    e.sample(n, &[("reason", "unknown_endpoint")], r.effects_unknown_endpoint as f64);
    e.sample(n, &[("reason", "unknown_request")], r.completions_unknown as f64);
    let n = "kvroute_replica_refused_total";
    e.header(n, "counter", "Batches not applied, by reason.");
    for (reason, v) in [
        ("malformed", r.malformed),
        ("unknown_replica", r.unknown_replica),
        ("wrong_fleet", r.wrong_fleet),
        ("duplicate", r.duplicates),
        ("stale", r.stale),
        ("own", r.own.saturating_sub(r.own_past_applied)),
    ] {
        e.sample(n, &[("reason", reason)], v as f64);
    }
    for (name, help, v) in [
        ("kvroute_replica_gaps_total", "Batches of other replicas missing between two received.", r.gaps),
        ("kvroute_replica_outbox_dropped_total", "Entries dropped from the full outbox.", r.outbox_dropped),
        ("kvroute_replica_incarnations_total", "New incarnations (restarts) of other replicas seen.", r.incarnations),
        (
            "kvroute_replica_inflight_dropped_total",
            "Other replicas' requests dropped from in flight: their replica restarted or went silent.",
            r.inflight_dropped,
        ),
    ] {
        e.header(name, "counter", help);
        e.sample(name, &[], v as f64);
    }
    e.header("kvroute_replica_outbox_entries", "gauge", "Entries waiting to be published.");
    e.sample("kvroute_replica_outbox_entries", &[], r.outbox_len as f64);
    e.header("kvroute_replica_peers", "gauge", "Other replicas heard from.");
    e.sample("kvroute_replica_peers", &[], r.peers as f64);
}

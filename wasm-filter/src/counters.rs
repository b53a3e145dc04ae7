//! The filter's own counters (per VM), exposed on the stats path in Prometheus text and, where
//! the host supports proxy-wasm metrics, as Envoy counters (summed over the VMs by Envoy).

use crate::sync::SyncStats;

/// One counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Counter {
    /// Requests with a body the filter tried to route.
    Requests,
    /// Requests routed by the core.
    Routed,
    /// Requests shed by the core (answered 429).
    Shed,
    /// Requests sent to the fail-open destination.
    FailOpen,
    /// Requests answered with the reject status because fail-open is disabled or no endpoint exists.
    Rejected,
    /// Core routing errors caused by the request (malformed body or header).
    RequestErrors,
    /// Core routing errors: no endpoint could serve.
    NoEndpoints,
    /// Internal errors (host calls, state borrow, encoding).
    InternalErrors,
    /// Bodies over the policy's `request.max_body_bytes`.
    BodyTooLarge,
    /// Requests without a body (sent to the least-loaded endpoint, not counted as errors).
    Bodyless,
    /// Requests passed through untouched because no valid configuration was ever received.
    Unconfigured,
    /// Event batches applied (or judged duplicate / reset).
    EventBatches,
    /// Event batches refused as a gap (409).
    EventGaps,
    /// Event posts refused as malformed (400/404/405/413).
    EventRejected,
    /// Event posts with a wrong or missing secret (401).
    EventUnauthorized,
    /// Stream resyncs requested by a relay.
    EventResyncs,
    /// Metric polls that updated an endpoint.
    Polls,
    /// Metric polls that failed (dispatch, status, timeout or unreadable page).
    PollFailures,
    /// Shared-log entries that could not be applied or written.
    SyncErrors,
    /// Mirrored event batches whose verdict differed from their writer's (the mirror resynced).
    SyncDivergences,
    /// Rejected configurations.
    ConfigErrors,
    /// Accepted configurations.
    Configurations,
    /// Requests flow control queued (held paused by the filter).
    FlowQueued,
    /// Held requests released to be routed and resumed.
    FlowResumed,
    /// Requests flow control refused at admission (answered with the reason header).
    FlowRejected,
    /// Held requests flow control dropped (answered with the reason header).
    FlowDropped,
    /// Held requests whose client went away (the ticket was cancelled).
    FlowCancelled,
    /// Held requests released without waiting for their turn because this VM lost shared-log
    /// entries (fail-open of the queue).
    FlowFailOpen,
    /// Export reads answered (`GET <replica path>/out`).
    ReplicaOut,
    /// Entries exported to the relay.
    ReplicaOutEntries,
    /// Entries the ring overwrote before the relay read them (lost to the other replicas).
    ReplicaOutLost,
    /// Other replicas' batches posted and applied (heartbeats included).
    ReplicaIn,
    /// Other replicas' batches posted and ignored by the core's judgment (own, duplicate, stale,
    /// another fleet's, a replica not allowed).
    ReplicaInIgnored,
    /// Replica requests refused as malformed (400), too large (413) or with a bad method (405).
    ReplicaRejected,
    /// Replica requests with a missing, wrong or stale signature (401).
    ReplicaUnauthorized,
}

impl Counter {
    /// Every counter, in exposition order.
    pub const ALL: [Counter; 35] = [
        Counter::Requests,
        Counter::Routed,
        Counter::Shed,
        Counter::FailOpen,
        Counter::Rejected,
        Counter::RequestErrors,
        Counter::NoEndpoints,
        Counter::InternalErrors,
        Counter::BodyTooLarge,
        Counter::Bodyless,
        Counter::Unconfigured,
        Counter::EventBatches,
        Counter::EventGaps,
        Counter::EventRejected,
        Counter::EventUnauthorized,
        Counter::EventResyncs,
        Counter::Polls,
        Counter::PollFailures,
        Counter::SyncErrors,
        Counter::SyncDivergences,
        Counter::ConfigErrors,
        Counter::Configurations,
        Counter::FlowQueued,
        Counter::FlowResumed,
        Counter::FlowRejected,
        Counter::FlowDropped,
        Counter::FlowCancelled,
        Counter::FlowFailOpen,
        Counter::ReplicaOut,
        Counter::ReplicaOutEntries,
        Counter::ReplicaOutLost,
        Counter::ReplicaIn,
        Counter::ReplicaInIgnored,
        Counter::ReplicaRejected,
        Counter::ReplicaUnauthorized,
    ];

    /// Metric name (`kvroute_wasm_…_total`).
    pub fn name(self) -> &'static str {
        match self {
            Counter::Requests => "kvroute_wasm_requests_total",
            Counter::Routed => "kvroute_wasm_routed_total",
            Counter::Shed => "kvroute_wasm_shed_total",
            Counter::FailOpen => "kvroute_wasm_fail_open_total",
            Counter::Rejected => "kvroute_wasm_rejected_total",
            Counter::RequestErrors => "kvroute_wasm_request_errors_total",
            Counter::NoEndpoints => "kvroute_wasm_no_endpoints_total",
            Counter::InternalErrors => "kvroute_wasm_internal_errors_total",
            Counter::BodyTooLarge => "kvroute_wasm_body_too_large_total",
            Counter::Bodyless => "kvroute_wasm_bodyless_total",
            Counter::Unconfigured => "kvroute_wasm_unconfigured_total",
            Counter::EventBatches => "kvroute_wasm_event_batches_total",
            Counter::EventGaps => "kvroute_wasm_event_gaps_total",
            Counter::EventRejected => "kvroute_wasm_event_rejected_total",
            Counter::EventUnauthorized => "kvroute_wasm_event_unauthorized_total",
            Counter::EventResyncs => "kvroute_wasm_event_resyncs_total",
            Counter::Polls => "kvroute_wasm_metric_polls_total",
            Counter::PollFailures => "kvroute_wasm_metric_poll_failures_total",
            Counter::SyncErrors => "kvroute_wasm_sync_errors_total",
            Counter::SyncDivergences => "kvroute_wasm_sync_divergences_total",
            Counter::ConfigErrors => "kvroute_wasm_config_errors_total",
            Counter::Configurations => "kvroute_wasm_configurations_total",
            Counter::FlowQueued => "kvroute_wasm_flow_queued_total",
            Counter::FlowResumed => "kvroute_wasm_flow_resumed_total",
            Counter::FlowRejected => "kvroute_wasm_flow_rejected_total",
            Counter::FlowDropped => "kvroute_wasm_flow_dropped_total",
            Counter::FlowCancelled => "kvroute_wasm_flow_cancelled_total",
            Counter::FlowFailOpen => "kvroute_wasm_flow_fail_open_total",
            Counter::ReplicaOut => "kvroute_wasm_replica_out_reads_total",
            Counter::ReplicaOutEntries => "kvroute_wasm_replica_out_entries_total",
            Counter::ReplicaOutLost => "kvroute_wasm_replica_out_lost_total",
            Counter::ReplicaIn => "kvroute_wasm_replica_in_batches_total",
            Counter::ReplicaInIgnored => "kvroute_wasm_replica_in_ignored_total",
            Counter::ReplicaRejected => "kvroute_wasm_replica_rejected_total",
            Counter::ReplicaUnauthorized => "kvroute_wasm_replica_unauthorized_total",
        }
    }
}

/// The counters of one VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counters {
    values: [u64; Counter::ALL.len()],
}

impl Default for Counters {
    fn default() -> Self {
        Counters { values: [0; Counter::ALL.len()] }
    }
}

impl Counters {
    /// Add one.
    pub fn bump(&mut self, c: Counter) {
        self.add(c, 1);
    }

    /// Add `n`.
    pub fn add(&mut self, c: Counter, n: u64) {
        let v = &mut self.values[c as usize];
        *v = v.saturating_add(n);
    }

    /// Current value.
    pub fn get(&self, c: Counter) -> u64 {
        self.values[c as usize]
    }

    /// Prometheus text of these counters, the shared-log figures and the flow-control gauges
    /// (`held`: this VM's requests held; `replicas`: the other VMs' queued requests it holds
    /// replicas of).
    pub fn exposition(&self, sync: &SyncStats, instance: u64, held: u64, replicas: u64) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        for c in Counter::ALL {
            let _ = writeln!(out, "# TYPE {} counter\n{} {}", c.name(), c.name(), self.get(c));
        }
        for (name, v) in [
            ("kvroute_wasm_sync_applied_total", sync.applied),
            ("kvroute_wasm_sync_appended_total", sync.appended),
            ("kvroute_wasm_sync_overruns_total", sync.overruns),
            ("kvroute_wasm_sync_lost_total", sync.lost),
            ("kvroute_wasm_sync_malformed_total", sync.malformed),
            ("kvroute_wasm_sync_host_errors_total", sync.errors),
            ("kvroute_wasm_sync_cas_conflicts_total", sync.cas_conflicts),
        ] {
            let _ = writeln!(out, "# TYPE {name} counter\n{name} {v}");
        }
        let _ = writeln!(out, "# TYPE kvroute_wasm_instance gauge\nkvroute_wasm_instance {instance}");
        for (name, v) in [("kvroute_wasm_flow_held", held), ("kvroute_wasm_flow_replicas", replicas)] {
            let _ = writeln!(out, "# TYPE {name} gauge\n{name} {v}");
        }
        out
    }
}

/// Prometheus text of the core's replication counters as one VM's router sees them (the other
/// replicas' batches it applied; the same on every VM of an Envoy).
pub fn replica_exposition(r: &kvroute::ReplicaStats) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    for (name, v) in [
        ("kvroute_wasm_replica_batches_applied_total", r.batches_in),
        ("kvroute_wasm_replica_effects_applied_total", r.effects_applied),
        ("kvroute_wasm_replica_completions_applied_total", r.completions_applied),
        ("kvroute_wasm_replica_completions_unknown_total", r.completions_unknown),
        ("kvroute_wasm_replica_effects_unknown_endpoint_total", r.effects_unknown_endpoint),
        ("kvroute_wasm_replica_duplicates_total", r.duplicates),
        ("kvroute_wasm_replica_stale_total", r.stale),
        ("kvroute_wasm_replica_gaps_total", r.gaps),
        ("kvroute_wasm_replica_incarnations_total", r.incarnations),
        ("kvroute_wasm_replica_inflight_dropped_total", r.inflight_dropped),
        ("kvroute_wasm_replica_ignored_total", r.own + r.wrong_fleet + r.unknown_replica),
    ] {
        let _ = writeln!(out, "# TYPE {name} counter\n{name} {v}");
    }
    let _ = writeln!(out, "# TYPE kvroute_wasm_replica_peers gauge\nkvroute_wasm_replica_peers {}", r.peers);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_indexed_in_order() {
        let names: std::collections::BTreeSet<_> = Counter::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(names.len(), Counter::ALL.len());
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i);
        }
        let mut c = Counters::default();
        c.bump(Counter::Shed);
        let page = c.exposition(&SyncStats::default(), 3, 2, 5);
        assert!(page.contains("kvroute_wasm_shed_total 1\n"));
        assert!(page.contains("kvroute_wasm_flow_held 2\n") && page.contains("kvroute_wasm_flow_replicas 5\n"));
    }
}

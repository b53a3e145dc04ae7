//! Flow control: priority bands, per-tenant fairness, queueing with deadlines.
//!
//! - `config.rs`: the `flow_control` policy section ([`FlowControlConfig`]);
//! - `controller.rs`: the controller (queues, limits, TTLs, shedding, dispatch), owned by
//!   [`RouterCore`](crate::RouterCore);
//! - `fairness.rs`: which flow of a band goes next (global strict, round robin, attained service);
//! - `ordering.rs`: which request of a flow goes next (FCFS, EDF, SLO deadline);
//! - `saturation.rs`: the utilization and concurrency detectors, stage-aware;
//! - `metrics.rs`: the duration histogram and its bounded fairness-id label.
//!
//! The module is private: its types are re-exported at the crate root, and the call protocol is
//! documented on [`Admission`].

mod config;
mod controller;
mod fairness;
mod metrics;
mod ordering;
mod saturation;

pub use config::{
    AttainedServiceConfig, BandDefaults, FairnessFallback, FairnessPolicy, FlowControlConfig, OrderingPolicy,
    PriorityBandConfig, SaturationDetectorConfig, SheddingConfig, DEFAULT_BAND_MAX_BYTES, DEFAULT_FLOW_MAX_BYTES,
    DEFAULT_FLOW_MAX_REQUESTS, DEFAULT_KV_CACHE_UTIL_THRESHOLD, DEFAULT_METRICS_FAIRNESS_IDS,
    DEFAULT_NO_ENDPOINTS_TTL_MS, DEFAULT_OUTPUT_TOKEN_WEIGHT, DEFAULT_QUEUE_DEPTH_THRESHOLD, DEFAULT_REQUEST_TTL_MS,
    DEFAULT_SATURATION_CEILING, DEFAULT_SERVICE_HALF_LIFE_MS, DEFAULT_SHED_K, DEFAULT_SHED_POWER,
    DEFAULT_UNBOUNDED_OUTPUT_TOKENS, MAX_FLOW_TTL_MS, MAX_PRIORITY_BANDS,
};
pub use metrics::LABEL_MIN_REQUESTS;

pub(crate) use config::validate;
pub(crate) use controller::{Ctx, FlowController};

use serde::Serialize;

/// The response header carrying a dropped request's reason (llm-d's convention), e.g.
/// `x-llm-d-request-dropped-reason: rejected-saturated`.
pub const HEADER_DROPPED_REASON: &str = "x-llm-d-request-dropped-reason";

/// A queued request's handle: a plain 64-bit number, unique among the requests the controller
/// holds or has released (it names a slot and that slot's use count, so it is never 0).
///
/// Tickets are what the bindings hand out: an integer in C (`uint64_t`) and Python (`int`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct Ticket(pub u64);

impl std::fmt::Display for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Why flow control refused or dropped a request (the value of
/// [`HEADER_DROPPED_REASON`]; llm-d's reasons).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
#[repr(u8)]
pub enum DropReason {
    /// `rejected-saturated` (429): the queue is full (global or band limit), or a sheddable
    /// request was shed before queueing.
    RejectedSaturated = 1,
    /// `rejected-ttl-expired` (429): the request waited its whole queue TTL.
    RejectedTtlExpired = 2,
    /// `rejected-no-endpoints` (503): the pool has no healthy decode-capable endpoint (at
    /// admission with `no_endpoints_ttl_ms` 0, or after waiting that long, or its TTL ran out
    /// while the pool was empty).
    RejectedNoEndpoints = 3,
    /// `rejected-shutting-down` (503): [`RouterCore::shutdown_queue`](crate::RouterCore::shutdown_queue).
    RejectedShuttingDown = 4,
    /// `evicted-priority` (429): a queued sheddable request made room for a higher-priority one
    /// when the queue was full.
    EvictedPriority = 5,
    /// `evicted-queue-pressure` (429): a reload lowered the limits below what was queued; the
    /// lowest-priority, newest requests went.
    EvictedQueuePressure = 6,
}

impl DropReason {
    /// Every reason.
    pub const ALL: [DropReason; 6] = [
        DropReason::RejectedSaturated,
        DropReason::RejectedTtlExpired,
        DropReason::RejectedNoEndpoints,
        DropReason::RejectedShuttingDown,
        DropReason::EvictedPriority,
        DropReason::EvictedQueuePressure,
    ];

    /// The header value (`rejected-saturated`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::RejectedSaturated => "rejected-saturated",
            DropReason::RejectedTtlExpired => "rejected-ttl-expired",
            DropReason::RejectedNoEndpoints => "rejected-no-endpoints",
            DropReason::RejectedShuttingDown => "rejected-shutting-down",
            DropReason::EvictedPriority => "evicted-priority",
            DropReason::EvictedQueuePressure => "evicted-queue-pressure",
        }
    }

    /// The HTTP status to answer with: 503 when the pool is empty or the router shuts down,
    /// else 429.
    pub fn status(self) -> u16 {
        match self {
            DropReason::RejectedNoEndpoints | DropReason::RejectedShuttingDown => 503,
            _ => 429,
        }
    }

    /// Parse a header value.
    pub fn from_name(name: &str) -> Option<DropReason> {
        DropReason::ALL.into_iter().find(|r| r.as_str() == name)
    }

    /// A stable number for the C ABI and other bindings: 1 `rejected-saturated`, 2
    /// `rejected-ttl-expired`, 3 `rejected-no-endpoints`, 4 `rejected-shutting-down`, 5
    /// `evicted-priority`, 6 `evicted-queue-pressure` (0 is never a reason).
    pub fn code(self) -> u8 {
        self as u8
    }
}

/// A refusal: answer the client with `status` and the header
/// [`HEADER_DROPPED_REASON`]` = reason.as_str()` ([`Rejection::header`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Rejection {
    /// HTTP status (429 or 503).
    pub status: u16,
    /// Why.
    pub reason: DropReason,
}

impl Rejection {
    /// The rejection for `reason` (its status follows from it).
    pub fn new(reason: DropReason) -> Rejection {
        Rejection { status: reason.status(), reason }
    }

    /// The header to answer with: (`x-llm-d-request-dropped-reason`, reason).
    pub fn header(&self) -> (&'static str, &'static str) {
        (HEADER_DROPPED_REASON, self.reason.as_str())
    }
}

/// What flow control says about a new request ([`RouterCore::admit`](crate::RouterCore::admit)).
///
/// # The call protocol
///
/// The bindings wrap exactly this (Python `await router.admit(...)`, the C
/// enqueue / poll / cancel calls, the Envoy filter pausing a request):
///
/// 1. **Admit.** For every request, before routing it, call `admit(&req, body_bytes, now_ms)`:
///    - [`Admission::Admit`]: route it now (`route` / `route_http`, as without flow control);
///    - [`Admission::Queued`]`(ticket)`: hold the request (do not route it) until its ticket is
///      released;
///    - [`Admission::Rejected`]`(r)`: answer `r.status` with the header `r.header()`; done.
/// 2. **Dispatch opportunities.** After anything that may free capacity or time out a request —
///    a completion (`complete`), a metrics update, an endpoint added or made healthy, a reload,
///    or a timer — call `take_releases(now_ms)`. For the timer, `next_flow_deadline()` says when
///    flow control would next act on its own (a TTL, the no-endpoint TTL, a release's load
///    lapsing): arm one timer for it, or tick every 10–100 ms while anything is queued. Each
///    [`Release`] ends one ticket:
///    - [`ReleaseOutcome::Dispatched`]: route the held request now;
///    - [`ReleaseOutcome::Dropped`]`(r)`: answer `r.status` with `r.header()`.
///
///    Releases come in the order the controller made them (bands by priority, then the band's
///    fairness and ordering policies). Any call (`admit` included: it may evict a queued
///    sheddable request) can add releases; they wait in the controller until taken.
/// 3. **Cancel.** When the client goes away while its request is held, call `cancel(ticket)`:
///    the ticket is removed (true), also when it was released but not yet taken. It then never
///    appears in a release.
/// 4. **Shutdown.** `shutdown_queue()` drops every held request with 503
///    `rejected-shutting-down` (as releases) and rejects later admissions the same way.
///
/// Every ticket ends exactly once: in one release (dispatched or dropped) or by a successful
/// `cancel`. A released ticket counts as load on the pool until the request is routed (each
/// `route` call takes one off) or for one second, so that one opportunity does not release the
/// whole queue on a saturation reading taken before it.
///
/// With flow control off (`flow_control.enabled: false`, the default), `admit` always answers
/// `Admit`, nothing is ever queued and `take_releases` returns nothing: a binding can follow the
/// protocol unconditionally. With it on, routing no longer sheds sheddable requests itself
/// (flow control owns shedding), so every request should go through `admit` first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "admission", content = "value", rename_all = "snake_case")]
pub enum Admission {
    /// Route the request now.
    Admit,
    /// Hold the request until its ticket is released.
    Queued(Ticket),
    /// Refuse the request.
    Rejected(Rejection),
}

impl Admission {
    /// The ticket, when queued.
    pub fn ticket(&self) -> Option<Ticket> {
        match self {
            Admission::Queued(t) => Some(*t),
            _ => None,
        }
    }

    /// The rejection, when refused.
    pub fn rejection(&self) -> Option<Rejection> {
        match self {
            Admission::Rejected(r) => Some(*r),
            _ => None,
        }
    }
}

/// How a held request's wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", content = "rejection", rename_all = "snake_case")]
pub enum ReleaseOutcome {
    /// Route it now.
    Dispatched,
    /// Answer the client with the rejection.
    Dropped(Rejection),
}

impl ReleaseOutcome {
    /// The rejection, when dropped.
    pub fn rejection(&self) -> Option<Rejection> {
        match self {
            ReleaseOutcome::Dropped(r) => Some(*r),
            ReleaseOutcome::Dispatched => None,
        }
    }
}

/// One ticket's end (see [`Admission`] for the protocol).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Release {
    /// The ticket [`Admission::Queued`] returned.
    pub ticket: Ticket,
    /// Route it, or answer with a rejection (in JSON flattened: `"outcome": "dispatched"` or
    /// `"outcome": "dropped", "rejection": {…}`).
    #[serde(flatten)]
    pub outcome: ReleaseOutcome,
    /// How long it waited in the queue, milliseconds.
    pub waited_ms: u64,
}

/// A queued request as another router needs it to hold a replica: the Envoy filter runs one
/// router per worker VM, and each VM holds replicas of the others' queued requests so that its
/// own requests are ordered against them ([`RouterCore::enqueue_replica`](crate::RouterCore::enqueue_replica)).
#[derive(Debug, Clone, PartialEq)]
pub struct FlowReplica {
    /// The request's fairness id (its flow), as its owner resolved it.
    pub fairness_id: String,
    /// Its priority.
    pub priority: i32,
    /// When its owner queued it (ms): its deadlines and TTL count from here.
    pub enqueue_ms: u64,
    /// Its size for the byte limits.
    pub bytes: u64,
    /// Input tokens + output budget (the concurrency detector's token count).
    pub tokens: u64,
    /// Its attained-service cost (input tokens + weight · output tokens).
    pub cost: f64,
    /// Its TTFT objective (SLO-deadline ordering).
    pub slo_ttft_ms: Option<u64>,
    /// Its own queue TTL.
    pub ttl_ms: Option<u64>,
}

/// Rejections by reason (at admission and of queued requests).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RejectionCounts {
    /// `rejected-saturated`.
    pub rejected_saturated: u64,
    /// `rejected-ttl-expired`.
    pub rejected_ttl_expired: u64,
    /// `rejected-no-endpoints`.
    pub rejected_no_endpoints: u64,
    /// `rejected-shutting-down`.
    pub rejected_shutting_down: u64,
    /// `evicted-priority`.
    pub evicted_priority: u64,
    /// `evicted-queue-pressure`.
    pub evicted_queue_pressure: u64,
}

impl RejectionCounts {
    /// The count of `reason`.
    pub fn get(&self, reason: DropReason) -> u64 {
        match reason {
            DropReason::RejectedSaturated => self.rejected_saturated,
            DropReason::RejectedTtlExpired => self.rejected_ttl_expired,
            DropReason::RejectedNoEndpoints => self.rejected_no_endpoints,
            DropReason::RejectedShuttingDown => self.rejected_shutting_down,
            DropReason::EvictedPriority => self.evicted_priority,
            DropReason::EvictedQueuePressure => self.evicted_queue_pressure,
        }
    }

    fn bump(&mut self, reason: DropReason) {
        let c = match reason {
            DropReason::RejectedSaturated => &mut self.rejected_saturated,
            DropReason::RejectedTtlExpired => &mut self.rejected_ttl_expired,
            DropReason::RejectedNoEndpoints => &mut self.rejected_no_endpoints,
            DropReason::RejectedShuttingDown => &mut self.rejected_shutting_down,
            DropReason::EvictedPriority => &mut self.evicted_priority,
            DropReason::EvictedQueuePressure => &mut self.evicted_queue_pressure,
        };
        *c += 1;
    }

    /// Every rejection.
    pub fn total(&self) -> u64 {
        DropReason::ALL.iter().map(|&r| self.get(r)).sum()
    }
}

/// Flow-control counters (releases count when taken).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FlowCounters {
    /// Requests admitted at once.
    pub admitted: u64,
    /// Requests queued (tickets issued).
    pub enqueued: u64,
    /// Tickets released to be routed.
    pub dispatched: u64,
    /// Tickets cancelled.
    pub cancelled: u64,
    /// Sheddable requests shed before queueing (also counted in `rejections.rejected_saturated`).
    pub shed: u64,
    /// Rejections by reason, at admission and of queued requests.
    pub rejections: RejectionCounts,
}

/// One band's queue.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BandStats {
    /// The band's priority.
    pub priority: i32,
    /// Requests queued.
    pub queued: u64,
    /// Request bytes queued.
    pub queued_bytes: u64,
    /// Flows (fairness ids) with queued requests.
    pub active_flows: u64,
    /// The band dispatches while saturation is below this (after the priority holdback).
    pub ceiling: f64,
    /// Its fairness policy.
    pub fairness_policy: FairnessPolicy,
    /// Its ordering policy.
    pub ordering_policy: OrderingPolicy,
}

/// The pool's saturation by stage, as flow control measures it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SaturationReport {
    /// What the bands' ceilings are compared with.
    pub pool: f64,
    /// The decode pool (endpoints with role `decode` or `both`).
    pub decode: f64,
    /// The prefill pool (role `prefill`), when there is one.
    pub prefill: Option<f64>,
    /// Healthy decode-capable endpoints (0: no endpoints).
    pub decode_endpoints: u32,
}

/// A snapshot of flow control.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FlowStats {
    /// `flow_control.enabled` of the active policy.
    pub enabled: bool,
    /// Requests queued.
    pub queued: u64,
    /// Request bytes queued.
    pub queued_bytes: u64,
    /// Releases made and not yet taken.
    pub releases_waiting: u64,
    /// Requests released (or admitted) that were not routed yet (they count as load).
    pub pending_dispatch: u64,
    /// `shutdown_queue` was called.
    pub shutting_down: bool,
    /// Bands by priority, highest first.
    pub bands: Vec<BandStats>,
    /// Counters.
    pub counters: FlowCounters,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_have_names_codes_and_statuses() {
        let names: Vec<(&str, u8, u16)> = DropReason::ALL.iter().map(|r| (r.as_str(), r.code(), r.status())).collect();
        assert_eq!(
            names,
            vec![
                ("rejected-saturated", 1, 429),
                ("rejected-ttl-expired", 2, 429),
                ("rejected-no-endpoints", 3, 503),
                ("rejected-shutting-down", 4, 503),
                ("evicted-priority", 5, 429),
                ("evicted-queue-pressure", 6, 429),
            ]
        );
        for r in DropReason::ALL {
            assert_eq!(DropReason::from_name(r.as_str()), Some(r));
        }
        assert_eq!(DropReason::from_name("nope"), None);
    }

    #[test]
    fn json_shapes_for_the_bindings() {
        let rej = Rejection::new(DropReason::RejectedTtlExpired);
        let a = serde_json::to_value(Admission::Queued(Ticket(7))).unwrap();
        assert_eq!(a, serde_json::json!({"admission": "queued", "value": 7}));
        let a = serde_json::to_value(Admission::Rejected(rej)).unwrap();
        assert_eq!(
            a,
            serde_json::json!({"admission": "rejected", "value": {"status": 429, "reason": "rejected-ttl-expired"}})
        );
        assert_eq!(serde_json::to_value(Admission::Admit).unwrap(), serde_json::json!({"admission": "admit"}));
        let r = Release { ticket: Ticket(9), outcome: ReleaseOutcome::Dropped(rej), waited_ms: 30 };
        assert_eq!(
            serde_json::to_value(r).unwrap(),
            serde_json::json!({"ticket": 9, "outcome": "dropped", "rejection": {"status": 429, "reason": "rejected-ttl-expired"}, "waited_ms": 30})
        );
        let r = Release { ticket: Ticket(9), outcome: ReleaseOutcome::Dispatched, waited_ms: 0 };
        assert_eq!(
            serde_json::to_value(r).unwrap(),
            serde_json::json!({"ticket": 9, "outcome": "dispatched", "waited_ms": 0})
        );
        assert_eq!(rej.header(), (HEADER_DROPPED_REASON, "rejected-ttl-expired"));
    }
}

//! The flow controller: queued requests in a slab, bands by priority with their fairness and
//! ordering schedules, the TTL heap, limits, shedding and the dispatch loop.
//!
//! Pure and single-threaded: every call takes `now_ms`, and the pool's saturation is read from
//! the router's endpoint table passed in ([`Ctx`]). [`RouterCore`](crate::RouterCore) owns one.
//!
//! Costs (n queued requests, m flows in a band, B ≤ 64 bands, E endpoints): admission and one
//! dispatch are `O(E + B + log n)`; a request leaving another way (cancel, TTL) is `O(log n)` and
//! leaves stale entries behind in the heaps, skipped when reached and compacted away (with
//! flows that went idle) once they outnumber the live ones.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;

use xxhash_rust::xxh3::Xxh3DefaultBuilder;

use super::config::{BandParams, FairnessFallback, FairnessPolicy, FlowControlConfig, MAX_PRIORITY_BANDS};
use super::fairness::BandQueues;
use super::metrics::{FlowMetrics, Outcome};
use super::ordering::{self, Item, NO_DEADLINE};
use super::saturation::{self, Saturation};
use super::{
    Admission, BandStats, DropReason, FlowCounters, FlowReplica, FlowStats, Rejection, Release, ReleaseOutcome,
    SaturationReport, Ticket,
};
use crate::config::PolicyConfig;
use crate::endpoints::EndpointTable;
use crate::metrics::Exposition;
use crate::request::RouteRequest;
use crate::score::{splitmix64, unit_f64};

/// A released (or admitted) request counts as load until it is routed or this long has passed.
pub(crate) const PENDING_GRACE_MS: u64 = 1_000;
/// No band's ceiling goes below this, whatever the holdback.
const MIN_CEILING: f64 = 0.05;
/// Attained service is renormalized when its inflation reaches 2^this.
const RESCALE_HALF_LIVES: f64 = 64.0;
/// Compaction when stale heap entries (or idle flows) exceed twice the live requests plus this.
const COMPACT_SLACK: u64 = 4096;
/// Idle flows whose attained service is kept over a compaction, at most (half the slack, so a
/// compaction always ends below the bound that starts the next one).
const RETAINED_IDLE_FLOWS: usize = (COMPACT_SLACK / 2) as usize;

/// What the controller reads from the router: the policy and the endpoint table.
pub(crate) struct Ctx<'a> {
    pub policy: &'a PolicyConfig,
    pub endpoints: &'a EndpointTable,
}

impl Ctx<'_> {
    fn flow(&self) -> &FlowControlConfig {
        &self.policy.flow_control
    }
}

#[derive(Debug)]
struct Entry {
    seq: u64,
    band: u16,
    flow: u32,
    enqueue_ms: u64,
    expires_ms: u64,
    bytes: u64,
    /// Input tokens + output budget (the concurrency detector's token count).
    tokens: u64,
    /// Attained-service cost (input tokens + weight · output tokens), uninflated.
    cost: f64,
    /// The request's priority (its band's, unless the band table was full).
    priority: i32,
    slo_ttft_ms: Option<u64>,
    /// The request's own TTL (header), replacing the band's.
    ttl_ms: Option<u64>,
    /// A replica of another router's queued request ([`FlowController::enqueue_replica`]).
    replica: bool,
}

impl Entry {
    /// Structures holding it: its flow's (or band's) heap and the band's FIFO, plus the expiry
    /// heap when it has a TTL.
    fn structures(&self) -> u64 {
        2 + u64::from(self.expires_ms != NO_DEADLINE)
    }
}

#[derive(Debug)]
struct Slot {
    gen: u32,
    entry: Option<Entry>,
}

#[derive(Debug)]
struct Band {
    priority: i32,
    params: BandParams,
    /// After the holdback.
    ceiling: f64,
    queued: u64,
    bytes: u64,
    /// (seq, slot) in arrival order: eviction (newest first), the no-endpoint TTL (oldest first).
    fifo: VecDeque<(u64, u32)>,
    queues: BandQueues,
}

impl Band {
    fn new(priority: i32, params: BandParams) -> Band {
        let queues = BandQueues::new(params.fairness);
        Band { priority, ceiling: params.ceiling, params, queued: 0, bytes: 0, fifo: VecDeque::new(), queues }
    }
}

/// A release waiting to be taken.
#[derive(Debug)]
struct Held {
    release: Release,
    fairness: Arc<str>,
    priority: i32,
    /// Of a replica: reported, never counted.
    replica: bool,
}

/// How a queued request leaves.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Leave {
    /// Popped from its schedule heap.
    Dispatched,
    /// Popped from the expiry heap.
    Expired,
    /// Popped from its band's FIFO.
    FromFifo,
    /// Removed directly (cancel, shutdown, reload).
    Direct,
}

/// The flow controller (see the module docs).
#[derive(Debug)]
pub(crate) struct FlowController {
    slots: Vec<Slot>,
    free: Vec<u32>,
    bands: Vec<Band>,
    /// Band indexes by priority, highest first.
    order: Vec<u16>,
    band_of: HashMap<i32, u16, Xxh3DefaultBuilder>,
    /// (expires_ms, seq, slot), soonest first.
    expiry: BinaryHeap<Reverse<(u64, u64, u32)>>,
    /// Releases made and not yet taken, with their fairness id and band priority (for the
    /// histogram, recorded when taken).
    releases: Vec<Held>,
    /// Released or admitted requests not yet routed: (at_ms, tokens), oldest first.
    pending: VecDeque<(u64, u64)>,
    pending_tokens: u64,
    /// Replicas released here, counted as load until their owner's request is routed
    /// ([`FlowController::forget_replica`]) or the grace lapses: (at_ms, tokens, ticket).
    replica_pending: Vec<(u64, u64, Ticket)>,
    next_seq: u64,
    queued: u64,
    queued_bytes: u64,
    /// Stale entries in the heaps and FIFOs (approximate; drives compaction).
    stale: u64,
    flows_total: u64,
    shutdown: bool,
    draws: u64,
    last_now: u64,
    /// Attained service is inflated relative to this time.
    epoch_ms: u64,
    counters: FlowCounters,
    metrics: FlowMetrics,
}

fn ticket(gen: u32, slot: u32) -> Ticket {
    Ticket((u64::from(gen) << 32) | u64::from(slot))
}

/// The fairness id of `req` under `f`: its fairness header, else the configured fallback, else
/// `default_fairness_id`.
pub(crate) fn fairness_id<'a>(f: &'a FlowControlConfig, req: &'a RouteRequest) -> &'a str {
    if let Some(id) = req.fairness_id.as_deref() {
        return id;
    }
    match f.fairness_fallback {
        FairnessFallback::CacheSalt => req.cache_salt.as_deref().unwrap_or(&f.default_fairness_id),
        FairnessFallback::Model => &req.model,
        FairnessFallback::None => &f.default_fairness_id,
    }
}

impl FlowController {
    pub fn new(policy: &PolicyConfig) -> FlowController {
        let f = &policy.flow_control;
        let mut c = FlowController {
            slots: Vec::new(),
            free: Vec::new(),
            bands: Vec::new(),
            order: Vec::new(),
            band_of: HashMap::with_hasher(Xxh3DefaultBuilder),
            expiry: BinaryHeap::new(),
            releases: Vec::new(),
            pending: VecDeque::new(),
            pending_tokens: 0,
            replica_pending: Vec::new(),
            next_seq: 0,
            queued: 0,
            queued_bytes: 0,
            stale: 0,
            flows_total: 0,
            shutdown: false,
            draws: 0,
            last_now: 0,
            epoch_ms: 0,
            counters: FlowCounters::default(),
            metrics: FlowMetrics::new(f.metrics_fairness_ids),
        };
        c.configure_bands(f);
        c
    }

    fn configure_bands(&mut self, f: &FlowControlConfig) {
        self.bands.clear();
        self.order.clear();
        self.band_of.clear();
        self.flows_total = 0;
        for b in &f.priority_bands {
            self.add_band(f, b.priority);
        }
    }

    fn add_band(&mut self, f: &FlowControlConfig, priority: i32) -> u16 {
        let i = self.bands.len() as u16;
        self.bands.push(Band::new(priority, f.band_params(priority)));
        self.band_of.insert(priority, i);
        let pos = self.order.partition_point(|&b| self.bands[b as usize].priority > priority);
        self.order.insert(pos, i);
        // Ceilings after the holdback, never higher than a higher band's.
        let mut above = f64::INFINITY;
        for (rank, &b) in self.order.iter().enumerate() {
            let band = &mut self.bands[b as usize];
            let c = (band.params.ceiling - f.priority_holdback * rank as f64).min(above).max(MIN_CEILING);
            band.ceiling = c;
            above = c;
        }
        i
    }

    /// The band of `priority`: its own, created from the default band when new; once
    /// [`MAX_PRIORITY_BANDS`] exist, the highest band at or below it (else the lowest).
    fn band_for(&mut self, f: &FlowControlConfig, priority: i32) -> u16 {
        if let Some(&b) = self.band_of.get(&priority) {
            return b;
        }
        if self.bands.len() < MAX_PRIORITY_BANDS {
            return self.add_band(f, priority);
        }
        let below = self.order.iter().copied().find(|&b| self.bands[b as usize].priority <= priority);
        below.or_else(|| self.order.last().copied()).unwrap_or(0)
    }

    /// Time never goes back for the controller.
    fn advance(&mut self, now_ms: u64) -> u64 {
        self.last_now = self.last_now.max(now_ms);
        self.last_now
    }

    /// The attained-service inflation at `now` (renormalizing when it grows large).
    fn service_scale(&mut self, f: &FlowControlConfig, now: u64) -> f64 {
        let half_lives = now.saturating_sub(self.epoch_ms) as f64 / f.attained_service.half_life_ms as f64;
        if half_lives <= RESCALE_HALF_LIVES {
            return half_lives.exp2();
        }
        let factor = (-half_lives).exp2();
        for b in &mut self.bands {
            b.queues.rescale(factor);
        }
        self.epoch_ms = now;
        1.0
    }

    fn live(slots: &[Slot], seq: u64, slot: u32) -> bool {
        slots.get(slot as usize).and_then(|s| s.entry.as_ref()).is_some_and(|e| e.seq == seq)
    }

    /// The pool's saturation now, counting released-but-unrouted requests.
    fn measure(&mut self, ctx: &Ctx<'_>, now: u64) -> Saturation {
        while self.pending.front().is_some_and(|&(at, _)| at.saturating_add(PENDING_GRACE_MS) <= now) {
            if let Some((_, t)) = self.pending.pop_front() {
                self.pending_tokens = self.pending_tokens.saturating_sub(t);
            }
        }
        self.replica_pending.retain(|&(at, _, _)| at.saturating_add(PENDING_GRACE_MS) > now);
        let replica_tokens = self.replica_pending.iter().fold(0u64, |s, &(_, t, _)| s.saturating_add(t));
        let mut sat = saturation::measure(ctx.policy, ctx.endpoints, now);
        sat.add_pending(
            (self.pending.len() + self.replica_pending.len()) as u64,
            self.pending_tokens.saturating_add(replica_tokens),
        );
        sat
    }

    fn add_pending(&mut self, now: u64, tokens: u64) {
        self.pending.push_back((now, tokens));
        self.pending_tokens = self.pending_tokens.saturating_add(tokens);
    }

    /// A request was routed: one released request is no longer pending.
    pub fn routed(&mut self) {
        if let Some((_, t)) = self.pending.pop_front() {
            self.pending_tokens = self.pending_tokens.saturating_sub(t);
        }
    }

    /// Remove the entry at `slot` from the counts (its heap entries become stale), returning it.
    fn take(&mut self, slot: u32, how: Leave) -> Option<Entry> {
        let s = self.slots.get_mut(slot as usize)?;
        let e = s.entry.take()?;
        s.gen = s.gen.wrapping_add(1).max(1);
        self.free.push(slot);
        let band = &mut self.bands[e.band as usize];
        band.queued = band.queued.saturating_sub(1);
        band.bytes = band.bytes.saturating_sub(e.bytes);
        if how != Leave::Dispatched {
            band.queues.forget(e.flow);
        }
        self.queued = self.queued.saturating_sub(1);
        self.queued_bytes = self.queued_bytes.saturating_sub(e.bytes);
        let left_in = e.structures() - u64::from(how != Leave::Direct);
        self.stale += left_in;
        Some(e)
    }

    fn fairness_of(&self, e: &Entry) -> Arc<str> {
        self.bands[e.band as usize].queues.flows[e.flow as usize].id.clone()
    }

    /// Release the queued entry at `slot`: dispatched (`reason` none) or dropped.
    fn release(&mut self, slot: u32, how: Leave, reason: Option<DropReason>, now: u64) -> Option<(Ticket, Entry)> {
        let t = ticket(self.slots.get(slot as usize)?.gen, slot);
        let e = self.take(slot, how)?;
        let outcome = match reason {
            None => ReleaseOutcome::Dispatched,
            Some(r) => ReleaseOutcome::Dropped(Rejection::new(r)),
        };
        let release = Release { ticket: t, outcome, waited_ms: now.saturating_sub(e.enqueue_ms) };
        let fairness = self.fairness_of(&e);
        let priority = self.bands[e.band as usize].priority;
        self.releases.push(Held { release, fairness, priority, replica: e.replica });
        Some((t, e))
    }

    /// Drop the queued entry at `slot` with `reason` (a release).
    fn drop_entry(&mut self, slot: u32, how: Leave, reason: DropReason, now: u64) {
        self.release(slot, how, Some(reason), now);
    }

    /// Expire requests past their TTL (and, while the pool is empty, past the no-endpoint TTL).
    fn expire(&mut self, f: &FlowControlConfig, no_endpoints: bool, now: u64) {
        let reason = if no_endpoints { DropReason::RejectedNoEndpoints } else { DropReason::RejectedTtlExpired };
        while let Some(&Reverse((at, seq, slot))) = self.expiry.peek() {
            if at > now {
                break;
            }
            self.expiry.pop();
            if Self::live(&self.slots, seq, slot) {
                self.drop_entry(slot, Leave::Expired, reason, now);
            } else {
                self.stale = self.stale.saturating_sub(1);
            }
        }
        if !no_endpoints {
            return;
        }
        let ttl = f.no_endpoints_ttl_ms;
        for i in 0..self.order.len() {
            let b = self.order[i] as usize;
            while let Some(&(seq, slot)) = self.bands[b].fifo.front() {
                let Some(e) = self.slots[slot as usize].entry.as_ref().filter(|e| e.seq == seq) else {
                    self.bands[b].fifo.pop_front();
                    self.stale = self.stale.saturating_sub(1);
                    continue;
                };
                if e.enqueue_ms.saturating_add(ttl) > now {
                    break;
                }
                self.bands[b].fifo.pop_front();
                self.drop_entry(slot, Leave::FromFifo, DropReason::RejectedNoEndpoints, now);
            }
        }
    }

    /// Dispatch while the first band with queued requests is below its ceiling.
    fn dispatch(&mut self, f: &FlowControlConfig, sat: &mut Saturation, now: u64) {
        while let Some(b) = self.order.iter().copied().find(|&b| self.bands[b as usize].queued > 0) {
            let b = b as usize;
            if sat.value() >= self.bands[b].ceiling {
                break;
            }
            let scale = match self.bands[b].params.fairness {
                FairnessPolicy::AttainedService => self.service_scale(f, now),
                _ => 0.0,
            };
            let FlowController { bands, slots, .. } = self;
            let live = |it: &Item| Self::live(slots, it.seq, it.slot);
            let cost = |it: &Item| slots[it.slot as usize].entry.as_ref().map_or(0.0, |e| e.cost * scale);
            let Some(p) = bands[b].queues.pop(live, cost) else {
                // Counts and heaps disagree (a bug): repair the band rather than spin.
                self.repair_band(b, now);
                continue;
            };
            self.stale = self.stale.saturating_sub(p.stale);
            let slot = p.item.slot;
            if let Some(e) = self.slots[slot as usize].entry.as_ref() {
                let (flow, c) = (e.flow, e.cost * scale);
                let q = &mut self.bands[b].queues;
                if p.flow == u32::MAX {
                    // Global strict: the band's heap does not know the flow.
                    q.popped_from(flow);
                    q.charge(flow, c);
                }
            }
            if let Some((t, e)) = self.release(slot, Leave::Dispatched, None, now) {
                sat.add_dispatch(e.tokens);
                if e.replica {
                    self.replica_pending.push((now, e.tokens, t));
                } else {
                    self.add_pending(now, e.tokens);
                }
            }
            self.trim(b);
        }
    }

    /// Drop stale entries at the front of band `b`'s FIFO and the top of the expiry heap (with
    /// FCFS ordering and one TTL, what was just dispatched is there).
    fn trim(&mut self, b: usize) {
        while let Some(&(seq, slot)) = self.bands[b].fifo.front() {
            if Self::live(&self.slots, seq, slot) {
                break;
            }
            self.bands[b].fifo.pop_front();
            self.stale = self.stale.saturating_sub(1);
        }
        while let Some(&Reverse((_, seq, slot))) = self.expiry.peek() {
            if Self::live(&self.slots, seq, slot) {
                break;
            }
            self.expiry.pop();
            self.stale = self.stale.saturating_sub(1);
        }
    }

    /// Drop a band's requests back into a consistent state (never expected: the counts and the
    /// heaps are kept in step).
    fn repair_band(&mut self, b: usize, now: u64) {
        let slots: Vec<u32> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.entry.as_ref().is_some_and(|e| e.band as usize == b))
            .map(|(i, _)| i as u32)
            .collect();
        for slot in slots {
            self.drop_entry(slot, Leave::Direct, DropReason::RejectedSaturated, now);
        }
        self.bands[b].queued = 0;
        self.bands[b].bytes = 0;
    }

    /// Expire, then dispatch: one dispatch opportunity.
    pub fn pump(&mut self, ctx: &Ctx<'_>, now_ms: u64) {
        let now = self.advance(now_ms);
        if self.queued > 0 {
            self.opportunity(ctx, now);
        }
    }

    /// Expire and dispatch at `now`; returns the saturation after the releases.
    fn opportunity(&mut self, ctx: &Ctx<'_>, now: u64) -> Saturation {
        let mut sat = self.measure(ctx, now);
        if self.queued > 0 {
            let f = ctx.flow();
            self.expire(f, sat.no_endpoints(), now);
            if !sat.no_endpoints() {
                self.dispatch(f, &mut sat, now);
            }
            self.maybe_compact(ctx, now);
        }
        sat
    }

    fn maybe_compact(&mut self, ctx: &Ctx<'_>, now: u64) {
        let bound = 2 * self.queued + COMPACT_SLACK;
        if self.stale > bound || self.flows_total > bound {
            self.rebuild(ctx, now, false);
        }
    }

    /// Would a request of `bytes` fit in band `b` and the global limits?
    fn fits_band(&self, b: usize, bytes: u64) -> bool {
        let band = &self.bands[b];
        let p = &band.params;
        (p.max_requests == 0 || band.queued < p.max_requests)
            && (p.max_bytes == 0 || band.bytes.saturating_add(bytes) <= p.max_bytes)
    }

    fn fits_global(&self, f: &FlowControlConfig, extra_requests: u64, extra_bytes: u64) -> bool {
        (f.max_requests == 0 || self.queued + extra_requests <= f.max_requests)
            && (f.max_bytes == 0 || self.queued_bytes.saturating_add(extra_bytes) <= f.max_bytes)
    }

    /// Make room for a request of `priority` and `bytes` by evicting queued sheddable requests of
    /// lower priority (lowest band first, newest first). Evicts only when that makes it fit.
    fn evict_for(&mut self, f: &FlowControlConfig, priority: i32, bytes: u64, now: u64) -> bool {
        let victim_bands: Vec<usize> = self
            .order
            .iter()
            .rev()
            .map(|&b| b as usize)
            .filter(|&b| {
                let p = self.bands[b].priority;
                p < 0 && p < priority
            })
            .collect();
        let (n, by): (u64, u64) = victim_bands
            .iter()
            .fold((0, 0), |(n, by), &b| (n + self.bands[b].queued, by.saturating_add(self.bands[b].bytes)));
        let need_requests = if f.max_requests == 0 { 0 } else { (self.queued + 1).saturating_sub(f.max_requests) };
        let need_bytes =
            if f.max_bytes == 0 { 0 } else { self.queued_bytes.saturating_add(bytes).saturating_sub(f.max_bytes) };
        if need_requests > n || need_bytes > by {
            return false;
        }
        for b in victim_bands {
            while !self.fits_global(f, 1, bytes) {
                let Some((seq, slot)) = self.bands[b].fifo.pop_back() else { break };
                if Self::live(&self.slots, seq, slot) {
                    self.drop_entry(slot, Leave::FromFifo, DropReason::EvictedPriority, now);
                } else {
                    self.stale = self.stale.saturating_sub(1);
                }
            }
        }
        self.fits_global(f, 1, bytes)
    }

    fn reject(&mut self, reason: DropReason, fairness: &str, priority: i32) -> Admission {
        self.counters.rejections.bump(reason);
        self.metrics.observe(fairness, priority, Outcome::Dropped(reason), 0);
        Admission::Rejected(Rejection::new(reason))
    }

    /// Flow control's answer for a new request (see [`Admission`]).
    pub fn admit(&mut self, ctx: &Ctx<'_>, req: &RouteRequest, body_bytes: u64, now_ms: u64) -> Admission {
        let f = ctx.flow();
        let fairness = fairness_id(f, req);
        let priority = req.priority;
        if self.shutdown {
            return self.reject(DropReason::RejectedShuttingDown, fairness, priority);
        }
        let now = self.advance(now_ms);
        let sat = self.opportunity(ctx, now);
        let b = self.band_for(f, priority) as usize;
        let input = req.input_tokens(ctx.policy.index.bytes_per_token);
        let output = u64::from(req.effective_max_tokens().unwrap_or(f.attained_service.unbounded_output_tokens));
        let tokens = input.saturating_add(output);
        let cost = input as f64 + f.attained_service.output_token_weight * output as f64;
        if sat.no_endpoints() {
            if f.no_endpoints_ttl_ms == 0 {
                return self.reject(DropReason::RejectedNoEndpoints, fairness, priority);
            }
        } else {
            // Strict head of line: nothing queued in this band or above it, and room under its
            // ceiling.
            let blocked =
                self.order.iter().map(|&o| o as usize).take_while(|&o| o != b).any(|o| self.bands[o].queued > 0)
                    || self.bands[b].queued > 0;
            if !blocked && sat.value() < self.bands[b].ceiling {
                if self.bands[b].params.fairness == FairnessPolicy::AttainedService {
                    // Service attained at once counts as much as service after a wait.
                    let scale = self.service_scale(f, now);
                    let before = self.bands[b].queues.flows.len();
                    let flow = self.bands[b].queues.flow(fairness);
                    self.flows_total += (self.bands[b].queues.flows.len() - before) as u64;
                    self.bands[b].queues.charge(flow, cost * scale);
                }
                self.add_pending(now, tokens);
                self.maybe_compact(ctx, now);
                self.counters.admitted += 1;
                self.metrics.observe(fairness, self.bands[b].priority, Outcome::Dispatched, 0);
                return Admission::Admit;
            }
            if priority < 0 && f.shedding.enabled {
                let s = &f.shedding;
                let p = (s.k * sat.value().max(0.0).powf(s.power)).min(1.0);
                let u = unit_f64(splitmix64(s.seed ^ self.draws.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
                self.draws = self.draws.wrapping_add(1);
                if u < p {
                    self.counters.shed += 1;
                    return self.reject(DropReason::RejectedSaturated, fairness, priority);
                }
            }
        }
        if !self.fits_band(b, body_bytes)
            || (!self.fits_global(f, 1, body_bytes) && !self.evict_for(f, priority, body_bytes, now))
        {
            return self.reject(DropReason::RejectedSaturated, fairness, priority);
        }
        let t = self.enqueue(
            b,
            fairness,
            Entry {
                seq: 0,
                band: b as u16,
                flow: 0,
                enqueue_ms: now,
                expires_ms: NO_DEADLINE,
                bytes: body_bytes,
                tokens,
                cost,
                priority,
                slo_ttft_ms: req.slo_ttft_ms,
                ttl_ms: req.queue_ttl_ms,
                replica: false,
            },
            None,
        );
        self.counters.enqueued += 1;
        Admission::Queued(t)
    }

    /// Put `e` in band `b` under `fairness` (in `slot` when given: a rebuild keeps tickets),
    /// computing its deadline and ordering key under the band's policies.
    fn enqueue(&mut self, b: usize, fairness: &str, mut e: Entry, slot: Option<u32>) -> Ticket {
        if slot.is_none() {
            e.seq = self.next_seq;
            self.next_seq += 1;
        }
        let band = &mut self.bands[b];
        let before = band.queues.flows.len();
        let flow = band.queues.flow(fairness);
        self.flows_total += (band.queues.flows.len() - before) as u64;
        let ttl = e.ttl_ms.unwrap_or(band.params.ttl_ms);
        e.expires_ms = if ttl == 0 { NO_DEADLINE } else { e.enqueue_ms.saturating_add(ttl) };
        e.band = b as u16;
        e.flow = flow;
        let key = ordering::key(band.params.ordering, e.seq, e.enqueue_ms, e.expires_ms, e.slo_ttft_ms);
        let slot = match slot {
            Some(s) => s,
            None => match self.free.pop() {
                Some(s) => s,
                None => {
                    self.slots.push(Slot { gen: 1, entry: None });
                    (self.slots.len() - 1) as u32
                }
            },
        };
        band.queues.push(flow, Item { key, seq: e.seq, slot });
        band.fifo.push_back((e.seq, slot));
        band.queued += 1;
        band.bytes = band.bytes.saturating_add(e.bytes);
        if e.expires_ms != NO_DEADLINE {
            self.expiry.push(Reverse((e.expires_ms, e.seq, slot)));
        }
        self.queued += 1;
        self.queued_bytes = self.queued_bytes.saturating_add(e.bytes);
        let s = &mut self.slots[slot as usize];
        s.entry = Some(e);
        ticket(s.gen, slot)
    }

    /// Remove a held ticket (queued, or released and not yet taken). True when it was held.
    pub fn cancel(&mut self, t: Ticket) -> bool {
        let now = self.last_now;
        let slot = (t.0 & 0xFFFF_FFFF) as u32;
        let gen = (t.0 >> 32) as u32;
        let held =
            self.slots.get(slot as usize).is_some_and(|s| s.gen == gen && s.entry.as_ref().is_some_and(|e| !e.replica));
        if held {
            let Some(e) = self.take(slot, Leave::Direct) else { return false };
            let fairness = self.fairness_of(&e);
            self.counters.cancelled += 1;
            self.metrics.observe(
                &fairness,
                self.bands[e.band as usize].priority,
                Outcome::Cancelled,
                now.saturating_sub(e.enqueue_ms),
            );
            return true;
        }
        if let Some(i) = self.releases.iter().position(|h| h.release.ticket == t && !h.replica) {
            let h = self.releases.remove(i);
            if h.release.outcome == ReleaseOutcome::Dispatched {
                // It will not be routed.
                if let Some((_, tk)) = self.pending.pop_back() {
                    self.pending_tokens = self.pending_tokens.saturating_sub(tk);
                }
            }
            self.counters.cancelled += 1;
            self.metrics.observe(&h.fairness, h.priority, Outcome::Cancelled, h.release.waited_ms);
            return true;
        }
        false
    }

    /// What another router needs to hold a replica of the queued request `t` (an own request,
    /// not a replica); `None` when `t` is not queued here.
    pub fn replica(&self, t: Ticket) -> Option<FlowReplica> {
        let slot = (t.0 & 0xFFFF_FFFF) as u32;
        let s = self.slots.get(slot as usize).filter(|s| u64::from(s.gen) == t.0 >> 32)?;
        let e = s.entry.as_ref().filter(|e| !e.replica)?;
        Some(FlowReplica {
            fairness_id: self.fairness_of(e).to_string(),
            priority: e.priority,
            enqueue_ms: e.enqueue_ms,
            bytes: e.bytes,
            tokens: e.tokens,
            cost: e.cost,
            slo_ttft_ms: e.slo_ttft_ms,
            ttl_ms: e.ttl_ms,
        })
    }

    /// Queue a replica of another router's queued request, unconditionally (its owner admitted
    /// it), in arrival order here, with the owner's enqueue time for its deadlines. It is
    /// released like any request (and reported by [`FlowController::drain`]) but never counted:
    /// its owner counts it. A replica released to be dispatched counts as load until
    /// [`FlowController::forget_replica`] or the grace. `None` after `shutdown`.
    pub fn enqueue_replica(&mut self, ctx: &Ctx<'_>, r: &FlowReplica, now_ms: u64) -> Option<Ticket> {
        if self.shutdown {
            return None;
        }
        self.advance(now_ms);
        let f = ctx.flow();
        let b = self.band_for(f, r.priority) as usize;
        let e = Entry {
            seq: 0,
            band: b as u16,
            flow: 0,
            enqueue_ms: r.enqueue_ms,
            expires_ms: NO_DEADLINE,
            bytes: r.bytes,
            tokens: r.tokens,
            cost: r.cost,
            priority: r.priority,
            slo_ttft_ms: r.slo_ttft_ms,
            ttl_ms: r.ttl_ms,
            replica: true,
        };
        Some(self.enqueue(b, &r.fairness_id, e, None))
    }

    /// The owner's request of replica `t` left its queue (dispatched, dropped or cancelled
    /// there): remove the replica wherever it is here: queued, released and not taken, or
    /// counted as load after its release. True when it was found; own tickets are never touched.
    pub fn forget_replica(&mut self, t: Ticket) -> bool {
        let slot = (t.0 & 0xFFFF_FFFF) as u32;
        let queued = self
            .slots
            .get(slot as usize)
            .is_some_and(|s| u64::from(s.gen) == t.0 >> 32 && s.entry.as_ref().is_some_and(|e| e.replica));
        if queued {
            return self.take(slot, Leave::Direct).is_some();
        }
        let before = self.releases.len() + self.replica_pending.len();
        self.releases.retain(|h| !(h.replica && h.release.ticket == t));
        self.replica_pending.retain(|&(_, _, tk)| tk != t);
        self.releases.len() + self.replica_pending.len() < before
    }

    /// Move the releases made so far into `out`, counting them and recording their waits.
    pub fn drain(&mut self, out: &mut Vec<Release>) {
        out.reserve(self.releases.len());
        for h in self.releases.drain(..) {
            if h.replica {
                out.push(h.release);
                continue;
            }
            let outcome = match h.release.outcome {
                ReleaseOutcome::Dispatched => {
                    self.counters.dispatched += 1;
                    Outcome::Dispatched
                }
                ReleaseOutcome::Dropped(rej) => {
                    self.counters.rejections.bump(rej.reason);
                    Outcome::Dropped(rej.reason)
                }
            };
            self.metrics.observe(&h.fairness, h.priority, outcome, h.release.waited_ms);
            out.push(h.release);
        }
    }

    /// Drop every queued request with 503 `rejected-shutting-down`; later admissions are
    /// rejected the same way.
    pub fn shutdown(&mut self, now_ms: u64) {
        let now = self.advance(now_ms);
        self.shutdown = true;
        for slot in self.live_in_order() {
            self.drop_entry(slot, Leave::Direct, DropReason::RejectedShuttingDown, now);
        }
    }

    /// Live slots by band priority (highest first), then arrival.
    fn live_in_order(&self) -> Vec<u32> {
        let mut live: Vec<(i32, u64, u32)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.entry.as_ref().map(|e| (self.bands[e.band as usize].priority, e.seq, i as u32)))
            .collect();
        live.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        live.into_iter().map(|(_, _, s)| s).collect()
    }

    /// Rebuild bands, schedules and heaps from the live entries under the (possibly new) policy
    /// in `ctx`; with `enforce_limits`, requests over the new limits are dropped with
    /// `evicted-queue-pressure` (lowest priority, newest first). Tickets do not change.
    fn rebuild(&mut self, ctx: &Ctx<'_>, now: u64, enforce_limits: bool) {
        let f = ctx.flow();
        let scale = self.service_scale(f, now);
        // Attained service worth keeping: flows with queued requests, and the most served idle
        // ones (more than one token of decayed service left).
        let mut kept: Vec<(i32, Arc<str>, f64)> = Vec::new();
        let mut idle: Vec<(i32, Arc<str>, f64)> = Vec::new();
        for band in &self.bands {
            for fl in &band.queues.flows {
                if fl.queued > 0 {
                    kept.push((band.priority, fl.id.clone(), fl.service));
                } else if fl.service / scale > 1.0 {
                    idle.push((band.priority, fl.id.clone(), fl.service));
                }
            }
        }
        idle.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0)).then(a.1.cmp(&b.1)));
        idle.truncate(RETAINED_IDLE_FLOWS);
        kept.extend(idle);
        let mut entries: Vec<(u32, Entry, Arc<str>)> = Vec::with_capacity(self.queued as usize);
        let order = self.live_in_order();
        for slot in order {
            let Some(e) = self.slots[slot as usize].entry.take() else { continue };
            let id = self.bands[e.band as usize].queues.flows[e.flow as usize].id.clone();
            entries.push((slot, e, id));
        }
        self.configure_bands(f);
        self.expiry.clear();
        self.queued = 0;
        self.queued_bytes = 0;
        self.stale = 0;
        for (priority, id, service) in kept {
            let b = self.band_for(f, priority) as usize;
            let before = self.bands[b].queues.flows.len();
            let flow = self.bands[b].queues.flow(&id);
            self.flows_total += (self.bands[b].queues.flows.len() - before) as u64;
            self.bands[b].queues.charge(flow, service);
        }
        for (slot, e, id) in entries {
            let b = self.band_for(f, e.priority) as usize;
            if enforce_limits && (!self.fits_band(b, e.bytes) || !self.fits_global(f, 1, e.bytes)) {
                let t = ticket(self.slots[slot as usize].gen, slot);
                self.slots[slot as usize].gen = self.slots[slot as usize].gen.wrapping_add(1).max(1);
                self.free.push(slot);
                let reason = Rejection::new(DropReason::EvictedQueuePressure);
                let release = Release {
                    ticket: t,
                    outcome: ReleaseOutcome::Dropped(reason),
                    waited_ms: now.saturating_sub(e.enqueue_ms),
                };
                let (priority, replica) = (self.bands[b].priority, e.replica);
                self.releases.push(Held { release, fairness: id, priority, replica });
                continue;
            }
            self.enqueue(b, &id, e, Some(slot));
        }
    }

    /// Apply a reloaded policy (`ctx` holds the new one). Queued requests are kept and re-evaluated: bands, policies and TTLs are the new
    /// ones, requests over the new limits are dropped (`evicted-queue-pressure`). Turning flow
    /// control off releases every queued request to be routed.
    pub fn reconfigure(&mut self, ctx: &Ctx<'_>) {
        let f = ctx.flow();
        let now = self.last_now;
        self.metrics.set_max_labels(f.metrics_fairness_ids);
        if !f.enabled {
            for slot in self.live_in_order() {
                self.release(slot, Leave::Direct, None, now);
            }
            self.rebuild(ctx, now, false);
            return;
        }
        self.rebuild(ctx, now, true);
    }

    /// When flow control will next act without any other call: the soonest queue deadline (TTL),
    /// no-endpoint deadline (while the pool is empty) or lapse of a released request's load;
    /// `None` when nothing is queued. It may be early (a deadline of a request that left
    /// meanwhile), never late.
    pub fn next_deadline(&self, ctx: &Ctx<'_>) -> Option<u64> {
        if self.queued == 0 {
            return None;
        }
        let ttl = self.expiry.peek().map(|&Reverse((at, _, _))| at);
        let replica = self.replica_pending.iter().map(|&(at, _, _)| at).min();
        let pending = self.pending.front().map(|&(at, _)| at).into_iter().chain(replica).min();
        let pending = pending.map(|at| at.saturating_add(PENDING_GRACE_MS));
        let no_endpoints = saturation::measure(ctx.policy, ctx.endpoints, self.last_now).no_endpoints();
        let empty_pool = if no_endpoints {
            let ne = ctx.flow().no_endpoints_ttl_ms;
            let oldest = self
                .order
                .iter()
                .filter_map(|&b| self.bands[b as usize].fifo.front())
                .filter_map(|&(_, slot)| self.slots.get(slot as usize)?.entry.as_ref().map(|e| e.enqueue_ms))
                .min();
            oldest.map(|t| t.saturating_add(ne))
        } else {
            None
        };
        [ttl, pending, empty_pool].into_iter().flatten().min()
    }

    /// The pool's saturation at `now_ms`, as flow control sees it.
    pub fn saturation(&self, ctx: &Ctx<'_>, now_ms: u64) -> SaturationReport {
        let now = self.last_now.max(now_ms);
        let mut s = saturation::measure(ctx.policy, ctx.endpoints, now);
        let replicas = self.replica_pending.iter().map(|&(at, tk, _)| (at, tk));
        let live =
            self.pending.iter().copied().chain(replicas).filter(|&(at, _)| at.saturating_add(PENDING_GRACE_MS) > now);
        let (n, tokens) = live.fold((0u64, 0u64), |(n, t), (_, tk)| (n + 1, t.saturating_add(tk)));
        s.add_pending(n, tokens);
        SaturationReport {
            pool: if s.no_endpoints() { 0.0 } else { s.value() },
            decode: s.decode.value,
            prefill: (s.prefill.endpoints > 0).then_some(s.prefill.value),
            decode_endpoints: s.decode.endpoints,
        }
    }

    /// A snapshot.
    pub fn stats(&self, enabled: bool) -> FlowStats {
        let bands = self
            .order
            .iter()
            .map(|&b| {
                let band = &self.bands[b as usize];
                BandStats {
                    priority: band.priority,
                    queued: band.queued,
                    queued_bytes: band.bytes,
                    active_flows: band.queues.active_flows() as u64,
                    ceiling: band.ceiling,
                    fairness_policy: band.params.fairness,
                    ordering_policy: band.params.ordering,
                }
            })
            .collect();
        FlowStats {
            enabled,
            queued: self.queued,
            queued_bytes: self.queued_bytes,
            releases_waiting: self.releases.len() as u64,
            pending_dispatch: (self.pending.len() + self.replica_pending.len()) as u64,
            shutting_down: self.shutdown,
            bands,
            counters: self.counters.clone(),
        }
    }

    /// The flow-control part of the metrics page.
    pub fn expose(&self, ctx: &Ctx<'_>, now_ms: u64, e: &mut Exposition) {
        let stats = self.stats(true);
        e.header("kvroute_flow_queue_depth", "gauge", "Requests queued by flow control, per priority band.");
        for b in &stats.bands {
            e.sample("kvroute_flow_queue_depth", &[("priority", &b.priority.to_string())], b.queued as f64);
        }
        e.header("kvroute_flow_queue_bytes", "gauge", "Request bytes queued by flow control, per priority band.");
        for b in &stats.bands {
            e.sample("kvroute_flow_queue_bytes", &[("priority", &b.priority.to_string())], b.queued_bytes as f64);
        }
        let s = self.saturation(ctx, now_ms);
        e.header(
            "kvroute_flow_saturation",
            "gauge",
            "Pool saturation as flow control measures it (1 = saturated), by stage.",
        );
        e.sample("kvroute_flow_saturation", &[("stage", "pool")], s.pool);
        e.sample("kvroute_flow_saturation", &[("stage", "decode")], s.decode);
        if let Some(p) = s.prefill {
            e.sample("kvroute_flow_saturation", &[("stage", "prefill")], p);
        }
        e.header("kvroute_flow_rejections_total", "counter", "Requests flow control rejected or dropped, by reason.");
        for r in DropReason::ALL {
            e.sample(
                "kvroute_flow_rejections_total",
                &[("reason", r.as_str())],
                stats.counters.rejections.get(r) as f64,
            );
        }
        let c = &stats.counters;
        for (name, help, v) in [
            ("kvroute_flow_admitted_total", "Requests flow control admitted at once.", c.admitted),
            ("kvroute_flow_enqueued_total", "Requests flow control queued.", c.enqueued),
            ("kvroute_flow_dispatched_total", "Queued requests released to be routed.", c.dispatched),
            ("kvroute_flow_cancelled_total", "Queued requests cancelled (client gone).", c.cancelled),
            ("kvroute_flow_shed_total", "Sheddable requests shed before queueing.", c.shed),
        ] {
            e.header(name, "counter", help);
            e.sample(name, &[], v as f64);
        }
        // Releases not taken yet are recorded when taken.
        self.metrics.expose(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Policy;
    use crate::endpoints::{EndpointSpec, Role};

    fn setup(flow: &str) -> (Policy, EndpointTable) {
        let p = Policy::from_json(&format!(r#"{{"flow_control":{flow}}}"#)).unwrap();
        let mut t = EndpointTable::default();
        t.insert(&EndpointSpec::new("10.0.0.1:1", Role::Decode), |_| true);
        (p, t)
    }

    fn req(id: &str) -> RouteRequest {
        let mut r = RouteRequest::text("m", "hello");
        r.fairness_id = Some(id.to_owned());
        r
    }

    #[test]
    fn idle_flows_are_forgotten() {
        let (p, t) = setup(
            r#"{"enabled":true,"saturation_detector":{"kind":"concurrency","max_requests_per_endpoint":1000000},
                "default_priority_band":{"fairness_policy":"attained_service"}}"#,
        );
        let ctx = Ctx { policy: p.config(), endpoints: &t };
        let mut c = FlowController::new(p.config());
        for i in 0..20_000u64 {
            assert_eq!(c.admit(&ctx, &req(&format!("tenant-{i}")), 10, i), Admission::Admit);
            c.routed();
        }
        assert!(c.flows_total <= 2 * c.queued + COMPACT_SLACK, "{}", c.flows_total);
    }

    fn drain(c: &mut FlowController) -> Vec<Release> {
        let mut out = Vec::new();
        c.drain(&mut out);
        out
    }

    #[test]
    fn replicas_queue_in_arrival_order_count_as_load_and_are_never_counted() {
        let (p, mut t) =
            setup(r#"{"enabled":true,"saturation_detector":{"kind":"concurrency","max_requests_per_endpoint":1}}"#);
        // The owner: a second controller over the same pool.
        let mut owner = FlowController::new(p.config());
        let mut c = FlowController::new(p.config());
        let ctx = Ctx { policy: p.config(), endpoints: &t };
        assert_eq!(owner.admit(&ctx, &req("x"), 10, 0), Admission::Admit);
        owner.routed();
        assert_eq!(c.admit(&ctx, &req("x"), 10, 0), Admission::Admit);
        c.routed();
        let slot = t.slot_of("10.0.0.1:1").unwrap();
        t.get_mut(slot).unwrap().load.set_requests(1);
        let ctx = Ctx { policy: p.config(), endpoints: &t };
        let mine1 = c.admit(&ctx, &req("t"), 10, 1).ticket().unwrap();
        let theirs = owner.admit(&ctx, &req("t"), 20, 2).ticket().unwrap();
        let r = owner.replica(theirs).unwrap();
        assert_eq!((r.fairness_id.as_str(), r.priority, r.enqueue_ms, r.bytes), ("t", 0, 2, 20));
        assert!(owner.replica(Ticket(12345)).is_none());
        let rep = c.enqueue_replica(&ctx, &r, 3).unwrap();
        assert!(c.replica(rep).is_none(), "a replica is not described again");
        let mine2 = c.admit(&ctx, &req("t"), 10, 4).ticket().unwrap();
        assert_eq!(c.stats(true).queued, 3);
        // One slot frees: own, replica, own, in arrival order (one per completion).
        let mut order = Vec::new();
        for now in [10, 20, 30] {
            t.get_mut(slot).unwrap().load.set_requests(0);
            let ctx = Ctx { policy: p.config(), endpoints: &t };
            c.pump(&ctx, now);
            let rs = drain(&mut c);
            assert_eq!(rs.len(), 1, "{rs:?}");
            order.push(rs[0].ticket);
            if rs[0].ticket == rep {
                assert_eq!(rs[0].waited_ms, 18, "the owner's enqueue time");
                // The replica's dispatch holds the slot until its owner's request is routed.
                c.pump(&ctx, now + 1);
                assert!(drain(&mut c).is_empty());
                assert!(c.forget_replica(rep));
                assert!(!c.forget_replica(rep));
            } else {
                c.routed();
            }
            t.get_mut(slot).unwrap().load.set_requests(1);
        }
        assert_eq!(order, vec![mine1, rep, mine2]);
        let k = c.stats(true).counters;
        assert_eq!((k.enqueued, k.dispatched, k.cancelled), (2, 2, 0), "the replica is its owner's to count");
        assert!(!c.forget_replica(mine1), "own tickets are never forgotten");
    }

    #[test]
    fn a_forgotten_replica_leaves_the_queue_and_its_ttl_is_the_owners() {
        let (p, mut t) = setup(
            r#"{"enabled":true,"saturation_detector":{"kind":"concurrency","max_requests_per_endpoint":1},"default_request_ttl_ms":100}"#,
        );
        let slot = t.slot_of("10.0.0.1:1").unwrap();
        t.get_mut(slot).unwrap().load.set_requests(1);
        let ctx = Ctx { policy: p.config(), endpoints: &t };
        let mut c = FlowController::new(p.config());
        let r = FlowReplica {
            fairness_id: "t".into(),
            priority: 0,
            enqueue_ms: 50,
            bytes: 10,
            tokens: 20,
            cost: 20.0,
            slo_ttft_ms: None,
            ttl_ms: None,
        };
        let a = c.enqueue_replica(&ctx, &r, 60).unwrap();
        let b = c.enqueue_replica(&ctx, &r, 60).unwrap();
        assert!(!c.cancel(a), "replicas are not cancelled, they are forgotten");
        assert!(c.forget_replica(a));
        assert_eq!(c.stats(true).queued, 1);
        c.pump(&ctx, 149);
        assert!(drain(&mut c).is_empty());
        c.pump(&ctx, 150);
        let rs = drain(&mut c);
        assert_eq!(rs.len(), 1);
        assert_eq!((rs[0].ticket, rs[0].waited_ms), (b, 100));
        assert_eq!(c.stats(true).counters.rejections.total(), 0);
        c.shutdown(200);
        assert!(c.enqueue_replica(&ctx, &r, 200).is_none());
    }

    #[test]
    fn stale_entries_are_compacted_and_tickets_stay_unique() {
        let (p, t) = setup(
            r#"{"enabled":true,"max_requests":0,"saturation_detector":{"kind":"concurrency","max_requests_per_endpoint":1}}"#,
        );
        let ctx = Ctx { policy: p.config(), endpoints: &t };
        let mut c = FlowController::new(p.config());
        assert_eq!(c.admit(&ctx, &req("a"), 10, 0), Admission::Admit);
        let mut seen = std::collections::BTreeSet::new();
        let keep = c.admit(&ctx, &req("keep"), 10, 0);
        let keep = keep.ticket().unwrap_or_else(|| panic!("{keep:?}"));
        for i in 0..50_000u64 {
            // At one instant: the first admission's load (never routed) keeps the pool full.
            let tk = c.admit(&ctx, &req(&format!("t{}", i % 100)), 10, 0).ticket().unwrap();
            assert_ne!(tk.0, 0);
            assert!(seen.insert(tk), "ticket {tk} issued twice");
            assert!(c.cancel(tk));
        }
        assert_eq!(c.queued, 1);
        let held: usize = c.bands.iter().map(|b| b.queues.held() + b.fifo.len()).sum::<usize>() + c.expiry.len();
        assert!(held < 3 * (2 * COMPACT_SLACK as usize), "stale entries kept: {held}");
        assert!(c.slots.len() <= 3, "slots are reused: {}", c.slots.len());
        // The survivor kept its ticket through the compactions.
        assert!(c.cancel(keep));
    }
}

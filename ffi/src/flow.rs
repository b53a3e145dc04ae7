//! Flow control through the C API: admit (admit now, a ticket, or a rejection), take releases
//! into a caller's buffer, cancel, tick, the next deadline, shutdown, stats.
//!
//! The call protocol is the core's (documented on `kvroute::Admission`); these functions only
//! convert arguments and results. One thing lives here and not in the core: the core hands over
//! every release at once, so the ones that did not fit the caller's buffer are kept by the
//! router handle ([`Held`]), in order, and handed out first by the next
//! `kvroute_router_take_releases`; `kvroute_router_cancel` finds tickets there too, so no ticket
//! is lost and none ends twice. The stats views count a kept release when the caller takes it
//! (as the core counts a release when it is taken), a cancelled one as cancelled.

use std::ffi::{c_char, CStr};
use std::sync::{MutexGuard, PoisonError};

use kvroute::{Admission, DropReason, FlowStats, Rejection, RejectionCounts, Release, ReleaseOutcome, Router, Ticket};

use crate::error::{guard, guard_value, kvroute_result, Error, Result, KVROUTE_RESULT_BUFFER_TOO_SMALL};
use crate::ptr;
use crate::router::{header_pairs, kvroute_header, kvroute_router};

/// What flow control said about a request (`kvroute_admission::kind`).
pub type kvroute_admission_kind = u32;
/// Route the request now (`kvroute_router_route`), as without flow control.
pub const KVROUTE_ADMISSION_ADMIT: kvroute_admission_kind = 1;
/// Hold the request (do not route it) until its ticket comes back from
/// `kvroute_router_take_releases`.
pub const KVROUTE_ADMISSION_QUEUED: kvroute_admission_kind = 2;
/// Refuse the request: answer `rejection.status` with the header
/// `x-llm-d-request-dropped-reason: rejection.reason_name`.
pub const KVROUTE_ADMISSION_REJECTED: kvroute_admission_kind = 3;

/// How a held request's wait ended (`kvroute_release::outcome`).
pub type kvroute_release_outcome = u32;
/// Route the held request now.
pub const KVROUTE_RELEASE_DISPATCHED: kvroute_release_outcome = 1;
/// Answer the held request's client with `rejection` (status and reason header).
pub const KVROUTE_RELEASE_DROPPED: kvroute_release_outcome = 2;

/// Why flow control refused or dropped a request: the core's stable reason codes
/// (`DropReason::code`); the header value is `kvroute_drop_reason_name`.
pub type kvroute_drop_reason = u32;
/// Not refused (the `reason` of an admitted, queued or dispatched request).
pub const KVROUTE_DROP_REASON_NONE: kvroute_drop_reason = 0;
/// `rejected-saturated` (429): the queue is full, or a sheddable request was shed before
/// queueing.
pub const KVROUTE_DROP_REASON_REJECTED_SATURATED: kvroute_drop_reason = 1;
/// `rejected-ttl-expired` (429): the request waited its whole queue TTL.
pub const KVROUTE_DROP_REASON_REJECTED_TTL_EXPIRED: kvroute_drop_reason = 2;
/// `rejected-no-endpoints` (503): the pool has no healthy decode-capable endpoint.
pub const KVROUTE_DROP_REASON_REJECTED_NO_ENDPOINTS: kvroute_drop_reason = 3;
/// `rejected-shutting-down` (503): `kvroute_router_shutdown_queue` was called.
pub const KVROUTE_DROP_REASON_REJECTED_SHUTTING_DOWN: kvroute_drop_reason = 4;
/// `evicted-priority` (429): a queued sheddable request made room for a higher-priority one.
pub const KVROUTE_DROP_REASON_EVICTED_PRIORITY: kvroute_drop_reason = 5;
/// `evicted-queue-pressure` (429): a reload lowered the limits below what was queued.
pub const KVROUTE_DROP_REASON_EVICTED_QUEUE_PRESSURE: kvroute_drop_reason = 6;

/// A refusal: answer `status` with the header `x-llm-d-request-dropped-reason`
/// (`kvroute_header_dropped_reason()`) set to `reason_name`. All zero (and `reason_name` NULL)
/// when the request was not refused.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvroute_rejection {
    /// HTTP status: 429 or 503 (0 when not refused).
    pub status: u16,
    /// Why (`KVROUTE_DROP_REASON_*`).
    pub reason: kvroute_drop_reason,
    /// The header value (`"rejected-saturated"`, ...): a static string, never free it; NULL when
    /// not refused.
    pub reason_name: *const c_char,
}

/// The answer of `kvroute_router_admit`.
#[repr(C)]
pub struct kvroute_admission {
    /// `KVROUTE_ADMISSION_ADMIT`, `_QUEUED` or `_REJECTED`.
    pub kind: kvroute_admission_kind,
    /// The ticket (`_QUEUED` only; never 0), else 0.
    pub ticket: u64,
    /// The refusal (`_REJECTED` only), else all zero.
    pub rejection: kvroute_rejection,
}

/// One ticket's end, from `kvroute_router_take_releases`.
#[repr(C)]
pub struct kvroute_release {
    /// The ticket `kvroute_router_admit` returned.
    pub ticket: u64,
    /// `KVROUTE_RELEASE_DISPATCHED` (route the request now) or `KVROUTE_RELEASE_DROPPED`
    /// (answer with `rejection`).
    pub outcome: kvroute_release_outcome,
    /// The refusal (`_DROPPED` only), else all zero.
    pub rejection: kvroute_rejection,
    /// How long the request waited in the queue, milliseconds.
    pub waited_ms: u64,
}

/// Flow control's counters and queue sizes (`kvroute_router_flow_stats`). Releases count as
/// dispatched or rejected when `kvroute_router_take_releases` hands them out.
#[repr(C)]
pub struct kvroute_flow_stats {
    /// `flow_control.enabled` of the active policy.
    pub enabled: bool,
    /// `kvroute_router_shutdown_queue` was called.
    pub shutting_down: bool,
    /// Requests queued.
    pub queued: u64,
    /// Request bytes queued.
    pub queued_bytes: u64,
    /// Releases made and not yet taken by `kvroute_router_take_releases` (held by the core or
    /// by the router handle).
    pub releases_waiting: u64,
    /// Requests released (or admitted) and not routed yet: they count as load.
    pub pending_dispatch: u64,
    /// Priority bands (`kvroute_router_flow_bands`).
    pub bands: u64,
    /// Requests admitted at once.
    pub admitted: u64,
    /// Requests queued (tickets issued).
    pub enqueued: u64,
    /// Tickets released to be routed.
    pub dispatched: u64,
    /// Tickets cancelled.
    pub cancelled: u64,
    /// Sheddable requests shed before queueing (also in `rejections`, as rejected-saturated).
    pub shed: u64,
    /// Rejections (at admission and of queued requests) by reason, indexed by
    /// `kvroute_drop_reason` (index 0, `KVROUTE_DROP_REASON_NONE`, stays 0).
    pub rejections: [u64; 7],
}

/// One priority band's queue (`kvroute_router_flow_bands`).
#[repr(C)]
pub struct kvroute_flow_band {
    /// The band's priority (higher dispatches first; negative is sheddable).
    pub priority: i32,
    /// Requests queued.
    pub queued: u64,
    /// Request bytes queued.
    pub queued_bytes: u64,
    /// Flows (fairness ids) with queued requests.
    pub active_flows: u64,
    /// The band dispatches while saturation is below this (after the priority holdback).
    pub ceiling: f64,
}

/// The pool's saturation as flow control measures it (`kvroute_router_flow_saturation`).
#[repr(C)]
pub struct kvroute_flow_saturation {
    /// What the bands' ceilings are compared with.
    pub pool: f64,
    /// The decode pool (endpoints with role decode or both).
    pub decode: f64,
    /// Whether there is a prefill pool (`prefill` is then set).
    pub has_prefill: bool,
    /// The prefill pool (0 when `has_prefill` is false).
    pub prefill: f64,
    /// Healthy decode-capable endpoints (0: no endpoints).
    pub decode_endpoints: u32,
}

fn reason_out(r: DropReason) -> kvroute_drop_reason {
    kvroute_drop_reason::from(r.code())
}

fn reason_cstr(reason: kvroute_drop_reason) -> Option<&'static CStr> {
    Some(match reason {
        KVROUTE_DROP_REASON_REJECTED_SATURATED => c"rejected-saturated",
        KVROUTE_DROP_REASON_REJECTED_TTL_EXPIRED => c"rejected-ttl-expired",
        KVROUTE_DROP_REASON_REJECTED_NO_ENDPOINTS => c"rejected-no-endpoints",
        KVROUTE_DROP_REASON_REJECTED_SHUTTING_DOWN => c"rejected-shutting-down",
        KVROUTE_DROP_REASON_EVICTED_PRIORITY => c"evicted-priority",
        KVROUTE_DROP_REASON_EVICTED_QUEUE_PRESSURE => c"evicted-queue-pressure",
        _ => return None,
    })
}

const NO_REJECTION: kvroute_rejection =
    kvroute_rejection { status: 0, reason: KVROUTE_DROP_REASON_NONE, reason_name: std::ptr::null() };

fn rejection_out(r: Rejection) -> kvroute_rejection {
    let reason = reason_out(r.reason);
    kvroute_rejection {
        status: r.status,
        reason,
        reason_name: reason_cstr(reason).map_or(std::ptr::null(), CStr::as_ptr),
    }
}

fn admission_out(a: Admission) -> kvroute_admission {
    match a {
        Admission::Admit => kvroute_admission { kind: KVROUTE_ADMISSION_ADMIT, ticket: 0, rejection: NO_REJECTION },
        Admission::Queued(t) => {
            kvroute_admission { kind: KVROUTE_ADMISSION_QUEUED, ticket: t.0, rejection: NO_REJECTION }
        }
        Admission::Rejected(r) => {
            kvroute_admission { kind: KVROUTE_ADMISSION_REJECTED, ticket: 0, rejection: rejection_out(r) }
        }
    }
}

fn release_out(r: &Release) -> kvroute_release {
    let (outcome, rejection) = match r.outcome {
        ReleaseOutcome::Dispatched => (KVROUTE_RELEASE_DISPATCHED, NO_REJECTION),
        ReleaseOutcome::Dropped(rej) => (KVROUTE_RELEASE_DROPPED, rejection_out(rej)),
    };
    kvroute_release { ticket: r.ticket.0, outcome, rejection, waited_ms: r.waited_ms }
}

/// The router handle behind a pointer.
///
/// # Safety
///
/// `router` is NULL or a live handle from `kvroute_router_new`.
unsafe fn handle<'a>(router: *const kvroute_router) -> Result<&'a kvroute_router> {
    // SAFETY: forwarded contract.
    unsafe { ptr::obj(router, "router") }
}

/// What a router handle keeps of flow control (in `kvroute_router::held`).
#[derive(Debug, Default)]
pub(crate) struct Held {
    /// Releases the core handed over that did not fit the caller's buffer, oldest first.
    releases: Vec<Release>,
    /// Kept releases cancelled before the caller took them: the core counted them as
    /// dispatched or dropped when it handed them over; the stats views count them as cancelled.
    cancelled_dispatched: u64,
    /// The same for dropped releases, by reason code.
    cancelled_dropped: [u64; 7],
}

fn rejection_count(c: &mut RejectionCounts, reason: DropReason) -> &mut u64 {
    match reason {
        DropReason::RejectedSaturated => &mut c.rejected_saturated,
        DropReason::RejectedTtlExpired => &mut c.rejected_ttl_expired,
        DropReason::RejectedNoEndpoints => &mut c.rejected_no_endpoints,
        DropReason::RejectedShuttingDown => &mut c.rejected_shutting_down,
        DropReason::EvictedPriority => &mut c.evicted_priority,
        DropReason::EvictedQueuePressure => &mut c.evicted_queue_pressure,
    }
}

impl Held {
    /// Flow stats as the caller sees them: a kept release is still waiting (not dispatched or
    /// rejected yet), a cancelled kept release is cancelled.
    pub(crate) fn adjust(&self, s: &mut FlowStats) {
        let mut dispatched = self.cancelled_dispatched;
        let mut dropped = self.cancelled_dropped;
        for r in &self.releases {
            match r.outcome {
                ReleaseOutcome::Dispatched => dispatched += 1,
                ReleaseOutcome::Dropped(rej) => dropped[usize::from(rej.reason.code()) % 7] += 1,
            }
        }
        let c = &mut s.counters;
        c.dispatched = c.dispatched.saturating_sub(dispatched);
        for reason in DropReason::ALL {
            let n = rejection_count(&mut c.rejections, reason);
            *n = n.saturating_sub(dropped[usize::from(reason.code()) % 7]);
        }
        c.cancelled += self.cancelled_dispatched + self.cancelled_dropped.iter().sum::<u64>();
        s.releases_waiting += self.releases.len() as u64;
    }

    /// Remove the kept release of `ticket`; true when there was one.
    fn cancel(&mut self, ticket: u64) -> bool {
        let Some(i) = self.releases.iter().position(|rel| rel.ticket.0 == ticket) else { return false };
        match self.releases.remove(i).outcome {
            ReleaseOutcome::Dispatched => self.cancelled_dispatched += 1,
            ReleaseOutcome::Dropped(rej) => self.cancelled_dropped[usize::from(rej.reason.code()) % 7] += 1,
        }
        true
    }
}

impl kvroute_router {
    /// What the handle keeps. A panic while it was locked leaves it consistent (releases are
    /// only appended by the core and removed after they were copied), so poisoning is ignored.
    pub(crate) fn held(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn core(&self) -> &Router {
        &self.inner
    }
}

/// Ask flow control about one HTTP request (the body and headers `kvroute_router_route` takes)
/// at `now_ms`, before routing it, and store the answer in `*out` (written only on success):
///
/// - `KVROUTE_ADMISSION_ADMIT`: route it now with `kvroute_router_route`;
/// - `KVROUTE_ADMISSION_QUEUED`: hold it (do not route it) until `out->ticket` comes back from
///   `kvroute_router_take_releases`; call `kvroute_router_cancel` if its client goes away;
/// - `KVROUTE_ADMISSION_REJECTED`: answer `out->rejection.status` with the header
///   `x-llm-d-request-dropped-reason: out->rejection.reason_name`; done.
///
/// The request's flow is its fairness id (`x-llm-d-inference-fairness-id`) and priority
/// (`x-llm-d-inference-objective`, `x-kvroute-priority`); its size is `body_len`. With flow
/// control off (the default) the answer is always ADMIT, so a caller can follow the protocol
/// unconditionally. An admission may also drop queued requests (evicting sheddable ones): their
/// releases wait for `kvroute_router_take_releases`.
///
/// Errors: `KVROUTE_RESULT_REQUEST_ERROR` (the body field in `kvroute_last_error_field`, or the
/// header in `kvroute_last_error_header`), `KVROUTE_RESULT_INVALID_UTF8` (a header).
///
/// Ownership: nothing is kept from the arguments; `*out` is a plain struct whose `reason_name`
/// is a static string (never free it). NULL: `router` and `out` must not be NULL; `body` and
/// `headers` only when their lengths are 0. Thread safety: any thread, concurrently.
///
/// # Safety
///
/// `router` is NULL or a live router; `body` is NULL or valid for `body_len` bytes; `headers`
/// is NULL or valid for `header_count` elements whose pointers are valid for their lengths;
/// `out` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_admit(
    router: *const kvroute_router,
    body: *const c_char,
    body_len: usize,
    headers: *const kvroute_header,
    header_count: usize,
    now_ms: u64,
    out: *mut kvroute_admission,
) -> kvroute_result {
    guard("kvroute_router_admit", || {
        let out = ptr::out(out, "out")?;
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { handle(router) }?;
        // SAFETY: the caller's contract for `body`.
        let body = unsafe { ptr::slice(body.cast::<u8>(), body_len, "body") }?;
        // SAFETY: the caller's contract for `headers`.
        let headers = unsafe { ptr::slice(headers, header_count, "headers") }?;
        // SAFETY: the caller's contract for each header's pointers.
        let pairs = unsafe { header_pairs(headers) }?;
        let a = r.core().admit_http(body, pairs, now_ms)?;
        // SAFETY: `out` is non-NULL and valid for one write by the caller's contract.
        unsafe { ptr::write(out, admission_out(a)) };
        Ok(())
    })
}

/// A dispatch opportunity at `now_ms` (expire requests past their TTL, release what the pool
/// has room for), then copy the releases made since the last call into `buf`, oldest first:
/// each ends one ticket (DISPATCHED: route the held request now; DROPPED: answer with its
/// rejection). Call it after every completion, metrics update, endpoint change and reload, and
/// on a timer while requests are queued (`kvroute_router_next_flow_deadline`).
///
/// Buffer: at most `cap` releases are copied; `*n` receives how many. Releases that do not fit
/// are NOT lost: the router keeps them, in order, and the next call hands them out first (before
/// anything newer); `*remaining` receives how many it keeps (0: all taken). Call again while
/// `*remaining` is not 0 (each call is also a dispatch opportunity, which is harmless).
/// `buf = NULL, cap = 0` takes nothing and tells in `*remaining` how many are waiting. A kept
/// release can still be cancelled, and the stats views (`kvroute_router_flow_stats`, `_json`,
/// `kvroute_router_stats_json`) count it as waiting until a call hands it out. Two differences
/// from a buffer large enough (the core hands over every release at once): the Prometheus page
/// (`kvroute_router_metrics_text`) counts kept releases as dispatched or dropped at once (also a
/// kept one cancelled later), and a kept DISPATCHED release that is cancelled keeps counting as
/// load until its one-second grace lapses (instead of at once).
///
/// Ownership: the releases are copied into the caller's `buf` (plain structs; `reason_name` is
/// a static string, never free it). NULL: `router`, `n` and `remaining` must not be NULL; `buf`
/// may be NULL only when `cap` is 0. `buf`, `*n` and `*remaining` are written only on success.
/// Thread safety: any thread; concurrent callers each get different releases, each release goes
/// to exactly one caller.
///
/// # Safety
///
/// `router` is NULL or a live router; `buf` is NULL or valid for writes of `cap` elements; `n`
/// and `remaining` are NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_take_releases(
    router: *const kvroute_router,
    now_ms: u64,
    buf: *mut kvroute_release,
    cap: usize,
    n: *mut usize,
    remaining: *mut usize,
) -> kvroute_result {
    guard("kvroute_router_take_releases", || {
        let n = ptr::out(n, "n")?;
        let remaining = ptr::out(remaining, "remaining")?;
        if buf.is_null() && cap > 0 {
            return Err(Error::null("buf"));
        }
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { handle(router) }?;
        let mut held = r.held();
        let kept = &mut held.releases;
        // Straight into the kept list: a panic anywhere below loses no release.
        r.core().take_releases_into(now_ms, kept);
        let k = kept.len().min(cap);
        for (i, rel) in kept.iter().take(k).enumerate() {
            // SAFETY: `i < k <= cap` and `buf` is valid for `cap` writes (non-NULL: cap > 0
            // whenever k > 0) by the caller's contract; a plain struct, nothing is dropped.
            unsafe { buf.add(i).write(release_out(rel)) };
        }
        kept.drain(..k);
        // SAFETY: `n` and `remaining` are non-NULL and valid by the caller's contract.
        unsafe {
            ptr::write(n, k);
            ptr::write(remaining, kept.len());
        }
        Ok(())
    })
}

/// A dispatch opportunity at `now_ms` with no other event (expire requests past their TTL,
/// release what the pool has room for). Its releases wait for `kvroute_router_take_releases`
/// (which makes an opportunity itself: call this only when you take releases elsewhere).
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call. NULL:
/// `router` must not be NULL. Thread safety: any thread.
///
/// # Safety
///
/// `router` is NULL or a live router.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_flow_tick(router: *const kvroute_router, now_ms: u64) -> kvroute_result {
    guard("kvroute_router_flow_tick", || {
        // SAFETY: the caller's contract for `router`.
        unsafe { handle(router) }?.core().tick(now_ms);
        Ok(())
    })
}

/// The client of a held request went away: remove its ticket. `*found` (optional, may be NULL;
/// written only on success) is true when the ticket was held (queued, or released and not yet
/// taken): it then never appears in a release; false for a ticket already ended (taken,
/// cancelled) or never issued (0 is never issued).
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call. NULL:
/// `router` must not be NULL. Thread safety: any thread; a ticket ends exactly once, whichever
/// of a concurrent cancel and take comes first.
///
/// # Safety
///
/// `router` is NULL or a live router; `found` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_cancel(
    router: *const kvroute_router,
    ticket: u64,
    found: *mut bool,
) -> kvroute_result {
    guard("kvroute_router_cancel", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { handle(router) }?;
        // Held first, under the lock take_releases moves releases with: the ticket is either
        // there or still in the core.
        let mut held = r.held();
        let hit = held.cancel(ticket) || r.core().cancel(Ticket(ticket));
        drop(held);
        // SAFETY: `found` is NULL or valid by the caller's contract.
        unsafe { ptr::write(found, hit) };
        Ok(())
    })
}

/// Drop every queued request with 503 `rejected-shutting-down` (as releases, for
/// `kvroute_router_take_releases`) and refuse later admissions the same way: for a router about
/// to stop. Releases made before stay as they are.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call. NULL:
/// `router` must not be NULL. Thread safety: any thread.
///
/// # Safety
///
/// `router` is NULL or a live router.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_shutdown_queue(router: *const kvroute_router) -> kvroute_result {
    guard("kvroute_router_shutdown_queue", || {
        // SAFETY: the caller's contract for `router`.
        unsafe { handle(router) }?.core().shutdown_queue();
        Ok(())
    })
}

/// When to call `kvroute_router_take_releases` next if nothing else happens: the soonest time
/// (on the `now_ms` clock) flow control would act on its own (a queue TTL, the no-endpoint TTL
/// while the pool is empty, a released request's load lapsing), stored in `*deadline_ms`
/// (written only on success). It may be early, never late; 0 when the router keeps releases a
/// caller's buffer could not take (take them now). `KVROUTE_RESULT_ABSENT` (not recorded as an
/// error) when nothing is queued or flow control is off. Completions, metrics updates and
/// endpoint changes are opportunities of their own.
///
/// Ownership: `router` stays the caller's; the value is copied out. NULL: `router` and
/// `deadline_ms` must not be NULL. Thread safety: any thread.
///
/// # Safety
///
/// `router` is NULL or a live router; `deadline_ms` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_next_flow_deadline(
    router: *const kvroute_router,
    deadline_ms: *mut u64,
) -> kvroute_result {
    guard("kvroute_router_next_flow_deadline", || {
        let out = ptr::out(deadline_ms, "deadline_ms")?;
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { handle(router) }?;
        let held = r.held();
        let next = if held.releases.is_empty() { r.core().next_flow_deadline() } else { Some(0) };
        drop(held);
        let next = next.ok_or_else(|| Error::absent("a flow-control deadline (nothing is queued)"))?;
        // SAFETY: `out` is non-NULL and valid by the caller's contract.
        unsafe { ptr::write(out, next) };
        Ok(())
    })
}

/// Store flow control's counters and queue sizes in `*out` (written only on success); the
/// bands are copied by `kvroute_router_flow_bands`, everything as JSON by
/// `kvroute_router_flow_stats_json`.
///
/// Ownership: `router` stays the caller's; the snapshot is copied out. NULL: `router` and `out`
/// must not be NULL. Thread safety: any thread.
///
/// # Safety
///
/// `router` is NULL or a live router; `out` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_flow_stats(
    router: *const kvroute_router,
    out: *mut kvroute_flow_stats,
) -> kvroute_result {
    guard("kvroute_router_flow_stats", || {
        let out = ptr::out(out, "out")?;
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { handle(router) }?;
        // The kept releases locked first: none moves between them and the core meanwhile.
        let held = r.held();
        let mut s = r.core().flow_stats();
        held.adjust(&mut s);
        drop(held);
        let c = &s.counters;
        let mut rejections = [0u64; 7];
        for reason in DropReason::ALL {
            if let Some(slot) = rejections.get_mut(reason_out(reason) as usize) {
                *slot = c.rejections.get(reason);
            }
        }
        let stats = kvroute_flow_stats {
            enabled: s.enabled,
            shutting_down: s.shutting_down,
            queued: s.queued,
            queued_bytes: s.queued_bytes,
            releases_waiting: s.releases_waiting,
            pending_dispatch: s.pending_dispatch,
            bands: s.bands.len() as u64,
            admitted: c.admitted,
            enqueued: c.enqueued,
            dispatched: c.dispatched,
            cancelled: c.cancelled,
            shed: c.shed,
            rejections,
        };
        // SAFETY: `out` is non-NULL and valid by the caller's contract.
        unsafe { ptr::write(out, stats) };
        Ok(())
    })
}

/// Copy flow control's priority bands, highest priority first, into `buf` (`cap` elements).
/// `*count` receives the number of bands on `KVROUTE_RESULT_OK` and on
/// `KVROUTE_RESULT_BUFFER_TOO_SMALL` (then `buf` is untouched; bands appear when configured or
/// first used, at most 64 — a buffer of 64 always fits). `buf = NULL, cap = 0` is a size query.
///
/// Ownership: `router` stays the caller's; the bands are copied into the caller's `buf`. NULL:
/// `router` and `count` must not be NULL; `buf` may be NULL only when `cap` is 0. Thread safety:
/// any thread.
///
/// # Safety
///
/// `router` is NULL or a live router; `buf` is NULL or valid for writes of `cap` elements;
/// `count` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_flow_bands(
    router: *const kvroute_router,
    buf: *mut kvroute_flow_band,
    cap: usize,
    count: *mut usize,
) -> kvroute_result {
    guard("kvroute_router_flow_bands", || {
        let count = ptr::out(count, "count")?;
        if buf.is_null() && cap > 0 {
            return Err(Error::null("buf"));
        }
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { handle(router) }?;
        let bands = r.core().flow_stats().bands;
        // SAFETY: `count` is non-NULL and valid by the caller's contract.
        unsafe { ptr::write(count, bands.len()) };
        if bands.len() > cap {
            return Err(Error::new(
                KVROUTE_RESULT_BUFFER_TOO_SMALL,
                format!("a buffer of {cap} bands is too small: {} needed", bands.len()),
            ));
        }
        for (i, b) in bands.iter().enumerate() {
            let band = kvroute_flow_band {
                priority: b.priority,
                queued: b.queued,
                queued_bytes: b.queued_bytes,
                active_flows: b.active_flows,
                ceiling: b.ceiling,
            };
            // SAFETY: `i < bands.len() <= cap`; `buf` is valid for `cap` writes (non-NULL since
            // cap > 0 here) by the caller's contract.
            unsafe { buf.add(i).write(band) };
        }
        Ok(())
    })
}

/// Copy flow control's stats as JSON (the core's form: `enabled`, `queued`, `queued_bytes`,
/// `releases_waiting`, `pending_dispatch`, `shutting_down`, `bands` (with their fairness and
/// ordering policies), `counters`; it may gain fields the structs lack), counted as
/// `kvroute_router_flow_stats` counts. Strings out as in `kvroute_router_policy_json`.
///
/// Ownership: `router` stays the caller's; the text is copied into the caller's `buf`, nothing
/// to free. NULL: `router` must not be NULL; `buf` may be NULL only when `buf_len` is 0;
/// `needed` may be NULL. Thread safety: any thread.
///
/// # Safety
///
/// `router` is NULL or a live router; `buf` is NULL or valid for `buf_len` bytes; `needed` is
/// NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_flow_stats_json(
    router: *const kvroute_router,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    guard("kvroute_router_flow_stats_json", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { handle(router) }?;
        let held = r.held();
        let mut s = r.core().flow_stats();
        held.adjust(&mut s);
        drop(held);
        let text =
            serde_json::to_string(&s).map_err(|e| Error::new(crate::error::KVROUTE_RESULT_INTERNAL, e.to_string()))?;
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_str(text.as_bytes(), buf, buf_len, needed) }
    })
}

/// Store the pool's saturation at `now_ms`, as flow control measures it (under the active
/// policy's detector, whether flow control is on or not), in `*out` (written only on success).
///
/// Ownership: `router` stays the caller's; the value is copied out. NULL: `router` and `out`
/// must not be NULL. Thread safety: any thread.
///
/// # Safety
///
/// `router` is NULL or a live router; `out` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_flow_saturation(
    router: *const kvroute_router,
    now_ms: u64,
    out: *mut kvroute_flow_saturation,
) -> kvroute_result {
    guard("kvroute_router_flow_saturation", || {
        let out = ptr::out(out, "out")?;
        // SAFETY: the caller's contract for `router`.
        let s = unsafe { handle(router) }?.core().flow_saturation(now_ms);
        let sat = kvroute_flow_saturation {
            pool: s.pool,
            decode: s.decode,
            has_prefill: s.prefill.is_some(),
            prefill: s.prefill.unwrap_or(0.0),
            decode_endpoints: s.decode_endpoints,
        };
        // SAFETY: `out` is non-NULL and valid by the caller's contract.
        unsafe { ptr::write(out, sat) };
        Ok(())
    })
}

/// The name of the response header carrying a refusal's reason,
/// `"x-llm-d-request-dropped-reason"` (llm-d's convention). Static string.
///
/// Ownership: the returned string is static: never free it. NULL: takes no pointer. Thread
/// safety: any thread.
#[no_mangle]
pub extern "C" fn kvroute_header_dropped_reason() -> *const c_char {
    guard_value("kvroute_header_dropped_reason", std::ptr::null(), || c"x-llm-d-request-dropped-reason".as_ptr())
}

/// The header value of a reason (`"rejected-saturated"`, `"rejected-ttl-expired"`,
/// `"rejected-no-endpoints"`, `"rejected-shutting-down"`, `"evicted-priority"`,
/// `"evicted-queue-pressure"`), or NULL for `KVROUTE_DROP_REASON_NONE` and unknown values.
/// Static string.
///
/// Ownership: the returned string is static: never free it. NULL: takes no pointer. Thread
/// safety: any thread.
#[no_mangle]
pub extern "C" fn kvroute_drop_reason_name(reason: kvroute_drop_reason) -> *const c_char {
    guard_value("kvroute_drop_reason_name", std::ptr::null(), || {
        reason_cstr(reason).map_or(std::ptr::null(), CStr::as_ptr)
    })
}

/// `"admit"`, `"queued"`, `"rejected"`, or NULL for an unknown value. Static string.
///
/// Ownership: the returned string is static: never free it. NULL: takes no pointer. Thread
/// safety: any thread.
#[no_mangle]
pub extern "C" fn kvroute_admission_kind_name(kind: kvroute_admission_kind) -> *const c_char {
    guard_value("kvroute_admission_kind_name", std::ptr::null(), || match kind {
        KVROUTE_ADMISSION_ADMIT => c"admit".as_ptr(),
        KVROUTE_ADMISSION_QUEUED => c"queued".as_ptr(),
        KVROUTE_ADMISSION_REJECTED => c"rejected".as_ptr(),
        _ => std::ptr::null(),
    })
}

/// `"dispatched"`, `"dropped"`, or NULL for an unknown value. Static string.
///
/// Ownership: the returned string is static: never free it. NULL: takes no pointer. Thread
/// safety: any thread.
#[no_mangle]
pub extern "C" fn kvroute_release_outcome_name(outcome: kvroute_release_outcome) -> *const c_char {
    guard_value("kvroute_release_outcome_name", std::ptr::null(), || match outcome {
        KVROUTE_RELEASE_DISPATCHED => c"dispatched".as_ptr(),
        KVROUTE_RELEASE_DROPPED => c"dropped".as_ptr(),
        _ => std::ptr::null(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(p: *const c_char) -> &'static str {
        assert!(!p.is_null());
        // SAFETY: non-NULL names are static NUL-terminated strings.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap()
    }

    #[test]
    fn reasons_are_the_cores() {
        let mut codes = std::collections::BTreeSet::new();
        for r in DropReason::ALL {
            let code = reason_out(r);
            assert_eq!(s(kvroute_drop_reason_name(code)), r.as_str());
            let rej = rejection_out(Rejection::new(r));
            assert_eq!((rej.status, rej.reason, s(rej.reason_name)), (r.status(), code, r.as_str()));
            assert!(codes.insert(code) && code != KVROUTE_DROP_REASON_NONE && (code as usize) < 7);
        }
        assert!(kvroute_drop_reason_name(KVROUTE_DROP_REASON_NONE).is_null());
        assert!(kvroute_drop_reason_name(7).is_null());
        assert_eq!(s(kvroute_header_dropped_reason()), kvroute::HEADER_DROPPED_REASON);
        // The names of the kinds are the core's JSON names.
        let kinds = [
            (Admission::Admit, KVROUTE_ADMISSION_ADMIT),
            (Admission::Queued(Ticket(3)), KVROUTE_ADMISSION_QUEUED),
            (Admission::Rejected(Rejection::new(DropReason::EvictedPriority)), KVROUTE_ADMISSION_REJECTED),
        ];
        for (a, kind) in kinds {
            let out = admission_out(a);
            assert_eq!(out.kind, kind);
            assert_eq!(out.ticket, a.ticket().map_or(0, |t| t.0));
            assert_eq!(serde_json::to_value(a).unwrap()["admission"], s(kvroute_admission_kind_name(kind)));
        }
        for (o, code) in [
            (ReleaseOutcome::Dispatched, KVROUTE_RELEASE_DISPATCHED),
            (ReleaseOutcome::Dropped(Rejection::new(DropReason::RejectedTtlExpired)), KVROUTE_RELEASE_DROPPED),
        ] {
            let rel = Release { ticket: Ticket(9), outcome: o, waited_ms: 4 };
            let out = release_out(&rel);
            assert_eq!((out.ticket, out.outcome, out.waited_ms), (9, code, 4));
            assert_eq!(serde_json::to_value(rel).unwrap()["outcome"], s(kvroute_release_outcome_name(code)));
        }
        assert!(kvroute_admission_kind_name(0).is_null() && kvroute_release_outcome_name(3).is_null());
    }
}

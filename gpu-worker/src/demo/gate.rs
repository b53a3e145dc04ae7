//! The demo's flow-control gate: where a held request waits, on tokio, following the core's call
//! protocol (`kvroute::Admission`) and nothing else.
//!
//! - [`Gate::admit`] calls `Router::admit_http`; admitted now → the caller routes at once;
//!   refused → the caller answers; queued → the request's task awaits its ticket's release (a
//!   oneshot channel the gate keeps by ticket). Dropping that future while it waits cancels the
//!   ticket (`Router::cancel`), so a client that goes away leaves the queue.
//! - [`Gate::dispatcher`], one task per run, is the dispatch loop: it calls `take_releases` when
//!   woken ([`Gate::wake`]: after every admission, completion and metrics scrape) and when
//!   `next_flow_deadline` says flow control would act on its own (its timer), and hands each
//!   release to the request it belongs to (dispatched: route it; dropped: answer it).
//!
//! The gate never looks at priorities or tenants to decide anything: it only counts the held
//! requests per tenant and priority for the report (the dispatch shares while saturated, and
//! whether a request was refused while a sheddable one was queued).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvroute::{unix_time_ms, Admission, Rejection, Release, ReleaseOutcome, Router, Ticket};
use kvroute_sim::noisy::Dispatch;
use tokio::sync::{oneshot, Notify};

/// A request the gate holds.
struct Waiter {
    tx: oneshot::Sender<(Release, u32)>,
    tenant: usize,
    priority: i32,
}

#[derive(Default)]
struct Held {
    waiters: HashMap<Ticket, Waiter>,
    queued_by_tenant: [u32; 2],
    queued_by_priority: BTreeMap<i32, u32>,
    dispatches: Vec<Dispatch>,
    unknown_releases: u64,
}

impl Held {
    /// Sheddable requests of lower priority than `priority` now held.
    fn sheddable_below(&self, priority: i32) -> u32 {
        self.queued_by_priority.range(..priority.min(0)).map(|(_, n)| n).sum()
    }

    fn remove(&mut self, t: Ticket) -> Option<Waiter> {
        let w = self.waiters.remove(&t)?;
        self.queued_by_tenant[w.tenant] -= 1;
        if let Some(n) = self.queued_by_priority.get_mut(&w.priority) {
            *n -= 1;
        }
        Some(w)
    }
}

/// What the gate says about a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Gated {
    /// Route it now (`waited_ms`: how long it was held, when it was).
    Go {
        /// Held, ms (`None`: admitted at once).
        waited_ms: Option<f64>,
    },
    /// Answer it with `rejection`.
    Refused {
        /// Status and reason.
        rejection: Rejection,
        /// Held, ms, before it was dropped (`None`: refused at admission).
        waited_ms: Option<f64>,
        /// Sheddable requests of lower priority held at that moment.
        sheddable_queued: u32,
    },
    /// The gate ended without releasing it (never expected: see [`Gate::dispatcher`]).
    Lost,
}

/// The gate of one run (see the module docs).
pub(crate) struct Gate {
    router: Arc<Router>,
    held: Mutex<Held>,
    wake: Notify,
    start: Instant,
}

/// Cancels a held ticket when the future waiting for it is dropped before its release.
struct CancelOnDrop<'a> {
    gate: &'a Gate,
    ticket: Option<Ticket>,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            let mut h = self.gate.lock();
            h.remove(t);
            self.gate.router.cancel(t);
        }
    }
}

impl Gate {
    /// A gate in front of `router`; dispatch times are counted from `start`.
    pub(crate) fn new(router: Arc<Router>, start: Instant) -> Gate {
        Gate { router, held: Mutex::new(Held::default()), wake: Notify::new(), start }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A dispatch opportunity happened (a completion, a metrics update): wake the dispatch loop.
    pub(crate) fn wake(&self) {
        self.wake.notify_one();
    }

    /// Admit a request of `tenant` (its priority only counted for the report): resolves when it
    /// may be routed, or with its refusal. Cancellation-safe.
    pub(crate) async fn admit(
        &self,
        body: &[u8],
        headers: &[(&str, &str)],
        tenant: usize,
        priority: i32,
    ) -> Result<Gated, kvroute::RequestError> {
        let (ticket, rx) = {
            // Admission and registering the waiter under one lock: the dispatch loop cannot take
            // this ticket's release before its waiter is there.
            let mut h = self.lock();
            let admission = self.router.admit_http(body, headers.iter().copied(), unix_time_ms())?;
            match admission {
                Admission::Admit => return Ok(Gated::Go { waited_ms: None }),
                Admission::Rejected(rejection) => {
                    let sheddable_queued = h.sheddable_below(priority);
                    drop(h);
                    self.wake();
                    return Ok(Gated::Refused { rejection, waited_ms: None, sheddable_queued });
                }
                Admission::Queued(t) => {
                    let (tx, rx) = oneshot::channel();
                    h.waiters.insert(t, Waiter { tx, tenant, priority });
                    h.queued_by_tenant[tenant] += 1;
                    *h.queued_by_priority.entry(priority).or_insert(0) += 1;
                    (t, rx)
                }
            }
        };
        // The admission may have evicted a queued request: let the loop take that release.
        self.wake();
        let mut guard = CancelOnDrop { gate: self, ticket: Some(ticket) };
        let got = rx.await;
        guard.ticket = None;
        Ok(match got {
            Ok((rel, sheddable_queued)) => match rel.outcome {
                ReleaseOutcome::Dispatched => Gated::Go { waited_ms: Some(rel.waited_ms as f64) },
                ReleaseOutcome::Dropped(rejection) => {
                    Gated::Refused { rejection, waited_ms: Some(rel.waited_ms as f64), sheddable_queued }
                }
            },
            Err(_) => Gated::Lost,
        })
    }

    /// A request of `tenant` was sent to an engine (after `from_queue`: it had been held).
    pub(crate) fn dispatched(&self, tenant: usize, from_queue: bool) {
        let t_s = self.start.elapsed().as_secs_f64();
        let mut h = self.lock();
        let queued = h.queued_by_tenant;
        h.dispatches.push(Dispatch { t_s, tenant, from_queue, queued });
    }

    /// Requests held now, per tenant.
    pub(crate) fn queued(&self) -> [u32; 2] {
        self.lock().queued_by_tenant
    }

    /// One dispatch opportunity: take the releases and hand each to its request.
    fn pump(&self, buf: &mut Vec<Release>) {
        let mut h = self.lock();
        self.router.take_releases_into(unix_time_ms(), buf);
        for rel in buf.drain(..) {
            match h.remove(rel.ticket) {
                Some(w) => {
                    let sheddable = h.sheddable_below(w.priority);
                    // A waiter gone meanwhile cancelled its ticket under this lock: never here.
                    let _ = w.tx.send((rel, sheddable));
                }
                None => h.unknown_releases += 1,
            }
        }
    }

    /// The dispatch loop: runs until `stop` is notified, then ends the queue
    /// (`shutdown_queue`: every request still held is answered 503 `rejected-shutting-down`).
    pub(crate) async fn dispatcher(self: Arc<Self>, stop: Arc<Notify>) {
        let mut buf = Vec::new();
        loop {
            // The timer: when flow control would next act on its own (a TTL, a lapsing load).
            match self.router.next_flow_deadline() {
                Some(at) => {
                    let sleep = Duration::from_millis(at.saturating_sub(unix_time_ms()).max(1));
                    tokio::select! {
                        () = self.wake.notified() => {}
                        () = tokio::time::sleep(sleep) => {}
                        () = stop.notified() => break,
                    }
                }
                None => {
                    tokio::select! {
                        () = self.wake.notified() => {}
                        () = stop.notified() => break,
                    }
                }
            }
            self.pump(&mut buf);
        }
        self.router.shutdown_queue();
        self.pump(&mut buf);
    }

    /// The dispatches made so far, and releases of tickets the gate did not hold (0 expected).
    pub(crate) fn take_dispatches(&self) -> (Vec<Dispatch>, u64) {
        let mut h = self.lock();
        (std::mem::take(&mut h.dispatches), h.unknown_releases)
    }
}

//! Flow control on [`RouterCore`]: admission, releases, cancellation, shutdown (the controller
//! itself is `crate::flow`; the call protocol is documented on [`Admission`]).

use super::state::RouterCore;
use crate::error::RequestError;
use crate::flow::{Admission, Ctx, FlowReplica, FlowStats, Release, SaturationReport, Ticket};
use crate::request::RouteRequest;

impl RouterCore {
    /// Flow control's answer for a request about to be routed, at `now_ms`: route it now, hold
    /// it until its ticket is released, or refuse it. `body_bytes` is its size for the byte
    /// limits (the HTTP body's length). With flow control off, always [`Admission::Admit`].
    ///
    /// The request's flow is its fairness id (header `x-llm-d-inference-fairness-id`, alias
    /// `x-gateway-inference-fairness-id`, else `flow_control.fairness_fallback`, else
    /// `flow_control.default_fairness_id`) and its priority ([`RouteRequest::priority`]). See
    /// [`Admission`] for the whole protocol.
    pub fn admit(&mut self, req: &RouteRequest, body_bytes: u64, now_ms: u64) -> Admission {
        let RouterCore { flow, endpoints, active, .. } = self;
        let policy = active.policy.config();
        if !policy.flow_control.enabled {
            return Admission::Admit;
        }
        flow.admit(&Ctx { policy, endpoints }, req, body_bytes, now_ms)
    }

    /// Parse an HTTP request (body + headers, as [`RouterCore::route_http`] does) and
    /// [`admit`](RouterCore::admit) it, with the body's length as its size.
    pub fn admit_http<K, V>(
        &mut self,
        body: &[u8],
        headers: impl IntoIterator<Item = (K, V)>,
        now_ms: u64,
    ) -> Result<Admission, RequestError>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let req = RouteRequest::parse(body, headers, &self.active.policy.config().request)?;
        Ok(self.admit(&req, body.len() as u64, now_ms))
    }

    /// A dispatch opportunity at `now_ms` with no other event: expire requests past their TTL
    /// and release what the pool has room for. The releases wait for
    /// [`take_releases`](RouterCore::take_releases).
    pub fn tick(&mut self, now_ms: u64) {
        let RouterCore { flow, endpoints, active, .. } = self;
        let policy = active.policy.config();
        if policy.flow_control.enabled {
            flow.pump(&Ctx { policy, endpoints }, now_ms);
        }
    }

    /// A dispatch opportunity at `now_ms` (as [`tick`](RouterCore::tick)), then every release
    /// made since the last call, in order: each ends one ticket (route it, or answer with its
    /// rejection). Call it after completions, metrics updates, endpoint changes, reloads and on a
    /// timer while requests are queued.
    pub fn take_releases(&mut self, now_ms: u64) -> Vec<Release> {
        let mut out = Vec::new();
        self.take_releases_into(now_ms, &mut out);
        out
    }

    /// [`take_releases`](RouterCore::take_releases) into a caller's buffer (appended; no
    /// allocation when it has room).
    pub fn take_releases_into(&mut self, now_ms: u64, out: &mut Vec<Release>) {
        self.tick(now_ms);
        self.flow.drain(out);
    }

    /// The client of a held request went away: remove its ticket. True when the ticket was
    /// held (queued, or released and not yet taken); it then never appears in a release. False
    /// for a ticket already ended or never issued.
    pub fn cancel(&mut self, ticket: Ticket) -> bool {
        self.flow.cancel(ticket)
    }

    /// What another router needs to hold a replica of this router's queued request `ticket`
    /// (see [`FlowReplica`]); `None` when it is not queued.
    pub fn flow_replica(&self, ticket: Ticket) -> Option<FlowReplica> {
        self.flow.replica(ticket)
    }

    /// Hold a replica of another router's queued request (a [`FlowReplica`] that router
    /// described), so that this router's own requests queue behind it as behind its own: the
    /// Envoy filter's worker VMs order their queues against each other this way. It is queued
    /// unconditionally, in arrival order here, with the owner's enqueue time for its deadlines;
    /// its releases appear in [`take_releases`](RouterCore::take_releases) (the caller acts only
    /// on its own tickets) but are never counted here. Released to be dispatched, it counts as
    /// load until [`forget_replica`](RouterCore::forget_replica) (its owner routed it) or for one
    /// second. `None` when flow control is off or shutting down.
    pub fn enqueue_replica(&mut self, replica: &FlowReplica, now_ms: u64) -> Option<Ticket> {
        let RouterCore { flow, endpoints, active, .. } = self;
        let policy = active.policy.config();
        if !policy.flow_control.enabled {
            return None;
        }
        flow.enqueue_replica(&Ctx { policy, endpoints }, replica, now_ms)
    }

    /// The owner's request of the replica `ticket` left the owner's queue (dispatched, dropped
    /// or cancelled there): remove the replica, whether still queued, released and not taken,
    /// or counted as load after its release. True when it was found; never touches this
    /// router's own tickets.
    pub fn forget_replica(&mut self, ticket: Ticket) -> bool {
        self.flow.forget_replica(ticket)
    }

    /// Drop every queued request with 503 `rejected-shutting-down` (as releases) and reject
    /// later admissions the same way (for a router about to stop).
    pub fn shutdown_queue(&mut self) {
        let now = self.books.last_now_ms();
        self.flow.shutdown(now);
    }

    /// When to call [`tick`](RouterCore::tick) next if nothing else happens: the soonest time
    /// flow control would act on its own (a queue TTL, the no-endpoint TTL while the pool is
    /// empty, a released request's load lapsing); `None` when nothing is queued (or flow control
    /// is off). Bindings can arm one timer for it instead of polling; it may be early, never late.
    /// Completions, metrics updates and endpoint changes are opportunities of their own.
    pub fn next_flow_deadline(&self) -> Option<u64> {
        let policy = self.active.policy.config();
        if !policy.flow_control.enabled {
            return None;
        }
        self.flow.next_deadline(&Ctx { policy, endpoints: &self.endpoints })
    }

    /// Flow control's queues and counters.
    pub fn flow_stats(&self) -> FlowStats {
        self.flow.stats(self.active.policy.config().flow_control.enabled)
    }

    /// The pool's saturation at `now_ms` as flow control measures it (under the active
    /// policy's detector, whether flow control is on or not).
    pub fn flow_saturation(&self, now_ms: u64) -> SaturationReport {
        self.flow.saturation(&Ctx { policy: self.active.policy.config(), endpoints: &self.endpoints }, now_ms)
    }
}

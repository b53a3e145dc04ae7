//! The replicas scenario's event loop: the cluster model of [`crate::sim`] (true prefix caches,
//! FIFO prefill, continuous-batching decode, metrics pushed every `metrics_interval_ms` to every
//! replica), N router replicas (each its own [`RouterCore`] over the same endpoints and policy)
//! behind a round-robin spray, and a simulated bus in virtual time:
//!
//! - with sync, a replica that routed or completed something takes its batches
//!   ([`RouterCore::take_replica_batch`]) at the next flush tick (every `flush_interval_ms`);
//!   each batch is appended to the stream and delivered to every other live replica
//!   `latency_ms` later ([`RouterCore::apply_replica_bytes`]); a replica that published
//!   nothing for `heartbeat_interval_ms` publishes an empty batch (checked every heartbeat
//!   interval, when it also drops the requests of silent peers);
//! - kill: the replica's core is dropped with its outbox (a crash); the spray skips it; its
//!   requests still running on the engines finish there, their completions are lost with it.
//!   Restart: a fresh core with a larger epoch, bootstrapped by applying every batch the stream
//!   retains (bounded by age and bytes, in stream order, at the restart instant), then live;
//! - bus outage: nothing is published (the outboxes keep their entries, bounded by
//!   `max_outbox_entries`) and nothing is delivered (deliveries that fall due are held by the
//!   stream); at the end the held deliveries go out in stream order and every outbox is drained.
//!
//! Ties at one instant: the cluster's events first, then the bus's, then arrivals; events of one
//! source in the order they were scheduled. Fully deterministic.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

use kvroute::{EndpointSpec, MetricsSnapshot, ReplicaConfig, ReplicaStats, Role, RouterCore, StateError};

use super::{BusCounters, Fault, Outcome, ReplayReport, ReplicasScenario, RequestRecord, RunRecords, RunSpec, FLEET};
use crate::error::SimError;
use crate::sim::{Event, Sim, SimRequest};

/// The id of replica `i`.
pub fn replica_id(i: usize) -> String {
    format!("router-{i}")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum BusEvent {
    Flush { replica: usize },
    Heartbeat { replica: usize },
    Deliver { to: usize, incarnation: u32, batch: usize },
    Kill { replica: usize },
    Restart { replica: usize },
    OutageStart,
    OutageEnd,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Due {
    t_us: u64,
    seq: u64,
    ev: BusEvent,
}

struct Replica {
    core: Option<RouterCore>,
    epoch: u64,
    /// Bumped at every kill: deliveries scheduled for an earlier incarnation are dropped.
    incarnation: u32,
    flush_armed: bool,
    last_sent_ms: u64,
    /// Counters of earlier incarnations (killed).
    retired: Vec<ReplicaStats>,
}

struct Published {
    t_ms: u64,
    bytes: Vec<u8>,
}

struct Loop<'a> {
    s: &'a ReplicasScenario,
    spec: RunSpec,
    sim: Sim<'a>,
    reqs: &'a [SimRequest],
    ids: Vec<String>,
    replicas: Vec<Replica>,
    index_of: HashMap<String, usize>,
    heap: BinaryHeap<Reverse<Due>>,
    seq: u64,
    stream: Vec<Published>,
    bus_up: bool,
    held: Vec<(usize, u32, usize)>,
    rr: usize,
    routed_by: Vec<Option<(usize, u32)>>,
    records: Vec<RequestRecord>,
    bus: BusCounters,
    replay: Option<ReplayReport>,
    /// Batches published up to the end of the outage: the bus has caught up once all of them
    /// are delivered.
    catchup_below: Option<usize>,
    notes: Vec<String>,
}

fn make_core(s: &ReplicasScenario, ids: &[String], i: usize, epoch: u64, sync: bool) -> Result<RouterCore, SimError> {
    let mut core = RouterCore::new(s.policy.clone());
    for id in ids {
        core.upsert_endpoint(EndpointSpec::new(id.as_str(), Role::Both))?;
    }
    if sync {
        let cfg = ReplicaConfig {
            max_outbox_entries: s.bus.max_outbox_entries,
            ..ReplicaConfig::new(FLEET, &replica_id(i), epoch)
        };
        core.enable_replication(cfg)?;
    }
    Ok(core)
}

impl Loop<'_> {
    fn schedule(&mut self, t_us: u64, ev: BusEvent) {
        self.seq += 1;
        self.heap.push(Reverse(Due { t_us, seq: self.seq, ev }));
    }

    fn arm_flush(&mut self, i: usize, now_us: u64) {
        if !self.spec.sync || self.replicas[i].flush_armed {
            return;
        }
        let f = self.s.bus.flush_interval_ms * 1000;
        self.replicas[i].flush_armed = true;
        self.schedule((now_us / f + 1) * f, BusEvent::Flush { replica: i });
    }

    /// Take replica `i`'s batches and publish them (nothing while the bus is down).
    fn publish(&mut self, i: usize, now_us: u64, heartbeat: bool) {
        if !self.spec.sync || !self.bus_up {
            return;
        }
        let now_ms = now_us / 1000;
        let Some(core) = self.replicas[i].core.as_mut() else { return };
        let mut hb = heartbeat;
        let mut out = Vec::new();
        while let Some(b) = core.take_replica_batch(now_ms, hb) {
            hb = false;
            out.push(b);
        }
        if !out.is_empty() {
            self.replicas[i].last_sent_ms = now_ms;
        }
        let latency = self.s.bus.latency_ms * 1000;
        for b in out {
            let k = self.stream.len();
            self.bus.published += 1;
            self.bus.published_bytes += b.len() as u64;
            self.stream.push(Published { t_ms: now_ms, bytes: b });
            for j in 0..self.replicas.len() {
                if j != i && self.replicas[j].core.is_some() {
                    let incarnation = self.replicas[j].incarnation;
                    self.schedule(now_us + latency, BusEvent::Deliver { to: j, incarnation, batch: k });
                }
            }
        }
    }

    fn deliver(&mut self, to: usize, incarnation: u32, batch: usize, now_us: u64) {
        if !self.bus_up {
            self.held.push((to, incarnation, batch));
            self.bus.held += 1;
            return;
        }
        let r = &mut self.replicas[to];
        let Some(core) = r.core.as_mut().filter(|_| r.incarnation == incarnation) else {
            self.bus.dropped_dead += 1;
            return;
        };
        self.bus.delivered += 1;
        if let Err(e) = core.apply_replica_bytes(&self.stream[batch].bytes, now_us / 1000) {
            self.notes.push(format!("{}: batch {batch}: {e}", replica_id(to)));
        }
        if self.catchup_below.is_some_and(|k| batch < k) {
            self.bus.caught_up_ms = Some(now_us / 1000);
        }
    }

    fn kill(&mut self, i: usize, now_us: u64) {
        let r = &mut self.replicas[i];
        if let Some(core) = r.core.take() {
            r.retired.extend(core.replica_stats());
        }
        r.incarnation += 1;
        r.flush_armed = false;
        self.notes.push(format!("{} killed at {:.3} s", replica_id(i), now_us as f64 / 1e6));
    }

    fn restart(&mut self, i: usize, now_us: u64) -> Result<(), SimError> {
        let now_ms = now_us / 1000;
        let epoch = self.replicas[i].epoch + 1;
        let mut core = make_core(self.s, &self.ids, i, epoch, self.spec.sync)?;
        // Bootstrap: what the stream retains (age, then bytes from the newest), in order.
        let mut rep = ReplayReport::default();
        let replayed = self.spec.sync && self.spec.fault != Fault::KillRestartNoReplay;
        if replayed {
            let min_t = now_ms.saturating_sub(self.s.bus.stream_max_age_s * 1000);
            let mut first = self.stream.len();
            let mut bytes = 0u64;
            while first > 0 {
                let p = &self.stream[first - 1];
                if p.t_ms < min_t || bytes + p.bytes.len() as u64 > self.s.bus.stream_max_bytes {
                    break;
                }
                bytes += p.bytes.len() as u64;
                first -= 1;
            }
            let t0 = Instant::now();
            rep.stream_batches = self.stream.len() as u64;
            rep.first_retained = first as u64;
            for p in &self.stream[first..] {
                rep.batches += 1;
                rep.bytes += p.bytes.len() as u64;
                match core.apply_replica_bytes(&p.bytes, now_ms) {
                    Ok(a) => {
                        rep.applied += u64::from(a.applied);
                        rep.effects += u64::from(a.effects);
                        rep.completions += u64::from(a.completions);
                    }
                    Err(e) => self.notes.push(format!("replay: {e}")),
                }
            }
            rep.own_past = core.replica_stats().map_or(0, |s| s.own_past_applied);
            rep.wall_us = t0.elapsed().as_micros() as u64;
        }
        for (id, m) in self.ids.iter().zip(self.sim.snapshots(now_ms)) {
            core.update_metrics(id, m)?;
        }
        let r = &mut self.replicas[i];
        r.core = Some(core);
        r.epoch = epoch;
        r.last_sent_ms = now_ms;
        self.replay = replayed.then_some(rep);
        self.notes.push(format!("{} restarted at {:.3} s, epoch {epoch}", replica_id(i), now_us as f64 / 1e6));
        // Announce the new incarnation at once (the others drop the old one's requests).
        self.publish(i, now_us, true);
        Ok(())
    }

    fn arrive(&mut self, r: usize, now_us: u64) {
        let n = self.replicas.len();
        let Some(i) = (0..n).map(|k| (self.rr + k) % n).find(|&k| self.replicas[k].core.is_some()) else {
            self.records[r].outcome = Outcome::Failed { error: "no live replica".into() };
            return;
        };
        self.rr = i + 1;
        self.records[r].replica = i as u32;
        self.records[r].incarnation = self.replicas[i].incarnation;
        let req = &self.reqs[r];
        let Some(core) = self.replicas[i].core.as_mut() else { return };
        let headers = req.headers.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        match core.route_http(&req.body, headers, now_us / 1000) {
            Ok(d) => {
                self.records[r].predicted_tokens = d.cached_tokens.min(d.input_tokens);
                self.records[r].input_tokens = d.input_tokens;
                match d.endpoint().and_then(|e| self.index_of.get(e).copied()) {
                    Some(e) => {
                        self.records[r].endpoint = Some(e as u32);
                        self.records[r].outcome = Outcome::Served;
                        self.routed_by[r] = Some((i, self.replicas[i].incarnation));
                        self.sim.send(r, e, Some(d.request_id), now_us);
                    }
                    None => {
                        let _ = core.complete(&d.request_id);
                        self.records[r].outcome = Outcome::Shed;
                    }
                }
            }
            Err(e) => self.records[r].outcome = Outcome::Failed { error: e.to_string() },
        }
        self.arm_flush(i, now_us);
    }

    fn complete(&mut self, request: usize, now_us: u64) -> Result<(), SimError> {
        let Some(ticket) = self.sim.decode_done(request) else { return Ok(()) };
        let Some((i, incarnation)) = self.routed_by[request] else { return Ok(()) };
        let r = &mut self.replicas[i];
        match r.core.as_mut().filter(|_| r.incarnation == incarnation) {
            Some(core) => match core.complete(&ticket) {
                Ok(()) | Err(StateError::UnknownRequest { .. }) => {}
                Err(e) => return Err(e.into()),
            },
            None => {
                self.bus.completions_lost += 1;
                return Ok(());
            }
        }
        self.arm_flush(i, now_us);
        Ok(())
    }

    fn metrics(&mut self, now_us: u64) -> Result<(), SimError> {
        let snaps: Vec<MetricsSnapshot> = self.sim.snapshots(now_us / 1000);
        for r in &mut self.replicas {
            if let Some(core) = r.core.as_mut() {
                for (id, m) in self.ids.iter().zip(&snaps) {
                    core.update_metrics(id, m.clone())?;
                }
            }
        }
        Ok(())
    }

    fn bus_event(&mut self, ev: BusEvent, now_us: u64, work_left: bool) -> Result<(), SimError> {
        let now_ms = now_us / 1000;
        match ev {
            BusEvent::Flush { replica } => {
                self.replicas[replica].flush_armed = false;
                self.publish(replica, now_us, false);
            }
            BusEvent::Heartbeat { replica } => {
                let hb = self.s.bus.heartbeat_interval_ms;
                let due = now_ms.saturating_sub(self.replicas[replica].last_sent_ms) >= hb;
                self.publish(replica, now_us, due);
                if let Some(core) = self.replicas[replica].core.as_mut() {
                    core.expire_silent_replicas(now_ms);
                }
                if work_left {
                    self.schedule(now_us + hb * 1000, BusEvent::Heartbeat { replica });
                }
            }
            BusEvent::Deliver { to, incarnation, batch } => self.deliver(to, incarnation, batch, now_us),
            BusEvent::Kill { replica } => self.kill(replica, now_us),
            BusEvent::Restart { replica } => self.restart(replica, now_us)?,
            BusEvent::OutageStart => {
                self.bus_up = false;
                self.notes.push(format!("bus down at {:.3} s", now_us as f64 / 1e6));
            }
            BusEvent::OutageEnd => {
                self.bus_up = true;
                self.bus.outbox_at_recovery =
                    self.replicas.iter().filter_map(|r| r.core.as_ref()).map(|c| c.replica_outbox_len() as u64).sum();
                self.notes.push(format!("bus up at {:.3} s", now_us as f64 / 1e6));
                // The stream delivers what it held, in order; then every outbox is drained.
                for (to, incarnation, batch) in std::mem::take(&mut self.held) {
                    self.schedule(now_us, BusEvent::Deliver { to, incarnation, batch });
                }
                for i in 0..self.replicas.len() {
                    self.publish(i, now_us, false);
                }
                self.catchup_below = Some(self.stream.len());
                self.bus.caught_up_ms = Some(now_ms);
            }
        }
        Ok(())
    }
}

/// When the fault of a run of `reqs` starts: a third of the way through the arrivals, ms.
pub fn fault_at_ms(reqs: &[SimRequest]) -> u64 {
    reqs.last().map_or(0, |r| r.arrival_ms) / 3
}

/// Simulate one run of the scenario on prepared requests.
pub fn run(s: &ReplicasScenario, reqs: &[SimRequest], spec: &RunSpec) -> Result<RunRecords, SimError> {
    s.validate()?;
    if reqs.is_empty() {
        return Err(SimError::EmptyWorkload);
    }
    if spec.replicas == 0 || (spec.fault != Fault::None && spec.replicas < 2) {
        return Err(SimError::setting("replicas", spec.replicas, "a fault run needs at least 2 replicas"));
    }
    let wall = Instant::now();
    let ids = s.cluster.endpoint_ids();
    let index_of = ids.iter().enumerate().map(|(i, id)| (id.clone(), i)).collect();
    let n = spec.replicas as usize;
    let mut replicas = Vec::with_capacity(n);
    for i in 0..n {
        replicas.push(Replica {
            core: Some(make_core(s, &ids, i, 1, spec.sync)?),
            epoch: 1,
            incarnation: 0,
            flush_armed: false,
            last_sent_ms: 0,
            retired: Vec::new(),
        });
    }
    let records = reqs
        .iter()
        .map(|r| RequestRecord { arrival_ms: r.arrival_ms, prompt_tokens: r.prompt_tokens, ..RequestRecord::default() })
        .collect();
    let mut l = Loop {
        s,
        spec: *spec,
        sim: Sim::new(&s.cluster, reqs),
        reqs,
        ids,
        replicas,
        index_of,
        heap: BinaryHeap::new(),
        seq: 0,
        stream: Vec::new(),
        bus_up: true,
        held: Vec::new(),
        rr: 0,
        routed_by: vec![None; reqs.len()],
        records,
        bus: BusCounters::default(),
        replay: None,
        catchup_below: None,
        notes: Vec::new(),
    };
    l.sim.schedule(0, Event::Metrics);
    if spec.sync {
        for i in 0..n {
            l.schedule(s.bus.heartbeat_interval_ms * 1000, BusEvent::Heartbeat { replica: i });
        }
    }
    let at = fault_at_ms(reqs) * 1000;
    let fault_window = match spec.fault {
        Fault::None => None,
        Fault::KillRestart | Fault::KillRestartNoReplay => {
            l.schedule(at, BusEvent::Kill { replica: 0 });
            l.schedule(at + s.restart_after_ms * 1000, BusEvent::Restart { replica: 0 });
            Some((at / 1000, at / 1000 + s.restart_after_ms))
        }
        Fault::BusOutage => {
            l.schedule(at, BusEvent::OutageStart);
            l.schedule(at + s.outage_ms * 1000, BusEvent::OutageEnd);
            Some((at / 1000, at / 1000 + s.outage_ms))
        }
    };
    let total = reqs.len();
    let mut next = 0usize;
    loop {
        let a = reqs.get(next).map(|r| r.arrival_ms * 1000);
        let e = l.sim.next_event_us();
        let b = l.heap.peek().map(|Reverse(d)| d.t_us);
        let Some(t) = [e, b, a].into_iter().flatten().min() else { break };
        let work_left = next < total || l.sim.endpoints.iter().any(|e| e.busy());
        if e == Some(t) {
            let Some(ev) = l.sim.pop() else { break };
            match ev.event {
                Event::Metrics => {
                    if work_left {
                        l.metrics(t)?;
                        l.sim.schedule(t + s.cluster.metrics_interval_ms * 1000, Event::Metrics);
                    }
                }
                Event::PrefillDone { endpoint } => l.sim.prefill_done(endpoint, t),
                Event::DecodeDone { request } => l.complete(request, t)?,
                Event::Timer => {}
            }
        } else if b == Some(t) {
            let Some(Reverse(d)) = l.heap.pop() else { break };
            l.bus_event(d.ev, t, work_left)?;
        } else {
            let r = next;
            next += 1;
            l.arrive(r, t);
        }
    }
    for (rec, f) in l.records.iter_mut().zip(&l.sim.flights) {
        if rec.outcome == Outcome::Served {
            rec.cached_tokens = f.cached_tokens;
            rec.ttft_ms = f.ttft_us as f64 / 1000.0;
        }
    }
    let mut stats = Vec::new();
    for r in &l.replicas {
        stats.extend(r.retired.iter().cloned());
        stats.extend(r.core.as_ref().and_then(RouterCore::replica_stats));
    }
    l.bus.stream_batches = l.stream.len() as u64;
    Ok(RunRecords {
        spec: *spec,
        records: l.records,
        replica_stats: stats,
        bus: l.bus,
        fault_window,
        replay: l.replay,
        wall_s: wall.elapsed().as_secs_f64(),
        notes: l.notes,
    })
}

//! Fairness policies: which flow (tenant) of a band dispatches next.
//!
//! A band's [`BandQueues`] holds its flows and the policy's schedule:
//!
//! - **global strict**: one heap of every request of the band by the ordering key, so the next
//!   request is the best head across flows (`O(log n)`); a bursting tenant gets what it asks for;
//! - **round robin**: a ring of the flows with queued requests; each dispatch takes the front
//!   flow's best request and puts the flow at the back (`O(log m)` in the flow's own heap);
//! - **attained service**: a heap of flows by the service they received (input tokens + weight ·
//!   output tokens of every request admitted or dispatched from them), halving every half-life of
//!   virtual time. Decay is applied the other way round: everyone decaying by the same factor
//!   keeps their order, so new service is *inflated* by `2^((now − epoch) / half_life)` instead
//!   (the controller supplies that scale) and the stored values are renormalized before they
//!   grow large. A tenant that bursts accumulates service and yields to a steady one.
//!
//! Schedules are lazy: a flow whose requests all left another way (cancelled, expired) stays in
//! the ring or heap until it comes up and is skipped; a flow whose service changed since it was
//! scheduled is rescheduled with its current value when it comes up.

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;

use xxhash_rust::xxh3::Xxh3DefaultBuilder;

use super::config::FairnessPolicy;
use super::ordering::{pop_live, Item, ItemHeap};

/// A flow: the queued requests of one fairness id in one band.
#[derive(Debug)]
pub(crate) struct Flow {
    pub id: Arc<str>,
    /// Its requests (round robin and attained service; global strict keeps them in the band's
    /// heap).
    heap: ItemHeap,
    /// Live requests queued.
    pub queued: u32,
    /// Attained service in inflated units (see the module docs).
    pub service: f64,
    /// In the ring / service heap.
    scheduled: bool,
}

/// A service value ordered by `f64::total_cmp`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Service(f64);

impl Eq for Service {}

impl PartialOrd for Service {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Service {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Debug)]
enum Schedule {
    GlobalStrict(ItemHeap),
    RoundRobin(VecDeque<u32>),
    AttainedService(BinaryHeap<Reverse<(Service, u32)>>),
}

/// The flows of one band and its fairness policy's schedule.
#[derive(Debug)]
pub(crate) struct BandQueues {
    pub flows: Vec<Flow>,
    flow_of: HashMap<Arc<str>, u32, Xxh3DefaultBuilder>,
    schedule: Schedule,
}

/// What a dispatch took.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Popped {
    pub item: Item,
    pub flow: u32,
    /// Stale entries skipped on the way.
    pub stale: u64,
}

impl BandQueues {
    pub fn new(policy: FairnessPolicy) -> Self {
        let schedule = match policy {
            FairnessPolicy::GlobalStrict => Schedule::GlobalStrict(ItemHeap::new()),
            FairnessPolicy::RoundRobin => Schedule::RoundRobin(VecDeque::new()),
            FairnessPolicy::AttainedService => Schedule::AttainedService(BinaryHeap::new()),
        };
        BandQueues { flows: Vec::new(), flow_of: HashMap::with_hasher(Xxh3DefaultBuilder), schedule }
    }

    /// The flow of `id`, created if new.
    pub fn flow(&mut self, id: &str) -> u32 {
        if let Some(&f) = self.flow_of.get(id) {
            return f;
        }
        let f = self.flows.len() as u32;
        let id: Arc<str> = Arc::from(id);
        self.flows.push(Flow { id: id.clone(), heap: ItemHeap::new(), queued: 0, service: 0.0, scheduled: false });
        self.flow_of.insert(id, f);
        f
    }

    /// Queue `item` in `flow`.
    pub fn push(&mut self, flow: u32, item: Item) {
        let Some(fl) = self.flows.get_mut(flow as usize) else { return };
        fl.queued += 1;
        match &mut self.schedule {
            Schedule::GlobalStrict(heap) => heap.push(Reverse(item)),
            Schedule::RoundRobin(ring) => {
                fl.heap.push(Reverse(item));
                if !fl.scheduled {
                    fl.scheduled = true;
                    ring.push_back(flow);
                }
            }
            Schedule::AttainedService(heap) => {
                fl.heap.push(Reverse(item));
                if !fl.scheduled {
                    fl.scheduled = true;
                    heap.push(Reverse((Service(fl.service), flow)));
                }
            }
        }
    }

    /// A live request of `flow` left the queue another way (cancelled, expired, dropped): its
    /// item stays where it is, stale.
    pub fn forget(&mut self, flow: u32) {
        if let Some(fl) = self.flows.get_mut(flow as usize) {
            fl.queued = fl.queued.saturating_sub(1);
        }
    }

    /// Add `amount` (inflated units) to `flow`'s attained service.
    pub fn charge(&mut self, flow: u32, amount: f64) {
        if let Some(fl) = self.flows.get_mut(flow as usize) {
            fl.service += amount;
        }
    }

    /// Take the next request under the band's fairness policy. `live(item)` says whether the
    /// request is still queued (else its item is stale and skipped); `cost(item)` is the service
    /// to charge its flow (inflated units).
    pub fn pop(&mut self, live: impl Fn(&Item) -> bool, cost: impl Fn(&Item) -> f64) -> Option<Popped> {
        let mut stale = 0;
        match &mut self.schedule {
            Schedule::GlobalStrict(heap) => {
                let (item, s) = pop_live(heap, &live);
                let item = item?;
                // The slot's entry names its flow; global strict does not need it, the caller
                // looks it up.
                Some(Popped { item, flow: u32::MAX, stale: s })
            }
            Schedule::RoundRobin(ring) => {
                while let Some(f) = ring.pop_front() {
                    let Some(fl) = self.flows.get_mut(f as usize) else { continue };
                    if fl.queued == 0 {
                        stale += fl.heap.len() as u64;
                        fl.heap.clear();
                        fl.scheduled = false;
                        continue;
                    }
                    let (item, s) = pop_live(&mut fl.heap, &live);
                    stale += s;
                    let Some(item) = item else {
                        // Counts said queued, the heap had nothing live: repair.
                        fl.queued = 0;
                        fl.scheduled = false;
                        continue;
                    };
                    fl.queued -= 1;
                    fl.service += cost(&item);
                    if fl.queued > 0 {
                        ring.push_back(f);
                    } else {
                        stale += fl.heap.len() as u64;
                        fl.heap.clear();
                        fl.scheduled = false;
                    }
                    return Some(Popped { item, flow: f, stale });
                }
                None
            }
            Schedule::AttainedService(heap) => {
                while let Some(Reverse((Service(s), f))) = heap.pop() {
                    let Some(fl) = self.flows.get_mut(f as usize) else { continue };
                    if fl.queued == 0 {
                        stale += fl.heap.len() as u64;
                        fl.heap.clear();
                        fl.scheduled = false;
                        continue;
                    }
                    if s.to_bits() != fl.service.to_bits() {
                        // Charged since it was scheduled (an immediate admission): reschedule.
                        heap.push(Reverse((Service(fl.service), f)));
                        continue;
                    }
                    let (item, st) = pop_live(&mut fl.heap, &live);
                    stale += st;
                    let Some(item) = item else {
                        fl.queued = 0;
                        fl.scheduled = false;
                        continue;
                    };
                    fl.queued -= 1;
                    fl.service += cost(&item);
                    if fl.queued > 0 {
                        heap.push(Reverse((Service(fl.service), f)));
                    } else {
                        stale += fl.heap.len() as u64;
                        fl.heap.clear();
                        fl.scheduled = false;
                    }
                    return Some(Popped { item, flow: f, stale });
                }
                None
            }
        }
    }

    /// For global strict: after the caller looked up the popped item's flow, count it out.
    pub fn popped_from(&mut self, flow: u32) {
        if matches!(self.schedule, Schedule::GlobalStrict(_)) {
            self.forget(flow);
        }
    }

    /// Multiply every flow's service by `factor` (renormalization of the inflated units) and
    /// reschedule.
    pub fn rescale(&mut self, factor: f64) {
        for fl in &mut self.flows {
            fl.service *= factor;
        }
        if let Schedule::AttainedService(heap) = &mut self.schedule {
            heap.clear();
            for (f, fl) in self.flows.iter().enumerate() {
                if fl.scheduled {
                    heap.push(Reverse((Service(fl.service), f as u32)));
                }
            }
        }
    }

    /// Flows with queued requests.
    pub fn active_flows(&self) -> usize {
        self.flows.iter().filter(|f| f.queued > 0).count()
    }

    /// Items held in the schedule's heaps (live and stale).
    #[cfg(test)]
    pub fn held(&self) -> usize {
        let own: usize = self.flows.iter().map(|f| f.heap.len()).sum();
        match &self.schedule {
            Schedule::GlobalStrict(h) => own + h.len(),
            _ => own,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// Push `per_flow[i]` requests for flow i (in flow order, round after round), all live, cost
    /// 1 each; return the flow of each dispatch.
    fn run(policy: FairnessPolicy, per_flow: &[usize], dispatches: usize) -> Vec<u32> {
        let mut q = BandQueues::new(policy);
        let flows: Vec<u32> = (0..per_flow.len()).map(|i| q.flow(&format!("t{i}"))).collect();
        let mut seq = 0;
        let mut owner = Vec::new();
        // Flow 0's requests all arrive first (a burst), then the others'.
        for (i, &n) in per_flow.iter().enumerate() {
            for _ in 0..n {
                q.push(flows[i], Item { key: seq, seq, slot: seq as u32 });
                owner.push(flows[i]);
                seq += 1;
            }
        }
        (0..dispatches)
            .filter_map(|_| {
                q.pop(|_| true, |_| 1.0).map(|p| {
                    let f = owner[p.item.slot as usize];
                    q.popped_from(f);
                    f
                })
            })
            .collect()
    }

    #[test]
    fn global_strict_serves_the_burst_first() {
        let d = run(FairnessPolicy::GlobalStrict, &[10, 2], 4);
        assert_eq!(d, vec![0, 0, 0, 0], "FCFS across flows: the burst arrived first");
    }

    #[test]
    fn round_robin_alternates() {
        let d = run(FairnessPolicy::RoundRobin, &[10, 2, 1], 7);
        assert_eq!(d, vec![0, 1, 2, 0, 1, 0, 0]);
    }

    #[test]
    fn attained_service_serves_the_least_served() {
        let mut q = BandQueues::new(FairnessPolicy::AttainedService);
        let a = q.flow("a");
        let b = q.flow("b");
        q.charge(a, 10.0); // a was served before (admitted at once)
        for s in 0..6u64 {
            q.push(if s < 3 { a } else { b }, Item { key: s, seq: s, slot: s as u32 });
        }
        let order: Vec<u32> = std::iter::from_fn(|| q.pop(|_| true, |_| 4.0).map(|p| p.flow)).collect();
        // b (0) < a (10): b, b (4), b (8), then a (10) < b (12): a, then a (14), a (18).
        assert_eq!(order, vec![b, b, b, a, a, a]);
        assert_eq!(q.held(), 0);
    }

    #[test]
    fn charged_flows_are_rescheduled_with_their_current_service() {
        let mut q = BandQueues::new(FairnessPolicy::AttainedService);
        let a = q.flow("a");
        let b = q.flow("b");
        q.push(a, Item { key: 0, seq: 0, slot: 0 });
        q.push(b, Item { key: 1, seq: 1, slot: 1 });
        q.charge(a, 100.0); // after a was scheduled at 0
        assert_eq!(q.pop(|_| true, |_| 1.0).map(|p| p.flow), Some(b));
        q.rescale(0.5);
        assert_eq!(q.flows[a as usize].service, 50.0);
        assert_eq!(q.pop(|_| true, |_| 1.0).map(|p| p.flow), Some(a));
    }

    #[test]
    fn stale_items_and_empty_flows_are_skipped() {
        for policy in [FairnessPolicy::GlobalStrict, FairnessPolicy::RoundRobin, FairnessPolicy::AttainedService] {
            let mut q = BandQueues::new(policy);
            let a = q.flow("a");
            let b = q.flow("b");
            q.push(a, Item { key: 0, seq: 0, slot: 0 });
            q.push(b, Item { key: 1, seq: 1, slot: 1 });
            q.push(a, Item { key: 2, seq: 2, slot: 2 });
            // slot 0 cancelled
            q.forget(a);
            let dead: BTreeSet<u32> = [0].into();
            let got: Vec<u32> = std::iter::from_fn(|| {
                q.pop(|it| !dead.contains(&it.slot), |_| 1.0).map(|p| {
                    if p.flow == u32::MAX {
                        q.popped_from(if p.item.slot == 1 { b } else { a });
                    }
                    p.item.slot
                })
            })
            .collect();
            let mut sorted = got.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, vec![1, 2], "{policy:?}: {got:?}");
            assert_eq!(q.active_flows(), 0);
        }
    }
}

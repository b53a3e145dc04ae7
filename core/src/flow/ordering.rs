//! Ordering policies: which request of a flow dispatches next.
//!
//! Every policy is a key: a request's place is `(key, seq)`, smallest first, where `seq` is its
//! arrival order (so ties are first come, first served). Flows hold their requests in a binary
//! min-heap of [`Item`]s; a request that left the queue another way (cancelled, expired,
//! dropped) stays in the heap until it reaches the top and is skipped there.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::config::OrderingPolicy;

/// A queued request's place: its ordering key, its arrival sequence number and its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Item {
    pub key: u64,
    pub seq: u64,
    pub slot: u32,
}

/// A min-heap of items.
pub(crate) type ItemHeap = BinaryHeap<Reverse<Item>>;

/// No deadline: sorts after every real one.
pub(crate) const NO_DEADLINE: u64 = u64::MAX;

/// The ordering key of a request under `policy`.
///
/// - `fcfs`: its arrival sequence number;
/// - `edf`: its queue deadline (`enqueue + TTL`; [`NO_DEADLINE`] without a TTL);
/// - `slo_deadline`: `enqueue + TTFT objective` ([`NO_DEADLINE`] without one).
pub(crate) fn key(policy: OrderingPolicy, seq: u64, enqueue_ms: u64, expires_ms: u64, slo_ttft_ms: Option<u64>) -> u64 {
    match policy {
        OrderingPolicy::Fcfs => seq,
        OrderingPolicy::Edf => expires_ms,
        OrderingPolicy::SloDeadline => slo_ttft_ms.map_or(NO_DEADLINE, |s| enqueue_ms.saturating_add(s)),
    }
}

/// Pop the first item for which `live` holds (the others are stale and dropped); returns it with
/// the number of stale items dropped.
pub(crate) fn pop_live(heap: &mut ItemHeap, mut live: impl FnMut(&Item) -> bool) -> (Option<Item>, u64) {
    let mut stale = 0;
    while let Some(Reverse(it)) = heap.pop() {
        if live(&it) {
            return (Some(it), stale);
        }
        stale += 1;
    }
    (None, stale)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(policy: OrderingPolicy, reqs: &[(u64, u64, u64, Option<u64>)]) -> Vec<u32> {
        let mut h = ItemHeap::new();
        for (i, &(seq, enq, exp, slo)) in reqs.iter().enumerate() {
            h.push(Reverse(Item { key: key(policy, seq, enq, exp, slo), seq, slot: i as u32 }));
        }
        std::iter::from_fn(|| pop_live(&mut h, |_| true).0.map(|it| it.slot)).collect()
    }

    // (seq, enqueue_ms, expires_ms, slo_ttft_ms)
    const REQS: [(u64, u64, u64, Option<u64>); 4] =
        [(1, 0, 5_000, None), (2, 10, 1_000, Some(500)), (3, 20, NO_DEADLINE, Some(100)), (4, 30, 900, None)];

    #[test]
    fn fcfs_is_arrival_order() {
        assert_eq!(order(OrderingPolicy::Fcfs, &REQS), vec![0, 1, 2, 3]);
    }

    #[test]
    fn edf_is_earliest_queue_deadline_and_no_deadline_last() {
        assert_eq!(order(OrderingPolicy::Edf, &REQS), vec![3, 1, 0, 2]);
    }

    #[test]
    fn slo_deadline_is_enqueue_plus_ttft_and_no_slo_last_in_arrival_order() {
        // deadlines: r1 none, r2 510, r3 120, r4 none
        assert_eq!(order(OrderingPolicy::SloDeadline, &REQS), vec![2, 1, 0, 3]);
    }

    #[test]
    fn stale_items_are_skipped_and_counted() {
        let mut h = ItemHeap::new();
        for s in 0..4 {
            h.push(Reverse(Item { key: s, seq: s, slot: s as u32 }));
        }
        let (it, stale) = pop_live(&mut h, |it| it.slot >= 2);
        assert_eq!((it.map(|i| i.slot), stale), (Some(2), 2));
    }
}

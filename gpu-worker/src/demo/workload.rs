//! The built-in multi-turn agent workload, its arrival schedule and the oracle prefix-hit rate.
//!
//! Tenants each have a long shared system prompt. Every tenant runs a fixed number of agent
//! slots; a slot holds one conversation at a time and replaces it with a fresh one when it has
//! run its turns (or its context would pass the limit). Requests arrive as ONE Poisson process
//! at the requested rate; each arrival goes to a slot drawn uniformly, which sends its next
//! turn: system prompt + every earlier turn (message and reply) + a new user or tool message.
//! Thinning a Poisson process keeps it Poisson, so every slot's turns are Poisson too.
//!
//! The reply a turn appends to the context is drawn in advance (same length as the request's
//! `max_tokens`), not the tokens the worker generated: the schedule is then fixed before the
//! run, identical for every policy, and never waits on a response (open loop).
//!
//! Prompts are token ids (`/v1/completions` with an integer-array prompt), so the workers, the
//! approximate index and the precise index all see exactly the same tokens. Token-count ranges
//! ([`Span`]) and the workload kinds ([`WorkloadKind`]) are the simulator toolkit's.

use std::collections::HashSet;
use std::sync::Arc;

use kvroute_sim::{Span, WorkloadKind};

/// Lowest token id drawn (ids below are left for special tokens).
const FIRST_TOKEN: u32 = 16;

/// A small deterministic generator (SplitMix64): no dependency, same stream on every platform.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator for `seed` and a stream label (independent streams per purpose).
    pub(crate) fn new(seed: u64, stream: u64) -> Rng {
        let mut r = Rng(seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F));
        r.next_u64();
        r
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `lo..=hi` (`lo` when `hi < lo`).
    pub(crate) fn range(&mut self, lo: u32, hi: u32) -> u32 {
        if hi <= lo {
            return lo;
        }
        let span = u64::from(hi - lo) + 1;
        lo + (self.next_u64() % span) as u32
    }

    /// Exponential with the given mean.
    pub(crate) fn exp(&mut self, mean: f64) -> f64 {
        -(1.0 - self.unit()).ln() * mean
    }
}

/// Shape of the workload (everything but the arrival rate).
#[derive(Debug, Clone)]
pub(crate) struct WorkloadSpec {
    /// What the prompts share.
    pub(crate) kind: WorkloadKind,
    /// Tenants, each with its own system prompt.
    pub(crate) tenants: u32,
    /// Concurrent agent conversations per tenant.
    pub(crate) agents_per_tenant: u32,
    /// System prompt length per tenant.
    pub(crate) system_tokens: Span,
    /// First user message of a conversation.
    pub(crate) first_message_tokens: Span,
    /// Later user / tool-result messages.
    pub(crate) message_tokens: Span,
    /// Reply length (`max_tokens`, generated exactly).
    pub(crate) output_tokens: Span,
    /// Turns per conversation.
    pub(crate) turns: Span,
    /// A conversation ends before its prompt would exceed this many tokens.
    pub(crate) max_prompt_tokens: u32,
    /// Token ids are drawn below this.
    pub(crate) vocab_size: u32,
    /// Workload seed.
    pub(crate) seed: u64,
}

impl WorkloadSpec {
    /// One-line description.
    pub(crate) fn describe(&self) -> String {
        if self.kind == WorkloadKind::Unique {
            return format!(
                "unique prompts: every request a prompt of its own ({} + {} tok of random tokens), reply {} tok; \
                 seed {}",
                self.system_tokens, self.first_message_tokens, self.output_tokens, self.seed
            );
        }
        format!(
            "{} tenants x {} agents; system prompt {} tok per tenant; first message {} tok, then +{} tok \
             message + {} tok reply per turn; {} turns; prompts <= {} tok; seed {}",
            self.tenants,
            self.agents_per_tenant,
            self.system_tokens,
            self.first_message_tokens,
            self.message_tokens,
            self.output_tokens,
            self.turns,
            self.max_prompt_tokens,
            self.seed
        )
    }
}

/// One request of the schedule.
#[derive(Debug, Clone)]
pub(crate) struct DemoRequest {
    /// Position in the schedule (arrival order).
    pub(crate) index: usize,
    /// Arrival, seconds from the start.
    pub(crate) at_s: f64,
    /// Conversation id (sent as `x-session-id`).
    pub(crate) session: Arc<str>,
    /// Prompt token ids.
    pub(crate) prompt: Arc<[u32]>,
    /// Tokens to generate.
    pub(crate) max_tokens: u32,
}

struct Conversation {
    id: Arc<str>,
    context: Vec<u32>,
    turns_left: u32,
    turn: u32,
    /// Reply of the previous turn, appended before the next message.
    pending_reply: Vec<u32>,
}

fn tokens(rng: &mut Rng, n: u32, vocab: u32) -> impl Iterator<Item = u32> + '_ {
    let hi = vocab.max(FIRST_TOKEN + 2) - 1;
    (0..n).map(move |_| rng.range(FIRST_TOKEN, hi))
}

/// The request contents in arrival order (independent of the rate): `n` requests.
pub(crate) fn contents(spec: &WorkloadSpec, n: usize) -> Vec<DemoRequest> {
    let mut rng = Rng::new(spec.seed, 1);
    if spec.kind == WorkloadKind::Unique {
        return (0..n)
            .map(|index| {
                let len = rng.range(spec.system_tokens.min, spec.system_tokens.max)
                    + rng.range(spec.first_message_tokens.min, spec.first_message_tokens.max);
                let len = len.clamp(1, spec.max_prompt_tokens.max(1));
                let prompt: Vec<u32> = tokens(&mut rng, len, spec.vocab_size).collect();
                let max_tokens = rng.range(spec.output_tokens.min.max(1), spec.output_tokens.max.max(1));
                DemoRequest {
                    index,
                    at_s: 0.0,
                    session: Arc::from(format!("u{index}")),
                    prompt: Arc::from(prompt),
                    max_tokens,
                }
            })
            .collect();
    }
    let tenants = spec.tenants.max(1);
    let systems: Vec<Vec<u32>> = (0..tenants)
        .map(|_| {
            let len = rng.range(spec.system_tokens.min, spec.system_tokens.max);
            tokens(&mut rng, len, spec.vocab_size).collect()
        })
        .collect();
    let slots = (tenants * spec.agents_per_tenant.max(1)) as usize;
    let mut convs: Vec<Option<Conversation>> = (0..slots).map(|_| None).collect();
    let mut started = 0u64;
    let mut out = Vec::with_capacity(n);
    for index in 0..n {
        let slot = (rng.next_u64() % slots as u64) as usize;
        let tenant = (slot % tenants as usize) as u32;
        // Retire a finished conversation, or one whose next turn would not fit.
        let next_len = |c: &Conversation| {
            c.context.len() + c.pending_reply.len() + spec.message_tokens.max as usize + spec.output_tokens.max as usize
        };
        if let Some(c) = &convs[slot] {
            if c.turns_left == 0 || next_len(c) > spec.max_prompt_tokens as usize {
                convs[slot] = None;
            }
        }
        let conv = convs[slot].get_or_insert_with(|| {
            started += 1;
            Conversation {
                id: Arc::from(format!("t{tenant}-c{started}")),
                context: systems[tenant as usize].clone(),
                turns_left: rng.range(spec.turns.min.max(1), spec.turns.max.max(1)),
                turn: 0,
                pending_reply: Vec::new(),
            }
        });
        let reply = std::mem::take(&mut conv.pending_reply);
        conv.context.extend_from_slice(&reply);
        let msg = if conv.turn == 0 { spec.first_message_tokens } else { spec.message_tokens };
        let len = rng.range(msg.min, msg.max);
        conv.context.extend(tokens(&mut rng, len, spec.vocab_size));
        conv.context.truncate(spec.max_prompt_tokens.max(1) as usize);
        let max_tokens = rng.range(spec.output_tokens.min.max(1), spec.output_tokens.max.max(1));
        conv.pending_reply = tokens(&mut rng, max_tokens, spec.vocab_size).collect();
        conv.turn += 1;
        conv.turns_left = conv.turns_left.saturating_sub(1);
        out.push(DemoRequest {
            index,
            at_s: 0.0,
            session: conv.id.clone(),
            prompt: Arc::from(conv.context.as_slice()),
            max_tokens,
        });
    }
    out
}

/// Poisson arrival times at `rate_per_s` for `reqs` (in place; seeded separately from the
/// contents, so the same seed gives the same contents at every rate).
pub(crate) fn stamp_arrivals(reqs: &mut [DemoRequest], rate_per_s: f64, seed: u64) {
    let mut rng = Rng::new(seed, 2);
    let mean = if rate_per_s > 0.0 { 1.0 / rate_per_s } else { 1.0 };
    let mut t = 0.0;
    for r in reqs {
        t += rng.exp(mean);
        r.at_s = t;
    }
}

/// Per-request oracle: prompt tokens in full blocks whose whole prefix some earlier request
/// (in arrival order) already had in its prompt — what one infinite shared cache would hit.
pub(crate) fn oracle_cached(reqs: &[DemoRequest], block_size: u32) -> Vec<u32> {
    let bs = block_size.max(1) as usize;
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = Vec::with_capacity(reqs.len());
    for r in reqs {
        let mut parent = 0x006b_7672_6f75_7465_u64;
        let mut hit = 0usize;
        let mut prefix_ok = true;
        for block in r.prompt.chunks_exact(bs) {
            parent = chain(parent, block);
            if prefix_ok && seen.contains(&parent) {
                hit += bs;
            } else {
                prefix_ok = false;
            }
            seen.insert(parent);
        }
        // Like vLLM, the last prompt token is always computed (it yields the first output).
        out.push(hit.min(r.prompt.len().saturating_sub(1)) as u32);
    }
    out
}

fn chain(parent: u64, block: &[u32]) -> u64 {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: deterministic (no RandomState).
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    block.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> WorkloadSpec {
        WorkloadSpec {
            kind: WorkloadKind::Agents,
            tenants: 2,
            agents_per_tenant: 3,
            system_tokens: Span::new(64, 96),
            first_message_tokens: Span::new(20, 40),
            message_tokens: Span::new(8, 16),
            output_tokens: Span::new(4, 8),
            turns: Span::new(2, 4),
            max_prompt_tokens: 400,
            vocab_size: 1000,
            seed: 7,
        }
    }

    #[test]
    fn contents_are_deterministic_and_grow() {
        let a = contents(&spec(), 60);
        let b = contents(&spec(), 80);
        assert_eq!(a.len(), 60);
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.prompt, y.prompt, "a longer schedule starts with the shorter one");
            assert_eq!(x.session, y.session);
        }
        // A later turn of a conversation extends the earlier one's prompt.
        let mut extended = 0;
        for (i, r) in a.iter().enumerate() {
            if let Some(prev) = a[..i].iter().rev().find(|p| p.session == r.session) {
                assert!(r.prompt.starts_with(&prev.prompt));
                assert!(r.prompt.len() > prev.prompt.len() + prev.max_tokens as usize);
                extended += 1;
            }
            assert!(r.prompt.len() <= 400);
            assert!(r.prompt.iter().all(|&t| (FIRST_TOKEN..1000).contains(&t)));
        }
        assert!(extended > 10);
    }

    #[test]
    fn unique_prompts_share_no_block() {
        let u = WorkloadSpec { kind: WorkloadKind::Unique, ..spec() };
        let r = contents(&u, 200);
        assert_eq!(r.len(), 200);
        assert!(oracle_cached(&r, 16).iter().all(|&c| c == 0), "nothing to reuse");
        let sessions: HashSet<&str> = r.iter().map(|x| &*x.session).collect();
        assert_eq!(sessions.len(), 200, "one-turn sessions");
        assert!(r.iter().all(|x| (84..=136).contains(&x.prompt.len())));
    }

    #[test]
    fn arrivals_are_poisson_at_the_rate() {
        let mut r = contents(&spec(), 4000);
        stamp_arrivals(&mut r, 5.0, 1);
        let span = r.last().map_or(0.0, |x| x.at_s);
        let rate = r.len() as f64 / span;
        assert!((rate - 5.0).abs() < 0.4, "rate {rate}");
        assert!(r.windows(2).all(|w| w[0].at_s <= w[1].at_s));
    }

    #[test]
    fn oracle_counts_shared_prefixes_only() {
        let mk = |p: Vec<u32>| DemoRequest {
            index: 0,
            at_s: 0.0,
            session: Arc::from("s"),
            prompt: Arc::from(p),
            max_tokens: 1,
        };
        let a: Vec<u32> = (100..164).collect();
        let mut b = a[..40].to_vec();
        b.extend(500..540);
        let mut c = vec![1, 2, 3, 4];
        c.extend(&a[4..]);
        let hits = oracle_cached(&[mk(a.clone()), mk(b), mk(c), mk(a)], 16);
        // b shares 40 tokens = 2 full blocks; c differs in block 0, so nothing; a again: all but
        // the last token.
        assert_eq!(hits, vec![0, 32, 0, 63]);
    }
}

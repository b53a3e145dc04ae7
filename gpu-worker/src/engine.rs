//! The engine thread: continuous-batching scheduler over the paged block pool, driving the
//! compute backend and producing KV events.
//!
//! # One step
//! 1. Running sequences, in arrival order: a sequence still prefilling gets a chunk of its
//!    remaining prompt, a decoding one gets one token, as long as the step's token budget
//!    (`max_batched_tokens`) lasts. A sequence whose next blocks cannot be allocated preempts the
//!    last running sequence (its blocks are freed and it is recomputed later, as vLLM does).
//! 2. Waiting sequences, first come first served, while fewer than `max_running` run and budget
//!    remains: the prefix cache is looked up (at most `len - 1` tokens, in whole blocks: the
//!    last token is always computed, as in vLLM), hit blocks are referenced, blocks received
//!    from a prefill worker are inserted after them, and a first chunk is scheduled. A sequence
//!    that does not fit waits (head-of-line, like vLLM).
//! 3. One forward pass over all scheduled tokens. Full blocks that became computed are cached
//!    (`BlockStored`); blocks evicted to make room were reported (`BlockRemoved`). A sequence
//!    whose known tokens are all computed samples its next token (greedy).
//! 4. The step's events go to the publisher as ONE batch, before any response of the step is
//!    completed (a client that got its answer can rely on the events being on their way).

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvroute::{BlockDigest, BlockExtras, EngineHasher};
use tokio::sync::mpsc::UnboundedSender;

use crate::block_pool::BlockPool;
use crate::events::WorkerEvent;
use crate::metrics::Shared;
use crate::model::{argmax, Backend, KvRead, SeqBatch};
use crate::publisher::Batch;

/// A reply callback (works for async and blocking callers alike).
pub(crate) type Reply<T> = Box<dyn FnOnce(T) + Send>;

/// Commands to the engine thread.
pub(crate) enum Command {
    /// A new sequence.
    Submit(Box<NewSeq>),
    /// Hand over a pinned (pulled) transfer: `None` when unknown or expired.
    TakeTransfer { id: u64, reply: Reply<Option<Vec<TransferMsg>>> },
    /// How many leading blocks of this prompt are cached (usable as hits).
    ProbePrefix { tokens: Vec<u32>, cache_salt: Option<String>, reply: Reply<usize> },
    /// Event keys of every cached block.
    CachedKeys { reply: Reply<Vec<u64>> },
    /// Forget the prefix cache (refused while blocks are held).
    ResetPrefixCache { reply: Reply<bool> },
    /// Hold (`true`) or resume (`false`) scheduling: while held, submissions queue up and no
    /// step runs (so tests can line requests up deterministically).
    Hold(bool),
    /// Stop: abort everything.
    Shutdown,
}

/// Messages of a KV transfer (the prefill side's stream; see [`crate::transfer`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum TransferMsg {
    /// Shape, first position and token ids of the transferred range.
    Header { layers: u32, kv_heads: u32, head_dim: u32, block_size: u32, start: u32, tokens: Vec<u32> },
    /// K and V of positions `start..start + n` of one layer (`n × kv_dim` floats each).
    Layer { layer: u32, start: u32, k: Vec<f32>, v: Vec<f32> },
    /// Everything was sent; the prefill worker's first token and how long the prefill took in
    /// its engine (submission to finish), microseconds.
    Done { first_token: u32, compute_us: u64 },
    /// The prefill failed.
    Error(String),
}

/// K/V received from a prefill worker, inserted at admission instead of being computed.
#[derive(Debug, Clone, Default)]
pub(crate) struct TransferredKv {
    /// First position (a block boundary).
    pub(crate) start: usize,
    /// Number of positions (whole blocks).
    pub(crate) len: usize,
    /// Per layer: K of the positions, token-major.
    pub(crate) k: Vec<Vec<f32>>,
    /// Per layer: V.
    pub(crate) v: Vec<Vec<f32>>,
}

/// What kind of work a sequence is.
pub(crate) enum SeqKind {
    /// An ordinary completion.
    Generate,
    /// A remote prefill for a decode worker: compute the prompt, then hand over the blocks
    /// `skip_blocks..transfer_blocks` (pull: pinned until taken; push: streamed per layer).
    Prefill { transfer_id: u64, skip_blocks: usize, push: Option<UnboundedSender<TransferMsg>> },
}

/// A request for the engine.
pub(crate) struct NewSeq {
    pub(crate) tokens: Vec<u32>,
    pub(crate) max_tokens: usize,
    pub(crate) cache_salt: Option<String>,
    pub(crate) sink: Option<UnboundedSender<SeqEvent>>,
    pub(crate) arrival: Instant,
    pub(crate) kind: SeqKind,
    pub(crate) preloaded: Option<TransferredKv>,
}

/// Usage and timings of a finished sequence.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Completion {
    pub(crate) prompt_tokens: usize,
    pub(crate) completion_tokens: usize,
    /// Prompt tokens not computed here: local prefix hits + transferred.
    pub(crate) cached_tokens: usize,
    /// Of those, local prefix-cache hits.
    pub(crate) local_hit_tokens: usize,
    /// Of those, inserted from a transfer.
    pub(crate) transferred_tokens: usize,
    /// Remote prefill (pull): the transfer is pinned under this id.
    pub(crate) transfer_id: Option<u64>,
    /// Remote prefill: tokens to be transferred (whole blocks, after the skipped ones).
    pub(crate) transfer_tokens: usize,
    /// Remote prefill: the first token.
    pub(crate) first_token: Option<u32>,
}

/// What a sequence reports to its HTTP handler.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum SeqEvent {
    /// A generated token.
    Token(u32),
    /// Finished.
    Done(Completion),
    /// Failed.
    Error(String),
}

struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    generated: usize,
    cache_salt: Option<String>,
    sink: Option<UnboundedSender<SeqEvent>>,
    arrival: Instant,
    last_token_at: Option<Instant>,
    kind: SeqKind,
    preloaded: Option<TransferredKv>,
    num_computed: usize,
    blocks: Vec<u32>,
    digests: Vec<BlockDigest>,
    /// Blocks `0..processed` were looked at for caching.
    processed_blocks: usize,
    /// First admission's local hits and inserted tokens (for usage).
    hit_tokens: Option<usize>,
    transferred_tokens: usize,
    /// Push transfers: the header was sent.
    push_started: bool,
}

impl Seq {
    fn new(n: NewSeq) -> Seq {
        Seq {
            prompt_len: n.tokens.len(),
            tokens: n.tokens,
            max_tokens: n.max_tokens,
            generated: 0,
            cache_salt: n.cache_salt,
            sink: n.sink,
            arrival: n.arrival,
            last_token_at: None,
            kind: n.kind,
            preloaded: n.preloaded,
            num_computed: 0,
            blocks: Vec::new(),
            digests: Vec::new(),
            processed_blocks: 0,
            hit_tokens: None,
            transferred_tokens: 0,
            push_started: false,
        }
    }

    fn send(&self, ev: SeqEvent) -> bool {
        self.sink.as_ref().is_none_or(|s| s.send(ev).is_ok())
    }

    fn client_gone(&self) -> bool {
        self.sink.as_ref().is_some_and(UnboundedSender::is_closed)
    }

    fn push_sender(&self) -> Option<&UnboundedSender<TransferMsg>> {
        match &self.kind {
            SeqKind::Prefill { push: Some(p), .. } => Some(p),
            _ => None,
        }
    }
}

/// A pulled transfer waiting for its decode worker.
struct Pinned {
    blocks: Vec<u32>,
    start: usize,
    len: usize,
    tokens: Vec<u32>,
    first_token: u32,
    created: Instant,
    compute_us: u64,
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Engine parameters.
pub(crate) struct EngineParams {
    pub(crate) block_size: usize,
    pub(crate) max_running: usize,
    pub(crate) max_batched_tokens: usize,
    pub(crate) reemit_cache_hits: bool,
    pub(crate) pin_timeout: Duration,
    pub(crate) layers: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
}

pub(crate) struct Engine {
    p: EngineParams,
    backend: Box<dyn Backend>,
    pool: BlockPool,
    hasher: EngineHasher,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    pinned: HashMap<u64, Pinned>,
    events: Vec<WorkerEvent>,
    publisher: Option<mpsc::Sender<Batch>>,
    shared: Arc<Shared>,
    scratch: Vec<u8>,
    held: bool,
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl Engine {
    pub(crate) fn new(
        p: EngineParams,
        backend: Box<dyn Backend>,
        num_blocks: u32,
        hasher: EngineHasher,
        publisher: Option<mpsc::Sender<Batch>>,
        shared: Arc<Shared>,
    ) -> Engine {
        Shared::set(&shared.counters.num_blocks, u64::from(num_blocks));
        Shared::set(&shared.counters.free_blocks, u64::from(num_blocks));
        Engine {
            p,
            backend,
            pool: BlockPool::new(num_blocks),
            hasher,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pinned: HashMap::new(),
            events: Vec::new(),
            publisher,
            shared,
            scratch: Vec::new(),
            held: false,
        }
    }

    /// Run until `Shutdown` (or every sender is gone).
    pub(crate) fn run(mut self, rx: &mpsc::Receiver<Command>) {
        loop {
            let idle = self.held || (self.running.is_empty() && self.waiting.is_empty());
            let first = if idle {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(c) => Some(c),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            } else {
                None
            };
            let mut stop = false;
            for cmd in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
                if self.command(cmd) {
                    stop = true;
                    break;
                }
            }
            if stop {
                break;
            }
            self.expire_pins();
            let has_work = !(self.running.is_empty() && self.waiting.is_empty());
            if has_work && !self.held {
                self.step();
            }
            self.flush_events();
            self.update_gauges();
        }
        self.abort_all("the worker is shutting down");
        self.flush_events();
    }

    /// Handle one command; `true` to stop.
    fn command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit(n) => {
                Shared::add(&self.shared.counters.requests_submitted, 1);
                self.waiting.push_back(Seq::new(*n));
            }
            Command::TakeTransfer { id, reply } => reply(self.take_transfer(id)),
            Command::ProbePrefix { tokens, cache_salt, reply } => {
                let n = self.probe(&tokens, cache_salt.as_deref());
                reply(n);
            }
            Command::CachedKeys { reply } => reply(self.pool.cached_keys()),
            Command::ResetPrefixCache { reply } => {
                let ok = self.pool.reset();
                if ok {
                    self.events.push(WorkerEvent::AllBlocksCleared);
                    Shared::add(&self.shared.counters.cache_resets, 1);
                }
                reply(ok);
            }
            Command::Hold(on) => self.held = on,
            Command::Shutdown => return true,
        }
        false
    }

    fn extras<'a>(salt: Option<&'a str>) -> BlockExtras<'a> {
        BlockExtras { lora: None, cache_salt: salt }
    }

    /// Consecutive cached blocks of `tokens` (at most `(len - 1) / block_size`).
    fn probe(&mut self, tokens: &[u32], salt: Option<&str>) -> usize {
        let bs = self.p.block_size;
        let max = tokens.len().saturating_sub(1) / bs;
        let mut digests = Vec::new();
        if self.hasher.block_digests(&tokens[..max * bs], &Self::extras(salt), &mut self.scratch, &mut digests).is_err()
        {
            return 0;
        }
        digests.iter().take_while(|d| self.pool.lookup(d).is_some()).count()
    }

    /// Extend `seq.digests` to cover its first `upto` blocks (all full).
    fn ensure_digests(hasher: &EngineHasher, scratch: &mut Vec<u8>, seq: &mut Seq, upto: usize, bs: usize) {
        let have = seq.digests.len();
        if upto <= have {
            return;
        }
        let parent = seq.digests.last().copied();
        let tokens = &seq.tokens[have * bs..upto * bs];
        let extras = Self::extras(seq.cache_salt.as_deref());
        // Only LoRA paths can fail, and the worker has no adapters.
        let _ = hasher.extend_chain(parent.as_ref(), tokens, &extras, scratch, &mut seq.digests);
    }

    fn stored_event(&self, seq: &Seq, from: usize, to: usize) -> WorkerEvent {
        let bs = self.p.block_size;
        WorkerEvent::BlockStored {
            block_hashes: seq.digests[from..to].iter().map(BlockDigest::event_key).collect(),
            parent_block_hash: from.checked_sub(1).map(|i| seq.digests[i].event_key()),
            token_ids: seq.tokens[from * bs..to * bs].to_vec(),
            block_size: bs as u32,
            cache_salt: if from == 0 { seq.cache_salt.clone() } else { None },
        }
    }

    /// Allocate blocks so `seq` covers `upto` positions. `false`: not enough free blocks.
    fn grow(&mut self, seq_blocks: &mut Vec<u32>, upto: usize) -> bool {
        let need = upto.div_ceil(self.p.block_size).saturating_sub(seq_blocks.len());
        if need == 0 {
            return true;
        }
        let mut evicted = Vec::new();
        match self.pool.allocate(need, &mut evicted) {
            Some(ids) => {
                if !evicted.is_empty() {
                    Shared::add(&self.shared.counters.blocks_evicted, evicted.len() as u64);
                    self.events.push(WorkerEvent::BlockRemoved { block_hashes: evicted });
                }
                seq_blocks.extend(ids);
                true
            }
            None => false,
        }
    }

    fn release(&mut self, seq: &mut Seq) {
        let blocks = std::mem::take(&mut seq.blocks);
        self.pool.free(blocks.into_iter().rev());
    }

    fn preempt(&mut self, mut seq: Seq) {
        self.release(&mut seq);
        seq.num_computed = 0;
        seq.processed_blocks = 0;
        Shared::add(&self.shared.counters.preemptions, 1);
        self.waiting.push_front(seq);
    }

    /// Admission of a waiting sequence: prefix hits, then blocks received from a prefill worker,
    /// then the first chunk. Returns the chunk's size, or `None` (nothing changed) when its
    /// blocks cannot be allocated.
    fn admit(&mut self, seq: &mut Seq, budget: usize) -> Option<usize> {
        let bs = self.p.block_size;
        let n = seq.tokens.len();
        let max_hit = n.saturating_sub(1) / bs;
        Self::ensure_digests(&self.hasher, &mut self.scratch, seq, max_hit, bs);
        let mut hit_ids = Vec::new();
        for d in &seq.digests[..max_hit.min(seq.digests.len())] {
            match self.pool.lookup(d) {
                Some(id) => hit_ids.push(id),
                None => break,
            }
        }
        let hits = hit_ids.len();
        // Blocks received from a prefill worker, contiguous with the hits.
        let pre_blocks = seq
            .preloaded
            .as_ref()
            .filter(|p| p.start <= hits * bs && p.start + p.len > hits * bs)
            .map_or(0, |p| ((p.start + p.len) / bs).saturating_sub(hits).min(max_hit - hits));
        let computed = (hits + pre_blocks) * bs;
        let chunk = (n - computed).min(budget);
        if chunk == 0 {
            return None;
        }
        // Reference the hits first so the allocation below cannot evict them.
        for &id in &hit_ids {
            self.pool.touch(id);
        }
        let mut blocks = hit_ids;
        if !self.grow(&mut blocks, computed + chunk) {
            self.pool.free(blocks.into_iter().rev());
            return None;
        }
        seq.blocks = blocks;
        seq.num_computed = hits * bs;
        seq.processed_blocks = hits;
        if self.p.reemit_cache_hits && hits > 0 {
            // vLLM 0.33 re-emits BlockStored for prefix-cache hits.
            let ev = self.stored_event(seq, 0, hits);
            self.events.push(ev);
        }
        let mut inserted = 0;
        if let Some(p) = seq.preloaded.take() {
            if pre_blocks > 0 && self.insert_preloaded(seq, &p, hits, pre_blocks).is_ok() {
                inserted = pre_blocks;
            }
        }
        // Without the transferred blocks (failed insert), the chunk starts at the hits.
        let chunk = if inserted == pre_blocks { chunk } else { (n - hits * bs).min(budget) };
        let c = &self.shared.counters;
        Shared::add(&c.prefix_cache_queries, n as u64);
        Shared::add(&c.cached_tokens_reused, (hits * bs) as u64);
        if seq.hit_tokens.is_none() {
            Shared::add(&c.prompt_tokens, seq.prompt_len as u64);
            seq.hit_tokens = Some(hits * bs);
            seq.transferred_tokens = inserted * bs;
            Shared::add(&c.kv_transfer_in_tokens, (inserted * bs) as u64);
            Shared::add(&c.kv_transfer_in_blocks, inserted as u64);
        }
        // Push transfers: the header, and the positions already in the pool.
        self.push_cached(seq);
        Some(chunk)
    }

    /// Write transferred K/V into the sequence's blocks `hits..hits + n` and cache them.
    fn insert_preloaded(
        &mut self,
        seq: &mut Seq,
        p: &TransferredKv,
        hits: usize,
        n: usize,
    ) -> Result<(), crate::model::BackendError> {
        let bs = self.p.block_size;
        let d = self.p.kv_heads * self.p.head_dim;
        let from = hits * bs;
        let off = from - p.start;
        let len = n * bs;
        for l in 0..self.p.layers {
            let (k, v) = (&p.k[l], &p.v[l]);
            let (Some(k), Some(v)) = (k.get(off * d..(off + len) * d), v.get(off * d..(off + len) * d)) else {
                return Err(crate::model::BackendError::Invalid("short transfer".into()));
            };
            self.backend.write_kv(l, &seq.blocks, from, k, v)?;
        }
        Self::ensure_digests(&self.hasher, &mut self.scratch, seq, hits + n, bs);
        let mut run_start = None;
        for i in hits..hits + n {
            let cached = self.pool.cache(seq.blocks[i], seq.digests[i]);
            if cached {
                Shared::add(&self.shared.counters.blocks_stored, 1);
                run_start.get_or_insert(i);
            } else if let Some(s) = run_start.take() {
                let ev = self.stored_event(seq, s, i);
                self.events.push(ev);
            }
        }
        if let Some(s) = run_start {
            let ev = self.stored_event(seq, s, hits + n);
            self.events.push(ev);
        }
        seq.num_computed = from + len;
        seq.processed_blocks = hits + n;
        Ok(())
    }

    /// Range of positions a prefill sequence hands over: `(start, end)`.
    fn transfer_range(&self, seq: &Seq) -> Option<(usize, usize)> {
        let SeqKind::Prefill { skip_blocks, .. } = &seq.kind else { return None };
        let bs = self.p.block_size;
        let end = (seq.prompt_len.saturating_sub(1) / bs) * bs;
        let start = (skip_blocks * bs).min(end);
        Some((start, end))
    }

    /// Push transfers: send the header and the K/V of positions already in the pool (hits).
    fn push_cached(&mut self, seq: &mut Seq) {
        let Some((start, end)) = self.transfer_range(seq) else { return };
        let Some(tx) = seq.push_sender() else { return };
        if !seq.push_started {
            let _ = tx.send(TransferMsg::Header {
                layers: self.p.layers as u32,
                kv_heads: self.p.kv_heads as u32,
                head_dim: self.p.head_dim as u32,
                block_size: self.p.block_size as u32,
                start: start as u32,
                tokens: seq.tokens[start..end].to_vec(),
            });
        }
        let to = seq.num_computed.min(end);
        if to > start {
            for l in 0..self.p.layers {
                send_layer(tx, self.backend.kv(), l, &seq.blocks, start, to, self.p.kv_heads * self.p.head_dim);
            }
        }
        seq.push_started = true;
    }

    fn step(&mut self) {
        let bs = self.p.block_size;
        let mut budget = self.p.max_batched_tokens;
        // Drop sequences whose client is gone.
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].client_gone() {
                let mut s = self.running.remove(i);
                self.release(&mut s);
                Shared::add(&self.shared.counters.requests_aborted, 1);
            } else {
                i += 1;
            }
        }
        self.waiting.retain(|s| {
            let gone = s.client_gone();
            if gone {
                Shared::add(&self.shared.counters.requests_aborted, 1);
            }
            !gone
        });

        // 1. Running sequences.
        let mut plan: Vec<(usize, usize)> = Vec::new();
        let mut idx = 0;
        while idx < self.running.len() && budget > 0 {
            let (computed, total) = (self.running[idx].num_computed, self.running[idx].tokens.len());
            let n = (total - computed).min(budget);
            if n == 0 {
                idx += 1;
                continue;
            }
            let mut scheduled = false;
            loop {
                let mut blocks = std::mem::take(&mut self.running[idx].blocks);
                let ok = self.grow(&mut blocks, computed + n);
                self.running[idx].blocks = blocks;
                if ok {
                    scheduled = true;
                    break;
                }
                // Preempt the last running sequence (possibly this one).
                let Some(victim) = self.running.pop() else { break };
                let was_self = self.running.len() == idx;
                self.preempt(victim);
                if was_self {
                    break;
                }
            }
            if !scheduled {
                break;
            }
            plan.push((idx, n));
            budget -= n;
            idx += 1;
        }

        // 2. Waiting sequences.
        while budget > 0 && self.running.len() < self.p.max_running {
            let Some(mut seq) = self.waiting.pop_front() else { break };
            match self.admit(&mut seq, budget) {
                Some(n) => {
                    budget -= n;
                    self.running.push(seq);
                    plan.push((self.running.len() - 1, n));
                }
                None => {
                    self.waiting.push_front(seq);
                    break;
                }
            }
        }
        if plan.is_empty() {
            return;
        }

        // 3. Forward.
        let kvd = self.p.kv_heads * self.p.head_dim;
        let result = {
            let running = &self.running;
            let batch: Vec<SeqBatch<'_>> = plan
                .iter()
                .map(|&(i, n)| {
                    let s = &running[i];
                    SeqBatch {
                        tokens: &s.tokens[s.num_computed..s.num_computed + n],
                        start: s.num_computed,
                        block_table: &s.blocks,
                        want_logits: s.num_computed + n == s.tokens.len(),
                    }
                })
                .collect();
            // Push transfers: positions of this chunk inside the transferred range.
            let pushes: Vec<(&UnboundedSender<TransferMsg>, &[u32], usize, usize)> = plan
                .iter()
                .filter_map(|&(i, n)| {
                    let s = &running[i];
                    let tx = s.push_sender()?;
                    let SeqKind::Prefill { skip_blocks, .. } = &s.kind else { return None };
                    let end = (s.prompt_len.saturating_sub(1) / bs) * bs;
                    let from = s.num_computed.max(skip_blocks * bs);
                    let to = (s.num_computed + n).min(end);
                    (to > from).then_some((tx, &s.blocks[..], from, to))
                })
                .collect();
            let mut hook = |layer: usize, kv: &dyn KvRead| {
                for &(tx, table, from, to) in &pushes {
                    send_layer(tx, kv, layer, table, from, to, kvd);
                }
            };
            self.backend.forward(&batch, &mut hook)
        };
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                let msg = format!("model error: {e}");
                let mut idxs: Vec<usize> = plan.iter().map(|&(i, _)| i).collect();
                idxs.sort_unstable();
                for i in idxs.into_iter().rev() {
                    let mut s = self.running.remove(i);
                    s.send(SeqEvent::Error(msg.clone()));
                    self.fail_transfer(&s, &msg);
                    self.release(&mut s);
                    Shared::add(&self.shared.counters.requests_aborted, 1);
                }
                return;
            }
        };

        // 4. Book-keeping, caching, sampling.
        let now = Instant::now();
        let mut finished = Vec::new();
        for (&(i, n), logits) in plan.iter().zip(logits) {
            let mut seq = std::mem::replace(&mut self.running[i], placeholder());
            // Positions of the prompt count as prefill, positions of generated tokens as decode.
            let prefill_part = seq.prompt_len.saturating_sub(seq.num_computed).min(n);
            Shared::add(&self.shared.counters.prefill_tokens_computed, prefill_part as u64);
            Shared::add(&self.shared.counters.decode_tokens_computed, (n - prefill_part) as u64);
            seq.num_computed += n;
            self.cache_full_blocks(&mut seq);
            if let Some(l) = logits {
                let tok = argmax(&l);
                if self.sample(&mut seq, tok, now) {
                    finished.push(i);
                }
            }
            self.running[i] = seq;
        }
        // Take every finished sequence out first, so the gauges a client reads after its
        // response already exclude it.
        finished.sort_unstable();
        let done: Vec<Seq> = finished.into_iter().rev().map(|i| self.running.remove(i)).collect();
        for seq in done.into_iter().rev() {
            self.finish(seq, now);
        }
    }

    /// Cache the blocks that became full and computed; queue their BlockStored events.
    fn cache_full_blocks(&mut self, seq: &mut Seq) {
        let bs = self.p.block_size;
        let full = seq.num_computed / bs;
        if full <= seq.processed_blocks {
            return;
        }
        Self::ensure_digests(&self.hasher, &mut self.scratch, seq, full, bs);
        let mut run_start: Option<usize> = None;
        for i in seq.processed_blocks..full {
            let id = seq.blocks[i];
            let newly = !self.pool.is_cached(id) && self.pool.cache(id, seq.digests[i]);
            if newly {
                Shared::add(&self.shared.counters.blocks_stored, 1);
                run_start.get_or_insert(i);
            } else if let Some(s) = run_start.take() {
                let ev = self.stored_event(seq, s, i);
                self.events.push(ev);
            }
        }
        if let Some(s) = run_start {
            let ev = self.stored_event(seq, s, full);
            self.events.push(ev);
        }
        seq.processed_blocks = full;
    }

    /// Take the sampled token; `true` when the sequence is finished.
    fn sample(&mut self, seq: &mut Seq, tok: u32, now: Instant) -> bool {
        seq.tokens.push(tok);
        seq.generated += 1;
        Shared::add(&self.shared.counters.generation_tokens, 1);
        match seq.last_token_at {
            None => {
                if matches!(seq.kind, SeqKind::Generate) {
                    let ttft = now.duration_since(seq.arrival).as_secs_f64();
                    self.shared.observe(|h| h.ttft.observe(ttft));
                }
            }
            Some(t) => {
                let itl = now.duration_since(t).as_secs_f64();
                self.shared.observe(|h| h.itl.observe(itl));
            }
        }
        seq.last_token_at = Some(now);
        if matches!(seq.kind, SeqKind::Generate) && !seq.send(SeqEvent::Token(tok)) {
            return true;
        }
        seq.generated >= seq.max_tokens
    }

    fn completion(&self, seq: &Seq) -> Completion {
        let hit = seq.hit_tokens.unwrap_or(0);
        Completion {
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.generated,
            cached_tokens: hit + seq.transferred_tokens,
            local_hit_tokens: hit,
            transferred_tokens: seq.transferred_tokens,
            transfer_id: None,
            transfer_tokens: 0,
            first_token: None,
        }
    }

    fn finish(&mut self, mut seq: Seq, now: Instant) {
        let mut done = self.completion(&seq);
        let e2e = now.duration_since(seq.arrival).as_secs_f64();
        match &seq.kind {
            SeqKind::Generate => {
                self.shared.observe(|h| h.e2e.observe(e2e));
                Shared::add(&self.shared.counters.requests_finished, 1);
                self.flush_events();
                self.release(&mut seq);
                self.update_gauges();
                seq.send(SeqEvent::Done(done));
            }
            SeqKind::Prefill { transfer_id, push, .. } => {
                let (start, end) = self.transfer_range(&seq).unwrap_or((0, 0));
                let first = seq.tokens.get(seq.prompt_len).copied().unwrap_or(0);
                Shared::add(&self.shared.counters.requests_finished, 1);
                Shared::add(&self.shared.counters.remote_prefills, 1);
                done.transfer_tokens = end - start;
                done.first_token = Some(first);
                self.flush_events();
                match push {
                    Some(tx) => {
                        let compute_us = micros(now.duration_since(seq.arrival));
                        let _ = tx.send(TransferMsg::Done { first_token: first, compute_us });
                        seq.send(SeqEvent::Done(done));
                        self.release(&mut seq);
                    }
                    None => {
                        done.transfer_id = Some(*transfer_id);
                        let pinned = Pinned {
                            blocks: std::mem::take(&mut seq.blocks),
                            start,
                            len: end - start,
                            tokens: seq.tokens[start..end].to_vec(),
                            first_token: first,
                            created: now,
                            compute_us: micros(now.duration_since(seq.arrival)),
                        };
                        self.pinned.insert(*transfer_id, pinned);
                        seq.send(SeqEvent::Done(done));
                    }
                }
            }
        }
    }

    fn fail_transfer(&self, seq: &Seq, msg: &str) {
        if let Some(tx) = seq.push_sender() {
            let _ = tx.send(TransferMsg::Error(msg.to_owned()));
        }
    }

    fn take_transfer(&mut self, id: u64) -> Option<Vec<TransferMsg>> {
        let p = self.pinned.remove(&id)?;
        let kvd = self.p.kv_heads * self.p.head_dim;
        let mut msgs = vec![TransferMsg::Header {
            layers: self.p.layers as u32,
            kv_heads: self.p.kv_heads as u32,
            head_dim: self.p.head_dim as u32,
            block_size: self.p.block_size as u32,
            start: p.start as u32,
            tokens: p.tokens,
        }];
        for l in 0..self.p.layers {
            let (mut k, mut v) = (vec![0.0; p.len * kvd], vec![0.0; p.len * kvd]);
            if let Err(e) = self.backend.kv().read(l, &p.blocks, p.start, &mut k, &mut v) {
                msgs = vec![TransferMsg::Error(e.to_string())];
                break;
            }
            msgs.push(TransferMsg::Layer { layer: l as u32, start: p.start as u32, k, v });
        }
        if !matches!(msgs.last(), Some(TransferMsg::Error(_))) {
            msgs.push(TransferMsg::Done { first_token: p.first_token, compute_us: p.compute_us });
        }
        self.pool.free(p.blocks.into_iter().rev());
        Some(msgs)
    }

    fn expire_pins(&mut self) {
        if self.pinned.is_empty() {
            return;
        }
        let timeout = self.p.pin_timeout;
        let expired: Vec<u64> =
            self.pinned.iter().filter(|(_, p)| p.created.elapsed() > timeout).map(|(&id, _)| id).collect();
        for id in expired {
            if let Some(p) = self.pinned.remove(&id) {
                self.pool.free(p.blocks.into_iter().rev());
            }
        }
    }

    fn abort_all(&mut self, why: &str) {
        let mut all: Vec<Seq> = self.running.drain(..).collect();
        all.extend(self.waiting.drain(..));
        for mut s in all {
            s.send(SeqEvent::Error(why.to_owned()));
            self.fail_transfer(&s, why);
            self.release(&mut s);
            Shared::add(&self.shared.counters.requests_aborted, 1);
        }
        let pins: Vec<Pinned> = self.pinned.drain().map(|(_, p)| p).collect();
        for p in pins {
            self.pool.free(p.blocks.into_iter().rev());
        }
    }

    fn flush_events(&mut self) {
        if self.events.is_empty() {
            return;
        }
        let events = std::mem::take(&mut self.events);
        if let Some(tx) = &self.publisher {
            if tx.send((unix_now(), events)).is_ok() {
                Shared::add(&self.shared.counters.event_batches, 1);
            }
        }
    }

    fn update_gauges(&self) {
        let c = &self.shared.counters;
        Shared::set(&c.running, self.running.len() as u64);
        Shared::set(&c.waiting, self.waiting.len() as u64);
        Shared::set(&c.free_blocks, self.pool.num_free() as u64);
        Shared::set(&c.cached_blocks, self.pool.num_cached() as u64);
        Shared::set(&c.pinned_transfers, self.pinned.len() as u64);
        self.shared.kv_usage_bits.store(self.pool.usage().to_bits(), std::sync::atomic::Ordering::Relaxed);
    }
}

/// Read layer `layer` of positions `from..to` and send it.
fn send_layer(
    tx: &UnboundedSender<TransferMsg>,
    kv: &dyn KvRead,
    layer: usize,
    table: &[u32],
    from: usize,
    to: usize,
    kvd: usize,
) {
    let n = to - from;
    let (mut k, mut v) = (vec![0.0; n * kvd], vec![0.0; n * kvd]);
    let msg = match kv.read(layer, table, from, &mut k, &mut v) {
        Ok(()) => TransferMsg::Layer { layer: layer as u32, start: from as u32, k, v },
        Err(e) => TransferMsg::Error(e.to_string()),
    };
    let _ = tx.send(msg);
}

fn placeholder() -> Seq {
    Seq::new(NewSeq {
        tokens: Vec::new(),
        max_tokens: 0,
        cache_salt: None,
        sink: None,
        arrival: Instant::now(),
        kind: SeqKind::Generate,
        preloaded: None,
    })
}

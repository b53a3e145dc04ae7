//! Internal state: what all VMs share (`Shared`, Envoy's process-wide state) and what one VM's
//! hostcalls see (`VmState`, the data of its wasmtime `Store`).

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::rc::Rc;

use wasmtime::{Memory, StoreLimits, TypedFunc};

use crate::abi::LogLevel;
use crate::fast_map::FastMap;
use crate::headers::HeaderMap;
use crate::types::{AbiViolation, CalloutReply, CalloutRequest, Dir, LocalReply, LogEntry, Stream, VmId};

/// One vm_id's shared data: key → (value, cas).
pub(crate) type SharedData = FastMap<Vec<u8>, (Vec<u8>, u32)>;

/// A cluster's callout handler.
pub(crate) type ClusterHandler = Box<dyn FnMut(&CalloutRequest) -> CalloutReply>;

/// Bounded history (logs, callouts, violations): keeps the newest `cap` entries.
#[derive(Debug)]
pub(crate) struct History<T> {
    pub(crate) items: Vec<T>,
    pub(crate) cap: usize,
    pub(crate) dropped: u64,
}

impl<T> History<T> {
    pub(crate) fn new(cap: usize) -> History<T> {
        History { items: Vec::new(), cap, dropped: 0 }
    }

    pub(crate) fn push(&mut self, item: T) {
        if self.cap == 0 {
            self.dropped += 1;
            return;
        }
        if self.items.len() >= self.cap.saturating_mul(2) {
            let excess = self.items.len() - self.cap + 1;
            self.items.drain(..excess);
            self.dropped += excess as u64;
        }
        self.items.push(item);
    }

    pub(crate) fn view(&self) -> &[T] {
        let start = self.items.len().saturating_sub(self.cap);
        &self.items[start..]
    }

    pub(crate) fn take(&mut self) -> Vec<T> {
        let start = self.items.len().saturating_sub(self.cap);
        self.items.drain(..start);
        std::mem::take(&mut self.items)
    }
}

/// A scheduled event on the virtual timeline.
#[derive(Debug)]
pub(crate) enum Event {
    Tick { vm: usize, root: u32, generation: u64 },
    CalloutResponse { vm: usize, root: u32, token: u32, response: Option<CallResponse> },
    QueueReady { vm: usize, context: u32, token: u32 },
}

#[derive(Debug)]
pub(crate) struct Timed {
    pub(crate) due: u64,
    pub(crate) seq: u64,
    pub(crate) event: Event,
}

impl PartialEq for Timed {
    fn eq(&self, other: &Timed) -> bool {
        (self.due, self.seq) == (other.due, other.seq)
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, other: &Timed) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Timed {
    fn cmp(&self, other: &Timed) -> std::cmp::Ordering {
        (self.due, self.seq).cmp(&(other.due, other.seq))
    }
}

/// An HTTP callout answer as delivered to `proxy_on_http_call_response` (`None`: failed call).
#[derive(Clone, Debug)]
pub(crate) struct CallResponse {
    pub(crate) headers: HeaderMap,
    pub(crate) body: Vec<u8>,
    pub(crate) trailers: HeaderMap,
}

#[derive(Debug)]
pub(crate) struct Queue {
    pub(crate) items: VecDeque<Vec<u8>>,
    /// The last registrant: (VM index, root context id).
    pub(crate) consumer: (usize, u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// Process-wide state shared by every VM of a host.
pub(crate) struct Shared {
    pub(crate) now_ns: u64,
    pub(crate) seq: u64,
    pub(crate) timeline: BinaryHeap<Reverse<Timed>>,
    pub(crate) log_level: LogLevel,
    pub(crate) logs: History<LogEntry>,
    pub(crate) violations: History<AbiViolation>,
    pub(crate) callouts: History<CalloutRequest>,
    /// vm_id → key → (value, cas).
    pub(crate) shared_data: FastMap<String, SharedData>,
    pub(crate) next_cas: u32,
    pub(crate) forced_cas_mismatch: FastMap<(String, Vec<u8>), u32>,
    pub(crate) queues: FastMap<u32, Queue>,
    pub(crate) queue_tokens: FastMap<(String, Vec<u8>), u32>,
    pub(crate) next_queue_token: u32,
    pub(crate) clusters: FastMap<String, ClusterHandler>,
    pub(crate) metrics: FastMap<(MetricKind, String), MetricSlot>,
    pub(crate) histogram_cap: usize,
    pub(crate) random_state: u64,
    /// Injected hostcall faults and per-import call counts.
    pub(crate) faults: crate::faults::Faults,
}

#[derive(Debug, Default)]
pub(crate) struct MetricSlot {
    pub(crate) value: u64,
    pub(crate) samples: VecDeque<u64>,
}

impl Shared {
    pub(crate) fn schedule(&mut self, due: u64, event: Event) {
        self.seq += 1;
        let seq = self.seq;
        self.timeline.push(Reverse(Timed { due, seq, event }));
    }

    /// Envoy's `SharedData::nextCas`: starts at 1, never 0.
    pub(crate) fn next_cas(&mut self) -> u32 {
        let cas = self.next_cas;
        self.next_cas = self.next_cas.wrapping_add(1);
        if self.next_cas == 0 {
            self.next_cas = 1;
        }
        cas
    }

    /// Deterministic bytes for WASI `random_get` (xorshift64*).
    pub(crate) fn fill_random(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let mut x = self.random_state;
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            self.random_state = x;
            let bytes = x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    }

    pub(crate) fn violation(&mut self, vm: VmId, context_id: u32, call: &'static str, message: impl Into<String>) {
        self.violations.push(AbiViolation { vm, context_id, call, message: message.into() });
    }
}

/// A root (plugin) context.
#[derive(Debug, Default)]
pub(crate) struct RootCtx {
    pub(crate) tick_period_ns: u64,
    pub(crate) tick_generation: u64,
}

/// A context of one VM.
#[derive(Debug)]
pub(crate) enum Context {
    Root(RootCtx),
    Http(Box<Stream>),
}

/// Work Envoy defers until the running callback has returned.
#[derive(Debug)]
pub(crate) enum AfterCall {
    Continue { context: u32, dir: Dir },
    Close { context: u32 },
    LocalReply { context: u32, reply: LocalReply },
    Done { context: u32 },
}

/// The data of one VM's store: everything its hostcalls read and write.
pub(crate) struct VmState {
    pub(crate) shared: Rc<RefCell<Shared>>,
    pub(crate) vm: VmId,
    pub(crate) vm_id: String,
    pub(crate) plugin_name: String,
    pub(crate) root_id: String,
    pub(crate) vm_config: Vec<u8>,
    pub(crate) plugin_config: Vec<u8>,
    /// Whether `PLUGIN_CONFIGURATION` is readable (during a root context's creation and configure).
    pub(crate) plugin_config_visible: bool,
    pub(crate) properties: Vec<(Vec<u8>, Vec<u8>)>,
    pub(crate) memory: Option<Memory>,
    pub(crate) alloc: Option<Rc<TypedFunc<i32, i32>>>,
    /// `_initialize`/`_start` is running: only logging, clocks and WASI are allowed (as in Envoy).
    pub(crate) initializing: bool,
    /// The context of the running callback (0: the VM context, during start and allocation).
    pub(crate) current: u32,
    /// Set by `proxy_set_effective_context` for the rest of the callback (0: none).
    pub(crate) effective: u32,
    pub(crate) contexts: FastMap<u32, Context>,
    pub(crate) next_context_id: u32,
    pub(crate) next_http_token: u32,
    pub(crate) after_call: Vec<AfterCall>,
    /// Set by `proxy_send_local_response`: the running callback's status becomes a full stop.
    pub(crate) stop_next_iteration: bool,
    /// Contexts whose `proxy_on_done` returned false (waiting for `proxy_done`).
    pub(crate) pending_done: Vec<u32>,
    /// The response being delivered by `proxy_on_http_call_response` (`Some(None)`: failed call).
    pub(crate) call_response: Option<Option<CallResponse>>,
    pub(crate) metric_ids: FastMap<u32, (MetricKind, String)>,
    pub(crate) next_metric_id: [u32; 3],
    pub(crate) allow_on_headers_stop_iteration: bool,
    pub(crate) fail_open: bool,
    pub(crate) failed: Option<String>,
    pub(crate) limits: StoreLimits,
}

impl VmState {
    /// The context hostcalls act on: the effective context if set and alive, else the current one.
    pub(crate) fn active_context(&self) -> u32 {
        if self.effective != 0 && self.contexts.contains_key(&self.effective) {
            self.effective
        } else {
            self.current
        }
    }

    /// The root context of `context` (itself for a root context).
    pub(crate) fn root_of(&self, context: u32) -> Option<u32> {
        match self.contexts.get(&context)? {
            Context::Root(_) => Some(context),
            Context::Http(stream) => Some(stream.root),
        }
    }

    pub(crate) fn stream(&self, context: u32) -> Option<&Stream> {
        match self.contexts.get(&context)? {
            Context::Http(stream) => Some(stream),
            Context::Root(_) => None,
        }
    }

    pub(crate) fn stream_mut(&mut self, context: u32) -> Option<&mut Stream> {
        match self.contexts.get_mut(&context)? {
            Context::Http(stream) => Some(stream),
            Context::Root(_) => None,
        }
    }

    pub(crate) fn violation(&self, call: &'static str, message: impl Into<String>) {
        let context = self.active_context();
        self.shared.borrow_mut().violation(self.vm, context, call, message);
    }

    pub(crate) fn alloc_context_id(&mut self) -> u32 {
        loop {
            let id = self.next_context_id;
            self.next_context_id = self.next_context_id.wrapping_add(1).max(1);
            if !self.contexts.contains_key(&id) {
                return id;
            }
        }
    }
}

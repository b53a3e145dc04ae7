//! The host: engine, VMs, shared state, the virtual clock and its events.

use std::cell::{Ref, RefCell};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::Path;
use std::rc::Rc;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use wasmtime::{
    Config, Engine, Extern, Instance, Linker, Module, OptLevel, Store, StoreLimitsBuilder, TypedFunc, WasmParams,
    WasmResults,
};

use crate::abi::{Action, LogLevel};
use crate::error::HostError;
use crate::fast_map::FastMap;
use crate::faults::{Fault, Faults};
use crate::state::{AfterCall, ClusterHandler, Context, Event, History, MetricKind, RootCtx, Shared, Timed, VmState};
use crate::types::{
    AbiViolation, CalloutReply, CalloutRequest, LogEntry, MetricValue, Stream, StreamId, VmConfig, VmId,
};

/// Arguments of `proxy_on_http_call_response`: (root context, token, headers, body size, trailers).
type CalloutResponseArgs = (i32, i32, i32, i32, i32);

/// Default start of the virtual clock: 2023-11-14T22:13:20Z, in ns since the Unix epoch.
pub const DEFAULT_START_TIME_NS: u64 = 1_700_000_000_000_000_000;
/// Default number of log lines, callouts and violations kept (oldest dropped).
pub const DEFAULT_HISTORY_CAP: usize = 100_000;
/// Default limit of a VM's linear memory (Envoy's `PROXY_WASM_HOST_MAX_WASM_MEMORY_SIZE_BYTES`).
pub const DEFAULT_MEMORY_LIMIT: usize = 1 << 30;
/// Events allowed at one virtual instant before [`HostError::EventStorm`].
pub const EVENT_STORM_LIMIT: usize = 100_000;

/// Configures a [`Host`].
pub struct HostBuilder {
    start_time_ns: u64,
    log_level: LogLevel,
    history_cap: usize,
    fuel: Option<u64>,
    memory_limit: usize,
    random_seed: u64,
    clusters: Vec<(String, ClusterHandler)>,
}

impl Default for HostBuilder {
    fn default() -> HostBuilder {
        HostBuilder {
            start_time_ns: DEFAULT_START_TIME_NS,
            log_level: LogLevel::Trace,
            history_cap: DEFAULT_HISTORY_CAP,
            fuel: None,
            memory_limit: DEFAULT_MEMORY_LIMIT,
            random_seed: 0x9E37_79B9_7F4A_7C15,
            clusters: Vec::new(),
        }
    }
}

impl HostBuilder {
    /// Start of the virtual clock, ns since the Unix epoch ([`DEFAULT_START_TIME_NS`]).
    pub fn start_time_ns(mut self, ns: u64) -> HostBuilder {
        self.start_time_ns = ns;
        self
    }

    /// The host's log level: `proxy_get_log_level` answers it, lower levels are dropped (default
    /// Trace: everything is captured; Envoy's default is Info).
    pub fn log_level(mut self, level: LogLevel) -> HostBuilder {
        self.log_level = level;
        self
    }

    /// How many log lines, callouts and ABI violations are kept ([`DEFAULT_HISTORY_CAP`]); also the
    /// number of samples kept per histogram.
    pub fn history_cap(mut self, cap: usize) -> HostBuilder {
        self.history_cap = cap;
        self
    }

    /// Meters guest execution: each callback (and module start) may execute about this many wasm
    /// instructions; beyond, it traps ("all fuel consumed"). Off by default (it slows execution).
    pub fn fuel_per_call(mut self, fuel: u64) -> HostBuilder {
        self.fuel = Some(fuel);
        self
    }

    /// Limit of each VM's linear memory in bytes ([`DEFAULT_MEMORY_LIMIT`]): `memory.grow` beyond it fails.
    pub fn memory_limit(mut self, bytes: usize) -> HostBuilder {
        self.memory_limit = bytes;
        self
    }

    /// Seed of WASI `random_get` (deterministic bytes).
    pub fn random_seed(mut self, seed: u64) -> HostBuilder {
        self.random_seed = seed | 1;
        self
    }

    /// Registers an upstream cluster for `proxy_http_call`: `handler` answers each call (synchronously,
    /// when the call is dispatched; the answer reaches the filter after the reply's delay). Calls to
    /// unregistered clusters answer BadArgument, as in Envoy.
    pub fn cluster(
        mut self,
        name: &str,
        handler: impl FnMut(&CalloutRequest) -> CalloutReply + 'static,
    ) -> HostBuilder {
        self.clusters.push((name.to_string(), Box::new(handler)));
        self
    }

    /// Builds the host.
    pub fn build(self) -> Result<Host, HostError> {
        let engine = engine(self.fuel.is_some())?;
        let mut linker = Linker::new(&engine);
        crate::hostcalls::add_to_linker(&mut linker).map_err(|e| HostError::Compile(format!("{e:?}")))?;
        let shared = Shared {
            now_ns: self.start_time_ns,
            seq: 0,
            timeline: BinaryHeap::new(),
            log_level: self.log_level,
            logs: History::new(self.history_cap),
            violations: History::new(self.history_cap),
            callouts: History::new(self.history_cap),
            shared_data: FastMap::default(),
            next_cas: 1,
            forced_cas_mismatch: FastMap::default(),
            queues: FastMap::default(),
            queue_tokens: FastMap::default(),
            next_queue_token: 1,
            clusters: self.clusters.into_iter().collect(),
            metrics: FastMap::default(),
            histogram_cap: self.history_cap,
            random_state: self.random_seed | 1,
            faults: crate::faults::Faults::default(),
        };
        Ok(Host {
            engine,
            linker,
            shared: Rc::new(RefCell::new(shared)),
            vms: Vec::new(),
            fuel: self.fuel,
            memory_limit: self.memory_limit,
        })
    }
}

/// One engine per fuel setting for the whole process, so that compiled modules can be shared
/// between hosts (tests run hosts on many threads).
fn engine(fuel: bool) -> Result<Engine, HostError> {
    static PLAIN: OnceLock<Engine> = OnceLock::new();
    static FUELED: OnceLock<Engine> = OnceLock::new();
    let cell = if fuel { &FUELED } else { &PLAIN };
    if let Some(engine) = cell.get() {
        return Ok(engine.clone());
    }
    let mut config = Config::new();
    // wasm backtraces are on by default (trap messages carry the guest's stack)
    config.cranelift_opt_level(OptLevel::Speed).consume_fuel(fuel);
    // Profiling the guest with `perf`: with `KVROUTE_HOST_PERFMAP` set, wasmtime writes the JIT
    // symbol map perf reads (its perfmap strategy), so guest functions show by name (when the
    // module keeps its name section).
    if std::env::var_os("KVROUTE_HOST_PERFMAP").is_some() {
        config.profiler(wasmtime::ProfilingStrategy::PerfMap);
    }
    let engine = Engine::new(&config).map_err(|e| HostError::Compile(format!("{e:?}")))?;
    Ok(cell.get_or_init(|| engine).clone())
}

/// A compiled wasm module, ready to be started in VMs (cheap to clone).
#[derive(Clone)]
pub struct Plugin {
    pub(crate) module: Module,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin").field("name", &self.module.name()).finish_non_exhaustive()
    }
}

impl Plugin {
    /// `module.import` names the module imports.
    pub fn imports(&self) -> Vec<String> {
        self.module.imports().map(|i| format!("{}.{}", i.module(), i.name())).collect()
    }

    /// Names the module exports.
    pub fn exports(&self) -> Vec<String> {
        self.module.exports().map(|e| e.name().to_string()).collect()
    }
}

/// The callbacks of a module, typed as ABI 0.2.1 has them (`None`: not exported).
#[derive(Clone)]
pub(crate) struct Exports {
    pub(crate) on_context_create: Export<(i32, i32), ()>,
    pub(crate) on_vm_start: Export<(i32, i32), i32>,
    pub(crate) on_configure: Export<(i32, i32), i32>,
    pub(crate) on_tick: Export<i32, ()>,
    pub(crate) on_queue_ready: Export<(i32, i32), ()>,
    pub(crate) on_request_headers: Export<(i32, i32, i32), i32>,
    pub(crate) on_request_body: Export<(i32, i32, i32), i32>,
    pub(crate) on_request_trailers: Export<(i32, i32), i32>,
    pub(crate) on_response_headers: Export<(i32, i32, i32), i32>,
    pub(crate) on_response_body: Export<(i32, i32, i32), i32>,
    pub(crate) on_response_trailers: Export<(i32, i32), i32>,
    pub(crate) on_http_call_response: Export<CalloutResponseArgs, ()>,
    pub(crate) on_done: Export<i32, i32>,
    pub(crate) on_log: Export<i32, ()>,
    pub(crate) on_delete: Export<i32, ()>,
}

/// An optional export as a typed function, shared (see [`typed`]).
type Export<P, R> = Option<Rc<TypedFunc<P, R>>>;

/// An export as a typed function, behind an `Rc`: each call clones the `Rc`, not the function
/// (whose type registration is reference-counted and costs more to clone and drop).
fn typed<P: WasmParams, R: WasmResults>(
    store: &mut Store<VmState>,
    instance: &Instance,
    name: &str,
) -> Result<Export<P, R>, HostError> {
    match instance.get_export(&mut *store, name) {
        None => Ok(None),
        Some(Extern::Func(f)) => f
            .typed::<P, R>(&*store)
            .map(|f| Some(Rc::new(f)))
            .map_err(|e| HostError::Abi(format!("export {name} has the wrong type: {e}"))),
        Some(_) => Err(HostError::Abi(format!("export {name} is not a function"))),
    }
}

impl Exports {
    fn lookup(store: &mut Store<VmState>, instance: &Instance) -> Result<Exports, HostError> {
        Ok(Exports {
            on_context_create: typed(store, instance, "proxy_on_context_create")?,
            on_vm_start: typed(store, instance, "proxy_on_vm_start")?,
            on_configure: typed(store, instance, "proxy_on_configure")?,
            on_tick: typed(store, instance, "proxy_on_tick")?,
            on_queue_ready: typed(store, instance, "proxy_on_queue_ready")?,
            on_request_headers: typed(store, instance, "proxy_on_request_headers")?,
            on_request_body: typed(store, instance, "proxy_on_request_body")?,
            on_request_trailers: typed(store, instance, "proxy_on_request_trailers")?,
            on_response_headers: typed(store, instance, "proxy_on_response_headers")?,
            on_response_body: typed(store, instance, "proxy_on_response_body")?,
            on_response_trailers: typed(store, instance, "proxy_on_response_trailers")?,
            on_http_call_response: typed(store, instance, "proxy_on_http_call_response")?,
            on_done: typed(store, instance, "proxy_on_done")?,
            on_log: typed(store, instance, "proxy_on_log")?,
            on_delete: typed(store, instance, "proxy_on_delete")?,
        })
    }
}

pub(crate) struct VmSlot {
    pub(crate) store: Store<VmState>,
    pub(crate) exports: Exports,
    /// The root context streams are created under (changes on [`Host::reconfigure`]).
    pub(crate) root: u32,
    pub(crate) stopped: bool,
}

/// A proxy with proxy-wasm VMs: Envoy's side of ABI 0.2.1 for the filter under test.
///
/// Single-threaded and deterministic: the host owns every VM, time is virtual, and work Envoy
/// would post to a thread (queue wake-ups, callout answers, deferred resumes) runs at the end of
/// the host operation that caused it, or when [`Host::advance`] reaches its time. See the crate
/// docs for the full model.
pub struct Host {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<VmState>,
    pub(crate) shared: Rc<RefCell<Shared>>,
    pub(crate) vms: Vec<Option<VmSlot>>,
    pub(crate) fuel: Option<u64>,
    pub(crate) memory_limit: usize,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host").field("vms", &self.vms.len()).field("now_ns", &self.now_ns()).finish_non_exhaustive()
    }
}

type ModuleCache = Mutex<HashMap<(bool, Vec<u8>), Module>>;

impl Host {
    /// A builder with the defaults.
    pub fn builder() -> HostBuilder {
        HostBuilder::default()
    }

    /// A host with the defaults and no clusters.
    pub fn new() -> Result<Host, HostError> {
        HostBuilder::default().build()
    }

    /// Compiles a module from wasm bytes or WAT text.
    pub fn compile(&self, wasm_or_wat: impl AsRef<[u8]>) -> Result<Plugin, HostError> {
        let module =
            Module::new(&self.engine, wasm_or_wat.as_ref()).map_err(|e| HostError::Compile(format!("{e:?}")))?;
        Ok(Plugin { module })
    }

    /// Compiles a module from a file (`.wasm` or `.wat`). Compiled modules are cached for the
    /// process by path, size and modification time, so many tests can load the same filter cheaply.
    pub fn compile_file(&self, path: impl AsRef<Path>) -> Result<Plugin, HostError> {
        static CACHE: OnceLock<ModuleCache> = OnceLock::new();
        let path = path.as_ref();
        let io = |source| HostError::Io { path: path.display().to_string(), source };
        let meta = std::fs::metadata(path).map_err(io)?;
        let stamp = format!("{}|{}|{:?}", path.display(), meta.len(), meta.modified().ok());
        let key = (self.fuel.is_some(), stamp.into_bytes());
        let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
        if let Some(module) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
            return Ok(Plugin { module });
        }
        let bytes = std::fs::read(path).map_err(io)?;
        let plugin = self.compile(bytes)?;
        if let Ok(mut c) = cache.lock() {
            c.insert(key, plugin.module.clone());
        }
        Ok(plugin)
    }

    /// Starts a VM of `plugin`: instantiates it, runs `_initialize` (or `_start`), creates the root
    /// context (`proxy_on_context_create(root, 0)`), then `proxy_on_vm_start` and `proxy_on_configure`
    /// with the configurations of `config`. A refused configuration or a trap is an error and the VM
    /// is not kept.
    pub fn start_vm(&mut self, plugin: &Plugin, config: VmConfig) -> Result<VmId, HostError> {
        let index = self.vms.len();
        let vm = VmId(index);
        let state = VmState {
            shared: self.shared.clone(),
            vm,
            vm_id: config.vm_id,
            plugin_name: config.plugin_name,
            root_id: config.root_id,
            vm_config: config.vm_config,
            plugin_config: config.plugin_config,
            plugin_config_visible: false,
            properties: config.properties,
            memory: None,
            alloc: None,
            initializing: false,
            current: 0,
            effective: 0,
            contexts: FastMap::default(),
            next_context_id: 1,
            next_http_token: 1,
            after_call: Vec::new(),
            stop_next_iteration: false,
            pending_done: Vec::new(),
            call_response: None,
            metric_ids: FastMap::default(),
            next_metric_id: [0, 1, 2],
            allow_on_headers_stop_iteration: config.allow_on_headers_stop_iteration,
            fail_open: config.fail_open,
            failed: None,
            limits: StoreLimitsBuilder::new().memory_size(self.memory_limit).build(),
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limits);
        if let Some(fuel) = self.fuel {
            store.set_fuel(fuel).map_err(|e| HostError::Compile(format!("{e:?}")))?;
        }
        for import in plugin.module.imports() {
            if self.linker.get_by_import(&mut store, &import).is_none() {
                return Err(HostError::MissingImport { module: import.module().into(), name: import.name().into() });
            }
        }
        let instance = self
            .linker
            .instantiate(&mut store, &plugin.module)
            .map_err(|e| HostError::Instantiate(format!("{e:?}")))?;
        let has = |store: &mut Store<VmState>, name: &str| instance.get_func(&mut *store, name).is_some();
        if !has(&mut store, "proxy_abi_version_0_2_1") {
            let other = ["proxy_abi_version_0_2_0", "proxy_abi_version_0_1_0"].into_iter().find(|n| has(&mut store, n));
            return Err(HostError::Abi(match other {
                Some(name) => format!("it exports {name}; this host implements 0.2.1 only"),
                None => "no proxy_abi_version_0_2_1 export".into(),
            }));
        }
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or_else(|| HostError::Abi("no exported memory named \"memory\"".into()))?;
        let alloc = match typed::<i32, i32>(&mut store, &instance, "proxy_on_memory_allocate")? {
            Some(f) => f,
            None => typed::<i32, i32>(&mut store, &instance, "malloc")?
                .ok_or_else(|| HostError::Abi("no proxy_on_memory_allocate (or malloc) export".into()))?,
        };
        let exports = Exports::lookup(&mut store, &instance)?;
        store.data_mut().memory = Some(memory);
        store.data_mut().alloc = Some(alloc);
        let initialize = typed::<(), ()>(&mut store, &instance, "_initialize")?;
        let main = typed::<(i32, i32), i32>(&mut store, &instance, "main")?;
        let start = typed::<(), ()>(&mut store, &instance, "_start")?;
        self.vms.push(Some(VmSlot { store, exports, root: 0, stopped: false }));

        let started = self.top(|host| {
            host.slot_mut(index)?.store.data_mut().initializing = true;
            let init = match (initialize, start) {
                (Some(init), _) => host.call(index, 0, "_initialize", &init, ()).and_then(|()| match &main {
                    Some(main) => host.call(index, 0, "main", main, (0, 0)).map(|_| ()),
                    None => Ok(()),
                }),
                (None, Some(start)) => host.call(index, 0, "_start", &start, ()),
                (None, None) => Ok(()),
            };
            host.slot_mut(index)?.store.data_mut().initializing = false;
            init?;
            let root = host.create_root(index)?;
            host.slot_mut(index)?.root = root;
            if !host.vm_start(index, root)? {
                return Err(HostError::VmStartRejected(vm));
            }
            if !host.configure(index, root)? {
                return Err(HostError::ConfigureRejected(vm));
            }
            Ok(())
        });
        match started {
            Ok(()) => Ok(vm),
            Err(e) => {
                self.vms[index] = None;
                Err(e)
            }
        }
    }

    fn create_root(&mut self, vm: usize) -> Result<u32, HostError> {
        let slot = self.slot_mut(vm)?;
        let state = slot.store.data_mut();
        let root = state.alloc_context_id();
        state.contexts.insert(root, Context::Root(RootCtx::default()));
        state.plugin_config_visible = true;
        let f = slot.exports.on_context_create.clone();
        let result = match f {
            Some(f) => self.call(vm, root, "proxy_on_context_create", &f, (root as i32, 0)),
            None => Ok(()),
        };
        self.slot_mut(vm)?.store.data_mut().plugin_config_visible = false;
        result?;
        self.process_after_call(vm, None)?;
        Ok(root)
    }

    fn vm_start(&mut self, vm: usize, root: u32) -> Result<bool, HostError> {
        let slot = self.slot_mut(vm)?;
        let len = slot.store.data().vm_config.len();
        let Some(f) = slot.exports.on_vm_start.clone() else { return Ok(true) };
        let ok = self.call(vm, root, "proxy_on_vm_start", &f, (root as i32, len_arg(len)))? != 0;
        self.process_after_call(vm, None)?;
        Ok(ok)
    }

    fn configure(&mut self, vm: usize, root: u32) -> Result<bool, HostError> {
        let slot = self.slot_mut(vm)?;
        let len = slot.store.data().plugin_config.len();
        let Some(f) = slot.exports.on_configure.clone() else { return Ok(true) };
        slot.store.data_mut().plugin_config_visible = true;
        let result = self.call(vm, root, "proxy_on_configure", &f, (root as i32, len_arg(len)));
        self.slot_mut(vm)?.store.data_mut().plugin_config_visible = false;
        let ok = result? != 0;
        self.process_after_call(vm, None)?;
        Ok(ok)
    }

    /// Applies a new plugin configuration the way Envoy does on a config update: a new root
    /// context is created in the same VM (`proxy_on_context_create`, `proxy_on_vm_start`,
    /// `proxy_on_configure`). If the filter accepts it (`Ok(true)`), new streams use the new root
    /// and the old root is retired (`proxy_on_done`, `proxy_on_delete`); if it refuses (`Ok(false)`),
    /// the new root is retired and the old one keeps serving.
    pub fn reconfigure(&mut self, vm: VmId, plugin_configuration: impl Into<Vec<u8>>) -> Result<bool, HostError> {
        let config = plugin_configuration.into();
        self.top(|host| {
            let index = host.live_vm(vm)?;
            let old_root = host.slot_mut(index)?.root;
            let old_config = std::mem::replace(&mut host.slot_mut(index)?.store.data_mut().plugin_config, config);
            let root = host.create_root(index)?;
            let ok = host.vm_start(index, root)? && host.configure(index, root)?;
            if ok {
                host.slot_mut(index)?.root = root;
                host.retire_context(index, old_root)?;
            } else {
                host.slot_mut(index)?.store.data_mut().plugin_config = old_config;
                host.retire_context(index, root)?;
            }
            Ok(ok)
        })
    }

    /// Calls `proxy_on_configure` again on the current root context with a new plugin
    /// configuration (what some hosts do; the Rust SDK allows it). Returns the filter's answer; the
    /// host keeps the new bytes either way.
    pub fn configure_again(&mut self, vm: VmId, plugin_configuration: impl Into<Vec<u8>>) -> Result<bool, HostError> {
        let config = plugin_configuration.into();
        self.top(|host| {
            let index = host.live_vm(vm)?;
            host.slot_mut(index)?.store.data_mut().plugin_config = config;
            let root = host.slot_mut(index)?.root;
            host.configure(index, root)
        })
    }

    /// Shuts a VM's plugin down: `proxy_on_done` on the root context, then `proxy_on_delete` (now, or
    /// when the filter calls `proxy_done`). Ticks stop; the VM can no longer take streams.
    pub fn shutdown_vm(&mut self, vm: VmId) -> Result<(), HostError> {
        self.top(|host| {
            let index = host.live_vm(vm)?;
            let root = host.slot_mut(index)?.root;
            host.slot_mut(index)?.stopped = true;
            host.retire_context(index, root)
        })
    }

    /// `proxy_on_done`, then (if it returned true) `proxy_on_log` for streams and `proxy_on_delete`.
    pub(crate) fn retire_context(&mut self, vm: usize, context: u32) -> Result<(), HostError> {
        let failed = self.slot_mut(vm)?.store.data().failed.is_some();
        let done = match self.slot_mut(vm)?.exports.on_done.clone() {
            Some(f) if !failed => {
                let done = self.call(vm, context, "proxy_on_done", &f, context as i32)? != 0;
                self.process_after_call(vm, None)?;
                done
            }
            _ => true,
        };
        if done {
            self.finalize_context(vm, context).map(|_| ())
        } else {
            self.slot_mut(vm)?.store.data_mut().pending_done.push(context);
            Ok(())
        }
    }

    /// `proxy_on_log` (streams) and `proxy_on_delete`, then forgets the context (a stream's final
    /// state is returned).
    pub(crate) fn finalize_context(&mut self, vm: usize, context: u32) -> Result<Option<Stream>, HostError> {
        let slot = self.slot_mut(vm)?;
        let failed = slot.store.data().failed.is_some();
        let is_stream = slot.store.data().stream(context).is_some();
        if !failed {
            if is_stream {
                if let Some(stream) = slot.store.data_mut().stream_mut(context) {
                    stream.in_log = true;
                }
                if let Some(f) = self.slot_mut(vm)?.exports.on_log.clone() {
                    self.call(vm, context, "proxy_on_log", &f, context as i32)?;
                    self.process_after_call(vm, None)?;
                }
            }
            if let Some(f) = self.slot_mut(vm)?.exports.on_delete.clone() {
                self.call(vm, context, "proxy_on_delete", &f, context as i32)?;
                self.process_after_call(vm, None)?;
            }
        }
        let state = self.slot_mut(vm)?.store.data_mut();
        state.pending_done.retain(|c| *c != context);
        Ok(match state.contexts.remove(&context) {
            Some(Context::Http(stream)) => Some(*stream),
            _ => None,
        })
    }

    /// Ids of the VMs that are running (started and not failed to start).
    pub fn vms(&self) -> Vec<VmId> {
        self.vms.iter().enumerate().filter(|(_, s)| s.is_some()).map(|(i, _)| VmId(i)).collect()
    }

    /// The root context new streams of `vm` are created under.
    pub fn root_context_id(&self, vm: VmId) -> Result<u32, HostError> {
        Ok(self.slot(vm.0)?.root)
    }

    /// Size of the VM's linear memory in bytes (grows in 64 KiB pages, never shrinks: a leak in
    /// the filter shows as growth over many requests).
    pub fn memory_size(&self, vm: VmId) -> Result<usize, HostError> {
        let slot = self.slot(vm.0)?;
        let memory = slot.store.data().memory.ok_or(HostError::UnknownVm(vm))?;
        Ok(memory.data_size(&slot.store))
    }

    /// Reads `len` bytes of the VM's linear memory at `ptr` (`None` when out of bounds): for tests
    /// that inspect what a guest wrote.
    pub fn read_memory(&self, vm: VmId, ptr: u32, len: usize) -> Result<Option<Vec<u8>>, HostError> {
        let slot = self.slot(vm.0)?;
        let memory = slot.store.data().memory.ok_or(HostError::UnknownVm(vm))?;
        let start = ptr as usize;
        Ok(start.checked_add(len).and_then(|end| memory.data(&slot.store).get(start..end)).map(<[u8]>::to_vec))
    }

    /// Why the VM failed (its trap), if it did.
    pub fn failure(&self, vm: VmId) -> Result<Option<String>, HostError> {
        Ok(self.slot(vm.0)?.store.data().failed.clone())
    }

    /// The virtual clock, ns since the Unix epoch (what `proxy_get_current_time_nanoseconds` and
    /// WASI `clock_time_get` answer).
    pub fn now_ns(&self) -> u64 {
        self.shared.borrow().now_ns
    }

    /// Moves the virtual clock forward, firing in time order every tick (`proxy_on_tick` of each
    /// root context whose period elapsed, as often as it elapsed), delayed callout answer and
    /// queue wake-up that falls due.
    pub fn advance(&mut self, by: Duration) -> Result<(), HostError> {
        let target = self.now_ns().saturating_add(u64::try_from(by.as_nanos()).unwrap_or(u64::MAX));
        self.run_until(target)
    }

    /// When the next scheduled event (tick, callout answer) falls due, if any.
    pub fn next_event_ns(&self) -> Option<u64> {
        self.shared.borrow().timeline.peek().map(|Reverse(t)| t.due)
    }

    // ---- shared state seen from the test ----

    /// Shared data as the filter would read it in a VM with this `vm_id`: (value, cas).
    pub fn shared_data(&self, vm_id: &str, key: &str) -> Option<(Vec<u8>, u32)> {
        self.shared.borrow().shared_data.get(vm_id).and_then(|m| m.get(key.as_bytes())).cloned()
    }

    /// Keys of the shared data of a `vm_id`, sorted.
    pub fn shared_data_keys(&self, vm_id: &str) -> Vec<String> {
        let shared = self.shared.borrow();
        let mut keys: Vec<String> = shared
            .shared_data
            .get(vm_id)
            .map(|m| m.keys().map(|k| String::from_utf8_lossy(k).into_owned()).collect())
            .unwrap_or_default();
        keys.sort();
        keys
    }

    /// Writes shared data unconditionally (as another process or VM would); returns the new cas.
    pub fn set_shared_data(&mut self, vm_id: &str, key: &str, value: impl Into<Vec<u8>>) -> u32 {
        let mut shared = self.shared.borrow_mut();
        let cas = shared.next_cas();
        shared.shared_data.entry(vm_id.to_string()).or_default().insert(key.as_bytes().to_vec(), (value.into(), cas));
        cas
    }

    /// Makes the next `times` conditional writes (`proxy_set_shared_data` with a non-zero cas) of
    /// `key` fail with CasMismatch, as if another VM had written it just before each of them (its cas
    /// moves on, its value stays). For testing the filter's retry loops.
    pub fn force_cas_mismatch(&mut self, vm_id: &str, key: &str, times: u32) {
        self.shared.borrow_mut().forced_cas_mismatch.insert((vm_id.to_string(), key.as_bytes().to_vec()), times);
    }

    // ---- fault injection ----

    /// Makes `import` (an `env.proxy_*` name of [`crate::PROXY_IMPORTS`]) answer the fault's status on
    /// the calls it selects, in every VM, instead of doing its work; replaces an earlier fault of
    /// that import. The calls the fault numbers are counted from now. A name the host does not
    /// provide is [`HostError::UnknownImport`].
    pub fn inject_fault(&mut self, import: &str, fault: Fault) -> Result<(), HostError> {
        let name = Faults::known(import).ok_or_else(|| HostError::UnknownImport(import.to_string()))?;
        self.shared.borrow_mut().faults.arm(name, fault);
        Ok(())
    }

    /// Removes the fault of `import` (if any): its calls work again.
    pub fn remove_fault(&mut self, import: &str) {
        self.shared.borrow_mut().faults.disarm(import);
    }

    /// Removes every injected fault.
    pub fn clear_faults(&mut self) {
        self.shared.borrow_mut().faults.clear();
    }

    /// How often the guests (all VMs) called `import` since the host was built, faulted or not.
    pub fn hostcall_count(&self, import: &str) -> u64 {
        self.shared.borrow().faults.calls(import)
    }

    /// How many calls of `import` an injected fault answered since the host was built.
    pub fn faults_fired(&self, import: &str) -> u64 {
        self.shared.borrow().faults.fired(import)
    }

    /// The token of a registered shared queue.
    pub fn queue_id(&self, vm_id: &str, name: &str) -> Option<u32> {
        self.shared.borrow().queue_tokens.get(&(vm_id.to_string(), name.as_bytes().to_vec())).copied()
    }

    /// Items waiting in a shared queue.
    pub fn queue_len(&self, vm_id: &str, name: &str) -> Option<usize> {
        let token = self.queue_id(vm_id, name)?;
        self.shared.borrow().queues.get(&token).map(|q| q.items.len())
    }

    /// Enqueues an item into a registered queue (as another VM would) and wakes its consumer.
    /// `Ok(false)`: no such queue.
    pub fn enqueue(&mut self, vm_id: &str, name: &str, item: impl Into<Vec<u8>>) -> Result<bool, HostError> {
        let item = item.into();
        self.top(|host| {
            let mut shared = host.shared.borrow_mut();
            let Some(token) = shared.queue_tokens.get(&(vm_id.to_string(), name.as_bytes().to_vec())).copied() else {
                return Ok(false);
            };
            let now = shared.now_ns;
            let Some(queue) = shared.queues.get_mut(&token) else { return Ok(false) };
            queue.items.push_back(item);
            let (vm, context) = queue.consumer;
            shared.schedule(now, Event::QueueReady { vm, context, token });
            Ok(true)
        })
    }

    /// Replaces (or adds) a cluster's callout handler.
    pub fn set_cluster(&mut self, name: &str, handler: impl FnMut(&CalloutRequest) -> CalloutReply + 'static) {
        self.shared.borrow_mut().clusters.insert(name.to_string(), Box::new(handler));
    }

    /// Removes a cluster: later calls to it answer BadArgument.
    pub fn remove_cluster(&mut self, name: &str) {
        self.shared.borrow_mut().clusters.remove(name);
    }

    /// The callouts dispatched so far (newest last, at most the history cap).
    pub fn callouts(&self) -> Ref<'_, [CalloutRequest]> {
        Ref::map(self.shared.borrow(), |s| s.callouts.view())
    }

    /// Captured log lines of all VMs (newest last, at most the history cap).
    pub fn logs(&self) -> Ref<'_, [LogEntry]> {
        Ref::map(self.shared.borrow(), |s| s.logs.view())
    }

    /// Takes the captured log lines out (the host keeps none).
    pub fn take_logs(&mut self) -> Vec<LogEntry> {
        self.shared.borrow_mut().logs.take()
    }

    /// Changes the host's log level (see [`HostBuilder::log_level`]).
    pub fn set_log_level(&mut self, level: LogLevel) {
        self.shared.borrow_mut().log_level = level;
    }

    /// What the guests did that points at a bug (see [`AbiViolation`]).
    pub fn abi_violations(&self) -> Ref<'_, [AbiViolation]> {
        Ref::map(self.shared.borrow(), |s| s.violations.view())
    }

    /// Takes the recorded violations out.
    pub fn take_abi_violations(&mut self) -> Vec<AbiViolation> {
        self.shared.borrow_mut().violations.take()
    }

    /// A metric the filter defined (the same name defined by several VMs is one metric, as in Envoy).
    pub fn metric(&self, name: &str) -> Option<MetricValue> {
        let shared = self.shared.borrow();
        let get = |kind| shared.metrics.get(&(kind, name.to_string()));
        if let Some(slot) = get(MetricKind::Counter) {
            return Some(MetricValue::Counter(slot.value));
        }
        if let Some(slot) = get(MetricKind::Gauge) {
            return Some(MetricValue::Gauge(slot.value));
        }
        get(MetricKind::Histogram).map(|slot| MetricValue::Histogram(slot.samples.iter().copied().collect()))
    }

    /// Names of all defined metrics, sorted.
    pub fn metric_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.shared.borrow().metrics.keys().map(|(_, n)| n.clone()).collect();
        names.sort();
        names.dedup();
        names
    }

    // ---- internals: calling the guest, deferred work, events ----

    pub(crate) fn slot(&self, vm: usize) -> Result<&VmSlot, HostError> {
        self.vms.get(vm).and_then(Option::as_ref).ok_or(HostError::UnknownVm(VmId(vm)))
    }

    pub(crate) fn slot_mut(&mut self, vm: usize) -> Result<&mut VmSlot, HostError> {
        self.vms.get_mut(vm).and_then(Option::as_mut).ok_or(HostError::UnknownVm(VmId(vm)))
    }

    /// The VM's index if it exists and has not failed.
    pub(crate) fn live_vm(&mut self, vm: VmId) -> Result<usize, HostError> {
        let slot = self.slot(vm.0)?;
        if slot.store.data().failed.is_some() {
            return Err(HostError::VmFailed(vm));
        }
        Ok(vm.0)
    }

    /// Runs `f`, then the events it made due now (queue wake-ups, immediate callout answers).
    pub(crate) fn top<R>(&mut self, f: impl FnOnce(&mut Host) -> Result<R, HostError>) -> Result<R, HostError> {
        let result = f(self)?;
        let now = self.now_ns();
        self.run_until(now)?;
        Ok(result)
    }

    /// Calls an export with `context` as the current context; a trap fails the VM.
    pub(crate) fn call<P: WasmParams, R: WasmResults>(
        &mut self,
        vm: usize,
        context: u32,
        name: &'static str,
        f: &TypedFunc<P, R>,
        args: P,
    ) -> Result<R, HostError> {
        let fuel = self.fuel;
        let slot = self.slot_mut(vm)?;
        if slot.store.data().failed.is_some() {
            return Err(HostError::VmFailed(VmId(vm)));
        }
        let state = slot.store.data_mut();
        state.current = context;
        state.effective = 0;
        state.stop_next_iteration = false;
        if let Some(fuel) = fuel {
            slot.store.set_fuel(fuel).map_err(|e| HostError::Compile(format!("{e:?}")))?;
        }
        let result = f.call(&mut slot.store, args);
        let state = slot.store.data_mut();
        state.current = 0;
        state.effective = 0;
        match result {
            Ok(r) => Ok(r),
            Err(e) => {
                let mut message = format!("{e:?}");
                let shared = state.shared.borrow();
                let now = shared.now_ns;
                let last = shared
                    .logs
                    .view()
                    .iter()
                    .rev()
                    .take(32)
                    .find(|l| l.vm == VmId(vm) && l.level >= LogLevel::Error && l.at_ns == now);
                if let Some(line) = last {
                    message.push_str(&format!("\nlast error logged by the guest: {}", line.message));
                }
                drop(shared);
                state.failed = Some(message.clone());
                Err(HostError::Trap { vm: VmId(vm), function: name.to_string(), message })
            }
        }
    }

    /// Runs the work the guest deferred during its last callback. `own`: the stream and direction
    /// of that callback (a `proxy_continue_stream` of the callback's own direction has no effect, as
    /// in Envoy: the callback's return value decides).
    pub(crate) fn process_after_call(
        &mut self,
        vm: usize,
        own: Option<(u32, crate::types::Dir)>,
    ) -> Result<(), HostError> {
        loop {
            let actions = std::mem::take(&mut self.slot_mut(vm)?.store.data_mut().after_call);
            if actions.is_empty() {
                return Ok(());
            }
            for action in actions {
                match action {
                    AfterCall::Continue { context, dir } => {
                        if own != Some((context, dir)) {
                            self.resume(StreamId { vm: VmId(vm), context }, dir)?;
                        }
                    }
                    AfterCall::Close { context, .. } => self.reset_stream(StreamId { vm: VmId(vm), context }),
                    AfterCall::LocalReply { context, reply } => {
                        self.local_reply(StreamId { vm: VmId(vm), context }, reply)?;
                    }
                    AfterCall::Done { context } => {
                        self.finalize_context(vm, context)?;
                    }
                }
            }
        }
    }

    pub(crate) fn run_until(&mut self, target: u64) -> Result<(), HostError> {
        let mut last_due = None;
        let mut same_instant = 0usize;
        loop {
            let next = {
                let mut shared = self.shared.borrow_mut();
                match shared.timeline.peek() {
                    Some(Reverse(t)) if t.due <= target => shared.timeline.pop().map(|Reverse(t)| t),
                    _ => None,
                }
            };
            let Some(Timed { due, event, .. }) = next else { break };
            if last_due == Some(due) {
                same_instant += 1;
                if same_instant > EVENT_STORM_LIMIT {
                    return Err(HostError::EventStorm(EVENT_STORM_LIMIT));
                }
            } else {
                last_due = Some(due);
                same_instant = 0;
            }
            {
                let mut shared = self.shared.borrow_mut();
                shared.now_ns = shared.now_ns.max(due);
            }
            self.fire(event)?;
        }
        let mut shared = self.shared.borrow_mut();
        shared.now_ns = shared.now_ns.max(target);
        Ok(())
    }

    fn usable(&self, vm: usize) -> bool {
        self.slot(vm).is_ok_and(|s| s.store.data().failed.is_none() && !s.stopped)
    }

    fn fire(&mut self, event: Event) -> Result<(), HostError> {
        match event {
            Event::Tick { vm, root, generation } => {
                if !self.usable(vm) {
                    return Ok(());
                }
                let slot = self.slot_mut(vm)?;
                let Some(Context::Root(ctx)) = slot.store.data().contexts.get(&root) else { return Ok(()) };
                if ctx.tick_generation != generation || ctx.tick_period_ns == 0 {
                    return Ok(());
                }
                let period = ctx.tick_period_ns;
                {
                    let mut shared = self.shared.borrow_mut();
                    let due = shared.now_ns.saturating_add(period);
                    shared.schedule(due, Event::Tick { vm, root, generation });
                }
                if let Some(f) = self.slot_mut(vm)?.exports.on_tick.clone() {
                    self.call(vm, root, "proxy_on_tick", &f, root as i32)?;
                    self.process_after_call(vm, None)?;
                }
            }
            Event::QueueReady { vm, context, token } => {
                if !self.usable(vm) || !self.slot(vm)?.store.data().contexts.contains_key(&context) {
                    return Ok(());
                }
                if let Some(f) = self.slot_mut(vm)?.exports.on_queue_ready.clone() {
                    self.call(vm, context, "proxy_on_queue_ready", &f, (context as i32, token as i32))?;
                    self.process_after_call(vm, None)?;
                }
            }
            Event::CalloutResponse { vm, root, token, response } => {
                if !self.usable(vm) || !self.slot(vm)?.store.data().contexts.contains_key(&root) {
                    return Ok(());
                }
                let Some(f) = self.slot_mut(vm)?.exports.on_http_call_response.clone() else { return Ok(()) };
                let (headers, body, trailers) = match &response {
                    Some(r) => (r.headers.len(), r.body.len(), r.trailers.len()),
                    None => (0, 0, 0),
                };
                self.slot_mut(vm)?.store.data_mut().call_response = Some(response);
                let args = (root as i32, token as i32, len_arg(headers), len_arg(body), len_arg(trailers));
                let result = self.call(vm, root, "proxy_on_http_call_response", &f, args);
                let result = result.and_then(|()| self.process_after_call(vm, None));
                if let Ok(slot) = self.slot_mut(vm) {
                    slot.store.data_mut().call_response = None;
                }
                result?;
            }
        }
        Ok(())
    }
}

/// A size or count as the i32 the ABI passes.
pub(crate) fn len_arg(n: usize) -> i32 {
    u32::try_from(n).unwrap_or(u32::MAX) as i32
}

/// The action a callback returned, for the callback history.
pub(crate) fn action_of(code: i32) -> Action {
    Action::from_code(code)
}

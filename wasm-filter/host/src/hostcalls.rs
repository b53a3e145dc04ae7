//! The imports: every `env.proxy_*` function of ABI 0.2.1 and the WASI functions Envoy provides,
//! with Envoy's semantics (see the crate docs for the list and what is not implemented).
//!
//! Every pointer/size pair from the guest is checked against its linear memory: a bad one answers
//! `InvalidMemoryAccess` (WASI: `EFAULT`) and is recorded as an [`crate::AbiViolation`]; the host
//! never panics on guest input. Values are returned the ABI way: the host calls the guest's
//! `proxy_on_memory_allocate` for exactly the returned size and writes the pointer and size.

use wasmtime::{Caller, Linker};

use crate::abi::{self, LogLevel, Status};
use crate::headers::HeaderMap;
use crate::state::{AfterCall, CallResponse, Context, Event, MetricKind, Queue, VmState};
use crate::types::{CalloutOutcome, CalloutRequest, Dir, HeadersState, LogEntry};

type C<'a> = Caller<'a, VmState>;
type HostResult = wasmtime::Result<Status>;

/// Unwraps a `Result<T, Status>`, answering the status to the guest on error.
macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(value) => value,
            Err(status) => return Ok(status),
        }
    };
}

/// Registers an `env.proxy_*` hostcall whose parameters are all `i32`.
macro_rules! proxy_fn {
    ($linker:expr, $name:literal, $f:path, ($($arg:ident),*)) => {
        $linker.func_wrap("env", $name, |mut caller: C<'_>, $($arg: i32),*| -> wasmtime::Result<i32> {
            guard(&caller, $name)?;
            if let Some(code) = injected(&caller, $name) {
                return Ok(code);
            }
            let status = $f(&mut caller, $($arg),*)?;
            note_status(&caller, $name, status);
            Ok(status.code())
        })?;
    };
}

pub(crate) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    // logging and clocks
    linker.func_wrap(
        "env",
        "proxy_log",
        |mut caller: C<'_>, level: i32, ptr: i32, len: i32| -> wasmtime::Result<i32> {
            if let Some(code) = injected(&caller, "proxy_log") {
                return Ok(code);
            }
            let status = log(&mut caller, level, ptr, len)?;
            note_status(&caller, "proxy_log", status);
            Ok(status.code())
        },
    )?;
    proxy_fn!(linker, "proxy_get_log_level", get_log_level, (ptr));
    proxy_fn!(linker, "proxy_get_current_time_nanoseconds", get_current_time, (ptr));
    proxy_fn!(linker, "proxy_set_tick_period_milliseconds", set_tick_period, (period));
    // buffers
    proxy_fn!(linker, "proxy_get_buffer_status", get_buffer_status, (kind, len_ptr, flags_ptr));
    proxy_fn!(linker, "proxy_get_buffer_bytes", get_buffer_bytes, (kind, start, max, ptr_ptr, size_ptr));
    proxy_fn!(linker, "proxy_set_buffer_bytes", set_buffer_bytes, (kind, start, size, ptr, len));
    // header maps
    proxy_fn!(linker, "proxy_get_header_map_pairs", get_header_map_pairs, (kind, ptr_ptr, size_ptr));
    proxy_fn!(linker, "proxy_set_header_map_pairs", set_header_map_pairs, (kind, ptr, len));
    proxy_fn!(linker, "proxy_get_header_map_size", get_header_map_size, (kind, size_ptr));
    proxy_fn!(linker, "proxy_get_header_map_value", get_header_map_value, (kind, kptr, klen, ptr_ptr, size_ptr));
    proxy_fn!(linker, "proxy_add_header_map_value", add_header_map_value, (kind, kptr, klen, vptr, vlen));
    proxy_fn!(linker, "proxy_replace_header_map_value", replace_header_map_value, (kind, kptr, klen, vptr, vlen));
    proxy_fn!(linker, "proxy_remove_header_map_value", remove_header_map_value, (kind, kptr, klen));
    // properties
    proxy_fn!(linker, "proxy_get_property", get_property, (pptr, plen, ptr_ptr, size_ptr));
    proxy_fn!(linker, "proxy_set_property", set_property, (pptr, plen, vptr, vlen));
    // shared data and queues
    proxy_fn!(linker, "proxy_get_shared_data", get_shared_data, (kptr, klen, ptr_ptr, size_ptr, cas_ptr));
    proxy_fn!(linker, "proxy_set_shared_data", set_shared_data, (kptr, klen, vptr, vlen, cas));
    proxy_fn!(linker, "proxy_register_shared_queue", register_shared_queue, (nptr, nlen, token_ptr));
    proxy_fn!(linker, "proxy_resolve_shared_queue", resolve_shared_queue, (vptr, vlen, nptr, nlen, token_ptr));
    proxy_fn!(linker, "proxy_enqueue_shared_queue", enqueue_shared_queue, (token, ptr, len));
    proxy_fn!(linker, "proxy_dequeue_shared_queue", dequeue_shared_queue, (token, ptr_ptr, size_ptr));
    // streams
    proxy_fn!(linker, "proxy_continue_stream", continue_stream, (kind));
    proxy_fn!(linker, "proxy_close_stream", close_stream, (kind));
    proxy_fn!(
        linker,
        "proxy_send_local_response",
        send_local_response,
        (code, dptr, dlen, bptr, blen, hptr, hlen, grpc_status)
    );
    proxy_fn!(
        linker,
        "proxy_http_call",
        http_call,
        (uptr, ulen, hptr, hlen, bptr, blen, tptr, tlen, timeout, token_ptr)
    );
    proxy_fn!(linker, "proxy_get_status", get_status, (code_ptr, ptr_ptr, size_ptr));
    proxy_fn!(linker, "proxy_set_effective_context", set_effective_context, (context));
    proxy_fn!(linker, "proxy_done", done, ());
    proxy_fn!(
        linker,
        "proxy_call_foreign_function",
        call_foreign_function,
        (nptr, nlen, aptr, alen, ptr_ptr, size_ptr)
    );
    // metrics
    proxy_fn!(linker, "proxy_define_metric", define_metric, (kind, nptr, nlen, id_ptr));
    proxy_fn!(linker, "proxy_get_metric", get_metric, (id, ptr));
    linker.func_wrap(
        "env",
        "proxy_increment_metric",
        |mut caller: C<'_>, id: i32, delta: i64| -> wasmtime::Result<i32> {
            guard(&caller, "proxy_increment_metric")?;
            if let Some(code) = injected(&caller, "proxy_increment_metric") {
                return Ok(code);
            }
            let status = increment_metric(&mut caller, id, delta);
            note_status(&caller, "proxy_increment_metric", status);
            Ok(status.code())
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_record_metric",
        |mut caller: C<'_>, id: i32, value: i64| -> wasmtime::Result<i32> {
            guard(&caller, "proxy_record_metric")?;
            if let Some(code) = injected(&caller, "proxy_record_metric") {
                return Ok(code);
            }
            let status = record_metric(&mut caller, id, value);
            note_status(&caller, "proxy_record_metric", status);
            Ok(status.code())
        },
    )?;
    // gRPC: not implemented by this host
    proxy_fn!(linker, "proxy_grpc_call", grpc_unimplemented12, (a, b, c, d, e, f, g, h, i, j, k, l));
    proxy_fn!(linker, "proxy_grpc_stream", grpc_unimplemented9, (a, b, c, d, e, f, g, h, i));
    proxy_fn!(linker, "proxy_grpc_send", grpc_unimplemented4, (a, b, c, d));
    proxy_fn!(linker, "proxy_grpc_cancel", grpc_unimplemented1, (a));
    proxy_fn!(linker, "proxy_grpc_close", grpc_unimplemented1, (a));

    for module in ["wasi_snapshot_preview1", "wasi_unstable"] {
        add_wasi(linker, module)?;
    }
    Ok(())
}

// ---- guards and memory access ----

/// Envoy allows only logging, clocks and WASI while the module initializes (`_initialize`).
fn guard(caller: &C<'_>, name: &'static str) -> wasmtime::Result<()> {
    if caller.data().initializing {
        return Err(wasmtime::Error::msg(format!(
            "{name} called while the module initializes (_initialize/_start): Envoy allows only logging, clocks and WASI there"
        )));
    }
    Ok(())
}

/// Counts a call of `name`; `Some(code)`: an injected fault answers it (the call does nothing).
fn injected(caller: &C<'_>, name: &'static str) -> Option<i32> {
    caller.data().shared.borrow_mut().faults.on_call(name)
}

fn note_status(caller: &C<'_>, call: &'static str, status: Status) {
    if status == Status::InvalidMemoryAccess {
        caller.data().violation(call, "pointer/size outside the guest memory");
    }
}

fn range(ptr: i32, len: i32) -> Option<(usize, usize)> {
    let start = ptr as u32 as usize;
    let end = start.checked_add(len as u32 as usize)?;
    Some((start, end))
}

fn read(caller: &C<'_>, ptr: i32, len: i32) -> Result<Vec<u8>, Status> {
    let memory = caller.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let (start, end) = range(ptr, len).ok_or(Status::InvalidMemoryAccess)?;
    memory.data(caller).get(start..end).map(<[u8]>::to_vec).ok_or(Status::InvalidMemoryAccess)
}

fn write(caller: &mut C<'_>, ptr: i32, bytes: &[u8]) -> Result<(), Status> {
    let memory = caller.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let len = i32::try_from(bytes.len()).map_err(|_| Status::InvalidMemoryAccess)?;
    let (start, end) = range(ptr, len).ok_or(Status::InvalidMemoryAccess)?;
    let dest = memory.data_mut(caller).get_mut(start..end).ok_or(Status::InvalidMemoryAccess)?;
    dest.copy_from_slice(bytes);
    Ok(())
}

fn write_u32(caller: &mut C<'_>, ptr: i32, value: u32) -> Result<(), Status> {
    write(caller, ptr, &value.to_le_bytes())
}

fn write_u64(caller: &mut C<'_>, ptr: i32, value: u64) -> Result<(), Status> {
    write(caller, ptr, &value.to_le_bytes())
}

fn writable(caller: &C<'_>, ptr: i32, len: i32) -> bool {
    let Some(memory) = caller.data().memory else { return false };
    range(ptr, len).is_some_and(|(_, end)| end <= memory.data_size(caller))
}

/// [`copy_out`] of bytes the VM's state holds: `data(state)` is copied straight into the guest's
/// allocation (no host-side copy first). `Err(status)` from `data`: answered as is, nothing
/// allocated.
fn copy_out_from(
    caller: &mut C<'_>,
    ptr_ptr: i32,
    size_ptr: i32,
    data: impl Fn(&VmState) -> Result<&[u8], Status>,
) -> HostResult {
    let len = match data(caller.data()) {
        Ok(d) => d.len(),
        Err(status) => return Ok(status),
    };
    copy_out_with(caller, len, ptr_ptr, size_ptr, |caller, ptr, size| {
        let Some(memory) = caller.data().memory else { return false };
        let (mem, state) = memory.data_and_store_mut(&mut *caller);
        match (data(state), range(ptr, size)) {
            (Ok(src), Some((start, end))) if src.len() == len => {
                mem.get_mut(start..end).map(|dest| dest.copy_from_slice(src)).is_some()
            }
            _ => false,
        }
    })
}

/// Copies `data` into fresh guest memory (from `proxy_on_memory_allocate`) and writes its pointer
/// and size; empty data is pointer 0, size 0 (as Envoy's `copyToPointerSize`). A trap in the
/// allocator propagates; a null or out-of-bounds allocation answers `InvalidMemoryAccess`.
fn copy_out(caller: &mut C<'_>, data: &[u8], ptr_ptr: i32, size_ptr: i32) -> HostResult {
    copy_out_with(caller, data.len(), ptr_ptr, size_ptr, |caller, ptr, _| write(caller, ptr, data).is_ok())
}

/// The frame of [`copy_out`]: allocates `len` bytes in the guest, has `fill(caller, ptr, size)`
/// copy them there (false: out of bounds), then writes the pointer and the size.
fn copy_out_with(
    caller: &mut C<'_>,
    len: usize,
    ptr_ptr: i32,
    size_ptr: i32,
    fill: impl FnOnce(&mut C<'_>, i32, i32) -> bool,
) -> HostResult {
    if !writable(caller, ptr_ptr, 4) || !writable(caller, size_ptr, 4) {
        return Ok(Status::InvalidMemoryAccess);
    }
    let mut address = 0u32;
    if len > 0 {
        let Ok(size) = i32::try_from(len) else { return Ok(Status::InvalidMemoryAccess) };
        let Some(alloc) = caller.data().alloc.clone() else { return Ok(Status::InvalidMemoryAccess) };
        let ptr = alloc.call(&mut *caller, size)?;
        if ptr == 0 {
            caller.data().violation("proxy_on_memory_allocate", format!("returned 0 for {size} bytes"));
            return Ok(Status::InvalidMemoryAccess);
        }
        if !fill(caller, ptr, size) {
            caller
                .data()
                .violation("proxy_on_memory_allocate", format!("returned {ptr:#x} for {size} bytes: out of bounds"));
            return Ok(Status::InvalidMemoryAccess);
        }
        address = ptr as u32;
    }
    tri!(write_u32(caller, ptr_ptr, address));
    tri!(write_u32(caller, size_ptr, len as u32));
    Ok(Status::Ok)
}

fn now(caller: &C<'_>) -> u64 {
    caller.data().shared.borrow().now_ns
}

// ---- logging, clocks, ticks ----

fn push_log(caller: &C<'_>, level: LogLevel, message: String) {
    let state = caller.data();
    let context_id = state.active_context();
    let mut shared = state.shared.borrow_mut();
    if level >= shared.log_level {
        let at_ns = shared.now_ns;
        shared.logs.push(LogEntry { vm: state.vm, context_id, level, message, at_ns });
    }
}

fn log(caller: &mut C<'_>, level: i32, ptr: i32, len: i32) -> HostResult {
    let Some(level) = LogLevel::from_code(level as u32) else {
        caller.data().violation("proxy_log", format!("unknown log level {level}"));
        return Ok(Status::BadArgument);
    };
    let message = tri!(read(caller, ptr, len));
    push_log(caller, level, String::from_utf8_lossy(&message).into_owned());
    Ok(Status::Ok)
}

fn get_log_level(caller: &mut C<'_>, ptr: i32) -> HostResult {
    let level = caller.data().shared.borrow().log_level as u32;
    tri!(write_u32(caller, ptr, level));
    Ok(Status::Ok)
}

fn get_current_time(caller: &mut C<'_>, ptr: i32) -> HostResult {
    let t = now(caller);
    tri!(write_u64(caller, ptr, t));
    Ok(Status::Ok)
}

fn set_tick_period(caller: &mut C<'_>, period_ms: i32) -> HostResult {
    let state = caller.data_mut();
    let Some(root) = state.root_of(state.active_context()) else { return Ok(Status::NotFound) };
    let period_ns = u64::from(period_ms as u32) * 1_000_000;
    let vm = state.vm.0;
    let Some(Context::Root(ctx)) = state.contexts.get_mut(&root) else { return Ok(Status::NotFound) };
    ctx.tick_period_ns = period_ns;
    ctx.tick_generation += 1;
    let generation = ctx.tick_generation;
    if period_ns > 0 {
        let mut shared = state.shared.borrow_mut();
        let due = shared.now_ns.saturating_add(period_ns);
        shared.schedule(due, Event::Tick { vm, root, generation });
    }
    Ok(Status::Ok)
}

// ---- buffers ----

fn body_dir(kind: u32) -> Option<Dir> {
    match kind {
        abi::buffer::HTTP_REQUEST_BODY => Some(Dir::Request),
        abi::buffer::HTTP_RESPONSE_BODY => Some(Dir::Response),
        _ => None,
    }
}

fn buffer_contents(state: &VmState, kind: u32) -> Result<&[u8], Status> {
    if kind > abi::buffer::MAX {
        return Err(Status::BadArgument);
    }
    if let Some(dir) = body_dir(kind) {
        let stream = state.stream(state.active_context()).ok_or(Status::NotFound)?;
        return Ok(&stream.flow(dir).pending);
    }
    match kind {
        // a failed call has no response: Envoy's null buffer (NotFound)
        abi::buffer::HTTP_CALL_RESPONSE_BODY => match &state.call_response {
            Some(Some(response)) => Ok(&response.body),
            _ => Err(Status::NotFound),
        },
        abi::buffer::VM_CONFIGURATION => Ok(&state.vm_config),
        abi::buffer::PLUGIN_CONFIGURATION if state.plugin_config_visible => Ok(&state.plugin_config),
        _ => Err(Status::NotFound),
    }
}

fn get_buffer_status(caller: &mut C<'_>, kind: i32, len_ptr: i32, flags_ptr: i32) -> HostResult {
    let len = tri!(buffer_contents(caller.data(), kind as u32)).len();
    tri!(write_u32(caller, len_ptr, len as u32));
    tri!(write_u32(caller, flags_ptr, 0));
    Ok(Status::Ok)
}

fn get_buffer_bytes(caller: &mut C<'_>, kind: i32, start: i32, max: i32, ptr_ptr: i32, size_ptr: i32) -> HostResult {
    let (start, max) = (start as u32 as usize, max as u32 as usize);
    copy_out_from(caller, ptr_ptr, size_ptr, |state| {
        let data = buffer_contents(state, kind as u32)?;
        let end = start.saturating_add(max).min(data.len());
        Ok(data.get(start..end).unwrap_or(&[]))
    })
}

fn set_buffer_bytes(caller: &mut C<'_>, kind: i32, start: i32, size: i32, ptr: i32, len: i32) -> HostResult {
    let kind = kind as u32;
    if kind > abi::buffer::MAX {
        return Ok(Status::BadArgument);
    }
    let value = tri!(read(caller, ptr, len));
    let state = caller.data_mut();
    let Some(dir) = body_dir(kind) else {
        // configuration and callout buffers are read-only in Envoy
        return Ok(match buffer_contents(state, kind) {
            Ok(_) => Status::BadArgument,
            Err(status) => status,
        });
    };
    let context = state.active_context();
    let Some(stream) = state.stream_mut(context) else { return Ok(Status::NotFound) };
    let flow = stream.flow_mut(dir);
    if flow.complete || flow.closed || flow.headers_state == HeadersState::NotReceived {
        state.violation("proxy_set_buffer_bytes", format!("{dir:?} body changed after it went on (or before headers)"));
        return Ok(Status::BadArgument);
    }
    // Envoy's Buffer::copyFrom: prepend, replace all, or append; nothing else.
    let (start, size) = (start as u32 as usize, size as u32 as usize);
    let pending = &mut flow.pending;
    if start == 0 && size == 0 {
        pending.splice(0..0, value);
    } else if start == 0 && size >= pending.len() {
        *pending = value;
    } else if start >= pending.len() {
        pending.extend_from_slice(&value);
    } else {
        return Ok(Status::BadArgument);
    }
    Ok(Status::Ok)
}

// ---- header maps ----

fn headers_dir(kind: u32) -> Option<(Dir, bool)> {
    match kind {
        abi::map::HTTP_REQUEST_HEADERS => Some((Dir::Request, false)),
        abi::map::HTTP_REQUEST_TRAILERS => Some((Dir::Request, true)),
        abi::map::HTTP_RESPONSE_HEADERS => Some((Dir::Response, false)),
        abi::map::HTTP_RESPONSE_TRAILERS => Some((Dir::Response, true)),
        _ => None,
    }
}

/// The map as readable now; `Ok(None)`: not available (Envoy's null map: get value/size answer
/// BadArgument, get pairs answers an empty map).
fn map_for_read(state: &VmState, kind: u32) -> Result<Option<&HeaderMap>, Status> {
    if kind > abi::map::MAX {
        return Err(Status::BadArgument);
    }
    if let Some((dir, trailers)) = headers_dir(kind) {
        let Some(stream) = state.stream(state.active_context()) else { return Ok(None) };
        let flow = stream.flow(dir);
        if trailers {
            if flow.trailers_held {
                return Ok(flow.trailers.as_ref());
            }
            return Ok(if stream.in_log { flow.out_trailers.as_ref() } else { None });
        }
        if matches!(flow.headers_state, HeadersState::Held { .. }) && !flow.headers_released {
            return Ok(Some(&flow.headers));
        }
        if stream.in_log && flow.headers_state != HeadersState::NotReceived {
            return Ok(Some(flow.out_headers.as_ref().unwrap_or(&flow.headers)));
        }
        return Ok(None);
    }
    match (kind, &state.call_response) {
        (abi::map::HTTP_CALL_RESPONSE_HEADERS, Some(Some(r))) => Ok(Some(&r.headers)),
        (abi::map::HTTP_CALL_RESPONSE_TRAILERS, Some(Some(r))) => Ok(Some(&r.trailers)),
        // a failed call has no response maps (Envoy's null map)
        _ => Ok(None),
    }
}

/// The map as writable now, or BadArgument (recorded as a violation when it is a stream map the
/// filter may no longer change).
fn map_for_write<'a>(state: &'a mut VmState, kind: u32, call: &'static str) -> Result<&'a mut HeaderMap, Status> {
    if kind > abi::map::MAX {
        return Err(Status::BadArgument);
    }
    let Some((dir, trailers)) = headers_dir(kind) else { return Err(Status::BadArgument) };
    let context = state.active_context();
    let why = match state.stream(context) {
        None => "in a root context (no stream)".to_string(),
        Some(stream) => {
            let flow = stream.flow(dir);
            let (what, whither) = match (dir, trailers) {
                (Dir::Request, false) => ("request headers", "upstream"),
                (Dir::Request, true) => ("request trailers", "upstream"),
                (Dir::Response, false) => ("response headers", "downstream"),
                (Dir::Response, true) => ("response trailers", "downstream"),
            };
            let writable = if trailers {
                flow.trailers_held
            } else {
                matches!(flow.headers_state, HeadersState::Held { .. }) && !flow.headers_released
            };
            if writable {
                let stream = state.stream_mut(context).ok_or(Status::BadArgument)?;
                let flow = stream.flow_mut(dir);
                return if trailers {
                    flow.trailers.as_mut().ok_or(Status::BadArgument)
                } else {
                    Ok(&mut flow.headers)
                };
            }
            if flow.headers_state == HeadersState::NotReceived {
                format!("{what} before they arrived")
            } else {
                format!("{what} after they went {whither} (only while the filter holds them)")
            }
        }
    };
    state.violation(call, format!("map {kind} is not writable: {why}"));
    Err(Status::BadArgument)
}

fn get_header_map_pairs(caller: &mut C<'_>, kind: i32, ptr_ptr: i32, size_ptr: i32) -> HostResult {
    let bytes = tri!(map_for_read(caller.data(), kind as u32)).map(HeaderMap::serialize).unwrap_or_default();
    copy_out(caller, &bytes, ptr_ptr, size_ptr)
}

fn parse_map(caller: &C<'_>, call: &'static str, bytes: &[u8]) -> HeaderMap {
    HeaderMap::deserialize(bytes).unwrap_or_else(|e| {
        caller.data().violation(call, format!("{e}; Envoy takes it as an empty map"));
        HeaderMap::new()
    })
}

fn set_header_map_pairs(caller: &mut C<'_>, kind: i32, ptr: i32, len: i32) -> HostResult {
    let bytes = tri!(read(caller, ptr, len));
    let new = parse_map(caller, "proxy_set_header_map_pairs", &bytes);
    let map = tri!(map_for_write(caller.data_mut(), kind as u32, "proxy_set_header_map_pairs"));
    *map = new;
    Ok(Status::Ok)
}

fn get_header_map_size(caller: &mut C<'_>, kind: i32, size_ptr: i32) -> HostResult {
    let Some(map) = tri!(map_for_read(caller.data(), kind as u32)) else { return Ok(Status::BadArgument) };
    tri!(write_u32(caller, size_ptr, map.byte_size() as u32));
    Ok(Status::Ok)
}

fn get_header_map_value(
    caller: &mut C<'_>,
    kind: i32,
    kptr: i32,
    klen: i32,
    ptr_ptr: i32,
    size_ptr: i32,
) -> HostResult {
    let key = tri!(read(caller, kptr, klen));
    let Some(map) = tri!(map_for_read(caller.data(), kind as u32)) else {
        caller.data().violation(
            "proxy_get_header_map_value",
            format!("map {kind} is not available in this context (e.g. request headers after they went upstream)"),
        );
        return Ok(Status::BadArgument);
    };
    if map.get_bytes(&key).is_none() {
        return Ok(Status::NotFound);
    }
    copy_out_from(caller, ptr_ptr, size_ptr, |state| {
        map_for_read(state, kind as u32)?.and_then(|m| m.get_bytes(&key)).ok_or(Status::NotFound)
    })
}

fn add_header_map_value(caller: &mut C<'_>, kind: i32, kptr: i32, klen: i32, vptr: i32, vlen: i32) -> HostResult {
    let key = tri!(read(caller, kptr, klen));
    let value = tri!(read(caller, vptr, vlen));
    tri!(map_for_write(caller.data_mut(), kind as u32, "proxy_add_header_map_value")).append(key, value);
    Ok(Status::Ok)
}

fn replace_header_map_value(caller: &mut C<'_>, kind: i32, kptr: i32, klen: i32, vptr: i32, vlen: i32) -> HostResult {
    let key = tri!(read(caller, kptr, klen));
    let value = tri!(read(caller, vptr, vlen));
    tri!(map_for_write(caller.data_mut(), kind as u32, "proxy_replace_header_map_value")).set(key, value);
    Ok(Status::Ok)
}

fn remove_header_map_value(caller: &mut C<'_>, kind: i32, kptr: i32, klen: i32) -> HostResult {
    let key = tri!(read(caller, kptr, klen));
    tri!(map_for_write(caller.data_mut(), kind as u32, "proxy_remove_header_map_value")).remove(key);
    Ok(Status::Ok)
}

// ---- properties ----

fn property(state: &VmState, path: &[u8]) -> Option<Vec<u8>> {
    let context = state.active_context();
    let stream = state.stream(context);
    if let Some(stream) = stream {
        if let Some((_, v)) = stream.properties.iter().rev().find(|(k, _)| k == path) {
            return Some(v.clone());
        }
    }
    if let Some((_, v)) = state.properties.iter().rev().find(|(k, _)| k == path) {
        return Some(v.clone());
    }
    let parts: Vec<&[u8]> = path.split(|b| *b == 0).collect();
    match parts.as_slice() {
        [b"plugin_name"] => return Some(state.plugin_name.as_bytes().to_vec()),
        [b"plugin_root_id"] => return Some(state.root_id.as_bytes().to_vec()),
        [b"plugin_vm_id"] => return Some(state.vm_id.as_bytes().to_vec()),
        _ => {}
    }
    let stream = stream?;
    let request = stream.request.out_headers.as_ref().unwrap_or(&stream.request.headers);
    let header = |name: &str| request.get_bytes(name.as_bytes()).map(<[u8]>::to_vec);
    match parts.as_slice() {
        [b"request", b"path"] => header(":path"),
        [b"request", b"url_path"] => {
            header(":path").map(|p| p.split(|b| *b == b'?').next().unwrap_or_default().to_vec())
        }
        [b"request", b"method"] => header(":method"),
        [b"request", b"host"] => header(":authority"),
        [b"request", b"scheme"] => header(":scheme"),
        [b"request", b"id"] => header("x-request-id"),
        [b"request", b"protocol"] => Some(b"HTTP/1.1".to_vec()),
        [b"request", b"headers", name] => request.get_bytes(name).map(<[u8]>::to_vec),
        [b"response", b"code"] => {
            let response = stream.response.out_headers.as_ref().unwrap_or(&stream.response.headers);
            let code: i64 = response.get(":status")?.parse().ok()?;
            Some(code.to_le_bytes().to_vec())
        }
        [b"response", b"headers", name] => {
            let response = stream.response.out_headers.as_ref().unwrap_or(&stream.response.headers);
            response.get_bytes(name).map(<[u8]>::to_vec)
        }
        _ => None,
    }
}

fn get_property(caller: &mut C<'_>, pptr: i32, plen: i32, ptr_ptr: i32, size_ptr: i32) -> HostResult {
    let path = tri!(read(caller, pptr, plen));
    match property(caller.data(), &path) {
        Some(value) => copy_out(caller, &value, ptr_ptr, size_ptr),
        None => Ok(Status::NotFound),
    }
}

fn set_property(caller: &mut C<'_>, pptr: i32, plen: i32, vptr: i32, vlen: i32) -> HostResult {
    let path = tri!(read(caller, pptr, plen));
    let value = tri!(read(caller, vptr, vlen));
    let state = caller.data_mut();
    let context = state.active_context();
    // Envoy stores it in the stream's filter state; a root context has no stream: NotFound.
    let Some(stream) = state.stream_mut(context) else { return Ok(Status::NotFound) };
    stream.properties.retain(|(k, _)| *k != path);
    stream.properties.push((path, value));
    Ok(Status::Ok)
}

// ---- shared data ----

/// The guest's bytes at `ptr..ptr + len`, borrowed (no copy).
fn guest_bytes<'a>(caller: &'a C<'_>, ptr: i32, len: i32) -> Result<&'a [u8], Status> {
    let memory = caller.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let (start, end) = range(ptr, len).ok_or(Status::InvalidMemoryAccess)?;
    memory.data(caller).get(start..end).ok_or(Status::InvalidMemoryAccess)
}

fn get_shared_data(caller: &mut C<'_>, kptr: i32, klen: i32, ptr_ptr: i32, size_ptr: i32, cas_ptr: i32) -> HostResult {
    let found = {
        let key = tri!(guest_bytes(caller, kptr, klen));
        let state = caller.data();
        let shared = state.shared.borrow();
        shared.shared_data.get(&state.vm_id).and_then(|m| m.get(key)).cloned()
    };
    let Some((value, cas)) = found else { return Ok(Status::NotFound) };
    let status = copy_out(caller, &value, ptr_ptr, size_ptr)?;
    if status != Status::Ok {
        return Ok(status);
    }
    tri!(write_u32(caller, cas_ptr, cas));
    Ok(Status::Ok)
}

fn set_shared_data(caller: &mut C<'_>, kptr: i32, klen: i32, vptr: i32, vlen: i32, cas: i32) -> HostResult {
    let key = tri!(guest_bytes(caller, kptr, klen));
    let value = tri!(guest_bytes(caller, vptr, vlen));
    let cas = cas as u32;
    let state = caller.data();
    let mut shared = state.shared.borrow_mut();
    let shared = &mut *shared;
    if !shared.shared_data.contains_key(&state.vm_id) {
        shared.shared_data.insert(state.vm_id.clone(), Default::default());
    }
    let Some(map) = shared.shared_data.get_mut(&state.vm_id) else { return Ok(Status::InternalFailure) };
    if let Some(entry) = map.get_mut(key) {
        if cas != 0 {
            // A conflicting write injected by the test (Host::force_cas_mismatch): another VM wrote
            // the same value in between, so the stored cas moved on. (The key is built only when
            // some are injected.)
            let forced = !shared.forced_cas_mismatch.is_empty()
                && shared
                    .forced_cas_mismatch
                    .get_mut(&(state.vm_id.clone(), key.to_vec()))
                    .filter(|n| **n > 0)
                    .map(|left| *left -= 1)
                    .is_some();
            if forced {
                let next = shared.next_cas;
                shared.next_cas = next.wrapping_add(1).max(1);
                entry.1 = next;
                return Ok(Status::CasMismatch);
            }
            if cas != entry.1 {
                return Ok(Status::CasMismatch);
            }
        }
        let next = shared.next_cas;
        shared.next_cas = next.wrapping_add(1).max(1);
        // The stored value's buffer is reused.
        entry.0.clear();
        entry.0.extend_from_slice(value);
        entry.1 = next;
    } else {
        let next = shared.next_cas;
        shared.next_cas = next.wrapping_add(1).max(1);
        map.insert(key.to_vec(), (value.to_vec(), next));
    }
    Ok(Status::Ok)
}

// ---- shared queues ----

fn register_shared_queue(caller: &mut C<'_>, nptr: i32, nlen: i32, token_ptr: i32) -> HostResult {
    let name = tri!(read(caller, nptr, nlen));
    let state = caller.data();
    let active = state.active_context();
    let consumer = (state.vm.0, state.root_of(active).unwrap_or(active));
    let token = {
        let mut shared = state.shared.borrow_mut();
        let key = (state.vm_id.clone(), name);
        let token = match shared.queue_tokens.get(&key) {
            Some(token) => *token,
            None => {
                let mut token = shared.next_queue_token;
                while token == 0 || shared.queues.contains_key(&token) {
                    token = token.wrapping_add(1);
                }
                shared.next_queue_token = token.wrapping_add(1);
                shared.queue_tokens.insert(key, token);
                token
            }
        };
        // The last registrant becomes the consumer; items already queued are kept.
        shared.queues.entry(token).or_insert_with(|| Queue { items: Default::default(), consumer }).consumer = consumer;
        token
    };
    tri!(write_u32(caller, token_ptr, token));
    Ok(Status::Ok)
}

fn resolve_shared_queue(caller: &mut C<'_>, vptr: i32, vlen: i32, nptr: i32, nlen: i32, token_ptr: i32) -> HostResult {
    let vm_id = tri!(read(caller, vptr, vlen));
    let name = tri!(read(caller, nptr, nlen));
    let token = {
        let state = caller.data();
        let vm_id = if vm_id.is_empty() { state.vm_id.clone() } else { String::from_utf8_lossy(&vm_id).into_owned() };
        state.shared.borrow().queue_tokens.get(&(vm_id, name)).copied()
    };
    let Some(token) = token else { return Ok(Status::NotFound) };
    tri!(write_u32(caller, token_ptr, token));
    Ok(Status::Ok)
}

fn enqueue_shared_queue(caller: &mut C<'_>, token: i32, ptr: i32, len: i32) -> HostResult {
    let value = tri!(read(caller, ptr, len));
    let token = token as u32;
    let mut shared = caller.data().shared.borrow_mut();
    let now = shared.now_ns;
    let Some(queue) = shared.queues.get_mut(&token) else { return Ok(Status::NotFound) };
    queue.items.push_back(value);
    let (vm, context) = queue.consumer;
    // Envoy posts on_queue_ready to the consumer's thread: it runs after the current callback.
    shared.schedule(now, Event::QueueReady { vm, context, token });
    Ok(Status::Ok)
}

fn dequeue_shared_queue(caller: &mut C<'_>, token: i32, ptr_ptr: i32, size_ptr: i32) -> HostResult {
    let item = {
        let mut shared = caller.data().shared.borrow_mut();
        let Some(queue) = shared.queues.get_mut(&(token as u32)) else { return Ok(Status::NotFound) };
        let Some(item) = queue.items.pop_front() else { return Ok(Status::Empty) };
        item
    };
    copy_out(caller, &item, ptr_ptr, size_ptr)
}

// ---- streams ----

fn stream_dir(kind: i32) -> Result<Dir, Status> {
    match kind as u32 {
        abi::stream::HTTP_REQUEST => Ok(Dir::Request),
        abi::stream::HTTP_RESPONSE => Ok(Dir::Response),
        // TCP streams and unknown values: BadArgument, as Envoy's HTTP filter answers
        _ => Err(Status::BadArgument),
    }
}

fn continue_stream(caller: &mut C<'_>, kind: i32) -> HostResult {
    let dir = tri!(stream_dir(kind));
    let state = caller.data_mut();
    let context = state.active_context();
    let Some(stream) = state.stream_mut(context) else {
        state.violation("proxy_continue_stream", "no stream in this context (set the effective context first)");
        return Ok(Status::Ok);
    };
    // Envoy drops its reference to the held headers right away; resuming happens after the callback.
    stream.flow_mut(dir).headers_released = true;
    state.after_call.push(AfterCall::Continue { context, dir });
    Ok(Status::Ok)
}

fn close_stream(caller: &mut C<'_>, kind: i32) -> HostResult {
    let kind = kind as u32;
    if kind > abi::stream::UPSTREAM {
        return Ok(Status::BadArgument);
    }
    if stream_dir(kind as i32).is_err() {
        return Ok(Status::Ok);
    }
    let state = caller.data_mut();
    let context = state.active_context();
    if state.stream(context).is_none() {
        state.violation("proxy_close_stream", "no stream in this context");
        return Ok(Status::Ok);
    }
    // Envoy resets the whole stream (request and response)
    state.after_call.push(AfterCall::Close { context });
    Ok(Status::Ok)
}

#[allow(clippy::too_many_arguments)]
fn send_local_response(
    caller: &mut C<'_>,
    code: i32,
    dptr: i32,
    dlen: i32,
    bptr: i32,
    blen: i32,
    hptr: i32,
    hlen: i32,
    grpc_status: i32,
) -> HostResult {
    let details = tri!(read(caller, dptr, dlen));
    let body = tri!(read(caller, bptr, blen));
    let headers = tri!(read(caller, hptr, hlen));
    let headers = parse_map(caller, "proxy_send_local_response", &headers);
    let state = caller.data_mut();
    let context = state.active_context();
    if state.stream(context).is_none() {
        state.violation("proxy_send_local_response", "no stream in this context: nothing is sent");
        return Ok(Status::Ok);
    }
    let reply = crate::types::LocalReply {
        status: code as u32,
        details: String::from_utf8_lossy(&details).into_owned(),
        body,
        headers,
        grpc_status,
    };
    state.after_call.push(AfterCall::LocalReply { context, reply });
    state.stop_next_iteration = true;
    Ok(Status::Ok)
}

#[allow(clippy::too_many_arguments)]
fn http_call(
    caller: &mut C<'_>,
    uptr: i32,
    ulen: i32,
    hptr: i32,
    hlen: i32,
    bptr: i32,
    blen: i32,
    tptr: i32,
    tlen: i32,
    timeout: i32,
    token_ptr: i32,
) -> HostResult {
    let cluster = tri!(read(caller, uptr, ulen));
    let body = tri!(read(caller, bptr, blen));
    let header_bytes = tri!(read(caller, hptr, hlen));
    let trailer_bytes = tri!(read(caller, tptr, tlen));
    tri!(write_u32(caller, token_ptr, 0));
    let mut headers = parse_map(caller, "proxy_http_call", &header_bytes);
    let trailers = parse_map(caller, "proxy_http_call", &trailer_bytes);
    let cluster = String::from_utf8_lossy(&cluster).into_owned();
    if timeout < 0 {
        caller.data().violation("proxy_http_call", format!("negative timeout {timeout}"));
        return Ok(Status::BadArgument);
    }
    let missing: Vec<&str> = [":method", ":path", ":authority"].into_iter().filter(|h| !headers.contains(h)).collect();
    if !missing.is_empty() {
        caller.data().violation("proxy_http_call", format!("headers lack {}", missing.join(", ")));
        return Ok(Status::BadArgument);
    }
    let state = caller.data_mut();
    let active = state.active_context();
    let Some(root) = state.root_of(active) else { return Ok(Status::BadArgument) };
    let mut shared = state.shared.borrow_mut();
    let Some(mut handler) = shared.clusters.remove(&cluster) else {
        drop(shared);
        state.violation("proxy_http_call", format!("unknown cluster {cluster:?}"));
        return Ok(Status::BadArgument);
    };
    if !body.is_empty() {
        headers.set("content-length", body.len().to_string());
    }
    let token = state.next_http_token;
    state.next_http_token = state.next_http_token.wrapping_add(1).max(1);
    let at_ns = shared.now_ns;
    let request = CalloutRequest {
        vm: state.vm,
        root_context_id: root,
        token,
        cluster: cluster.clone(),
        headers,
        body,
        trailers,
        timeout_ms: timeout as u32,
        at_ns,
    };
    let reply = handler(&request);
    shared.clusters.insert(cluster, handler);
    let timeout_ns = u64::from(timeout as u32) * 1_000_000;
    let delay_ns = u64::try_from(reply.delay.as_nanos()).unwrap_or(u64::MAX);
    let (due, response) = if timeout_ns > 0 && delay_ns > timeout_ns {
        let mut headers =
            HeaderMap::from([(":status", "504"), ("content-length", "24"), ("content-type", "text/plain")]);
        headers.set("content-length", "24");
        (
            at_ns.saturating_add(timeout_ns),
            Some(CallResponse { headers, body: b"upstream request timeout".to_vec(), trailers: HeaderMap::new() }),
        )
    } else {
        let response = match reply.outcome {
            CalloutOutcome::Reset => None,
            CalloutOutcome::Response { status, headers: extra, body, trailers } => {
                let mut headers = HeaderMap::from([(":status", status.to_string())]);
                for (k, v) in extra.iter() {
                    headers.append(k, v);
                }
                Some(CallResponse { headers, body, trailers })
            }
        };
        (at_ns.saturating_add(delay_ns), response)
    };
    shared.callouts.push(request);
    shared.schedule(due, Event::CalloutResponse { vm: state.vm.0, root, token, response });
    drop(shared);
    tri!(write_u32(caller, token_ptr, token));
    Ok(Status::Ok)
}

fn get_status(caller: &mut C<'_>, code_ptr: i32, ptr_ptr: i32, size_ptr: i32) -> HostResult {
    let (code, message): (u32, &[u8]) = match caller.data().call_response {
        Some(None) => (Status::BrokenConnection as u32, b"reset"),
        _ => (0, b""),
    };
    tri!(write_u32(caller, code_ptr, code));
    copy_out(caller, message, ptr_ptr, size_ptr)
}

fn set_effective_context(caller: &mut C<'_>, context: i32) -> HostResult {
    let state = caller.data_mut();
    let context = context as u32;
    if !state.contexts.contains_key(&context) {
        state.violation("proxy_set_effective_context", format!("unknown context {context}"));
        return Ok(Status::BadArgument);
    }
    state.effective = context;
    Ok(Status::Ok)
}

fn done(caller: &mut C<'_>) -> HostResult {
    let state = caller.data_mut();
    let context = state.active_context();
    let Some(at) = state.pending_done.iter().position(|c| *c == context) else { return Ok(Status::NotFound) };
    state.pending_done.remove(at);
    state.after_call.push(AfterCall::Done { context });
    Ok(Status::Ok)
}

fn call_foreign_function(
    caller: &mut C<'_>,
    nptr: i32,
    nlen: i32,
    aptr: i32,
    alen: i32,
    _ptr_ptr: i32,
    _size_ptr: i32,
) -> HostResult {
    tri!(read(caller, nptr, nlen));
    tri!(read(caller, aptr, alen));
    // No foreign functions are registered in this host.
    Ok(Status::NotFound)
}

// ---- metrics ----

fn metric_kind(code: u32) -> Option<MetricKind> {
    match code {
        abi::metric::COUNTER => Some(MetricKind::Counter),
        abi::metric::GAUGE => Some(MetricKind::Gauge),
        abi::metric::HISTOGRAM => Some(MetricKind::Histogram),
        _ => None,
    }
}

fn define_metric(caller: &mut C<'_>, kind: i32, nptr: i32, nlen: i32, id_ptr: i32) -> HostResult {
    let Some(metric) = metric_kind(kind as u32) else { return Ok(Status::BadArgument) };
    let name = String::from_utf8_lossy(&tri!(read(caller, nptr, nlen))).into_owned();
    if !writable(caller, id_ptr, 4) {
        return Ok(Status::InvalidMemoryAccess);
    }
    let state = caller.data_mut();
    // Envoy: ids step by 4 from the type (counters 4, 8, ...; gauges 5, 9, ...; histograms 6, ...).
    let slot = &mut state.next_metric_id[kind as usize];
    *slot = slot.wrapping_add(4);
    let id = *slot;
    state.metric_ids.insert(id, (metric, name.clone()));
    state.shared.borrow_mut().metrics.entry((metric, name)).or_default();
    tri!(write_u32(caller, id_ptr, id));
    Ok(Status::Ok)
}

fn with_metric(
    caller: &C<'_>,
    id: i32,
    f: impl FnOnce(MetricKind, &mut crate::state::MetricSlot, usize) -> Status,
) -> Status {
    let state = caller.data();
    let Some((kind, name)) = state.metric_ids.get(&(id as u32)) else { return Status::NotFound };
    let mut shared = state.shared.borrow_mut();
    let cap = shared.histogram_cap;
    let slot = shared.metrics.entry((*kind, name.clone())).or_default();
    f(*kind, slot, cap)
}

fn increment_metric(caller: &mut C<'_>, id: i32, delta: i64) -> Status {
    with_metric(caller, id, |kind, slot, _| match kind {
        MetricKind::Counter if delta > 0 => {
            slot.value = slot.value.saturating_add(delta as u64);
            Status::Ok
        }
        MetricKind::Gauge => {
            slot.value = slot.value.saturating_add_signed(delta);
            Status::Ok
        }
        _ => Status::BadArgument,
    })
}

fn record_metric(caller: &mut C<'_>, id: i32, value: i64) -> Status {
    let value = value as u64;
    with_metric(caller, id, |kind, slot, cap| {
        match kind {
            MetricKind::Counter => slot.value = slot.value.saturating_add(value),
            MetricKind::Gauge => slot.value = value,
            MetricKind::Histogram => {
                slot.value = slot.value.saturating_add(1);
                if slot.samples.len() >= cap {
                    slot.samples.pop_front();
                }
                if cap > 0 {
                    slot.samples.push_back(value);
                }
            }
        }
        Status::Ok
    })
}

fn get_metric(caller: &mut C<'_>, id: i32, ptr: i32) -> HostResult {
    let mut value = 0;
    let status = with_metric(caller, id, |kind, slot, _| match kind {
        MetricKind::Histogram => Status::BadArgument,
        _ => {
            value = slot.value;
            Status::Ok
        }
    });
    if status != Status::Ok {
        return Ok(status);
    }
    tri!(write_u64(caller, ptr, value));
    Ok(Status::Ok)
}

// ---- gRPC (not implemented) ----

fn grpc_unimplemented(caller: &C<'_>) -> HostResult {
    caller.data().violation("proxy_grpc_*", "gRPC calls are not implemented by the test host");
    Ok(Status::Unimplemented)
}

#[allow(clippy::too_many_arguments)]
fn grpc_unimplemented12(
    caller: &mut C<'_>,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
) -> HostResult {
    grpc_unimplemented(caller)
}

#[allow(clippy::too_many_arguments)]
fn grpc_unimplemented9(
    caller: &mut C<'_>,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
    _: i32,
) -> HostResult {
    grpc_unimplemented(caller)
}

fn grpc_unimplemented4(caller: &mut C<'_>, _: i32, _: i32, _: i32, _: i32) -> HostResult {
    grpc_unimplemented(caller)
}

fn grpc_unimplemented1(caller: &mut C<'_>, _: i32) -> HostResult {
    grpc_unimplemented(caller)
}

// ---- WASI (what Envoy provides: stdout/stderr to the log, clocks, randomness, stubs) ----

mod errno {
    pub(super) const SUCCESS: i32 = 0;
    pub(super) const BADF: i32 = 8;
    pub(super) const FAULT: i32 = 21;
    pub(super) const INVAL: i32 = 28;
    pub(super) const NOENT: i32 = 44;
    pub(super) const NOSYS: i32 = 52;
    pub(super) const NOTDIR: i32 = 20;
    pub(super) const NOTSUP: i32 = 58;
}

fn fault(caller: &C<'_>, call: &'static str) -> i32 {
    caller.data().violation(call, "pointer/size outside the guest memory");
    errno::FAULT
}

fn is_std_stream(fd: i32) -> bool {
    fd == 1 || fd == 2
}

/// `fd_write` to stdout (Info) or stderr (Error): the iovecs are concatenated, one trailing
/// newline removed.
fn fd_write(caller: &mut C<'_>, fd: i32, iovs: i32, iovs_len: i32, nwritten_ptr: i32) -> i32 {
    let level = match fd {
        1 => LogLevel::Info,
        2 => LogLevel::Error,
        _ => return errno::BADF,
    };
    let mut text = Vec::new();
    for i in 0..(iovs_len as u32) {
        let Some(at) = (i as i32).checked_mul(8).and_then(|o| iovs.checked_add(o)) else {
            return fault(caller, "fd_write");
        };
        let Ok(iovec) = read(caller, at, 8) else { return fault(caller, "fd_write") };
        let buf = i32::from_le_bytes([iovec[0], iovec[1], iovec[2], iovec[3]]);
        let len = i32::from_le_bytes([iovec[4], iovec[5], iovec[6], iovec[7]]);
        let Ok(bytes) = read(caller, buf, len) else { return fault(caller, "fd_write") };
        text.extend_from_slice(&bytes);
    }
    let written = text.len() as u32;
    if text.last() == Some(&b'\n') {
        text.pop();
    }
    if !text.is_empty() {
        push_log(caller, level, String::from_utf8_lossy(&text).into_owned());
    }
    if write_u32(caller, nwritten_ptr, written).is_err() {
        return fault(caller, "fd_write");
    }
    errno::SUCCESS
}

fn zero_words(caller: &mut C<'_>, call: &'static str, ptrs: &[i32]) -> i32 {
    for ptr in ptrs {
        if write_u32(caller, *ptr, 0).is_err() {
            return fault(caller, call);
        }
    }
    errno::SUCCESS
}

fn add_wasi(linker: &mut Linker<VmState>, m: &str) -> wasmtime::Result<()> {
    linker.func_wrap(m, "fd_write", |mut c: C<'_>, fd: i32, iovs: i32, n: i32, out: i32| {
        fd_write(&mut c, fd, iovs, n, out)
    })?;
    linker.func_wrap(m, "fd_pwrite", |mut c: C<'_>, fd: i32, iovs: i32, n: i32, _off: i64, out: i32| {
        fd_write(&mut c, fd, iovs, n, out)
    })?;
    linker.func_wrap(m, "fd_read", |_: C<'_>, _: i32, _: i32, _: i32, _: i32| errno::NOSYS)?;
    linker.func_wrap(m, "fd_pread", |_: C<'_>, _: i32, _: i32, _: i32, _: i64, _: i32| errno::NOSYS)?;
    linker.func_wrap(m, "fd_seek", |_: C<'_>, _: i32, _: i64, _: i32, _: i32| errno::SUCCESS)?;
    linker.func_wrap(m, "fd_close", |_: C<'_>, _: i32| errno::SUCCESS)?;
    linker.func_wrap(m, "fd_fdstat_get", |mut c: C<'_>, fd: i32, out: i32| {
        if !is_std_stream(fd) {
            return errno::BADF;
        }
        // filetype/flags 0, rights_base FD_WRITE (64), rights_inheriting 0
        let mut stat = [0u8; 24];
        stat[8] = 64;
        if write(&mut c, out, &stat).is_err() {
            return fault(&c, "fd_fdstat_get");
        }
        errno::SUCCESS
    })?;
    linker.func_wrap(m, "fd_fdstat_set_flags", |_: C<'_>, _: i32, _: i32| errno::NOSYS)?;
    linker.func_wrap(
        m,
        "fd_fdstat_set_rights",
        |_: C<'_>, fd: i32, _: i64, _: i64| {
            if is_std_stream(fd) {
                errno::SUCCESS
            } else {
                errno::BADF
            }
        },
    )?;
    linker.func_wrap(m, "fd_advise", |_: C<'_>, _: i32, _: i64, _: i64, _: i32| errno::SUCCESS)?;
    linker.func_wrap(
        m,
        "fd_allocate",
        |_: C<'_>, fd: i32, _: i64, _: i64| {
            if is_std_stream(fd) {
                errno::SUCCESS
            } else {
                errno::BADF
            }
        },
    )?;
    linker.func_wrap(
        m,
        "fd_datasync",
        |_: C<'_>, fd: i32| if is_std_stream(fd) { errno::SUCCESS } else { errno::BADF },
    )?;
    linker.func_wrap(m, "fd_sync", |_: C<'_>, fd: i32| if is_std_stream(fd) { errno::SUCCESS } else { errno::BADF })?;
    linker.func_wrap(m, "fd_filestat_get", |_: C<'_>, _: i32, _: i32| errno::BADF)?;
    linker.func_wrap(
        m,
        "fd_filestat_set_size",
        |_: C<'_>, fd: i32, _: i64| {
            if is_std_stream(fd) {
                errno::SUCCESS
            } else {
                errno::BADF
            }
        },
    )?;
    linker.func_wrap(
        m,
        "fd_filestat_set_times",
        |_: C<'_>, fd: i32, _: i64, _: i64, _: i32| {
            if is_std_stream(fd) {
                errno::SUCCESS
            } else {
                errno::BADF
            }
        },
    )?;
    linker.func_wrap(m, "fd_prestat_get", |_: C<'_>, _: i32, _: i32| errno::BADF)?;
    linker.func_wrap(m, "fd_prestat_dir_name", |_: C<'_>, _: i32, _: i32, _: i32| errno::NOSYS)?;
    linker.func_wrap(m, "fd_readdir", |mut c: C<'_>, _: i32, _: i32, _: i32, _: i64, used: i32| {
        match zero_words(&mut c, "fd_readdir", &[used]) {
            errno::SUCCESS => errno::NOTDIR,
            e => e,
        }
    })?;
    linker.func_wrap(m, "fd_renumber", |_: C<'_>, fd: i32, to: i32| {
        if is_std_stream(fd) && is_std_stream(to) {
            errno::NOTSUP
        } else {
            errno::BADF
        }
    })?;
    linker.func_wrap(m, "fd_tell", |mut c: C<'_>, fd: i32, out: i32| {
        if !is_std_stream(fd) {
            return errno::BADF;
        }
        if write_u64(&mut c, out, 0).is_err() {
            return fault(&c, "fd_tell");
        }
        errno::SUCCESS
    })?;
    linker.func_wrap(m, "environ_get", |_: C<'_>, _: i32, _: i32| errno::SUCCESS)?;
    linker.func_wrap(m, "environ_sizes_get", |mut c: C<'_>, count: i32, size: i32| {
        zero_words(&mut c, "environ_sizes_get", &[count, size])
    })?;
    linker.func_wrap(m, "args_get", |_: C<'_>, _: i32, _: i32| errno::SUCCESS)?;
    linker.func_wrap(m, "args_sizes_get", |mut c: C<'_>, argc: i32, size: i32| {
        zero_words(&mut c, "args_sizes_get", &[argc, size])
    })?;
    linker.func_wrap(m, "clock_time_get", |mut c: C<'_>, id: i32, _precision: i64, out: i32| {
        // realtime and monotonic both read the host's virtual clock
        if id != 0 && id != 1 {
            return errno::NOTSUP;
        }
        let t = now(&c);
        if write_u64(&mut c, out, t).is_err() {
            return fault(&c, "clock_time_get");
        }
        errno::SUCCESS
    })?;
    linker.func_wrap(m, "clock_res_get", |mut c: C<'_>, id: i32, out: i32| {
        if id != 0 && id != 1 {
            return errno::NOTSUP;
        }
        if write_u64(&mut c, out, 1).is_err() {
            return fault(&c, "clock_res_get");
        }
        errno::SUCCESS
    })?;
    linker.func_wrap(m, "random_get", |mut c: C<'_>, buf: i32, len: i32| {
        let len = len as u32 as usize;
        if len > 64 * 1024 {
            return errno::INVAL;
        }
        let mut bytes = vec![0u8; len];
        c.data().shared.borrow_mut().fill_random(&mut bytes);
        if write(&mut c, buf, &bytes).is_err() {
            return fault(&c, "random_get");
        }
        errno::SUCCESS
    })?;
    linker.func_wrap(m, "sched_yield", |_: C<'_>| errno::SUCCESS)?;
    linker.func_wrap(m, "poll_oneoff", |mut c: C<'_>, _: i32, _: i32, _: i32, nevents: i32| {
        zero_words(&mut c, "poll_oneoff", &[nevents])
    })?;
    linker.func_wrap(m, "proc_exit", |_: C<'_>, code: i32| -> wasmtime::Result<()> {
        Err(wasmtime::Error::msg(format!("the guest called proc_exit({code})")))
    })?;
    linker.func_wrap(
        m,
        "path_open",
        |_: C<'_>, _: i32, _: i32, _: i32, _: i32, _: i32, _: i64, _: i64, _: i32, _: i32| errno::NOENT,
    )?;
    linker.func_wrap(m, "path_create_directory", |_: C<'_>, _: i32, _: i32, _: i32| errno::NOTSUP)?;
    linker.func_wrap(m, "path_filestat_get", |_: C<'_>, _: i32, _: i32, _: i32, _: i32, _: i32| errno::NOTSUP)?;
    linker.func_wrap(
        m,
        "path_filestat_set_times",
        |_: C<'_>, _: i32, _: i32, _: i32, _: i32, _: i64, _: i64, _: i32| errno::NOTSUP,
    )?;
    linker
        .func_wrap(m, "path_link", |_: C<'_>, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32| errno::NOTSUP)?;
    linker.func_wrap(m, "path_readlink", |mut c: C<'_>, _: i32, _: i32, _: i32, _: i32, _: i32, used: i32| {
        match zero_words(&mut c, "path_readlink", &[used]) {
            errno::SUCCESS => errno::NOTSUP,
            e => e,
        }
    })?;
    linker.func_wrap(m, "path_remove_directory", |_: C<'_>, _: i32, _: i32, _: i32| errno::NOTSUP)?;
    linker.func_wrap(m, "path_rename", |_: C<'_>, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32| errno::NOTSUP)?;
    linker.func_wrap(m, "path_symlink", |_: C<'_>, _: i32, _: i32, _: i32, _: i32, _: i32| errno::NOTSUP)?;
    linker.func_wrap(m, "path_unlink_file", |_: C<'_>, _: i32, _: i32, _: i32| errno::NOTSUP)?;
    linker.func_wrap(m, "sock_accept", |mut c: C<'_>, _: i32, _: i32, out: i32| {
        match zero_words(&mut c, "sock_accept", &[out]) {
            errno::SUCCESS => errno::NOTSUP,
            e => e,
        }
    })?;
    linker.func_wrap(m, "sock_recv", |mut c: C<'_>, _: i32, _: i32, _: i32, _: i32, len: i32, flags: i32| {
        if write_u32(&mut c, len, 0).is_err() || write(&mut c, flags, &[0, 0]).is_err() {
            return fault(&c, "sock_recv");
        }
        errno::NOTSUP
    })?;
    linker.func_wrap(m, "sock_send", |mut c: C<'_>, _: i32, _: i32, _: i32, _: i32, len: i32| {
        match zero_words(&mut c, "sock_send", &[len]) {
            errno::SUCCESS => errno::NOTSUP,
            e => e,
        }
    })?;
    linker.func_wrap(m, "sock_shutdown", |_: C<'_>, _: i32, _: i32| errno::NOTSUP)?;
    Ok(())
}

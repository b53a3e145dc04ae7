//! Tiny guest modules in WAT for the host's ABI tests.
//!
//! [`module`] wraps callback bodies in a module that imports every hostcall (as `$proxy_*`,
//! `$fd_write`, ...), exports `memory` (2 pages), the ABI marker and a bump allocator, and has
//! helpers:
//! - `(call $rec (i32.const SLOT) VALUE)` stores an i32 in slot SLOT (read with [`slots`]);
//! - `(call $rec64 (i32.const SLOT) VALUE)` stores an i64 (read with [`slot64`]);
//! - `(call $ev CODE)` appends to the journal (read with [`journal`]);
//! - `(call $log_ret)` logs the value a hostcall returned through pointer 0 / size 4;
//! - `(global.set $bad_alloc (i32.const 1))` makes the allocator answer an out-of-bounds pointer.
//!
//! Memory: 0..64 return pointers, 64..256 scratch, slots at 256 (i32 × 256), i64 slots at 1280
//! (× 128), the journal at 2304, strings from 4096, the heap from 65536.

#![allow(dead_code)]

use kvroute_wasm_host::{Host, VmId};

const IMPORTS: &str = r#"
  (import "env" "proxy_log" (func $proxy_log (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_log_level" (func $proxy_get_log_level (param i32) (result i32)))
  (import "env" "proxy_get_current_time_nanoseconds" (func $proxy_get_current_time_nanoseconds (param i32) (result i32)))
  (import "env" "proxy_set_tick_period_milliseconds" (func $proxy_set_tick_period_milliseconds (param i32) (result i32)))
  (import "env" "proxy_get_buffer_status" (func $proxy_get_buffer_status (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_buffer_bytes" (func $proxy_get_buffer_bytes (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_buffer_bytes" (func $proxy_set_buffer_bytes (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_header_map_pairs" (func $proxy_get_header_map_pairs (param i32 i32 i32) (result i32)))
  (import "env" "proxy_set_header_map_pairs" (func $proxy_set_header_map_pairs (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_header_map_size" (func $proxy_get_header_map_size (param i32 i32) (result i32)))
  (import "env" "proxy_get_header_map_value" (func $proxy_get_header_map_value (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_add_header_map_value" (func $proxy_add_header_map_value (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_replace_header_map_value" (func $proxy_replace_header_map_value (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_remove_header_map_value" (func $proxy_remove_header_map_value (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_property" (func $proxy_get_property (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_property" (func $proxy_set_property (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_shared_data" (func $proxy_get_shared_data (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_shared_data" (func $proxy_set_shared_data (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_register_shared_queue" (func $proxy_register_shared_queue (param i32 i32 i32) (result i32)))
  (import "env" "proxy_resolve_shared_queue" (func $proxy_resolve_shared_queue (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_enqueue_shared_queue" (func $proxy_enqueue_shared_queue (param i32 i32 i32) (result i32)))
  (import "env" "proxy_dequeue_shared_queue" (func $proxy_dequeue_shared_queue (param i32 i32 i32) (result i32)))
  (import "env" "proxy_continue_stream" (func $proxy_continue_stream (param i32) (result i32)))
  (import "env" "proxy_close_stream" (func $proxy_close_stream (param i32) (result i32)))
  (import "env" "proxy_send_local_response" (func $proxy_send_local_response (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_http_call" (func $proxy_http_call (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_status" (func $proxy_get_status (param i32 i32 i32) (result i32)))
  (import "env" "proxy_set_effective_context" (func $proxy_set_effective_context (param i32) (result i32)))
  (import "env" "proxy_done" (func $proxy_done (result i32)))
  (import "env" "proxy_call_foreign_function" (func $proxy_call_foreign_function (param i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_define_metric" (func $proxy_define_metric (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_increment_metric" (func $proxy_increment_metric (param i32 i64) (result i32)))
  (import "env" "proxy_record_metric" (func $proxy_record_metric (param i32 i64) (result i32)))
  (import "env" "proxy_get_metric" (func $proxy_get_metric (param i32 i32) (result i32)))
  (import "env" "proxy_grpc_call" (func $proxy_grpc_call (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "clock_time_get" (func $clock_time_get (param i32 i64 i32) (result i32)))
  (import "wasi_snapshot_preview1" "random_get" (func $random_get (param i32 i32) (result i32)))
"#;

const PRELUDE: &str = r#"
  (memory (export "memory") 2)
  (global $heap (mut i32) (i32.const 65536))
  (global $bad_alloc (mut i32) (i32.const 0))
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_memory_allocate") (param $n i32) (result i32)
    (local $p i32)
    (if (global.get $bad_alloc) (then (return (i32.const 0x7ffffff0))))
    (local.set $p (global.get $heap))
    (global.set $heap (i32.and (i32.add (i32.add (global.get $heap) (local.get $n)) (i32.const 7)) (i32.const -8)))
    (if (i32.gt_u (global.get $heap) (i32.mul (memory.size) (i32.const 65536)))
      (then (drop (memory.grow
        (i32.add (i32.div_u (i32.sub (global.get $heap) (i32.mul (memory.size) (i32.const 65536))) (i32.const 65536))
                 (i32.const 1))))))
    (local.get $p))
  (func $rec (param $slot i32) (param $v i32)
    (i32.store (i32.add (i32.const 256) (i32.shl (local.get $slot) (i32.const 2))) (local.get $v)))
  (func $rec64 (param $slot i32) (param $v i64)
    (i64.store (i32.add (i32.const 1280) (i32.shl (local.get $slot) (i32.const 3))) (local.get $v)))
  (func $slot (param $slot i32) (result i32)
    (i32.load (i32.add (i32.const 256) (i32.shl (local.get $slot) (i32.const 2)))))
  (func $ev (param $code i32)
    (local $n i32)
    (local.set $n (i32.load (i32.const 2304)))
    (i32.store (i32.add (i32.const 2308) (i32.shl (local.get $n) (i32.const 2))) (local.get $code))
    (i32.store (i32.const 2304) (i32.add (local.get $n) (i32.const 1))))
  (func $log_ret
    (drop (call $proxy_log (i32.const 2) (i32.load (i32.const 0)) (i32.load (i32.const 4)))))
"#;

/// A guest module: `strings` become data segments; in `body`, `{name}` becomes
/// `(i32.const ADDR) (i32.const LEN)`, `{name.ptr}` and `{name.len}` each half.
pub fn module(strings: &[(&str, &[u8])], body: &str) -> String {
    let mut data = String::new();
    let mut body = body.to_string();
    let mut addr = 4096u32;
    for (name, bytes) in strings {
        let escaped: String = bytes.iter().map(|b| format!("\\{b:02x}")).collect();
        data.push_str(&format!("  (data (i32.const {addr}) \"{escaped}\")\n"));
        let len = bytes.len();
        body = body
            .replace(&format!("{{{name}}}"), &format!("(i32.const {addr}) (i32.const {len})"))
            .replace(&format!("{{{name}.ptr}}"), &format!("(i32.const {addr})"))
            .replace(&format!("{{{name}.len}}"), &format!("(i32.const {len})"));
        addr += (len as u32 + 8) & !7;
    }
    assert!(!body.contains('{'), "unknown string reference in guest body: {body}");
    format!("(module\n{IMPORTS}\n{PRELUDE}\n{data}\n{body}\n)")
}

/// The first `n` i32 slots.
pub fn slots(host: &Host, vm: VmId, n: usize) -> Vec<i32> {
    let bytes = host.read_memory(vm, 256, n * 4).unwrap().unwrap();
    bytes.chunks(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// One i32 slot.
pub fn slot(host: &Host, vm: VmId, i: usize) -> i32 {
    slots(host, vm, i + 1)[i]
}

/// One i64 slot.
pub fn slot64(host: &Host, vm: VmId, i: usize) -> i64 {
    let b = host.read_memory(vm, 1280 + 8 * i as u32, 8).unwrap().unwrap();
    i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// The journal of `(call $ev ...)` codes.
pub fn journal(host: &Host, vm: VmId) -> Vec<i32> {
    let n = host.read_memory(vm, 2304, 4).unwrap().unwrap();
    let n = u32::from_le_bytes([n[0], n[1], n[2], n[3]]) as usize;
    let bytes = host.read_memory(vm, 2308, n * 4).unwrap().unwrap();
    bytes.chunks(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Guest memory at (pointer, size) taken from two slots.
pub fn bytes_at(host: &Host, vm: VmId, ptr_slot: usize, len_slot: usize) -> Vec<u8> {
    let s = slots(host, vm, ptr_slot.max(len_slot) + 1);
    host.read_memory(vm, s[ptr_slot] as u32, s[len_slot] as usize).unwrap().unwrap()
}

/// Log messages of one VM.
pub fn logs(host: &Host, vm: VmId) -> Vec<String> {
    host.logs().iter().filter(|l| l.vm == vm).map(|l| l.message.clone()).collect()
}

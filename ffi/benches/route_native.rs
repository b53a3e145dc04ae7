//! The C-overhead comparison, timed by criterion on exactly the router and 32 KB body that
//! `ffi/bench/route_bench.c` routes (the workload of `benches/benches/route.rs`,
//! parse_and_route at 64 endpoints):
//!
//! - `route_native/*`: `Router::route_http` + `complete` (+ drop) on the core, called from Rust;
//! - `route_c_api/*`: the same through the C API of the built `libkvroute.so` (loaded at run
//!   time from the profile directory: build it first, `cargo build --release -p kvroute-ffi`):
//!   `kvroute_router_route` + `kvroute_decision_request_id` + `kvroute_router_complete` +
//!   `kvroute_decision_free`, what a C caller does per request;
//!
//! each for the 8k-token request (`*/8k`) and for a short one (`*/short`, a few tokens, where
//! the fixed cost of a call weighs most).
//!
//! The difference is the per-call cost of the C boundary. Run: `ffi/bench/run.sh` (it also runs
//! the C timing loop) or `cargo bench -p kvroute-ffi --bench route_native`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, missing_docs)]
// Calling the C API of the loaded library takes raw pointers and `unsafe` calls; each call
// follows the contract its header comment states.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_void};

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};

use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Role, Router};

const ENDPOINTS: usize = 64;
const PROMPT_BYTES: usize = 8192 * 4;
const NOW: u64 = 1_000;

/// The text generator of benches/benches/route.rs (and of route_bench.c).
use kvroute_benches::fleet::words as text;

/// The JSON body, byte for byte as route_bench.c writes it.
fn body(prompt: &str, max_tokens: Option<u32>) -> String {
    match max_tokens {
        Some(m) => format!("{{\"max_tokens\":{m},\"model\":\"llama\",\"prompt\":\"{prompt}\"}}"),
        None => format!("{{\"model\":\"llama\",\"prompt\":\"{prompt}\"}}"),
    }
}

fn route_native(c: &mut Criterion) {
    let router = Router::new(Policy::default());
    for i in 0..ENDPOINTS {
        let id = format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256);
        router.upsert_endpoint(EndpointSpec::new(id.as_str(), Role::Decode)).unwrap();
        let m = MetricsSnapshot {
            waiting: (i % 4) as u32,
            running: 8,
            kv_usage: 0.3 + (i % 5) as f64 * 0.05,
            updated_ms: NOW,
            ..Default::default()
        };
        router.update_metrics(&id, m).unwrap();
    }
    let systems: Vec<String> = (0..16).map(|t| text(1000 + t, 2048 * 4)).collect();
    let mut warm_ids = Vec::new();
    for w in 0..4 * ENDPOINTS {
        let tail = text(w as u64, PROMPT_BYTES - systems[0].len());
        let b = body(&format!("{}{}", systems[w % 16], tail), None);
        warm_ids.push(router.route_http(b.as_bytes(), std::iter::empty::<(&str, &str)>(), NOW).unwrap().request_id);
    }
    for id in warm_ids {
        router.complete(&id).unwrap();
    }
    let prior = text(3, PROMPT_BYTES - systems[0].len());
    let prompt = format!("{}{}", systems[3], &prior[..prior.len() - 4096]);
    let prompt = format!("{prompt}{}", text(99, PROMPT_BYTES - prompt.len()));
    let request = body(&prompt, Some(256));
    let headers = [("x-session-id", "s")];
    let d = router.route_http(request.as_bytes(), headers, NOW).unwrap();
    assert!(d.prefix_hit > 0.5, "the bench request is a partial hit ({})", d.prefix_hit);
    router.complete(&d.request_id).unwrap();

    c.bench_function("route_native/8k", |b| {
        b.iter(|| {
            let d = router.route_http(black_box(request.as_bytes()), headers, NOW).unwrap();
            router.complete(&d.request_id).unwrap();
            d
        });
    });

    // A short request (a few tokens, no cache hit): the fixed cost of a call weighs most here.
    let short = body("What is the capital of France?", Some(16));
    c.bench_function("route_native/short", |b| {
        b.iter(|| {
            let d = router.route_http(black_box(short.as_bytes()), headers, NOW).unwrap();
            router.complete(&d.request_id).unwrap();
            d
        });
    });

    let Some(lib) = load_library() else {
        println!("route_c_api: libkvroute.so not found next to the bench: run `cargo build --release -p kvroute-ffi`");
        return;
    };
    let api = CApi::new(&lib);
    let r = api.setup(&systems);
    let header = Header { name: c"x-session-id".as_ptr(), name_len: 12, value: c"s".as_ptr(), value_len: 1 };
    // SAFETY: a live router, a body of `len` bytes, one header, out-params on the stack.
    let hit = unsafe { api.route_once(r, request.as_bytes(), &header) };
    assert!((hit - d.prefix_hit).abs() < 1e-12, "the C API decides as the core ({hit} vs {})", d.prefix_hit);
    c.bench_function("route_c_api/8k", |b| {
        // SAFETY: as above.
        b.iter(|| unsafe { api.route_once(r, black_box(request.as_bytes()), &header) });
    });
    c.bench_function("route_c_api/short", |b| {
        // SAFETY: as above.
        b.iter(|| unsafe { api.route_once(r, black_box(short.as_bytes()), &header) });
    });
    // SAFETY: the router from `setup`, freed once.
    unsafe { (api.router_free)(r) };
}

/// `kvroute_header` (ffi/include/kvroute.h).
#[repr(C)]
struct Header {
    name: *const c_char,
    name_len: usize,
    value: *const c_char,
    value_len: usize,
}

/// `kvroute_metrics` (ffi/include/kvroute.h).
#[repr(C)]
#[derive(Default)]
struct Metrics {
    waiting: u32,
    running: u32,
    kv_usage: f64,
    lora_running: usize,
    lora_running_len: usize,
    lora_waiting: usize,
    lora_waiting_len: usize,
    has_max_lora: bool,
    max_lora: u32,
    has_kv_capacity_tokens: bool,
    kv_capacity_tokens: u64,
    updated_ms: u64,
}

type Router_ = c_void;
type Decision_ = c_void;

/// The C functions the bench calls.
struct CApi {
    router_new: unsafe extern "C" fn(*const c_char, usize, *mut *mut Router_) -> i32,
    router_free: unsafe extern "C" fn(*mut Router_),
    upsert_endpoint: unsafe extern "C" fn(*const Router_, *const c_char, u32) -> i32,
    update_metrics: unsafe extern "C" fn(*const Router_, *const c_char, *const Metrics) -> i32,
    route: unsafe extern "C" fn(
        *const Router_,
        *const c_char,
        usize,
        *const Header,
        usize,
        u64,
        *mut *mut Decision_,
    ) -> i32,
    request_id: unsafe extern "C" fn(*const Decision_, *mut c_char, usize, *mut usize) -> i32,
    complete: unsafe extern "C" fn(*const Router_, *const c_char) -> i32,
    prefix_hit: unsafe extern "C" fn(*const Decision_) -> f64,
    decision_free: unsafe extern "C" fn(*mut Decision_),
}

/// `libkvroute.so` of the profile directory this bench runs from (`target/release/deps/..`).
fn load_library() -> Option<libloading::Library> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("libkvroute.so");
    // SAFETY: loading libkvroute runs no initializers beyond Rust std's.
    path.exists().then(|| unsafe { libloading::Library::new(&path) }.ok()).flatten()
}

impl CApi {
    fn new(lib: &libloading::Library) -> CApi {
        // SAFETY: each symbol has the signature its header declaration states.
        unsafe {
            CApi {
                router_new: *lib.get(b"kvroute_router_new").unwrap(),
                router_free: *lib.get(b"kvroute_router_free").unwrap(),
                upsert_endpoint: *lib.get(b"kvroute_router_upsert_endpoint").unwrap(),
                update_metrics: *lib.get(b"kvroute_router_update_metrics").unwrap(),
                route: *lib.get(b"kvroute_router_route").unwrap(),
                request_id: *lib.get(b"kvroute_decision_request_id").unwrap(),
                complete: *lib.get(b"kvroute_router_complete").unwrap(),
                prefix_hit: *lib.get(b"kvroute_decision_prefix_hit").unwrap(),
                decision_free: *lib.get(b"kvroute_decision_free").unwrap(),
            }
        }
    }

    /// The router of the native setup, built through the C API.
    fn setup(&self, systems: &[String]) -> *mut Router_ {
        let mut r = std::ptr::null_mut();
        // SAFETY: valid pointers for every call; the router is live until `router_free`.
        unsafe {
            assert_eq!((self.router_new)(std::ptr::null(), 0, &mut r), 0);
            for i in 0..ENDPOINTS {
                let id =
                    std::ffi::CString::new(format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256)).unwrap();
                assert_eq!((self.upsert_endpoint)(r, id.as_ptr(), 2), 0);
                let m = Metrics {
                    waiting: (i % 4) as u32,
                    running: 8,
                    kv_usage: 0.3 + (i % 5) as f64 * 0.05,
                    updated_ms: NOW,
                    ..Default::default()
                };
                assert_eq!((self.update_metrics)(r, id.as_ptr(), &m), 0);
            }
            let mut ids = Vec::new();
            for w in 0..4 * ENDPOINTS {
                let tail = text(w as u64, PROMPT_BYTES - systems[0].len());
                let b = body(&format!("{}{}", systems[w % 16], tail), None);
                let mut d = std::ptr::null_mut();
                assert_eq!((self.route)(r, b.as_ptr().cast(), b.len(), std::ptr::null(), 0, NOW, &mut d), 0);
                let mut id = [0 as c_char; 64];
                assert_eq!((self.request_id)(d, id.as_mut_ptr(), id.len(), std::ptr::null_mut()), 0);
                ids.push(id);
                (self.decision_free)(d);
            }
            for id in &ids {
                assert_eq!((self.complete)(r, id.as_ptr()), 0);
            }
        }
        r
    }

    /// One request as a C caller makes it; returns the prefix hit.
    ///
    /// # Safety
    ///
    /// `r` is a live router.
    unsafe fn route_once(&self, r: *mut Router_, body: &[u8], header: &Header) -> f64 {
        let mut d = std::ptr::null_mut();
        let mut id = [0 as c_char; 64];
        // SAFETY: the caller's contract for `r`; the other pointers are valid locals.
        unsafe {
            assert_eq!((self.route)(r, body.as_ptr().cast(), body.len(), header, 1, NOW, &mut d), 0);
            (self.request_id)(d, id.as_mut_ptr(), id.len(), std::ptr::null_mut());
            (self.complete)(r, id.as_ptr());
            let hit = (self.prefix_hit)(d);
            (self.decision_free)(d);
            hit
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50);
    targets = route_native
}
criterion_main!(benches);

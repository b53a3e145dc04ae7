//! Stateful fuzzing of KV-event ingestion: a sequence of operations from the input (apply a
//! msgpack batch from the input or a fixture batch with a byte changed, as an endpoint with a
//! sequence number; resync a stream; re-register or remove an endpoint; route a request) on one
//! router. Invariants: no panic; decisions name known endpoints and complete; nothing stays in
//! flight; every index stays within its budget.
//!
//! Run (from core/fuzz): `RUSTC_BOOTSTRAP=1 cargo fuzz run event_apply corpus/event_apply seeds/event_apply
//! -- -dict=decode_batch.dict -max_total_time=600`
#![no_main]

mod common;

use kvroute::EndpointSpec;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

/// Endpoint ids the operations name: the fleet and one never registered.
fn endpoint(u: &mut Unstructured<'_>) -> Result<&'static str> {
    let i = u.choose_index(common::ENDPOINTS.len() + 1)?;
    Ok(common::ENDPOINTS.get(i).map_or("10.9.9.9:8000", |(id, _)| *id))
}

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let mode = u.arbitrary::<u8>()?;
    let r = common::router(mode, false);
    let mut now = 1_000u64;
    for _ in 0..64 {
        if u.is_empty() {
            break;
        }
        now += u64::from(u.arbitrary::<u16>()?);
        match u.int_in_range(0u8..=9)? {
            0..=3 => {
                let ep = endpoint(u)?;
                let seq = u.arbitrary::<Option<u8>>()?.map(u64::from);
                let len = u.int_in_range(0usize..=2048)?;
                let payload = u.bytes(len)?;
                let _ = r.apply_events(ep, payload, seq, now);
            }
            4..=6 => {
                let ep = endpoint(u)?;
                let seq = u.arbitrary::<Option<u8>>()?.map(u64::from);
                let mut batch = common::EVENT_BATCHES[u.choose_index(common::EVENT_BATCHES.len())?].to_vec();
                if u.arbitrary::<bool>()? {
                    let at = u.choose_index(batch.len())?;
                    batch[at] = u.arbitrary()?;
                }
                let _ = r.apply_events(ep, &batch, seq, now);
            }
            7 => {
                let ep = endpoint(u)?;
                let _ = r.resync_stream(ep, now);
            }
            8 => {
                let i = u.choose_index(common::ENDPOINTS.len())?;
                let (id, role) = common::ENDPOINTS[i];
                if u.arbitrary::<bool>()? {
                    let _ = r.remove_endpoint(id);
                } else {
                    let _ = r.upsert_endpoint(EndpointSpec::new(id, role));
                }
            }
            _ => {
                let n = u.int_in_range(0usize..=200)?;
                let ids: Vec<u32> = (0..n).map(|i| (i as u32 * 7 + 3) % 5000).collect();
                let body = serde_json_like(&ids);
                let d = r.route_http(body.as_bytes(), [("x-session-id", "s")], now);
                common::check(&r, d);
            }
        }
        common::check_stats(&r);
    }
    Ok(())
}

/// `{"model":"m","prompt":[ids]}` (token-id prompts reach the precise keys).
fn serde_json_like(ids: &[u32]) -> String {
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    format!(r#"{{"model": "m", "prompt": [{}]}}"#, list.join(","))
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});

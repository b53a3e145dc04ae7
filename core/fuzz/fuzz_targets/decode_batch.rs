//! Fuzz `kvroute::decode_batch` with arbitrary bytes: it must never panic, must never
//! allocate more than a small multiple of the input, and every error must point inside the input.
//!
//! Run (from core/): `RUSTC_BOOTSTRAP=1 cargo fuzz run decode_batch fuzz/corpus/decode_batch
//! ../fixtures/events -- -dict=fuzz/decode_batch.dict -max_total_time=120`
#![no_main]

use kvroute::{decode_batch, KvEvent};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match decode_batch(data) {
        Ok(batch) => {
            // Every decoded element needs at least one input byte.
            let mut elements = batch.events.len();
            for ev in &batch.events {
                if let KvEvent::BlockStored(s) = ev {
                    elements += s.block_hashes.len() + s.token_ids.len();
                } else if let KvEvent::BlockRemoved(r) = ev {
                    elements += r.block_hashes.len();
                }
            }
            assert!(elements <= data.len(), "{elements} elements from {} bytes", data.len());
            // Decoding is a pure function of the bytes (`ts` compared by bits: NaN is passed through).
            let again = decode_batch(data).expect("second decode");
            assert_eq!(
                (again.ts.to_bits(), &again.events, again.data_parallel_rank),
                (batch.ts.to_bits(), &batch.events, batch.data_parallel_rank)
            );
        }
        Err(e) => {
            assert!(e.offset() <= data.len(), "{e}");
            let _ = e.to_string();
        }
    }
});

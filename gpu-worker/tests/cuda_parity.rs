//! CUDA backend parity: the same weights and batches on the CPU backend and on the CUDA backend
//! give the same logits (to a few ulp of `expf`), the same greedy tokens and the same K/V in the
//! paged pool; a worker started with `--backend cuda` answers what a CPU worker answers.
//!
//! Runs with `--features cuda` on a machine with an NVIDIA driver, NVRTC and a device; anywhere
//! else it prints why it was skipped and passes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_matches_cpu() {
    eprintln!("SKIPPED cuda_matches_cpu: this build has no CUDA backend (run with `--features cuda`)");
}

mod common;

/// Where the backend cannot run, starting a worker with it is a typed error, not a panic.
#[test]
fn unavailable_cuda_backend_is_a_typed_error() {
    #[cfg(feature = "cuda")]
    if kvroute_worker::model::cuda::unavailable_reason().is_none() {
        return;
    }
    let cfg = kvroute_worker::WorkerConfig { backend: kvroute_worker::BackendKind::Cuda, ..common::tiny(16) };
    match kvroute_worker::spawn(cfg) {
        Err(kvroute_worker::WorkerError::Backend(e)) => {
            let expected = if cfg!(feature = "cuda") {
                matches!(
                    e,
                    kvroute_worker::BackendError::NoDriver(_)
                        | kvroute_worker::BackendError::NoNvrtc(_)
                        | kvroute_worker::BackendError::Cuda(_)
                )
            } else {
                matches!(e, kvroute_worker::BackendError::Unavailable(_))
            };
            assert!(expected, "{e:?}");
            assert!(!e.to_string().is_empty());
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
}

#[cfg(feature = "cuda")]
mod parity {
    use kvroute_worker::model::cpu::CpuBackend;
    use kvroute_worker::model::cuda::{unavailable_reason, CudaBackend};
    use kvroute_worker::model::{argmax, Backend, SeqBatch, Weights};
    use kvroute_worker::{spawn, BackendKind, ModelConfig};

    use super::common::*;

    fn skip() -> bool {
        match unavailable_reason() {
            Some(why) => {
                eprintln!("SKIPPED CUDA parity: {why}");
                true
            }
            None => false,
        }
    }

    fn close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            let tol = 1e-4 * x.abs().max(y.abs()).max(1.0);
            assert!((x - y).abs() <= tol, "{what}[{i}]: cpu {x} vs cuda {y}");
        }
    }

    fn run(b: &mut dyn Backend, batch: &[SeqBatch<'_>]) -> Vec<Option<Vec<f32>>> {
        b.forward(batch, &mut |_, _| {}).unwrap()
    }

    #[test]
    fn cuda_matches_cpu() {
        if skip() {
            return;
        }
        let cfg =
            ModelConfig { layers: 3, hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, ffn: 128, vocab: 300, seed: 3 };
        let w = Weights::new(&cfg, 256);
        let (blocks, bs) = (32, 16);
        let mut cpu = CpuBackend::new(w.clone(), blocks, bs);
        let mut gpu = CudaBackend::new(w, blocks, bs, 0).expect("a CUDA device is present: the backend must start");
        let a: Vec<u32> = (0..70).map(|i| (i * 37 + 11) % 300).collect();
        let b: Vec<u32> = (0..23).map(|i| (i * 13 + 5) % 300).collect();
        let (ta, tb) = ([3u32, 9, 1, 0, 7], [20u32, 21]);
        // Chunked prefill of `a` batched with all of `b`, then the rest of `a`, then decode steps.
        let step1 = [
            SeqBatch { tokens: &a[..40], start: 0, block_table: &ta, want_logits: false },
            SeqBatch { tokens: &b, start: 0, block_table: &tb, want_logits: true },
        ];
        let (c1, g1) = (run(&mut cpu, &step1), run(&mut gpu, &step1));
        close(c1[1].as_ref().unwrap(), g1[1].as_ref().unwrap(), "logits of b");
        assert!(g1[0].is_none());
        let step2 = [SeqBatch { tokens: &a[40..], start: 40, block_table: &ta, want_logits: true }];
        let mut ca = run(&mut cpu, &step2).remove(0).unwrap();
        let mut ga = run(&mut gpu, &step2).remove(0).unwrap();
        let mut seq = a.clone();
        for step in 0..8 {
            close(&ca, &ga, &format!("logits of a, step {step}"));
            let (tc, tg) = (argmax(&ca), argmax(&ga));
            assert_eq!(tc, tg, "greedy token at step {step}");
            seq.push(tc);
            let pos = seq.len() - 1;
            let batch = [SeqBatch { tokens: &seq[pos..], start: pos, block_table: &ta, want_logits: true }];
            ca = run(&mut cpu, &batch).remove(0).unwrap();
            ga = run(&mut gpu, &batch).remove(0).unwrap();
        }
        // The pools hold the same K/V.
        let d = cfg.kv_heads as usize * cfg.head_dim as usize;
        let n = seq.len();
        for l in 0..cfg.layers as usize {
            let (mut kc, mut vc, mut kg, mut vg) =
                (vec![0.0; n * d], vec![0.0; n * d], vec![0.0; n * d], vec![0.0; n * d]);
            cpu.kv().read(l, &ta, 0, &mut kc, &mut vc).unwrap();
            gpu.kv().read(l, &ta, 0, &mut kg, &mut vg).unwrap();
            close(&kc, &kg, &format!("K of layer {l}"));
            close(&vc, &vg, &format!("V of layer {l}"));
        }
        // write_kv round trip and bad input.
        let (mut k, mut v) = (vec![0.0; 16 * d], vec![0.0; 16 * d]);
        cpu.kv().read(0, &ta, 0, &mut k, &mut v).unwrap();
        gpu.write_kv(0, &[31], 0, &k, &v).unwrap();
        let (mut k2, mut v2) = (vec![0.0; 16 * d], vec![0.0; 16 * d]);
        gpu.kv().read(0, &[31], 0, &mut k2, &mut v2).unwrap();
        assert_eq!((k, v), (k2, v2));
        let bad = [SeqBatch { tokens: &[1, 2], start: 0, block_table: &[99], want_logits: true }];
        assert!(gpu.forward(&bad, &mut |_, _| {}).is_err(), "a block beyond the pool is an error");
    }

    #[test]
    fn cuda_worker_answers_like_a_cpu_worker() {
        if skip() {
            return;
        }
        let cpu = spawn(tiny(64)).unwrap();
        let gpu = spawn(kvroute_worker::WorkerConfig { backend: BackendKind::Cuda, ..tiny(64) }).unwrap();
        assert_eq!(gpu.backend(), "cuda");
        let p = prompt(5, 90, 300);
        let (a, b) = (complete(cpu.http_addr(), &p, 8), complete(gpu.http_addr(), &p, 8));
        assert_eq!(output_ids(&a), output_ids(&b));
        let again = complete(gpu.http_addr(), &p, 8);
        assert_eq!(cached_tokens(&again), 80);
        assert_eq!(output_ids(&again), output_ids(&a));
        cpu.shutdown();
        gpu.shutdown();
    }
}

//! The deterministic transformer-like model and its compute backends.
//!
//! Pre-norm decoder layers with real arithmetic (f32): RMSNorm, Q/K/V projections, rotary
//! embeddings (rotate-half), grouped-query causal attention over the paged KV pool, output
//! projection, SiLU MLP, residuals; the output head is tied to the embedding table and decoding
//! is greedy (argmax, lowest id on ties). All weights come from [`ModelConfig::seed`].
//!
//! Every token's arithmetic depends only on its own inputs and on the K/V of the positions before
//! it, always summed in position order, so on the CPU backend the K/V and logits are bitwise the
//! same however prompts are chunked or batched: a prompt prefilled in one worker and transferred
//! to another yields the same tokens as a colocated run.
//!
//! # Paged KV layout
//! Per layer, K and V are each `num_blocks × block_size × kv_heads × head_dim` floats: token
//! `pos` of a sequence lives in slot `block_table[pos / block_size] * block_size + pos %
//! block_size`, and one token's K (or V) of one layer is `kv_heads × head_dim` contiguous floats.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::config::ModelConfig;

/// Base of the rotary embedding frequencies.
pub const ROPE_THETA: f64 = 10_000.0;
/// RMSNorm epsilon.
pub const RMS_EPS: f32 = 1e-5;

/// A compute failure (bad internal indices, or a device error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// A block id, position or token id outside its range (a bug in the caller).
    #[error("invalid model input: {0}")]
    Invalid(String),
    /// The CUDA driver library is not installed.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// NVRTC (the CUDA runtime compiler) is not installed.
    #[error("no NVRTC: {0}")]
    NoNvrtc(String),
    /// The backend was not compiled in.
    #[error("backend not available: {0}")]
    Unavailable(String),
    /// A CUDA call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
}

/// The weights of one layer; matrices are row-major `[in][out]`.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMSNorm weight before attention, `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// `[hidden][heads × head_dim]`.
    pub wq: Vec<f32>,
    /// `[hidden][kv_heads × head_dim]`.
    pub wk: Vec<f32>,
    /// `[hidden][kv_heads × head_dim]`.
    pub wv: Vec<f32>,
    /// `[heads × head_dim][hidden]`.
    pub wo: Vec<f32>,
    /// RMSNorm weight before the MLP, `[hidden]`.
    pub mlp_norm: Vec<f32>,
    /// `[hidden][ffn]`.
    pub w1: Vec<f32>,
    /// `[ffn][hidden]`.
    pub w2: Vec<f32>,
}

/// All weights and the rotary tables.
#[derive(Debug, Clone)]
pub struct Weights {
    /// The shape.
    pub cfg: ModelConfig,
    /// Embedding table, also the output head: `[vocab][hidden]`.
    pub emb: Vec<f32>,
    /// Layers.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight, `[hidden]`.
    pub final_norm: Vec<f32>,
    /// Positions the rotary tables cover.
    pub max_positions: usize,
    /// `cos(pos · θ_i)`, `[max_positions][head_dim / 2]`.
    pub rope_cos: Vec<f32>,
    /// `sin(pos · θ_i)`, `[max_positions][head_dim / 2]`.
    pub rope_sin: Vec<f32>,
}

/// SplitMix64: the weights' generator (same stream on every platform).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn fill(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }

    fn norm(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| 1.0 + 0.1 * self.unit()).collect()
    }
}

impl Weights {
    /// Weights for `cfg` (from its seed), with rotary tables for `max_positions` positions.
    pub fn new(cfg: &ModelConfig, max_positions: usize) -> Weights {
        let h = cfg.hidden as usize;
        let (qd, kd, f) = (cfg.q_dim(), cfg.kv_dim(), cfg.ffn as usize);
        let mut g = SplitMix(cfg.seed ^ 0x006b_7672_6f75_7465);
        let scale = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        let emb = g.fill(cfg.vocab as usize * h, 1.0);
        let layers = (0..cfg.layers)
            .map(|_| LayerWeights {
                attn_norm: g.norm(h),
                wq: g.fill(h * qd, scale(h)),
                wk: g.fill(h * kd, scale(h)),
                wv: g.fill(h * kd, scale(h)),
                wo: g.fill(qd * h, 0.5 * scale(qd)),
                mlp_norm: g.norm(h),
                w1: g.fill(h * f, scale(h)),
                w2: g.fill(f * h, 0.5 * scale(f)),
            })
            .collect();
        let final_norm = g.norm(h);
        let half = cfg.head_dim as usize / 2;
        let mut rope_cos = Vec::with_capacity(max_positions * half);
        let mut rope_sin = Vec::with_capacity(max_positions * half);
        for pos in 0..max_positions {
            for i in 0..half {
                let freq = ROPE_THETA.powf(-2.0 * i as f64 / f64::from(cfg.head_dim));
                let a = pos as f64 * freq;
                rope_cos.push(a.cos() as f32);
                rope_sin.push(a.sin() as f32);
            }
        }
        Weights { cfg: cfg.clone(), emb, layers, final_norm, max_positions, rope_cos, rope_sin }
    }
}

/// One sequence's part of a forward pass: tokens at positions `start..start + tokens.len()`.
#[derive(Debug, Clone, Copy)]
pub struct SeqBatch<'a> {
    /// The tokens whose K/V are computed (a prefill chunk, or one token when decoding).
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` (the tokens before it are in the pool already).
    pub start: usize,
    /// The sequence's block table (covers at least `start + tokens.len()` positions).
    pub block_table: &'a [u32],
    /// Whether to return the logits of the last token.
    pub want_logits: bool,
}

/// Read access to the KV pool.
pub trait KvRead {
    /// Copy the K and V of positions `start..start + n` of layer `layer` of the sequence with
    /// `block_table` into `k` and `v` (`n × kv_heads × head_dim` floats each, token-major).
    fn read(
        &self,
        layer: usize,
        block_table: &[u32],
        start: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), BackendError>;
}

/// Called after layer `layer`'s K/V of the whole batch were written to the pool (before that
/// layer's attention): layer-by-layer KV streaming reads them here.
pub type LayerHook<'a> = dyn FnMut(usize, &dyn KvRead) + 'a;

/// A compute backend: owns the weights and the paged KV pool.
pub trait Backend: Send {
    /// `cpu` or `cuda`.
    fn name(&self) -> &'static str;

    /// Compute the K/V of every sequence's tokens into the pool, layer by layer; return the
    /// logits of the last token of each sequence that wants them (`None` for the others).
    fn forward(
        &mut self,
        batch: &[SeqBatch<'_>],
        on_layer: &mut LayerHook<'_>,
    ) -> Result<Vec<Option<Vec<f32>>>, BackendError>;

    /// The pool, for reading.
    fn kv(&self) -> &dyn KvRead;

    /// Write K and V of positions `start..start + n` of layer `layer` (as [`KvRead::read`]
    /// returns them) into the pool.
    fn write_kv(
        &mut self,
        layer: usize,
        block_table: &[u32],
        start: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), BackendError>;
}

/// Index of the largest logit (the lowest index among equal ones); 0 for an empty slice.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Build the backend `kind` with `num_blocks × block_size` KV slots per layer.
pub fn build_backend(
    kind: crate::config::BackendKind,
    weights: Weights,
    num_blocks: usize,
    block_size: usize,
    cuda_device: usize,
) -> Result<Box<dyn Backend>, BackendError> {
    match kind {
        crate::config::BackendKind::Cpu => Ok(Box::new(cpu::CpuBackend::new(weights, num_blocks, block_size))),
        #[cfg(feature = "cuda")]
        crate::config::BackendKind::Cuda => {
            Ok(Box::new(cuda::CudaBackend::new(weights, num_blocks, block_size, cuda_device)?))
        }
        #[cfg(not(feature = "cuda"))]
        crate::config::BackendKind::Cuda => {
            let _ = cuda_device;
            Err(BackendError::Unavailable("this build has no CUDA backend: rebuild with `--features cuda`".to_owned()))
        }
    }
}

/// Slot of position `pos` in a block table.
pub(crate) fn slot(
    block_table: &[u32],
    block_size: usize,
    num_blocks: usize,
    pos: usize,
) -> Result<usize, BackendError> {
    let b = *block_table
        .get(pos / block_size)
        .ok_or_else(|| BackendError::Invalid(format!("position {pos} is beyond the block table")))?
        as usize;
    if b >= num_blocks {
        return Err(BackendError::Invalid(format!("block {b} is beyond the pool ({num_blocks} blocks)")));
    }
    Ok(b * block_size + pos % block_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_are_deterministic_and_seeded() {
        let a = Weights::new(&ModelConfig::tiny(), 8);
        let b = Weights::new(&ModelConfig::tiny(), 8);
        assert_eq!(a.emb, b.emb);
        assert_eq!(a.layers[1].w2, b.layers[1].w2);
        let c = Weights::new(&ModelConfig { seed: 8, ..ModelConfig::tiny() }, 8);
        assert_ne!(a.emb, c.emb);
        assert!(a.emb.iter().all(|x| (-1.0..1.0).contains(x)));
        assert_eq!(a.rope_cos[0], 1.0);
    }

    #[test]
    fn argmax_prefers_the_lowest_index_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[]), 0);
    }
}

//! The CPU backend: plain Rust, f32, one thread. Matrix products run as row-times-matrix
//! `axpy` loops (the compiler vectorizes them across output columns) and dot products keep 8
//! partial sums combined in a fixed order, so results are deterministic and do not depend on how
//! a batch is composed.

use super::{slot, Backend, BackendError, KvRead, LayerHook, SeqBatch, Weights, RMS_EPS};

/// The paged KV pool in host memory.
#[derive(Debug)]
pub struct CpuKv {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    block_size: usize,
    num_blocks: usize,
    kv_dim: usize,
}

impl CpuKv {
    fn new(layers: usize, num_blocks: usize, block_size: usize, kv_dim: usize) -> Self {
        let n = num_blocks * block_size * kv_dim;
        CpuKv {
            k: (0..layers).map(|_| vec![0.0; n]).collect(),
            v: (0..layers).map(|_| vec![0.0; n]).collect(),
            block_size,
            num_blocks,
            kv_dim,
        }
    }

    fn check(&self, layer: usize, k: usize, v: usize) -> Result<usize, BackendError> {
        if layer >= self.k.len() {
            return Err(BackendError::Invalid(format!("layer {layer} out of range")));
        }
        if k != v || k % self.kv_dim != 0 {
            return Err(BackendError::Invalid(format!("K/V buffers of {k} and {v} floats")));
        }
        Ok(k / self.kv_dim)
    }
}

impl KvRead for CpuKv {
    fn read(
        &self,
        layer: usize,
        table: &[u32],
        start: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), BackendError> {
        let n = self.check(layer, k.len(), v.len())?;
        let d = self.kv_dim;
        for i in 0..n {
            let s = slot(table, self.block_size, self.num_blocks, start + i)? * d;
            k[i * d..(i + 1) * d].copy_from_slice(&self.k[layer][s..s + d]);
            v[i * d..(i + 1) * d].copy_from_slice(&self.v[layer][s..s + d]);
        }
        Ok(())
    }
}

/// Scratch buffers reused across steps.
#[derive(Debug, Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    tmp: Vec<f32>,
    mlp: Vec<f32>,
    scores: Vec<f32>,
    pos: Vec<usize>,
    seq: Vec<usize>,
}

/// The CPU backend.
#[derive(Debug)]
pub struct CpuBackend {
    w: Weights,
    kv: CpuKv,
    s: Scratch,
}

impl CpuBackend {
    /// A backend with `num_blocks × block_size` KV slots per layer.
    pub fn new(w: Weights, num_blocks: usize, block_size: usize) -> Self {
        let kv = CpuKv::new(w.cfg.layers as usize, num_blocks, block_size, w.cfg.kv_dim());
        CpuBackend { w, kv, s: Scratch::default() }
    }

    /// The weights.
    pub fn weights(&self) -> &Weights {
        &self.w
    }
}

/// Dot product with 8 partial sums combined in a fixed order.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `y[t] = x[t] · W` for every row `t` (`W` is `[inp][out]`).
fn matmul(x: &[f32], w: &[f32], inp: usize, out: usize, y: &mut Vec<f32>) {
    let rows = x.len() / inp;
    y.clear();
    y.resize(rows * out, 0.0);
    for (xr, yr) in x.chunks_exact(inp).zip(y.chunks_exact_mut(out)) {
        for (&a, wr) in xr.iter().zip(w.chunks_exact(out)) {
            for (yo, &wo) in yr.iter_mut().zip(wr) {
                *yo += a * wo;
            }
        }
    }
}

fn rmsnorm(x: &[f32], w: &[f32], y: &mut Vec<f32>) {
    let d = w.len();
    y.clear();
    y.resize(x.len(), 0.0);
    for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + RMS_EPS).sqrt();
        for ((o, &a), &g) in yr.iter_mut().zip(xr).zip(w) {
            *o = a * r * g;
        }
    }
}

/// Rotate-half rotary embedding of `heads` heads per row, row `t` at position `pos[t]`.
fn rope(x: &mut [f32], pos: &[usize], heads: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for (row, &p) in x.chunks_exact_mut(heads * head_dim).zip(pos) {
        let (c, s) = (&cos[p * half..(p + 1) * half], &sin[p * half..(p + 1) * half]);
        for head in row.chunks_exact_mut(head_dim) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x0, x1) = (a[i], b[i]);
                a[i] = x0 * c[i] - x1 * s[i];
                b[i] = x0 * s[i] + x1 * c[i];
            }
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn forward(
        &mut self,
        batch: &[SeqBatch<'_>],
        on_layer: &mut LayerHook<'_>,
    ) -> Result<Vec<Option<Vec<f32>>>, BackendError> {
        let CpuBackend { w, kv, s } = self;
        let cfg = &w.cfg;
        let (hid, qd, kd, ffn) = (cfg.hidden as usize, cfg.q_dim(), cfg.kv_dim(), cfg.ffn as usize);
        let (nh, nkv, hd) = (cfg.heads as usize, cfg.kv_heads as usize, cfg.head_dim as usize);
        let group = nh / nkv;
        let bs = kv.block_size;
        let scale = 1.0 / (hd as f32).sqrt();

        // Flatten the batch: per token its sequence and position; embeddings.
        s.pos.clear();
        s.seq.clear();
        s.x.clear();
        for (i, sb) in batch.iter().enumerate() {
            let end = sb.start + sb.tokens.len();
            if end > w.max_positions || end > sb.block_table.len() * bs {
                return Err(BackendError::Invalid(format!("positions up to {end} exceed the tables")));
            }
            for (j, &tok) in sb.tokens.iter().enumerate() {
                let row = w
                    .emb
                    .get(tok as usize * hid..(tok as usize + 1) * hid)
                    .ok_or_else(|| BackendError::Invalid(format!("token id {tok} is beyond the vocabulary")))?;
                s.x.extend_from_slice(row);
                s.pos.push(sb.start + j);
                s.seq.push(i);
            }
        }
        let total = s.pos.len();
        // Slots of every token (validated once).
        let mut slots = Vec::with_capacity(total);
        for t in 0..total {
            slots.push(slot(batch[s.seq[t]].block_table, bs, kv.num_blocks, s.pos[t])?);
        }

        for (l, lw) in w.layers.iter().enumerate() {
            rmsnorm(&s.x, &lw.attn_norm, &mut s.h);
            matmul(&s.h, &lw.wq, hid, qd, &mut s.q);
            matmul(&s.h, &lw.wk, hid, kd, &mut s.k);
            matmul(&s.h, &lw.wv, hid, kd, &mut s.v);
            rope(&mut s.q, &s.pos, nh, hd, &w.rope_cos, &w.rope_sin);
            rope(&mut s.k, &s.pos, nkv, hd, &w.rope_cos, &w.rope_sin);
            let (kc, vc) = (&mut kv.k[l], &mut kv.v[l]);
            for (t, &sl) in slots.iter().enumerate() {
                kc[sl * kd..(sl + 1) * kd].copy_from_slice(&s.k[t * kd..(t + 1) * kd]);
                vc[sl * kd..(sl + 1) * kd].copy_from_slice(&s.v[t * kd..(t + 1) * kd]);
            }
            on_layer(l, &*kv);
            let (kc, vc) = (&kv.k[l], &kv.v[l]);

            // Causal attention over the pool.
            s.att.clear();
            s.att.resize(total * qd, 0.0);
            for t in 0..total {
                let table = batch[s.seq[t]].block_table;
                let p = s.pos[t];
                for head in 0..nh {
                    let g = head / group;
                    let qv = &s.q[t * qd + head * hd..t * qd + (head + 1) * hd];
                    s.scores.clear();
                    let mut m = f32::NEG_INFINITY;
                    for j in 0..=p {
                        // Validated above: every position up to p has a block.
                        let b = table[j / bs] as usize;
                        let base = (b * bs + j % bs) * kd + g * hd;
                        let sc = dot(qv, &kc[base..base + hd]) * scale;
                        m = m.max(sc);
                        s.scores.push(sc);
                    }
                    let mut sum = 0.0f32;
                    for sc in s.scores.iter_mut() {
                        *sc = (*sc - m).exp();
                        sum += *sc;
                    }
                    let out = &mut s.att[t * qd + head * hd..t * qd + (head + 1) * hd];
                    for (j, &e) in s.scores.iter().enumerate() {
                        let b = table[j / bs] as usize;
                        let base = (b * bs + j % bs) * kd + g * hd;
                        for (o, &vv) in out.iter_mut().zip(&vc[base..base + hd]) {
                            *o += e * vv;
                        }
                    }
                    let inv = 1.0 / sum;
                    for o in out.iter_mut() {
                        *o *= inv;
                    }
                }
            }
            matmul(&s.att, &lw.wo, qd, hid, &mut s.tmp);
            for (x, &d) in s.x.iter_mut().zip(&s.tmp) {
                *x += d;
            }
            rmsnorm(&s.x, &lw.mlp_norm, &mut s.h);
            matmul(&s.h, &lw.w1, hid, ffn, &mut s.mlp);
            for a in s.mlp.iter_mut() {
                *a /= 1.0 + (-*a).exp();
            }
            matmul(&s.mlp, &lw.w2, ffn, hid, &mut s.tmp);
            for (x, &d) in s.x.iter_mut().zip(&s.tmp) {
                *x += d;
            }
        }

        // Logits of the last token of each sequence that wants them.
        let mut out = Vec::with_capacity(batch.len());
        let mut row_end = 0usize;
        for sb in batch {
            row_end += sb.tokens.len();
            if !sb.want_logits || sb.tokens.is_empty() {
                out.push(None);
                continue;
            }
            let row = &s.x[(row_end - 1) * hid..row_end * hid];
            rmsnorm(row, &w.final_norm, &mut s.h);
            let logits: Vec<f32> = w.emb.chunks_exact(hid).map(|e| dot(&s.h, e)).collect();
            out.push(Some(logits));
        }
        Ok(out)
    }

    fn kv(&self) -> &dyn KvRead {
        &self.kv
    }

    fn write_kv(
        &mut self,
        layer: usize,
        table: &[u32],
        start: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), BackendError> {
        let n = self.kv.check(layer, k.len(), v.len())?;
        let d = self.kv.kv_dim;
        for i in 0..n {
            let s = slot(table, self.kv.block_size, self.kv.num_blocks, start + i)? * d;
            self.kv.k[layer][s..s + d].copy_from_slice(&k[i * d..(i + 1) * d]);
            self.kv.v[layer][s..s + d].copy_from_slice(&v[i * d..(i + 1) * d]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::model::argmax;

    fn backend(blocks: usize) -> CpuBackend {
        CpuBackend::new(Weights::new(&ModelConfig::tiny(), 256), blocks, 4)
    }

    fn run(b: &mut CpuBackend, tokens: &[u32], start: usize, table: &[u32]) -> Vec<f32> {
        let sb = SeqBatch { tokens, start, block_table: table, want_logits: true };
        b.forward(&[sb], &mut |_, _| {}).unwrap().pop().unwrap().unwrap()
    }

    fn read_all(b: &CpuBackend, table: &[u32], n: usize) -> Vec<Vec<f32>> {
        let d = b.w.cfg.kv_dim();
        (0..b.w.cfg.layers as usize)
            .map(|l| {
                let (mut k, mut v) = (vec![0.0; n * d], vec![0.0; n * d]);
                b.kv().read(l, table, 0, &mut k, &mut v).unwrap();
                k.extend(v);
                k
            })
            .collect()
    }

    #[test]
    fn chunked_prefill_is_bitwise_identical_to_one_pass() {
        let prompt: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % 300).collect();
        let mut a = backend(16);
        let table_a = [3u32, 9, 1, 0, 7, 2];
        let whole = run(&mut a, &prompt, 0, &table_a);
        let mut b = backend(16);
        let table_b = [5u32, 4, 11, 12, 13, 14];
        run(&mut b, &prompt[..7], 0, &table_b);
        run(&mut b, &prompt[7..16], 7, &table_b);
        let chunked = run(&mut b, &prompt[16..], 16, &table_b);
        assert_eq!(whole, chunked);
        assert_eq!(read_all(&a, &table_a, 23), read_all(&b, &table_b, 23));
        // Batched with another sequence: still identical.
        let mut c = backend(16);
        let other: Vec<u32> = (0..9).collect();
        let table_c = [0u32, 1, 2, 3, 4, 5];
        let table_o = [8u32, 9, 10];
        let batch = [
            SeqBatch { tokens: &other, start: 0, block_table: &table_o, want_logits: true },
            SeqBatch { tokens: &prompt, start: 0, block_table: &table_c, want_logits: true },
        ];
        let out = c.forward(&batch, &mut |_, _| {}).unwrap();
        assert_eq!(out[1].as_deref(), Some(&whole[..]));
        assert!(argmax(&whole) < 300);
    }

    #[test]
    fn transferred_kv_continues_identically() {
        let prompt: Vec<u32> = (0..12).map(|i| (i * 11) % 300).collect();
        let mut a = backend(8);
        let ta = [0u32, 1, 2, 3];
        run(&mut a, &prompt[..8], 0, &ta);
        // Copy the first 8 positions into another pool with other block ids, compute the rest there.
        let mut b = backend(8);
        let tb = [6u32, 2, 5, 4];
        let d = a.w.cfg.kv_dim();
        for l in 0..2 {
            let (mut k, mut v) = (vec![0.0; 8 * d], vec![0.0; 8 * d]);
            a.kv().read(l, &ta, 0, &mut k, &mut v).unwrap();
            b.write_kv(l, &tb, 0, &k, &v).unwrap();
        }
        let la = run(&mut a, &prompt[8..], 8, &ta);
        let lb = run(&mut b, &prompt[8..], 8, &tb);
        assert_eq!(la, lb);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut b = backend(2);
        let sb = SeqBatch { tokens: &[1, 2], start: 0, block_table: &[5], want_logits: false };
        assert!(b.forward(&[sb], &mut |_, _| {}).is_err(), "block beyond pool");
        let sb = SeqBatch { tokens: &[1, 2, 3, 4, 5], start: 0, block_table: &[0], want_logits: false };
        assert!(b.forward(&[sb], &mut |_, _| {}).is_err(), "table too short");
        let sb = SeqBatch { tokens: &[1000], start: 0, block_table: &[0], want_logits: false };
        assert!(b.forward(&[sb], &mut |_, _| {}).is_err(), "token beyond vocab");
    }
}

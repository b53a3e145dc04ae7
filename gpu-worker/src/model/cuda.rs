//! The CUDA backend (cargo feature `cuda`): the same model as [`super::cpu`], computed by
//! kernels compiled at start-up with NVRTC and launched through the CUDA driver API
//! ([`cudarc`], loaded at run time: the build needs no CUDA installation, the backend needs
//! `libcuda` and `libnvrtc` only when it starts).
//!
//! The kernels mirror the CPU arithmetic step by step: the same RMSNorm, matrix products summed
//! in input order, rotate-half rotary embedding, causal attention over the paged pool with the
//! CPU's max-then-exp softmax and 8-way partial dot products, SiLU MLP and tied output head.
//! They are compiled without fused multiply-add contraction (`--fmad=false`) and with IEEE
//! division and square roots, so the results differ from the CPU backend's only by the device's
//! `expf` (a few ulp); the parity test (`tests/cuda_parity.rs`) bounds the difference.
//!
//! The paged KV pool lives in device memory with the CPU layout (per layer, K and V each
//! `num_blocks × block_size × kv_heads × head_dim` floats).
// Launching a kernel and probing for the driver library are foreign calls that cudarc marks
// `unsafe`: the kernels' arguments are checked here (lengths and indices validated on the host
// before every launch), which is what makes those calls sound.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use super::{slot, Backend, BackendError, KvRead, LayerHook, SeqBatch, Weights, RMS_EPS};

/// The kernels (CUDA C, compiled by NVRTC when the backend starts).
const KERNELS: &str = r#"
__device__ float dot8(const float* a, const float* b, int n) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int full = n - n % 8;
    for (int i = 0; i < full; i += 8) {
        for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
    }
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (int i = full; i < n; ++i) s += a[i] * b[i];
    return s;
}

extern "C" __global__ void rmsnorm(const float* x, const float* w, float* y, int rows, int d, float eps) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * d;
    float ms = 0.f;
    for (int i = 0; i < d; ++i) ms += xr[i] * xr[i];
    ms = ms / (float)d;
    float inv = 1.0f / sqrtf(ms + eps);
    for (int i = 0; i < d; ++i) y[(size_t)r * d + i] = xr[i] * inv * w[i];
}

extern "C" __global__ void matmul(const float* x, const float* w, float* y, int rows, int inp, int out) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * out) return;
    int t = idx / out, o = idx % out;
    const float* xr = x + (size_t)t * inp;
    float acc = 0.f;
    for (int i = 0; i < inp; ++i) acc += xr[i] * w[(size_t)i * out + o];
    y[idx] = acc;
}

extern "C" __global__ void rope(float* x, const int* pos, int rows, int heads, int hd,
                                const float* cosv, const float* sinv) {
    int half = hd / 2;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * heads * half) return;
    int i = idx % half, h = (idx / half) % heads, t = idx / (half * heads);
    float* head = x + ((size_t)t * heads + h) * hd;
    int p = pos[t];
    float c = cosv[(size_t)p * half + i], s = sinv[(size_t)p * half + i];
    float x0 = head[i], x1 = head[i + half];
    head[i] = x0 * c - x1 * s;
    head[i + half] = x0 * s + x1 * c;
}

extern "C" __global__ void kv_write(const float* k, const float* v, float* kc, float* vc,
                                    const int* slots, int rows, int kd) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * kd) return;
    int t = idx / kd, j = idx % kd;
    size_t dst = (size_t)slots[t] * kd + j;
    kc[dst] = k[idx];
    vc[dst] = v[idx];
}

extern "C" __global__ void attention(const float* q, const float* kc, const float* vc, float* out,
                                     const int* pos, const int* toff, const unsigned* tables,
                                     int rows, int nh, int group, int hd, int kd, int bs, float scale) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * nh) return;
    int t = idx / nh, head = idx % nh, g = head / group;
    int p = pos[t];
    const unsigned* table = tables + toff[t];
    const float* qv = q + (size_t)t * nh * hd + (size_t)head * hd;
    float m = -INFINITY;
    for (int j = 0; j <= p; ++j) {
        size_t base = ((size_t)table[j / bs] * bs + j % bs) * kd + (size_t)g * hd;
        m = fmaxf(m, dot8(qv, kc + base, hd) * scale);
    }
    float* o = out + (size_t)t * nh * hd + (size_t)head * hd;
    for (int d = 0; d < hd; ++d) o[d] = 0.f;
    float sum = 0.f;
    for (int j = 0; j <= p; ++j) {
        size_t base = ((size_t)table[j / bs] * bs + j % bs) * kd + (size_t)g * hd;
        float e = expf(dot8(qv, kc + base, hd) * scale - m);
        sum += e;
        for (int d = 0; d < hd; ++d) o[d] += e * vc[base + d];
    }
    float inv = 1.0f / sum;
    for (int d = 0; d < hd; ++d) o[d] *= inv;
}

extern "C" __global__ void add_into(float* x, const float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

extern "C" __global__ void silu(float* a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] = a[i] / (1.0f + expf(-a[i]));
}

extern "C" __global__ void logits(const float* h, const float* emb, float* out, int rows, int vocab, int hid) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * vocab) return;
    int r = idx / vocab, v = idx % vocab;
    out[idx] = dot8(h + (size_t)r * hid, emb + (size_t)v * hid, hid);
}
"#;

fn cuda_err(e: impl std::fmt::Display) -> BackendError {
    BackendError::Cuda(e.to_string())
}

/// `n` as a kernel's `int`.
fn int(n: usize) -> Result<i32, BackendError> {
    i32::try_from(n).map_err(|_| BackendError::Invalid(format!("{n} exceeds the kernels' 32-bit indices")))
}

fn grid(n: usize) -> Result<LaunchConfig, BackendError> {
    Ok(LaunchConfig::for_num_elems(u32::try_from(n).map_err(|_| BackendError::Invalid(format!("{n} threads")))?))
}

/// Device copies of one layer's weights.
struct DevLayer {
    attn_norm: CudaSlice<f32>,
    wq: CudaSlice<f32>,
    wk: CudaSlice<f32>,
    wv: CudaSlice<f32>,
    wo: CudaSlice<f32>,
    mlp_norm: CudaSlice<f32>,
    w1: CudaSlice<f32>,
    w2: CudaSlice<f32>,
}

/// The kernels, loaded.
struct Kernels {
    rmsnorm: CudaFunction,
    matmul: CudaFunction,
    rope: CudaFunction,
    kv_write: CudaFunction,
    attention: CudaFunction,
    add_into: CudaFunction,
    silu: CudaFunction,
    logits: CudaFunction,
}

/// The paged KV pool in device memory.
pub struct CudaKv {
    stream: Arc<CudaStream>,
    k: Vec<CudaSlice<f32>>,
    v: Vec<CudaSlice<f32>>,
    block_size: usize,
    num_blocks: usize,
    kv_dim: usize,
}

impl std::fmt::Debug for CudaKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKv")
            .field("layers", &self.k.len())
            .field("num_blocks", &self.num_blocks)
            .field("block_size", &self.block_size)
            .finish_non_exhaustive()
    }
}

impl CudaKv {
    fn check(&self, layer: usize, k: usize, v: usize) -> Result<usize, BackendError> {
        if layer >= self.k.len() {
            return Err(BackendError::Invalid(format!("layer {layer} out of range")));
        }
        if k != v || k % self.kv_dim != 0 {
            return Err(BackendError::Invalid(format!("K/V buffers of {k} and {v} floats")));
        }
        Ok(k / self.kv_dim)
    }

    /// Runs of consecutive positions `start..start + n` that share a block: `(slot, first index, len)`.
    fn runs(&self, table: &[u32], start: usize, n: usize) -> Result<Vec<(usize, usize, usize)>, BackendError> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < n {
            let pos = start + i;
            let len = (self.block_size - pos % self.block_size).min(n - i);
            out.push((slot(table, self.block_size, self.num_blocks, pos)?, i, len));
            i += len;
        }
        Ok(out)
    }
}

impl KvRead for CudaKv {
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
        for (s, i, len) in self.runs(table, start, n)? {
            let src = s * d..(s + len) * d;
            self.stream
                .memcpy_dtoh(&self.k[layer].slice(src.clone()), &mut k[i * d..(i + len) * d])
                .map_err(cuda_err)?;
            self.stream.memcpy_dtoh(&self.v[layer].slice(src), &mut v[i * d..(i + len) * d]).map_err(cuda_err)?;
        }
        Ok(())
    }
}

/// The CUDA backend.
pub struct CudaBackend {
    cfg: crate::config::ModelConfig,
    max_positions: usize,
    emb_host: Vec<f32>,
    stream: Arc<CudaStream>,
    f: Kernels,
    emb: CudaSlice<f32>,
    final_norm: CudaSlice<f32>,
    rope_cos: CudaSlice<f32>,
    rope_sin: CudaSlice<f32>,
    layers: Vec<DevLayer>,
    kv: CudaKv,
    device_name: String,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("device", &self.device_name).field("kv", &self.kv).finish_non_exhaustive()
    }
}

/// Whether the CUDA driver library (`libcuda`) can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: loads the driver library by name to see whether it exists (cudarc's own probe);
    // nothing from it is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC (`libnvrtc`) can be loaded on this machine.
pub fn nvrtc_present() -> bool {
    // SAFETY: as in `driver_present`.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Why the CUDA backend cannot run on this machine (no driver, no NVRTC, no device), or `None`
/// when it can be tried. Never panics.
pub fn unavailable_reason() -> Option<String> {
    if !driver_present() {
        return Some("libcuda could not be loaded (no NVIDIA driver on this machine)".into());
    }
    if !nvrtc_present() {
        return Some("libnvrtc could not be loaded (install the CUDA NVRTC runtime)".into());
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => None,
        Ok(_) => Some("the CUDA driver reports no device".into()),
        Err(e) => Some(format!("the CUDA driver cannot list devices: {e}")),
    }
}

impl CudaBackend {
    /// Start the backend on device `ordinal`: compile the kernels, upload the weights, allocate
    /// the pool. Errors (never panics) when the driver, NVRTC or a device is missing.
    pub fn new(w: Weights, num_blocks: usize, block_size: usize, ordinal: usize) -> Result<Self, BackendError> {
        // cudarc panics when a library it needs cannot be loaded: probe first.
        if !driver_present() {
            return Err(BackendError::NoDriver(
                "libcuda could not be loaded (no NVIDIA driver on this machine)".into(),
            ));
        }
        if !nvrtc_present() {
            return Err(BackendError::NoNvrtc("libnvrtc could not be loaded (install the CUDA NVRTC runtime)".into()));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| BackendError::Cuda(format!("device {ordinal}: {e}")))?;
        let device_name = ctx.name().unwrap_or_else(|_| format!("device {ordinal}"));
        let stream = ctx.default_stream();
        let opts = CompileOptions {
            fmad: Some(false),
            prec_div: Some(true),
            prec_sqrt: Some(true),
            ftz: Some(false),
            ..CompileOptions::default()
        };
        let ptx = compile_ptx_with_opts(KERNELS, opts).map_err(|e| BackendError::Cuda(format!("NVRTC: {e}")))?;
        let module = ctx.load_module(ptx).map_err(cuda_err)?;
        let load = |name: &str| module.load_function(name).map_err(cuda_err);
        let f = Kernels {
            rmsnorm: load("rmsnorm")?,
            matmul: load("matmul")?,
            rope: load("rope")?,
            kv_write: load("kv_write")?,
            attention: load("attention")?,
            add_into: load("add_into")?,
            silu: load("silu")?,
            logits: load("logits")?,
        };
        let up = |v: &[f32]| stream.clone_htod(v).map_err(cuda_err);
        let layers = w
            .layers
            .iter()
            .map(|l| {
                Ok(DevLayer {
                    attn_norm: up(&l.attn_norm)?,
                    wq: up(&l.wq)?,
                    wk: up(&l.wk)?,
                    wv: up(&l.wv)?,
                    wo: up(&l.wo)?,
                    mlp_norm: up(&l.mlp_norm)?,
                    w1: up(&l.w1)?,
                    w2: up(&l.w2)?,
                })
            })
            .collect::<Result<Vec<_>, BackendError>>()?;
        let kv_dim = w.cfg.kv_dim();
        let n = num_blocks * block_size * kv_dim;
        let mut k = Vec::with_capacity(layers.len());
        let mut v = Vec::with_capacity(layers.len());
        for _ in 0..layers.len() {
            k.push(stream.alloc_zeros::<f32>(n).map_err(cuda_err)?);
            v.push(stream.alloc_zeros::<f32>(n).map_err(cuda_err)?);
        }
        Ok(CudaBackend {
            emb: up(&w.emb)?,
            final_norm: up(&w.final_norm)?,
            rope_cos: up(&w.rope_cos)?,
            rope_sin: up(&w.rope_sin)?,
            layers,
            kv: CudaKv { stream: stream.clone(), k, v, block_size, num_blocks, kv_dim },
            f,
            cfg: w.cfg,
            max_positions: w.max_positions,
            emb_host: w.emb,
            stream,
            device_name,
        })
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        d: usize,
    ) -> Result<(), BackendError> {
        let (r, di) = (int(rows)?, int(d)?);
        let mut b = self.stream.launch_builder(&self.f.rmsnorm);
        b.arg(x).arg(w).arg(y).arg(&r).arg(&di).arg(&RMS_EPS);
        // SAFETY: x and y hold rows × d floats, w holds d (checked by the callers' allocation).
        unsafe { b.launch(grid(rows)?) }.map(drop).map_err(cuda_err)
    }

    fn matmul(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        inp: usize,
        out: usize,
    ) -> Result<CudaSlice<f32>, BackendError> {
        let mut y = self.stream.alloc_zeros::<f32>(rows * out).map_err(cuda_err)?;
        let (r, i, o) = (int(rows)?, int(inp)?, int(out)?);
        let mut b = self.stream.launch_builder(&self.f.matmul);
        b.arg(x).arg(w).arg(&mut y).arg(&r).arg(&i).arg(&o);
        // SAFETY: x is rows × inp, w is inp × out, y was just allocated with rows × out floats.
        unsafe { b.launch(grid(rows * out)?) }.map_err(cuda_err)?;
        Ok(y)
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        pos: &CudaSlice<i32>,
        rows: usize,
        heads: usize,
    ) -> Result<(), BackendError> {
        let hd = self.cfg.head_dim as usize;
        let (r, h, d) = (int(rows)?, int(heads)?, int(hd)?);
        let mut b = self.stream.launch_builder(&self.f.rope);
        b.arg(x).arg(pos).arg(&r).arg(&h).arg(&d).arg(&self.rope_cos).arg(&self.rope_sin);
        // SAFETY: x is rows × heads × head_dim; every position was checked below max_positions.
        unsafe { b.launch(grid(rows * heads * (hd / 2))?) }.map(drop).map_err(cuda_err)
    }

    fn add_into(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<(), BackendError> {
        let n = x.len().min(y.len());
        let ni = int(n)?;
        let mut b = self.stream.launch_builder(&self.f.add_into);
        b.arg(x).arg(y).arg(&ni);
        // SAFETY: both hold at least n floats.
        unsafe { b.launch(grid(n)?) }.map(drop).map_err(cuda_err)
    }

    fn kv_write(
        &mut self,
        layer: usize,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &CudaSlice<i32>,
        rows: usize,
    ) -> Result<(), BackendError> {
        let kd = self.kv.kv_dim;
        let (r, d) = (int(rows)?, int(kd)?);
        let CudaKv { stream, k: kc, v: vc, .. } = &mut self.kv;
        let mut b = stream.launch_builder(&self.f.kv_write);
        b.arg(k).arg(v).arg(&mut kc[layer]).arg(&mut vc[layer]).arg(slots).arg(&r).arg(&d);
        // SAFETY: every slot was validated against the pool (`slot`) on the host.
        unsafe { b.launch(grid(rows * kd)?) }.map(drop).map_err(cuda_err)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn forward(
        &mut self,
        batch: &[SeqBatch<'_>],
        on_layer: &mut LayerHook<'_>,
    ) -> Result<Vec<Option<Vec<f32>>>, BackendError> {
        let cfg = self.cfg.clone();
        let (hid, qd, kd, ffn) = (cfg.hidden as usize, cfg.q_dim(), cfg.kv_dim(), cfg.ffn as usize);
        let (nh, nkv, hd) = (cfg.heads as usize, cfg.kv_heads as usize, cfg.head_dim as usize);
        let bs = self.kv.block_size;

        // Host side: embeddings, positions, slots, block tables (all validated here).
        let mut x = Vec::new();
        let (mut pos, mut slots, mut toff, mut tables) = (Vec::new(), Vec::new(), Vec::new(), Vec::<u32>::new());
        for sb in batch {
            let end = sb.start + sb.tokens.len();
            if end > self.max_positions || end > sb.block_table.len() * bs {
                return Err(BackendError::Invalid(format!("positions up to {end} exceed the tables")));
            }
            let off = int(tables.len())?;
            for (j, &tok) in sb.tokens.iter().enumerate() {
                let row = self
                    .emb_host
                    .get(tok as usize * hid..(tok as usize + 1) * hid)
                    .ok_or_else(|| BackendError::Invalid(format!("token id {tok} is beyond the vocabulary")))?;
                x.extend_from_slice(row);
                let p = sb.start + j;
                pos.push(int(p)?);
                slots.push(int(slot(sb.block_table, bs, self.kv.num_blocks, p)?)?);
                toff.push(off);
            }
            // Attention reads positions 0..end: their blocks must be in the pool too.
            for j in (0..end).step_by(bs) {
                slot(sb.block_table, bs, self.kv.num_blocks, j)?;
            }
            tables.extend_from_slice(&sb.block_table[..end.div_ceil(bs)]);
        }
        let rows = pos.len();
        if rows == 0 {
            return Ok(batch.iter().map(|_| None).collect());
        }
        let s = self.stream.clone();
        let up_i = |v: &[i32]| s.clone_htod(v).map_err(cuda_err);
        let mut dx = s.clone_htod(&x).map_err(cuda_err)?;
        let dpos = up_i(&pos)?;
        let dslots = up_i(&slots)?;
        let dtoff = up_i(&toff)?;
        let dtables = s.clone_htod(&tables).map_err(cuda_err)?;
        let mut h = s.alloc_zeros::<f32>(rows * hid).map_err(cuda_err)?;
        let mut att = s.alloc_zeros::<f32>(rows * qd).map_err(cuda_err)?;
        let scale = 1.0 / (hd as f32).sqrt();

        for l in 0..self.layers.len() {
            let lw = &self.layers[l];
            self.rmsnorm(&dx, &lw.attn_norm, &mut h, rows, hid)?;
            let mut q = self.matmul(&h, &lw.wq, rows, hid, qd)?;
            let mut k = self.matmul(&h, &lw.wk, rows, hid, kd)?;
            let v = self.matmul(&h, &lw.wv, rows, hid, kd)?;
            self.rope(&mut q, &dpos, rows, nh)?;
            self.rope(&mut k, &dpos, rows, nkv)?;
            self.kv_write(l, &k, &v, &dslots, rows)?;
            on_layer(l, &self.kv);

            let (r, nhi, grp, hdi, kdi, bsi) = (int(rows)?, int(nh)?, int(nh / nkv)?, int(hd)?, int(kd)?, int(bs)?);
            {
                let mut b = s.launch_builder(&self.f.attention);
                b.arg(&q)
                    .arg(&self.kv.k[l])
                    .arg(&self.kv.v[l])
                    .arg(&mut att)
                    .arg(&dpos)
                    .arg(&dtoff)
                    .arg(&dtables)
                    .arg(&r)
                    .arg(&nhi)
                    .arg(&grp)
                    .arg(&hdi)
                    .arg(&kdi)
                    .arg(&bsi)
                    .arg(&scale);
                // SAFETY: q and att are rows × heads × head_dim; every position's block was
                // validated against the pool above.
                unsafe { b.launch(grid(rows * nh)?) }.map_err(cuda_err)?;
            }
            let lw = &self.layers[l];
            let o = self.matmul(&att, &lw.wo, rows, qd, hid)?;
            self.add_into(&mut dx, &o)?;
            self.rmsnorm(&dx, &lw.mlp_norm, &mut h, rows, hid)?;
            let mut mlp = self.matmul(&h, &lw.w1, rows, hid, ffn)?;
            {
                let n = int(rows * ffn)?;
                let mut b = s.launch_builder(&self.f.silu);
                b.arg(&mut mlp).arg(&n);
                // SAFETY: mlp holds rows × ffn floats.
                unsafe { b.launch(grid(rows * ffn)?) }.map_err(cuda_err)?;
            }
            let o = self.matmul(&mlp, &lw.w2, rows, ffn, hid)?;
            self.add_into(&mut dx, &o)?;
        }

        // Logits of the last token of each sequence that wants them.
        let x_host = s.clone_dtoh(&dx).map_err(cuda_err)?;
        let vocab = cfg.vocab as usize;
        let mut out = Vec::with_capacity(batch.len());
        let mut row_end = 0usize;
        for sb in batch {
            row_end += sb.tokens.len();
            if !sb.want_logits || sb.tokens.is_empty() {
                out.push(None);
                continue;
            }
            let row = s.clone_htod(&x_host[(row_end - 1) * hid..row_end * hid]).map_err(cuda_err)?;
            let mut hn = s.alloc_zeros::<f32>(hid).map_err(cuda_err)?;
            self.rmsnorm(&row, &self.final_norm, &mut hn, 1, hid)?;
            let mut lg = s.alloc_zeros::<f32>(vocab).map_err(cuda_err)?;
            let (one, vi, hi) = (1i32, int(vocab)?, int(hid)?);
            let mut b = s.launch_builder(&self.f.logits);
            b.arg(&hn).arg(&self.emb).arg(&mut lg).arg(&one).arg(&vi).arg(&hi);
            // SAFETY: hn holds hid floats, emb vocab × hid, lg vocab.
            unsafe { b.launch(grid(vocab)?) }.map_err(cuda_err)?;
            out.push(Some(s.clone_dtoh(&lg).map_err(cuda_err)?));
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
        let mut slots = Vec::with_capacity(n);
        for i in 0..n {
            slots.push(int(slot(table, self.kv.block_size, self.kv.num_blocks, start + i)?)?);
        }
        if n == 0 {
            return Ok(());
        }
        let dk = self.stream.clone_htod(k).map_err(cuda_err)?;
        let dv = self.stream.clone_htod(v).map_err(cuda_err)?;
        let ds = self.stream.clone_htod(&slots).map_err(cuda_err)?;
        self.kv_write(layer, &dk, &dv, &ds, n)
    }
}

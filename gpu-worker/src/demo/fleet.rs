//! Starting and stopping the demo's in-process workers.

use std::time::Duration;

use super::runner::WorkerAddrs;
use crate::{ModelConfig, WorkerConfig, WorkerHandle};

/// What every worker of the fleet looks like.
#[derive(Debug, Clone)]
pub(crate) struct FleetOptions {
    pub(crate) workers: u32,
    pub(crate) block_size: u32,
    pub(crate) kv_blocks: u32,
    pub(crate) max_model_len: usize,
    pub(crate) model: ModelConfig,
}

/// The model of a run: the tiny test model for `--quick`, the default model otherwise.
pub(crate) fn model(quick: bool) -> ModelConfig {
    if quick {
        ModelConfig::tiny()
    } else {
        ModelConfig::default()
    }
}

/// A running fleet.
pub(crate) struct Fleet {
    handles: Vec<WorkerHandle>,
    addrs: Vec<WorkerAddrs>,
    model_name: String,
    vocab: u32,
}

fn config(o: &FleetOptions) -> WorkerConfig {
    WorkerConfig {
        block_size: o.block_size,
        num_blocks: o.kv_blocks,
        max_model_len: o.max_model_len,
        model: o.model.clone(),
        ..WorkerConfig::ephemeral()
    }
}

/// One line describing the workers.
pub(crate) fn describe(o: &FleetOptions) -> String {
    let m = &o.model;
    format!(
        "CPU backend, model {} layers x hidden {} ({} heads, {} KV heads of {}), vocab {}; KV pool {} blocks x {} tokens \
         = {} tokens per worker",
        m.layers,
        m.hidden,
        m.heads,
        m.kv_heads,
        m.head_dim,
        m.vocab,
        o.kv_blocks,
        o.block_size,
        u64::from(o.kv_blocks) * u64::from(o.block_size)
    )
}

impl Fleet {
    /// Start `o.workers` workers (role both) on loopback with ephemeral ports.
    pub(crate) fn start(o: &FleetOptions) -> anyhow::Result<Fleet> {
        let mut handles = Vec::new();
        let mut addrs = Vec::new();
        for _ in 0..o.workers {
            let h = crate::spawn(config(o))?;
            let events = h.events_endpoint().ok_or_else(|| anyhow::anyhow!("the worker publishes no KV events"))?;
            addrs.push(WorkerAddrs {
                http: h.http_addr(),
                events: events.to_owned(),
                replay: h.replay_endpoint().map(str::to_owned),
            });
            handles.push(h);
        }
        let c = config(o);
        Ok(Fleet { handles, addrs, model_name: c.model_name, vocab: c.model.vocab })
    }

    pub(crate) fn addrs(&self) -> &[WorkerAddrs] {
        &self.addrs
    }

    pub(crate) fn model_name(&self) -> &str {
        &self.model_name
    }

    pub(crate) fn vocab_size(&self) -> u32 {
        self.vocab
    }

    /// Wait until every worker's KV-event socket has a subscriber (no early event lost to
    /// ZMQ's slow joiner); `false` on timeout.
    pub(crate) fn wait_subscribed(&self, timeout: Duration) -> bool {
        self.handles.iter().all(|h| h.wait_for_event_subscribers(1, timeout))
    }

    /// Stop every worker and wait for them.
    pub(crate) fn stop(self) {
        for h in self.handles {
            h.shutdown();
        }
    }
}

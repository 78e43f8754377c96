//! LoRA adapters' series: host loads and pool evictions (counters), the adapters loaded in
//! the shards' host memory and those paged into each replica's KV pool (gauges), and
//! vLLM's `vllm:lora_requests_info`, whose labels name the adapters of the running and
//! waiting requests and whose value is when they were last recorded (unix seconds), as
//! vLLM sets it; gateways' adapter-affinity pickers read its labels.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use super::families::{label, Families};
use super::series::{Counter, Gauge};

/// The registry's side of the LoRA series (the replicas' side is in `LoadGauges`).
#[derive(Debug, Default)]
pub struct LoraMetrics {
    /// Host loads that succeeded (`LoadAdapter` on every rank).
    pub loads: Counter,
    /// Adapters paged into a KV pool (a step's `adapters_in`).
    pub page_ins: Counter,
    /// Adapters that left a KV pool (a step's `adapters_out`).
    pub evictions: Counter,
    /// Adapters loaded in the shards' host memory.
    pub host: Gauge,
    /// `vllm:lora_requests_info`'s `max_lora` (`--max-adapters-per-batch`).
    pub max_lora: usize,
}

/// One replica's adapters as of its last step.
#[derive(Debug, Default)]
pub struct ReplicaAdapters {
    names: Mutex<(Vec<String>, Vec<String>)>,
    /// Unix seconds of the last `record`.
    recorded_at: Gauge,
    /// Adapters paged into its pool, and the blocks they hold.
    pub resident: Gauge,
    pub blocks: Gauge,
    /// Of `blocks`, those of adapters running requests use.
    pub blocks_in_use: Gauge,
}

impl ReplicaAdapters {
    /// The distinct adapters of the running and of the waiting requests, now.
    pub fn record(&self, running: Vec<String>, waiting: Vec<String>) {
        *self.names.lock().unwrap_or_else(|e| e.into_inner()) = (running, waiting);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.recorded_at.set(now);
    }
}

/// Registers the LoRA series: `cadence`'s carry the model label, `plain`'s none (as
/// vLLM's `vllm:lora_requests_info`); `replicas` are each replica's adapters.
pub(super) fn write(
    cadence: &mut Families,
    plain: &mut Families,
    lora: &LoraMetrics,
    replicas: &[&ReplicaAdapters],
) {
    let (mut running, mut waiting, mut at) = (Vec::new(), Vec::new(), 0.0f64);
    let (mut resident, mut blocks, mut in_use) = (0.0, 0.0, 0.0);
    for a in replicas {
        let names = a.names.lock().unwrap_or_else(|e| e.into_inner());
        running.extend(names.0.iter().cloned());
        waiting.extend(names.1.iter().cloned());
        at = at.max(a.recorded_at.get());
        resident += a.resident.get();
        blocks += a.blocks.get();
        in_use += a.blocks_in_use.get();
    }
    let joined = |mut v: Vec<String>| {
        v.sort_unstable();
        v.dedup();
        v.join(",")
    };
    let info = vec![
        label("max_lora", lora.max_lora),
        label("running_lora_adapters", joined(running)),
        label("waiting_lora_adapters", joined(waiting)),
    ];
    plain.samples(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        prometheus_client::metrics::MetricType::Gauge,
        vec![(info, at)],
    );
    let counters: [(&str, &str, &Counter); 3] = [
        (
            "cadence_lora_adapter_loads_total",
            "LoRA adapters loaded into the shards' host memory (LoadAdapter on every rank).",
            &lora.loads,
        ),
        (
            "cadence_lora_adapter_page_ins_total",
            "LoRA adapters paged into a KV pool.",
            &lora.page_ins,
        ),
        (
            "cadence_lora_adapter_evictions_total",
            "LoRA adapters that left a KV pool (evicted by last use, or unloaded).",
            &lora.evictions,
        ),
    ];
    for (name, help, c) in counters {
        cadence.counter(name, help, c);
    }
    let gauges: [(&str, &str, f64); 4] = [
        (
            "cadence_lora_adapter_blocks",
            "KV blocks holding paged-in LoRA adapters' weights (counted as used KV blocks).",
            blocks,
        ),
        (
            "cadence_lora_adapter_blocks_in_use",
            "Of those, the blocks of adapters that running requests use (the others are \
             evicted, least recently used first, when blocks are needed).",
            in_use,
        ),
        (
            "cadence_lora_adapters_resident",
            "LoRA adapters paged into the KV pools (over the replicas).",
            resident,
        ),
        (
            "cadence_lora_adapters_host",
            "LoRA adapters loaded in the shards' host memory.",
            lora.host.get(),
        ),
    ];
    for (name, help, value) in gauges {
        cadence.value(name, help, value);
    }
}

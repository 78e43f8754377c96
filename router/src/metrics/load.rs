//! The gauges each replica's batching loop sets after every step (its queue and its KV
//! cache), and how /metrics shows them: summed over the replicas under the `cadence_*`
//! and `vllm:` names (a gateway sees one endpoint), and per replica, with a `replica`
//! label (replica "0" alone without `--replicas`, so dashboards need no second case).

use super::gateway;
use super::lora::ReplicaAdapters;
use prometheus_client::metrics::MetricType;

use super::families::{label, Families};
use super::series::{Counter, Gauge};

/// One replica's queue and KV cache, as of its last step.
#[derive(Debug, Default)]
pub struct LoadGauges {
    pub waiting: Gauge,
    pub running: Gauge,
    pub swapped: Gauge,
    pub kv_blocks_total: Gauge,
    /// Tokens per KV block (set once, at start).
    pub kv_block_size: Gauge,
    pub kv_blocks_used: Gauge,
    pub kv_blocks_cached: Gauge,
    /// Block-table entries of the live beam searches' beams that point to a block another
    /// beam of the same search holds too: the blocks their sharing saves.
    pub kv_blocks_shared_by_beams: Gauge,
    pub kv_utilization: Gauge,
    /// 1 while the replica takes new requests, 0 once it failed its readiness check.
    pub ready: Gauge,
    /// Requests the balancer sent to this replica.
    pub routed: Counter,
    /// The LoRA adapters of its requests and in its pool.
    pub adapters: ReplicaAdapters,
}

impl LoadGauges {
    /// A replica's gauges before its first step: ready until a check says otherwise.
    pub fn new() -> Self {
        let gauges = Self::default();
        gauges.ready.set(1.0);
        gauges
    }

    /// Fraction (0 to 1) of this replica's KV blocks referenced by a request or holding
    /// a paged-in adapter.
    pub fn kv_usage(&self) -> f64 {
        let total = self.kv_blocks_total.get();
        if total > 0.0 {
            self.kv_blocks_used.get() / total
        } else {
            0.0
        }
    }
}

/// The replicas' gauges added up, read once per scrape.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Totals {
    pub load: gateway::Load,
    pub swapped: f64,
    pub kv_blocks_cached: f64,
    pub kv_blocks_shared_by_beams: f64,
    /// Over the replicas' running requests' blocks: each replica's utilization weighted
    /// by the blocks it has in use.
    pub kv_utilization: f64,
}

pub(super) fn totals(replicas: &[std::sync::Arc<LoadGauges>]) -> Totals {
    let mut t = Totals::default();
    let mut weighted = 0.0;
    for r in replicas {
        let used = r.kv_blocks_used.get();
        t.load.waiting += r.waiting.get();
        t.load.running += r.running.get();
        t.load.kv_blocks_used += used;
        t.load.kv_blocks_total += r.kv_blocks_total.get();
        t.swapped += r.swapped.get();
        t.kv_blocks_cached += r.kv_blocks_cached.get();
        t.kv_blocks_shared_by_beams += r.kv_blocks_shared_by_beams.get();
        weighted += r.kv_utilization.get() * used;
    }
    t.load.kv_block_size = replicas.first().map_or(0.0, |r| r.kv_block_size.get());
    if t.load.kv_blocks_used > 0.0 {
        t.kv_utilization = weighted / t.load.kv_blocks_used;
    }
    t
}

/// Registers the per-replica series; `cadence` carries the model label.
pub(super) fn write_replicas(cadence: &mut Families, replicas: &[std::sync::Arc<LoadGauges>]) {
    type Read = fn(&LoadGauges) -> f64;
    let series: [(&str, &str, MetricType, Read); 5] = [
        (
            "cadence_replica_waiting_requests",
            "Requests waiting for a step on this replica.",
            MetricType::Gauge,
            |r| r.waiting.get(),
        ),
        (
            "cadence_replica_running_requests",
            "Requests in this replica's running batch.",
            MetricType::Gauge,
            |r| r.running.get(),
        ),
        (
            "cadence_replica_kv_cache_usage_perc",
            "Fraction (0 to 1) of this replica's KV blocks referenced by a request or holding a paged-in LoRA adapter.",
            MetricType::Gauge,
            LoadGauges::kv_usage,
        ),
        (
            "cadence_replica_ready",
            "1 while the replica gets new requests, 0 once its readiness check failed.",
            MetricType::Gauge,
            |r| r.ready.get(),
        ),
        (
            "cadence_replica_requests_total",
            "Requests sent to this replica.",
            MetricType::Counter,
            |r| r.routed.get() as f64,
        ),
    ];
    for (name, help, kind, read) in series {
        let samples = replicas
            .iter()
            .enumerate()
            .map(|(i, r)| (vec![label("replica", i)], read(r)))
            .collect();
        cadence.samples(name, help, kind, samples);
    }
}

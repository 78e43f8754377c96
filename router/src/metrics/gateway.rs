//! The gauges a gateway's endpoint picker reads to choose a replica (the Kubernetes
//! Gateway API Inference Extension reads vLLM's by default), under vLLM's names and its
//! `model_name` label. Each is computed from the very value its `cadence_*` twin shows
//! in the same scrape (`Load`, read once), so the two never disagree.

use super::families::{label, Families};

/// The gauges both namings show, read once per scrape.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Load {
    pub waiting: f64,
    pub running: f64,
    pub kv_blocks_used: f64,
    pub kv_blocks_total: f64,
    pub kv_block_size: f64,
}

/// Registers the `vllm:` gauges; `vllm` carries the `model_name` label.
pub(super) fn write(vllm: &mut Families, load: Load) {
    let total = load.kv_blocks_total;
    let usage = if total > 0.0 {
        load.kv_blocks_used / total
    } else {
        0.0
    };
    let gauges = [
        (
            "vllm:num_requests_waiting",
            "Requests waiting for a step (cadence_queue_waiting_requests).",
            load.waiting,
        ),
        (
            "vllm:num_requests_running",
            "Requests in the running batch (cadence_running_requests).",
            load.running,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "Fraction (0 to 1) of KV blocks referenced by a request or holding a paged-in LoRA adapter (cadence_kv_blocks_used / cadence_kv_blocks_total).",
            usage,
        ),
        (
            "vllm:gpu_cache_usage_perc",
            "vllm:kv_cache_usage_perc under its former name, which older dashboards query.",
            usage,
        ),
    ];
    for (name, help, value) in gauges {
        vllm.value(name, help, value);
    }
    vllm.info(
        "vllm:cache_config_info",
        "The KV cache's configuration, in its labels; always 1.",
        vec![
            label("block_size", load.kv_block_size as u64),
            label("num_gpu_blocks", total as u64),
        ],
    );
}

#[cfg(test)]
mod tests {
    use crate::metrics::Metrics;

    #[test]
    fn gateway_gauges_follow_the_cadence_gauges_under_vllm_names() {
        let m = Metrics::new("org/m");
        let r = m.load(0);
        r.waiting.set(3.0);
        r.running.set(2.0);
        r.kv_blocks_total.set(200.0);
        r.kv_block_size.set(16.0);
        r.kv_blocks_used.set(50.0);
        let text = m.render(None);
        for line in [
            "vllm:num_requests_waiting{model_name=\"org/m\"} 3\n",
            "vllm:num_requests_running{model_name=\"org/m\"} 2\n",
            "vllm:kv_cache_usage_perc{model_name=\"org/m\"} 0.25\n",
            "vllm:cache_config_info{model_name=\"org/m\",block_size=\"16\",num_gpu_blocks=\"200\"} 1\n",
            "cadence_queue_waiting_requests{model=\"org/m\"} 3\n",
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
        // Before warm-up sized the cache: no division by zero.
        let empty = Metrics::new("m").render(None);
        assert!(empty.contains("vllm:kv_cache_usage_perc{model_name=\"m\"} 0\n"));
    }
}

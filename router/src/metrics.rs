//! Prometheus metrics for `GET /metrics`, kept in `prometheus-client`'s series (atomics;
//! one small lock per histogram) and written by its text encoder. The batching loop
//! updates them once per step and once per token event; the HTTP side reads them at
//! scrape time. Labels follow one rule: every `cadence_*` series carries `model`, every
//! `vllm:*` series `model_name` (the name vLLM's dashboards and gateways filter on; both
//! hold the served model name), `process_*` none. `gateway` adds the gauges gateways'
//! endpoint pickers read, `requests` vLLM's request-level series for its dashboards,
//! both under vLLM's names; `process` the router process's series and the build's.
//! `series` holds the kinds of series, `families` how a scrape registers and writes them.

#[cfg(test)]
mod exposition_tests;
pub(crate) mod families;
mod gateway;
mod load;
mod lora;
mod process;
pub(crate) mod rejections;
mod requests;
pub(crate) mod series;
mod tenants;

pub use families::CONTENT_TYPE;
pub(crate) use families::{label, Families};
pub use load::LoadGauges;
pub use lora::{LoraMetrics, ReplicaAdapters};
pub use rejections::{Rejection, Rejections};
pub use requests::{Finished, FinishedReason, RequestSeries};
pub use series::{Counter, Gauge, Histogram};

use std::sync::Arc;

use requests::{ITERATION_TOKENS, ITL_SECONDS, REQUEST_SECONDS, TTFT_SECONDS};

use crate::speculative::SpecDecodeMetrics;
use crate::tenants::Tenants;

/// Latency buckets in seconds, 1 ms to 2 min.
const SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Grammar work in seconds, 10 µs to 10 s (per-step masks are usually well under 1 ms).
const GRAMMAR_SECONDS: &[f64] = &[
    0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
];
const BATCH_SIZES: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
const BATCH_TOKENS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];
/// The longest sequence the token-count buckets reach until `with_max_model_len` says.
const DEFAULT_MAX_MODEL_LEN: usize = 131_072;

/// Every metric the router exports.
#[derive(Debug)]
pub struct Metrics {
    /// The served model's name (the `model` and `model_name` labels).
    model: String,
    /// Each replica's queue and KV gauges, in replica order (one without --replicas).
    replicas: Vec<Arc<LoadGauges>>,
    pub prefix_queries: Counter,
    pub prefix_hits: Counter,
    pub preemptions_recompute: Counter,
    pub preemptions_swap: Counter,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub step_tokens: Counter,
    pub requests_rejected: Counter,
    /// Every 4xx answer, counted by the HTTP layer (`crate::rejections`).
    pub http_rejections: Rejections,
    pub requests_failed: Counter,
    pub constrained_requests: Counter,
    pub grammar_cache_hits: Counter,
    pub fast_forward_tokens: Counter,
    pub batch_size: Histogram,
    /// Twinned with `vllm:iteration_tokens_total`.
    pub batch_tokens: Histogram,
    /// Twinned with `vllm:request_queue_time_seconds`.
    pub queue_time: Histogram,
    /// Twinned with `vllm:time_to_first_token_seconds`.
    pub ttft: Histogram,
    /// Twinned with `vllm:inter_token_latency_seconds`.
    pub itl: Histogram,
    /// Twinned with `vllm:e2e_request_latency_seconds`.
    pub e2e: Histogram,
    pub grammar_compile: Histogram,
    pub grammar_mask: Histogram,
    pub step_time: Histogram,
    pub forward_time: Histogram,
    /// Finished requests by reason and vLLM's per-request histograms; their count is
    /// `cadence_requests_succeeded_total`.
    pub requests: RequestSeries,
    /// The labels of `cadence_quantization_info` (set once the shards have answered).
    quantization: std::sync::OnceLock<families::Labels>,
    /// Speculative decoding's series, once it is on.
    speculative: std::sync::OnceLock<SpecDecodeMetrics>,
    /// LoRA adapters' series, when any LoRA option is on.
    lora: std::sync::OnceLock<Arc<LoraMetrics>>,
    /// The API keys' tenants' accounts, when keys are required.
    tenants: std::sync::OnceLock<Arc<Tenants>>,
}

impl Metrics {
    pub fn new(model: &str) -> Self {
        Self::with_replicas(model, 1)
    }

    /// Metrics for a router in front of `replicas` shard groups.
    pub fn with_replicas(model: &str, replicas: usize) -> Self {
        Self {
            model: model.to_string(),
            replicas: (0..replicas.max(1))
                .map(|_| Arc::new(LoadGauges::new()))
                .collect(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            preemptions_recompute: Counter::default(),
            preemptions_swap: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            step_tokens: Counter::default(),
            requests_rejected: Counter::default(),
            http_rejections: Rejections::default(),
            requests_failed: Counter::default(),
            constrained_requests: Counter::default(),
            grammar_cache_hits: Counter::default(),
            fast_forward_tokens: Counter::default(),
            batch_size: Histogram::new(BATCH_SIZES),
            batch_tokens: Histogram::with_twin(BATCH_TOKENS, ITERATION_TOKENS),
            queue_time: Histogram::with_twin(SECONDS, REQUEST_SECONDS),
            ttft: Histogram::with_twin(SECONDS, TTFT_SECONDS),
            itl: Histogram::with_twin(SECONDS, ITL_SECONDS),
            e2e: Histogram::with_twin(SECONDS, REQUEST_SECONDS),
            grammar_compile: Histogram::new(GRAMMAR_SECONDS),
            grammar_mask: Histogram::new(GRAMMAR_SECONDS),
            step_time: Histogram::new(SECONDS),
            forward_time: Histogram::new(SECONDS),
            requests: RequestSeries::new(DEFAULT_MAX_MODEL_LEN),
            quantization: std::sync::OnceLock::new(),
            speculative: std::sync::OnceLock::new(),
            lora: std::sync::OnceLock::new(),
            tenants: std::sync::OnceLock::new(),
        }
    }

    /// The token-count histograms' buckets reach `max_model_len` (prompt and generated
    /// tokens, max_tokens), as vLLM's do; call before any request.
    pub fn with_max_model_len(mut self, max_model_len: usize) -> Self {
        self.requests = RequestSeries::new(max_model_len);
        self
    }

    /// One request (one sample of it) finished generating.
    pub fn finish(&self, finished: &Finished) {
        self.e2e.observe(finished.e2e.as_secs_f64());
        self.requests.record(finished);
    }

    /// Turns the LoRA series on (the registry keeps its counters); only the first call
    /// counts.
    pub fn enable_lora(&self, lora: Arc<LoraMetrics>) {
        let _ = self.lora.set(lora);
    }

    /// Turns the per-tenant series on; only the first call counts.
    pub fn enable_tenants(&self, tenants: Arc<Tenants>) {
        let _ = self.tenants.set(tenants);
    }

    /// How the shards store weights and KV cache (the shards' `InfoResponse.quantization`),
    /// exported as the labels of `cadence_quantization_info`; only the first call counts.
    pub fn set_quantization(&self, fields: &std::collections::BTreeMap<String, String>) {
        let labels = fields
            .iter()
            .filter(|(k, _)| k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
            .filter(|(k, _)| k.as_str() != "model")
            .map(|(k, v)| label(k, v))
            .collect();
        let _ = self.quantization.set(labels);
    }

    /// Turns speculative decoding's series on, with a per-position counter for each of
    /// up to `num_speculative_tokens` proposals; only the first call counts.
    pub fn enable_speculative(&self, num_speculative_tokens: usize) -> &SpecDecodeMetrics {
        self.speculative
            .get_or_init(|| SpecDecodeMetrics::new(num_speculative_tokens))
    }

    /// Speculative decoding's series, when on.
    pub fn speculative(&self) -> Option<&SpecDecodeMetrics> {
        self.speculative.get()
    }

    /// Replica `i`'s queue and KV gauges.
    pub fn load(&self, i: usize) -> &Arc<LoadGauges> {
        &self.replicas[i]
    }

    /// The Prometheus text exposition; `shard_computed` are the shard-side cumulative
    /// (all tokens, prompt tokens) computed, when the shards answered.
    pub fn render(&self, shard_computed: Option<(u64, u64)>) -> String {
        let mut cadence = Families::labelled("model", &self.model);
        let mut vllm = Families::labelled("model_name", &self.model);
        let mut plain = Families::default();
        self.write_cadence(&mut cadence, shard_computed);
        // Read once: the gateways' gauges show the same values as cadence's.
        gateway::write(&mut vllm, load::totals(&self.replicas).load);
        requests::write(&mut vllm, self);
        if let Some(speculative) = self.speculative.get() {
            speculative.write(&mut cadence, &mut vllm);
        }
        if let Some(lora) = self.lora.get() {
            let adapters: Vec<&ReplicaAdapters> =
                self.replicas.iter().map(|r| &r.adapters).collect();
            lora::write(&mut cadence, &mut plain, lora, &adapters);
        }
        process::write(&mut plain);
        let mut out = String::with_capacity(32 * 1024);
        for families in [&cadence, &vllm, &plain] {
            families.encode(&mut out);
        }
        out
    }

    /// Registers cadence's own series.
    fn write_cadence(&self, cadence: &mut Families, shard_computed: Option<(u64, u64)>) {
        let totals = load::totals(&self.replicas);
        let load = totals.load;
        let gauges: [(&str, &str, f64); 8] = [
            (
                "cadence_queue_waiting_requests",
                "Requests waiting for a step (queued or preempted).",
                load.waiting,
            ),
            (
                "cadence_running_requests",
                "Requests holding KV blocks in the running batch.",
                load.running,
            ),
            (
                "cadence_swapped_requests",
                "Preempted requests whose KV is in the host pool.",
                totals.swapped,
            ),
            (
                "cadence_kv_blocks_total",
                "KV cache blocks.",
                load.kv_blocks_total,
            ),
            (
                "cadence_kv_blocks_used",
                "KV blocks referenced by a request or holding a paged-in LoRA adapter.",
                load.kv_blocks_used,
            ),
            (
                "cadence_kv_blocks_cached",
                "Unreferenced KV blocks kept for prefix hits (evictable).",
                totals.kv_blocks_cached,
            ),
            (
                "cadence_kv_utilization",
                "Tokens stored in the running requests' blocks / the slots of those blocks.",
                totals.kv_utilization,
            ),
            (
                "cadence_kv_blocks_shared_by_beams",
                "KV blocks the live beam searches save: block-table entries of their beams that share a block with another beam of the same search.",
                totals.kv_blocks_shared_by_beams,
            ),
        ];
        for (name, help, value) in gauges {
            cadence.value(name, help, value);
        }
        let counters: [(&str, &str, &Counter); 10] = [
            (
                "cadence_prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
                &self.prefix_queries,
            ),
            (
                "cadence_prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache (their prefill skipped).",
                &self.prefix_hits,
            ),
            (
                "cadence_prompt_tokens_total",
                "Prompt tokens of admitted requests.",
                &self.prompt_tokens,
            ),
            (
                "cadence_generation_tokens_total",
                "Tokens generated.",
                &self.generation_tokens,
            ),
            (
                "cadence_step_tokens_total",
                "Tokens computed by the steps the router sent (prefill and decode).",
                &self.step_tokens,
            ),
            (
                "cadence_requests_rejected_total",
                "Requests answered 429: --max-concurrent-requests in flight or --max-waiting-requests waiting (every 4xx: cadence_http_requests_rejected_total).",
                &self.requests_rejected,
            ),
            (
                "cadence_requests_failed_total",
                "Requests that ended with an error.",
                &self.requests_failed,
            ),
            (
                "cadence_constrained_requests_total",
                "Requests admitted with a grammar (structured output or tool calls).",
                &self.constrained_requests,
            ),
            (
                "cadence_grammar_cache_hits_total",
                "Constrained requests whose grammar was already compiled.",
                &self.grammar_cache_hits,
            ),
            (
                "cadence_grammar_fast_forward_tokens_total",
                "Tokens a grammar forced, appended without sampling (computed as a prefill chunk).",
                &self.fast_forward_tokens,
            ),
        ];
        for (name, help, c) in counters {
            cadence.counter(name, help, c);
        }
        cadence.count(
            "cadence_requests_succeeded_total",
            "Requests that finished generating (vllm:request_success_total, all reasons).",
            self.requests.finished(),
        );
        let preemptions = [
            ("recompute", &self.preemptions_recompute),
            ("swap", &self.preemptions_swap),
        ]
        .map(|(kind, c)| (vec![label("kind", kind)], c.get() as f64));
        cadence.samples(
            "cadence_preemptions_total",
            "Requests preempted when KV blocks ran out, by kind.",
            prometheus_client::metrics::MetricType::Counter,
            preemptions.to_vec(),
        );
        if let Some((all, prompt)) = shard_computed {
            cadence.count(
                "cadence_shard_computed_tokens_total",
                "Tokens the shard's forward passes computed, counted by the shard.",
                all,
            );
            cadence.count(
                "cadence_shard_prompt_tokens_computed_total",
                "Prompt tokens the shard's forward passes computed (prefill), counted by the shard.",
                prompt,
            );
        }
        let histograms: [(&str, &str, &Histogram); 10] = [
            ("cadence_batch_size", "Requests per step.", &self.batch_size),
            (
                "cadence_batch_tokens",
                "Tokens computed per step.",
                &self.batch_tokens,
            ),
            (
                "cadence_queue_time_seconds",
                "Arrival to first admission.",
                &self.queue_time,
            ),
            (
                "cadence_time_to_first_token_seconds",
                "Arrival to first generated token.",
                &self.ttft,
            ),
            (
                "cadence_inter_token_latency_seconds",
                "Between consecutive generated tokens of a request.",
                &self.itl,
            ),
            (
                "cadence_e2e_request_latency_seconds",
                "Arrival to last token.",
                &self.e2e,
            ),
            (
                "cadence_grammar_compile_seconds",
                "Compiling a request's grammar (cache misses only).",
                &self.grammar_compile,
            ),
            (
                "cadence_grammar_mask_seconds",
                "Computing the allowed-token masks of one step's constrained requests.",
                &self.grammar_mask,
            ),
            (
                "cadence_step_duration_seconds",
                "A step from sent (or, sent ahead, from the previous step's answer) to answered: the shards' forward and sampling, their step handling and gRPC both ways.",
                &self.step_time,
            ),
            (
                "cadence_forward_duration_seconds",
                "A step's forward pass and sampling, timed by shard rank 0.",
                &self.forward_time,
            ),
        ];
        for (name, help, h) in histograms {
            cadence.histogram(name, help, h.series());
        }
        load::write_replicas(cadence, &self.replicas);
        if let Some(tenants) = self.tenants.get() {
            tenants::write(cadence, tenants);
        }
        self.http_rejections.write(cadence);
        if let Some(labels) = self.quantization.get() {
            cadence.info(
                "cadence_quantization_info",
                "How weights and KV cache are stored (labels); always 1.",
                labels.clone(),
            );
        }
        process::write_build_info(cadence);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantization_info_carries_the_shards_fields_as_labels() {
        let m = Metrics::new("m");
        assert!(!m.render(None).contains("cadence_quantization_info"));
        let fields = [
            ("weights".to_string(), "int4".to_string()),
            ("source".to_string(), "gguf \"Q4_1\"".to_string()),
            ("bad key".to_string(), "dropped".to_string()),
        ];
        m.set_quantization(&fields.into());
        let text = m.render(None);
        assert!(text.contains(
            "cadence_quantization_info{model=\"m\",source=\"gguf \\\"Q4_1\\\"\",weights=\"int4\"} 1\n"
        ));
    }

    #[test]
    fn lora_series_name_every_replicas_adapters_once_under_vllms_info_gauge() {
        let m = Metrics::with_replicas("m", 2);
        assert!(!m.render(None).contains("lora"), "off until enabled");
        let lora = Arc::new(LoraMetrics {
            max_lora: 4,
            ..Default::default()
        });
        lora.loads.add(3);
        lora.host.set(3.0);
        m.enable_lora(lora);
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        m.load(0)
            .adapters
            .record(names(&["sql", "chat"]), names(&["math"]));
        m.load(1).adapters.record(names(&["sql"]), Vec::new());
        m.load(0).adapters.blocks.set(5.0);
        m.load(1).adapters.blocks.set(3.0);
        m.load(0).adapters.blocks_in_use.set(2.0);
        let text = m.render(None);
        let info = text
            .lines()
            .find(|l| l.starts_with("vllm:lora_requests_info{"))
            .unwrap();
        let (labels, stamp) = info.rsplit_once(' ').unwrap();
        assert_eq!(
            labels,
            "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"chat,sql\",waiting_lora_adapters=\"math\"}"
        );
        assert!(
            stamp.parse::<f64>().unwrap() > 1.0e9,
            "unix seconds: {stamp}"
        );
        assert!(text.contains("cadence_lora_adapter_loads_total{model=\"m\"} 3\n"));
        assert!(text.contains("cadence_lora_adapter_blocks{model=\"m\"} 8\n"));
        assert!(text.contains("cadence_lora_adapter_blocks_in_use{model=\"m\"} 2\n"));
        assert!(text.contains("cadence_lora_adapters_host{model=\"m\"} 3\n"));
    }

    #[test]
    fn renders_prometheus_text_with_cumulative_buckets_and_the_model_label() {
        let m = Metrics::new("org/m\"x");
        m.load(0).waiting.set(3.0);
        m.prefix_hits.add(32);
        m.preemptions_swap.add(2);
        m.ttft.observe(0.004);
        m.ttft.observe(0.2);
        m.ttft.observe(1000.0);
        let text = m.render(Some((10, 7)));
        assert!(text.contains("cadence_queue_waiting_requests{model=\"org/m\\\"x\"} 3\n"));
        assert!(text.contains("cadence_prefix_cache_hits_total{model=\"org/m\\\"x\"} 32\n"));
        assert!(text.contains("cadence_preemptions_total{model=\"org/m\\\"x\",kind=\"swap\"} 2\n"));
        assert!(
            text.contains("cadence_shard_prompt_tokens_computed_total{model=\"org/m\\\"x\"} 7\n")
        );
        let bucket = |le: &str| {
            let key = format!(
                "cadence_time_to_first_token_seconds_bucket{{model=\"org/m\\\"x\",le=\"{le}\"}} "
            );
            let line = text.lines().find(|l| l.starts_with(&key)).unwrap();
            line[key.len()..].parse::<u64>().unwrap()
        };
        assert_eq!(bucket("0.001"), 0);
        assert_eq!(bucket("0.005"), 1);
        assert_eq!(bucket("0.25"), 2);
        assert_eq!(bucket("120"), 2);
        assert_eq!(bucket("+Inf"), 3);
        // Every sample line is `name{labels} value`.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, value) = line.rsplit_once(' ').unwrap();
            value.parse::<f64>().unwrap();
        }
    }
}

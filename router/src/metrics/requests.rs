//! Request-level series under vLLM's names, `model_name` label, units and buckets, so
//! the dashboards written for vLLM find them: what each finished request took and
//! produced (`Finished`, recorded once by `Metrics::finish`) and what each admitted
//! request asked for. The latencies cadence also keeps under its own names (time to
//! first token, between tokens, end to end, queue) are the same observations counted in
//! vLLM's buckets (`Histogram::with_twin`); the token counters are the same counters
//! under both names. Nothing here is a second count of what `cadence_*` counts.

use std::time::Duration;

use prometheus_client::metrics::MetricType;

use super::families::{label, Families};
use super::series::{one_two_five_buckets, Counter, Histogram};
use super::Metrics;

/// vLLM's time-to-first-token buckets (seconds).
pub(super) const TTFT_SECONDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's inter-token latency buckets (seconds).
pub(super) const ITL_SECONDS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's buckets for a request's phases: queued, prefill, decode, end to end (seconds).
pub(super) const REQUEST_SECONDS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's buckets of tokens per step.
pub(super) const ITERATION_TOKENS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
/// vLLM's buckets of the `n` parameter.
const PARAMS_N: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];

/// How a request finished, as vLLM's `finished_reason` label names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishedReason {
    /// An EOS token or a stop string.
    Stop,
    /// Its token budget.
    Length,
}

/// What one finished request (one sample of it) took and produced.
#[derive(Debug, Clone)]
pub struct Finished {
    pub reason: FinishedReason,
    pub prompt_tokens: usize,
    pub generation_tokens: usize,
    /// Arrival to its end.
    pub e2e: Duration,
    /// Its first step to its first token.
    pub prefill: Duration,
    /// Its first token to its last.
    pub decode: Duration,
    /// Its first step to its last token.
    pub inference: Duration,
}

/// The request-level series only vLLM's names have.
#[derive(Debug)]
pub struct RequestSeries {
    stop: Counter,
    length: Counter,
    prompt_tokens: Histogram,
    generation_tokens: Histogram,
    params_n: Histogram,
    params_max_tokens: Histogram,
    max_num_generation_tokens: Histogram,
    prefill: Histogram,
    decode: Histogram,
    inference: Histogram,
}

impl RequestSeries {
    /// Token-count buckets up to `max_model_len` (1, 2, 5, 10, …), as vLLM's.
    pub(super) fn new(max_model_len: usize) -> Self {
        let tokens = one_two_five_buckets(max_model_len.max(1));
        Self {
            stop: Counter::default(),
            length: Counter::default(),
            prompt_tokens: Histogram::new(&tokens),
            generation_tokens: Histogram::new(&tokens),
            params_n: Histogram::new(PARAMS_N),
            params_max_tokens: Histogram::new(&tokens),
            max_num_generation_tokens: Histogram::new(&tokens),
            prefill: Histogram::new(REQUEST_SECONDS),
            decode: Histogram::new(REQUEST_SECONDS),
            inference: Histogram::new(REQUEST_SECONDS),
        }
    }

    /// A request admitted with `n` samples and at most `max_tokens` new tokens each.
    pub fn admitted(&self, n: usize, max_tokens: usize) {
        self.params_n.observe(n as f64);
        self.params_max_tokens.observe(max_tokens as f64);
        self.max_num_generation_tokens.observe(max_tokens as f64);
    }

    pub(super) fn record(&self, f: &Finished) {
        match f.reason {
            FinishedReason::Stop => self.stop.add(1),
            FinishedReason::Length => self.length.add(1),
        }
        self.prompt_tokens.observe(f.prompt_tokens as f64);
        self.generation_tokens.observe(f.generation_tokens as f64);
        self.prefill.observe(f.prefill.as_secs_f64());
        self.decode.observe(f.decode.as_secs_f64());
        self.inference.observe(f.inference.as_secs_f64());
    }

    /// Requests that finished generating, whatever the reason.
    pub fn finished(&self) -> u64 {
        self.stop.get() + self.length.get()
    }
}

/// Registers vLLM's request-level series; `vllm` carries the `model_name` label.
pub(super) fn write(vllm: &mut Families, m: &Metrics) {
    let r = &m.requests;
    let reasons = [("stop", &r.stop), ("length", &r.length)]
        .map(|(reason, c)| (vec![label("finished_reason", reason)], c.get() as f64));
    vllm.samples(
        "vllm:request_success_total",
        "Count of successfully processed requests, by finished_reason (stop: EOS or a stop string; length: max_tokens).",
        MetricType::Counter,
        reasons.to_vec(),
    );
    vllm.counter(
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed (cadence_prompt_tokens_total).",
        &m.prompt_tokens,
    );
    vllm.counter(
        "vllm:generation_tokens_total",
        "Number of generation tokens processed (cadence_generation_tokens_total).",
        &m.generation_tokens,
    );
    vllm.counter(
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens (cadence_prefix_cache_queries_total).",
        &m.prefix_queries,
    );
    vllm.counter(
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens (cadence_prefix_cache_hits_total).",
        &m.prefix_hits,
    );
    vllm.count(
        "vllm:num_preemptions_total",
        "Cumulative number of preemptions (cadence_preemptions_total, both kinds).",
        m.preemptions_recompute.get() + m.preemptions_swap.get(),
    );
    let twins: [(&str, &str, &Histogram); 5] = [
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (cadence_time_to_first_token_seconds).",
            &m.ttft,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (cadence_inter_token_latency_seconds).",
            &m.itl,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds (cadence_e2e_request_latency_seconds).",
            &m.e2e,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request (cadence_queue_time_seconds).",
            &m.queue_time,
        ),
        (
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step (cadence_batch_tokens).",
            &m.batch_tokens,
        ),
    ];
    for (name, help, h) in twins {
        if let Some(twin) = h.twin() {
            vllm.histogram(name, help, twin);
        }
    }
    // vLLM's name for inter-token latency before it was renamed; older dashboards
    // (vLLM's own included) still query it. The very same buckets.
    if let Some(itl) = m.itl.twin() {
        vllm.histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (vllm:inter_token_latency_seconds under its former name).",
            itl,
        );
    }
    let own: [(&str, &str, &Histogram); 8] = [
        (
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed, per finished request.",
            &r.prompt_tokens,
        ),
        (
            "vllm:request_generation_tokens",
            "Number of generation tokens processed, per finished request.",
            &r.generation_tokens,
        ),
        (
            "vllm:request_params_n",
            "Histogram of the n request parameter (samples per request, best_of included).",
            &r.params_n,
        ),
        (
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            &r.params_max_tokens,
        ),
        (
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            &r.max_num_generation_tokens,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request (first step to first token).",
            &r.prefill,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request (first token to last).",
            &r.decode,
        ),
        (
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request (first step to last token).",
            &r.inference,
        ),
    ];
    for (name, help, h) in own {
        vllm.histogram(name, help, h.series());
    }
}

//! Command-line flags. Every flag has a `CADENCE_<FLAG_NAME>` environment twin.

use std::path::PathBuf;

use clap::{CommandFactory, Parser, ValueEnum};

use crate::pb;
use crate::tenants::ApiKey;

/// `--preemption`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PreemptionArg {
    Recompute,
    Swap,
}

/// `--batching`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BatchingArg {
    Continuous,
    Dynamic,
    Static,
    None,
}

/// `--scheduling-policy`: who joins the batch first, and who is preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SchedulingPolicyArg {
    /// First come, first served; the latest arrival is preempted.
    Fcfs,
    /// Fair between tenants (API keys' tenants): the Virtual Token Counter.
    Fair,
    /// The requests' `priority` (lower first), aged so that none starves.
    Priority,
}

/// `--speculative`: who proposes the tokens a step verifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpeculativeArg {
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the
    /// request's last n tokens (free: computed by the router).
    Ngram,
    /// The shards' draft model (`--draft-model-id`).
    Draft,
    /// Benchmarking only: arbitrary tokens the shards accept at the rate they are given
    /// (`--speculative-acceptance`); the output is not the model's.
    Synthetic,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// cadence's HTTP router: validation, tokenization, continuous batching and streaming in
/// front of the model shards.
#[derive(Debug, Clone, Parser)]
#[command(name = "cadence-router", version, about)]
pub struct Args {
    /// Address to listen on.
    #[arg(long, env = "CADENCE_HOSTNAME", default_value = "127.0.0.1")]
    pub hostname: String,

    /// Port to listen on.
    #[arg(long, env = "CADENCE_PORT", default_value_t = 8080)]
    pub port: u16,

    /// Unix socket of a shard's gRPC server; repeat once per tensor-parallel rank, rank 0
    /// first, and with --replicas once per rank of every replica, replica 0's ranks first
    /// (the environment variable takes a comma-separated list).
    #[arg(
        long = "shard-uds-path",
        env = "CADENCE_SHARD_UDS_PATH",
        required = true,
        value_delimiter = ','
    )]
    pub shard_uds_path: Vec<PathBuf>,

    /// Independent shard groups (each a full copy of the model with its own KV cache)
    /// behind this router, which sends each new request to one of them by load and prefix
    /// affinity; the --shard-uds-path are split into this many groups of equal size.
    #[arg(long, env = "CADENCE_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub replicas: u32,

    /// Model folder holding tokenizer.json.
    #[arg(long, env = "CADENCE_TOKENIZER")]
    pub tokenizer: PathBuf,

    /// A chat template used instead of the model's (tokenizer_config.json's): a Jinja
    /// file, or the template itself (vLLM's --chat-template).
    #[arg(long, env = "CADENCE_CHAT_TEMPLATE")]
    pub chat_template: Option<String>,

    /// Splits a thinking model's `<think>…</think>` reasoning from its answer into
    /// chat's `reasoning` field, Anthropic's `thinking` blocks and Responses' reasoning
    /// items (vLLM's --reasoning-parser) [default: none, the text as generated].
    #[arg(long, env = "CADENCE_REASONING_PARSER", value_enum)]
    pub reasoning_parser: Option<crate::reasoning::ReasoningParser>,

    /// Model name reported by /info.
    #[arg(long, env = "CADENCE_MODEL_ID")]
    pub model_id: String,

    /// The names clients know the model by, comma-separated (or the flag repeated): each
    /// is listed by /v1/models and accepted as a request's `model`; the first is the
    /// `model` of OpenAI answers and the `model` and `model_name` labels of /metrics
    /// [default: --model-id].
    #[arg(long, env = "CADENCE_SERVED_MODEL_NAME", value_delimiter = ',')]
    pub served_model_name: Vec<String>,

    /// Most tokens computed in one step (prefill chunks and decodes together); the shards
    /// profile their memory with a step this large at warm-up.
    #[arg(long, env = "CADENCE_MAX_BATCH_TOKENS", default_value_t = 1024)]
    pub max_batch_tokens: u32,

    /// Most requests in one step.
    #[arg(long, env = "CADENCE_MAX_BATCH_SIZE", default_value_t = 64)]
    pub max_batch_size: u32,

    /// Bytes of KV cache each shard allocates at warm-up [default: --memory-fraction of
    /// the free memory].
    #[arg(long, env = "CADENCE_KV_CACHE_BYTES")]
    pub kv_cache_bytes: Option<u64>,

    /// Share of memory a shard may use when --kv-cache-bytes is unset; the KV cache gets
    /// what is left after the profiled step. On a GPU: of the device's total memory, for
    /// all the shard holds there (weights, activations, KV cache, CUDA's own allocations),
    /// as vLLM's --gpu-memory-utilization [default: 0.9]. On CPU: of MemAvailable at
    /// warm-up (the loaded weights are not in it), split between the ranks, for the
    /// activations and the KV cache [default: 0.1].
    #[arg(long, env = "CADENCE_MEMORY_FRACTION")]
    pub memory_fraction: Option<f32>,

    /// Most prompt tokens one request computes per step (chunked prefill); 0 = up to
    /// --max-batch-tokens.
    #[arg(long, env = "CADENCE_MAX_PREFILL_CHUNK", default_value_t = 0)]
    pub max_prefill_chunk: u32,

    /// What happens to a request's KV when the cache runs out: recompute it later, or swap
    /// it to the shards' host memory and back.
    #[arg(long, env = "CADENCE_PREEMPTION", value_enum, default_value_t = PreemptionArg::Recompute)]
    pub preemption: PreemptionArg,

    /// Host-memory blocks for swap preemption [default: 4 × the KV cache's blocks, the
    /// most the shards accept].
    #[arg(long, env = "CADENCE_SWAP_BLOCKS")]
    pub swap_blocks: Option<u32>,

    /// Turns prefix caching (sharing the KV of identical leading blocks) off.
    #[arg(long, env = "CADENCE_NO_PREFIX_CACHING")]
    pub no_prefix_caching: bool,

    /// Turns asynchronous scheduling off: the router then schedules each step only after
    /// the previous one's tokens are back, and the shards wait for it between steps.
    #[arg(long, env = "CADENCE_NO_ASYNC_SCHEDULING")]
    pub no_async_scheduling: bool,

    /// Longest a request's grammar (JSON schema, regex, choice, Lark grammar, tools) may
    /// take to compile; past it that request fails with an error naming the field, and
    /// others are not held up. Compiled grammars are cached.
    #[arg(
        long,
        default_value_t = 5000,
        env = "CADENCE_GRAMMAR_COMPILE_TIMEOUT_MS"
    )]
    pub grammar_compile_timeout_ms: u64,

    /// Do not append the tokens a grammar forces (a JSON key, a closing brace) without
    /// sampling: sample every token under its mask instead.
    #[arg(long, env = "CADENCE_NO_GRAMMAR_FAST_FORWARD")]
    pub no_grammar_fast_forward: bool,

    /// Speculative decoding: who proposes tokens for each decode to verify in one forward
    /// (off unless set). Exact for every sampler; switched off per step under load.
    #[arg(long, env = "CADENCE_SPECULATIVE", value_enum)]
    pub speculative: Option<SpeculativeArg>,

    /// Speculative decoding: most tokens proposed per request and step (each request's own
    /// number adapts to how many of its proposals are accepted).
    #[arg(long, env = "CADENCE_NUM_SPECULATIVE_TOKENS", default_value_t = 4)]
    pub num_speculative_tokens: usize,

    /// N-gram proposals: the shortest suffix looked up.
    #[arg(long, env = "CADENCE_NGRAM_MIN", default_value_t = 1)]
    pub ngram_min: usize,

    /// N-gram proposals: the longest suffix looked up (longer matches are preferred).
    #[arg(long, env = "CADENCE_NGRAM_MAX", default_value_t = 4)]
    pub ngram_max: usize,

    /// Speculative decoding: proposals are added to a step only while it holds at most this
    /// many tokens; 0 = the shards' measured threshold (or their device's default).
    #[arg(long, env = "CADENCE_SPECULATIVE_MAX_STEP_TOKENS", default_value_t = 0)]
    pub speculative_max_step_tokens: usize,

    /// LoRA adapters loaded at start, `name=path` (a PEFT folder: adapter_config.json and
    /// adapter_model.safetensors), comma-separated or repeated; requests name them in
    /// `parameters.adapter_id` or OpenAI's `model`. One the shards refuse stops the start,
    /// with their reason.
    #[arg(long, env = "CADENCE_LORA_ADAPTERS", value_delimiter = ',', value_parser = crate::lora::parse_adapter)]
    pub lora_adapters: Vec<(String, PathBuf)>,

    /// Folder of LoRA adapters: a request naming an unknown adapter N is served with the
    /// adapter in DIR/N (when DIR/N/adapter_config.json exists), loaded on first use.
    #[arg(long, env = "CADENCE_LORA_DIR")]
    pub lora_dir: Option<PathBuf>,

    /// Most LoRA adapters kept loaded in the shards' host memory; past it the least
    /// recently used one no request uses and no KV pool holds is dropped (and loaded again
    /// when a request names it).
    #[arg(long, env = "CADENCE_MAX_CPU_ADAPTERS", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_cpu_adapters: u32,

    /// Most distinct LoRA adapters in one step's batch; waiting requests for another
    /// adapter wait (requests behind them may go ahead).
    #[arg(long, env = "CADENCE_MAX_ADAPTERS_PER_BATCH", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_adapters_per_batch: u32,

    /// Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime adapter
    /// loading); without it they are 404.
    #[arg(long, env = "CADENCE_ALLOW_RUNTIME_LORA")]
    pub allow_runtime_lora: bool,

    /// When waiting requests join: continuous (every step), dynamic (a batch forms when
    /// --max-batch-size requests wait or --batch-timeout-ms passes), static (a batch forms
    /// from what waits and runs until its longest member ends), none (one at a time).
    #[arg(long, env = "CADENCE_BATCHING", value_enum, default_value_t = BatchingArg::Continuous)]
    pub batching: BatchingArg,

    /// Who joins the batch first and who is preempted: fcfs (arrival order), fair (between
    /// the API keys' tenants, by the Virtual Token Counter; weights from the key file),
    /// priority (the requests' `priority`, lower first, aged by one level a second).
    #[arg(long, env = "CADENCE_SCHEDULING_POLICY", value_enum, default_value_t = SchedulingPolicyArg::Fcfs)]
    pub scheduling_policy: SchedulingPolicyArg,

    /// Priorities of the Gateway API Inference Extension's objectives, `NAME=P` comma-
    /// separated: a request without `priority` whose `x-gateway-inference-objective`
    /// header names one runs at its priority under --scheduling-policy priority.
    #[arg(long, env = "CADENCE_OBJECTIVE_PRIORITIES", value_delimiter = ',')]
    pub objective_priorities: Vec<String>,

    /// Dynamic batching: longest a request waits for its batch to fill.
    #[arg(long, env = "CADENCE_BATCH_TIMEOUT_MS", default_value_t = 50)]
    pub batch_timeout_ms: u64,

    /// Requests waiting for their first step beyond which new ones get 429.
    #[arg(long, env = "CADENCE_MAX_WAITING_REQUESTS", default_value_t = 128)]
    pub max_waiting_requests: usize,

    /// Longest prompt accepted, in tokens [default: max total tokens - 1].
    #[arg(long, env = "CADENCE_MAX_INPUT_TOKENS")]
    pub max_input_tokens: Option<u32>,

    /// Most prompt + generated tokens per request [default: the model's
    /// max_position_embeddings].
    #[arg(long, env = "CADENCE_MAX_TOTAL_TOKENS")]
    pub max_total_tokens: Option<u32>,

    /// Requests in flight (queued or running) beyond which new ones get 429.
    #[arg(long, env = "CADENCE_MAX_CONCURRENT_REQUESTS", default_value_t = 128)]
    pub max_concurrent_requests: usize,

    /// Most stop sequences per request.
    #[arg(long, env = "CADENCE_MAX_STOP_SEQUENCES", default_value_t = 4)]
    pub max_stop_sequences: usize,

    /// Most alternatives per token a request may ask for (top_n_tokens, OpenAI's
    /// logprobs / top_logprobs).
    #[arg(long, env = "CADENCE_MAX_TOP_N_TOKENS", default_value_t = 5)]
    pub max_top_n_tokens: usize,

    /// Most samples generated for one prompt (best_of, OpenAI's n and best_of).
    #[arg(long, env = "CADENCE_MAX_BEST_OF", default_value_t = 8)]
    pub max_best_of: usize,

    /// Largest request body accepted, in bytes.
    #[arg(long, env = "CADENCE_PAYLOAD_LIMIT", default_value_t = 2_000_000)]
    pub payload_limit: usize,

    /// API key required as `Authorization: Bearer KEY` on every route but /health,
    /// /metrics and /docs; repeat for several (the environment variable takes a
    /// comma-separated list).
    #[arg(
        long,
        env = "CADENCE_API_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_key: Vec<String>,

    /// File of API keys, one per line (blank lines and lines starting with # skipped):
    /// `KEY [TENANT] [OPTION=VALUE ...]`: TENANT accounts the key's requests under that
    /// name (several keys may share one; without it, `key-` and the first 8 hex digits of
    /// the key's SHA-256); options `tokens_per_minute=N`, `weight=W`, `role=admin`. Read
    /// again on SIGHUP and when its content changes.
    #[arg(long, env = "CADENCE_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,

    /// Tokens (prompt and generated) per minute per tenant beyond which its new requests
    /// get 429 with the seconds to wait; a key file's `tokens_per_minute=N` overrides it
    /// for that key's tenant. Unset: no token rate limit.
    #[arg(long, env = "CADENCE_MAX_TOKENS_PER_MINUTE_PER_KEY", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_tokens_per_minute_per_key: Option<u64>,

    /// Requests in flight per tenant (an API key's account) beyond which its new ones get
    /// 429, whatever the other tenants do. Unset: only --max-concurrent-requests.
    #[arg(long, env = "CADENCE_MAX_CONCURRENT_REQUESTS_PER_KEY", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_requests_per_key: Option<u32>,

    /// Origins allowed by CORS; repeat for several, or `*` for any. None: no CORS headers.
    #[arg(long, env = "CADENCE_CORS_ALLOW_ORIGIN", value_delimiter = ',')]
    pub cors_allow_origin: Vec<String>,

    /// Request headers CORS allows, comma-separated, or `*` for any. Unset: the headers
    /// each preflight asks for, so the official browser SDKs (OpenAI's `x-stainless-*`,
    /// Anthropic's `anthropic-*` and `x-api-key`) get through.
    #[arg(long, env = "CADENCE_CORS_ALLOW_HEADERS", value_delimiter = ',')]
    pub cors_allow_headers: Vec<String>,

    /// Methods CORS allows, comma-separated, or `*` for any [default: GET,POST].
    #[arg(long, env = "CADENCE_CORS_ALLOW_METHODS", value_delimiter = ',')]
    pub cors_allow_methods: Vec<String>,

    /// PEM certificate chain (the server's certificate first) to serve HTTPS with; needs
    /// --ssl-keyfile. Unset: plain HTTP.
    #[arg(long, env = "CADENCE_SSL_CERTFILE", requires = "ssl_keyfile")]
    pub ssl_certfile: Option<PathBuf>,

    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of --ssl-certfile's certificate.
    #[arg(long, env = "CADENCE_SSL_KEYFILE", requires = "ssl_certfile")]
    pub ssl_keyfile: Option<PathBuf>,

    /// Folder holding Swagger UI's swagger-ui-bundle.js and swagger-ui.css: /docs is then
    /// Swagger UI, its files served by the router. Unset: /docs is a small built-in page.
    /// Either way /docs loads nothing from another host.
    #[arg(long, env = "CADENCE_DOCS_ASSETS")]
    pub docs_assets: Option<PathBuf>,

    /// Log format.
    #[arg(long, env = "CADENCE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// /ready turns red when a step has been awaited this long and the shards do not
    /// answer their Health call within 1 s (a shard that answers is busy, not stuck).
    #[arg(long, env = "CADENCE_READY_STALL_TIMEOUT_MS", default_value_t = 5000)]
    pub ready_stall_timeout_ms: u64,

    /// Seconds the requests in flight get to finish after SIGTERM or SIGINT (new ones get
    /// 503); those still running then end with an error, and the router exits.
    #[arg(long, env = "CADENCE_SHUTDOWN_TIMEOUT", default_value_t = 30)]
    pub shutdown_timeout: u64,

    /// Seconds to wait at start for each shard's socket to accept a connection. `cadence
    /// launch` starts the router beside its shards (its tokenizer and templates load while
    /// the shards load the model) and passes its own start-up timeout here.
    #[arg(long, env = "CADENCE_SHARD_CONNECT_TIMEOUT", default_value_t = 60)]
    pub shard_connect_timeout: u64,

    /// Debug: compare every rank's Step answer with rank 0's and fail the step when they
    /// differ (tensor-parallel ranks must compute the same tokens).
    #[arg(long, env = "CADENCE_CHECK_RANK_AGREEMENT")]
    pub check_rank_agreement: bool,

    /// OpenTelemetry collector's OTLP/HTTP base URL (e.g. http://localhost:4318): each
    /// request's trace is exported to its /v1/traces [default: $OTEL_EXPORTER_OTLP_ENDPOINT;
    /// neither: no traces].
    #[arg(long, env = "CADENCE_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// The `service.name` of the exported traces.
    #[arg(long, env = "CADENCE_OTLP_SERVICE_NAME", default_value = "cadence")]
    pub otlp_service_name: String,
}

/// The KV cache the shards allocated at warm-up (the smallest rank's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCache {
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// The host pool for swap preemption the shards hold, in blocks (their warm-up's
    /// answer to `--swap-blocks`).
    pub host_blocks: usize,
}

/// The limits every request is checked against, resolved once at start from the flags,
/// the shard's `Info` and the KV cache.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_input_tokens: usize,
    pub max_total_tokens: usize,
    pub max_stop_sequences: usize,
    pub max_top_n_tokens: usize,
    pub max_best_of: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

impl Args {
    /// `--served-model-name`'s names (blanks dropped), or the model id.
    pub fn served_model_names(&self) -> Vec<String> {
        let names: Vec<String> = self
            .served_model_name
            .iter()
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() {
            vec![self.model_id.clone()]
        } else {
            names
        }
    }

    /// The shards' sockets split into one group per replica, in replica order.
    pub fn shard_groups(&self) -> Result<Vec<Vec<PathBuf>>, String> {
        let replicas = self.replicas as usize;
        let paths = &self.shard_uds_path;
        if !paths.len().is_multiple_of(replicas) {
            return Err(format!(
                "{} --shard-uds-path cannot be split into --replicas {replicas} groups of equal size",
                paths.len()
            ));
        }
        Ok(paths
            .chunks(paths.len() / replicas)
            .map(<[PathBuf]>::to_vec)
            .collect())
    }

    /// What every rank gets at warm-up.
    pub fn warmup_request(&self) -> pb::WarmupRequest {
        pb::WarmupRequest {
            max_batch_tokens: self.max_batch_tokens,
            max_batch_size: self.max_batch_size,
            kv_cache_bytes: self.kv_cache_bytes.unwrap_or(0),
            memory_fraction: self.memory_fraction.unwrap_or(0.0), // 0: the device's default
            replicas: self.replicas,
            swap_blocks: self.swap_blocks.unwrap_or(0), // 0: the shards' default
        }
    }

    /// Checks the flags that warm-up uses, before it runs, and the batching flags.
    pub fn check_warmup(&self) -> Result<(), String> {
        if self.max_batch_tokens == 0 || self.max_batch_size == 0 {
            return Err("max_batch_tokens and max_batch_size must be positive".into());
        }
        if self.scheduling_policy != SchedulingPolicyArg::Fcfs
            && self.batching != BatchingArg::Continuous
        {
            return Err(
                "--scheduling-policy fair and priority order continuous batching's \
                        admissions: use --batching continuous"
                    .into(),
            );
        }
        if let Some(fraction) = self.memory_fraction {
            if self.kv_cache_bytes.is_none() && !(fraction > 0.0 && fraction <= 1.0) {
                return Err(format!("--memory-fraction ({fraction}) must be in (0, 1]"));
            }
        }
        Ok(())
    }

    /// Resolves the token limits against the model's context length and the KV cache the
    /// shards allocated.
    pub fn limits(&self, max_position_embeddings: u32, cache: KvCache) -> Result<Limits, String> {
        let max_total = self.max_total_tokens.unwrap_or(max_position_embeddings) as usize;
        let max_input = match self.max_input_tokens {
            Some(n) => n as usize,
            None => max_total.saturating_sub(1),
        };
        if max_total == 0 || max_input == 0 {
            return Err("max_total_tokens and max_input_tokens must be positive".into());
        }
        if max_input >= max_total {
            return Err(format!(
                "max_input_tokens ({max_input}) must be less than max_total_tokens ({max_total})"
            ));
        }
        if max_position_embeddings > 0 && max_total > max_position_embeddings as usize {
            return Err(format!(
                "max_total_tokens ({max_total}) exceeds the model's max_position_embeddings \
                 ({max_position_embeddings})"
            ));
        }
        if self.max_best_of == 0 {
            return Err("max_best_of must be positive".into());
        }
        if cache.block_size == 0 || cache.num_blocks == 0 {
            return Err("block_size and num_blocks must be positive".into());
        }
        Ok(Limits {
            max_input_tokens: max_input,
            max_total_tokens: max_total,
            max_stop_sequences: self.max_stop_sequences,
            max_top_n_tokens: self.max_top_n_tokens,
            max_best_of: self.max_best_of,
            block_size: cache.block_size,
            num_blocks: cache.num_blocks,
        })
    }

    /// The scheduler's configuration from the flags and the KV cache.
    pub fn scheduler_config(&self, cache: KvCache) -> crate::scheduler::SchedulerConfig {
        use crate::scheduler::{Batching, Preemption, SchedulerConfig};
        let mut c = SchedulerConfig::new(
            self.max_batch_tokens as usize,
            self.max_batch_size as usize,
            cache.num_blocks,
            cache.block_size,
        );
        c.max_prefill_chunk = self.max_prefill_chunk as usize;
        c.preemption = match self.preemption {
            PreemptionArg::Recompute => Preemption::Recompute,
            PreemptionArg::Swap => Preemption::Swap,
        };
        c.swap_blocks = cache.host_blocks;
        c.prefix_caching = !self.no_prefix_caching;
        c.batching = match self.batching {
            BatchingArg::Continuous => Batching::Continuous,
            BatchingArg::Dynamic => Batching::Dynamic,
            BatchingArg::Static => Batching::Static,
            BatchingArg::None => Batching::None,
        };
        c.batch_timeout = std::time::Duration::from_millis(self.batch_timeout_ms);
        c.policy = self.scheduling_policy();
        c.max_adapters_per_batch = self.max_adapters_per_batch as usize;
        c
    }

    /// `--scheduling-policy`.
    pub fn scheduling_policy(&self) -> crate::scheduler::SchedulingPolicy {
        use crate::scheduler::SchedulingPolicy;
        match self.scheduling_policy {
            SchedulingPolicyArg::Fcfs => SchedulingPolicy::Fcfs,
            SchedulingPolicyArg::Fair => SchedulingPolicy::Fair,
            SchedulingPolicyArg::Priority => SchedulingPolicy::Priority,
        }
    }

    /// The LoRA settings.
    pub fn lora_config(&self) -> crate::lora::LoraConfig {
        crate::lora::LoraConfig {
            adapters: self.lora_adapters.clone(),
            dir: self.lora_dir.clone(),
            max_cpu_adapters: self.max_cpu_adapters as usize,
            max_adapters_per_batch: self.max_adapters_per_batch as usize,
            allow_runtime: self.allow_runtime_lora,
        }
    }

    /// Checks the speculative decoding flags against each other and what the shards
    /// offer (`draft_model`: the shards' draft model, "" without one).
    pub fn check_speculative(&self, draft_model: &str) -> Result<(), String> {
        let Some(method) = self.speculative else {
            return Ok(());
        };
        if self.num_speculative_tokens == 0 || self.num_speculative_tokens > 16 {
            return Err(format!(
                "--num-speculative-tokens ({}) must be in 1..=16",
                self.num_speculative_tokens
            ));
        }
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max {
            return Err(format!(
                "--ngram-min ({}) must be at least 1 and at most --ngram-max ({})",
                self.ngram_min, self.ngram_max
            ));
        }
        if method == SpeculativeArg::Draft && draft_model.is_empty() {
            return Err("--speculative draft needs the shards to run a draft model \
                        (--draft-model-id)"
                .into());
        }
        Ok(())
    }
}

/// Every flag's default as the command line spells it (`--port` → `8080`); flags without
/// one are absent. The Python CLI shows these rather than restating them.
pub fn flag_defaults() -> Vec<(String, String)> {
    Args::command()
        .get_arguments()
        .filter_map(|arg| {
            let long = arg.get_long()?;
            let values = arg.get_default_values();
            let shown: Vec<_> = values.iter().map(|v| v.to_string_lossy()).collect();
            (!shown.is_empty()).then(|| (format!("--{long}"), shown.join(",")))
        })
        .collect()
}

impl Args {
    /// The keys of --api-key (fixed for the life of the process).
    pub fn fixed_api_keys(&self) -> Vec<ApiKey> {
        self.api_key
            .iter()
            .filter(|k| !k.is_empty())
            .map(|k| ApiKey::bare(k))
            .collect()
    }

    /// Every accepted API key and its tenant: --api-key values and the lines of
    /// --api-key-file.
    pub fn api_keys(&self) -> Result<Vec<ApiKey>, String> {
        let mut keys = self.fixed_api_keys();
        if let Some(path) = &self.api_key_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read --api-key-file {}: {e}", path.display()))?;
            let file = crate::tenants::keys::parse_key_file(&text)
                .map_err(|e| format!("--api-key-file {} {e}", path.display()))?;
            if file.is_empty() {
                return Err(format!("--api-key-file {} holds no key", path.display()));
            }
            keys.extend(file);
        }
        for (flag, set) in [
            (
                "--max-tokens-per-minute-per-key",
                self.max_tokens_per_minute_per_key.is_some(),
            ),
            (
                "--max-concurrent-requests-per-key",
                self.max_concurrent_requests_per_key.is_some(),
            ),
        ] {
            if set && keys.is_empty() {
                return Err(format!(
                    "{flag} needs API keys (--api-key or --api-key-file)"
                ));
            }
        }
        Ok(keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CACHE: KvCache = KvCache {
        num_blocks: 100,
        block_size: 16,
        host_blocks: 400,
    };

    fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        let base = ["cadence-router", "--tokenizer", "/m", "--model-id", "m"];
        Args::try_parse_from(base.iter().chain(extra))
    }

    #[test]
    fn flags_parse_with_defaults_and_limits_derive_from_the_model() {
        let args = parse(&[
            "--shard-uds-path",
            "/tmp/a.sock",
            "--shard-uds-path",
            "/tmp/b.sock",
        ])
        .unwrap();
        assert_eq!(args.shard_uds_path.len(), 2);
        assert_eq!(args.port, 8080);
        let limits = args.limits(2048, CACHE).unwrap();
        assert_eq!(limits.max_total_tokens, 2048);
        assert_eq!(limits.max_input_tokens, 2047);
        assert_eq!((limits.num_blocks, limits.block_size), (100, 16));
    }

    #[test]
    fn replicas_split_the_sockets_into_equal_groups_in_order() {
        let args = parse(&["--shard-uds-path", "/a,/b,/c,/d", "--replicas", "2"]).unwrap();
        let groups = args.shard_groups().unwrap();
        let names: Vec<Vec<&str>> = groups
            .iter()
            .map(|g| g.iter().map(|p| p.to_str().unwrap()).collect())
            .collect();
        assert_eq!(names, vec![vec!["/a", "/b"], vec!["/c", "/d"]]);
        let uneven = parse(&["--shard-uds-path", "/a,/b,/c", "--replicas", "2"]).unwrap();
        assert!(uneven.shard_groups().unwrap_err().contains("--replicas 2"));
        assert!(parse(&["--shard-uds-path", "/a", "--replicas", "0"]).is_err());
    }

    #[test]
    fn shard_uds_path_is_required() {
        let err = parse(&[]).unwrap_err();
        assert!(err.to_string().contains("--shard-uds-path"));
    }

    #[test]
    fn warmup_asks_for_the_memory_fraction_unless_a_size_is_given() {
        let args = parse(&["--shard-uds-path", "/s", "--max-batch-tokens", "256"]).unwrap();
        let request = args.warmup_request();
        assert_eq!(
            (request.max_batch_tokens, request.max_batch_size),
            (256, 64)
        );
        // unset: 0 asks the shard for its device's default
        assert_eq!((request.kv_cache_bytes, request.memory_fraction), (0, 0.0));
        let share = parse(&["--shard-uds-path", "/s", "--memory-fraction", "0.5"]).unwrap();
        assert_eq!(share.warmup_request().memory_fraction, 0.5);
        let sized = parse(&["--shard-uds-path", "/s", "--kv-cache-bytes", "1048576"]).unwrap();
        assert_eq!(sized.warmup_request().kv_cache_bytes, 1 << 20);
        assert!(sized.check_warmup().is_ok());
        let bad = parse(&["--shard-uds-path", "/s", "--memory-fraction", "1.5"]).unwrap();
        assert!(bad.check_warmup().unwrap_err().contains("(0, 1]"));
    }

    #[test]
    fn a_scheduling_policy_reaches_the_scheduler_and_needs_continuous_batching() {
        use crate::scheduler::SchedulingPolicy;
        let args = parse(&["--shard-uds-path", "/s"]).unwrap();
        assert_eq!(args.scheduler_config(CACHE).policy, SchedulingPolicy::Fcfs);
        let fair = parse(&["--shard-uds-path", "/s", "--scheduling-policy", "fair"]).unwrap();
        assert_eq!(fair.scheduler_config(CACHE).policy, SchedulingPolicy::Fair);
        assert!(fair.check_warmup().is_ok());
        let static_ = ["--scheduling-policy", "priority", "--batching", "static"];
        let bad = parse(&[&["--shard-uds-path", "/s"][..], &static_].concat()).unwrap();
        assert!(bad
            .check_warmup()
            .unwrap_err()
            .contains("--batching continuous"));
    }

    #[test]
    fn the_host_pool_is_asked_of_the_shards_and_taken_from_their_answer() {
        let args = parse(&["--shard-uds-path", "/s"]).unwrap();
        assert_eq!(args.warmup_request().swap_blocks, 0); // the shards' default
        let args = parse(&["--shard-uds-path", "/s", "--swap-blocks", "7"]).unwrap();
        assert_eq!(args.warmup_request().swap_blocks, 7);
        let held = KvCache {
            host_blocks: 7,
            ..CACHE
        };
        assert_eq!(args.scheduler_config(held).swap_blocks, 7);
    }

    #[test]
    fn flag_defaults_spell_what_clap_parses() {
        let defaults: std::collections::HashMap<_, _> = flag_defaults().into_iter().collect();
        assert_eq!(defaults["--port"], "8080");
        assert!(!defaults.contains_key("--memory-fraction")); // the shard's device decides
        assert_eq!(defaults["--preemption"], "recompute");
        assert!(!defaults.contains_key("--max-input-tokens")); // derived from the model
        assert!(!defaults.contains_key("--kv-cache-bytes"));
        assert_eq!(defaults["--ready-stall-timeout-ms"], "5000");
        assert_eq!(defaults["--shutdown-timeout"], "30");
        assert!(!defaults.contains_key("--served-model-name")); // the model id
    }

    #[test]
    fn lora_flags_parse_into_the_lora_settings() {
        let args = parse(&[
            "--shard-uds-path",
            "/s",
            "--lora-adapters",
            "sql=/a/sql,chat=/a/chat",
            "--lora-adapters",
            "math=/a/math",
            "--lora-dir",
            "/loras",
            "--max-adapters-per-batch",
            "4",
        ])
        .unwrap();
        let lora = args.lora_config();
        let names: Vec<&str> = lora.adapters.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["sql", "chat", "math"]);
        assert_eq!(lora.dir.as_deref(), Some(std::path::Path::new("/loras")));
        assert_eq!(
            (lora.max_cpu_adapters, lora.max_adapters_per_batch),
            (64, 4)
        );
        assert!(lora.enabled() && !lora.allow_runtime);
        assert_eq!(args.scheduler_config(CACHE).max_adapters_per_batch, 4);
        let err = parse(&["--shard-uds-path", "/s", "--lora-adapters", "sql"]).unwrap_err();
        assert!(err.to_string().contains("name=path"), "{err}");
        let plain = parse(&["--shard-uds-path", "/s"]).unwrap();
        assert!(!plain.lora_config().enabled());
        let runtime = parse(&["--shard-uds-path", "/s", "--allow-runtime-lora"]).unwrap();
        assert!(runtime.lora_config().enabled());
        let defaults: std::collections::HashMap<_, _> = flag_defaults().into_iter().collect();
        assert_eq!(defaults["--max-cpu-adapters"], "64");
        assert_eq!(defaults["--max-adapters-per-batch"], "32");
    }

    #[test]
    fn the_served_model_name_defaults_to_the_model_id() {
        let args = parse(&["--shard-uds-path", "/s"]).unwrap();
        assert_eq!(args.served_model_names(), ["m"]);
        let args = parse(&["--shard-uds-path", "/s", "--served-model-name", "chat"]).unwrap();
        assert_eq!(args.served_model_names(), ["chat"]);
        let args = parse(&[
            "--shard-uds-path",
            "/s",
            "--served-model-name",
            "chat, gpt-x",
        ])
        .unwrap();
        assert_eq!(args.served_model_names(), ["chat", "gpt-x"]);
    }
}

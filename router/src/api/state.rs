//! What every handler shares: the batching loop, `/info`'s answer, the shards, the
//! readiness rule, the chat template and the stored responses.

use std::sync::Arc;

use serde::Serialize;

use super::store::ResponseStore;
use crate::chat::ChatTemplate;
use crate::client::ShardClient;
use crate::infer::Infer;
use crate::readiness::Readiness;
use crate::reasoning::ReasoningParser;

/// `GET /info`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Info {
    pub model_id: String,
    /// The name clients use: `/v1/models`, OpenAI answers' `model`, the metrics' labels
    /// (the first of `served_model_names`).
    pub served_model_name: String,
    /// Every name requests may give the base model (`--served-model-name a,b`), each
    /// listed by `/v1/models`.
    pub served_model_names: Vec<String>,
    pub model_dtype: String,
    pub model_device_type: String,
    pub model_pipeline_tag: &'static str,
    pub max_input_tokens: usize,
    pub max_total_tokens: usize,
    pub max_batch_tokens: usize,
    pub max_batch_size: usize,
    pub max_concurrent_requests: usize,
    /// `--scheduling-policy`: fcfs, fair or priority.
    pub scheduling_policy: &'static str,
    pub max_best_of: usize,
    pub max_stop_sequences: usize,
    pub max_top_n_tokens: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Tensor-parallel ranks of each replica.
    pub world_size: usize,
    /// Independent shard groups behind this router (`--replicas`).
    pub replicas: usize,
    /// What serves each kernel family on the shards: `isa` (the C++ CPU kernels'
    /// instruction set), `attention`, `products`, `norms`, `sampling`.
    pub kernels: std::collections::BTreeMap<String, String>,
    /// How weights and KV cache are stored: `weights` (the float dtype or the quantized
    /// formats), `kv_cache_dtype`, and with quantized weights `source`, `float_copy`,
    /// `quantized_max_rows`.
    pub quantization: std::collections::BTreeMap<String, String>,
    /// Speculative decoding, empty when off: `method`, `num_speculative_tokens`,
    /// `max_step_tokens` (the load switch's threshold) and where it came from
    /// (`threshold_source`), `draft_model`, `ngram` (`min..max`).
    pub speculative: std::collections::BTreeMap<String, String>,
    /// LoRA adapters, when any LoRA option is on (filled in when /info is asked: adapters
    /// come and go).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraInfo>,
    pub version: &'static str,
    pub router: &'static str,
}

impl Info {
    /// Whether a request's `model` names the base model: a served name or the model id.
    pub fn names_base_model(&self, model: &str) -> bool {
        model == self.model_id || self.served_model_names.iter().any(|n| n == model)
    }
}

/// `/info`'s `lora`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct LoraInfo {
    /// The adapters requests may name, by name.
    pub adapters: Vec<String>,
    pub max_cpu_adapters: usize,
    pub max_adapters_per_batch: usize,
    /// `--lora-dir`, when set.
    pub lora_dir: Option<String>,
    /// `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` are served.
    pub runtime_loading: bool,
}

impl LoraInfo {
    pub fn of(adapters: &crate::lora::Registry) -> Option<Self> {
        let config = adapters.config();
        config.enabled().then(|| Self {
            adapters: adapters.listed().into_iter().map(|a| a.name).collect(),
            max_cpu_adapters: config.max_cpu_adapters,
            max_adapters_per_batch: config.max_adapters_per_batch,
            lora_dir: config.dir.as_ref().map(|d| d.display().to_string()),
            runtime_loading: config.allow_runtime,
        })
    }
}

#[derive(Clone)]
pub struct AppState {
    pub infer: Infer,
    pub info: Info,
    /// Each replica's shards; empty only in tests without shards (/metrics then has no
    /// shard-side counters).
    pub shards: Vec<ShardClient>,
    /// What `/ready` asks the shards and how long it waits.
    pub readiness: Readiness,
    /// The model's chat template; `None` when it has none (chat completions answer 400).
    pub chat: Option<Arc<ChatTemplate>>,
    /// `--reasoning-parser`: how chat answers' reasoning is split from their content.
    pub reasoning: Option<ReasoningParser>,
    /// Finished Responses-API responses, for `GET /v1/responses/{id}` and follow-ups.
    pub responses: Arc<ResponseStore>,
}

//! Request bodies and their validation. Every rule answers 422 with a message naming the
//! field. Parameters follow TGI's names and meaning; every TGI parameter is a known
//! optional field (clients send many nulls) and an unknown one is an error.

use serde::Deserialize;

use crate::args::Limits;
use crate::detokenize::TokenizerInfo;
use crate::error::InferError;
use crate::pb;

/// max_new_tokens when the client gives none (clamped to what the context leaves).
pub const DEFAULT_MAX_NEW_TOKENS: usize = 100;
/// Most alternatives returned per token.
pub const MAX_TOP_N_TOKENS: u32 = 5;

/// `POST /generate`, `/generate_stream` and `/`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateRequest {
    pub inputs: String,
    #[serde(default)]
    pub parameters: Option<GenerateParameters>,
    /// Only meaningful on `/`, which streams when it is true.
    #[serde(default)]
    pub stream: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateParameters {
    pub best_of: Option<u32>,
    pub temperature: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub min_p: Option<f32>,
    pub do_sample: Option<bool>,
    pub max_new_tokens: Option<u32>,
    pub return_full_text: Option<bool>,
    pub stop: Option<Vec<String>>,
    pub truncate: Option<usize>,
    pub watermark: Option<bool>,
    pub details: Option<bool>,
    pub decoder_input_details: Option<bool>,
    pub seed: Option<u64>,
    pub top_n_tokens: Option<u32>,
    pub grammar: Option<serde_json::Value>,
    pub adapter_id: Option<String>,
}

/// A request that passed validation, tokenized.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub input_ids: Vec<u32>,
    pub sampling: pb::SamplingParams,
    /// The seed reported in details (`None` for greedy requests without a seed).
    pub seed: Option<u64>,
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub details: bool,
    /// The prompt, when `return_full_text` asks to prepend it.
    pub prefix: Option<String>,
    pub top_n_tokens: u32,
    pub adapter_id: String,
}

/// Checks requests against the limits and tokenizes them.
#[derive(Clone)]
pub struct Validation {
    pub tokenizer: TokenizerInfo,
    pub limits: Limits,
    pub model_id: String,
}

fn invalid(message: impl Into<String>) -> InferError {
    InferError::Validation(message.into())
}

/// The sampling parameters a request asks for, checked (no tokenization needed).
fn sampling(p: &GenerateParameters) -> Result<(pb::SamplingParams, Option<u64>), InferError> {
    let temperature = p.temperature.unwrap_or(1.0);
    if temperature <= 0.0 {
        return Err(invalid(format!(
            "parameters.temperature must be strictly positive, got {temperature}"
        )));
    }
    let top_p = p.top_p.unwrap_or(1.0);
    if top_p <= 0.0 || top_p > 1.0 {
        return Err(invalid(format!(
            "parameters.top_p must be in (0, 1], got {top_p}"
        )));
    }
    let typical_p = p.typical_p.unwrap_or(1.0);
    if typical_p <= 0.0 || typical_p > 1.0 {
        return Err(invalid(format!(
            "parameters.typical_p must be in (0, 1], got {typical_p}"
        )));
    }
    let min_p = p.min_p.unwrap_or(0.0);
    if !(0.0..1.0).contains(&min_p) {
        return Err(invalid(format!(
            "parameters.min_p must be in [0, 1), got {min_p}"
        )));
    }
    let top_k = match p.top_k {
        None => 0,
        Some(k) if k > 0 && k <= u32::MAX as i64 => k as u32,
        Some(k) => {
            return Err(invalid(format!(
                "parameters.top_k must be strictly positive, got {k}"
            )))
        }
    };
    let repetition_penalty = p.repetition_penalty.unwrap_or(1.0);
    if repetition_penalty <= 0.0 {
        return Err(invalid(format!(
            "parameters.repetition_penalty must be strictly positive, got {repetition_penalty}"
        )));
    }
    let frequency_penalty = p.frequency_penalty.unwrap_or(0.0);
    if !(-2.0..=2.0).contains(&frequency_penalty) {
        return Err(invalid(format!(
            "parameters.frequency_penalty must be in [-2, 2], got {frequency_penalty}"
        )));
    }
    let presence_penalty = p.presence_penalty.unwrap_or(0.0);
    if !(-2.0..=2.0).contains(&presence_penalty) {
        return Err(invalid(format!(
            "parameters.presence_penalty must be in [-2, 2], got {presence_penalty}"
        )));
    }
    // TGI's rule: any warper turns sampling on.
    let do_sample = p.do_sample.unwrap_or(false)
        || temperature != 1.0
        || top_k != 0
        || top_p < 1.0
        || typical_p < 1.0
        || min_p > 0.0;
    let seed = match (p.seed, do_sample) {
        (Some(seed), _) => Some(seed),
        (None, true) => Some(rand::random::<u64>()),
        (None, false) => None,
    };
    let params = pb::SamplingParams {
        do_sample,
        temperature,
        top_k,
        top_p,
        seed: seed.unwrap_or(0),
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
        typical_p,
        min_p,
    };
    Ok((params, seed))
}

impl Validation {
    /// Validates and tokenizes a request. Tokenization runs on the blocking pool.
    pub async fn validate(&self, request: GenerateRequest) -> Result<ValidRequest, InferError> {
        let p = request.parameters.unwrap_or_default();
        if request.inputs.is_empty() {
            return Err(invalid("inputs must not be empty"));
        }
        if let Some(b) = p.best_of {
            if b != 1 {
                return Err(invalid(format!(
                    "parameters.best_of: only 1 is supported for now, got {b}"
                )));
            }
        }
        if p.decoder_input_details == Some(true) {
            return Err(invalid(
                "parameters.decoder_input_details: true is not yet supported",
            ));
        }
        if p.watermark == Some(true) {
            return Err(invalid("parameters.watermark: true is not supported"));
        }
        if p.grammar.as_ref().is_some_and(|g| !g.is_null()) {
            return Err(invalid("parameters.grammar is not yet supported"));
        }
        let adapter_id = match p.adapter_id.as_deref() {
            None | Some("") => String::new(),
            Some(id) if id == self.model_id => String::new(),
            Some(id) => {
                return Err(invalid(format!(
                    "parameters.adapter_id: unknown adapter {id:?} (no adapters are loaded)"
                )))
            }
        };
        if p.max_new_tokens == Some(0) {
            return Err(invalid(
                "parameters.max_new_tokens must be strictly positive",
            ));
        }
        let top_n_tokens = p.top_n_tokens.unwrap_or(0);
        if top_n_tokens > MAX_TOP_N_TOKENS {
            return Err(invalid(format!(
                "parameters.top_n_tokens must be at most {MAX_TOP_N_TOKENS}, got {top_n_tokens}"
            )));
        }
        let stop = p.stop.clone().unwrap_or_default();
        if stop.len() > self.limits.max_stop_sequences {
            return Err(invalid(format!(
                "parameters.stop: at most {} stop sequences are allowed, got {}",
                self.limits.max_stop_sequences,
                stop.len()
            )));
        }
        if stop.iter().any(String::is_empty) {
            return Err(invalid("parameters.stop: stop sequences must not be empty"));
        }
        if let Some(t) = p.truncate {
            if t == 0 || t > self.limits.max_input_tokens {
                return Err(invalid(format!(
                    "parameters.truncate must be in [1, {}] (max_input_tokens), got {t}",
                    self.limits.max_input_tokens
                )));
            }
        }
        let (sampling, seed) = sampling(&p)?;

        let tokenizer = self.tokenizer.clone();
        let inputs = request.inputs;
        let (inputs, encoded) = tokio::task::spawn_blocking(move || {
            let ids = tokenizer.encode(&inputs);
            (inputs, ids)
        })
        .await
        .map_err(|e| invalid(format!("inputs: tokenization failed: {e}")))?;
        let mut input_ids =
            encoded.map_err(|e| invalid(format!("inputs: tokenization failed: {e}")))?;
        if let Some(t) = p.truncate {
            if input_ids.len() > t {
                input_ids.drain(..input_ids.len() - t);
            }
        }
        let input_len = input_ids.len();
        let limits = &self.limits;
        if input_len == 0 {
            return Err(invalid("inputs must not be empty (no tokens)"));
        }
        if input_len > limits.max_input_tokens {
            return Err(invalid(format!(
                "inputs must have less than {} tokens, got {input_len} (use parameters.truncate \
                 to keep the last tokens)",
                limits.max_input_tokens + 1
            )));
        }
        let max_new_tokens = match p.max_new_tokens {
            Some(n) => n as usize,
            None => DEFAULT_MAX_NEW_TOKENS.min(limits.max_total_tokens - input_len),
        };
        if input_len + max_new_tokens > limits.max_total_tokens {
            return Err(invalid(format!(
                "inputs tokens + parameters.max_new_tokens must be <= {}, got {input_len} + \
                 {max_new_tokens} = {}",
                limits.max_total_tokens,
                input_len + max_new_tokens
            )));
        }
        // The KV of every token but the last sampled one must fit in the cache, or the
        // request could never finish even alone.
        let kv_tokens = input_len + max_new_tokens - 1;
        let blocks = kv_tokens.div_ceil(limits.block_size);
        if blocks > limits.num_blocks {
            let field = if input_len.div_ceil(limits.block_size) > limits.num_blocks {
                "inputs"
            } else {
                "parameters.max_new_tokens"
            };
            return Err(invalid(format!(
                "{field}: {input_len} input tokens + {max_new_tokens} new tokens need {blocks} \
                 KV blocks but the cache holds {}",
                limits.num_blocks
            )));
        }
        Ok(ValidRequest {
            input_ids,
            sampling,
            seed,
            max_new_tokens,
            stop,
            details: p.details.unwrap_or(false),
            prefix: p.return_full_text.unwrap_or(false).then_some(inputs),
            top_n_tokens,
            adapter_id,
        })
    }
}

//! Request bodies and their validation. Every rule answers 422 with a message naming the
//! field. Parameters follow TGI's names and meaning; every TGI parameter is a known
//! optional field (clients send many nulls) and an unknown one is an error.

use std::collections::HashMap;

use serde::Deserialize;
use utoipa::ToSchema;

use crate::args::Limits;
use crate::constraints::{Compiled, Compiler, Constraint, Grammar};
use crate::detokenize::TokenizerInfo;
use crate::error::InferError;
use crate::pb;

mod beam;
pub use beam::{BeamSearch, EarlyStopping, Never, MAX_BEAM_WIDTH};

/// max_new_tokens when the client gives none (clamped to what the context leaves).
pub const DEFAULT_MAX_NEW_TOKENS: usize = 100;
/// Ends the message of a prompt over `max_input_tokens` (the APIs without `truncate`
/// leave it out).
pub const TRUNCATE_HINT: &str = " (use parameters.truncate to keep the last tokens)";
/// TGI's own way to turn sampling on, named after the fields every API has.
pub const DO_SAMPLE_HINT: &str = " (or parameters.do_sample)";

/// How a request's prompt arrives: text to tokenize, or token ids (OpenAI's completions).
#[derive(Debug, Clone)]
pub enum Prompt {
    /// `add_special`: add the tokenizer's BOS (false for rendered chat templates, which
    /// write their own).
    Text {
        text: String,
        add_special: bool,
    },
    Ids(Vec<u32>),
}

/// What a route asks for beyond TGI's parameters.
#[derive(Debug, Clone, Default)]
pub struct Extra {
    /// Token id -> bias added to its logit, each in [-100, 100].
    pub logit_bias: HashMap<u32, f32>,
    /// Samples returned (OpenAI's `n`); 0 means 1. `best_of` is how many are generated.
    pub n: u32,
    /// The answer is streamed: every sample is sent as it is generated, so none can be
    /// left out (`best_of` must equal `n`).
    pub stream: bool,
    /// What the output must match (OpenAI's `response_format`, vLLM's `guided_*`,
    /// tool calls); TGI's `parameters.grammar` is read by validation itself.
    pub constraint: Option<Constraint>,
}

/// `POST /generate`, `/generate_stream` and `/`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GenerateRequest {
    /// The prompt.
    #[schema(example = "What is deep learning?")]
    pub inputs: String,
    #[serde(default)]
    pub parameters: Option<GenerateParameters>,
    /// Only meaningful on `/`, which streams when it is true.
    #[serde(default)]
    pub stream: Option<bool>,
}

/// TGI's generation parameters. Sampling order: penalties, temperature, top-k, top-p,
/// typical-p, min-p.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GenerateParameters {
    /// Generate this many samples and return the one with the highest cumulative logprob
    /// (needs sampling; at most --max-best-of).
    pub best_of: Option<u32>,
    /// Divides the logits; > 0. Any value but 1 turns sampling on.
    pub temperature: Option<f32>,
    /// Divides positive (multiplies negative) logits of tokens already in the prompt or
    /// the output; > 0, 1 = off.
    pub repetition_penalty: Option<f32>,
    /// Subtracted from a logit once per occurrence in the output; [-2, 2].
    pub frequency_penalty: Option<f32>,
    /// Subtracted once from the logit of every token in the output; [-2, 2].
    pub presence_penalty: Option<f32>,
    /// Keep the k most likely tokens; > 0.
    pub top_k: Option<i64>,
    /// Keep the smallest set of tokens whose probability reaches top_p; (0, 1].
    pub top_p: Option<f32>,
    /// Locally typical sampling mass; (0, 1].
    pub typical_p: Option<f32>,
    /// Drop tokens less likely than min_p times the most likely; [0, 1).
    pub min_p: Option<f32>,
    /// Sample instead of greedy decoding.
    pub do_sample: Option<bool>,
    /// Most tokens to generate; > 0.
    pub max_new_tokens: Option<u32>,
    /// Prepend the prompt to generated_text.
    pub return_full_text: Option<bool>,
    /// Stop before these strings (at most --max-stop-sequences).
    pub stop: Option<Vec<String>>,
    /// Keep only the last `truncate` prompt tokens.
    pub truncate: Option<usize>,
    /// Not supported (must be false).
    pub watermark: Option<bool>,
    /// Return details: finish reason, tokens with logprobs, seed.
    pub details: Option<bool>,
    /// Return the prompt tokens with their logprobs in details.prefill.
    pub decoder_input_details: Option<bool>,
    /// Seed of the sampler: the same seed gives the same sample.
    pub seed: Option<u64>,
    /// Keep generating past the end-of-sequence token, up to max_new_tokens (vLLM's
    /// `ignore_eos`; for benchmarks that need exact output lengths).
    pub ignore_eos: Option<bool>,
    /// Return this many most likely alternatives per token (at most --max-top-n-tokens).
    pub top_n_tokens: Option<u32>,
    /// Constrains the output: `{"type": "json", "value": <JSON schema>}` or
    /// `{"type": "regex", "value": "<regular expression>"}`.
    #[schema(value_type = Option<Object>)]
    pub grammar: Option<serde_json::Value>,
    /// A LoRA adapter's name (`--lora-adapters`, `--lora-dir`, `/v1/load_lora_adapter`);
    /// the base model's id or null for the base model.
    pub adapter_id: Option<String>,
    /// Under `--scheduling-policy priority`, lower runs first [default: 0]; ignored by
    /// the other policies.
    pub priority: Option<i64>,
    /// Beam search of this width (cadence's own field; greedy, not streamed): the best
    /// beam answers, the others come in details.best_of_sequences; in [1, 32].
    pub num_beams: Option<u32>,
    /// Beam search: a finished beam's score is its cumulative logprob divided by its
    /// length to this power [default: 1].
    pub length_penalty: Option<f32>,
    /// Beam search: true, false or "never", as transformers defines them [default: false].
    #[schema(value_type = Option<Object>)]
    pub early_stopping: Option<EarlyStopping>,
}

/// A request that passed validation, tokenized.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub input_ids: Vec<u32>,
    /// Samples returned, and samples generated (`best_of >= n`); siblings of one prompt.
    pub n: usize,
    pub best_of: usize,
    /// Return the prompt tokens' logprobs (with the first event).
    pub prompt_logprobs: bool,
    pub sampling: pb::SamplingParams,
    /// The seed reported in details (`None` for greedy requests without a seed).
    pub seed: Option<u64>,
    pub max_new_tokens: usize,
    /// EOS does not end the request; only length and stop strings do.
    pub ignore_eos: bool,
    pub stop: Vec<String>,
    pub details: bool,
    /// The prompt, when `return_full_text` asks to prepend it.
    pub prefix: Option<String>,
    pub top_n_tokens: u32,
    pub adapter_id: String,
    /// The grammar its output must match, compiled.
    pub grammar: Option<Compiled>,
    /// How long compiling it took (`None`: unconstrained, or found in the cache).
    pub grammar_compile_time: Option<std::time::Duration>,
    /// `--scheduling-policy priority`: lower runs first.
    pub priority: i64,
    /// Beam search (`best_of` is then its width, `n` the beams returned).
    pub beam: Option<BeamSearch>,
}

/// Structured outputs' compiler, or why there is none (the tokenizer's vocabulary could
/// not be read as bytes).
pub type Constraints = Result<std::sync::Arc<Compiler>, String>;

/// Checks requests against the limits and tokenizes them.
#[derive(Clone)]
pub struct Validation {
    pub tokenizer: TokenizerInfo,
    pub limits: Limits,
    pub model_id: String,
    pub constraints: Constraints,
}

fn invalid(message: impl Into<String>) -> InferError {
    InferError::Validation(message.into())
}

/// The sampling parameters a request asks for, checked (no tokenization needed).
fn sampling(
    p: &GenerateParameters,
    logit_bias: HashMap<u32, f32>,
) -> Result<(pb::SamplingParams, Option<u64>), InferError> {
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
        logit_bias,
    };
    Ok((params, seed))
}

impl Validation {
    /// Validates any route's request: a prompt, TGI's parameters and the extras.
    /// Tokenization runs on the blocking pool.
    pub async fn validate_prompt(
        &self,
        prompt: Prompt,
        p: GenerateParameters,
        extra: Extra,
    ) -> Result<ValidRequest, InferError> {
        let limits = &self.limits;
        if matches!(&prompt, Prompt::Text { text, .. } if text.is_empty())
            || matches!(&prompt, Prompt::Ids(ids) if ids.is_empty())
        {
            return Err(invalid("inputs must not be empty"));
        }
        let n = extra.n.max(1) as usize;
        let best_of = p.best_of.map_or(n, |b| b as usize);
        // A beam search's width has its own limit (`beam::check`).
        if best_of == 0 || (best_of > limits.max_best_of && p.num_beams.is_none()) {
            return Err(invalid(format!(
                "parameters.best_of must be in [1, {}] (max_best_of), got {best_of}",
                limits.max_best_of
            )));
        }
        if best_of < n {
            return Err(invalid(format!(
                "parameters.best_of ({best_of}) must be at least n ({n})"
            )));
        }
        if let Some((&id, &bias)) = extra.logit_bias.iter().find(|(&id, &b)| {
            id as usize >= self.tokenizer.vocab_size() || !(-100.0..=100.0).contains(&b)
        }) {
            return Err(invalid(format!(
                "logit_bias: token {id} must be a token id below {} with a bias in [-100, 100], \
                 got {bias}",
                self.tokenizer.vocab_size()
            )));
        }
        if p.watermark == Some(true) {
            return Err(invalid("parameters.watermark: true is not supported"));
        }
        let constraint = match p.grammar.as_ref().filter(|g| !g.is_null()) {
            Some(grammar) => Some(tgi_grammar(grammar)?),
            None => extra.constraint.clone(),
        };
        // The base model, or an adapter's name (which `Infer::submit` resolves).
        let adapter_id = match p.adapter_id.as_deref() {
            None | Some("") => String::new(),
            Some(id) if id == self.model_id => String::new(),
            Some(id) => id.to_string(),
        };
        if p.max_new_tokens == Some(0) {
            return Err(invalid(
                "parameters.max_new_tokens must be strictly positive",
            ));
        }
        let top_n_tokens = p.top_n_tokens.unwrap_or(0);
        if top_n_tokens as usize > limits.max_top_n_tokens {
            return Err(invalid(format!(
                "parameters.top_n_tokens must be at most {} (max_top_n_tokens), got \
                 {top_n_tokens}",
                limits.max_top_n_tokens
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
        let (sampling, seed) = sampling(&p, extra.logit_bias.clone())?;
        let beam = beam::check(&p, &sampling, extra.stream, n, constraint.is_some())?;
        let best_of = beam.map_or(best_of, |b| b.width);
        // Choosing among samples needs them to differ; n greedy copies are allowed.
        if best_of > n && !sampling.do_sample && beam.is_none() {
            return Err(invalid(format!(
                "parameters.best_of ({best_of}) > 1 needs sampling: set a temperature, top_k, \
                 top_p, typical_p or min_p{DO_SAMPLE_HINT}"
            )));
        }

        let (inputs, mut input_ids) = match prompt {
            Prompt::Text { text, add_special } => {
                let tokenizer = self.tokenizer.clone();
                let (text, encoded) = tokio::task::spawn_blocking(move || {
                    let ids = tokenizer.encode_with(&text, add_special);
                    (text, ids)
                })
                .await
                .map_err(|e| invalid(format!("inputs: tokenization failed: {e}")))?;
                let ids =
                    encoded.map_err(|e| invalid(format!("inputs: tokenization failed: {e}")))?;
                (text, ids)
            }
            Prompt::Ids(ids) => {
                let vocab = self.tokenizer.vocab_size();
                if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(invalid(format!(
                        "inputs: token id {bad} is out of the vocabulary (size {vocab})"
                    )));
                }
                (self.tokenizer.decode_all(&ids), ids)
            }
        };
        if let Some(t) = p.truncate {
            if input_ids.len() > t {
                input_ids.drain(..input_ids.len() - t);
            }
        }
        let input_len = input_ids.len();
        if input_len == 0 {
            return Err(invalid("inputs must not be empty (no tokens)"));
        }
        if input_len > limits.max_input_tokens {
            return Err(invalid(format!(
                "inputs must have less than {} tokens (max_input_tokens), got {input_len}\
                 {TRUNCATE_HINT}",
                limits.max_input_tokens + 1
            )));
        }
        let max_new_tokens = match p.max_new_tokens {
            Some(n) => n as usize,
            None => DEFAULT_MAX_NEW_TOKENS.min(limits.max_total_tokens - input_len),
        };
        if input_len + max_new_tokens > limits.max_total_tokens {
            return Err(invalid(format!(
                "inputs tokens + parameters.max_new_tokens must be <= {} (max_total_tokens), got \
                 {input_len} + {max_new_tokens} = {}",
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
        if extra.stream && best_of > n {
            return Err(invalid(format!(
                "parameters.best_of > {n} is not supported when streaming"
            )));
        }
        let (grammar, grammar_compile_time) = match &constraint {
            None => (None, None),
            Some(constraint) => {
                let compiler = self.constraints.as_ref().map_err(|why| {
                    invalid(format!(
                        "{}: structured outputs are unavailable for this model: {why}",
                        constraint.field
                    ))
                })?;
                let (compiled, took) = compiler
                    .compile(constraint)
                    .await
                    .map_err(|e| invalid(e.0))?;
                (Some(compiled), took)
            }
        };
        Ok(ValidRequest {
            input_ids,
            n,
            best_of,
            prompt_logprobs: p.decoder_input_details.unwrap_or(false),
            sampling,
            seed,
            max_new_tokens,
            ignore_eos: p.ignore_eos.unwrap_or(false),
            stop,
            details: p.details.unwrap_or(false),
            prefix: p.return_full_text.unwrap_or(false).then_some(inputs),
            top_n_tokens,
            adapter_id,
            grammar,
            grammar_compile_time,
            priority: p.priority.unwrap_or(0),
            beam,
        })
    }
}

/// TGI's `parameters.grammar`: `{"type": "json", "value": <schema, or a string holding
/// one>}` or `{"type": "regex", "value": "<regex>"}`.
fn tgi_grammar(grammar: &serde_json::Value) -> Result<Constraint, InferError> {
    let field = "parameters.grammar";
    let kind = grammar.get("type").and_then(|t| t.as_str()).unwrap_or("");
    let value = grammar
        .get("value")
        .filter(|v| !v.is_null())
        .ok_or_else(|| invalid(format!("{field}.value is required")))?;
    let grammar = match kind {
        "json" | "json_schema" => Grammar::json_schema(value.clone())
            .map_err(|message| invalid(format!("{field}.value {message}")))?,
        "regex" => match value.as_str() {
            Some(regex) if !regex.is_empty() => Grammar::Regex(regex.to_string()),
            _ => {
                return Err(invalid(format!(
                    "{field}.value must be a non-empty regular expression"
                )))
            }
        },
        other => {
            return Err(invalid(format!(
                "{field}.type must be \"json\" or \"regex\", got {other:?}"
            )))
        }
    };
    Ok(Constraint::new(field, grammar))
}

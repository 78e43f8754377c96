//! The sampling fields both routes share, turned into TGI's `GenerateParameters` plus
//! `Extra`'s `logit_bias` and `n`.

use std::collections::HashMap;

use serde::Deserialize;
use utoipa::ToSchema;

use super::error::ApiError;
use crate::validation::{Extra, GenerateParameters};

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

impl StopInput {
    fn into_vec(self) -> Vec<String> {
        match self {
            StopInput::One(s) => vec![s],
            StopInput::Many(v) => v,
        }
    }
}

/// What a request asks of the sampler, with vLLM's extensions (top_k, min_p, typical_p,
/// repetition_penalty, ignore_eos). Each route fills it from its own request shape.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<u32>,
    pub best_of: Option<u32>,
    pub stop: Option<StopInput>,
    pub seed: Option<u64>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub max_tokens: Option<u32>,
    /// Alternatives returned per token.
    pub top_n: Option<u32>,
    pub prompt_logprobs: bool,
    /// Return the prompt before the generated text.
    pub echo: bool,
    pub ignore_eos: Option<bool>,
}

impl Sampling {
    pub fn into_parameters(self) -> Result<(GenerateParameters, Extra), ApiError> {
        // OpenAI samples by default; temperature 0 is greedy.
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                format!("must be in [0, 2], got {temperature}"),
            ));
        }
        let n = self.n.unwrap_or(1);
        if n == 0 {
            return Err(ApiError::invalid("n", "must be at least 1"));
        }
        let mut logit_bias = HashMap::new();
        for (token, bias) in self.logit_bias.unwrap_or_default() {
            let id = token.parse::<u32>().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("keys must be token ids, got {token:?}"),
                )
            })?;
            logit_bias.insert(id, bias);
        }
        let greedy = temperature == 0.0;
        // A greedy request drops the sampling filters: they would change nothing.
        let when_sampling = |v: Option<f32>| if greedy { None } else { v };
        let parameters = GenerateParameters {
            best_of: self.best_of,
            temperature: (!greedy).then_some(temperature),
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            top_k: if greedy {
                None
            } else {
                // -1 is vLLM's "no top-k".
                self.top_k.filter(|&k| k != -1)
            },
            top_p: when_sampling(self.top_p),
            typical_p: when_sampling(self.typical_p),
            min_p: when_sampling(self.min_p),
            do_sample: Some(!greedy),
            max_new_tokens: self.max_tokens,
            return_full_text: Some(self.echo),
            stop: self.stop.map(StopInput::into_vec),
            details: Some(true),
            decoder_input_details: Some(self.prompt_logprobs),
            seed: self.seed,
            top_n_tokens: self.top_n,
            ignore_eos: self.ignore_eos,
            ..Default::default()
        };
        let extra = Extra {
            logit_bias,
            n,
            ..Extra::default()
        };
        Ok((parameters, extra))
    }
}

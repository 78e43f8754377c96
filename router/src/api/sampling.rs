//! The sampling fields every generating API shares, declared once, and what they become:
//! TGI's `GenerateParameters` plus `Extra`'s `logit_bias` and `n`.

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

/// Declares a struct with the sampling fields of OpenAI's request shapes (with vLLM's
/// extensions: top_k, min_p, typical_p, repetition_penalty, ignore_eos) after its own:
/// `SamplingFields` (the fields alone, which the other APIs fill with the few they
/// have) and each OpenAI request, which also gets `take_sampling`.
///
/// Not `#[serde(flatten)]`: serde reads a flattened struct from a buffered copy of the
/// body, so its type errors would lose their field's path (and the `param` a 400 names)
/// and their position in the body.
macro_rules! with_sampling_fields {
    (@fields $(#[$meta:meta])* $vis:vis struct $name:ident { $($body:tt)* }) => {
        $(#[$meta])*
        $vis struct $name {
            $($body)*
            /// [0, 2]; 0 is greedy [default: 1].
            pub temperature: Option<f32>,
            pub top_p: Option<f32>,
            /// Choices (per prompt) [default: 1].
            pub n: Option<u32>,
            pub stop: Option<$crate::api::sampling::StopInput>,
            pub seed: Option<u64>,
            pub frequency_penalty: Option<f32>,
            pub presence_penalty: Option<f32>,
            /// Token id (as a string) -> bias in [-100, 100] added to its logit.
            pub logit_bias: Option<std::collections::HashMap<String, f32>>,
            pub top_k: Option<i64>,
            pub min_p: Option<f32>,
            pub typical_p: Option<f32>,
            pub repetition_penalty: Option<f32>,
            /// vLLM's extension: generate past the end-of-sequence token up to the token
            /// limit.
            pub ignore_eos: Option<bool>,
            /// vLLM's extension: under `--scheduling-policy priority`, lower runs first
            /// [default: 0]; ignored by the other policies.
            pub priority: Option<i64>,
            /// vLLM's extension: beam search, `best_of` (or `n`) beams wide, the `n`
            /// best returned; greedy, not streamed.
            pub use_beam_search: Option<bool>,
            /// Beam search: a finished beam's score is its cumulative logprob divided by
            /// its length to this power [default: 1].
            pub length_penalty: Option<f32>,
            /// Beam search: true, false or "never", as transformers defines them
            /// [default: false].
            pub early_stopping: Option<$crate::validation::EarlyStopping>,
        }
    };
    ($(#[$meta:meta])* pub struct $name:ident { $($body:tt)* }) => {
        $crate::api::sampling::with_sampling_fields! {
            @fields $(#[$meta])* pub struct $name { $($body)* }
        }

        impl $name {
            /// The sampling fields, taken out of the request.
            pub(crate) fn take_sampling(&mut self) -> $crate::api::sampling::SamplingFields {
                $crate::api::sampling::SamplingFields {
                    temperature: self.temperature.take(),
                    top_p: self.top_p.take(),
                    n: self.n.take(),
                    stop: self.stop.take(),
                    seed: self.seed.take(),
                    frequency_penalty: self.frequency_penalty.take(),
                    presence_penalty: self.presence_penalty.take(),
                    logit_bias: self.logit_bias.take(),
                    top_k: self.top_k.take(),
                    min_p: self.min_p.take(),
                    typical_p: self.typical_p.take(),
                    repetition_penalty: self.repetition_penalty.take(),
                    ignore_eos: self.ignore_eos.take(),
                    priority: self.priority.take(),
                    use_beam_search: self.use_beam_search.take(),
                    length_penalty: self.length_penalty.take(),
                    early_stopping: self.early_stopping.take(),
                }
            }
        }
    };
}
pub(crate) use with_sampling_fields;

with_sampling_fields! {
    @fields
    /// What a request sets of the sampling fields.
    #[derive(Debug, Clone, Default)]
    pub(crate) struct SamplingFields {}
}

/// What a request asks of the sampler: its sampling fields and what each route sets its
/// own way.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sampling {
    pub fields: SamplingFields,
    pub best_of: Option<u32>,
    pub max_tokens: Option<u32>,
    /// Alternatives returned per token.
    pub top_n: Option<u32>,
    pub prompt_logprobs: bool,
    /// Return the prompt before the generated text.
    pub echo: bool,
}

impl Sampling {
    pub fn into_parameters(self) -> Result<(GenerateParameters, Extra), ApiError> {
        let f = self.fields;
        // OpenAI samples by default; temperature 0 is greedy.
        let temperature = f.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                format!("must be in [0, 2], got {temperature}"),
            ));
        }
        let n = f.n.unwrap_or(1);
        if n == 0 {
            return Err(ApiError::invalid("n", "must be at least 1"));
        }
        let beam = super::beam::check(&f, self.best_of, n)?;
        let mut logit_bias = HashMap::new();
        for (token, bias) in f.logit_bias.unwrap_or_default() {
            let id = token.parse::<u32>().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("keys must be token ids, got {token:?}"),
                )
            })?;
            logit_bias.insert(id, bias);
        }
        let greedy = temperature == 0.0 || beam.num_beams.is_some();
        // A greedy request drops the sampling filters: they would change nothing.
        let when_sampling = |v: Option<f32>| if greedy { None } else { v };
        let mut parameters = GenerateParameters {
            best_of: self.best_of,
            temperature: (!greedy).then_some(temperature),
            repetition_penalty: f.repetition_penalty,
            frequency_penalty: f.frequency_penalty,
            presence_penalty: f.presence_penalty,
            top_k: if greedy {
                None
            } else {
                // -1 is vLLM's "no top-k".
                f.top_k.filter(|&k| k != -1)
            },
            top_p: when_sampling(f.top_p),
            typical_p: when_sampling(f.typical_p),
            min_p: when_sampling(f.min_p),
            do_sample: Some(!greedy),
            max_new_tokens: self.max_tokens,
            return_full_text: Some(self.echo),
            stop: f.stop.map(StopInput::into_vec),
            details: Some(true),
            decoder_input_details: Some(self.prompt_logprobs),
            seed: f.seed,
            top_n_tokens: self.top_n,
            ignore_eos: f.ignore_eos,
            priority: f.priority,
            ..Default::default()
        };
        beam.set(&mut parameters);
        let extra = Extra {
            logit_bias,
            n,
            ..Extra::default()
        };
        Ok((parameters, extra))
    }
}

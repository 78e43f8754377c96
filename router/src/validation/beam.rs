//! Beam search's parameters: `parameters.num_beams` (cadence's own TGI field; OpenAI's
//! `use_beam_search` maps to it), `length_penalty` and `early_stopping`, and the rules a
//! beam request follows. Beam search is deterministic (greedy ranking of every beam's
//! most likely continuations), so it refuses what would contradict that or what it
//! cannot give back: sampling, a stream, stop strings, a grammar, prompt logprobs.

use serde::Deserialize;
use utoipa::ToSchema;

use super::{invalid, GenerateParameters};
use crate::error::InferError;
use crate::pb;

/// The widest beam a request may ask for: every beam is a row of the batch, and each
/// row returns twice the width of candidates.
pub const MAX_BEAM_WIDTH: usize = 32;

/// When a beam search stops, as transformers' `early_stopping` defines it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum EarlyStopping {
    /// `true`: as soon as `width` hypotheses are finished; `false`: when no running beam
    /// can beat the worst finished one at its current length (the default).
    Flag(bool),
    /// `"never"`: when no running beam can beat it at any length it may reach.
    Never(Never),
    #[serde(skip)]
    #[default]
    Default,
}

/// The string `"never"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Never {
    Never,
}

impl EarlyStopping {
    pub fn is_true(self) -> bool {
        self == Self::Flag(true)
    }

    pub fn is_never(self) -> bool {
        matches!(self, Self::Never(_))
    }

    /// The default (`false`) when nothing was sent.
    pub fn is_default(self) -> bool {
        matches!(self, Self::Default | Self::Flag(false))
    }
}

/// A validated beam search.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BeamSearch {
    pub width: usize,
    /// The score of a finished hypothesis is its cumulative logprob divided by its length
    /// (generated tokens, the last one included) to this power.
    pub length_penalty: f32,
    pub early_stopping: EarlyStopping,
}

/// What a beam request asks, checked against everything else it sets: `None` for a
/// request without `num_beams` (which must then leave `length_penalty` and
/// `early_stopping` at their defaults, as vLLM requires).
pub(super) fn check(
    p: &GenerateParameters,
    sampling: &pb::SamplingParams,
    stream: bool,
    n: usize,
    constrained: bool,
) -> Result<Option<BeamSearch>, InferError> {
    let length_penalty = p.length_penalty.unwrap_or(1.0);
    let early_stopping = p.early_stopping.unwrap_or_default();
    let Some(width) = p.num_beams else {
        if length_penalty != 1.0 {
            return Err(invalid(
                "parameters.length_penalty applies to beam search only: set \
                 parameters.num_beams, or leave it at 1",
            ));
        }
        if !early_stopping.is_default() {
            return Err(invalid(
                "parameters.early_stopping applies to beam search only: set \
                 parameters.num_beams, or leave it out",
            ));
        }
        return Ok(None);
    };
    let width = width as usize;
    if width == 0 || width > MAX_BEAM_WIDTH {
        return Err(invalid(format!(
            "parameters.num_beams must be in [1, {MAX_BEAM_WIDTH}], got {width}"
        )));
    }
    if !length_penalty.is_finite() {
        return Err(invalid(format!(
            "parameters.length_penalty must be a finite number, got {length_penalty}"
        )));
    }
    if n > width {
        return Err(invalid(format!(
            "parameters.num_beams ({width}) must be at least the sequences returned ({n})"
        )));
    }
    if p.best_of.is_some_and(|b| b as usize != width) {
        return Err(invalid(
            "parameters.best_of: leave it out with num_beams (the beams are the candidates)",
        ));
    }
    if sampling.do_sample {
        let field = [
            ("do_sample", p.do_sample == Some(true)),
            ("temperature", p.temperature.is_some_and(|t| t != 1.0)),
            ("top_k", p.top_k.is_some()),
            ("top_p", p.top_p.is_some_and(|v| v < 1.0)),
            ("typical_p", p.typical_p.is_some_and(|v| v < 1.0)),
            ("min_p", p.min_p.is_some_and(|v| v > 0.0)),
        ]
        .into_iter()
        .find_map(|(name, set)| set.then_some(name))
        .unwrap_or("do_sample");
        return Err(invalid(format!(
            "parameters.{field}: beam search is greedy (it ranks every beam's most likely \
             tokens); leave the sampling parameters out"
        )));
    }
    if stream {
        return Err(invalid(
            "parameters.num_beams: beam search cannot stream (the best beam is known only \
             at the end)",
        ));
    }
    let unsupported = [
        ("stop", p.stop.as_ref().is_some_and(|s| !s.is_empty())),
        ("grammar", constrained),
        (
            "decoder_input_details",
            p.decoder_input_details == Some(true),
        ),
    ];
    if let Some((field, _)) = unsupported.into_iter().find(|(_, set)| *set) {
        return Err(invalid(format!(
            "parameters.{field} is not supported with beam search"
        )));
    }
    if p.top_n_tokens.is_some_and(|k| k as usize > 2 * width) {
        return Err(invalid(format!(
            "parameters.top_n_tokens must be at most 2 × num_beams ({}) with beam search",
            2 * width
        )));
    }
    Ok(Some(BeamSearch {
        width,
        length_penalty,
        early_stopping,
    }))
}

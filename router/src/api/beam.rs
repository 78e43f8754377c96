//! vLLM's beam search fields on the OpenAI routes: `use_beam_search: true` makes `best_of`
//! (or `n` without it) the beam width and returns the `n` best beams; `length_penalty`
//! and `early_stopping` as transformers defines them. Beam search is greedy, as vLLM's
//! in-engine beam search was: `temperature` must be 0 or left out, the sampling filters
//! at their defaults. Errors name the OpenAI field.

use super::error::ApiError;
use super::sampling::SamplingFields;
use crate::validation::{EarlyStopping, GenerateParameters, MAX_BEAM_WIDTH};

/// The beam search a request asks for, in TGI's parameters.
pub(super) struct Beam {
    pub num_beams: Option<u32>,
    length_penalty: Option<f32>,
    early_stopping: Option<EarlyStopping>,
}

impl Beam {
    /// Sets `parameters`' beam search (`best_of` is then the width: left out).
    pub fn set(self, parameters: &mut GenerateParameters) {
        parameters.length_penalty = self.length_penalty;
        parameters.early_stopping = self.early_stopping;
        if self.num_beams.is_some() {
            parameters.num_beams = self.num_beams;
            parameters.best_of = None;
        }
    }
}

/// Checks the request's beam search fields; `best_of` and `n` as sent.
pub(super) fn check(f: &SamplingFields, best_of: Option<u32>, n: u32) -> Result<Beam, ApiError> {
    let mut beam = Beam {
        num_beams: None,
        length_penalty: f.length_penalty,
        early_stopping: f.early_stopping,
    };
    if f.use_beam_search != Some(true) {
        return Ok(beam);
    }
    if f.temperature.is_some_and(|t| t != 0.0) {
        return Err(ApiError::invalid(
            "temperature",
            "must be 0 or left out with use_beam_search (beam search is greedy)",
        ));
    }
    let filters = [
        ("top_p", f.top_p.is_some_and(|v| v < 1.0)),
        ("top_k", f.top_k.is_some_and(|k| k != -1 && k != 0)),
        ("min_p", f.min_p.is_some_and(|v| v > 0.0)),
        ("typical_p", f.typical_p.is_some_and(|v| v < 1.0)),
    ];
    if let Some((field, _)) = filters.into_iter().find(|(_, set)| *set) {
        return Err(ApiError::invalid(
            field,
            "must be left at its default with use_beam_search (beam search is greedy)",
        ));
    }
    let (field, width) = match best_of {
        Some(b) => ("best_of", b),
        None => ("n", n),
    };
    if width == 0 || width as usize > MAX_BEAM_WIDTH {
        return Err(ApiError::invalid(
            field,
            format!(
                "the beam width must be in [1, {MAX_BEAM_WIDTH}] with use_beam_search, got {width}"
            ),
        ));
    }
    if n > width {
        return Err(ApiError::invalid(
            "n",
            format!("must be at most best_of ({width}), the beam width"),
        ));
    }
    beam.num_beams = Some(width);
    Ok(beam)
}

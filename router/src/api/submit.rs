//! What every API does around the batching loop: submit a prepared request's prompts,
//! read every sample to its end, and count what was computed.

use axum::http::HeaderMap;
use serde::Serialize;
use utoipa::ToSchema;

use super::error::ApiError;
use super::headers::timing_headers;
use super::names::ParamNames;
use super::sampling::Sampling;
use super::state::AppState;
use crate::constraints::Constraint;
use crate::infer::{collect, Sample, Submitted};
use crate::validation::{Extra, GenerateParameters, Prompt, ValidRequest};

/// Tokens read and written, in OpenAI's shape.
#[derive(Debug, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// A request as every API hands it to the batching loop: TGI's parameters and the
/// extras, checked, with the adapter, the streaming and the output constraint set.
pub(crate) struct Generation {
    parameters: GenerateParameters,
    extra: Extra,
}

impl Generation {
    /// The sampling asked (checked here), for the adapter `model` named.
    pub fn new(
        sampling: Sampling,
        adapter: Option<String>,
        stream: bool,
    ) -> Result<Self, ApiError> {
        let (mut parameters, mut extra) = sampling.into_parameters()?;
        if stream && parameters.num_beams.is_some() {
            return Err(ApiError::invalid(
                "use_beam_search",
                "cannot be streamed: the best beam is known only at the end",
            ));
        }
        parameters.adapter_id = adapter;
        extra.stream = stream;
        Ok(Self { parameters, extra })
    }

    /// The output held to `constraint` (a format or the tools' grammar).
    pub fn constrained(mut self, constraint: Option<Constraint>) -> Self {
        self.extra.constraint = constraint;
        self
    }

    /// Choices per prompt.
    pub fn n(&self) -> usize {
        self.extra.n.max(1) as usize
    }

    /// Submits every prompt with the same parameters; the first rejection answers for all
    /// (the ones already queued are cancelled when dropped), in the API's `names`.
    pub async fn submit(
        self,
        state: &AppState,
        prompts: Vec<Prompt>,
        names: &ParamNames,
    ) -> Result<Vec<Submitted>, ApiError> {
        let mut submitted = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            let s = state
                .infer
                .submit(prompt, self.parameters.clone(), self.extra.clone())
                .await
                .map_err(|e| ApiError::from_infer(e, names))?;
            submitted.push(s);
        }
        Ok(submitted)
    }
}

/// One prompt, generated to the end: every sample (`best_of` of them), in sample order.
pub(crate) struct Answered {
    pub request: ValidRequest,
    pub samples: Vec<Sample>,
}

/// Reads every sample of every prompt to its end, prompt by prompt.
pub(crate) async fn collect_all(
    submitted: Vec<Submitted>,
    names: &ParamNames,
) -> Result<Vec<Answered>, ApiError> {
    let mut answered = Vec::with_capacity(submitted.len());
    for s in submitted {
        let samples = futures::future::try_join_all(s.samples.into_iter().map(collect))
            .await
            .map_err(|e| ApiError::from_infer(e, names))?;
        answered.push(Answered {
            request: s.request,
            samples,
        });
    }
    Ok(answered)
}

/// Prompt tokens of every prompt, generated tokens of every sample (the ones `best_of`
/// discards included).
pub(crate) fn usage(answered: &[Answered]) -> Usage {
    let prompt_tokens = answered.iter().map(|a| a.request.input_ids.len()).sum();
    let completion_tokens = answered
        .iter()
        .flat_map(|a| &a.samples)
        .map(|s| s.end.generated_tokens)
        .sum();
    Usage::new(prompt_tokens, completion_tokens)
}

/// The timing headers over every sample, `x-prompt-tokens` counting every prompt (as
/// `usage` and a stream's header do).
pub(crate) fn headers(answered: &[Answered], usage: &Usage) -> HeaderMap {
    let ends: Vec<_> = answered
        .iter()
        .flat_map(|a| &a.samples)
        .map(|s| &s.end)
        .collect();
    let Some(first) = answered.first() else {
        return HeaderMap::new();
    };
    let mut headers = timing_headers(&first.request, &ends);
    headers.insert("x-prompt-tokens", usage.prompt_tokens.into());
    headers
}

//! What both routes do around the batching loop: submit each prompt, read every sample
//! to its end, and count what was computed.

use axum::http::HeaderMap;

use super::error::{ApiError, ParamNames};
use super::Usage;
use crate::infer::{collect, Sample, Submitted};
use crate::server::{timing_headers, AppState};
use crate::validation::{Extra, GenerateParameters, Prompt, ValidRequest};

/// Submits every prompt with the same parameters; the first rejection answers for all
/// (the ones already queued are cancelled when dropped).
pub(crate) async fn submit_all(
    state: &AppState,
    prompts: Vec<Prompt>,
    parameters: GenerateParameters,
    extra: Extra,
    names: ParamNames,
) -> Result<Vec<Submitted>, ApiError> {
    let mut submitted = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let s = state
            .infer
            .submit(prompt, parameters.clone(), extra.clone())
            .await
            .map_err(|e| ApiError::from_infer(e, names))?;
        submitted.push(s);
    }
    Ok(submitted)
}

/// One prompt, generated to the end: every sample (`best_of` of them), in sample order.
pub(crate) struct Answered {
    pub request: ValidRequest,
    pub samples: Vec<Sample>,
}

/// Reads every sample of every prompt to its end, prompt by prompt.
pub(crate) async fn collect_all(
    submitted: Vec<Submitted>,
    names: ParamNames,
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

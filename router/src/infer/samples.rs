//! A request's samples read to their end, and the ranking `best_of` keeps the best by,
//! for every route that answers once generation is done (TGI's and OpenAI's shapes).

use tokio::sync::mpsc::UnboundedReceiver;

use super::events::{End, EventResult, Token};
use crate::error::InferError;

/// One finished sample: every event of its stream gathered.
pub struct Sample {
    pub tokens: Vec<Token>,
    pub top_tokens: Vec<Vec<Token>>,
    pub prefill: Vec<Token>,
    pub prefill_top_tokens: Vec<Vec<Token>>,
    pub end: End,
}

/// Reads one sample's stream to its end.
pub async fn collect(mut rx: UnboundedReceiver<EventResult>) -> Result<Sample, InferError> {
    let mut tokens = Vec::new();
    let mut top_tokens = Vec::new();
    let mut prefill = Vec::new();
    let mut prefill_top_tokens = Vec::new();
    while let Some(event) = rx.recv().await {
        let event = event?;
        if !event.prefill.is_empty() {
            prefill = event.prefill;
            prefill_top_tokens = event.prefill_top_tokens;
        }
        tokens.push(event.token);
        top_tokens.push(event.top_tokens);
        if let Some(end) = event.end {
            return Ok(Sample {
                tokens,
                top_tokens,
                prefill,
                prefill_top_tokens,
                end,
            });
        }
    }
    Err(InferError::Generation(
        "the request ended without a result".into(),
    ))
}

/// The indices of `samples`, best first: by cumulative logprob (a beam search's
/// hypotheses by their score), the earlier sample first on ties.
pub fn best_first(samples: &[Sample]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..samples.len()).collect();
    // Stable: equal logprobs keep sample order.
    order.sort_by(|&a, &b| {
        let (a, b) = (&samples[a].end, &samples[b].end);
        let score = |e: &End| e.beam_score.unwrap_or(e.cumulative_logprob);
        score(b).total_cmp(&score(a))
    });
    order
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::infer::FinishReason;

    fn sample(cumulative_logprob: f32) -> Sample {
        Sample {
            tokens: Vec::new(),
            top_tokens: Vec::new(),
            prefill: Vec::new(),
            prefill_top_tokens: Vec::new(),
            end: End {
                finish_reason: FinishReason::Length,
                stop_sequence: None,
                generated_text: String::new(),
                generated_tokens: 1,
                input_length: 1,
                seed: None,
                cumulative_logprob,
                beam_score: None,
                queue_time: Duration::ZERO,
                inference_time: Duration::ZERO,
            },
        }
    }

    #[test]
    fn best_first_ranks_by_cumulative_logprob_and_keeps_sample_order_on_ties() {
        let samples: Vec<Sample> = [-3.0, -1.0, -2.0, -1.0, -0.5]
            .into_iter()
            .map(sample)
            .collect();
        assert_eq!(best_first(&samples), [4, 1, 3, 2, 0]);
        assert_eq!(best_first(&[]), Vec::<usize>::new());
    }
}

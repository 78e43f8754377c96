//! What a request's handler receives from the batching loop: one event per generated
//! token, the last one carrying how the request ended.

use std::time::Duration;

use serde::Serialize;

use crate::error::InferError;

#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct Token {
    pub id: u32,
    pub text: String,
    pub logprob: Option<f32>,
    pub special: bool,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Length,
    EosToken,
    StopSequence,
}

impl FinishReason {
    /// Its name in TGI's answers (`eos_token`), for logs and traces too.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Length => "length",
            Self::EosToken => "eos_token",
            Self::StopSequence => "stop_sequence",
        }
    }
}

/// How a request ended; carried by its last event.
#[derive(Debug, Clone)]
pub struct End {
    pub finish_reason: FinishReason,
    /// The stop string that ended it (`FinishReason::StopSequence`).
    pub stop_sequence: Option<String>,
    /// The generated text (stop string excluded), prefixed by the prompt when asked.
    pub generated_text: String,
    pub generated_tokens: usize,
    pub input_length: usize,
    pub seed: Option<u64>,
    /// Sum of the sampled tokens' logprobs (what best_of ranks by).
    pub cumulative_logprob: f32,
    /// A beam search's hypothesis: its score (the cumulative logprob under the length
    /// penalty), what the beams are ranked by.
    pub beam_score: Option<f32>,
    /// From arrival to the first step that computed it.
    pub queue_time: Duration,
    /// From that step to the last token.
    pub inference_time: Duration,
}

/// One generated token, as sent to the request's handler.
#[derive(Debug, Clone)]
pub struct TokenEvent {
    pub token: Token,
    pub top_tokens: Vec<Token>,
    /// With the first event when prompt logprobs were asked: every prompt token (the
    /// first has no logprob) and, with top_n_tokens, the alternatives to each but the
    /// first.
    pub prefill: Vec<Token>,
    pub prefill_top_tokens: Vec<Vec<Token>>,
    pub end: Option<End>,
}

pub type EventResult = Result<TokenEvent, InferError>;

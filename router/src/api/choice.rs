//! How a choice ended, as OpenAI's answers say it, and who speaks an answer: kept as
//! enums until serialized.

use serde::Serialize;
use utoipa::ToSchema;

use crate::infer::FinishReason;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ChoiceFinish {
    /// The model's end, a stop sequence, or a call to the function `tool_choice` named.
    Stop,
    /// The token limit.
    Length,
    /// Calls to the tools.
    ToolCalls,
}

impl From<FinishReason> for ChoiceFinish {
    fn from(reason: FinishReason) -> Self {
        match reason {
            FinishReason::Length => Self::Length,
            FinishReason::EosToken | FinishReason::StopSequence => Self::Stop,
        }
    }
}

/// Who speaks an answer (the requests' roles reach the chat template as they came).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Assistant,
}

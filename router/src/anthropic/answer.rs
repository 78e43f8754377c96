//! The answer: a message of `thinking` (with --reasoning-parser), text and `tool_use`
//! blocks, its stop reason and usage.

use serde::Serialize;
use serde_json::{json, Value};
use utoipa::ToSchema;

use crate::api::tools::{random_id, Reading, ToolCall};
use crate::api::Role;
use crate::infer::{End, FinishReason};
use crate::reasoning::Thinking;

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Message {
    /// `msg_` and 32 hex digits.
    pub id: String,
    /// "message".
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub role: Role,
    pub content: Vec<OutputBlock>,
    /// The adapter's name when the request used one, else the served model name.
    pub model: String,
    /// Null in `message_start`.
    pub stop_reason: Option<StopReason>,
    /// The stop sequence that ended the answer.
    pub stop_sequence: Option<String>,
    pub usage: MessageUsage,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MessageUsage {
    pub input_tokens: usize,
    pub output_tokens: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputBlock {
    /// The model's reasoning (--reasoning-parser), first.
    Thinking {
        thinking: String,
        /// Empty: the reasoning is the model's own, not signed.
        signature: String,
    },
    Text {
        text: String,
    },
    ToolUse {
        /// `toolu_` and 24 letters and digits.
        id: String,
        name: String,
        /// The arguments, valid against the tool's `input_schema`.
        #[schema(value_type = Object)]
        input: Value,
    },
}

impl OutputBlock {
    pub(super) fn thinking(thinking: String) -> Self {
        Self::Thinking {
            thinking,
            signature: String::new(),
        }
    }

    /// A call read from the output, with an id in Anthropic's shape.
    pub(super) fn tool_use(call: ToolCall) -> Self {
        // The reader took the arguments from parsed JSON: they parse.
        let input = serde_json::from_str(&call.function.arguments).unwrap_or_else(|_| json!({}));
        Self::ToolUse {
            id: random_id("toolu_"),
            name: call.function.name,
            input,
        }
    }

    /// The block as a stream opens it (no text, an empty input) and what its deltas
    /// carry (the text, the input as JSON text).
    pub(super) fn streamed(self) -> (Self, String) {
        match self {
            Self::Thinking { thinking, .. } => (Self::thinking(String::new()), thinking),
            Self::Text { text } => (
                Self::Text {
                    text: String::new(),
                },
                text,
            ),
            Self::ToolUse { id, name, input } => {
                let input_json = input.to_string();
                let opening = Self::ToolUse {
                    id,
                    name,
                    input: json!({}),
                };
                (opening, input_json)
            }
        }
    }
}

impl Message {
    /// A message with no content yet (and no stop reason), as a stream opens.
    pub(super) fn opening(model: String, input_tokens: usize) -> Self {
        Self {
            id: format!("msg_{}", uuid::Uuid::new_v4().simple()),
            kind: "message",
            role: Role::Assistant,
            content: Vec::new(),
            model,
            stop_reason: None,
            stop_sequence: None,
            usage: MessageUsage {
                input_tokens,
                output_tokens: 0,
            },
        }
    }

    /// The whole answer from the generated text; `reading` when the model may call,
    /// `thinking` when its reasoning is split from its answer.
    pub(super) fn answered(
        mut self,
        end: End,
        reading: Option<&Reading>,
        thinking: Option<&Thinking>,
    ) -> Self {
        let (reasoning, generated) = match thinking {
            None => (None, end.generated_text.clone()),
            Some(thinking) => {
                let split = thinking.split(&end.generated_text);
                (split.reasoning, split.content)
            }
        };
        let (text, calls, called) = match reading {
            None => (Some(generated), Vec::new(), false),
            // `Reading` gives OpenAI's finish reason, unused here.
            Some(reading) => {
                let answer = reading.answer(&generated, end.finish_reason.into());
                (answer.content, answer.calls, answer.called)
            }
        };
        // An empty text is no block, as a stream opens none for it.
        let text = text
            .filter(|t| !t.is_empty())
            .map(|text| OutputBlock::Text { text });
        self.content = reasoning
            .map(OutputBlock::thinking)
            .into_iter()
            .chain(text)
            .chain(calls.into_iter().map(OutputBlock::tool_use))
            .collect();
        self.stop_reason = Some(stop_reason(&end, called));
        self.stop_sequence = end.stop_sequence;
        self.usage.output_tokens = end.generated_tokens;
        self
    }
}

/// Why an answer stopped, in Anthropic's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    EndTurn,
    MaxTokens,
    StopSequence,
    ToolUse,
}

/// `ToolUse` when the answer ended as calls end, else why generation stopped.
pub(super) fn stop_reason(end: &End, called: bool) -> StopReason {
    if called {
        return StopReason::ToolUse;
    }
    match end.finish_reason {
        FinishReason::Length => StopReason::MaxTokens,
        FinishReason::EosToken => StopReason::EndTurn,
        FinishReason::StopSequence => StopReason::StopSequence,
    }
}

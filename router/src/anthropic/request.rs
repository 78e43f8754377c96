//! The request bodies, as Anthropic's clients send them. Blocks are read loosely (every
//! field optional) so that `convert` can refuse a bad one naming its field.

use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct MessagesRequest {
    /// The base model (any name, or none) or a loaded LoRA adapter's name.
    pub model: Option<String>,
    /// Most tokens to generate (required).
    pub max_tokens: Option<u32>,
    /// Alternating `user` and `assistant` turns.
    pub messages: Vec<InputMessage>,
    /// A string or text blocks, rendered as the template's system message.
    pub system: Option<InputContent>,
    pub stop_sequences: Option<Vec<String>>,
    /// [0, 1]; 0 is greedy [default: 1].
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub stream: Option<bool>,
    /// Accepted and unused (`user_id`).
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
    /// Client tools the model may call.
    pub tools: Option<Vec<ToolDefinition>>,
    pub tool_choice: Option<ToolChoiceInput>,
    /// Extended thinking: `{"type": "enabled", "budget_tokens": N}` or `{"type":
    /// "disabled"}`, given to the chat template as `enable_thinking` (the budget is not
    /// enforced: `max_tokens` bounds reasoning and answer together).
    pub thinking: Option<ThinkingConfig>,
}

/// `POST /v1/messages/count_tokens`: the fields of a conversation.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CountTokensRequest {
    pub model: Option<String>,
    pub messages: Vec<InputMessage>,
    pub system: Option<InputContent>,
    pub tools: Option<Vec<ToolDefinition>>,
    pub tool_choice: Option<ToolChoiceInput>,
    pub thinking: Option<ThinkingConfig>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ThinkingConfig {
    /// "enabled" or "disabled".
    #[serde(rename = "type")]
    pub kind: String,
    /// Accepted, not enforced.
    pub budget_tokens: Option<u32>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct InputMessage {
    /// "user" or "assistant".
    pub role: String,
    pub content: InputContent,
}

/// A message's content, a system prompt or a tool result: text, or blocks.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum InputContent {
    Text(String),
    Blocks(Vec<ContentBlock>),
}

/// One content block: `text` {text}, `tool_use` {id, name, input} (assistant turns),
/// `tool_result` {tool_use_id, content, is_error} (user turns); `thinking` and
/// `redacted_thinking` in assistant turns are accepted and left out of the prompt (chat
/// templates drop earlier turns' reasoning). Other kinds (`image`, `document`, ...) are
/// refused.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ContentBlock {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
    pub id: Option<String>,
    pub name: Option<String>,
    /// The call's arguments, an object.
    #[schema(value_type = Option<Object>)]
    pub input: Option<Value>,
    pub tool_use_id: Option<String>,
    /// A tool result's content: a string or text blocks.
    #[schema(value_type = Option<Object>)]
    pub content: Option<InputContent>,
    pub is_error: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ToolDefinition {
    /// "custom" or absent: server tools are not supported.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// `^[a-zA-Z0-9_-]{1,64}$`, unique among the tools.
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema object of the input (required); calls always follow it.
    #[schema(value_type = Option<Object>)]
    pub input_schema: Option<Value>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ToolChoiceInput {
    /// "auto" (the default with tools), "any", "tool" (with `name`) or "none".
    #[serde(rename = "type")]
    pub kind: String,
    pub name: Option<String>,
    /// At most one call [default: false].
    pub disable_parallel_tool_use: Option<bool>,
}

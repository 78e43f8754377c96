//! The response object, as `POST /v1/responses` answers, `response.completed` carries
//! and `GET /v1/responses/{id}` returns: its output items, usage and the request's
//! settings echoed back.

use serde::Serialize;
use serde_json::{json, Value};
use utoipa::ToSchema;

use super::items::Item;
use super::request::ResponsesRequest;
use crate::api::Role;

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ResponseObject {
    /// `resp_` and a uuid.
    pub id: String,
    /// "response".
    pub object: &'static str,
    /// Unix seconds.
    pub created_at: u64,
    /// "in_progress" (while streaming), "completed" or "incomplete".
    pub status: &'static str,
    /// Always null: a failed generation is an error answer (or an `error` event).
    #[schema(value_type = Option<Object>)]
    pub error: Option<Value>,
    pub incomplete_details: Option<IncompleteDetails>,
    pub model: String,
    pub output: Vec<OutputItem>,
    pub usage: Option<ResponseUsage>,
    #[serde(flatten)]
    pub settings: Settings,
}

/// The request's settings, echoed (OpenAI's defaults where it set none).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Settings {
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub temperature: f32,
    pub top_p: f32,
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<Value>,
    #[schema(value_type = Object)]
    pub tool_choice: Value,
    pub parallel_tool_calls: bool,
    #[schema(value_type = Object)]
    pub text: Value,
    pub previous_response_id: Option<String>,
    pub store: bool,
    #[schema(value_type = Object)]
    pub metadata: Value,
    pub user: Option<String>,
}

impl Settings {
    pub fn of(r: &ResponsesRequest) -> Self {
        Self {
            instructions: r.instructions.clone(),
            max_output_tokens: r.max_output_tokens,
            temperature: r.temperature.unwrap_or(1.0),
            top_p: r.top_p.unwrap_or(1.0),
            tools: r.tools.clone().unwrap_or_default(),
            tool_choice: r
                .tool_choice
                .clone()
                .filter(|v| !v.is_null())
                .unwrap_or_else(|| json!("auto")),
            parallel_tool_calls: r.parallel_tool_calls.unwrap_or(true),
            text: r
                .text
                .clone()
                .filter(|v| !v.is_null())
                .unwrap_or_else(|| json!({"format": {"type": "text"}})),
            previous_response_id: r.previous_response_id.clone(),
            store: r.store.unwrap_or(true),
            metadata: r
                .metadata
                .clone()
                .filter(|v| !v.is_null())
                .unwrap_or_else(|| json!({})),
            user: r.user.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct IncompleteDetails {
    /// "max_output_tokens".
    pub reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    Message {
        /// `msg_` and a uuid.
        id: String,
        status: &'static str,
        role: Role,
        content: Vec<OutputText>,
    },
    /// The model's reasoning (`--reasoning-parser`), before the message.
    Reasoning {
        /// `rs_` and a uuid.
        id: String,
        #[schema(value_type = Vec<Object>)]
        summary: Vec<Value>,
        content: Vec<ReasoningText>,
        status: &'static str,
    },
    FunctionCall {
        /// `fc_` and a uuid.
        id: String,
        /// `call_` and 24 letters and digits: what a `function_call_output` answers.
        call_id: String,
        name: String,
        /// A JSON string.
        arguments: String,
        status: &'static str,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct OutputText {
    /// "output_text".
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
    #[schema(value_type = Vec<Object>)]
    pub annotations: Vec<Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ReasoningText {
    /// "reasoning_text".
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
}

impl ReasoningText {
    pub fn new(text: String) -> Self {
        Self {
            kind: "reasoning_text",
            text,
        }
    }
}

impl OutputText {
    pub fn new(text: String) -> Self {
        Self {
            kind: "output_text",
            text,
            annotations: Vec::new(),
        }
    }
}

impl OutputItem {
    #[cfg(test)]
    pub fn id(&self) -> &str {
        match self {
            OutputItem::Message { id, .. }
            | OutputItem::Reasoning { id, .. }
            | OutputItem::FunctionCall { id, .. } => id,
        }
    }

    /// The item as the next turn's input reads it (reasoning is not carried: chat
    /// templates leave earlier turns' reasoning out).
    pub fn as_input(&self) -> Option<Item> {
        Some(match self {
            OutputItem::Reasoning { .. } => return None,
            OutputItem::Message { content, .. } => Item::Message {
                role: "assistant".into(),
                text: content.iter().map(|c| c.text.as_str()).collect(),
            },
            OutputItem::FunctionCall {
                call_id,
                name,
                arguments,
                ..
            } => Item::FunctionCall {
                call_id: call_id.clone(),
                name: name.clone(),
                arguments: arguments.clone(),
            },
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub total_tokens: usize,
    #[schema(value_type = Object)]
    pub input_tokens_details: Value,
    #[schema(value_type = Object)]
    pub output_tokens_details: Value,
}

impl ResponseUsage {
    pub fn new(input_tokens: usize, output_tokens: usize) -> Self {
        Self {
            input_tokens,
            output_tokens,
            total_tokens: input_tokens + output_tokens,
            input_tokens_details: json!({"cached_tokens": 0}),
            output_tokens_details: json!({"reasoning_tokens": 0}),
        }
    }
}

/// A uuid-based id with OpenAI's `prefix` (`resp`, `msg`, `fc`).
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A response in progress with the default settings.
    pub fn response(id: &str) -> ResponseObject {
        let request: ResponsesRequest = serde_json::from_value(json!({"input": "hi"})).unwrap();
        ResponseObject {
            id: id.into(),
            object: "response",
            created_at: 0,
            status: "in_progress",
            error: None,
            incomplete_details: None,
            model: "m".into(),
            output: Vec::new(),
            usage: None,
            settings: Settings::of(&request),
        }
    }

    #[test]
    fn the_object_takes_openai_s_shape_with_the_defaults_echoed() {
        let mut r = response("resp_1");
        r.output.push(OutputItem::FunctionCall {
            id: "fc_1".into(),
            call_id: "call_1".into(),
            name: "f".into(),
            arguments: "{}".into(),
            status: "completed",
        });
        r.usage = Some(ResponseUsage::new(3, 4));
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            json!({"id": "resp_1", "object": "response", "created_at": 0,
                "status": "in_progress", "error": null, "incomplete_details": null,
                "model": "m", "output": [{"type": "function_call", "id": "fc_1",
                "call_id": "call_1", "name": "f", "arguments": "{}", "status": "completed"}],
                "usage": {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens_details": {"reasoning_tokens": 0}},
                "instructions": null, "max_output_tokens": null, "temperature": 1.0,
                "top_p": 1.0, "tools": [], "tool_choice": "auto", "parallel_tool_calls": true,
                "text": {"format": {"type": "text"}}, "previous_response_id": null,
                "store": true, "metadata": {}, "user": null})
        );
        assert_eq!(
            r.output[0].as_input().unwrap(),
            Item::FunctionCall {
                call_id: "call_1".into(),
                name: "f".into(),
                arguments: "{}".into()
            }
        );
    }
}

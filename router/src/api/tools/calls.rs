//! Tool calls in OpenAI's shapes: whole (`message.tool_calls`, and assistant messages
//! in history) and as stream deltas (`delta.tool_calls`).

use rand::distr::{Alphanumeric, SampleString};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolCall {
    /// `call_` and 24 letters and digits.
    pub id: String,
    /// "function".
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON string (compact, keys in the order they were written).
    pub arguments: String,
}

fn function_kind() -> String {
    "function".into()
}

/// A new call id: `prefix` and 24 letters and digits.
pub fn random_id(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        Alphanumeric.sample_string(&mut rand::rng(), 24)
    )
}

impl ToolCall {
    /// A call made now, with a new id.
    pub fn new(name: String, arguments: String) -> Self {
        Self {
            id: random_id("call_"),
            kind: function_kind(),
            function: FunctionCall { name, arguments },
        }
    }

    /// The call as stream deltas of call `index`: the first names it (with empty
    /// arguments), the second carries the arguments.
    pub fn deltas(self, index: usize) -> [ToolCallDelta; 2] {
        let opening = ToolCallDelta {
            index,
            id: Some(self.id),
            kind: Some("function"),
            function: FunctionDelta {
                name: Some(self.function.name),
                arguments: String::new(),
            },
        };
        let arguments = ToolCallDelta {
            index,
            id: None,
            kind: None,
            function: FunctionDelta {
                name: None,
                arguments: self.function.arguments,
            },
        };
        [opening, arguments]
    }
}

/// A piece of call `index` in a stream: the first carries `id`, `type` and the name,
/// the rest fragments of the arguments, which add up to the whole call's `arguments`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ids_are_call_and_24_alphanumerics_and_deltas_take_openai_s_shape() {
        let call = ToolCall::new("f".into(), "{\"a\":1}".into());
        let suffix = call.id.strip_prefix("call_").unwrap();
        assert_eq!(suffix.len(), 24);
        assert!(suffix.bytes().all(|b| b.is_ascii_alphanumeric()));
        assert_ne!(call.id, ToolCall::new("f".into(), String::new()).id);
        let id = call.id.clone();
        let [first, rest] = call.deltas(2);
        assert_eq!(
            serde_json::to_value(first).unwrap(),
            json!({"index": 2, "id": id, "type": "function",
                "function": {"name": "f", "arguments": ""}})
        );
        assert_eq!(
            serde_json::to_value(rest).unwrap(),
            json!({"index": 2, "function": {"arguments": "{\"a\":1}"}})
        );
    }
}

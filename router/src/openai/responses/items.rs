//! The items a conversation is made of (the request's input, a stored response's output)
//! and the chat template's messages they become: a call joins the assistant message
//! before it (as chat's `tool_calls`), a call's output is a `tool` message.

use serde_json::Value;

use crate::chat::{TemplateMessage, TemplateToolCall};

#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// Roles user, assistant, system and developer.
    Message {
        role: String,
        text: String,
    },
    /// The arguments as the API writes them, a JSON string (checked when read).
    FunctionCall {
        call_id: String,
        name: String,
        arguments: String,
    },
    FunctionCallOutput {
        call_id: String,
        output: String,
    },
}

/// The template's messages: `instructions` as the first system message, then `items`.
pub fn template_messages(instructions: Option<&str>, items: &[Item]) -> Vec<TemplateMessage> {
    let mut out: Vec<TemplateMessage> = instructions
        .map(|text| TemplateMessage::text("system", text))
        .into_iter()
        .collect();
    for item in items {
        match item {
            // Templates know "system"; the developer role is OpenAI's newer name for it.
            Item::Message { role, text } if role == "developer" => {
                out.push(TemplateMessage::text("system", text.as_str()))
            }
            Item::Message { role, text } => {
                out.push(TemplateMessage::text(role.as_str(), text.as_str()))
            }
            Item::FunctionCall {
                call_id,
                name,
                arguments,
            } => {
                let arguments = serde_json::from_str(arguments)
                    .unwrap_or_else(|_| Value::String(arguments.clone()));
                let call = TemplateToolCall::new(call_id.clone(), name.clone(), arguments);
                match out.last_mut() {
                    Some(last) if last.role == "assistant" => {
                        last.tool_calls.get_or_insert_with(Vec::new).push(call)
                    }
                    _ => out.push(TemplateMessage {
                        content: None,
                        tool_calls: Some(vec![call]),
                        ..TemplateMessage::text("assistant", "")
                    }),
                }
            }
            Item::FunctionCallOutput { call_id, output } => out.push(TemplateMessage {
                tool_call_id: Some(call_id.clone()),
                ..TemplateMessage::text("tool", output.as_str())
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn message(role: &str, text: &str) -> Item {
        Item::Message {
            role: role.into(),
            text: text.into(),
        }
    }

    fn call(id: &str) -> Item {
        Item::FunctionCall {
            call_id: id.into(),
            name: "f".into(),
            arguments: "{\"x\": 1}".into(),
        }
    }

    #[test]
    fn calls_join_the_assistant_message_before_them_and_outputs_are_tool_messages() {
        let items = [
            message("developer", "Be brief."),
            message("user", "go"),
            call("c1"),
            call("c2"),
            Item::FunctionCallOutput {
                call_id: "c1".into(),
                output: "one".into(),
            },
            message("assistant", "Checking."),
            call("c3"),
        ];
        let out = template_messages(Some("Rules."), &items);
        let shown: Vec<Value> = out
            .iter()
            .map(|m| serde_json::to_value(m).unwrap())
            .collect();
        let fc = |id: &str| {
            json!({"id": id, "type": "function",
            "function": {"name": "f", "arguments": {"x": 1}}})
        };
        assert_eq!(
            shown,
            [
                json!({"role": "system", "content": "Rules."}),
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "go"}),
                json!({"role": "assistant", "content": null, "tool_calls": [fc("c1"), fc("c2")]}),
                json!({"role": "tool", "content": "one", "tool_call_id": "c1"}),
                json!({"role": "assistant", "content": "Checking.", "tool_calls": [fc("c3")]}),
            ]
        );
    }
}

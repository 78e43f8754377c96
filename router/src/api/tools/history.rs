//! Tool calls and results in the request's history, as chat templates read them:
//! transformers' shape for templates with a tool section, plain text for the others.

use serde_json::Value;

use super::calls::ToolCall;
use super::format::{call_block, response_block};
use crate::api::error::ApiError;
use crate::chat::{TemplateMessage, TemplateToolCall};

/// The tool fields of `messages[i]`: an assistant's calls, their arguments parsed from
/// OpenAI's JSON string into the value templates expect, and a `tool` message's
/// `tool_call_id` (required there, as OpenAI requires it).
pub fn tool_fields(
    i: usize,
    role: &str,
    tool_calls: Option<Vec<ToolCall>>,
    tool_call_id: Option<String>,
) -> Result<(Option<Vec<TemplateToolCall>>, Option<String>), ApiError> {
    let calls = tool_calls.filter(|calls| !calls.is_empty());
    if calls.is_some() && role != "assistant" {
        return Err(ApiError::invalid(
            &format!("messages[{i}].tool_calls"),
            format!("only assistant messages make tool calls, not {role:?}"),
        ));
    }
    if role == "tool" && tool_call_id.is_none() {
        return Err(ApiError::invalid(
            &format!("messages[{i}].tool_call_id"),
            "is required for role \"tool\"",
        ));
    }
    let calls = calls
        .map(|calls| {
            calls
                .into_iter()
                .enumerate()
                .map(|(j, call)| template_call(&format!("messages[{i}].tool_calls[{j}]"), call))
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    Ok((calls, tool_call_id))
}

fn template_call(field: &str, call: ToolCall) -> Result<TemplateToolCall, ApiError> {
    if call.kind != "function" {
        return Err(ApiError::invalid(
            &format!("{field}.type"),
            format!("must be \"function\", got {:?}", call.kind),
        ));
    }
    let arguments = call_arguments(
        &format!("{field}.function.arguments"),
        &call.function.arguments,
    )?;
    Ok(TemplateToolCall::new(
        call.id,
        call.function.name,
        arguments,
    ))
}

/// A call's arguments, OpenAI's JSON string (the request's `field`), as the value
/// templates read.
pub fn call_arguments(field: &str, arguments: &str) -> Result<Value, ApiError> {
    serde_json::from_str(arguments)
        .map_err(|e| ApiError::invalid(field, format!("is not JSON: {e}")))
}

/// History for a template without a tool section: an assistant's calls follow its text
/// as `<tool_call>` blocks, one per line, and each run of `tool` messages becomes one
/// `user` message of `<tool_response>` blocks (such a template may not know the role
/// `tool`, and every template takes `user`; the call ids are dropped).
pub fn as_plain_text(messages: Vec<TemplateMessage>) -> Vec<TemplateMessage> {
    let mut out: Vec<TemplateMessage> = Vec::with_capacity(messages.len());
    let mut previous_was_tool = false;
    for m in messages {
        let is_tool = m.role == "tool";
        if is_tool {
            let block = response_block(m.content.as_deref().unwrap_or_default());
            match out.last_mut() {
                Some(last) if previous_was_tool => {
                    let text = last.content.get_or_insert_with(String::new);
                    text.push('\n');
                    text.push_str(&block);
                }
                _ => out.push(TemplateMessage::text("user", block)),
            }
        } else if let Some(calls) = m.tool_calls {
            let text = m.content.into_iter().filter(|c| !c.is_empty());
            let blocks = calls
                .iter()
                .map(|c| call_block(&c.function.name, &c.function.arguments));
            let content: Vec<String> = text.chain(blocks).collect();
            out.push(TemplateMessage {
                content: Some(content.join("\n")),
                tool_calls: None,
                ..m
            });
        } else {
            out.push(m);
        }
        previous_was_tool = is_tool;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
        serde_json::from_value(json!({"id": id, "type": "function",
            "function": {"name": name, "arguments": arguments}}))
        .unwrap()
    }

    #[test]
    fn arguments_become_objects_and_errors_name_the_field() {
        let (calls, id) = tool_fields(
            3,
            "assistant",
            Some(vec![call("c1", "f", "{\"a\": [1]}")]),
            None,
        )
        .unwrap();
        assert_eq!(id, None);
        assert_eq!(
            serde_json::to_value(calls.unwrap()).unwrap(),
            json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": [1]}}}])
        );
        let param = |r: Result<_, ApiError>| r.unwrap_err().body.error.param.unwrap();
        let bad = vec![call("c1", "f", "{}"), call("c2", "g", "{not json")];
        assert_eq!(
            param(tool_fields(3, "assistant", Some(bad), None)),
            "messages[3].tool_calls[1].function.arguments"
        );
        let mut retrieval = call("c1", "f", "{}");
        retrieval.kind = "retrieval".into();
        assert_eq!(
            param(tool_fields(0, "assistant", Some(vec![retrieval]), None)),
            "messages[0].tool_calls[0].type"
        );
        assert_eq!(
            param(tool_fields(
                1,
                "user",
                Some(vec![call("c", "f", "{}")]),
                None
            )),
            "messages[1].tool_calls"
        );
        assert_eq!(
            param(tool_fields(2, "tool", None, None)),
            "messages[2].tool_call_id"
        );
        let (calls, id) = tool_fields(2, "tool", Some(vec![]), Some("c1".into())).unwrap();
        assert_eq!((calls, id.as_deref()), (None, Some("c1")));
    }

    #[test]
    fn plain_text_history_writes_calls_as_blocks_and_results_as_user_messages() {
        let (calls, _) = tool_fields(
            1,
            "assistant",
            Some(vec![call("c1", "f", "{\"x\": 1}"), call("c2", "g", "{}")]),
            None,
        )
        .unwrap();
        let tool = |id: &str, content: &str| TemplateMessage {
            tool_call_id: Some(id.into()),
            ..TemplateMessage::text("tool", content)
        };
        let messages = vec![
            TemplateMessage::text("user", "go"),
            TemplateMessage {
                content: None,
                tool_calls: calls.clone(),
                ..TemplateMessage::text("assistant", "")
            },
            tool("c1", "one"),
            tool("c2", "two"),
            TemplateMessage {
                tool_calls: calls,
                ..TemplateMessage::text("assistant", "Again.")
            },
            tool("c1", "three"),
        ];
        let out = as_plain_text(messages);
        let seen: Vec<(&str, &str)> = out
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_deref().unwrap()))
            .collect();
        let f = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\":1}}\n</tool_call>";
        let g = "<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
        assert_eq!(
            seen,
            [
                ("user", "go"),
                ("assistant", format!("{f}\n{g}").as_str()),
                ("user", "<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>"),
                ("assistant", format!("Again.\n{f}\n{g}").as_str()),
                ("user", "<tool_response>\nthree\n</tool_response>"),
            ]
        );
        assert!(out
            .iter()
            .all(|m| m.tool_calls.is_none() && m.tool_call_id.is_none()));
    }
}

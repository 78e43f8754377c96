//! The request's conversation as the chat template reads it, and its tools as the chat
//! route's `Tools`: Anthropic's blocks map onto OpenAI's messages (text content, an
//! assistant's `tool_calls`, `tool` messages), so the template renders both APIs' turns
//! alike. Every refusal names the field in Anthropic's shape.

use serde_json::{json, Value};

use super::request::{
    ContentBlock, InputContent, InputMessage, ThinkingConfig, ToolChoiceInput, ToolDefinition,
};
use crate::api::tools::{unique_names, Function, ToolChoice, Tools};
use crate::api::ApiError;
use crate::chat::{TemplateFunctionCall, TemplateKwargs, TemplateMessage, TemplateToolCall};

/// The template's messages: `system` first, then each turn's.
pub(super) fn template_messages(
    system: Option<InputContent>,
    messages: Vec<InputMessage>,
) -> Result<Vec<TemplateMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "must not be empty"));
    }
    let mut out = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = system {
        out.push(TemplateMessage::text("system", text_of("system", system)?));
    }
    for (i, m) in messages.into_iter().enumerate() {
        let blocks = match m.content {
            InputContent::Text(text) => vec![text_block(text)],
            InputContent::Blocks(blocks) => blocks,
        };
        match m.role.as_str() {
            "user" => user_turn(i, blocks, &mut out)?,
            "assistant" => out.push(assistant_turn(i, blocks)?),
            other => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!("must be \"user\" or \"assistant\", got {other:?}"),
                ))
            }
        }
    }
    Ok(out)
}

fn text_block(text: String) -> ContentBlock {
    ContentBlock {
        kind: "text".into(),
        text: Some(text),
        id: None,
        name: None,
        input: None,
        tool_use_id: None,
        content: None,
        is_error: None,
    }
}

/// A block's required field.
fn required<T>(field: String, value: Option<T>) -> Result<T, ApiError> {
    value.ok_or_else(|| ApiError::invalid(&field, "is required"))
}

fn refused(field: &str, kind: &str, allowed: &str) -> ApiError {
    ApiError::invalid(
        &format!("{field}.type"),
        format!("{kind:?} blocks are not supported here; {allowed}"),
    )
}

/// The text of a system prompt or a tool result: a string, or text blocks joined.
fn text_of(field: &str, content: InputContent) -> Result<String, ApiError> {
    match content {
        InputContent::Text(text) => Ok(text),
        InputContent::Blocks(blocks) => {
            let mut text = String::new();
            for (j, block) in blocks.into_iter().enumerate() {
                let field = format!("{field}[{j}]");
                if block.kind != "text" {
                    return Err(refused(&field, &block.kind, "only text blocks are"));
                }
                text.push_str(&required(format!("{field}.text"), block.text)?);
            }
            Ok(text)
        }
    }
}

/// A user turn: runs of text blocks become `user` messages, each `tool_result` a `tool`
/// message answering its call, in the order they came.
fn user_turn(
    i: usize,
    blocks: Vec<ContentBlock>,
    out: &mut Vec<TemplateMessage>,
) -> Result<(), ApiError> {
    let mut text: Option<String> = None;
    let mut results = 0;
    for (j, block) in blocks.into_iter().enumerate() {
        let field = format!("messages[{i}].content[{j}]");
        match block.kind.as_str() {
            "text" => text
                .get_or_insert_with(String::new)
                .push_str(&required(format!("{field}.text"), block.text)?),
            "tool_result" => {
                if let Some(text) = text.take() {
                    out.push(TemplateMessage::text("user", text));
                }
                let id = required(format!("{field}.tool_use_id"), block.tool_use_id)?;
                let content = match block.content {
                    Some(content) => text_of(&format!("{field}.content"), content)?,
                    None => String::new(),
                };
                // A template has no place for the flag: the model reads it in the text.
                let content = if block.is_error == Some(true) {
                    format!("Error: {content}")
                } else {
                    content
                };
                out.push(TemplateMessage {
                    tool_call_id: Some(id),
                    ..TemplateMessage::text("tool", content)
                });
                results += 1;
            }
            kind => {
                return Err(refused(
                    &field,
                    kind,
                    "user turns take text and tool_result",
                ))
            }
        }
    }
    // A turn of no blocks is an empty user message; one of results alone, none.
    if let Some(text) = text.or_else(|| (results == 0).then(String::new)) {
        out.push(TemplateMessage::text("user", text));
    }
    Ok(())
}

/// An assistant turn: its text, and its `tool_use` blocks as calls.
fn assistant_turn(i: usize, blocks: Vec<ContentBlock>) -> Result<TemplateMessage, ApiError> {
    let mut text = String::new();
    let mut calls = Vec::new();
    for (j, block) in blocks.into_iter().enumerate() {
        let field = format!("messages[{i}].content[{j}]");
        match block.kind.as_str() {
            "text" => text.push_str(&required(format!("{field}.text"), block.text)?),
            "tool_use" => {
                let arguments = match block.input {
                    None => json!({}),
                    Some(Value::Object(input)) => Value::Object(input),
                    Some(other) => {
                        return Err(ApiError::invalid(
                            &format!("{field}.input"),
                            format!("must be an object, got {other}"),
                        ))
                    }
                };
                calls.push(TemplateToolCall {
                    id: required(format!("{field}.id"), block.id)?,
                    kind: "function",
                    function: TemplateFunctionCall {
                        name: required(format!("{field}.name"), block.name)?,
                        arguments,
                    },
                });
            }
            "thinking" | "redacted_thinking" => {}
            kind => {
                return Err(refused(
                    &field,
                    kind,
                    "assistant turns take text, tool_use and thinking",
                ))
            }
        }
    }
    // As the chat route passes it: null content for a turn that only calls.
    let content = (!text.is_empty() || calls.is_empty()).then_some(text);
    Ok(TemplateMessage {
        content,
        tool_calls: (!calls.is_empty()).then_some(calls),
        ..TemplateMessage::text("assistant", "")
    })
}

/// The template's variables for the request's `thinking`: `enable_thinking`, which
/// thinking models' templates (Qwen3's) read.
pub(super) fn template_kwargs(
    thinking: Option<ThinkingConfig>,
) -> Result<TemplateKwargs, ApiError> {
    let mut kwargs = TemplateKwargs::new();
    let Some(thinking) = thinking else {
        return Ok(kwargs);
    };
    let enabled = match thinking.kind.as_str() {
        "enabled" | "adaptive" => true,
        "disabled" => false,
        other => {
            return Err(ApiError::invalid(
                "thinking.type",
                format!("must be \"enabled\" or \"disabled\", got {other:?}"),
            ))
        }
    };
    kwargs.insert("enable_thinking".into(), Value::Bool(enabled));
    Ok(kwargs)
}

/// The request's tools; `None` without tools (where `tool_choice` may only be "auto"
/// or "none").
pub(super) fn tools(
    tools: Option<Vec<ToolDefinition>>,
    choice: Option<ToolChoiceInput>,
) -> Result<Option<Tools>, ApiError> {
    let tools = tools.unwrap_or_default();
    if tools.is_empty() {
        return match choice {
            Some(c) if c.kind != "auto" && c.kind != "none" => Err(ApiError::invalid(
                "tool_choice",
                format!("{:?} needs tools", c.kind),
            )),
            _ => Ok(None),
        };
    }
    let functions = tools
        .into_iter()
        .enumerate()
        .map(|(i, tool)| function(i, tool))
        .collect::<Result<Vec<_>, _>>()?;
    unique_names(&functions, |i| format!("tools[{i}].name"))?;
    let parallel = !choice
        .as_ref()
        .and_then(|c| c.disable_parallel_tool_use)
        .unwrap_or(false);
    let choice = match choice {
        None => ToolChoice::Auto,
        Some(c) => tool_choice(c, &functions)?,
    };
    Ok(Some(Tools {
        functions,
        choice,
        parallel,
    }))
}

fn function(i: usize, tool: ToolDefinition) -> Result<Function, ApiError> {
    if let Some(kind) = tool.kind.filter(|k| k != "custom") {
        return Err(ApiError::invalid(
            &format!("tools[{i}].type"),
            format!("must be \"custom\" (server tools are not supported), got {kind:?}"),
        ));
    }
    let schema = required(format!("tools[{i}].input_schema"), tool.input_schema)?;
    Function::new(
        &format!("tools[{i}]"),
        tool.name,
        tool.description,
        ("input_schema", Some(schema)),
    )
}

/// Anthropic's choices as the chat route's: "any" is OpenAI's "required".
fn tool_choice(choice: ToolChoiceInput, functions: &[Function]) -> Result<ToolChoice, ApiError> {
    match choice.kind.as_str() {
        "auto" => Ok(ToolChoice::Auto),
        "any" => Ok(ToolChoice::Required),
        "none" => Ok(ToolChoice::None),
        "tool" => {
            let name = required("tool_choice.name".into(), choice.name)?;
            ToolChoice::named(name, functions, "tool_choice.name")
        }
        other => Err(ApiError::invalid(
            "tool_choice.type",
            format!("must be \"auto\", \"any\", \"tool\" or \"none\", got {other:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct Body {
        system: Option<InputContent>,
        #[serde(default)]
        messages: Vec<InputMessage>,
        tools: Option<Vec<ToolDefinition>>,
        tool_choice: Option<ToolChoiceInput>,
    }

    fn body(value: Value) -> Body {
        serde_json::from_value(value).unwrap()
    }

    fn converted(value: Value) -> Result<Vec<TemplateMessage>, ApiError> {
        let b = body(value);
        template_messages(b.system, b.messages)
    }

    fn converted_tools(value: Value) -> Result<Option<Tools>, ApiError> {
        let b = body(value);
        tools(b.tools, b.tool_choice)
    }

    /// What a refusal names: its message starts with the field.
    fn field(e: ApiError) -> String {
        let message = e.into_parts().message;
        message.split(": ").next().unwrap().to_string()
    }

    #[test]
    fn blocks_become_the_chat_route_s_messages() {
        let out = converted(json!({
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "22°C"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
                     "content": [{"type": "text", "text": "no such city"}]},
                    {"type": "text", "text": "Thanks"}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_3", "name": "now", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_3"}]},
            ]
        }))
        .unwrap();
        let call = |id: &str, name: &str, arguments: Value| TemplateToolCall {
            id: id.into(),
            kind: "function",
            function: TemplateFunctionCall {
                name: name.into(),
                arguments,
            },
        };
        let tool = |id: &str, content: &str| TemplateMessage {
            tool_call_id: Some(id.into()),
            ..TemplateMessage::text("tool", content)
        };
        let want = vec![
            TemplateMessage::text("system", "Be brief."),
            TemplateMessage::text("user", "Weather?"),
            TemplateMessage {
                tool_calls: Some(vec![call(
                    "toolu_1",
                    "get_weather",
                    json!({"city": "Paris"}),
                )]),
                ..TemplateMessage::text("assistant", "Checking.")
            },
            tool("toolu_1", "22°C"),
            tool("toolu_2", "Error: no such city"),
            TemplateMessage::text("user", "Thanks"),
            TemplateMessage {
                content: None,
                tool_calls: Some(vec![call("toolu_3", "now", json!({}))]),
                ..TemplateMessage::text("assistant", "")
            },
            tool("toolu_3", ""),
        ];
        assert_eq!(
            serde_json::to_value(&out).unwrap(),
            serde_json::to_value(&want).unwrap()
        );
    }

    #[test]
    fn refusals_name_the_field() {
        let image = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}});
        let cases = [
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "system", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, image]}]}),
                "messages[0].content[1].type",
            ),
            (
                json!({"messages": [{"role": "user", "content": [
                    {"type": "document", "source": {}}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"messages": [{"role": "user", "content": [
                    {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"messages": [{"role": "user", "content": "a"},
                    {"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]}),
                "messages[1].content[0].id",
            ),
            (
                json!({"messages": [{"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]}),
                "messages[0].content[0].input",
            ),
            (
                json!({"messages": [{"role": "user", "content": [
                    {"type": "tool_result", "content": "x"}]}]}),
                "messages[0].content[0].tool_use_id",
            ),
            (
                json!({"messages": [{"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": [image]}]}]}),
                "messages[0].content[0].content[0].type",
            ),
            (
                json!({"system": [{"type": "text"}], "messages": [{"role": "user", "content": "a"}]}),
                "system[0].text",
            ),
        ];
        for (value, want) in cases {
            let got = field(converted(value.clone()).unwrap_err());
            assert_eq!(got, want, "{value}");
        }
    }

    fn weather() -> Value {
        json!({"name": "get_weather", "description": "Weather now",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}})
    }

    #[test]
    fn tool_choice_maps_onto_the_chat_route_s() {
        let cases = [
            (json!(null), ToolChoice::Auto, true),
            (json!({"type": "auto"}), ToolChoice::Auto, true),
            (
                json!({"type": "any", "disable_parallel_tool_use": true}),
                ToolChoice::Required,
                false,
            ),
            (
                json!({"type": "tool", "name": "get_weather"}),
                ToolChoice::Function("get_weather".into()),
                true,
            ),
            (json!({"type": "none"}), ToolChoice::None, true),
        ];
        for (choice, want, parallel) in cases {
            let t = converted_tools(json!({"tools": [weather()], "tool_choice": choice}))
                .unwrap()
                .unwrap();
            assert_eq!((&t.choice, t.parallel), (&want, parallel), "{choice}");
            assert_eq!(t.functions[0].name, "get_weather");
            assert_eq!(t.functions[0].parameters, weather()["input_schema"]);
            assert_eq!(t.functions[0].description.as_deref(), Some("Weather now"));
        }
        assert!(converted_tools(json!({})).unwrap().is_none());
        assert!(converted_tools(json!({"tool_choice": {"type": "auto"}}))
            .unwrap()
            .is_none());
    }

    #[test]
    fn tool_refusals_name_the_field() {
        let named = |name: &str| json!({"name": name, "input_schema": {"type": "object"}});
        let cases = [
            (json!({"tool_choice": {"type": "any"}}), "tool_choice"),
            (
                json!({"tools": [weather(), {"name": "x"}]}),
                "tools[1].input_schema",
            ),
            (
                json!({"tools": [{"name": "x", "input_schema": "{}"}]}),
                "tools[0].input_schema",
            ),
            (
                json!({"tools": [{"type": "bash_20250124", "name": "bash"}]}),
                "tools[0].type",
            ),
            (json!({"tools": [named("a b")]}), "tools[0].name"),
            (json!({"tools": [weather(), weather()]}), "tools[1].name"),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "required"}}),
                "tool_choice.type",
            ),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "tool"}}),
                "tool_choice.name",
            ),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "tool", "name": "x"}}),
                "tool_choice.name",
            ),
        ];
        for (value, want) in cases {
            let got = field(converted_tools(value.clone()).unwrap_err());
            assert_eq!(got, want, "{value}");
        }
    }
}

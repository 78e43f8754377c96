//! The body of `POST /v1/responses`, read into the conversation's items, the tools and
//! the output format; every bad value is a 400 naming its field as the client wrote it
//! (`input[2].content[0]`, `tools[1].type`, `text.format.schema`).

use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::items::Item;
use crate::api::error::ApiError;
use crate::api::tools::{call_arguments, FunctionDefinition, Shape, Tool, Tools};
use crate::constraints::Constraint;
use crate::openai::chat::MessageContent;
use crate::openai::guided::format_grammar;

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    /// A user message's text, or a list of items: messages (`role`, `content` a string or
    /// `input_text` / `output_text` parts), `function_call` and `function_call_output`.
    #[schema(value_type = Object)]
    pub input: Value,
    /// A system message before the conversation (not carried to a follow-up).
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    /// [0, 2]; 0 is greedy [default: 1].
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub stream: Option<bool>,
    /// `[{"type": "function", "name", "description", "parameters", "strict"}]`.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    /// "none", "auto" (the default with tools), "required", or
    /// `{"type": "function", "name": ...}`.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Several calls in one answer [default: true].
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text"}}`, `{"format": {"type": "json_object"}}` or
    /// `{"format": {"type": "json_schema", "name", "schema", "strict"}}`.
    #[schema(value_type = Option<Object>)]
    pub text: Option<Value>,
    /// Keep the finished response for `GET /v1/responses/{id}` and
    /// `previous_response_id` [default: true].
    pub store: Option<bool>,
    /// Continue the conversation of this stored response.
    pub previous_response_id: Option<String>,
    /// Echoed back.
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
    pub user: Option<String>,
    pub seed: Option<u64>,
}

/// The request's input as conversation items.
pub fn input_items(input: Value) -> Result<Vec<Item>, ApiError> {
    match input {
        Value::String(text) => Ok(vec![Item::Message {
            role: "user".into(),
            text,
        }]),
        Value::Array(items) if !items.is_empty() => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| input_item(&format!("input[{i}]"), item))
            .filter_map(Result::transpose)
            .collect(),
        Value::Array(_) => Err(ApiError::invalid("input", "must not be empty")),
        other => Err(ApiError::invalid(
            "input",
            format!("must be a string or a list of items, got {other}"),
        )),
    }
}

#[derive(Deserialize)]
struct MessageItem {
    role: String,
    content: MessageContent,
}

#[derive(Deserialize)]
struct FunctionCallItem {
    call_id: String,
    name: String,
    arguments: String,
}

#[derive(Deserialize)]
struct FunctionCallOutputItem {
    call_id: String,
    output: String,
}

/// `value` read as a `T`, its errors naming `field`.
fn read<T: serde::de::DeserializeOwned>(field: &str, value: Value) -> Result<T, ApiError> {
    serde_json::from_value(value).map_err(|e| ApiError::invalid(field, e.to_string()))
}

/// An input item; `None` for a `reasoning` item (an earlier answer's, given back: chat
/// templates leave earlier turns' reasoning out).
fn input_item(field: &str, item: Value) -> Result<Option<Item>, ApiError> {
    // A message may leave out its type (the SDKs' "easy" input message).
    let kind = match item.get("type") {
        None | Some(Value::Null) => "message".to_string(),
        Some(Value::String(kind)) => kind.clone(),
        Some(other) => {
            return Err(ApiError::invalid(
                &format!("{field}.type"),
                format!("must be a string, got {other}"),
            ))
        }
    };
    match kind.as_str() {
        "message" => {
            let m: MessageItem = read(field, item)?;
            if !["user", "assistant", "system", "developer"].contains(&m.role.as_str()) {
                return Err(ApiError::invalid(
                    &format!("{field}.role"),
                    format!(
                        "must be \"user\", \"assistant\", \"system\" or \"developer\", got {:?}",
                        m.role
                    ),
                ));
            }
            let text = m
                .content
                .into_text(&format!("{field}.content"), &["input_text", "output_text"])?;
            Ok(Some(Item::Message { role: m.role, text }))
        }
        "function_call" => {
            let c: FunctionCallItem = read(field, item)?;
            call_arguments(&format!("{field}.arguments"), &c.arguments)?;
            Ok(Some(Item::FunctionCall {
                call_id: c.call_id,
                name: c.name,
                arguments: c.arguments,
            }))
        }
        "function_call_output" => {
            let o: FunctionCallOutputItem = read(field, item)?;
            Ok(Some(Item::FunctionCallOutput {
                call_id: o.call_id,
                output: o.output,
            }))
        }
        "reasoning" => Ok(None),
        other => Err(ApiError::invalid(
            &format!("{field}.type"),
            format!(
                "must be \"message\", \"function_call\", \"function_call_output\" or \"reasoning\", got {other:?}"
            ),
        )),
    }
}

#[derive(Deserialize)]
struct FlatTool {
    #[serde(rename = "type")]
    kind: String,
    name: String,
    description: Option<String>,
    parameters: Option<Value>,
    /// Calls always follow the schema: accepted, changes nothing.
    #[allow(dead_code)]
    strict: Option<bool>,
}

/// The request's tools: Responses' flat function tools, validated as chat's are.
pub fn tools(
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
) -> Result<Option<Tools>, ApiError> {
    let tools = tools
        .map(|tools| {
            tools
                .into_iter()
                .enumerate()
                .map(|(i, tool)| {
                    let field = format!("tools[{i}]");
                    let kind = tool.get("type").and_then(Value::as_str).unwrap_or("");
                    if kind != "function" {
                        return Err(ApiError::invalid(
                            &format!("{field}.type"),
                            format!("only \"function\" tools are supported, got {kind:?}"),
                        ));
                    }
                    let t: FlatTool = read(&field, tool)?;
                    Ok(Tool {
                        kind: t.kind,
                        function: FunctionDefinition {
                            name: t.name,
                            description: t.description,
                            parameters: t.parameters,
                        },
                    })
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    Tools::from_shape(tools, tool_choice, parallel_tool_calls, Shape::Flat)
}

/// `text.format` as a constraint, through the same path as chat's `response_format`.
pub fn format(text: Option<&Value>) -> Result<Option<Constraint>, ApiError> {
    let Some(format) = text.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let schema = format.get("schema").cloned();
    let grammar = format_grammar("text.format", format, schema, "text.format.schema")?;
    Ok(grammar.map(|g| Constraint::new("text.format", g)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tools::ToolChoice;
    use crate::constraints::Grammar;
    use serde_json::json;

    fn param(e: ApiError) -> String {
        e.body.error.param.unwrap()
    }

    #[test]
    fn a_string_is_one_user_message_and_items_keep_their_order() {
        assert_eq!(
            input_items(json!("hi")).unwrap(),
            [Item::Message {
                role: "user".into(),
                text: "hi".into()
            }]
        );
        let items = input_items(json!([
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{\"x\": 1}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        ]))
        .unwrap();
        assert_eq!(
            items,
            [
                Item::Message {
                    role: "developer".into(),
                    text: "Be brief.".into()
                },
                Item::Message {
                    role: "user".into(),
                    text: "ab".into()
                },
                Item::FunctionCall {
                    call_id: "call_1".into(),
                    name: "f".into(),
                    arguments: "{\"x\": 1}".into()
                },
                Item::FunctionCallOutput {
                    call_id: "call_1".into(),
                    output: "42".into()
                },
            ]
        );
    }

    #[test]
    fn bad_items_name_their_field() {
        let cases = [
            (json!([]), "input"),
            (json!(3), "input"),
            (
                json!([{"role": "user", "content": "a"}, {"role": "user",
                    "content": [{"type": "input_image", "image_url": "http://x"}]}]),
                "input[1].content[0]",
            ),
            (json!([{"type": "input_image"}]), "input[0].type"),
            (json!([{"role": "tool", "content": "a"}]), "input[0].role"),
            (
                json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]),
                "input[0].arguments",
            ),
            (
                json!([{"type": "function_call_output", "output": "1"}]),
                "input[0]",
            ),
        ];
        for (input, field) in cases {
            let err = input_items(input.clone()).unwrap_err();
            assert_eq!(param(err), field, "{input}");
        }
    }

    #[test]
    fn flat_tools_and_choices_map_to_chat_s_tools() {
        let weather = json!({"type": "function", "name": "get_weather", "strict": true,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}});
        let t = tools(
            Some(vec![weather.clone()]),
            Some(json!({"type": "function", "name": "get_weather"})),
            Some(false),
        )
        .unwrap()
        .unwrap();
        assert_eq!(t.choice, ToolChoice::Function("get_weather".into()));
        assert!(!t.parallel);
        assert_eq!(t.functions[0].parameters, weather["parameters"]);
        for (choice, want) in [
            ("none", ToolChoice::None),
            ("auto", ToolChoice::Auto),
            ("required", ToolChoice::Required),
        ] {
            let t = tools(Some(vec![weather.clone()]), Some(json!(choice)), None);
            assert_eq!(t.unwrap().unwrap().choice, want);
        }
        let cases = [
            (vec![json!({"type": "web_search"})], None, "tools[0].type"),
            (vec![json!({"type": "function"})], None, "tools[0]"),
            (
                vec![json!({"type": "function", "name": "bad name"})],
                None,
                "tools[0].name",
            ),
            (
                vec![weather.clone()],
                Some(json!({"type": "function", "name": "other"})),
                "tool_choice.name",
            ),
            (vec![weather], Some(json!("sometimes")), "tool_choice"),
        ];
        for (list, choice, field) in cases {
            let err = tools(Some(list), choice, None).unwrap_err();
            assert_eq!(param(err), field);
        }
    }

    #[test]
    fn text_format_maps_as_response_format_does() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let grammar = |text: Value| format(Some(&text)).unwrap().map(|c| (c.field, c.grammar));
        assert_eq!(grammar(json!({"format": {"type": "text"}})), None);
        assert_eq!(format(None).unwrap(), None);
        assert_eq!(
            grammar(json!({"format": {"type": "json_object"}})),
            Some((
                "text.format".into(),
                Grammar::JsonSchema(json!({"type": "object"}))
            ))
        );
        assert_eq!(
            grammar(
                json!({"format": {"type": "json_schema", "name": "a", "schema": schema,
                "strict": true}})
            ),
            Some(("text.format".into(), Grammar::JsonSchema(schema)))
        );
        let err = format(Some(
            &json!({"format": {"type": "json_schema", "name": "a"}}),
        ));
        assert_eq!(param(err.unwrap_err()), "text.format.schema");
        let err = format(Some(&json!({"format": {"type": "yaml"}})));
        assert_eq!(param(err.unwrap_err()), "text.format.type");
    }
}

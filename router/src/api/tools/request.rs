//! The request fields of tool calling, `tools`, `tool_choice` and `parallel_tool_calls`,
//! validated into `Tools`; every bad value is a 400 naming its field, as the request's
//! API spells it (`Shape`).

use std::collections::HashSet;

use serde::Deserialize;
use serde_json::{json, Value};
use utoipa::ToSchema;

use crate::api::error::ApiError;

/// One entry of `tools`, as OpenAI's clients send it.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct Tool {
    /// Only "function".
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDefinition,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct FunctionDefinition {
    /// `^[a-zA-Z0-9_-]{1,64}$`, unique among the tools.
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema of the arguments [default: `{"type": "object", "properties": {}}`];
    /// calls always follow it (OpenAI's `strict` is accepted and changes nothing).
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Value>,
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No calls: the template still sees the tools, the output is plain text.
    None,
    /// Text, or calls (the default when tools are given).
    Auto,
    /// One or more calls, at once.
    Required,
    /// Exactly one call to this function, at once.
    Function(String),
}

impl ToolChoice {
    /// A call to the function `name`, which must be one of `functions` (else a 400
    /// naming `field`).
    pub fn named(name: String, functions: &[Function], field: &str) -> Result<Self, ApiError> {
        if !functions.iter().any(|f| f.name == name) {
            return Err(ApiError::invalid(
                field,
                format!("{name:?} is not one of the tools"),
            ));
        }
        Ok(Self::Function(name))
    }
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema object.
    pub parameters: Value,
}

/// A request's tools, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub functions: Vec<Function>,
    pub choice: ToolChoice,
    /// Several calls may be made in one answer (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

/// Where an API puts a function's fields: chat nests them under `function`
/// (`tools[i].function.name`, `tool_choice.function.name`); the Responses API puts them
/// on the tool itself (`tools[i].name`, `tool_choice.name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Chat,
    Flat,
}

impl Shape {
    /// Where the function that `base` holds is declared.
    fn holder(self, base: &str) -> String {
        match self {
            Shape::Chat => format!("{base}.function"),
            Shape::Flat => base.to_string(),
        }
    }

    /// The field `name` of the function that `base` holds.
    fn field(self, base: &str, name: &str) -> String {
        format!("{}.{name}", self.holder(base))
    }
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Function {
    /// A function as a request declares it, its name and schema checked; `field` names
    /// the tool's entry in the request's own shape (`tools[i].function` for OpenAI's),
    /// `schema_key` its schema's key there.
    pub fn new(
        field: &str,
        name: String,
        description: Option<String>,
        (schema_key, schema): (&str, Option<Value>),
    ) -> Result<Self, ApiError> {
        if !valid_name(&name) {
            return Err(ApiError::invalid(
                &format!("{field}.name"),
                format!("must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name:?}"),
            ));
        }
        let parameters = match schema {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(Value::Object(schema)) => Value::Object(schema),
            Some(other) => {
                return Err(ApiError::invalid(
                    &format!("{field}.{schema_key}"),
                    format!("must be a JSON schema object, got {other}"),
                ))
            }
        };
        Ok(Self {
            name,
            description,
            parameters,
        })
    }
}

fn function(i: usize, tool: Tool, shape: Shape) -> Result<Function, ApiError> {
    if tool.kind != "function" {
        return Err(ApiError::invalid(
            &format!("tools[{i}].type"),
            format!("must be \"function\", got {:?}", tool.kind),
        ));
    }
    let f = tool.function;
    Function::new(
        &shape.holder(&format!("tools[{i}]")),
        f.name,
        f.description,
        ("parameters", f.parameters),
    )
}

fn choice(value: Value, functions: &[Function], shape: Shape) -> Result<ToolChoice, ApiError> {
    let named = |value: &Value| -> Option<String> {
        if value.get("type")?.as_str()? != "function" {
            return None;
        }
        let holder = match shape {
            Shape::Chat => value.get("function")?,
            Shape::Flat => value,
        };
        Some(holder.get("name")?.as_str()?.to_string())
    };
    match &value {
        Value::String(s) if s == "none" => Ok(ToolChoice::None),
        Value::String(s) if s == "auto" => Ok(ToolChoice::Auto),
        Value::String(s) if s == "required" => Ok(ToolChoice::Required),
        Value::Object(_) => {
            let name = named(&value).ok_or_else(|| {
                let shown = match shape {
                    Shape::Chat => "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                    Shape::Flat => "{\"type\": \"function\", \"name\": ...}",
                };
                ApiError::invalid("tool_choice", format!("must be {shown}"))
            })?;
            ToolChoice::named(name, functions, &shape.field("tool_choice", "name"))
        }
        other => Err(ApiError::invalid(
            "tool_choice",
            format!("must be \"none\", \"auto\", \"required\" or a function, got {other}"),
        )),
    }
}

/// Refuses a function named as an earlier one; `field(i)` names tool i's name field.
pub fn unique_names(
    functions: &[Function],
    field: impl Fn(usize) -> String,
) -> Result<(), ApiError> {
    let mut seen = HashSet::new();
    for (i, f) in functions.iter().enumerate() {
        if !seen.insert(f.name.as_str()) {
            return Err(ApiError::invalid(
                &field(i),
                format!("{:?} names an earlier tool too", f.name),
            ));
        }
    }
    Ok(())
}

impl Tools {
    /// A chat request's tools; `None` when it has none (`tools` absent, null or empty).
    pub fn from_request(
        tools: Option<Vec<Tool>>,
        tool_choice: Option<Value>,
        parallel_tool_calls: Option<bool>,
    ) -> Result<Option<Self>, ApiError> {
        Self::from_shape(tools, tool_choice, parallel_tool_calls, Shape::Chat)
    }

    /// The tools of a request whose API spells its fields as `shape` says.
    pub fn from_shape(
        tools: Option<Vec<Tool>>,
        tool_choice: Option<Value>,
        parallel_tool_calls: Option<bool>,
        shape: Shape,
    ) -> Result<Option<Self>, ApiError> {
        let tool_choice = tool_choice.filter(|v| !v.is_null());
        let tools = tools.unwrap_or_default();
        if tools.is_empty() {
            if tool_choice.is_some() {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "is only allowed when tools are given",
                ));
            }
            return Ok(None);
        }
        let functions = tools
            .into_iter()
            .enumerate()
            .map(|(i, tool)| function(i, tool, shape))
            .collect::<Result<Vec<_>, _>>()?;
        unique_names(&functions, |i| shape.field(&format!("tools[{i}]"), "name"))?;
        let choice = match tool_choice {
            None => ToolChoice::Auto,
            Some(value) => choice(value, &functions, shape)?,
        };
        Ok(Some(Self {
            functions,
            choice,
            parallel: parallel_tool_calls.unwrap_or(true),
        }))
    }

    /// Whether the model may call (and its output is constrained and read for calls):
    /// every choice but "none".
    pub fn may_call(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The functions the output may call: the named one, or all.
    pub fn callable(&self) -> impl Iterator<Item = &Function> {
        self.functions.iter().filter(|f| match &self.choice {
            ToolChoice::Function(name) => &f.name == name,
            _ => true,
        })
    }

    /// The tools as a chat template sees them (transformers' `apply_chat_template(tools=)`):
    /// OpenAI's `{"type": "function", "function": {"name", "description", "parameters"}}`.
    pub fn template_list(&self) -> Vec<Value> {
        self.functions
            .iter()
            .map(|f| {
                let mut function = serde_json::Map::new();
                function.insert("name".into(), f.name.clone().into());
                if let Some(description) = &f.description {
                    function.insert("description".into(), description.clone().into());
                }
                function.insert("parameters".into(), f.parameters.clone());
                json!({"type": "function", "function": function})
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(body: Value) -> Result<Option<Tools>, ApiError> {
        #[derive(Deserialize)]
        struct Fields {
            tools: Option<Vec<Tool>>,
            tool_choice: Option<Value>,
            parallel_tool_calls: Option<bool>,
        }
        let f: Fields = serde_json::from_value(body).unwrap();
        Tools::from_request(f.tools, f.tool_choice, f.parallel_tool_calls)
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather",
            "description": "Today's weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    #[test]
    fn defaults_are_auto_parallel_and_an_empty_object_schema() {
        let t =
            tools(json!({"tools": [weather(), {"type": "function", "function": {"name": "now"}}]}))
                .unwrap()
                .unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert!(t.parallel && t.may_call());
        assert_eq!(
            t.functions[1].parameters,
            json!({"type": "object", "properties": {}})
        );
        assert_eq!(
            t.template_list()[1],
            json!({"type": "function", "function": {"name": "now",
                "parameters": {"type": "object", "properties": {}}}})
        );
        assert_eq!(t.template_list()[0], weather());
    }

    #[test]
    fn each_choice_is_read() {
        let cases = [
            (json!("none"), ToolChoice::None),
            (json!("auto"), ToolChoice::Auto),
            (json!("required"), ToolChoice::Required),
            (
                json!({"type": "function", "function": {"name": "get_weather"}}),
                ToolChoice::Function("get_weather".into()),
            ),
        ];
        for (choice, want) in cases {
            let body = json!({"tools": [weather()], "tool_choice": choice,
                "parallel_tool_calls": false});
            let t = tools(body).unwrap().unwrap();
            assert_eq!(t.choice, want);
            assert!(!t.parallel);
        }
    }

    #[test]
    fn no_tools_is_none_and_a_choice_without_tools_is_refused() {
        assert!(tools(json!({})).unwrap().is_none());
        assert!(tools(json!({"tools": [], "parallel_tool_calls": true}))
            .unwrap()
            .is_none());
        let err = tools(json!({"tools": [], "tool_choice": "auto"})).unwrap_err();
        assert_eq!(err.body.error.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn errors_name_the_field() {
        let named = |name: &str| json!({"type": "function", "function": {"name": name}});
        let cases = [
            (
                json!({"tools": [weather(), {"type": "retrieval", "function": {"name": "x"}}]}),
                "tools[1].type",
            ),
            (
                json!({"tools": [weather(), named("get weather")]}),
                "tools[1].function.name",
            ),
            (json!({"tools": [named("")]}), "tools[0].function.name"),
            (
                json!({"tools": [named(&"x".repeat(65))]}),
                "tools[0].function.name",
            ),
            (
                json!({"tools": [weather(), weather()]}),
                "tools[1].function.name",
            ),
            (
                json!({"tools": [{"type": "function",
                    "function": {"name": "x", "parameters": "{}"}}]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [weather()], "tool_choice": "any"}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather()], "tool_choice": 3}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function"}}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather()],
                    "tool_choice": {"type": "function", "function": {"name": "other"}}}),
                "tool_choice.function.name",
            ),
        ];
        for (body, field) in cases {
            let err = tools(body.clone()).unwrap_err();
            assert_eq!(
                err.body.error.param.as_deref(),
                Some(field),
                "{body}: {err:?}"
            );
        }
    }

    #[test]
    fn a_named_choice_makes_only_that_function_callable() {
        let body = json!({"tools": [weather(), {"type": "function", "function": {"name": "now"}}],
            "tool_choice": {"type": "function", "function": {"name": "now"}}});
        let t = tools(body).unwrap().unwrap();
        let names: Vec<_> = t.callable().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["now"]);
    }
}

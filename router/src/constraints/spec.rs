//! What a request constrains its output to, as the client asked for it: a JSON schema, a
//! regular expression, a choice of strings or a Lark grammar, with the request field that
//! asked (named in every error about it).

use serde_json::Value;

/// The language the output must belong to.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// A JSON Schema; `{"type": "object"}` for OpenAI's `json_object` mode.
    JsonSchema(Value),
    /// A regular expression the whole output matches.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect (what tool calling builds too).
    Lark(String),
}

/// A grammar and the request field it came from (`response_format`, `guided_json`,
/// `parameters.grammar`, `tools`, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct Constraint {
    pub grammar: Grammar,
    pub field: String,
}

impl Grammar {
    /// A JSON schema as requests send it: an object (or `true`), or a string holding one.
    /// The error completes a sentence that starts with the field's name.
    pub fn json_schema(value: Value) -> Result<Self, String> {
        let schema = match value {
            Value::String(text) => {
                serde_json::from_str(&text).map_err(|e| format!("is not a JSON schema: {e}"))?
            }
            other => other,
        };
        match schema {
            Value::Object(_) | Value::Bool(true) => Ok(Self::JsonSchema(schema)),
            other => Err(format!("must be a JSON schema object, got {other}")),
        }
    }
}

impl Constraint {
    pub fn new(field: impl Into<String>, grammar: Grammar) -> Self {
        Self {
            grammar,
            field: field.into(),
        }
    }
}

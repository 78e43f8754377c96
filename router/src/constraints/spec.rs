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

impl Constraint {
    pub fn new(field: impl Into<String>, grammar: Grammar) -> Self {
        Self {
            grammar,
            field: field.into(),
        }
    }
}

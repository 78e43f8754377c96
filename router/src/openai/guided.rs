//! The request fields that ask for structured output on the OpenAI routes: OpenAI's
//! `response_format`, and vLLM's `guided_json` / `guided_regex` / `guided_choice` /
//! `guided_grammar` and their newer `structured_outputs` object, so that clients written
//! for either work. At most one of them may constrain a request.

use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::api::ApiError;
use crate::constraints::{Constraint, Grammar};

/// Flattened into the chat and completions requests.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct GuidedFields {
    /// `{"type": "text"}`, `{"type": "json_object"}` or
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<Value>,
    /// vLLM: a JSON schema (an object, or a string holding one).
    #[schema(value_type = Option<Object>)]
    pub guided_json: Option<Value>,
    /// vLLM: a regular expression the whole output matches.
    pub guided_regex: Option<String>,
    /// vLLM: the output is exactly one of these strings.
    pub guided_choice: Option<Vec<String>>,
    /// vLLM: a grammar, in llguidance's Lark dialect.
    pub guided_grammar: Option<String>,
    /// vLLM: `{"json": ...}`, `{"regex": ...}`, `{"choice": [...]}`, `{"grammar": ...}`
    /// or `{"json_object": true}`.
    #[schema(value_type = Option<Object>)]
    pub structured_outputs: Option<Value>,
}

fn schema_of(field: &str, value: Value) -> Result<Grammar, ApiError> {
    Grammar::json_schema(value).map_err(|message| ApiError::invalid(field, message))
}

fn choice(field: &str, options: Vec<String>) -> Result<Grammar, ApiError> {
    if options.is_empty() {
        return Err(ApiError::invalid(field, "must list at least one choice"));
    }
    Ok(Grammar::Choice(options))
}

fn not_empty(field: &str, text: String) -> Result<String, ApiError> {
    if text.is_empty() {
        return Err(ApiError::invalid(field, "must not be empty"));
    }
    Ok(text)
}

fn response_format(format: Value) -> Result<Option<Grammar>, ApiError> {
    let schema = format
        .get("json_schema")
        .and_then(|j| j.get("schema"))
        .cloned();
    format_grammar(
        "response_format",
        &format,
        schema,
        "response_format.json_schema.schema",
    )
}

/// OpenAI's output format `{"type": "text" | "json_object" | "json_schema", ...}` as a
/// grammar (none for text): chat's `response_format` and the Responses API's
/// `text.format` (`field`), which hold the schema in different places (`schema`, found
/// at `schema_field`).
pub(super) fn format_grammar(
    field: &str,
    format: &Value,
    schema: Option<Value>,
    schema_field: &str,
) -> Result<Option<Grammar>, ApiError> {
    let kind = format.get("type").and_then(Value::as_str).unwrap_or("");
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Grammar::JsonSchema(
            serde_json::json!({"type": "object"}),
        ))),
        "json_schema" => {
            let schema = schema.ok_or_else(|| {
                ApiError::invalid(schema_field, "is required for type \"json_schema\"")
            })?;
            Ok(Some(schema_of(schema_field, schema)?))
        }
        other => Err(ApiError::invalid(
            &format!("{field}.type"),
            format!("must be \"text\", \"json_object\" or \"json_schema\", got {other:?}"),
        )),
    }
}

fn structured_outputs(value: Value) -> Result<Grammar, ApiError> {
    let Value::Object(map) = value else {
        return Err(ApiError::invalid("structured_outputs", "must be an object"));
    };
    let set: Vec<(String, Value)> = map.into_iter().filter(|(_, v)| !v.is_null()).collect();
    let [(key, value)] = <[_; 1]>::try_from(set).map_err(|set| {
        let keys: Vec<&str> = set.iter().map(|(k, _)| k.as_str()).collect();
        ApiError::invalid(
            "structured_outputs",
            format!(
                "must set exactly one of json, regex, choice, grammar, json_object; got {keys:?}"
            ),
        )
    })?;
    let field = format!("structured_outputs.{key}");
    let text = |v: Value| match v {
        Value::String(s) => not_empty(&field, s),
        _ => Err(ApiError::invalid(&field, "must be a string")),
    };
    match key.as_str() {
        "json" => schema_of(&field, value),
        "regex" => Ok(Grammar::Regex(text(value)?)),
        "grammar" => Ok(Grammar::Lark(text(value)?)),
        "choice" => {
            let options: Vec<String> = serde_json::from_value(value)
                .map_err(|_| ApiError::invalid(&field, "must be a list of strings"))?;
            choice(&field, options)
        }
        "json_object" if value == Value::Bool(true) => {
            Ok(Grammar::JsonSchema(serde_json::json!({"type": "object"})))
        }
        _ => Err(ApiError::invalid(
            &field,
            "is not one of json, regex, choice, grammar, json_object: true",
        )),
    }
}

impl GuidedFields {
    /// The one constraint these fields ask for, if any.
    pub fn constraint(self) -> Result<Option<Constraint>, ApiError> {
        let mut found: Vec<Constraint> = Vec::new();
        if let Some(format) = self.response_format.filter(|v| !v.is_null()) {
            if let Some(grammar) = response_format(format)? {
                found.push(Constraint::new("response_format", grammar));
            }
        }
        if let Some(schema) = self.guided_json.filter(|v| !v.is_null()) {
            let grammar = schema_of("guided_json", schema)?;
            found.push(Constraint::new("guided_json", grammar));
        }
        if let Some(regex) = self.guided_regex {
            let grammar = Grammar::Regex(not_empty("guided_regex", regex)?);
            found.push(Constraint::new("guided_regex", grammar));
        }
        if let Some(options) = self.guided_choice {
            found.push(Constraint::new(
                "guided_choice",
                choice("guided_choice", options)?,
            ));
        }
        if let Some(grammar) = self.guided_grammar {
            let grammar = Grammar::Lark(not_empty("guided_grammar", grammar)?);
            found.push(Constraint::new("guided_grammar", grammar));
        }
        if let Some(value) = self.structured_outputs.filter(|v| !v.is_null()) {
            found.push(Constraint::new(
                "structured_outputs",
                structured_outputs(value)?,
            ));
        }
        match found.len() {
            0 | 1 => Ok(found.pop()),
            _ => {
                let fields: Vec<&str> = found.iter().map(|c| c.field.as_str()).collect();
                Err(ApiError::invalid(
                    found[1].field.as_str(),
                    format!("only one structured-output field may be set, got {fields:?}"),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: Value) -> GuidedFields {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn each_field_maps_to_its_grammar() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some(Grammar::JsonSchema(json!({"type": "object"}))),
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some(Grammar::JsonSchema(schema.clone())),
            ),
            (
                json!({"guided_json": schema.to_string()}),
                Some(Grammar::JsonSchema(schema.clone())),
            ),
            (
                json!({"guided_regex": "a+"}),
                Some(Grammar::Regex("a+".into())),
            ),
            (
                json!({"guided_choice": ["x", "y"]}),
                Some(Grammar::Choice(vec!["x".into(), "y".into()])),
            ),
            (
                json!({"structured_outputs": {"choice": ["x"]}}),
                Some(Grammar::Choice(vec!["x".into()])),
            ),
            (
                json!({"structured_outputs": {"grammar": "start: \"a\""}}),
                Some(Grammar::Lark("start: \"a\"".into())),
            ),
        ];
        for (body, want) in cases {
            let got = fields(body.clone())
                .constraint()
                .unwrap()
                .map(|c| c.grammar);
            assert_eq!(got, want, "{body}");
        }
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format.json_schema.schema",
            ),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_choice": []}), "guided_choice"),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
                "structured_outputs",
            ),
            (
                json!({"guided_regex": "a", "response_format": {"type": "json_object"}}),
                "guided_regex",
            ),
        ];
        for (body, field) in cases {
            let err = fields(body.clone()).constraint().unwrap_err();
            assert_eq!(
                err.body.error.param.as_deref(),
                Some(field),
                "{body}: {err:?}"
            );
        }
    }
}

//! The Hermes/Qwen call format, the one place its tags are spelled: each call is a block
//! `<tool_call>\n{"name": "<fn>", "arguments": {...}}\n</tool_call>`, and a tool's result
//! goes back to the model as `<tool_response>\n...\n</tool_response>`.

use serde_json::Value;

/// Opens a call; the trigger after which the output must be a call.
pub const CALL_OPEN: &str = "<tool_call>";
/// Closes a call.
pub const CALL_CLOSE: &str = "</tool_call>";
const RESPONSE_OPEN: &str = "<tool_response>";
const RESPONSE_CLOSE: &str = "</tool_response>";

/// One call as the model writes it (and as history shows it to a template that has no
/// tool section).
pub fn call_block(name: &str, arguments: &Value) -> String {
    let name = Value::from(name);
    // The arguments compact, their keys in the order they came (serde_json's
    // preserve_order, which llguidance turns on).
    format!("{CALL_OPEN}\n{{\"name\": {name}, \"arguments\": {arguments}}}\n{CALL_CLOSE}")
}

/// One tool result as the model reads it.
pub fn response_block(content: &str) -> String {
    format!("{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_call_block_is_name_then_arguments_on_its_own_line() {
        let block = call_block("get_weather", &json!({"city": "Paris", "days": 2}));
        assert_eq!(
            block,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\",\"days\":2}}\n</tool_call>"
        );
        assert_eq!(
            response_block("22°C"),
            "<tool_response>\n22°C\n</tool_response>"
        );
    }
}

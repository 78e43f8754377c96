//! The tool prompt: what the model is told when its chat template has no tool section
//! of its own (the embedded SmolLM2's has none). It lists the tools as JSON and asks
//! for the call format `format` writes and the grammar enforces; it becomes the system
//! message (after the request's own system text, when there is one).

use serde_json::Value;

use super::format::{call_block, CALL_CLOSE, CALL_OPEN};
use crate::chat::TemplateMessage;

/// The system text listing `tools` (OpenAI's `{"type": "function", "function": ...}`
/// objects) and how to call them; `parallel: false` asks for one call at most.
pub fn tool_prompt(tools: &[Value], parallel: bool) -> String {
    let listed: Vec<String> = tools.iter().map(Value::to_string).collect();
    let example = call_block(
        "<function name>",
        &serde_json::json!({"<parameter>": "<value>"}),
    );
    let how_many = if parallel {
        "one block per call"
    } else {
        "at most one call"
    };
    format!(
        "You can call functions to help answer. They are described as JSON, one per line, \
         between <tools> and </tools>:\n<tools>\n{}\n</tools>\n\
         To call a function, answer with a {CALL_OPEN} block holding a JSON object with its \
         name and its arguments ({how_many}), and nothing after the blocks:\n{example}\n\
         Results come back in <tool_response> blocks. If no function helps, answer in \
         plain text, without {CALL_OPEN} or {CALL_CLOSE}.",
        listed.join("\n")
    )
}

/// `messages` with the tool prompt as their system message: after the first message's
/// text when it is a system message, else as a new first message.
pub fn with_tool_prompt(
    mut messages: Vec<TemplateMessage>,
    prompt: String,
) -> Vec<TemplateMessage> {
    match messages.first_mut() {
        Some(first) if first.role == "system" => {
            let own = first.content.take().unwrap_or_default();
            first.content = Some(if own.is_empty() {
                prompt
            } else {
                format!("{own}\n\n{prompt}")
            });
        }
        _ => messages.insert(0, TemplateMessage::text("system", prompt)),
    }
    messages
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_prompt_lists_each_tool_and_the_call_format() {
        let tools = [
            json!({"type": "function", "function": {"name": "a", "parameters": {}}}),
            json!({"type": "function", "function": {"name": "b", "parameters": {}}}),
        ];
        let prompt = tool_prompt(&tools, true);
        assert!(prompt.contains(&format!("<tools>\n{}\n{}\n</tools>", tools[0], tools[1])));
        assert!(prompt.contains(
            "<tool_call>\n{\"name\": \"<function name>\", \"arguments\": {\"<parameter>\":\"<value>\"}}\n</tool_call>"
        ));
        assert!(prompt.contains("one block per call"));
        assert!(tool_prompt(&tools, false).contains("at most one call"));
    }

    #[test]
    fn the_prompt_follows_the_system_text_or_becomes_it() {
        let user = TemplateMessage::text("user", "hi");
        let m = with_tool_prompt(
            vec![TemplateMessage::text("system", "Be brief."), user.clone()],
            "P".into(),
        );
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].content.as_deref(), Some("Be brief.\n\nP"));
        let m = with_tool_prompt(vec![user], "P".into());
        assert_eq!(
            (m[0].role.as_str(), m[0].content.as_deref()),
            ("system", Some("P"))
        );
        assert_eq!(m[1].role, "user");
    }
}

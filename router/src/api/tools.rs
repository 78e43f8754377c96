//! OpenAI tool calling on `/v1/chat/completions`, in the Hermes/Qwen call format: the
//! model answers with text, or with one `<tool_call>\n{"name": ..., "arguments": {...}}
//! \n</tool_call>` block per call, which a grammar enforces and the route reads back
//! into `message.tool_calls`.
//!
//! - `request`: `tools`, `tool_choice`, `parallel_tool_calls`, validated.
//! - `history`: assistant `tool_calls` and `tool` messages as templates read them.
//! - `prompt`: what the model is told when its template has no tool section.
//! - `format`: the call and result blocks.
//! - `grammar`: the Lark grammar of an output that may call.
//! - `output`: the output read back into content and calls, incrementally.
//! - `answer`: a choice's message or stream deltas, and its finish reason.
//! - `calls`: the calls in OpenAI's shapes.

mod answer;
mod calls;
mod format;
mod grammar;
mod history;
mod output;
mod prompt;
mod request;

use serde_json::Value;

pub use answer::{DeltaPart, Reading, StreamedAnswer};
pub use calls::{random_id, FunctionCall, FunctionDelta, ToolCall, ToolCallDelta};
pub use grammar::tags_are_special;
pub use history::{call_arguments, tool_fields};
pub use output::Piece;
pub use request::{unique_names, Function, FunctionDefinition, Shape, Tool, ToolChoice, Tools};

use crate::api::error::ApiError;
use crate::chat::TemplateMessage;
use crate::constraints::Constraint;

/// The request's constraint: the tool grammar when the model may call, else the
/// `response_format` / `guided_*` one. Both at once are refused, naming the guided
/// field: calls have their own grammar, and an output cannot follow two. With
/// `tool_choice: "none"` the guided constraint applies (the template still sees the
/// tools).
pub fn constraint(
    tools: Option<&Tools>,
    guided: Option<Constraint>,
    special_tags: bool,
) -> Result<Option<Constraint>, ApiError> {
    let Some(tools) = tools.filter(|t| t.may_call()) else {
        return Ok(guided);
    };
    if let Some(guided) = guided {
        return Err(ApiError::invalid(
            &guided.field,
            "cannot constrain an answer that may call tools; set tool_choice to \"none\" \
             to use it with tools",
        ));
    }
    Ok(grammar::constraint(tools, special_tags))
}

/// The messages and tools the chat template renders. A template with a tool section
/// gets both as transformers passes them; one without gets the calls and results
/// written as text (`history::as_plain_text`) and, when the model may call, the tool
/// prompt as its system message.
pub fn template_input(
    messages: Vec<TemplateMessage>,
    tools: Option<&Tools>,
    template_supports_tools: bool,
) -> (Vec<TemplateMessage>, Option<Vec<Value>>) {
    if template_supports_tools {
        return (messages, tools.map(Tools::template_list));
    }
    let messages = history::as_plain_text(messages);
    match tools.filter(|t| t.may_call()) {
        Some(tools) => {
            let text = prompt::tool_prompt(&tools.template_list(), tools.parallel);
            (prompt::with_tool_prompt(messages, text), None)
        }
        None => (messages, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ChatTemplate;
    use crate::constraints::Grammar;
    use request::ToolChoice;
    use serde_json::json;

    fn tools(choice: ToolChoice) -> Tools {
        let parameters = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        Tools {
            functions: vec![request::Function {
                name: "get_weather".into(),
                description: Some("Weather now".into()),
                parameters,
            }],
            choice,
            parallel: true,
        }
    }

    fn guided() -> Constraint {
        Constraint::new(
            "response_format",
            Grammar::JsonSchema(json!({"type": "object"})),
        )
    }

    #[test]
    fn tools_and_a_guided_constraint_only_mix_under_tool_choice_none() {
        let auto = tools(ToolChoice::Auto);
        let err = constraint(Some(&auto), Some(guided()), false).unwrap_err();
        assert_eq!(err.body.error.param.as_deref(), Some("response_format"));
        let c = constraint(Some(&auto), None, false).unwrap().unwrap();
        assert_eq!(c.field, "tools");
        let none = tools(ToolChoice::None);
        assert_eq!(
            constraint(Some(&none), Some(guided()), false).unwrap(),
            Some(guided())
        );
        assert_eq!(constraint(Some(&none), None, false).unwrap(), None);
        assert_eq!(
            constraint(None, Some(guided()), false).unwrap(),
            Some(guided())
        );
    }

    /// SmolLM2-135M-Instruct's template, which has no tool section.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn history() -> Vec<TemplateMessage> {
        let (calls, _) = tool_fields(
            1,
            "assistant",
            Some(vec![serde_json::from_value(
                json!({"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}),
            )
            .unwrap()]),
            None,
        )
        .unwrap();
        vec![
            TemplateMessage::text("user", "Weather in Paris?"),
            TemplateMessage {
                content: None,
                tool_calls: calls,
                ..TemplateMessage::text("assistant", "")
            },
            TemplateMessage {
                tool_call_id: Some("call_1".into()),
                ..TemplateMessage::text("tool", "22°C")
            },
        ]
    }

    #[test]
    fn a_template_without_tools_gets_the_prompt_and_history_as_text() {
        let template = ChatTemplate::new(SMOLLM2.into(), String::new(), String::new()).unwrap();
        assert!(!template.supports_tools());
        let auto = tools(ToolChoice::Auto);
        let (messages, listed) = template_input(history(), Some(&auto), false);
        assert!(listed.is_none());
        let out = template.render(&messages, None).unwrap();
        let prompt = prompt::tool_prompt(&auto.template_list(), true);
        let want = format!(
            "<|im_start|>system\n{prompt}<|im_end|>\n\
             <|im_start|>user\nWeather in Paris?<|im_end|>\n\
             <|im_start|>assistant\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\":\"Paris\"}}}}\n</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\n22°C\n</tool_response><|im_end|>\n\
             <|im_start|>assistant\n"
        );
        assert_eq!(out, want);
        // tool_choice "none": no prompt; the template's own system message stays.
        let (messages, _) = template_input(history(), Some(&tools(ToolChoice::None)), false);
        let out = template.render(&messages, None).unwrap();
        assert!(out.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
        assert!(!out.contains("<tools>"));
    }

    #[test]
    fn a_template_with_tools_gets_them_and_the_history_as_is() {
        let template = concat!(
            "{% for t in tools or [] %}[{{ t.function.name }}: {{ t.function.description }}]{% endfor %}",
            "{% for m in messages %}{{ m.role }}:",
            "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}",
            "{{ m.content or '' }}{% if m.tool_call_id %}@{{ m.tool_call_id }}{% endif %};{% endfor %}"
        );
        let template = ChatTemplate::new(template.into(), String::new(), String::new()).unwrap();
        let auto = tools(ToolChoice::Auto);
        let (messages, listed) = template_input(history(), Some(&auto), template.supports_tools());
        let out = template.render(&messages, listed.as_deref()).unwrap();
        assert_eq!(
            out,
            "[get_weather: Weather now]user:Weather in Paris?;assistant:get_weather{\"city\": \"Paris\"};tool:22°C@call_1;"
        );
    }
}

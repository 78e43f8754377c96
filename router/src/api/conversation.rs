//! What chat completions, the Responses API and Anthropic's Messages do before generating: the
//! conversation rendered by the model's chat template (the tools listed there, or as the
//! tool prompt), and the output constrained to the tool grammar or to the requested
//! format, with the `Reading` that reads calls back out of it and the `Thinking` that
//! splits its reasoning from its answer (`--reasoning-parser`).

use super::error::ApiError;
use super::state::AppState;
use super::tools::{self, Reading, ToolChoice, Tools};
use crate::chat::{TemplateKwargs, TemplateMessage};
use crate::constraints::Constraint;
use crate::reasoning::Thinking;
use crate::validation::Prompt;

/// A conversation to answer.
pub(crate) struct Conversation {
    pub messages: Vec<TemplateMessage>,
    pub tools: Option<Tools>,
    /// The requested output format (`response_format`, `text.format`, vLLM's fields).
    pub format: Option<Constraint>,
    /// The request field that holds the messages, named in template errors.
    pub field: &'static str,
    /// More variables for the template (`chat_template_kwargs`, Anthropic's `thinking`).
    pub template_kwargs: TemplateKwargs,
}

/// A conversation ready to submit.
pub(crate) struct Prepared {
    /// The rendered text; the template wrote the special tokens itself.
    pub text: String,
    pub constraint: Option<Constraint>,
    /// Set when the model may call tools: reads the answer (never the reasoning).
    pub reading: Option<Reading>,
    /// Set with `--reasoning-parser`: splits each output's reasoning from its answer.
    pub thinking: Option<Thinking>,
}

impl Conversation {
    pub async fn prepare(self, state: &AppState) -> Result<Prepared, ApiError> {
        let field = self.field;
        let Some(template) = state.chat.clone() else {
            return Err(ApiError::invalid(
                field,
                "the model has no chat template (use /v1/completions)",
            ));
        };
        let tools = self.tools;
        let (messages, listed) =
            tools::template_input(self.messages, tools.as_ref(), template.supports_tools());
        let kwargs = self.template_kwargs;
        let text = tokio::task::spawn_blocking(move || {
            template.render_with(&messages, listed.as_deref(), &kwargs)
        })
        .await
        .map_err(|e| ApiError::invalid(field, e.to_string()))?
        .map_err(|e| ApiError::invalid(field, e))?;
        // A grammar that shapes the output from its first token (a format, calls that
        // must come at once) leaves no room for reasoning: the whole output is the answer.
        let shaped_from_start = self.format.is_some()
            || tools.as_ref().is_some_and(|t| {
                matches!(t.choice, ToolChoice::Required | ToolChoice::Function(_))
            });
        let special_tags = tools::tags_are_special(&state.infer.validation.tokenizer);
        let constraint = tools::constraint(tools.as_ref(), self.format, special_tags)?;
        Ok(Prepared {
            thinking: Thinking::of(state.reasoning, &text).filter(|_| !shaped_from_start),
            text,
            constraint,
            reading: Reading::of(tools.as_ref()),
        })
    }
}

/// The prompt to submit for a rendered conversation: no special tokens added (the
/// template wrote them).
pub(crate) fn template_prompt(text: String) -> Prompt {
    Prompt::Text {
        text,
        add_special: false,
    }
}

//! `POST /v1/chat/completions`: the messages rendered by the model's chat template
//! (`crate::chat`), `n` choices, logprobs in the chat shape, structured outputs
//! (`guided`), tool calling (`tools`), the reasoning split from the answer with
//! `--reasoning-parser` (`message.reasoning`, `delta.reasoning`).

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::envelope::{Envelope, FINGERPRINT};
use super::guided::GuidedFields;
use super::logprobs::ChatLogprobs;
use super::stream::{self, ChunkUsage, Chunks, StreamOptions};
use crate::api::tools::{
    self, DeltaPart, Reading, StreamedAnswer, Tool, ToolCall, ToolCallDelta, Tools,
};
use crate::api::{
    collect_all, model_adapter, submit, template_prompt, with_sampling_fields, ApiError, AppState,
    ChoiceFinish, Conversation, Generation, OpenAiError, OpenAiJson, ParamNames, Role, Sampling,
    Usage,
};
use crate::chat::{TemplateKwargs, TemplateMessage};
use crate::detokenize::TokenizerInfo;
use crate::infer::{Submitted, TokenEvent};
use crate::reasoning::{Thinking, ThinkingStream};

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

impl MessageContent {
    /// The text of a content, its parts (at `field`) of the `kinds` that hold text;
    /// any other part is refused.
    pub(super) fn into_text(self, field: &str, kinds: &[&str]) -> Result<String, ApiError> {
        let parts = match self {
            MessageContent::Text(text) => return Ok(text),
            MessageContent::Parts(parts) => parts,
        };
        let mut text = String::new();
        for (j, part) in parts.into_iter().enumerate() {
            match (part.kind.as_str(), part.text) {
                (kind, Some(t)) if kinds.contains(&kind) => text.push_str(&t),
                (kind, _) => {
                    return Err(ApiError::invalid(
                        &format!("{field}[{j}]"),
                        format!("only text parts ({kinds:?}) are supported, got {kind:?}"),
                    ))
                }
            }
        }
        Ok(text)
    }
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    /// An assistant's calls (`function.arguments` a JSON string).
    pub tool_calls: Option<Vec<ToolCall>>,
    /// A `tool` message's answer to this call (required there).
    pub tool_call_id: Option<String>,
}

with_sampling_fields! {
    #[derive(Debug, Clone, Deserialize, ToSchema)]
    pub struct ChatRequest {
        pub model: Option<String>,
        pub messages: Vec<ChatMessage>,
        /// Most tokens to generate per choice (deprecated name of max_completion_tokens).
        pub max_tokens: Option<u32>,
        pub max_completion_tokens: Option<u32>,
        pub stream: Option<bool>,
        pub stream_options: Option<StreamOptions>,
        /// Return each token's logprob.
        pub logprobs: Option<bool>,
        /// Alternatives per token with logprobs (needs logprobs: true).
        pub top_logprobs: Option<u32>,
        /// Structured output: `response_format` and vLLM's `guided_*` / `structured_outputs`.
        #[serde(flatten)]
        pub guided: GuidedFields,
        /// Functions the model may call.
        pub tools: Option<Vec<Tool>>,
        /// "none", "auto" (the default with tools), "required", or
        /// `{"type": "function", "function": {"name": ...}}`.
        #[schema(value_type = Option<Object>)]
        pub tool_choice: Option<Value>,
        /// Several calls in one answer [default: true].
        pub parallel_tool_calls: Option<bool>,
        /// OpenAI's deprecated function calling: refused (use `tools`).
        #[schema(value_type = Option<Vec<Object>>)]
        pub functions: Option<Value>,
        /// As `functions`.
        #[schema(value_type = Option<Object>)]
        pub function_call: Option<Value>,
        pub user: Option<String>,
        /// More variables for the chat template (e.g. `{"enable_thinking": false}` for
        /// Qwen3's), as vLLM passes them to `apply_chat_template`.
        #[schema(value_type = Option<Object>)]
        pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
        /// "low", "medium" or "high": given to the chat template as `reasoning_effort`
        /// (templates that read it, such as gpt-oss's, use it; others ignore it).
        pub reasoning_effort: Option<String>,
        /// With --reasoning-parser: answer the reasoning too [default: true].
        pub include_reasoning: Option<bool>,
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AssistantMessage {
    role: Role,
    /// Null when the answer is only tool calls (or, with --reasoning-parser, only
    /// reasoning).
    content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<ToolCall>>,
    #[serde(flatten)]
    reasoning: Reasoning,
}

/// The reasoning (`--reasoning-parser`) under vLLM's name and the older one that clients
/// written for DeepSeek's API read; absent without it.
#[derive(Debug, Default, Serialize, ToSchema)]
pub struct Reasoning {
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<String>,
}

impl Reasoning {
    fn of(text: Option<String>) -> Self {
        Self {
            reasoning_content: text.clone(),
            reasoning: text,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatChoice {
    index: usize,
    message: AssistantMessage,
    logprobs: Option<ChatLogprobs>,
    finish_reason: ChoiceFinish,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatCompletion {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    system_fingerprint: String,
    choices: Vec<ChatChoice>,
    usage: Usage,
}

#[derive(Debug, Default, Serialize, ToSchema)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<Role>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<String>,
    /// A piece of one call: its opening (`id`, `type`, name) or arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<ToolCallDelta>>,
    /// A piece of the reasoning (`--reasoning-parser`).
    #[serde(flatten)]
    reasoning: Reasoning,
}

impl Delta {
    fn content(text: String) -> Self {
        Self {
            content: Some(text),
            ..Self::default()
        }
    }

    fn reasoning(text: String) -> Self {
        Self {
            reasoning: Reasoning::of(Some(text)),
            ..Self::default()
        }
    }
}

impl From<DeltaPart> for Delta {
    fn from(part: DeltaPart) -> Self {
        match part {
            DeltaPart::Content(text) => Self::content(text),
            DeltaPart::Call(call) => Self {
                tool_calls: Some(vec![call]),
                ..Self::default()
            },
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    index: usize,
    delta: Delta,
    logprobs: Option<ChatLogprobs>,
    finish_reason: Option<ChoiceFinish>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    system_fingerprint: String,
    choices: Vec<ChatChunkChoice>,
    /// As `stream::ChunkUsage` says.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Usage>)]
    usage: ChunkUsage,
}

impl ChatCompletionChunk {
    fn new(envelope: &Envelope, choices: Vec<ChatChunkChoice>, usage: ChunkUsage) -> Self {
        Self {
            id: envelope.id.clone(),
            object: "chat.completion.chunk",
            created: envelope.created,
            model: envelope.model.clone(),
            system_fingerprint: FINGERPRINT.into(),
            choices,
            usage,
        }
    }
}

const NAMES: ParamNames = ParamNames {
    inputs: Some("messages"),
    max_new_tokens: Some("max_completion_tokens"),
    top_n_tokens: Some("top_logprobs"),
    adapter_id: Some("model"),
    ..ParamNames::TGI
};

#[utoipa::path(post, path = "/v1/chat/completions", request_body = ChatRequest, tag = "OpenAI",
    responses((status = 200, description = "A chat completion, or an SSE stream of chat.completion.chunk ending with [DONE] when stream is true", body = ChatCompletion),
              (status = 400, body = OpenAiError), (status = 401, body = OpenAiError),
              (status = 429, body = OpenAiError)))]
pub async fn chat_completions(
    State(state): State<AppState>,
    OpenAiJson(mut r): OpenAiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    let fields = r.take_sampling();
    refuse_unsupported(&r)?;
    let adapter = model_adapter(&state, r.model.as_deref())?;
    let with_logprobs = r.logprobs.unwrap_or(false);
    if r.top_logprobs.is_some_and(|n| n > 0) && !with_logprobs {
        return Err(ApiError::invalid("top_logprobs", "needs logprobs: true"));
    }
    let tools = Tools::from_request(r.tools, r.tool_choice, r.parallel_tool_calls)?;
    let conversation = Conversation {
        messages: template_messages(r.messages)?,
        tools,
        format: r.guided.constraint()?,
        field: "messages",
        template_kwargs: template_kwargs(r.chat_template_kwargs, r.reasoning_effort)?,
    };
    let prepared = conversation.prepare(&state).await?;
    let sampling = Sampling {
        fields,
        max_tokens: r.max_completion_tokens.or(r.max_tokens),
        top_n: if with_logprobs { r.top_logprobs } else { None },
        ..Sampling::default()
    };
    let stream = r.stream.unwrap_or(false);
    let generation =
        Generation::new(sampling, adapter.clone(), stream)?.constrained(prepared.constraint);
    let tokenizer = state.infer.validation.tokenizer.clone();
    let reading = prepared.reading;
    let thinking = prepared.thinking;
    let include_reasoning = r.include_reasoning.unwrap_or(true);
    let n = generation.n();
    // The token limit is named as the client sent it.
    let names = if r.max_completion_tokens.is_none() && r.max_tokens.is_some() {
        ParamNames {
            max_new_tokens: Some("max_tokens"),
            ..NAMES
        }
    } else {
        NAMES
    };
    let prompts = vec![template_prompt(prepared.text)];
    let submitted = generation.submit(&state, prompts, &names).await?;
    if stream {
        let envelope = Envelope::new("chatcmpl", &state, adapter.as_deref());
        let include_usage = stream::include_usage(r.stream_options);
        let chat = ChatStream {
            n,
            envelope,
            tokenizer,
            with_logprobs,
            include_usage,
            names,
            reading,
            thinking,
            include_reasoning,
        };
        return Ok(chat.respond(submitted));
    }
    let answered = collect_all(submitted, &names).await?;
    let usage = submit::usage(&answered);
    let headers = submit::headers(&answered, &usage);
    let choices = answered
        .into_iter()
        .flat_map(|a| a.samples)
        .enumerate()
        .map(|(index, s)| {
            let usual = ChoiceFinish::from(s.end.finish_reason);
            let (reasoning, text) = match &thinking {
                None => (None, s.end.generated_text),
                Some(thinking) => {
                    let split = thinking.split(&s.end.generated_text);
                    (split.reasoning, split.content)
                }
            };
            let (mut message, finish_reason) = match &reading {
                // With a parser, an answer that is only reasoning has no content.
                None if thinking.is_some() && text.is_empty() => {
                    (AssistantMessage::calling(None, Vec::new()), usual)
                }
                None => (AssistantMessage::text(text), usual),
                Some(reading) => {
                    let answer = reading.answer(&text, usual);
                    (
                        AssistantMessage::calling(answer.content, answer.calls),
                        answer.finish_reason,
                    )
                }
            };
            message.reasoning = Reasoning::of(reasoning.filter(|_| include_reasoning));
            ChatChoice {
                index,
                logprobs: with_logprobs
                    .then(|| ChatLogprobs::of(&tokenizer, &s.tokens, &s.top_tokens)),
                message,
                finish_reason,
            }
        })
        .collect();
    let envelope = Envelope::new("chatcmpl", &state, adapter.as_deref());
    let body = ChatCompletion {
        id: envelope.id,
        object: "chat.completion",
        created: envelope.created,
        model: envelope.model,
        system_fingerprint: FINGERPRINT.into(),
        choices,
        usage,
    };
    Ok((headers, Json(body)).into_response())
}

impl AssistantMessage {
    fn text(content: String) -> Self {
        Self {
            role: Role::Assistant,
            content: Some(content),
            tool_calls: None,
            reasoning: Reasoning::default(),
        }
    }

    fn calling(content: Option<String>, calls: Vec<ToolCall>) -> Self {
        Self {
            role: Role::Assistant,
            content,
            tool_calls: (!calls.is_empty()).then_some(calls),
            reasoning: Reasoning::default(),
        }
    }
}

/// The template's extra variables: `chat_template_kwargs`, and `reasoning_effort` as
/// `reasoning_effort` unless the kwargs name it.
fn template_kwargs(
    kwargs: Option<serde_json::Map<String, Value>>,
    effort: Option<String>,
) -> Result<TemplateKwargs, ApiError> {
    let mut kwargs = kwargs.unwrap_or_default();
    if let Some(effort) = effort {
        if !["low", "medium", "high"].contains(&effort.as_str()) {
            let message = format!("must be \"low\", \"medium\" or \"high\", got {effort:?}");
            return Err(ApiError::invalid("reasoning_effort", message));
        }
        kwargs
            .entry("reasoning_effort")
            .or_insert(Value::String(effort));
    }
    Ok(kwargs)
}

/// Refuses what the request asks that cadence cannot do (rather than ignoring it).
fn refuse_unsupported(r: &ChatRequest) -> Result<(), ApiError> {
    for (field, value) in [
        ("functions", &r.functions),
        ("function_call", &r.function_call),
    ] {
        if value.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid(
                field,
                "the deprecated function calling is not supported; use tools and tool_choice",
            ));
        }
    }
    Ok(())
}

/// The template's messages: text contents, and tool calls and results.
fn template_messages(messages: Vec<ChatMessage>) -> Result<Vec<TemplateMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "must not be empty"));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let content = m
                .content
                .map(|c| c.into_text(&format!("messages[{i}].content"), &["text"]))
                .transpose()?;
            let (tool_calls, tool_call_id) =
                tools::tool_fields(i, &m.role, m.tool_calls, m.tool_call_id)?;
            // As transformers passes it: null for an assistant message that only calls.
            let content = match (content, &tool_calls) {
                (None, Some(_)) => None,
                (content, _) => Some(content.unwrap_or_default()),
            };
            Ok(TemplateMessage {
                role: m.role,
                content,
                name: m.name,
                tool_calls,
                tool_call_id,
            })
        })
        .collect()
}

/// How a chat answer streams.
struct ChatStream {
    n: usize,
    envelope: Envelope,
    tokenizer: TokenizerInfo,
    with_logprobs: bool,
    include_usage: bool,
    names: ParamNames,
    /// Set when the model may call tools: each choice's answer is read for calls.
    reading: Option<Reading>,
    /// Set with --reasoning-parser: each choice's reasoning is split from its answer.
    thinking: Option<Thinking>,
    /// Whether the reasoning is sent (else dropped).
    include_reasoning: bool,
}

impl ChatStream {
    fn respond(self, submitted: Vec<Submitted>) -> Response {
        let Self {
            n,
            envelope,
            tokenizer,
            with_logprobs,
            include_usage,
            names,
            reading,
            thinking,
            include_reasoning,
        } = self;
        // Each choice opens with the assistant's role.
        let opening = (0..n)
            .map(|index| {
                let delta = Delta {
                    role: Some(Role::Assistant),
                    ..Delta::content(String::new())
                };
                let choice = ChatChunkChoice {
                    index,
                    delta,
                    logprobs: None,
                    finish_reason: None,
                };
                ChatCompletionChunk::new(
                    &envelope,
                    vec![choice],
                    stream::no_usage_yet(include_usage),
                )
            })
            .collect();
        let mut answers: Option<Vec<StreamedAnswer>> =
            reading.map(|r| (0..n).map(|_| r.stream()).collect());
        let mut thoughts: Option<Vec<ThinkingStream>> =
            thinking.map(|t| (0..n).map(|_| t.stream()).collect());
        let last = envelope.clone();
        let chunks = Chunks {
            opening,
            token: move |index: usize, event: TokenEvent| {
                let logprobs = with_logprobs.then(|| {
                    ChatLogprobs::of(
                        &tokenizer,
                        std::slice::from_ref(&event.token),
                        std::slice::from_ref(&event.top_tokens),
                    )
                });
                let usual = event
                    .end
                    .as_ref()
                    .map(|e| ChoiceFinish::from(e.finish_reason));
                let mut deltas = Vec::new();
                let text = match thoughts.as_mut() {
                    None => Some(event.token.text),
                    Some(thoughts) => {
                        let parts = thoughts[index].next(&event.token.text, usual.is_some());
                        if include_reasoning && !parts.reasoning.is_empty() {
                            deltas.push(Delta::reasoning(parts.reasoning));
                        }
                        // Only answer text makes a content delta (an empty one would
                        // be sent for each token of reasoning).
                        Some(parts.content).filter(|c| !c.is_empty() || answers.is_some())
                    }
                };
                let reason = match (answers.as_mut(), text) {
                    (None, text) => {
                        deltas.extend(text.map(Delta::content));
                        usual
                    }
                    (Some(answers), text) => {
                        let text = text.unwrap_or_default();
                        let (parts, reason) = answers[index].next(&text, usual);
                        deltas.extend(parts.into_iter().map(Delta::from));
                        reason
                    }
                };
                token_chunks(index, deltas, logprobs, reason)
                    .into_iter()
                    .map(|choice| {
                        let usage = stream::no_usage_yet(include_usage);
                        ChatCompletionChunk::new(&envelope, vec![choice], usage)
                    })
                    .collect()
            },
            usage: move |usage| ChatCompletionChunk::new(&last, Vec::new(), Some(Some(usage))),
        };
        stream::respond(submitted, n, names, include_usage, chunks)
    }
}

/// One token's chunks of choice `index`: a chunk per delta (a token may close a call,
/// or send nothing while one is written), the token's logprobs on the first and the
/// finish reason on the last, an empty delta carrying them when there is none.
fn token_chunks(
    index: usize,
    mut deltas: Vec<Delta>,
    mut logprobs: Option<ChatLogprobs>,
    finish_reason: Option<ChoiceFinish>,
) -> Vec<ChatChunkChoice> {
    if deltas.is_empty() && (logprobs.is_some() || finish_reason.is_some()) {
        deltas.push(Delta::default());
    }
    let count = deltas.len();
    deltas
        .into_iter()
        .enumerate()
        .map(|(i, delta)| ChatChunkChoice {
            index,
            delta,
            logprobs: logprobs.take(),
            finish_reason: if i + 1 == count { finish_reason } else { None },
        })
        .collect()
}

//! `POST /v1/chat/completions`: the messages rendered by the model's chat template
//! (`crate::chat`), `n` choices, logprobs in the chat shape, structured outputs
//! (`guided`). Tools are refused until they are supported.

use std::collections::HashMap;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::error::{ApiError, OpenAiError, OpenAiJson, ParamNames};
use super::generate;
use super::guided::GuidedFields;
use super::logprobs::ChatLogprobs;
use super::sampling::{Sampling, StopInput};
use super::stream::{self, ChunkUsage, Chunks, StreamOptions};
use super::{finish_reason, Envelope, Usage, FINGERPRINT};
use crate::chat::TemplateMessage;
use crate::detokenize::TokenizerInfo;
use crate::infer::{Submitted, TokenEvent};
use crate::server::AppState;
use crate::validation::Prompt;

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

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub tool_calls: Option<Value>,
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    /// Most tokens to generate per choice (deprecated name of max_completion_tokens).
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    /// [0, 2]; 0 is greedy [default: 1].
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<StopInput>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    /// Return each token's logprob.
    pub logprobs: Option<bool>,
    /// Alternatives per token with logprobs (needs logprobs: true).
    pub top_logprobs: Option<u32>,
    pub seed: Option<u64>,
    /// Structured output: `response_format` and vLLM's `guided_*` / `structured_outputs`.
    #[serde(flatten)]
    pub guided: GuidedFields,
    /// Not supported yet (must be absent, null or empty).
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub user: Option<String>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// vLLM's extension: generate past the end-of-sequence token up to the token limit.
    pub ignore_eos: Option<bool>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AssistantMessage {
    role: &'static str,
    content: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatChoice {
    index: usize,
    message: AssistantMessage,
    logprobs: Option<ChatLogprobs>,
    finish_reason: &'static str,
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

#[derive(Debug, Serialize, ToSchema)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    index: usize,
    delta: Delta,
    logprobs: Option<ChatLogprobs>,
    finish_reason: Option<&'static str>,
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

const NAMES: ParamNames = &[
    ("max_new_tokens", "max_completion_tokens"),
    ("top_n_tokens", "top_logprobs"),
    ("inputs", "messages"),
];

/// The same, for a request that used the older name `max_tokens`.
const NAMES_MAX_TOKENS: ParamNames = &[
    ("max_new_tokens", "max_tokens"),
    ("top_n_tokens", "top_logprobs"),
    ("inputs", "messages"),
];

#[utoipa::path(post, path = "/v1/chat/completions", request_body = ChatRequest, tag = "OpenAI",
    responses((status = 200, description = "A chat completion, or an SSE stream of chat.completion.chunk ending with [DONE] when stream is true", body = ChatCompletion),
              (status = 400, body = OpenAiError), (status = 401, body = OpenAiError),
              (status = 429, body = OpenAiError)))]
pub async fn chat_completions(
    State(state): State<AppState>,
    OpenAiJson(r): OpenAiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    refuse_unsupported(&r)?;
    let with_logprobs = r.logprobs.unwrap_or(false);
    if r.top_logprobs.is_some_and(|n| n > 0) && !with_logprobs {
        return Err(ApiError::invalid("top_logprobs", "needs logprobs: true"));
    }
    let Some(template) = state.chat.clone() else {
        return Err(ApiError::invalid(
            "messages",
            "the model has no chat template (use /v1/completions)",
        ));
    };
    let messages = template_messages(r.messages)?;
    let text = tokio::task::spawn_blocking(move || template.render(&messages))
        .await
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?
        .map_err(|e| ApiError::invalid("messages", e))?;
    let sampling = Sampling {
        temperature: r.temperature,
        top_p: r.top_p,
        n: r.n,
        best_of: None,
        stop: r.stop,
        seed: r.seed,
        frequency_penalty: r.frequency_penalty,
        presence_penalty: r.presence_penalty,
        logit_bias: r.logit_bias,
        top_k: r.top_k,
        min_p: r.min_p,
        typical_p: r.typical_p,
        repetition_penalty: r.repetition_penalty,
        ignore_eos: r.ignore_eos,
        max_tokens: r.max_completion_tokens.or(r.max_tokens),
        top_n: if with_logprobs { r.top_logprobs } else { None },
        prompt_logprobs: false,
        echo: false,
    };
    let stream = r.stream.unwrap_or(false);
    let (parameters, mut extra) = sampling.into_parameters()?;
    extra.stream = stream;
    extra.constraint = r.guided.constraint()?;
    let n = extra.n.max(1) as usize;
    // The template writes the special tokens itself.
    let prompt = Prompt::Text {
        text,
        add_special: false,
    };
    let names = if r.max_completion_tokens.is_none() && r.max_tokens.is_some() {
        NAMES_MAX_TOKENS
    } else {
        NAMES
    };
    let submitted = generate::submit_all(&state, vec![prompt], parameters, extra, names).await?;
    let tokenizer = state.infer.validation.tokenizer.clone();
    if stream {
        let envelope = Envelope::new("chatcmpl", &state);
        let include_usage = stream::include_usage(r.stream_options);
        return Ok(chat_stream(
            submitted,
            n,
            envelope,
            tokenizer,
            with_logprobs,
            include_usage,
            names,
        ));
    }
    let answered = generate::collect_all(submitted, names).await?;
    let usage = generate::usage(&answered);
    let headers = generate::headers(&answered, &usage);
    let choices = answered
        .into_iter()
        .flat_map(|a| a.samples)
        .enumerate()
        .map(|(index, s)| ChatChoice {
            index,
            logprobs: with_logprobs.then(|| ChatLogprobs::of(&tokenizer, &s.tokens, &s.top_tokens)),
            message: AssistantMessage {
                role: "assistant",
                content: s.end.generated_text,
            },
            finish_reason: finish_reason(s.end.finish_reason),
        })
        .collect();
    let envelope = Envelope::new("chatcmpl", &state);
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

/// Refuses what the request asks that cadence cannot do yet (rather than ignoring it).
fn refuse_unsupported(r: &ChatRequest) -> Result<(), ApiError> {
    if r.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::invalid(
            "tools",
            "tool calling is not supported yet",
        ));
    }
    Ok(())
}

/// The template's messages: text contents only.
fn template_messages(messages: Vec<ChatMessage>) -> Result<Vec<TemplateMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "must not be empty"));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match m.content {
                None => String::new(),
                Some(MessageContent::Text(t)) => t,
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, part) in parts.into_iter().enumerate() {
                        match (part.kind.as_str(), part.text) {
                            ("text", Some(t)) => text.push_str(&t),
                            (kind, _) => {
                                return Err(ApiError::invalid(
                                    &format!("messages[{i}].content[{j}]"),
                                    format!("only text parts are supported, got {kind:?}"),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            if m.tool_calls.as_ref().is_some_and(|t| !t.is_null()) {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].tool_calls"),
                    "tool calls are not supported yet",
                ));
            }
            Ok(TemplateMessage {
                role: m.role,
                content,
                name: m.name,
            })
        })
        .collect()
}

fn chat_stream(
    submitted: Vec<Submitted>,
    n: usize,
    envelope: Envelope,
    tokenizer: TokenizerInfo,
    with_logprobs: bool,
    include_usage: bool,
    names: ParamNames,
) -> Response {
    let choice = |index, role, content, logprobs, finish_reason| ChatChunkChoice {
        index,
        delta: Delta { role, content },
        logprobs,
        finish_reason,
    };
    // Each choice opens with the assistant's role.
    let opening = (0..n)
        .map(|index| {
            let role = choice(index, Some("assistant"), Some(String::new()), None, None);
            ChatCompletionChunk::new(&envelope, vec![role], stream::no_usage_yet(include_usage))
        })
        .collect();
    let last = envelope.clone();
    let chunks = Chunks {
        opening,
        token: move |index, event: TokenEvent| {
            let logprobs = with_logprobs.then(|| {
                ChatLogprobs::of(
                    &tokenizer,
                    std::slice::from_ref(&event.token),
                    std::slice::from_ref(&event.top_tokens),
                )
            });
            let reason = event.end.as_ref().map(|e| finish_reason(e.finish_reason));
            let token = choice(index, None, Some(event.token.text), logprobs, reason);
            ChatCompletionChunk::new(&envelope, vec![token], stream::no_usage_yet(include_usage))
        },
        usage: move |usage| ChatCompletionChunk::new(&last, Vec::new(), Some(Some(usage))),
    };
    stream::respond(submitted, n, names, include_usage, chunks)
}

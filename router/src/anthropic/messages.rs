//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: the conversation prepared
//! as the chat route prepares its own (`api::conversation`: template, tools, their
//! grammar), generated with the same parameters, answered in Anthropic's shapes.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use super::answer::Message;
use super::convert;
use super::error::{AnthropicError, AnthropicJson, MessagesError};
use super::request::{CountTokensRequest, InputContent, MessagesRequest};
use super::request::{InputMessage, ThinkingConfig, ToolChoiceInput, ToolDefinition};
use super::stream::{self, Events};
use crate::api::submit;
use crate::api::{
    collect_all, model_adapter, template_prompt, ApiError, AppState, Conversation, Generation,
    ParamNames, Prepared, Sampling, SamplingFields, StopInput,
};

/// The router's parameter names as this API names them.
const NAMES: ParamNames = ParamNames {
    inputs: Some("messages"),
    max_new_tokens: Some("max_tokens"),
    stop: Some("stop_sequences"),
    adapter_id: Some("model"),
    ..ParamNames::TGI
};

#[derive(Debug, Serialize, ToSchema)]
pub struct TokenCount {
    /// The rendered prompt's tokens (what `usage.input_tokens` counts).
    pub input_tokens: usize,
}

/// The conversation's fields, checked, rendered and constrained to the tools' grammar.
async fn prepare(
    state: &AppState,
    system: Option<InputContent>,
    messages: Vec<InputMessage>,
    tools: Option<Vec<ToolDefinition>>,
    tool_choice: Option<ToolChoiceInput>,
    thinking: Option<ThinkingConfig>,
) -> Result<Prepared, ApiError> {
    let conversation = Conversation {
        tools: convert::tools(tools, tool_choice)?,
        messages: convert::template_messages(system, messages)?,
        format: None,
        field: "messages",
        template_kwargs: convert::template_kwargs(thinking)?,
    };
    conversation.prepare(state).await
}

#[utoipa::path(post, path = "/v1/messages", request_body = MessagesRequest, tag = "Anthropic",
    params(("x-api-key" = Option<String>, Header, description = "The API key, when the router has keys (or Authorization: Bearer)"),
           ("anthropic-version" = Option<String>, Header, description = "Accepted and ignored")),
    responses((status = 200, description = "A message, or with stream: true an SSE stream of message_start, content_block_start / content_block_delta / content_block_stop per block, message_delta and message_stop (error on a failure)", body = Message),
              (status = 400, body = AnthropicError), (status = 401, body = AnthropicError),
              (status = 429, body = AnthropicError), (status = 503, body = AnthropicError)))]
pub async fn messages(
    State(state): State<AppState>,
    AnthropicJson(r): AnthropicJson<MessagesRequest>,
) -> Result<Response, MessagesError> {
    let max_tokens = r
        .max_tokens
        .ok_or_else(|| ApiError::invalid("max_tokens", "is required"))?;
    // Anthropic samples by default, in [0, 1]; 0 is greedy.
    let temperature = r.temperature.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&temperature) {
        let message = format!("must be in [0, 1], got {temperature}");
        return Err(ApiError::invalid("temperature", message).into());
    }
    let adapter = model_adapter(&state, r.model.as_deref())?;
    let prepared = prepare(
        &state,
        r.system,
        r.messages,
        r.tools,
        r.tool_choice,
        r.thinking,
    )
    .await?;
    let sampling = Sampling {
        fields: SamplingFields {
            temperature: Some(temperature),
            top_p: r.top_p,
            top_k: r.top_k,
            stop: r.stop_sequences.map(StopInput::Many),
            ..SamplingFields::default()
        },
        max_tokens: Some(max_tokens),
        ..Sampling::default()
    };
    let stream = r.stream.unwrap_or(false);
    let generation =
        Generation::new(sampling, adapter.clone(), stream)?.constrained(prepared.constraint);
    let reading = prepared.reading;
    let thinking = prepared.thinking;
    let prompts = vec![template_prompt(prepared.text)];
    let submitted = generation.submit(&state, prompts, &NAMES).await?;
    let model = adapter.unwrap_or_else(|| state.info.served_model_name.clone());
    let input_tokens = submitted[0].request.input_ids.len();
    let message = Message::opening(model, input_tokens);
    if stream {
        let events = Events::new(reading.as_ref(), thinking.as_ref());
        let submitted = submitted.into_iter().next().expect("one prompt submitted");
        return Ok(stream::respond(submitted, message, events, NAMES));
    }
    let answered = collect_all(submitted, &NAMES).await?;
    let usage = submit::usage(&answered);
    let headers = submit::headers(&answered, &usage);
    let end = answered
        .into_iter()
        .flat_map(|a| a.samples)
        .next()
        .expect("one sample collected")
        .end;
    let message = message.answered(end, reading.as_ref(), thinking.as_ref());
    Ok((headers, Json(message)).into_response())
}

#[utoipa::path(post, path = "/v1/messages/count_tokens", request_body = CountTokensRequest, tag = "Anthropic",
    responses((status = 200, description = "The tokens of the prompt the conversation renders to", body = TokenCount),
              (status = 400, body = AnthropicError), (status = 401, body = AnthropicError)))]
pub async fn count_tokens(
    State(state): State<AppState>,
    AnthropicJson(r): AnthropicJson<CountTokensRequest>,
) -> Result<Json<TokenCount>, MessagesError> {
    model_adapter(&state, r.model.as_deref())?;
    let prepared = prepare(
        &state,
        r.system,
        r.messages,
        r.tools,
        r.tool_choice,
        r.thinking,
    )
    .await?;
    let text = prepared.text;
    let tokenizer = state.infer.validation.tokenizer.clone();
    let ids = tokio::task::spawn_blocking(move || tokenizer.encode_with(&text, false))
        .await
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?
        .map_err(|e| ApiError::invalid("messages", e))?;
    Ok(Json(TokenCount {
        input_tokens: ids.len(),
    }))
}

//! OpenAI's Responses API: `POST /v1/responses` and `GET /v1/responses/{id}`, on chat's
//! machinery (`crate::api::conversation`): the input items become the template's
//! messages, tools and `text.format` constrain the output as chat's `tools` and
//! `response_format` do, and the output is read back into message and `function_call`
//! items, whole or as streaming events.
//!
//! - `request`: the body, read into items, tools and the format constraint.
//! - `items`: conversation items and the template messages they become.
//! - `object`: the response object.
//! - `events`: the streaming events, and the writer both answers are made by.
//! - `stream`: the SSE answer.
//! - `keep`: what a finished response leaves in the store.

mod events;
mod items;
mod keep;
mod object;
mod request;
mod stream;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

pub use object::{
    IncompleteDetails, OutputItem, OutputText, ReasoningText, ResponseObject, ResponseUsage,
    Settings,
};
pub use request::ResponsesRequest;

use events::{Ending, Writer};
use keep::{Keep, Stored, NAMES};
use object::new_id;

use super::envelope::Envelope;
use crate::api::submit;
use crate::api::{
    collect_all, model_adapter, template_prompt, ApiError, AppState, Conversation, Generation,
    OpenAiError, OpenAiJson, Sampling, SamplingFields,
};

#[utoipa::path(post, path = "/v1/responses", request_body = ResponsesRequest, tag = "OpenAI",
    responses((status = 200, description = "A response, or with stream: true an SSE stream of typed events (response.created ... response.completed)", body = ResponseObject),
              (status = 400, body = OpenAiError), (status = 401, body = OpenAiError),
              (status = 429, body = OpenAiError)))]
pub async fn create_response(
    State(state): State<AppState>,
    OpenAiJson(r): OpenAiJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let adapter = model_adapter(&state, r.model.as_deref())?;
    let tools = request::tools(
        r.tools.clone(),
        r.tool_choice.clone(),
        r.parallel_tool_calls,
    )?;
    let format = request::format(r.text.as_ref())?;
    let mut conversation = match &r.previous_response_id {
        None => Vec::new(),
        Some(id) => state
            .responses
            .get::<Stored>(id)
            .ok_or_else(|| {
                ApiError::invalid(
                    "previous_response_id",
                    format!("no stored response has the id {id:?}"),
                )
            })?
            .conversation
            .clone(),
    };
    conversation.extend(request::input_items(r.input.clone())?);
    let prepared = Conversation {
        messages: items::template_messages(r.instructions.as_deref(), &conversation),
        tools,
        format,
        field: "input",
        template_kwargs: Default::default(),
    }
    .prepare(&state)
    .await?;
    let sampling = Sampling {
        fields: SamplingFields {
            temperature: r.temperature,
            top_p: r.top_p,
            seed: r.seed,
            ..SamplingFields::default()
        },
        max_tokens: r.max_output_tokens,
        ..Sampling::default()
    };
    let streamed = r.stream.unwrap_or(false);
    let generation =
        Generation::new(sampling, adapter.clone(), streamed)?.constrained(prepared.constraint);
    let prompts = vec![template_prompt(prepared.text)];
    let submitted = generation.submit(&state, prompts, &NAMES).await?;
    let envelope = Envelope::new("resp", &state, adapter.as_deref());
    let settings = object::Settings::of(&r);
    let keep = Keep {
        store: settings.store.then(|| state.responses.clone()),
        conversation,
    };
    let response = ResponseObject {
        id: new_id("resp"),
        object: "response",
        created_at: envelope.created,
        status: "in_progress",
        error: None,
        incomplete_details: None,
        model: envelope.model,
        output: Vec::new(),
        usage: None,
        settings,
    };
    let mut writer =
        Writer::new(response, prepared.reading.as_ref()).thinking(prepared.thinking.as_ref());
    if streamed {
        let one = submitted.into_iter().next();
        return Ok(one.map_or_else(
            || StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            |s| stream::respond(s, writer, keep),
        ));
    }
    let answered = collect_all(submitted, &NAMES).await?;
    let usage = submit::usage(&answered);
    let headers = submit::headers(&answered, &usage);
    let Some(sample) = answered.into_iter().flat_map(|a| a.samples).next() else {
        return Ok(StatusCode::INTERNAL_SERVER_ERROR.into_response());
    };
    let ending = Ending {
        finish_reason: sample.end.finish_reason.into(),
        usage: ResponseUsage::new(usage.prompt_tokens, usage.completion_tokens),
    };
    writer.next(&sample.end.generated_text, Some(ending));
    let response = writer.into_response();
    keep.keep(&response);
    Ok((headers, Json(response)).into_response())
}

#[utoipa::path(get, path = "/v1/responses/{id}", tag = "OpenAI",
    params(("id" = String, Path, description = "A stored response's id")),
    responses((status = 200, body = ResponseObject), (status = 404, body = OpenAiError)))]
pub async fn get_response(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<ResponseObject>, ApiError> {
    let stored = state.responses.get::<Stored>(&id).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("Response with id '{id}' not found."),
            None,
        )
    })?;
    Ok(Json(stored.response.clone()))
}

//! OpenAI's Responses API: `POST /v1/responses` and `GET /v1/responses/{id}`, on chat's
//! machinery (`crate::openai::conversation`): the input items become the template's
//! messages, tools and `text.format` constrain the output as chat's `tools` and
//! `response_format` do, and the output is read back into message and `function_call`
//! items, whole or as streaming events.
//!
//! - `request`: the body, read into items, tools and the format constraint.
//! - `items`: conversation items and the template messages they become.
//! - `object`: the response object.
//! - `events`: the streaming events, and the writer both answers are made by.
//! - `stream`: the SSE answer.
//! - `store`: finished responses, for `GET` and `previous_response_id`.

mod events;
mod items;
mod object;
mod request;
mod store;
mod stream;

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

pub use object::{
    IncompleteDetails, OutputItem, OutputText, ResponseObject, ResponseUsage, Settings,
};
pub use request::ResponsesRequest;
pub use store::ResponseStore;

use events::{Ending, Writer};
use items::Item;
use object::new_id;
use store::Stored;

use super::conversation::{template_prompt, Conversation};
use super::error::{ApiError, OpenAiError, OpenAiJson, ParamNames};
use super::sampling::Sampling;
use super::{finish_reason, generate, Envelope};
use crate::server::AppState;

const NAMES: ParamNames = &[
    ("max_new_tokens", "max_output_tokens"),
    ("inputs", "input"),
    ("adapter_id", "model"),
];

#[utoipa::path(post, path = "/v1/responses", request_body = ResponsesRequest, tag = "OpenAI",
    responses((status = 200, description = "A response, or with stream: true an SSE stream of typed events (response.created ... response.completed)", body = ResponseObject),
              (status = 400, body = OpenAiError), (status = 401, body = OpenAiError),
              (status = 429, body = OpenAiError)))]
pub async fn create_response(
    State(state): State<AppState>,
    OpenAiJson(r): OpenAiJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let adapter = super::adapters::model_adapter(&state, r.model.as_deref())?;
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
            .get(id)
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
    }
    .prepare(&state)
    .await?;
    let sampling = Sampling {
        temperature: r.temperature,
        top_p: r.top_p,
        seed: r.seed,
        max_tokens: r.max_output_tokens,
        ..Sampling::default()
    };
    let (mut parameters, mut extra) = sampling.into_parameters()?;
    parameters.adapter_id = adapter.clone();
    let streamed = r.stream.unwrap_or(false);
    extra.stream = streamed;
    extra.constraint = prepared.constraint;
    let submitted = generate::submit_all(
        &state,
        vec![template_prompt(prepared.text)],
        parameters,
        extra,
        NAMES,
    )
    .await?;
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
    let mut writer = Writer::new(response, prepared.reading.as_ref());
    if streamed {
        let one = submitted.into_iter().next();
        return Ok(one.map_or_else(
            || StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            |s| stream::respond(s, writer, keep),
        ));
    }
    let answered = generate::collect_all(submitted, NAMES).await?;
    let usage = generate::usage(&answered);
    let headers = generate::headers(&answered, &usage);
    let Some(sample) = answered.into_iter().flat_map(|a| a.samples).next() else {
        return Ok(StatusCode::INTERNAL_SERVER_ERROR.into_response());
    };
    let ending = Ending {
        finish_reason: finish_reason(sample.end.finish_reason),
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
    let stored = state.responses.get(&id).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("Response with id '{id}' not found."),
            None,
        )
    })?;
    Ok(Json(stored.response.clone()))
}

/// Where a finished response goes: the store (unless the request said `store: false`),
/// with the conversation it answered.
pub(super) struct Keep {
    store: Option<Arc<ResponseStore>>,
    conversation: Vec<Item>,
}

impl Keep {
    fn keep(self, response: &ResponseObject) {
        let Some(store) = self.store else {
            return;
        };
        let mut conversation = self.conversation;
        conversation.extend(response.output.iter().map(OutputItem::as_input));
        store.put(Stored {
            response: response.clone(),
            conversation,
        });
    }
}

//! TGI's generating routes: /generate, /generate_stream, / (TGI's compat route that
//! streams when `stream` is true) and /tokenize, in TGI's shapes.

use std::convert::Infallible;

use axum::extract::{FromRequest, Request, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::api::{read_body, stream_headers, timing_headers, AppState};
use crate::error::{ErrorBody, InferError};
use crate::infer::{best_first, collect, EventResult, FinishReason, Token};
use crate::validation::{Extra, GenerateRequest, Prompt};

/// A JSON body parsed whatever the content type, with errors in TGI's shape that name
/// the offending field path.
pub struct TgiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for TgiJson<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = read_body(req, state, IntoResponse::into_response).await?;
        let mut de = serde_json::Deserializer::from_slice(&bytes);
        let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let message = if path == "." {
                e.inner().to_string()
            } else {
                format!("{path}: {}", e.inner())
            };
            InferError::Validation(message).into_response()
        })?;
        de.end()
            .map_err(|e| InferError::Validation(e.to_string()).into_response())?;
        Ok(TgiJson(value))
    }
}

/// One of the other samples when `best_of` > 1.
#[derive(Serialize, utoipa::ToSchema)]
pub struct BestOfSequence {
    generated_text: String,
    finish_reason: FinishReason,
    generated_tokens: usize,
    seed: Option<u64>,
    prefill: Vec<Token>,
    tokens: Vec<Token>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    top_tokens: Vec<Vec<Token>>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct Details {
    finish_reason: FinishReason,
    generated_tokens: usize,
    seed: Option<u64>,
    /// The prompt tokens with their logprobs (decoder_input_details).
    prefill: Vec<Token>,
    tokens: Vec<Token>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    top_tokens: Vec<Vec<Token>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    best_of_sequences: Option<Vec<BestOfSequence>>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct GenerateResponse {
    generated_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    details: Option<Details>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct StreamDetails {
    finish_reason: FinishReason,
    generated_tokens: usize,
    input_length: usize,
    seed: Option<u64>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct StreamResponse {
    index: usize,
    token: Token,
    top_tokens: Vec<Token>,
    generated_text: Option<String>,
    details: Option<StreamDetails>,
}

/// One token of `/tokenize`, with its character span in the input.
#[derive(Serialize, utoipa::ToSchema)]
pub struct SimpleToken {
    id: u32,
    text: String,
    start: usize,
    stop: usize,
}

/// `POST /tokenize`.
#[derive(serde::Deserialize, utoipa::ToSchema)]
pub struct TokenizeRequest {
    inputs: String,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    #[allow(dead_code)]
    parameters: Option<serde_json::Value>,
}

/// TGI's `/`: streams when `stream` is true; otherwise answers like /generate but wrapped
/// in a one-element array (what `text-generation`'s client and the HF inference API read).
#[utoipa::path(post, path = "/", request_body = GenerateRequest, tag = "TGI",
    responses((status = 200, description = "Generated text (in a one-element array), or an SSE stream of StreamResponse when stream is true", body = Vec<GenerateResponse>),
              (status = 422, body = ErrorBody), (status = 429, body = ErrorBody)))]
pub async fn compat_generate(state: State<AppState>, body: TgiJson<GenerateRequest>) -> Response {
    if body.0.stream.unwrap_or(false) {
        return generate_stream(state, body).await;
    }
    match generate_inner(&state.0, body.0).await {
        Ok((headers, response)) => (headers, Json([response])).into_response(),
        Err(e) => e.into_response(),
    }
}

#[utoipa::path(post, path = "/generate", request_body = GenerateRequest, tag = "TGI",
    responses((status = 200, body = GenerateResponse,
               headers(("x-queue-time" = String), ("x-inference-time" = String),
                       ("x-time-per-token" = String), ("x-prompt-tokens" = String),
                       ("x-generated-tokens" = String))),
              (status = 422, body = ErrorBody), (status = 424, body = ErrorBody),
              (status = 429, body = ErrorBody)))]
pub async fn generate(
    State(state): State<AppState>,
    TgiJson(request): TgiJson<GenerateRequest>,
) -> Response {
    match generate_inner(&state, request).await {
        Ok((headers, response)) => (headers, Json(response)).into_response(),
        Err(e) => e.into_response(),
    }
}

fn tgi_parts(request: GenerateRequest) -> (Prompt, crate::validation::GenerateParameters) {
    let prompt = Prompt::Text {
        text: request.inputs,
        add_special: true,
    };
    (prompt, request.parameters.unwrap_or_default())
}

async fn generate_inner(
    state: &AppState,
    request: GenerateRequest,
) -> Result<(HeaderMap, GenerateResponse), InferError> {
    let (prompt, parameters) = tgi_parts(request);
    let submitted = state
        .infer
        .submit(prompt, parameters, Extra::default())
        .await?;
    let valid = submitted.request;
    let mut samples =
        futures::future::try_join_all(submitted.samples.into_iter().map(collect)).await?;
    let headers = timing_headers(&valid, &samples.iter().map(|s| &s.end).collect::<Vec<_>>());
    // The best sample answers; the others, in sample order, are the best_of_sequences.
    let best = best_first(&samples)[0];
    let prefill = std::mem::take(&mut samples[0].prefill);
    let chosen = samples.remove(best);
    let top = |s: Vec<Vec<Token>>| {
        if valid.top_n_tokens > 0 {
            s
        } else {
            Vec::new()
        }
    };
    let best_of_sequences = (valid.best_of > 1).then(|| {
        samples
            .into_iter()
            .map(|s| BestOfSequence {
                generated_text: s.end.generated_text,
                finish_reason: s.end.finish_reason,
                generated_tokens: s.end.generated_tokens,
                seed: s.end.seed,
                prefill: prefill.clone(),
                tokens: s.tokens,
                top_tokens: top(s.top_tokens),
            })
            .collect()
    });
    let end = chosen.end;
    let details = valid.details.then(|| Details {
        finish_reason: end.finish_reason,
        generated_tokens: end.generated_tokens,
        seed: end.seed,
        prefill,
        tokens: chosen.tokens,
        top_tokens: top(chosen.top_tokens),
        best_of_sequences,
    });
    Ok((
        headers,
        GenerateResponse {
            generated_text: end.generated_text,
            details,
        },
    ))
}

#[utoipa::path(post, path = "/generate_stream", request_body = GenerateRequest, tag = "TGI",
    responses((status = 200, description = "An SSE stream: one StreamResponse per token", content_type = "text/event-stream", body = StreamResponse,
               headers(("x-prompt-tokens" = String), ("x-compute-characters" = String))),
              (status = 422, body = ErrorBody), (status = 429, body = ErrorBody)))]
pub async fn generate_stream(
    State(state): State<AppState>,
    TgiJson(request): TgiJson<GenerateRequest>,
) -> Response {
    let characters = request.inputs.chars().count();
    let (prompt, parameters) = tgi_parts(request);
    let extra = Extra {
        stream: true,
        ..Extra::default()
    };
    match state.infer.submit(prompt, parameters, extra).await {
        Ok(mut submitted) => {
            let rx = submitted.samples.remove(0);
            let headers = stream_headers(&submitted.request, characters);
            (headers, Sse::new(sse_events(rx, submitted.request.details))).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// `POST /tokenize`: the ids the router would feed the model, with character offsets.
#[utoipa::path(post, path = "/tokenize", request_body = TokenizeRequest, tag = "TGI",
    responses((status = 200, body = Vec<SimpleToken>), (status = 422, body = ErrorBody)))]
pub async fn tokenize(
    State(state): State<AppState>,
    TgiJson(request): TgiJson<TokenizeRequest>,
) -> Response {
    let tokenizer = state.infer.validation.tokenizer.clone();
    let inputs = request.inputs;
    let result = tokio::task::spawn_blocking(move || {
        tokenizer.encode_offsets(&inputs).map(|ids| {
            let chars: Vec<(usize, char)> = inputs.char_indices().collect();
            // The tokenizer reports byte offsets; TGI reports characters.
            let to_char = |byte: usize| chars.partition_point(|&(b, _)| b < byte);
            ids.into_iter()
                .map(|(id, start, stop)| SimpleToken {
                    id,
                    text: inputs.get(start..stop).unwrap_or_default().to_string(),
                    start: to_char(start),
                    stop: to_char(stop),
                })
                .collect::<Vec<_>>()
        })
    })
    .await;
    match result {
        Ok(Ok(tokens)) => Json(tokens).into_response(),
        Ok(Err(e)) => InferError::Validation(format!("inputs: {e}")).into_response(),
        Err(e) => InferError::Validation(format!("inputs: {e}")).into_response(),
    }
}

fn sse_events(
    rx: tokio::sync::mpsc::UnboundedReceiver<EventResult>,
    details: bool,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let mut index = 0;
    UnboundedReceiverStream::new(rx).map(move |event| {
        let data = match event {
            Ok(event) => {
                index += 1;
                let (generated_text, stream_details) = match event.end {
                    Some(end) => (
                        Some(end.generated_text),
                        details.then_some(StreamDetails {
                            finish_reason: end.finish_reason,
                            generated_tokens: end.generated_tokens,
                            input_length: end.input_length,
                            seed: end.seed,
                        }),
                    ),
                    None => (None, None),
                };
                serde_json::to_string(&StreamResponse {
                    index,
                    token: event.token,
                    top_tokens: event.top_tokens,
                    generated_text,
                    details: stream_details,
                })
            }
            Err(e) => serde_json::to_string(&e.body()),
        };
        Ok(Event::default().data(data.unwrap_or_default()))
    })
}

//! HTTP routes (TGI's shapes): /generate, /generate_stream, / (TGI's compat route that
//! streams when `stream` is true), /health, /info.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::client::ShardClient;
use crate::error::{ErrorBody, InferError};
use crate::infer::{EventResult, FinishReason, Infer, Token};
use crate::validation::GenerateRequest;

/// `GET /info`.
#[derive(Debug, Clone, Serialize)]
pub struct Info {
    pub model_id: String,
    pub model_dtype: String,
    pub model_device_type: String,
    pub model_pipeline_tag: &'static str,
    pub max_input_tokens: usize,
    pub max_total_tokens: usize,
    pub max_batch_tokens: usize,
    pub max_batch_size: usize,
    pub max_concurrent_requests: usize,
    pub max_best_of: usize,
    pub max_stop_sequences: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub world_size: usize,
    pub version: &'static str,
    pub router: &'static str,
}

#[derive(Clone)]
pub struct AppState {
    pub infer: Infer,
    pub info: Info,
    /// `None` only in tests without shards: /health then answers 503.
    pub shards: Option<ShardClient>,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/", post(compat_generate))
        .route("/generate", post(generate))
        .route("/generate_stream", post(generate_stream))
        .route("/health", get(health))
        .route("/info", get(info))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// A JSON body parsed whatever the content type, with errors in TGI's shape that name
/// the offending field path.
pub struct TgiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for TgiJson<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            let body = ErrorBody {
                error: e.body_text(),
                error_type: "validation",
            };
            (e.status(), Json(body)).into_response()
        })?;
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

#[derive(Serialize)]
struct Details {
    finish_reason: FinishReason,
    generated_tokens: usize,
    seed: Option<u64>,
    prefill: Vec<Token>,
    tokens: Vec<Token>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    top_tokens: Vec<Vec<Token>>,
}

#[derive(Serialize)]
struct GenerateResponse {
    generated_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    details: Option<Details>,
}

#[derive(Serialize)]
struct StreamDetails {
    finish_reason: FinishReason,
    generated_tokens: usize,
    input_length: usize,
    seed: Option<u64>,
}

#[derive(Serialize)]
struct StreamResponse {
    index: usize,
    token: Token,
    top_tokens: Vec<Token>,
    generated_text: Option<String>,
    details: Option<StreamDetails>,
}

/// TGI's `/`: streams when `stream` is true; otherwise answers like /generate but wrapped
/// in a one-element array (what `text-generation`'s client and the HF inference API read).
async fn compat_generate(state: State<AppState>, body: TgiJson<GenerateRequest>) -> Response {
    if body.0.stream.unwrap_or(false) {
        return generate_stream(state, body).await;
    }
    match generate_inner(&state.0, body.0).await {
        Ok(response) => Json([response]).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn generate(
    State(state): State<AppState>,
    TgiJson(request): TgiJson<GenerateRequest>,
) -> Response {
    match generate_inner(&state, request).await {
        Ok(response) => Json(response).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn generate_inner(
    state: &AppState,
    request: GenerateRequest,
) -> Result<GenerateResponse, InferError> {
    let (valid, mut rx) = state.infer.submit(request).await?;
    let mut tokens = Vec::new();
    let mut top_tokens = Vec::new();
    while let Some(event) = rx.recv().await {
        let event = event?;
        if valid.details {
            tokens.push(event.token);
            if valid.top_n_tokens > 0 {
                top_tokens.push(event.top_tokens);
            }
        }
        if let Some(end) = event.end {
            let details = valid.details.then(|| Details {
                finish_reason: end.finish_reason,
                generated_tokens: end.generated_tokens,
                seed: end.seed,
                prefill: Vec::new(),
                tokens,
                top_tokens,
            });
            return Ok(GenerateResponse {
                generated_text: end.generated_text,
                details,
            });
        }
    }
    Err(InferError::Generation(
        "the request ended without a result".into(),
    ))
}

async fn generate_stream(
    State(state): State<AppState>,
    TgiJson(request): TgiJson<GenerateRequest>,
) -> Response {
    match state.infer.submit(request).await {
        Ok((valid, rx)) => Sse::new(sse_events(rx, valid.details)).into_response(),
        Err(e) => e.into_response(),
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

async fn health(State(state): State<AppState>) -> Response {
    let Some(shards) = &state.shards else {
        return InferError::Unhealthy("no shards".into()).into_response();
    };
    match tokio::time::timeout(Duration::from_secs(5), shards.health()).await {
        Ok(Ok(true)) => StatusCode::OK.into_response(),
        Ok(Ok(false)) => InferError::Unhealthy("shards are not ready".into()).into_response(),
        Ok(Err(e)) => InferError::Unhealthy(e.to_string()).into_response(),
        Err(_) => InferError::Unhealthy("shards did not answer in 5 s".into()).into_response(),
    }
}

async fn info(State(state): State<AppState>) -> Json<Info> {
    Json(state.info)
}

/// `GET /metrics`: Prometheus text, with the shard-side token counters when rank 0 answers.
async fn metrics(State(state): State<AppState>) -> Response {
    let shard = match &state.shards {
        Some(shards) => tokio::time::timeout(Duration::from_secs(2), shards.computed_tokens())
            .await
            .ok()
            .and_then(Result::ok),
        None => None,
    };
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.infer.metrics().render(shard),
    )
        .into_response()
}

//! HTTP routes (TGI's shapes): /generate, /generate_stream, / (TGI's compat route that
//! streams when `stream` is true), /tokenize, /health (liveness), /ready (readiness, the
//! rule in `readiness`), /info; the OpenAI routes live in `openai`, the OpenAPI document
//! in `openapi`, access control in `access`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::chat::ChatTemplate;
use crate::client::ShardClient;
use crate::error::{error_response, ErrorBody, InferError};
use crate::infer::{best_first, collect, End, EventResult, FinishReason, Infer, Token};
use crate::readiness::{NotReadyBody, Readiness};
use crate::validation::{Extra, GenerateRequest, Prompt, ValidRequest};

/// `GET /info`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Info {
    pub model_id: String,
    /// The name clients use: `/v1/models`, OpenAI answers' `model`, the metrics' labels.
    pub served_model_name: String,
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
    pub max_top_n_tokens: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Tensor-parallel ranks of each replica.
    pub world_size: usize,
    /// Independent shard groups behind this router (`--replicas`).
    pub replicas: usize,
    /// What serves each kernel family on the shards: `isa` (the C++ CPU kernels'
    /// instruction set), `attention`, `products`, `norms`, `sampling`.
    pub kernels: std::collections::BTreeMap<String, String>,
    /// How weights and KV cache are stored: `weights` (the float dtype or the quantized
    /// formats), `kv_cache_dtype`, and with quantized weights `source`, `float_copy`,
    /// `quantized_max_rows`.
    pub quantization: std::collections::BTreeMap<String, String>,
    /// Speculative decoding, empty when off: `method`, `num_speculative_tokens`,
    /// `max_step_tokens` (the load switch's threshold) and where it came from
    /// (`threshold_source`), `draft_model`, `ngram` (`min..max`).
    pub speculative: std::collections::BTreeMap<String, String>,
    /// LoRA adapters, when any LoRA option is on (filled in when /info is asked: adapters
    /// come and go).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraInfo>,
    pub version: &'static str,
    pub router: &'static str,
}

/// `/info`'s `lora`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct LoraInfo {
    /// The adapters requests may name, by name.
    pub adapters: Vec<String>,
    pub max_cpu_adapters: usize,
    pub max_adapters_per_batch: usize,
    /// `--lora-dir`, when set.
    pub lora_dir: Option<String>,
    /// `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` are served.
    pub runtime_loading: bool,
}

impl LoraInfo {
    fn of(adapters: &crate::lora::Registry) -> Option<Self> {
        let config = adapters.config();
        config.enabled().then(|| Self {
            adapters: adapters.listed().into_iter().map(|a| a.name).collect(),
            max_cpu_adapters: config.max_cpu_adapters,
            max_adapters_per_batch: config.max_adapters_per_batch,
            lora_dir: config.dir.as_ref().map(|d| d.display().to_string()),
            runtime_loading: config.allow_runtime,
        })
    }
}

#[derive(Clone)]
pub struct AppState {
    pub infer: Infer,
    pub info: Info,
    /// Each replica's shards; empty only in tests without shards (/metrics then has no
    /// shard-side counters).
    pub shards: Vec<ShardClient>,
    /// What `/ready` asks the shards and how long it waits.
    pub readiness: Readiness,
    /// The model's chat template; `None` when it has none (chat completions answer 400).
    pub chat: Option<Arc<ChatTemplate>>,
    /// Finished Responses-API responses, for `GET /v1/responses/{id}` and follow-ups.
    pub responses: Arc<crate::openai::ResponseStore>,
}

/// Every route, without access control or CORS (see `access::layers`).
pub fn router(state: AppState) -> Router {
    let runtime_lora = if state.infer.adapters().config().allow_runtime {
        crate::openai::lora_routes()
    } else {
        Router::new()
    };
    Router::new()
        .route("/", post(compat_generate))
        .route("/generate", post(generate))
        .route("/generate_stream", post(generate_stream))
        .merge(crate::openai::routes())
        .merge(crate::anthropic::routes())
        .merge(runtime_lora)
        // The routes above: each request gets its `x-request-id` and, with traces on, spans.
        .route_layer(axum::middleware::from_fn(crate::request_scope::scope))
        .route("/tokenize", post(tokenize))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/info", get(info))
        .merge(crate::openapi::routes())
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// Reads a request body, answering a body over the payload limit with a 422 that names
/// the limit (`shape` turns the error into the route's error body).
pub async fn read_body<S: Send + Sync>(
    req: Request,
    state: &S,
    shape: impl FnOnce(InferError) -> Response,
) -> Result<Bytes, Response> {
    Bytes::from_request(req, state).await.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return shape(InferError::Validation(
                "payload_limit: the request body exceeds --payload-limit".into(),
            ));
        }
        let body = ErrorBody {
            error: e.body_text(),
            error_type: "validation",
        };
        (e.status(), Json(body)).into_response()
    })
}

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

/// Headers for operators: where the time went and how many tokens it took.
pub fn timing_headers(request: &ValidRequest, samples: &[&End]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let generated: usize = samples.iter().map(|e| e.generated_tokens).sum();
    let queue = samples
        .iter()
        .map(|e| e.queue_time)
        .max()
        .unwrap_or_default();
    let inference = samples
        .iter()
        .map(|e| e.inference_time)
        .max()
        .unwrap_or_default();
    let per_token = samples
        .iter()
        .map(|e| e.inference_time / e.generated_tokens.max(1) as u32)
        .max()
        .unwrap_or_default();
    let values = [
        ("x-queue-time", queue.as_millis().to_string()),
        ("x-inference-time", inference.as_millis().to_string()),
        ("x-time-per-token", per_token.as_millis().to_string()),
        ("x-prompt-tokens", request.input_ids.len().to_string()),
        ("x-generated-tokens", generated.to_string()),
    ];
    for (name, value) in values {
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(name, v);
        }
    }
    headers
}

/// Headers for operators that are known when a stream starts (TGI sends the last two on
/// its streams too): the prompt's tokens, its characters, and no proxy buffering.
pub fn stream_headers(request: &ValidRequest, characters: usize) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("x-prompt-tokens", request.input_ids.len().into());
    headers.insert("x-compute-characters", characters.into());
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    headers
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

/// Liveness: answered by the HTTP task alone (no shard call, nothing the batching loop
/// holds), so load never delays it; it stays 200 while draining.
#[utoipa::path(get, path = "/health", tag = "TGI",
    responses((status = 200, description = "The router process is alive: `{}`")))]
pub async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({}))
}

/// Readiness: the rule is in `readiness`.
#[utoipa::path(get, path = "/ready", tag = "TGI",
    responses((status = 200, description = "Ready for traffic: `{\"status\": \"ready\"}`"),
              (status = 503, description = "Not ready; `reason` says why", body = NotReadyBody)))]
pub async fn ready(State(state): State<AppState>) -> Response {
    let readiness = &state.readiness;
    match readiness.check(&state.infer).await {
        Ok(()) => Json(serde_json::json!({"status": "ready"})).into_response(),
        Err(why) => {
            let body = NotReadyBody {
                error: format!(
                    "not ready ({}): {}",
                    why.reason(),
                    why.message(readiness.probe_timeout)
                ),
                error_type: "not_ready",
                reason: why.reason(),
            };
            error_response(StatusCode::SERVICE_UNAVAILABLE, body)
        }
    }
}

#[utoipa::path(get, path = "/info", tag = "TGI", responses((status = 200, body = Info)))]
pub async fn info(State(state): State<AppState>) -> Json<Info> {
    let mut info = state.info;
    info.lora = LoraInfo::of(state.infer.adapters());
    Json(info)
}

/// `GET /metrics`: Prometheus text, with the shard-side token counters summed over the
/// replicas when every replica's rank 0 answers (a sum missing a replica would make the
/// counters go down, which Prometheus reads as a restart).
async fn metrics(State(state): State<AppState>) -> Response {
    let asked = state
        .shards
        .iter()
        .map(|shards| tokio::time::timeout(Duration::from_secs(2), shards.computed_tokens()));
    let answers = futures::future::join_all(asked).await;
    let shard = if state.shards.is_empty() {
        None
    } else {
        answers
            .into_iter()
            .map(|a| a.ok().and_then(Result::ok))
            .try_fold((0, 0), |(all, prompt), a| {
                a.map(|(x, y)| (all + x, prompt + y))
            })
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

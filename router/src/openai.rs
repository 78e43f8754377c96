//! OpenAI's API: `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat
//! template rendered by `chat`), `GET /v1/models`, with SSE streaming that ends with
//! `data: [DONE]`, `n` / `best_of`, logprobs, `logit_bias`, and errors in OpenAI's shape
//! `{"error": {"message", "type", "param", "code"}}` (400 for bad input).
//!
//! Each request is turned into TGI's parameters plus `Extra` and goes through the same
//! validation and batching loop as the TGI routes.

use std::collections::HashMap;
use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::stream::{self, Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_stream::wrappers::UnboundedReceiverStream;
use utoipa::ToSchema;

use crate::chat::TemplateMessage;
use crate::detokenize::TokenizerInfo;
use crate::error::InferError;
use crate::infer::{FinishReason, Submitted, Token};
use crate::server::{collect, read_body, submit, timing_headers, AppState, Sample};
use crate::validation::{Extra, GenerateParameters, Prompt};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
}

// -- errors ----------------------------------------------------------------------------

#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiError {
    pub error: OpenAiErrorDetail,
}

/// An error answered in OpenAI's shape.
pub struct ApiError {
    status: StatusCode,
    body: OpenAiError,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &str, message: String, param: Option<String>) -> Self {
        Self {
            status,
            body: OpenAiError {
                error: OpenAiErrorDetail {
                    message,
                    kind: kind.into(),
                    param,
                    code: None,
                },
            },
        }
    }

    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        let message = message.into();
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("{param}: {message}"),
            Some(param.into()),
        )
    }

    pub fn unauthorized() -> Self {
        let mut e = Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "missing or invalid API key: send Authorization: Bearer <key>".into(),
            None,
        );
        e.body.error.code = Some("invalid_api_key".into());
        e
    }

    /// A router error, its TGI parameter names turned into the route's OpenAI names.
    fn from_infer(e: InferError, names: &[(&str, &str)]) -> Self {
        let (status, kind) = match &e {
            InferError::Validation(_) => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            InferError::Overloaded(_) => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded"),
            InferError::Generation(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
            InferError::Unhealthy(_) => (StatusCode::SERVICE_UNAVAILABLE, "server_error"),
        };
        let mut message = e.to_string();
        let mut param = None;
        if let InferError::Validation(_) = e {
            let field = message
                .split([' ', ':', '('])
                .next()
                .unwrap_or_default()
                .trim_start_matches("parameters.")
                .to_string();
            let name = names
                .iter()
                .find(|(tgi, _)| *tgi == field)
                .map_or(field.as_str(), |(_, openai)| openai)
                .to_string();
            if !name.is_empty() {
                let rest = message
                    .split_once(&field)
                    .map_or("", |(_, r)| r)
                    .to_string();
                message = format!("{name}{rest}");
                param = Some(name);
            }
        }
        Self::new(status, kind, message, param)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}

/// `InferError` → OpenAI's shape, for `read_body`.
fn shaped(e: InferError) -> Response {
    ApiError::from_infer(e, &[]).into_response()
}

/// A JSON body whose errors are 400s in OpenAI's shape naming the field.
pub struct OpenAiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for OpenAiJson<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = read_body(req, state, shaped).await?;
        let mut de = serde_json::Deserializer::from_slice(&bytes);
        let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let param = if path == "." { "body" } else { path.as_str() };
            ApiError::invalid(param, e.inner().to_string()).into_response()
        })?;
        de.end()
            .map_err(|e| ApiError::invalid("body", e.to_string()).into_response())?;
        Ok(OpenAiJson(value))
    }
}

// -- shared request pieces ---------------------------------------------------------------

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

impl StopInput {
    fn into_vec(self) -> Vec<String> {
        match self {
            StopInput::One(s) => vec![s],
            StopInput::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send a last chunk with the usage counts (and `choices: []`).
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The sampling fields both routes share, with vLLM's extensions (top_k, min_p,
/// typical_p, repetition_penalty).
#[derive(Debug, Clone, Default)]
struct Sampling {
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<u32>,
    best_of: Option<u32>,
    stop: Option<StopInput>,
    seed: Option<u64>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    logit_bias: Option<HashMap<String, f32>>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    typical_p: Option<f32>,
    repetition_penalty: Option<f32>,
    max_tokens: Option<u32>,
    top_n: Option<u32>,
    prompt_logprobs: bool,
    echo: bool,
    ignore_eos: Option<bool>,
}

impl Sampling {
    fn into_parameters(self) -> Result<(GenerateParameters, Extra), ApiError> {
        // OpenAI samples by default; temperature 0 is greedy.
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                format!("must be in [0, 2], got {temperature}"),
            ));
        }
        let n = self.n.unwrap_or(1);
        if n == 0 {
            return Err(ApiError::invalid("n", "must be at least 1"));
        }
        let mut logit_bias = HashMap::new();
        for (token, bias) in self.logit_bias.unwrap_or_default() {
            let id = token.parse::<u32>().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("keys must be token ids, got {token:?}"),
                )
            })?;
            logit_bias.insert(id, bias);
        }
        let greedy = temperature == 0.0;
        let parameters = GenerateParameters {
            best_of: self.best_of,
            temperature: (!greedy).then_some(temperature),
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            top_k: if greedy {
                None
            } else {
                self.top_k.filter(|&k| k != -1)
            },
            top_p: if greedy { None } else { self.top_p },
            typical_p: if greedy { None } else { self.typical_p },
            min_p: if greedy { None } else { self.min_p },
            do_sample: Some(!greedy),
            max_new_tokens: self.max_tokens,
            return_full_text: Some(self.echo),
            stop: self.stop.map(StopInput::into_vec),
            details: Some(true),
            decoder_input_details: Some(self.prompt_logprobs),
            seed: self.seed,
            top_n_tokens: self.top_n,
            ignore_eos: self.ignore_eos,
            ..Default::default()
        };
        Ok((parameters, Extra { logit_bias, n }))
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::EosToken | FinishReason::StopSequence => "stop",
    }
}

/// A token as logprobs show it: its own text, special tokens included.
fn token_string(tokenizer: &TokenizerInfo, id: u32) -> String {
    tokenizer.decode_all(&[id])
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

/// The `best_of` samples of a prompt, best first, cut to `n`: ranked by cumulative
/// logprob when more were generated than returned.
fn best_n(mut samples: Vec<Sample>, n: usize) -> Vec<Sample> {
    if samples.len() > n {
        samples.sort_by(|a, b| {
            b.end
                .cumulative_logprob
                .total_cmp(&a.end.cumulative_logprob)
        });
        samples.truncate(n);
    }
    samples
}

// -- /v1/models -------------------------------------------------------------------------

#[derive(Serialize, ToSchema)]
pub struct Model {
    id: String,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
}

#[derive(Serialize, ToSchema)]
pub struct ModelList {
    object: &'static str,
    data: Vec<Model>,
}

#[utoipa::path(get, path = "/v1/models", tag = "OpenAI", responses((status = 200, body = ModelList)))]
pub async fn models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![Model {
            id: state.info.model_id.clone(),
            object: "model",
            created: 0,
            owned_by: "cadence",
        }],
    })
}

// -- /v1/completions --------------------------------------------------------------------

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdsList(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// A string, a list of strings, a list of token ids or a list of such lists.
    pub prompt: PromptInput,
    /// Most tokens to generate per choice [default: 16].
    pub max_tokens: Option<u32>,
    /// [0, 2]; 0 is greedy [default: 1].
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Choices per prompt.
    pub n: Option<u32>,
    /// Samples generated per prompt, the best `n` returned (by cumulative logprob).
    pub best_of: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Return the logprobs of each token and of this many alternatives.
    pub logprobs: Option<u32>,
    /// Return the prompt before the completion (with its logprobs when asked).
    pub echo: Option<bool>,
    pub stop: Option<StopInput>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string) -> bias in [-100, 100] added to its logit.
    pub logit_bias: Option<HashMap<String, f32>>,
    pub seed: Option<u64>,
    pub user: Option<String>,
    /// Not supported (must be null or empty).
    pub suffix: Option<String>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// vLLM's extension: generate past the end-of-sequence token up to the token limit.
    pub ignore_eos: Option<bool>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f32>>,
    top_logprobs: Vec<Option<HashMap<String, f32>>>,
    text_offset: Vec<usize>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionChoice {
    text: String,
    index: usize,
    logprobs: Option<CompletionLogprobs>,
    finish_reason: Option<&'static str>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Completion {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    system_fingerprint: String,
    choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

const COMPLETION_NAMES: &[(&str, &str)] = &[
    ("max_new_tokens", "max_tokens"),
    ("top_n_tokens", "logprobs"),
    ("inputs", "prompt"),
    ("decoder_input_details", "echo"),
];

/// Completions logprobs of `tokens` (and their alternatives), text offsets from `start`.
fn completion_logprobs(
    tokenizer: &TokenizerInfo,
    tokens: &[Token],
    top: &[Vec<Token>],
    top_offset: usize,
    start: usize,
    with_top: bool,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs {
        tokens: Vec::new(),
        token_logprobs: Vec::new(),
        top_logprobs: Vec::new(),
        text_offset: Vec::new(),
    };
    let mut offset = start;
    for (i, t) in tokens.iter().enumerate() {
        let text = token_string(tokenizer, t.id);
        out.text_offset.push(offset);
        offset += text.len();
        out.tokens.push(text);
        out.token_logprobs.push(t.logprob);
        let alternatives = i.checked_sub(top_offset).and_then(|j| top.get(j));
        out.top_logprobs
            .push(match (with_top, alternatives, t.logprob) {
                (true, Some(alts), Some(_)) => Some(
                    alts.iter()
                        .map(|a| (token_string(tokenizer, a.id), a.logprob.unwrap_or(0.0)))
                        .collect(),
                ),
                _ => None,
            });
    }
    out
}

fn sse_json<T: Serialize>(value: &T) -> Result<Event, Infallible> {
    Ok(Event::default().data(serde_json::to_string(value).unwrap_or_default()))
}

fn done() -> Result<Event, Infallible> {
    Ok(Event::default().data("[DONE]"))
}

#[utoipa::path(post, path = "/v1/completions", request_body = CompletionRequest, tag = "OpenAI",
    responses((status = 200, description = "A completion, or an SSE stream of completion chunks ending with [DONE] when stream is true", body = Completion),
              (status = 400, body = OpenAiError), (status = 401, body = OpenAiError),
              (status = 429, body = OpenAiError)))]
pub async fn completions(
    State(state): State<AppState>,
    OpenAiJson(request): OpenAiJson<CompletionRequest>,
) -> Response {
    match completions_inner(state, request).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(state: AppState, r: CompletionRequest) -> Result<Response, ApiError> {
    if r.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "is not supported"));
    }
    let prompts: Vec<Prompt> = match r.prompt {
        PromptInput::Text(text) => vec![Prompt::Text {
            text,
            add_special: true,
        }],
        PromptInput::Texts(texts) => texts
            .into_iter()
            .map(|text| Prompt::Text {
                text,
                add_special: true,
            })
            .collect(),
        PromptInput::Ids(ids) => vec![Prompt::Ids(ids)],
        PromptInput::IdsList(lists) => lists.into_iter().map(Prompt::Ids).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "must not be empty"));
    }
    let echo = r.echo.unwrap_or(false);
    let stream = r.stream.unwrap_or(false);
    let with_logprobs = r.logprobs.is_some();
    if stream && r.best_of.is_some_and(|b| b > r.n.unwrap_or(1)) {
        return Err(ApiError::invalid("best_of", "must equal n when streaming"));
    }
    let sampling = Sampling {
        temperature: r.temperature,
        top_p: r.top_p,
        n: r.n,
        best_of: r.best_of,
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
        max_tokens: Some(r.max_tokens.unwrap_or(16)),
        top_n: r.logprobs,
        prompt_logprobs: echo && with_logprobs,
        echo: echo && !stream,
    };
    let (parameters, extra) = sampling.into_parameters()?;
    let n = extra.n.max(1) as usize;
    let mut submitted = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let s = submit(&state.infer, prompt, parameters.clone(), extra.clone())
            .await
            .map_err(|e| ApiError::from_infer(e, COMPLETION_NAMES))?;
        submitted.push(s);
    }
    let id = format!("cmpl-{}", uuid::Uuid::new_v4().simple());
    let model = state.info.model_id.clone();
    let tokenizer = state.infer.validation.tokenizer.clone();
    let top_n = r.logprobs.unwrap_or(0) > 0;
    if stream {
        let include_usage = r
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        return Ok(completion_stream(
            submitted,
            n,
            id,
            model,
            tokenizer,
            echo,
            with_logprobs,
            top_n,
            include_usage,
        ));
    }
    let mut choices = Vec::new();
    let mut usage = Usage {
        prompt_tokens: 0,
        completion_tokens: 0,
        total_tokens: 0,
    };
    let mut ends = Vec::new();
    let mut first_request = None;
    for (p, s) in submitted.into_iter().enumerate() {
        let request = s.request;
        let samples = futures::future::try_join_all(s.samples.into_iter().map(collect))
            .await
            .map_err(|e| ApiError::from_infer(e, COMPLETION_NAMES))?;
        usage.prompt_tokens += request.input_ids.len();
        usage.completion_tokens += samples
            .iter()
            .map(|s| s.end.generated_tokens)
            .sum::<usize>();
        ends.extend(samples.iter().map(|s| s.end.clone()));
        let prefill = samples
            .first()
            .map(|s| s.prefill.clone())
            .unwrap_or_default();
        let prefill_top = samples
            .first()
            .map(|s| s.prefill_top_tokens.clone())
            .unwrap_or_default();
        let prompt_text = request.prefix.clone().unwrap_or_default();
        for (j, sample) in best_n(samples, n).into_iter().enumerate() {
            let logprobs = with_logprobs.then(|| {
                let mut lp = CompletionLogprobs {
                    tokens: Vec::new(),
                    token_logprobs: Vec::new(),
                    top_logprobs: Vec::new(),
                    text_offset: Vec::new(),
                };
                if echo {
                    lp = completion_logprobs(&tokenizer, &prefill, &prefill_top, 1, 0, top_n);
                }
                let generated = completion_logprobs(
                    &tokenizer,
                    &sample.tokens,
                    &sample.top_tokens,
                    0,
                    prompt_text.len(),
                    top_n,
                );
                lp.tokens.extend(generated.tokens);
                lp.token_logprobs.extend(generated.token_logprobs);
                lp.top_logprobs.extend(generated.top_logprobs);
                lp.text_offset.extend(generated.text_offset);
                lp
            });
            choices.push(CompletionChoice {
                text: sample.end.generated_text,
                index: p * n + j,
                logprobs,
                finish_reason: Some(finish_reason(sample.end.finish_reason)),
            });
        }
        first_request.get_or_insert(request);
    }
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens;
    let headers = first_request
        .map(|r| timing_headers(&r, &ends.iter().collect::<Vec<_>>()))
        .unwrap_or_default();
    let body = Completion {
        id,
        object: "text_completion",
        created: now_secs(),
        model,
        system_fingerprint: fingerprint(),
        choices,
        usage: Some(usage),
    };
    Ok((headers, Json(body)).into_response())
}

fn fingerprint() -> String {
    format!("cadence-{}", env!("CARGO_PKG_VERSION"))
}

/// Every sample of every prompt as one stream of (choice index, event).
fn merged(
    submitted: Vec<Submitted>,
    n: usize,
) -> (
    usize,
    impl Stream<Item = (usize, crate::infer::EventResult)>,
) {
    let prompt_tokens = submitted.iter().map(|s| s.request.input_ids.len()).sum();
    let streams = submitted.into_iter().enumerate().flat_map(|(p, s)| {
        s.samples.into_iter().enumerate().map(move |(j, rx)| {
            UnboundedReceiverStream::new(rx)
                .map(move |e| (p * n + j, e))
                .boxed()
        })
    });
    (prompt_tokens, stream::select_all(streams))
}

#[allow(clippy::too_many_arguments)]
fn completion_stream(
    submitted: Vec<Submitted>,
    n: usize,
    id: String,
    model: String,
    tokenizer: TokenizerInfo,
    echo: bool,
    with_logprobs: bool,
    top_n: bool,
    include_usage: bool,
) -> Response {
    let created = now_secs();
    let chunk = {
        let (id, model) = (id.clone(), model.clone());
        move |choices: Vec<CompletionChoice>, usage: Option<Usage>| Completion {
            id: id.clone(),
            object: "text_completion",
            created,
            model: model.clone(),
            system_fingerprint: fingerprint(),
            choices,
            usage,
        }
    };
    // Echo: each choice opens with its prompt.
    let mut opening = Vec::new();
    if echo {
        for (p, s) in submitted.iter().enumerate() {
            let text = tokenizer.decode_all(&s.request.input_ids);
            for j in 0..n {
                opening.push(sse_json(&chunk(
                    vec![CompletionChoice {
                        text: text.clone(),
                        index: p * n + j,
                        logprobs: None,
                        finish_reason: None,
                    }],
                    None,
                )));
            }
        }
    }
    let (prompt_tokens, events) = merged(submitted, n);
    let mut completion_tokens = 0;
    let tail_chunk = chunk.clone();
    let body = events.map(move |(index, event)| match event {
        Ok(event) => {
            let logprobs = with_logprobs.then(|| {
                completion_logprobs(
                    &tokenizer,
                    std::slice::from_ref(&event.token),
                    std::slice::from_ref(&event.top_tokens),
                    0,
                    0,
                    top_n,
                )
            });
            let reason = event.end.as_ref().map(|e| finish_reason(e.finish_reason));
            if let Some(end) = &event.end {
                completion_tokens += end.generated_tokens;
            }
            (
                completion_tokens,
                sse_json(&chunk(
                    vec![CompletionChoice {
                        text: event.token.text,
                        index,
                        logprobs,
                        finish_reason: reason,
                    }],
                    None,
                )),
            )
        }
        Err(e) => (
            completion_tokens,
            sse_json(&ApiError::from_infer(e, COMPLETION_NAMES).body),
        ),
    });
    let body = stream::iter(opening.into_iter().map(|e| (0, e))).chain(body);
    finish_stream(body, prompt_tokens, include_usage, move |usage| {
        sse_json(&tail_chunk(Vec::new(), Some(usage)))
    })
}

/// Sends the events, then the usage chunk when asked, then `[DONE]`.
fn finish_stream(
    body: impl Stream<Item = (usize, Result<Event, Infallible>)> + Send + 'static,
    prompt_tokens: usize,
    include_usage: bool,
    usage_chunk: impl Fn(Usage) -> Result<Event, Infallible> + Send + 'static,
) -> Response {
    let completion = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = completion.clone();
    let events = body.map(move |(tokens, event)| {
        counter.store(tokens, std::sync::atomic::Ordering::Relaxed);
        event
    });
    let tail = stream::once(async move {
        let completion_tokens = completion.load(std::sync::atomic::Ordering::Relaxed);
        let mut out = Vec::new();
        if include_usage {
            out.push(usage_chunk(Usage {
                prompt_tokens,
                completion_tokens,
                total_tokens: prompt_tokens + completion_tokens,
            }));
        }
        out.push(done());
        stream::iter(out)
    })
    .flatten();
    // What operators can know when the stream starts (the rest comes in `usage`).
    let mut headers = HeaderMap::new();
    headers.insert("x-prompt-tokens", prompt_tokens.into());
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    (headers, Sse::new(events.chain(tail))).into_response()
}

// -- /v1/chat/completions ---------------------------------------------------------------

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
    /// `{"type": "text"}`; JSON modes are not supported yet.
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<Value>,
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

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TopLogprob {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatTokenLogprob {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
    top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprobs {
    content: Vec<ChatTokenLogprob>,
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
    usage: Option<Usage>,
}

const CHAT_NAMES: &[(&str, &str)] = &[
    ("max_new_tokens", "max_completion_tokens"),
    ("top_n_tokens", "top_logprobs"),
    ("inputs", "messages"),
];

/// The same, for a request that used the older name `max_tokens`.
const CHAT_NAMES_MAX_TOKENS: &[(&str, &str)] = &[
    ("max_new_tokens", "max_tokens"),
    ("top_n_tokens", "top_logprobs"),
    ("inputs", "messages"),
];

fn chat_logprobs(tokenizer: &TokenizerInfo, tokens: &[Token], top: &[Vec<Token>]) -> ChatLogprobs {
    let entry = |t: &Token| {
        let token = token_string(tokenizer, t.id);
        (token.clone(), t.logprob.unwrap_or(0.0), token.into_bytes())
    };
    ChatLogprobs {
        content: tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let (token, logprob, bytes) = entry(t);
                ChatTokenLogprob {
                    token,
                    logprob,
                    bytes,
                    top_logprobs: top
                        .get(i)
                        .map(|alts| {
                            alts.iter()
                                .map(|a| {
                                    let (token, logprob, bytes) = entry(a);
                                    TopLogprob {
                                        token,
                                        logprob,
                                        bytes,
                                    }
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                }
            })
            .collect(),
    }
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

#[utoipa::path(post, path = "/v1/chat/completions", request_body = ChatRequest, tag = "OpenAI",
    responses((status = 200, description = "A chat completion, or an SSE stream of chat.completion.chunk ending with [DONE] when stream is true", body = ChatCompletion),
              (status = 400, body = OpenAiError), (status = 401, body = OpenAiError),
              (status = 429, body = OpenAiError)))]
pub async fn chat_completions(
    State(state): State<AppState>,
    OpenAiJson(request): OpenAiJson<ChatRequest>,
) -> Response {
    match chat_inner(state, request).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(state: AppState, r: ChatRequest) -> Result<Response, ApiError> {
    if let Some(format) = r.response_format.as_ref().filter(|f| !f.is_null()) {
        let kind = format.get("type").and_then(Value::as_str).unwrap_or("");
        if kind != "text" {
            return Err(ApiError::invalid(
                "response_format",
                format!(
                    "type {kind:?} is not supported yet (no grammar-constrained decoding); \
                     only \"text\" is"
                ),
            ));
        }
    }
    if r.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::invalid(
            "tools",
            "tool calling is not supported yet",
        ));
    }
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
    let (parameters, extra) = sampling.into_parameters()?;
    let n = extra.n.max(1) as usize;
    // The template writes the special tokens itself.
    let prompt = Prompt::Text {
        text,
        add_special: false,
    };
    let names = if r.max_completion_tokens.is_none() && r.max_tokens.is_some() {
        CHAT_NAMES_MAX_TOKENS
    } else {
        CHAT_NAMES
    };
    let submitted = submit(&state.infer, prompt, parameters, extra)
        .await
        .map_err(|e| ApiError::from_infer(e, names))?;
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let model = state.info.model_id.clone();
    let tokenizer = state.infer.validation.tokenizer.clone();
    if r.stream.unwrap_or(false) {
        let include_usage = r
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        return Ok(chat_stream(
            submitted,
            n,
            id,
            model,
            tokenizer,
            with_logprobs,
            include_usage,
        ));
    }
    let request = submitted.request;
    let samples = futures::future::try_join_all(submitted.samples.into_iter().map(collect))
        .await
        .map_err(|e| ApiError::from_infer(e, CHAT_NAMES))?;
    let ends: Vec<_> = samples.iter().map(|s| s.end.clone()).collect();
    let headers = timing_headers(&request, &ends.iter().collect::<Vec<_>>());
    let prompt_tokens = request.input_ids.len();
    let completion_tokens = ends.iter().map(|e| e.generated_tokens).sum::<usize>();
    let choices = samples
        .into_iter()
        .enumerate()
        .map(|(index, s)| ChatChoice {
            index,
            logprobs: with_logprobs.then(|| chat_logprobs(&tokenizer, &s.tokens, &s.top_tokens)),
            message: AssistantMessage {
                role: "assistant",
                content: s.end.generated_text,
            },
            finish_reason: finish_reason(s.end.finish_reason),
        })
        .collect();
    let body = ChatCompletion {
        id,
        object: "chat.completion",
        created: now_secs(),
        model,
        system_fingerprint: fingerprint(),
        choices,
        usage: Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        },
    };
    Ok((headers, Json(body)).into_response())
}

fn chat_stream(
    submitted: Submitted,
    n: usize,
    id: String,
    model: String,
    tokenizer: TokenizerInfo,
    with_logprobs: bool,
    include_usage: bool,
) -> Response {
    let created = now_secs();
    let chunk = move |choices: Vec<ChatChunkChoice>, usage: Option<Usage>| ChatCompletionChunk {
        id: id.clone(),
        object: "chat.completion.chunk",
        created,
        model: model.clone(),
        system_fingerprint: fingerprint(),
        choices,
        usage,
    };
    // Each choice opens with the assistant's role.
    let opening: Vec<_> = (0..n)
        .map(|index| {
            sse_json(&chunk(
                vec![ChatChunkChoice {
                    index,
                    delta: Delta {
                        role: Some("assistant"),
                        content: Some(String::new()),
                    },
                    logprobs: None,
                    finish_reason: None,
                }],
                None,
            ))
        })
        .collect();
    let (prompt_tokens, events) = merged(vec![submitted], n);
    let mut completion_tokens = 0;
    let tail_chunk = chunk.clone();
    let body = events.map(move |(index, event)| match event {
        Ok(event) => {
            if let Some(end) = &event.end {
                completion_tokens += end.generated_tokens;
            }
            let logprobs = with_logprobs.then(|| {
                chat_logprobs(
                    &tokenizer,
                    std::slice::from_ref(&event.token),
                    std::slice::from_ref(&event.top_tokens),
                )
            });
            let choice = ChatChunkChoice {
                index,
                delta: Delta {
                    role: None,
                    content: Some(event.token.text),
                },
                logprobs,
                finish_reason: event.end.as_ref().map(|e| finish_reason(e.finish_reason)),
            };
            (completion_tokens, sse_json(&chunk(vec![choice], None)))
        }
        Err(e) => (
            completion_tokens,
            sse_json(&ApiError::from_infer(e, CHAT_NAMES).body),
        ),
    });
    let body = stream::iter(opening.into_iter().map(|e| (0, e))).chain(body);
    finish_stream(body, prompt_tokens, include_usage, move |usage| {
        sse_json(&tail_chunk(Vec::new(), Some(usage)))
    })
}

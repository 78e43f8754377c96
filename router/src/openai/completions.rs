//! `POST /v1/completions`: one or more prompts (text or token ids), `n` choices each,
//! `best_of` ranking, `echo`, and logprobs in the completions shape.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::envelope::{Envelope, FINGERPRINT};
use super::guided::GuidedFields;
use super::logprobs::CompletionLogprobs;
use super::stream::{self, ChunkUsage, Chunks, StreamOptions};
use crate::api::submit::{self, Answered};
use crate::api::{
    collect_all, model_adapter, with_sampling_fields, ApiError, AppState, ChoiceFinish, Generation,
    OpenAiError, OpenAiJson, ParamNames, Sampling, Usage,
};
use crate::detokenize::TokenizerInfo;
use crate::infer::{best_first, Sample, Submitted, TokenEvent};
use crate::validation::Prompt;

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdsList(Vec<Vec<u32>>),
}

with_sampling_fields! {
    #[derive(Debug, Clone, Deserialize, ToSchema)]
    pub struct CompletionRequest {
        pub model: Option<String>,
        /// A string, a list of strings, a list of token ids or a list of such lists.
        pub prompt: PromptInput,
        /// Most tokens to generate per choice [default: 16].
        pub max_tokens: Option<u32>,
        /// Samples generated per prompt, the best `n` returned (by cumulative logprob).
        pub best_of: Option<u32>,
        pub stream: Option<bool>,
        pub stream_options: Option<StreamOptions>,
        /// Return the logprobs of each token and of this many alternatives.
        pub logprobs: Option<u32>,
        /// Return the prompt before the completion (with its logprobs when asked).
        pub echo: Option<bool>,
        pub user: Option<String>,
        /// Not supported (must be null or empty).
        pub suffix: Option<String>,
        /// Structured output: `response_format` and vLLM's `guided_*` / `structured_outputs`.
        #[serde(flatten)]
        pub guided: GuidedFields,
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionChoice {
    text: String,
    index: usize,
    logprobs: Option<CompletionLogprobs>,
    finish_reason: Option<ChoiceFinish>,
}

// The whole answer, and each chunk of a stream (`usage` as `stream::ChunkUsage` says).
#[derive(Debug, Serialize, ToSchema)]
pub struct Completion {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    system_fingerprint: String,
    choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Usage>)]
    usage: ChunkUsage,
}

impl Completion {
    fn new(envelope: &Envelope, choices: Vec<CompletionChoice>, usage: ChunkUsage) -> Self {
        Self {
            id: envelope.id.clone(),
            object: "text_completion",
            created: envelope.created,
            model: envelope.model.clone(),
            system_fingerprint: FINGERPRINT.into(),
            choices,
            usage,
        }
    }
}

const NAMES: ParamNames = ParamNames {
    inputs: Some("prompt"),
    max_new_tokens: Some("max_tokens"),
    top_n_tokens: Some("logprobs"),
    decoder_input_details: Some("echo"),
    adapter_id: Some("model"),
    ..ParamNames::TGI
};

/// What the choices show besides their text.
#[derive(Clone, Copy)]
struct Shown {
    /// The prompt before the generated text.
    echo: bool,
    /// Logprobs of each token ...
    logprobs: bool,
    /// ... and of its alternatives.
    alternatives: bool,
}

#[utoipa::path(post, path = "/v1/completions", request_body = CompletionRequest, tag = "OpenAI",
    responses((status = 200, description = "A completion, or an SSE stream of completion chunks ending with [DONE] when stream is true", body = Completion),
              (status = 400, body = OpenAiError), (status = 401, body = OpenAiError),
              (status = 429, body = OpenAiError)))]
pub async fn completions(
    State(state): State<AppState>,
    OpenAiJson(mut r): OpenAiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let n_asked = r.n;
    let fields = r.take_sampling();
    if r.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "is not supported"));
    }
    let adapter = model_adapter(&state, r.model.as_deref())?;
    let prompts = prompts(r.prompt);
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "must not be empty"));
    }
    let stream = r.stream.unwrap_or(false);
    let shown = Shown {
        echo: r.echo.unwrap_or(false),
        logprobs: r.logprobs.is_some(),
        alternatives: r.logprobs.unwrap_or(0) > 0,
    };
    if stream && r.best_of.is_some_and(|b| b > n_asked.unwrap_or(1)) {
        return Err(ApiError::invalid("best_of", "must equal n when streaming"));
    }
    let sampling = Sampling {
        fields,
        best_of: r.best_of,
        max_tokens: Some(r.max_tokens.unwrap_or(16)),
        top_n: r.logprobs,
        prompt_logprobs: shown.echo && shown.logprobs,
        // Streamed or not, the echo is the prompt validation kept (`ValidRequest::prefix`).
        echo: shown.echo,
    };
    let generation = Generation::new(sampling, adapter.clone(), stream)?;
    let generation = generation.constrained(r.guided.constraint()?);
    let n = generation.n();
    let submitted = generation.submit(&state, prompts, &NAMES).await?;
    let tokenizer = state.infer.validation.tokenizer.clone();
    if stream {
        let envelope = Envelope::new("cmpl", &state, adapter.as_deref());
        let include_usage = stream::include_usage(r.stream_options);
        return Ok(completion_stream(
            submitted,
            n,
            envelope,
            tokenizer,
            shown,
            include_usage,
        ));
    }
    let answered = collect_all(submitted, &NAMES).await?;
    let usage = submit::usage(&answered);
    let headers = submit::headers(&answered, &usage);
    let mut choices = Vec::new();
    for (p, answer) in answered.into_iter().enumerate() {
        choices.extend(prompt_choices(&tokenizer, answer, p * n, n, shown));
    }
    let envelope = Envelope::new("cmpl", &state, adapter.as_deref());
    let body = Completion::new(&envelope, choices, Some(Some(usage)));
    Ok((headers, Json(body)).into_response())
}

fn prompts(input: PromptInput) -> Vec<Prompt> {
    let text = |text| Prompt::Text {
        text,
        add_special: true,
    };
    match input {
        PromptInput::Text(t) => vec![text(t)],
        PromptInput::Texts(texts) => texts.into_iter().map(text).collect(),
        PromptInput::Ids(ids) => vec![Prompt::Ids(ids)],
        PromptInput::IdsList(lists) => lists.into_iter().map(Prompt::Ids).collect(),
    }
}

/// The best `n` samples of one prompt as choices, indexed from `first_index`.
fn prompt_choices(
    tokenizer: &TokenizerInfo,
    answer: Answered,
    first_index: usize,
    n: usize,
    shown: Shown,
) -> impl Iterator<Item = CompletionChoice> + '_ {
    let Answered { request, samples } = answer;
    // The prompt's logprobs come with the first sample only; every choice shows them.
    let first = samples.first();
    let prefill = first.map(|s| s.prefill.clone()).unwrap_or_default();
    let prefill_top = first
        .map(|s| s.prefill_top_tokens.clone())
        .unwrap_or_default();
    let prompt_text = request.prefix.unwrap_or_default();
    best_n(samples, n)
        .into_iter()
        .enumerate()
        .map(move |(j, sample)| {
            let logprobs = shown.logprobs.then(|| {
                let mut lp = CompletionLogprobs::default();
                if shown.echo {
                    // `prefill_top` starts at the second prompt token (the first has
                    // no logprob).
                    lp = CompletionLogprobs::of(
                        tokenizer,
                        &prefill,
                        &prefill_top,
                        1,
                        0,
                        shown.alternatives,
                    );
                }
                lp.append(CompletionLogprobs::of(
                    tokenizer,
                    &sample.tokens,
                    &sample.top_tokens,
                    0,
                    prompt_text.len(),
                    shown.alternatives,
                ));
                lp
            });
            CompletionChoice {
                text: sample.end.generated_text,
                index: first_index + j,
                logprobs,
                finish_reason: Some(sample.end.finish_reason.into()),
            }
        })
}

/// The `best_of` samples of a prompt cut to `n`, best first when more were generated
/// than returned (in sample order otherwise).
fn best_n(samples: Vec<Sample>, n: usize) -> Vec<Sample> {
    if samples.len() <= n {
        return samples;
    }
    let order = best_first(&samples);
    let mut samples: Vec<Option<Sample>> = samples.into_iter().map(Some).collect();
    order
        .into_iter()
        .take(n)
        .filter_map(|i| samples[i].take())
        .collect()
}

/// The stream: each choice's first chunk carries its echoed prompt (and the prompt's
/// logprobs) before its first token, as vLLM streams the echo.
fn completion_stream(
    submitted: Vec<Submitted>,
    n: usize,
    envelope: Envelope,
    tokenizer: TokenizerInfo,
    shown: Shown,
    include_usage: bool,
) -> Response {
    let prompts: Vec<String> = submitted
        .iter()
        .map(|s| s.request.prefix.clone().unwrap_or_default())
        .collect();
    let mut choices = vec![StreamedChoice::default(); prompts.len() * n];
    let last = envelope.clone();
    let chunks = Chunks {
        opening: Vec::new(),
        token: move |index: usize, event: TokenEvent| {
            let reason = event
                .end
                .as_ref()
                .map(|e| ChoiceFinish::from(e.finish_reason));
            let prompt = &prompts[index / n];
            let (text, logprobs) = choices[index].next(&tokenizer, prompt, event, shown);
            let token = CompletionChoice {
                text,
                index,
                logprobs,
                finish_reason: reason,
            };
            vec![Completion::new(
                &envelope,
                vec![token],
                stream::no_usage_yet(include_usage),
            )]
        },
        usage: move |usage| Completion::new(&last, Vec::new(), Some(Some(usage))),
    };
    stream::respond(submitted, n, NAMES, include_usage, chunks)
}

/// Where one streamed choice is: whether its prompt was echoed, and the text offset of
/// its next token (counted as the whole answer's logprobs count them).
#[derive(Clone, Default)]
struct StreamedChoice {
    echoed: bool,
    offset: usize,
}

impl StreamedChoice {
    /// The text and logprobs of the chunk for `event`: the first one echoes `prompt`.
    fn next(
        &mut self,
        tokenizer: &TokenizerInfo,
        prompt: &str,
        event: TokenEvent,
        shown: Shown,
    ) -> (String, Option<CompletionLogprobs>) {
        let mut text = String::new();
        let mut logprobs = CompletionLogprobs::default();
        if shown.echo && !self.echoed {
            self.echoed = true;
            text.push_str(prompt);
            // As `prompt_choices`: the prompt's logprobs from 0, then the generated
            // tokens from the end of the prompt's text.
            if shown.logprobs {
                logprobs = CompletionLogprobs::of(
                    tokenizer,
                    &event.prefill,
                    &event.prefill_top_tokens,
                    1,
                    0,
                    shown.alternatives,
                );
            }
            self.offset = prompt.len();
        }
        text.push_str(&event.token.text);
        let logprobs = shown.logprobs.then(|| {
            let token = CompletionLogprobs::of(
                tokenizer,
                std::slice::from_ref(&event.token),
                std::slice::from_ref(&event.top_tokens),
                0,
                self.offset,
                shown.alternatives,
            );
            self.offset = token.end_offset().unwrap_or(self.offset);
            logprobs.append(token);
            logprobs
        });
        (text, logprobs)
    }
}

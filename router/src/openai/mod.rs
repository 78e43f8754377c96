//! OpenAI's API: `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat
//! template rendered by `chat`), `GET /v1/models`, with SSE streaming that ends with
//! `data: [DONE]`, `n` / `best_of`, logprobs, `logit_bias`, and errors in OpenAI's shape
//! `{"error": {"message", "type", "param", "code"}}` (400 for bad input).
//!
//! Each request is turned into TGI's parameters plus `Extra` (`sampling`) and goes in
//! through `Infer::submit`, as the TGI routes' requests do (`generate`). The two
//! generating routes differ only in their request and response shapes
//! (`completions`, `chat`); they share the streaming (`stream`), the logprobs (`logprobs`)
//! and the errors (`error`). Chat adds tool calling (`tools`). The Responses API
//! (`responses`, `POST /v1/responses`, `GET /v1/responses/{id}`) answers conversations as
//! chat does (`conversation`: template, tools, output constraint). `adapters`: the
//! `model` naming a LoRA adapter, and vLLM's runtime adapter loading routes.

mod adapters;
mod chat;
mod completions;
mod envelope;
mod guided;
mod logprobs;
mod models;
mod responses;
mod stream;

use axum::routing::{get, post};
use axum::Router;

// The route types make up the OpenAPI document (`crate::openapi`); the `__path_` items
// are the operations utoipa generates for the handlers.
pub use crate::api::tools::{
    FunctionCall, FunctionDefinition, FunctionDelta, Tool, ToolCall, ToolCallDelta,
};
pub use crate::api::{ApiError, OpenAiError, OpenAiErrorDetail, OpenAiJson, StopInput, Usage};
pub use adapters::{
    __path_load_lora_adapter, __path_unload_lora_adapter, load_lora_adapter, unload_lora_adapter,
    LoadLoraAdapterRequest, UnloadLoraAdapterRequest,
};
pub use chat::{
    __path_chat_completions, chat_completions, AssistantMessage, ChatChoice, ChatChunkChoice,
    ChatCompletion, ChatCompletionChunk, ChatMessage, ChatRequest, ContentPart, Delta,
    MessageContent, Reasoning,
};
pub use completions::{
    __path_completions, completions, Completion, CompletionChoice, CompletionRequest, PromptInput,
};
pub use guided::GuidedFields;
pub use logprobs::{ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob};
pub use models::{__path_models, models, Model, ModelList};
pub use responses::{
    __path_create_response, __path_get_response, create_response, get_response, IncompleteDetails,
    OutputItem, OutputText, ReasoningText, ResponseObject, ResponseUsage, ResponsesRequest,
    Settings,
};
pub use stream::StreamOptions;

use crate::api::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/responses", post(create_response))
        .route("/v1/responses/{id}", get(get_response))
}

/// `--allow-runtime-lora`'s routes.
pub fn lora_routes() -> Router<AppState> {
    Router::new()
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
}

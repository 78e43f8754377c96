//! The OpenAPI document, generated from the Rust types with utoipa: served as JSON at
//! `/openapi.json` (and TGI's `/api-doc/openapi.json`), browsable at `/docs` (`docs`).

use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use utoipa::OpenApi;

use crate::anthropic::{
    self, AnthropicError, AnthropicErrorDetail, BlockDelta, ContentBlock, CountTokensRequest,
    InputContent, InputMessage, Message, MessageDeltaBody, MessageUsage, MessagesRequest,
    OutputBlock, OutputUsage, StopReason, StreamEvent, ThinkingConfig, TokenCount, ToolChoiceInput,
    ToolDefinition,
};
use crate::api::{ChoiceFinish, Info, LoraInfo, Role};
use crate::error::ErrorBody;
use crate::infer::{FinishReason, Token};
use crate::openai::{self, *};
use crate::readiness::NotReadyBody;
use crate::status;
use crate::tgi::{self, *};
use crate::usage::{self, TenantUsageReport, UsageList};
use crate::validation::{GenerateParameters, GenerateRequest};

#[derive(OpenApi)]
#[openapi(
    info(title = "cadence", description = "Text generation: TGI's API, OpenAI's and Anthropic's Messages"),
    paths(
        tgi::compat_generate,
        tgi::generate,
        tgi::generate_stream,
        tgi::tokenize,
        status::health,
        status::ready,
        status::info,
        openai::completions,
        openai::chat_completions,
        openai::models,
        openai::create_response,
        openai::get_response,
        openai::load_lora_adapter,
        openai::unload_lora_adapter,
        anthropic::messages,
        anthropic::count_tokens,
        usage::usage,
    ),
    components(schemas(
        GenerateRequest, GenerateParameters, GenerateResponse, Details, BestOfSequence,
        StreamResponse, StreamDetails, Token, FinishReason, SimpleToken, TokenizeRequest,
        Info, ErrorBody, OpenAiError, OpenAiErrorDetail, CompletionRequest, Completion,
        CompletionChoice, CompletionLogprobs, ChatRequest, ChatCompletion, ChatChoice,
        ChatCompletionChunk, ChatChunkChoice, Delta, ChatLogprobs, ChatTokenLogprob,
        TopLogprob, AssistantMessage, Usage, ModelList, Model, ChatMessage,
        MessageContent, ContentPart, PromptInput, StopInput, StreamOptions, Tool,
        FunctionDefinition, ToolCall, FunctionCall, ToolCallDelta, FunctionDelta, NotReadyBody,
        LoraInfo, LoadLoraAdapterRequest, UnloadLoraAdapterRequest, ResponsesRequest,
        ResponseObject, OutputItem, OutputText, ResponseUsage, IncompleteDetails, Settings,
        MessagesRequest,
        CountTokensRequest, InputMessage, InputContent, ContentBlock, ToolDefinition,
        ToolChoiceInput, Message, MessageUsage, OutputBlock, TokenCount, StreamEvent, BlockDelta,
        MessageDeltaBody, OutputUsage, AnthropicError, AnthropicErrorDetail, ChoiceFinish,
        Role, StopReason, UsageList, TenantUsageReport, Reasoning, ReasoningText,
        ThinkingConfig,
    )),
    modifiers(&BearerAuth),
)]
pub struct ApiDoc;

/// Declares the API key schemes, a bearer token or Anthropic's `x-api-key` header
/// (enforced only when the router has keys).
struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{
            ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme,
        };
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        components.add_security_scheme(
            "x_api_key",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::new("x-api-key"))),
        );
    }
}

pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/openapi.json", get(document))
        .route("/api-doc/openapi.json", get(document))
}

async fn document() -> Response {
    Json(ApiDoc::openapi()).into_response()
}

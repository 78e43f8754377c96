//! Anthropic's Messages API: `POST /v1/messages` (streamed as Anthropic's SSE events or
//! not) and `POST /v1/messages/count_tokens`, with errors in Anthropic's shape
//! `{"type": "error", "error": {"type", "message"}}`.
//!
//! Built on the shared API layer (`crate::api`): the conversation becomes the
//! chat template's messages (`convert`), tools become `api::tools::Tools`, whose
//! grammar constrains the output and whose `Reading` reads the calls back; the answer
//! (`answer`) and its events (`stream`) only change the shape.
//!
//! - `request`: the request types.
//! - `convert`: blocks → template messages, tools and `tool_choice` → `Tools`.
//! - `answer`: the message, its content blocks and stop reason.
//! - `stream`: one answer's SSE events.
//! - `error`: the error shape and the JSON body extractor.
//! - `messages`: the two handlers.

mod answer;
mod convert;
mod error;
mod messages;
mod request;
mod stream;

use axum::routing::post;
use axum::Router;

pub use answer::{Message, MessageUsage, OutputBlock, StopReason};
pub use error::{error, unauthorized, AnthropicError, AnthropicErrorDetail};
pub use messages::{__path_count_tokens, __path_messages, count_tokens, messages, TokenCount};
pub use request::{
    ContentBlock, CountTokensRequest, InputContent, InputMessage, MessagesRequest, ThinkingConfig,
    ToolChoiceInput, ToolDefinition,
};
pub use stream::{BlockDelta, MessageDeltaBody, OutputUsage, StreamEvent};

use crate::api::AppState;

/// The path prefix of the routes that answer in Anthropic's shape (401s included).
pub const PATH_PREFIX: &str = "/v1/messages";

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
}

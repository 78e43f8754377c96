//! Errors in Anthropic's shape `{"type": "error", "error": {"type", "message"}}`: the
//! chat machinery's `ApiError`s (their message names the field) keep their status and
//! take the type Anthropic gives it; and the JSON body extractor whose rejections take
//! this shape too.

use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;
use utoipa::ToSchema;

use crate::api::{parse_json, ApiError};
use crate::error::{error_response_after, RETRY_AFTER_SECONDS};

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AnthropicErrorDetail {
    /// invalid_request_error (400), authentication_error (401), not_found_error (404),
    /// rate_limit_error (429), overloaded_error (503), api_error (500).
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub message: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AnthropicError {
    /// "error".
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub error: AnthropicErrorDetail,
}

/// An error answered in Anthropic's shape.
#[derive(Debug)]
pub struct MessagesError {
    status: StatusCode,
    /// The seconds a 429 or 503 tells the client to wait.
    retry_after: u64,
    /// Also sent alone as an `error` event when a stream fails after it started.
    pub(super) body: AnthropicError,
}

/// Anthropic's error type for a status.
fn kind(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST => "invalid_request_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::METHOD_NOT_ALLOWED => "invalid_request_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        _ => "api_error",
    }
}

impl MessagesError {
    fn new(status: StatusCode, message: String) -> Self {
        Self {
            status,
            retry_after: RETRY_AFTER_SECONDS.into(),
            body: AnthropicError {
                kind: "error",
                error: AnthropicErrorDetail {
                    kind: kind(status),
                    message,
                },
            },
        }
    }
}

impl From<ApiError> for MessagesError {
    fn from(e: ApiError) -> Self {
        let parts = e.into_parts();
        let mut error = Self::new(parts.status, parts.message);
        error.retry_after = parts.retry_after;
        error
    }
}

impl IntoResponse for MessagesError {
    fn into_response(self) -> Response {
        error_response_after(self.status, self.body, self.retry_after)
    }
}

/// An error in Anthropic's shape, its type the status's (unknown routes' 404 and 405).
pub fn error(status: StatusCode, message: String) -> Response {
    MessagesError::new(status, message).into_response()
}

/// The 401 of `/v1/messages*` when the router has API keys.
pub fn unauthorized() -> Response {
    MessagesError::new(
        StatusCode::UNAUTHORIZED,
        "missing or invalid API key: send x-api-key: <key> (or Authorization: Bearer <key>)".into(),
    )
    .into_response()
}

/// A JSON body whose errors are 400s in Anthropic's shape naming the field.
pub struct AnthropicJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for AnthropicJson<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        parse_json(req, state, |e| MessagesError::from(e).into_response())
            .await
            .map(AnthropicJson)
    }
}

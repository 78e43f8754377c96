//! Errors: what clients see (`InferError`, TGI's `{"error", "error_type"}` shape) and
//! what stops the router from starting (`RouterError`).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// An error answered to a client. The variant decides the status code and `error_type`.
#[derive(Debug, Clone, thiserror::Error)]
pub enum InferError {
    /// Bad input: 422.
    #[error("{0}")]
    Validation(String),
    /// Too many requests in flight or waiting: 429.
    #[error("{0}")]
    Overloaded(String),
    /// A tenant's own limit: 429, `Retry-After` the seconds until it lets a request in.
    #[error("{message}")]
    RateLimited { message: String, retry_after: u64 },
    /// A shard failed while generating: 424.
    #[error("{0}")]
    Generation(String),
    /// The shards do not answer: 503.
    #[error("{0}")]
    Unhealthy(String),
    /// The router is draining (SIGTERM): 503, try another replica.
    #[error("{0}")]
    ShuttingDown(String),
}

/// The JSON body of every error on the TGI routes.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: String,
    pub error_type: &'static str,
}

impl InferError {
    pub fn error_type(&self) -> &'static str {
        match self {
            InferError::Validation(_) => "validation",
            InferError::Overloaded(_) | InferError::RateLimited { .. } => "overloaded",
            InferError::Generation(_) => "generation",
            InferError::Unhealthy(_) => "unhealthy",
            InferError::ShuttingDown(_) => "shutting_down",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            InferError::Validation(_) => StatusCode::UNPROCESSABLE_ENTITY,
            InferError::Overloaded(_) | InferError::RateLimited { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            InferError::Generation(_) => StatusCode::FAILED_DEPENDENCY,
            InferError::Unhealthy(_) | InferError::ShuttingDown(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// The seconds a 429 or 503 tells the client to wait.
    pub fn retry_after(&self) -> u64 {
        match self {
            InferError::RateLimited { retry_after, .. } => *retry_after,
            _ => RETRY_AFTER_SECONDS.into(),
        }
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: self.to_string(),
            error_type: self.error_type(),
        }
    }
}

impl IntoResponse for InferError {
    fn into_response(self) -> Response {
        error_response_after(self.status(), self.body(), self.retry_after())
    }
}

/// Seconds a client told 429 or 503 waits before trying again.
pub const RETRY_AFTER_SECONDS: u32 = 1;

/// An error answer in any route's shape; a 429 or a 503 says when to try again
/// (`Retry-After`, which OpenAI's clients honour).
pub fn error_response(status: StatusCode, body: impl Serialize) -> Response {
    error_response_after(status, body, RETRY_AFTER_SECONDS.into())
}

/// `error_response` whose 429 or 503 says to wait `retry_after` seconds.
pub fn error_response_after(
    status: StatusCode,
    body: impl Serialize,
    retry_after: u64,
) -> Response {
    let mut response = (status, Json(body)).into_response();
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
    }
    response
}

/// A failed gRPC call to a shard.
#[derive(Debug, Clone, thiserror::Error)]
#[error("shard {rank}: {message}")]
pub struct ShardError {
    pub rank: usize,
    pub message: String,
}

/// Why the router could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("invalid arguments: {0}")]
    Args(String),
    #[error("cannot load the tokenizer from {path}: {message}")]
    Tokenizer { path: String, message: String },
    #[error("cannot connect to shard {rank} at {path}: {message}")]
    Connect {
        rank: usize,
        path: String,
        message: String,
    },
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error("the shards disagree with the router: {0}")]
    Mismatch(String),
    #[error("LoRA: {0}")]
    Adapter(String),
    #[error("HTTP server: {0}")]
    Io(#[from] std::io::Error),
}

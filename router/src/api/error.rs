//! Errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, and the
//! JSON body extractor whose rejections take that shape too.

use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;
use utoipa::ToSchema;

use super::body::read_body;
use super::names::ParamNames;
use crate::error::{error_response_after, InferError, RETRY_AFTER_SECONDS};

#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<ErrorCode>,
}

/// An error's `code`: a name (`invalid_api_key`) or, as vLLM answers a model it does not
/// serve, the status number.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum ErrorCode {
    Name(String),
    Status(u16),
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ErrorCode::Name(name) => f.write_str(name),
            ErrorCode::Status(status) => write!(f, "{status}"),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiError {
    pub error: OpenAiErrorDetail,
}

/// An error answered in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    /// The seconds a 429 or 503 tells the client to wait.
    retry_after: u64,
    /// Also sent alone as an SSE event when a stream fails after it started.
    pub(crate) body: OpenAiError,
}

/// What an `ApiError` says, for the routes that answer in another shape.
pub(crate) struct ErrorParts {
    pub status: StatusCode,
    pub message: String,
    pub retry_after: u64,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &str, message: String, param: Option<String>) -> Self {
        Self {
            status,
            retry_after: RETRY_AFTER_SECONDS.into(),
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
        e.body.error.code = Some(ErrorCode::Name("invalid_api_key".into()));
        e
    }

    /// A `model` that names no served model nor adapter: 404 in vLLM's words.
    pub fn model_not_found(model: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The model `{model}` does not exist."),
            Some("model".into()),
        );
        e.body.error.code = Some(ErrorCode::Status(StatusCode::NOT_FOUND.as_u16()));
        e
    }

    pub(crate) fn into_parts(self) -> ErrorParts {
        ErrorParts {
            status: self.status,
            message: self.body.error.message,
            retry_after: self.retry_after,
        }
    }

    /// A router error, its TGI parameter names turned into the route's names.
    pub(crate) fn from_infer(e: InferError, names: &ParamNames) -> Self {
        let (status, kind) = match &e {
            InferError::Validation(_) => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            InferError::Overloaded(_) | InferError::RateLimited { .. } => {
                (StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded")
            }
            InferError::Generation(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
            InferError::Unhealthy(_) | InferError::ShuttingDown(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "server_error")
            }
        };
        let retry_after = e.retry_after();
        let (message, param) = match e {
            InferError::Validation(message) => names.message(&message),
            e => (e.to_string(), None),
        };
        let mut error = Self::new(status, kind, message, param);
        error.retry_after = retry_after;
        error
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error_response_after(self.status, self.body, self.retry_after)
    }
}

/// A JSON body whose errors are 400s in OpenAI's shape naming the field.
pub struct OpenAiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for OpenAiJson<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        parse_json(req, state, IntoResponse::into_response)
            .await
            .map(OpenAiJson)
    }
}

/// Reads and parses a JSON body; every error is an `ApiError` naming the field (the
/// body's path, "body" for the whole) that `shape` answers in the route's shape.
pub(crate) async fn parse_json<T: DeserializeOwned, S: Send + Sync>(
    req: Request,
    state: &S,
    shape: fn(ApiError) -> Response,
) -> Result<T, Response> {
    let bytes = read_body(req, state, |e| {
        shape(ApiError::from_infer(e, &ParamNames::TGI))
    })
    .await?;
    let mut de = serde_json::Deserializer::from_slice(&bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let param = if path == "." { "body" } else { path.as_str() };
        shape(ApiError::invalid(param, e.inner().to_string()))
    })?;
    de.end()
        .map_err(|e| shape(ApiError::invalid("body", e.to_string())))?;
    Ok(value)
}

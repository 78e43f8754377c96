//! Reading a request body within the payload limit.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::error::{ErrorBody, InferError};

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

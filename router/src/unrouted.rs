//! The answers to requests no route takes, in the shape of the API their path belongs
//! to, so that each API's clients report them: a 404 for an unknown path and a 405 for a
//! known path asked with another method. Anthropic's shape under `/v1/messages`, OpenAI's
//! under `/v1/` (its words for an unknown URL), TGI's `{"error", "error_type"}` elsewhere.

use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use crate::api::ApiError;
use crate::error::{error_response, ErrorBody};

/// The 404 of a path no route serves.
pub async fn not_found(method: Method, uri: Uri) -> Response {
    let path = uri.path();
    let message = if path.starts_with("/v1/") && !path.starts_with(crate::anthropic::PATH_PREFIX) {
        // OpenAI's own words for it.
        format!("Invalid URL ({method} {path})")
    } else {
        format!("Not Found: no route {method} {path}")
    };
    answer(path, StatusCode::NOT_FOUND, "not_found", message)
}

/// The 405 of a served path asked with a method it does not take (its `Allow` header,
/// which the router adds, names those it does).
pub async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let path = uri.path();
    let message = format!("Method Not Allowed: {path} does not take {method}");
    answer(
        path,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        message,
    )
}

/// `message` in the shape of `path`'s API; `tgi_type` is the `error_type` of TGI's.
fn answer(path: &str, status: StatusCode, tgi_type: &'static str, message: String) -> Response {
    if path.starts_with(crate::anthropic::PATH_PREFIX) {
        return crate::anthropic::error(status, message);
    }
    if path.starts_with("/v1/") {
        return ApiError::new(status, "invalid_request_error", message, None).into_response();
    }
    let body = ErrorBody {
        error: message,
        error_type: tgi_type,
    };
    error_response(status, body)
}

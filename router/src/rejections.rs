//! Every rejected request (answered a 4xx: a missing key, bad input, an unknown route or
//! model, a body too large, too many requests) leaves an access log line (method, path,
//! status, reason and the error's message; never a header, so never a key) and a count in
//! `cadence_http_requests_rejected_total{route, status, reason}`.
//!
//! The reason is the error's type as the answer's own shape gives it (OpenAI's `code` or
//! `type`, Anthropic's `error.type`, TGI's `error_type`); the route is the route that
//! matched (`unmatched` when none did), so neither label grows with what clients send.

use std::sync::Arc;

use axum::body::{to_bytes, Body};
use axum::extract::{MatchedPath, Request};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;
use serde_json::Value;

use crate::metrics::{Metrics, Rejection};

/// Error bodies are small JSON; one larger than this is counted without its reason.
const MAX_ERROR_BODY: usize = 64 * 1024;
/// The most characters of an error's message that go in its log line.
const MAX_LOGGED_MESSAGE: usize = 300;

/// Wraps `app` (its routes, access control included) with the log and the counter.
pub fn layers(app: Router, metrics: Arc<Metrics>) -> Router {
    app.route_layer(middleware::from_fn(keep_matched_path))
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            let metrics = metrics.clone();
            async move { record(&metrics, req, next).await }
        }))
}

/// Carries the route that matched to the answer, for the outer layer's label.
async fn keep_matched_path(req: Request, next: Next) -> Response {
    let matched = req.extensions().get::<MatchedPath>().cloned();
    let mut response = next.run(req).await;
    if let Some(matched) = matched {
        response.extensions_mut().insert(matched);
    }
    response
}

async fn record(metrics: &Metrics, req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let response = next.run(req).await;
    let status = response.status();
    if !status.is_client_error() {
        return response;
    }
    let route = response
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_string();
    let (parts, body) = response.into_parts();
    let bytes = to_bytes(body, MAX_ERROR_BODY).await.unwrap_or_default();
    let (reason, message) = reason_of(&bytes);
    tracing::warn!(
        target: "cadence::access",
        method = %method,
        path = %path,
        status = status.as_u16(),
        reason = %reason,
        message = %message,
        "request rejected"
    );
    metrics.http_rejections.count(Rejection {
        route,
        status: status.as_u16(),
        reason,
    });
    Response::from_parts(parts, Body::from(bytes))
}

/// An error body's type and message, whichever API's shape it has.
fn reason_of(body: &[u8]) -> (String, String) {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return ("none".into(), String::new());
    };
    let error = &v["error"];
    let reason = if v["type"] == "error" {
        // Anthropic's `{"type": "error", "error": {"type", "message"}}`.
        error["type"].as_str()
    } else if error.is_object() {
        // OpenAI's: its `code` when a string names it better than `type`.
        error["code"].as_str().or(error["type"].as_str())
    } else {
        v["error_type"].as_str()
    };
    let message = error["message"].as_str().or(error.as_str()).unwrap_or("");
    let message: String = message.chars().take(MAX_LOGGED_MESSAGE).collect();
    (reason.unwrap_or("none").to_string(), message)
}

#[cfg(test)]
mod tests {
    use super::reason_of;

    #[test]
    fn every_apis_error_shape_gives_its_type_and_message() {
        let openai = br#"{"error": {"message": "m", "type": "NotFoundError", "param": "model", "code": 404}}"#;
        let key = br#"{"error": {"message": "k", "type": "invalid_request_error", "code": "invalid_api_key"}}"#;
        let anthropic =
            br#"{"type": "error", "error": {"type": "not_found_error", "message": "a"}}"#;
        let tgi = br#"{"error": "t", "error_type": "validation"}"#;
        assert_eq!(reason_of(openai), ("NotFoundError".into(), "m".into()));
        assert_eq!(reason_of(key), ("invalid_api_key".into(), "k".into()));
        assert_eq!(reason_of(anthropic), ("not_found_error".into(), "a".into()));
        assert_eq!(reason_of(tgi), ("validation".into(), "t".into()));
        assert_eq!(reason_of(b""), ("none".into(), String::new()));
    }
}

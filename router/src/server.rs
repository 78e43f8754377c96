//! The HTTP surface: every API's routes in one `Router` (TGI's in `tgi`, the operators'
//! in `status`, OpenAI's in `openai`, Anthropic's in `anthropic`); the OpenAPI document
//! is in `openapi`, access control in `access`, the answers to requests no route takes
//! in `unrouted`, the log and count of rejected requests in `rejections`.

use axum::routing::{get, post};
use axum::Router;

use crate::api::AppState;
use crate::status::{health, info, metrics, ready};
use crate::tgi::{compat_generate, generate, generate_stream, tokenize};

/// Every route, `more` (routes without state: `/docs`) among them, and JSON 404 and 405
/// answers; without access control or CORS (see `access::layers`).
pub fn router(state: AppState, more: Router) -> Router {
    let runtime_lora = if state.infer.adapters().config().allow_runtime {
        crate::openai::lora_routes()
    } else {
        Router::new()
    };
    Router::new()
        .route("/", post(compat_generate))
        .route("/generate", post(generate))
        .route("/generate_stream", post(generate_stream))
        .merge(crate::openai::routes())
        .merge(crate::anthropic::routes())
        .merge(runtime_lora)
        // The routes above: each request gets its `x-request-id` and, with traces on, spans.
        .route_layer(axum::middleware::from_fn(crate::request_scope::scope))
        .route("/tokenize", post(tokenize))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/info", get(info))
        .route("/v1/usage", get(crate::usage::usage))
        .merge(crate::openapi::routes())
        .route("/metrics", get(metrics))
        .with_state(state)
        .merge(more)
        // After every route: it applies to the routes there are.
        .method_not_allowed_fallback(crate::unrouted::method_not_allowed)
        .fallback(crate::unrouted::not_found)
}

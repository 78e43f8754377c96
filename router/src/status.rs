//! The routes for operators: /health (liveness), /ready (readiness, the rule in
//! `readiness`), /info and /metrics.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::api::{AppState, Info, LoraInfo};
use crate::error::error_response;
use crate::readiness::NotReadyBody;

/// Liveness: answered by the HTTP task alone (no shard call, nothing the batching loop
/// holds), so load never delays it; it stays 200 while draining.
#[utoipa::path(get, path = "/health", tag = "TGI",
    responses((status = 200, description = "The router process is alive: `{}`")))]
pub async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({}))
}

/// Readiness: the rule is in `readiness`.
#[utoipa::path(get, path = "/ready", tag = "TGI",
    responses((status = 200, description = "Ready for traffic: `{\"status\": \"ready\"}`"),
              (status = 503, description = "Not ready; `reason` says why", body = NotReadyBody)))]
pub async fn ready(State(state): State<AppState>) -> Response {
    let readiness = &state.readiness;
    match readiness.check(&state.infer).await {
        Ok(()) => Json(serde_json::json!({"status": "ready"})).into_response(),
        Err(why) => {
            let body = NotReadyBody {
                error: format!(
                    "not ready ({}): {}",
                    why.reason(),
                    why.message(readiness.probe_timeout)
                ),
                error_type: "not_ready",
                reason: why.reason(),
            };
            error_response(StatusCode::SERVICE_UNAVAILABLE, body)
        }
    }
}

#[utoipa::path(get, path = "/info", tag = "TGI", responses((status = 200, body = Info)))]
pub async fn info(State(state): State<AppState>) -> Json<Info> {
    let mut info = state.info;
    info.lora = LoraInfo::of(state.infer.adapters());
    Json(info)
}

/// `GET /metrics`: Prometheus text, with the shard-side token counters summed over the
/// replicas when every replica's rank 0 answers (a sum missing a replica would make the
/// counters go down, which Prometheus reads as a restart).
pub async fn metrics(State(state): State<AppState>) -> Response {
    let asked = state
        .shards
        .iter()
        .map(|shards| tokio::time::timeout(Duration::from_secs(2), shards.computed_tokens()));
    let answers = futures::future::join_all(asked).await;
    let shard = if state.shards.is_empty() {
        None
    } else {
        answers
            .into_iter()
            .map(|a| a.ok().and_then(Result::ok))
            .try_fold((0, 0), |(all, prompt), a| {
                a.map(|(x, y)| (all + x, prompt + y))
            })
    };
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::metrics::CONTENT_TYPE,
        )],
        state.infer.metrics().render(shard),
    )
        .into_response()
}

//! `GET /v1/usage`: the tenants' accounts, the numbers `/metrics` exports per tenant. A
//! key sees its own tenant's; a key with `role=admin` sees every tenant's. Without API
//! keys there are no tenants: 404, saying so.

use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Serialize;

use crate::api::{ApiError, AppState};
use crate::tenants::{AdminKey, Tenant, TenantUsage};

/// One tenant's account.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TenantUsageReport {
    /// "tenant.usage".
    pub object: &'static str,
    pub tenant: String,
    /// Requests admitted past the limits.
    pub requests: u64,
    /// Requests answered 429 for the tenant's own limits.
    pub rejected_requests: u64,
    /// Prompt tokens of admitted requests (once per request, as answers' usage says).
    pub prompt_tokens: u64,
    /// Tokens generated, a stopped stream's up to where it stopped.
    pub generation_tokens: u64,
    pub total_tokens: u64,
    /// Requests admitted and not ended.
    pub running_requests: usize,
    /// The tenant's tokens per minute; null: no limit.
    pub tokens_per_minute: Option<u64>,
    /// Tokens its bucket holds now (below zero: owed); null: no limit.
    pub tokens_available: Option<i64>,
}

/// `{"object": "list", "data": [...]}`, tenants in name order.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct UsageList {
    pub object: &'static str,
    pub data: Vec<TenantUsageReport>,
}

fn report(name: &str, usage: &TenantUsage, now: Instant) -> TenantUsageReport {
    let (prompt, generated) = (usage.prompt_tokens.get(), usage.generation_tokens.get());
    let limit = Some(usage.bucket.per_minute()).filter(|&n| n > 0);
    TenantUsageReport {
        object: "tenant.usage",
        tenant: name.to_string(),
        requests: usage.requests.get(),
        rejected_requests: usage.rejected.get(),
        prompt_tokens: prompt,
        generation_tokens: generated,
        total_tokens: prompt + generated,
        running_requests: usage.in_flight.load(Ordering::Acquire),
        tokens_per_minute: limit,
        tokens_available: limit.map(|_| usage.bucket.available(now).floor() as i64),
    }
}

/// `GET /v1/usage`.
#[utoipa::path(
    get,
    path = "/v1/usage",
    tag = "Operations",
    responses(
        (status = 200, description = "The caller's tenant's account, or every tenant's for an admin key", body = UsageList),
        (status = 404, description = "No API keys, so no tenants", body = crate::api::OpenAiError)
    )
)]
pub async fn usage(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    admin: Option<Extension<AdminKey>>,
) -> Response {
    let tenants = state.infer.tenants();
    let Some(Extension(Tenant(caller))) = tenant.filter(|_| !tenants.is_empty()) else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "usage is accounted per API key: start the server with --api-key-file or \
             --api-key"
                .into(),
            None,
        )
        .into_response();
    };
    let now = Instant::now();
    let data = tenants
        .iter()
        .filter(|(name, _)| admin.is_some() || **name == *caller)
        .map(|(name, usage)| report(&name, &usage, now))
        .collect();
    Json(UsageList {
        object: "list",
        data,
    })
    .into_response()
}

//! Access control and browser access: API keys on every route but the open ones (sent
//! as `Authorization: Bearer <key>` or, as Anthropic's clients send it, `x-api-key`),
//! CORS, and the request body limit.
//!
//! CORS lets the official browser SDKs through by default: their preflight asks for
//! headers of their own (OpenAI's `x-stainless-*`, Anthropic's `anthropic-version`,
//! `anthropic-dangerous-direct-browser-access`, `x-api-key`), which a fixed list would
//! miss, so without `--cors-allow-headers` the headers a preflight asks for are allowed.

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{header, HeaderName, HeaderValue, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin, Any, CorsLayer};

use crate::api::ApiError;
use crate::error::ErrorBody;
use crate::tenants::{AdminKey, ApiKey, KeyRing, Tenant};

/// Routes anyone may call: probes, metrics and the API's description (and the files of
/// `/docs`, under `docs::ASSETS_PREFIX`).
const OPEN_PATHS: &[&str] = &[
    "/health",
    "/ready",
    "/metrics",
    "/docs",
    "/openapi.json",
    "/api-doc/openapi.json",
];

/// The key header of Anthropic's clients.
const API_KEY_HEADER: &str = "x-api-key";

#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Accepted bearer keys and their tenants; empty: no authentication.
    pub api_keys: Vec<ApiKey>,
    /// The keys in force when they can change while serving (a reloaded key file);
    /// None: `api_keys`, fixed.
    pub key_ring: Option<KeyRing>,
    /// CORS origins; empty: no CORS headers, `*`: any origin.
    pub cors_allow_origin: Vec<String>,
    /// Request headers CORS allows; empty: those the preflight asks for, `*`: any.
    pub cors_allow_headers: Vec<String>,
    /// Methods CORS allows; empty: GET and POST (every route's), `*`: any.
    pub cors_allow_methods: Vec<String>,
    pub payload_limit: usize,
}

/// Wraps `app` with the body limit, API key check and CORS.
pub fn layers(app: Router, access: Access) -> Router {
    let mut app = app.layer(DefaultBodyLimit::max(access.payload_limit));
    let ring = match access.key_ring {
        Some(ring) => Some(ring),
        None if access.api_keys.is_empty() => None,
        None => Some(KeyRing::new(&access.api_keys)),
    };
    if let Some(ring) = ring {
        // On the routes only: a path no route serves is a 404 with or without a key.
        app = app.route_layer(middleware::from_fn(move |req: Request, next: Next| {
            let ring = ring.clone();
            async move { check_key(&ring, req, next).await }
        }));
    }
    if !access.cors_allow_origin.is_empty() {
        app = app.layer(cors(
            &access.cors_allow_origin,
            &access.cors_allow_headers,
            &access.cors_allow_methods,
        ));
    }
    app
}

/// The CORS layer of `--cors-allow-origin`, `--cors-allow-headers` and
/// `--cors-allow-methods` (see the module's comment for the defaults).
fn cors(origins: &[String], headers: &[String], methods: &[String]) -> CorsLayer {
    let any = |list: &[String]| list.iter().any(|o| o == "*");
    let origin = if any(origins) {
        AllowOrigin::from(Any)
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
    };
    let headers = if headers.is_empty() {
        AllowHeaders::mirror_request()
    } else if any(headers) {
        AllowHeaders::from(Any)
    } else {
        AllowHeaders::list(headers.iter().filter_map(|h| h.parse::<HeaderName>().ok()))
    };
    let methods = if methods.is_empty() {
        AllowMethods::list([Method::GET, Method::POST])
    } else if any(methods) {
        AllowMethods::from(Any)
    } else {
        AllowMethods::list(methods.iter().filter_map(|m| m.parse::<Method>().ok()))
    };
    CorsLayer::new()
        .allow_origin(origin)
        .allow_headers(headers)
        .allow_methods(methods)
        // The request id, for a browser client's bug reports.
        .expose_headers([HeaderName::from_static("x-request-id")])
}

/// Lets a request with an accepted key through, its tenant set on it for accounting.
async fn check_key(ring: &KeyRing, mut req: Request<Body>, next: Next) -> Response {
    let path = req.uri().path();
    let open = OPEN_PATHS.contains(&path) || path.starts_with(crate::docs::ASSETS_PREFIX);
    // The playground's page (its `POST /` twin is TGI's generate, which needs a key).
    let open = open
        || (req.method() == Method::GET && path == "/")
        || path.starts_with(crate::playground::ASSETS_PREFIX);
    if open || req.method() == Method::OPTIONS {
        return next.run(req).await;
    }
    let headers = req.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let api_key = headers.get(API_KEY_HEADER).and_then(|v| v.to_str().ok());
    let keys = ring.current();
    let owner = [bearer, api_key]
        .into_iter()
        .flatten()
        .find_map(|k| keys.owner(k.trim()))
        .cloned();
    if let Some(owner) = owner {
        req.extensions_mut().insert(Tenant(owner.tenant));
        if owner.admin {
            req.extensions_mut().insert(AdminKey);
        }
        return next.run(req).await;
    }
    let path = req.uri().path();
    if path.starts_with(crate::anthropic::PATH_PREFIX) {
        return crate::anthropic::unauthorized();
    }
    if path.starts_with("/v1/") {
        return ApiError::unauthorized().into_response();
    }
    let body = ErrorBody {
        error: "missing or invalid API key: send Authorization: Bearer <key>".into(),
        error_type: "authentication",
    };
    (axum::http::StatusCode::UNAUTHORIZED, Json(body)).into_response()
}

//! `GET /`: the playground, a small chat page that talks to the router's own
//! `/v1/chat/completions` (streamed). Its HTML, stylesheet and script are compiled into the
//! router, so the page works offline; nothing on it loads from another host.

use axum::http::{header, HeaderValue};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// Where the page's stylesheet and script are served; `access` keeps this prefix open
/// like the page itself.
pub const ASSETS_PREFIX: &str = "/playground/";

const PAGE: &str = include_str!("playground/index.html");
const STYLESHEET: &str = include_str!("playground/playground.css");
const SCRIPT: &str = include_str!("playground/playground.js");

/// `GET /` and the page's two files. The page is open to anyone (it holds nothing
/// secret; the key it is given goes only to the API routes, which check it).
pub fn routes() -> Router {
    Router::new()
        .route("/", get(page))
        .route("/playground/playground.css", get(stylesheet))
        .route("/playground/playground.js", get(script))
}

async fn page() -> Html<&'static str> {
    Html(PAGE)
}

async fn stylesheet() -> Response {
    asset("text/css; charset=utf-8", STYLESHEET)
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

/// The files change only with the router's build: `no-cache` lets the browser keep them
/// but ask again, so an upgraded router never runs an old script.
fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::routing::post;
    use tower::ServiceExt;

    async fn call(app: &Router, request: Request<Body>) -> (StatusCode, String, String) {
        let response = app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (
            status,
            content_type,
            String::from_utf8(bytes.to_vec()).unwrap(),
        )
    }

    #[tokio::test]
    async fn the_page_and_its_files_are_served_and_reference_no_other_host() {
        let app = routes();
        for (path, kind) in [
            ("/", "text/html"),
            ("/playground/playground.css", "text/css"),
            ("/playground/playground.js", "text/javascript"),
        ] {
            let (status, content_type, body) =
                call(&app, Request::get(path).body(Body::empty()).unwrap()).await;
            assert_eq!(status, StatusCode::OK, "{path}");
            assert!(content_type.starts_with(kind), "{path}: {content_type}");
            assert!(!body.contains("http://"), "{path} names another host");
            assert!(!body.contains("https://"), "{path} names another host");
        }
        let (_, _, html) = call(&app, Request::get("/").body(Body::empty()).unwrap()).await;
        assert!(html.contains("/playground/playground.js"));
        assert!(html.contains("/playground/playground.css"));
        let (_, _, js) = call(
            &app,
            Request::get("/playground/playground.js")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
        assert!(
            js.contains("/v1/chat/completions"),
            "the page calls the chat route"
        );
    }

    /// TGI's `POST /` and the page's `GET /` share the path: merged, each method keeps
    /// its handler.
    #[tokio::test]
    async fn get_and_post_on_the_root_reach_their_own_handlers() {
        let app = Router::new()
            .route("/", post(|| async { "generated" }))
            .merge(routes());
        let (_, _, html) = call(&app, Request::get("/").body(Body::empty()).unwrap()).await;
        assert!(html.starts_with("<!doctype html>"));
        let (status, _, body) = call(&app, Request::post("/").body(Body::empty()).unwrap()).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, "generated");
    }

    /// With API keys, the page and its files are open; TGI's `POST /` still needs a key.
    #[tokio::test]
    async fn with_api_keys_the_page_is_open_and_post_on_the_root_is_not() {
        let app = Router::new()
            .route("/", post(|| async { "generated" }))
            .merge(routes());
        let access = crate::access::Access {
            api_keys: vec![crate::tenants::ApiKey::bare("sekret")],
            payload_limit: 1000,
            ..Default::default()
        };
        let app = crate::access::layers(app, access);
        for path in [
            "/",
            "/playground/playground.css",
            "/playground/playground.js",
        ] {
            let (status, _, _) = call(&app, Request::get(path).body(Body::empty()).unwrap()).await;
            assert_eq!(status, StatusCode::OK, "{path} is open");
        }
        let (status, _, _) = call(&app, Request::post("/").body(Body::empty()).unwrap()).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        let keyed = Request::post("/")
            .header(header::AUTHORIZATION, "Bearer sekret")
            .body(Body::empty())
            .unwrap();
        let (status, _, _) = call(&app, keyed).await;
        assert_eq!(status, StatusCode::OK);
    }
}

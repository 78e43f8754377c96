//! `/docs`: a browsable view of `/openapi.json` that loads nothing from outside the router,
//! so it works on a machine without network. With `--docs-assets DIR` (the Python side
//! finds Swagger UI's distribution in an installed package and passes its folder), the page
//! is Swagger UI, its script and stylesheet served from memory under `/docs/assets/`;
//! without it, a small built-in page (`docs_page.html`) lists the routes and can call them.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// Where the page finds Swagger UI's files; `access` keeps this prefix open like `/docs`.
pub const ASSETS_PREFIX: &str = "/docs/assets/";

/// The files of Swagger UI's distribution the page loads, with their content types.
const SWAGGER_UI_FILES: [(&str, &str); 2] = [
    ("swagger-ui-bundle.js", "text/javascript; charset=utf-8"),
    ("swagger-ui.css", "text/css; charset=utf-8"),
];

/// The assets do not change while the router runs; after a day the browser revalidates
/// with the ETag (an upgraded package then serves new bytes under the same name).
const ASSET_CACHE_CONTROL: &str = "public, max-age=86400";

/// Swagger UI over `/openapi.json`, from the router's own copy of its files. No validator:
/// Swagger UI would otherwise load a badge from its public validation service.
const SWAGGER_PAGE: &str = r##"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>cadence API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css"></head>
<body><div id="ui"><p>The OpenAPI document is at <a href="/openapi.json">/openapi.json</a>.</p></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui", validatorUrl: null});</script>
</body></html>
"##;

/// The page served when no Swagger UI folder was given: self-contained HTML and script.
const BUILTIN_PAGE: &str = include_str!("docs_page.html");

/// One file served under `/docs/assets/`.
struct Asset {
    body: Bytes,
    content_type: &'static str,
    etag: HeaderValue,
}

/// What `/docs` serves: Swagger UI with its files, or the built-in page.
#[derive(Clone, Default)]
pub struct Docs {
    /// Swagger UI's files by name; `None`: the built-in page.
    assets: Option<Arc<HashMap<&'static str, Asset>>>,
}

impl Docs {
    /// Swagger UI when `dir` is given (its files read once, now), else the built-in page.
    pub fn from_flag(dir: Option<&Path>) -> Result<Self, String> {
        match dir {
            Some(dir) => Self::swagger_ui(dir),
            None => Ok(Self::default()),
        }
    }

    /// Reads Swagger UI's files from `dir`; an error names the file that is missing.
    pub fn swagger_ui(dir: &Path) -> Result<Self, String> {
        let mut assets = HashMap::new();
        for (name, content_type) in SWAGGER_UI_FILES {
            let path = dir.join(name);
            let body = std::fs::read(&path).map_err(|e| {
                format!("--docs-assets {}: cannot read {name} ({e})", dir.display())
            })?;
            let asset = Asset {
                etag: etag(&body),
                body: Bytes::from(body),
                content_type,
            };
            assets.insert(name, asset);
        }
        Ok(Self {
            assets: Some(Arc::new(assets)),
        })
    }

    fn page(&self) -> &'static str {
        match self.assets {
            Some(_) => SWAGGER_PAGE,
            None => BUILTIN_PAGE,
        }
    }
}

/// A strong validator from the file's bytes (stable for one build of the router).
fn etag(body: &[u8]) -> HeaderValue {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    body.hash(&mut hasher);
    HeaderValue::from_str(&format!("\"{:016x}\"", hasher.finish())).expect("hex is a header")
}

/// `/docs` and `/docs/assets/{name}`.
pub fn routes(docs: Docs) -> Router {
    Router::new()
        .route("/docs", get(page))
        .route("/docs/assets/{name}", get(asset))
        .with_state(docs)
}

async fn page(State(docs): State<Docs>) -> Html<&'static str> {
    Html(docs.page())
}

async fn asset(
    State(docs): State<Docs>,
    UrlPath(name): UrlPath<String>,
    request: HeaderMap,
) -> Response {
    let Some(asset) = docs.assets.as_ref().and_then(|a| a.get(name.as_str())) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let cache = [
        (header::ETAG, asset.etag.clone()),
        (
            header::CACHE_CONTROL,
            HeaderValue::from_static(ASSET_CACHE_CONTROL),
        ),
    ];
    if request.get(header::IF_NONE_MATCH) == Some(&asset.etag) {
        return (StatusCode::NOT_MODIFIED, cache).into_response();
    }
    let content_type = [(
        header::CONTENT_TYPE,
        HeaderValue::from_static(asset.content_type),
    )];
    (content_type, cache, asset.body.clone()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get(app: &Router, path: &str, etag: Option<&HeaderValue>) -> Response {
        let mut request = Request::get(path);
        if let Some(etag) = etag {
            request = request.header(header::IF_NONE_MATCH, etag);
        }
        app.clone()
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap()
    }

    async fn text(response: Response) -> String {
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    /// Every `src="…"` and `href="…"` of an HTML page.
    fn references(html: &str) -> Vec<String> {
        let mut found = Vec::new();
        for attribute in ["src=\"", "href=\""] {
            for (at, _) in html.match_indices(attribute) {
                let rest = &html[at + attribute.len()..];
                found.push(rest[..rest.find('"').unwrap()].to_string());
            }
        }
        found
    }

    /// A folder holding files named like Swagger UI's, with `contents` as their text.
    fn assets_dir(test: &str, contents: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("cadence-docs-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, _) in SWAGGER_UI_FILES {
            std::fs::write(dir.join(name), format!("/* {name} */ {contents}")).unwrap();
        }
        dir
    }

    #[tokio::test]
    async fn the_pages_reference_no_url_off_the_router() {
        let dir = assets_dir("offline", "");
        for docs in [Docs::default(), Docs::swagger_ui(&dir).unwrap()] {
            let app = routes(docs);
            let response = get(&app, "/docs", None).await;
            assert_eq!(response.status(), StatusCode::OK);
            let html = text(response).await;
            assert!(!html.contains("http://"), "{html}");
            assert!(!html.contains("https://"), "{html}");
            assert!(
                html.contains("/openapi.json"),
                "the page loads the document"
            );
            for reference in references(&html) {
                let here = reference.starts_with('/') || reference.starts_with('#');
                assert!(here, "{reference} is not the router's");
            }
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn swagger_ui_files_are_served_with_their_type_and_cache_headers() {
        let dir = assets_dir("served", "body");
        let app = routes(Docs::swagger_ui(&dir).unwrap());
        let html = text(get(&app, "/docs", None).await).await;
        let assets: Vec<String> = references(&html)
            .into_iter()
            .filter(|r| r.starts_with(ASSETS_PREFIX))
            .collect();
        assert_eq!(assets.len(), SWAGGER_UI_FILES.len(), "{html}");
        for (name, content_type) in SWAGGER_UI_FILES {
            let path = format!("{ASSETS_PREFIX}{name}");
            assert!(assets.contains(&path), "{html}");
            let response = get(&app, &path, None).await;
            assert_eq!(response.status(), StatusCode::OK);
            let headers = response.headers().clone();
            assert_eq!(headers[header::CONTENT_TYPE], content_type);
            assert_eq!(headers[header::CACHE_CONTROL], ASSET_CACHE_CONTROL);
            let on_disk = std::fs::read_to_string(dir.join(name)).unwrap();
            assert_eq!(text(response).await, on_disk);
            // revalidation with the ETag answers 304 without the body
            let again = get(&app, &path, Some(&headers[header::ETAG])).await;
            assert_eq!(again.status(), StatusCode::NOT_MODIFIED);
            assert!(text(again).await.is_empty());
        }
        let missing = get(&app, "/docs/assets/swagger-ui.js", None).await;
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn the_page_and_its_files_need_no_api_key() {
        let dir = assets_dir("open", "");
        let access = crate::access::Access {
            api_keys: vec![crate::tenants::ApiKey::bare("sekret")],
            payload_limit: 1 << 20,
            ..Default::default()
        };
        let app = crate::access::layers(routes(Docs::swagger_ui(&dir).unwrap()), access);
        for path in [
            "/docs",
            "/docs/assets/swagger-ui-bundle.js",
            "/docs/assets/swagger-ui.css",
        ] {
            assert_eq!(
                get(&app, path, None).await.status(),
                StatusCode::OK,
                "{path}"
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn without_a_folder_no_asset_is_served_and_a_bad_folder_is_refused() {
        let app = routes(Docs::default());
        let response = get(&app, "/docs/assets/swagger-ui.css", None).await;
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        let dir = assets_dir("incomplete", "");
        std::fs::remove_file(dir.join("swagger-ui.css")).unwrap();
        let err = Docs::swagger_ui(&dir).err().unwrap();
        assert!(err.contains("swagger-ui.css"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}

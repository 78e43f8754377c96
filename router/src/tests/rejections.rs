//! Unknown routes, methods and models, answered in each API's shape as its own clients
//! expect; browser SDKs' CORS preflights; the count of every rejected request.

use super::*;

/// `--served-model-name chat-model,alias`, a chat template, API keys when `key` is set,
/// and the layers `lib.rs` puts around the routes.
fn served(key: Option<&str>, cors: crate::access::Access) -> (Harness, Router) {
    let h = setup(Script::Hash)
        .served_model_name("chat-model,alias")
        .chat_template_source(TOOL_TEMPLATE)
        .build();
    let access = crate::access::Access {
        api_keys: key.map(crate::tenants::ApiKey::bare).into_iter().collect(),
        payload_limit: 1 << 20,
        ..cors
    };
    let app = crate::access::layers(h.app.clone(), access);
    let app = crate::rejections::layers(app, h.infer.metrics().clone());
    (h, app)
}

async fn json_of(app: &Router, request: Request<Body>) -> (StatusCode, HeaderMap, Value) {
    let (status, headers, text) = send(app, request).await;
    let v = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text:?}"));
    (status, headers, v)
}

#[tokio::test]
async fn unknown_routes_and_methods_are_json_in_the_shape_of_the_paths_api() {
    let (_h, app) = served(None, Default::default());
    let (status, _, v) = json_of(&app, post_json("/v1/nope", &json!({}), None)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        v,
        json!({"error": {"message": "Invalid URL (POST /v1/nope)",
                         "type": "invalid_request_error", "param": null, "code": null}})
    );
    let (status, _, v) = json_of(&app, post_json("/v1/messages/nope", &json!({}), None)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "not_found_error");
    let (status, _, v) = json_of(&app, get("/nope")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error_type"], "not_found");
    assert_eq!(v["error"], "Not Found: no route GET /nope");
    // A served path asked with another method: 405, its Allow header kept.
    let (status, headers, v) = json_of(&app, get("/v1/chat/completions")).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(headers["allow"], "POST");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (status, _, v) = json_of(&app, get("/v1/messages")).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["type"], "error");
    let (status, _, v) = json_of(&app, get("/generate")).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(v["error_type"], "method_not_allowed");
}

#[tokio::test]
async fn openai_and_anthropic_routes_serve_only_the_served_names_and_tgi_any() {
    let (h, app) = served(None, Default::default());
    let (_, _, v) = json_of(&app, get("/v1/models")).await;
    let ids: Vec<&Value> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| &m["id"])
        .collect();
    assert_eq!(ids, [&json!("chat-model"), &json!("alias")]);
    let chat = |model: &str| {
        json!({"model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]})
    };
    // Every served name and the model id; the answer names the first served name.
    // And the placeholders TGI's clients send without a model name.
    for model in ["chat-model", "alias", "test-model", "tgi", "dummy"] {
        let (status, _, v) =
            json_of(&app, post_json("/v1/chat/completions", &chat(model), None)).await;
        assert_eq!(status, StatusCode::OK, "{model}: {v}");
        assert_eq!(v["model"], "chat-model");
    }
    let wrong = [
        ("/v1/chat/completions", chat("gpt-4o")),
        (
            "/v1/completions",
            json!({"model": "gpt-4o", "prompt": "hi", "max_tokens": 2}),
        ),
        ("/v1/responses", json!({"model": "gpt-4o", "input": "hi"})),
    ];
    for (path, body) in wrong {
        let (status, _, v) = json_of(&app, post_json(path, &body, None)).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(
            v["error"],
            json!({"message": "The model `gpt-4o` does not exist.", "type": "NotFoundError",
                   "param": "model", "code": 404}),
            "{path}"
        );
    }
    for path in ["/v1/messages", "/v1/messages/count_tokens"] {
        let (status, _, v) = json_of(&app, post_json(path, &chat("claude-x"), None)).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(
            v,
            json!({"type": "error", "error": {"type": "not_found_error",
                   "message": "The model `claude-x` does not exist."}})
        );
    }
    // No `model`: the served model, as before.
    let (status, _, v) = json_of(
        &app,
        post_json(
            "/v1/completions",
            &json!({"prompt": "hi", "max_tokens": 2}),
            None,
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // TGI's OpenAI-compatible root takes any name, as TGI does.
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 2}});
    let (status, _, v) = json_of(&app, post_json("/generate", &body, None)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    h.assert_protocol_ok();
}

/// A browser's preflight of a cross-origin POST with `headers`.
fn preflight(path: &str, headers: &str) -> Request<Body> {
    Request::options(path)
        .header("origin", "https://app.example")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", headers)
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn the_official_browser_sdks_preflights_pass_by_default_and_a_header_list_narrows_them() {
    // What openai-node and anthropic-sdk-typescript ask for from a browser.
    let openai = "authorization,content-type,x-stainless-arch,x-stainless-lang,\
        x-stainless-os,x-stainless-package-version,x-stainless-retry-count,\
        x-stainless-runtime,x-stainless-runtime-version,x-stainless-timeout";
    let anthropic = "anthropic-dangerous-direct-browser-access,anthropic-version,\
        content-type,x-api-key,x-stainless-lang,x-stainless-retry-count";
    let cors = crate::access::Access {
        cors_allow_origin: vec!["https://app.example".into()],
        ..Default::default()
    };
    let (_h, app) = served(Some("sekret"), cors.clone());
    for (path, asked) in [
        ("/v1/chat/completions", openai),
        ("/v1/messages", anthropic),
    ] {
        let (status, headers, _) = send(&app, preflight(path, asked)).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert_eq!(
            headers["access-control-allow-origin"],
            "https://app.example"
        );
        let allowed = headers["access-control-allow-headers"].to_str().unwrap();
        for header in asked.split(',') {
            assert!(allowed.contains(header), "{header} not in {allowed}");
        }
        let methods = headers["access-control-allow-methods"].to_str().unwrap();
        assert!(methods.contains("POST"), "{methods}");
    }
    let narrow = crate::access::Access {
        cors_allow_headers: vec!["content-type".into(), "authorization".into()],
        ..cors
    };
    let (_h, app) = served(Some("sekret"), narrow);
    let (_, headers, _) = send(&app, preflight("/v1/chat/completions", openai)).await;
    let allowed = headers["access-control-allow-headers"].to_str().unwrap();
    assert!(!allowed.contains("x-stainless"), "{allowed}");
    assert!(allowed.contains("authorization"), "{allowed}");
}

/// `cadence_http_requests_rejected_total`'s value for `labels` (0 when absent).
fn rejected(metrics: &str, labels: &str) -> u64 {
    let key = format!("cadence_http_requests_rejected_total{{model=\"chat-model\",{labels}}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |v| v.parse().unwrap())
}

#[tokio::test]
async fn every_rejected_request_is_counted_by_route_status_and_reason() {
    let (_h, app) = served(Some("sekret"), Default::default());
    let chat = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]});
    let requests = [
        post_json("/v1/chat/completions", &chat, None),
        post_json("/v1/chat/completions", &chat, Some("wrong")),
        post_json("/v1/chat/completions", &chat, Some("sekret")),
        post_json("/generate", &json!({"inputs": ""}), Some("sekret")),
        post_json("/v1/nope", &json!({}), Some("sekret")),
        get("/v1/nope"),
    ];
    for request in requests {
        let (status, _, _) = send(&app, request).await;
        assert!(status.is_client_error(), "{status}");
    }
    let (status, _, metrics) = send(&app, get("/metrics")).await;
    assert_eq!(status, StatusCode::OK);
    for (labels, n) in [
        (
            "route=\"/v1/chat/completions\",status=\"401\",reason=\"invalid_api_key\"",
            2,
        ),
        (
            "route=\"/v1/chat/completions\",status=\"404\",reason=\"NotFoundError\"",
            1,
        ),
        (
            "route=\"/generate\",status=\"422\",reason=\"validation\"",
            1,
        ),
        (
            "route=\"unmatched\",status=\"404\",reason=\"invalid_request_error\"",
            2,
        ),
    ] {
        assert_eq!(rejected(&metrics, labels), n, "{labels} in:\n{metrics}");
    }
    // Answers that are no rejection are not counted.
    assert!(!metrics.contains("status=\"200\""), "{metrics}");
}

#[tokio::test]
async fn openai_and_anthropic_errors_name_only_their_own_fields() {
    let (_h, app) = served(None, Default::default());
    let long = "hello ".repeat(60);
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "hi", "best_of": 2, "n": 1, "temperature": 0}),
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 0}),
            "max_tokens",
        ),
        ("/v1/completions", json!({"prompt": long}), "prompt"),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 1000}),
            "prompt",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_tokens": 1000})),
            "messages",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 99})),
            "top_logprobs",
        ),
        (
            "/v1/responses",
            json!({"input": "hi", "max_output_tokens": 1000}),
            "input",
        ),
        (
            "/v1/messages",
            chat(json!({"max_tokens": 1000})),
            "messages",
        ),
        (
            "/v1/messages",
            chat(json!({"max_tokens": 2, "stop_sequences": ["a", "b", "c"]})),
            "stop_sequences",
        ),
    ];
    for (path, body, field) in cases {
        let (status, _, v) = json_of(&app, post_json(path, &body, None)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(field), "{path}: {message}");
        for tgi in [
            "parameters",
            "max_new_tokens",
            "inputs",
            "truncate",
            "do_sample",
        ] {
            assert!(!message.contains(tgi), "{path}: {tgi} in {message}");
        }
    }
}

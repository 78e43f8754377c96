//! The request id: answered as `x-request-id` on every generation route and sent to the
//! shards with the request.

use super::*;
use crate::request_id;

fn with_request_id(mut request: Request<Body>, id: &str) -> Request<Body> {
    let value = axum::http::HeaderValue::from_str(id).unwrap();
    request.headers_mut().insert(request_id::HEADER, value);
    request
}

#[tokio::test]
async fn the_callers_request_id_is_answered_and_reaches_the_shard() {
    let h = harness(Script::Hash);
    let generate = json!({"inputs": "abc", "parameters": {"max_new_tokens": 2}});
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let routes = [
        ("/generate", generate.clone(), "tgi-1"),
        ("/generate_stream", generate.clone(), "tgi-stream-2"),
        ("/", generate, "compat-3"),
        (
            "/v1/completions",
            json!({"prompt": "abc", "max_tokens": 2}),
            "cmpl-4",
        ),
    ];
    for (path, body, id) in &routes {
        let request = with_request_id(post_json(path, body, None), id);
        let (status, headers, text) = send(&h.app, request).await;
        assert_eq!(status, StatusCode::OK, "{path}: {text}");
        assert_eq!(headers[request_id::HEADER], *id, "{path}");
    }
    let sent: Vec<&str> = routes.iter().map(|(_, _, id)| *id).collect();
    assert_eq!(h.shard.state.lock().unwrap().joined_request_ids, sent);
    // Chat needs a template: answered 400 here, with the id all the same.
    let request = with_request_id(post_json("/v1/chat/completions", &chat, None), "chat-5");
    let (status, headers, _) = send(&h.app, request).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(headers[request_id::HEADER], "chat-5");
}

#[tokio::test]
async fn a_request_without_a_usable_id_gets_a_new_one_on_the_shard_too() {
    let h = harness(Script::Hash);
    let body = json!({"inputs": "abc", "parameters": {"max_new_tokens": 2}});
    let request = with_request_id(post_json("/generate", &body, None), "two words");
    let (status, headers, _) = send(&h.app, request).await;
    assert_eq!(status, StatusCode::OK);
    let made = headers[request_id::HEADER].to_str().unwrap();
    assert!(uuid::Uuid::parse_str(made).is_ok(), "{made}");
    assert_eq!(h.shard.state.lock().unwrap().joined_request_ids, [made]);
    // Routes that run no generation answer without one.
    let (_, headers, _) = send(&h.app, get("/health")).await;
    assert!(!headers.contains_key(request_id::HEADER));
}

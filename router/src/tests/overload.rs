//! Overload: every route's 429 (and a draining router's 503) in its own error shape,
//! with Retry-After, counted; cancelled streams free their slot.

use super::*;

#[tokio::test]
async fn beyond_max_concurrent_requests_is_429_and_cancelled_streams_free_their_slot() {
    let h = setup(Script::Hash)
        .step_delay(Duration::from_millis(5))
        .max_concurrent(1)
        .build();
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 60}}).to_string();
    let req = Request::post("/generate_stream")
        .body(Body::from(body.clone()))
        .unwrap();
    let resp = h.app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let (status, v) = h.post("/generate", json!({"inputs": "hi"})).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(v["error_type"], "overloaded");
    // The client goes away: the request is cancelled and removed from the shard.
    drop(resp);
    let mut ok = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let s = h.shard_state();
        if s.removed.contains(&0) || s.requests.is_empty() {
            ok = true;
            break;
        }
    }
    assert!(ok, "the cancelled request should be dropped");
    let (status, v) = h
        .post(
            "/generate",
            json!({"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    h.assert_protocol_ok();
}

/// How every generating route must refuse a request: the status, then the error's type
/// in TGI's shape and in OpenAI's.
pub(super) struct Refusal {
    pub(super) status: StatusCode,
    pub(super) tgi_type: &'static str,
    pub(super) openai_type: &'static str,
}

const OVERLOADED: Refusal = Refusal {
    status: StatusCode::TOO_MANY_REQUESTS,
    tgi_type: "overloaded",
    openai_type: "rate_limit_exceeded",
};

pub(super) const SHUTTING_DOWN: Refusal = Refusal {
    status: StatusCode::SERVICE_UNAVAILABLE,
    tgi_type: "shutting_down",
    openai_type: "server_error",
};

/// Asks every generating route, streaming and not, `best_of` / `n` included, to generate
/// while the router is overloaded: each must answer 429 in its own error shape, saying
/// `why`, with `Retry-After`. Returns how many were asked.
async fn assert_every_route_overloaded(h: &Harness, why: &str) -> u64 {
    assert_every_route_refuses(h, OVERLOADED, why).await
}

/// Asks every generating route, streaming and not, `best_of` / `n` included, to
/// generate: each must refuse as `refusal` says in its own error shape, saying `why`,
/// with `Retry-After`. Returns how many were asked.
pub(super) async fn assert_every_route_refuses(h: &Harness, refusal: Refusal, why: &str) -> u64 {
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let requests = [
        ("/generate", json!({"inputs": "hi"})),
        (
            "/generate",
            json!({"inputs": "hi", "parameters": {"best_of": 2, "do_sample": true}}),
        ),
        ("/generate_stream", json!({"inputs": "hi"})),
        ("/", json!({"inputs": "hi"})),
        ("/", json!({"inputs": "hi", "stream": true})),
        ("/v1/completions", json!({"prompt": "hi"})),
        (
            "/v1/completions",
            json!({"prompt": ["hi", "ho"], "n": 2, "best_of": 3}),
        ),
        ("/v1/completions", json!({"prompt": "hi", "stream": true})),
        ("/v1/chat/completions", chat(json!({}))),
        (
            "/v1/chat/completions",
            chat(json!({"n": 2, "stream": true})),
        ),
    ];
    for (path, body) in &requests {
        let (status, headers, text) = h.send(post_json(path, body, None)).await;
        assert_eq!(status, refusal.status, "{path} {body}: {text}");
        assert_eq!(headers["retry-after"], "1", "{path} {body}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let message = if path.starts_with("/v1/") {
            assert_eq!(v["error"]["type"], refusal.openai_type, "{path}: {v}");
            &v["error"]["message"]
        } else {
            assert_eq!(v["error_type"], refusal.tgi_type, "{path}: {v}");
            &v["error"]
        };
        assert!(message.as_str().unwrap().contains(why), "{path}: {v}");
    }
    requests.len() as u64
}

/// The value of `cadence_requests_rejected_total`.
async fn rejected(h: &Harness) -> u64 {
    let (_, _, text) = h.get("/metrics").await;
    let key = "cadence_requests_rejected_total{model=\"test-model\"} ";
    let line = text.lines().find(|l| l.starts_with(key)).unwrap();
    line[key.len()..].parse().unwrap()
}

#[tokio::test]
async fn beyond_max_concurrent_requests_every_route_is_429_with_retry_after_and_counted() {
    let h = setup(Script::Hash)
        .chat_template()
        .max_concurrent(1)
        .paused()
        .build();
    // The one slot in flight, held as long as the shard is paused.
    let held = hold_stream(&h).await;
    assert_eq!(rejected(&h).await, 0);
    let asked = assert_every_route_overloaded(&h, "too many requests in flight").await;
    assert_eq!(rejected(&h).await, asked);
    h.resume();
    assert_eq!(stream_events(held).await.len(), 2);
    let (status, v) = h.post("/generate", json!({"inputs": "hi"})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(rejected(&h).await, asked);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn beyond_max_waiting_requests_every_route_is_429_with_retry_after_and_counted() {
    let h = setup(Script::Hash)
        .chat_template()
        .max_waiting(1)
        .paused()
        .build();
    // The first request leaves the queue at its first step, which the paused shard
    // holds; the loop waits for that step, so the second stays in the queue's one place.
    let running = hold_stream(&h).await;
    h.until_steps_held(1).await;
    let waiting = hold_stream(&h).await;
    let asked = assert_every_route_overloaded(&h, "the queue is full").await;
    assert_eq!(rejected(&h).await, asked);
    h.resume();
    assert_eq!(stream_events(running).await.len(), 2);
    assert_eq!(stream_events(waiting).await.len(), 2);
    let (status, v) = h.post("/generate", json!({"inputs": "hi"})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(rejected(&h).await, asked);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn streaming_refuses_best_of_on_the_tgi_routes_and_frees_the_slot() {
    let h = setup(Script::Hash).max_concurrent(1).build();
    let parameters = json!({"best_of": 2, "do_sample": true, "max_new_tokens": 2});
    for (path, body) in [
        (
            "/generate_stream",
            json!({"inputs": "hi", "parameters": parameters}),
        ),
        (
            "/",
            json!({"inputs": "hi", "parameters": parameters, "stream": true}),
        ),
    ] {
        let (status, v) = h.post(path, body).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{path}: {v}");
        assert_eq!(
            v["error"], "parameters.best_of > 1 is not supported when streaming",
            "{path}"
        );
    }
    let body = json!({"inputs": "hi", "parameters": parameters});
    let (status, v) = h.post("/generate", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(rejected(&h).await, 0);
    h.assert_protocol_ok();
}

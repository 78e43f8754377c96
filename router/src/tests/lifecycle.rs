//! What an orchestrator and a gateway see: `/health` (liveness), `/ready` (readiness:
//! the step clock and the shards' `Health` answer together), the drain on SIGTERM, the
//! served model name and the `vllm:` gauges.

use super::*;
use crate::drain::{self, Outcome};

/// Waits until `n` requests hold a permit (admitted, maybe not yet in the loop).
async fn until_in_flight(h: &Harness, n: usize) {
    while h.infer.in_flight() < n {
        tokio::task::yield_now().await;
    }
}

fn ok() -> (StatusCode, String) {
    (StatusCode::OK, String::new())
}

fn red(reason: &str) -> (StatusCode, String) {
    (StatusCode::SERVICE_UNAVAILABLE, reason.into())
}

/// Starts a chat completion stream of two tokens; its response, the body unread.
async fn hold_chat_stream(h: &Harness) -> axum::response::Response {
    let body = json!({"messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2, "stream": true});
    let response = h
        .app
        .clone()
        .oneshot(post_json("/v1/chat/completions", &body, None))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    response
}

/// What a drain finds on a paused shard: a TGI stream, a chat stream and a whole
/// `/generate`, all admitted.
async fn three_in_flight(
    h: &Harness,
) -> (
    axum::response::Response,
    axum::response::Response,
    tokio::task::JoinHandle<(StatusCode, HeaderMap, String)>,
) {
    let tgi_stream = hold_stream(h).await;
    let chat_stream = hold_chat_stream(h).await;
    let app = h.app.clone();
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 3}});
    let whole = tokio::spawn(async move { send(&app, post_json("/generate", &body, None)).await });
    until_in_flight(h, 3).await;
    (tgi_stream, chat_stream, whole)
}

#[tokio::test]
async fn health_answers_whatever_the_shards_and_the_steps_do() {
    let h = setup(Script::Hash).paused().build();
    let held = hold_stream(&h).await;
    h.until_steps_held(1).await;
    for health in [FakeHealth::Silent, FakeHealth::Fails, FakeHealth::NotReady] {
        h.set_health(health);
        let (status, _, text) = h.get("/health").await;
        assert_eq!(
            (status, text.as_str()),
            (StatusCode::OK, "{}"),
            "{health:?}"
        );
    }
    h.set_health(FakeHealth::Ready);
    h.resume();
    assert_eq!(stream_events(held).await.len(), 2);
}

#[tokio::test]
async fn ready_is_red_while_idle_when_a_shard_fails_is_cold_or_is_silent() {
    let h = harness(Script::Hash);
    assert_eq!(h.ready().await, ok());
    for (health, reason) in [
        (FakeHealth::NotReady, "warming_up"),
        (FakeHealth::Fails, "shard_error"),
        (FakeHealth::Silent, "shard_silent"),
    ] {
        h.set_health(health);
        assert_eq!(h.ready().await, red(reason), "{health:?}");
    }
    h.set_health(FakeHealth::Fails);
    let (_, headers, text) = h.get("/ready").await;
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error_type"], "not_ready");
    assert!(
        v["error"].as_str().unwrap().contains("connection refused"),
        "{v}"
    );
    assert_eq!(headers["retry-after"], "1");
    h.set_health(FakeHealth::Ready);
    assert_eq!(h.ready().await, ok());
}

#[tokio::test]
async fn ready_is_red_when_a_step_is_overdue_and_the_shard_silent_green_when_it_answers() {
    // Every step in flight is overdue at once.
    let h = setup(Script::Hash)
        .paused()
        .stall_timeout(Duration::ZERO)
        .build();
    let held = hold_stream(&h).await;
    h.until_steps_held(1).await;
    // A long step on a shard that answers Health: busy, not stuck.
    assert_eq!(h.ready().await, ok());
    // The same step on a shard that does not answer: stuck.
    h.set_health(FakeHealth::Silent);
    assert_eq!(h.ready().await, red("stalled"));
    let (status, _, _) = h.get("/health").await;
    assert_eq!(status, StatusCode::OK);
    h.set_health(FakeHealth::Ready);
    assert_eq!(h.ready().await, ok());
    h.resume();
    assert_eq!(stream_events(held).await.len(), 2);
    assert_eq!(h.ready().await, ok());
    h.assert_protocol_ok();
}

#[tokio::test]
async fn ready_is_red_when_the_shard_answers_but_its_forward_stopped_beating() {
    let stall = Duration::from_millis(50);
    let h = setup(Script::Hash).paused().stall_timeout(stall).build();
    let held = hold_stream(&h).await;
    h.until_steps_held(1).await;
    tokio::time::sleep(stall * 2).await; // the step in flight is overdue
                                         // Heartbeats moving: a long forward, busy.
    assert_eq!(h.ready().await, ok());
    assert_eq!(h.ready().await, ok());
    // Standing still: green until they have stood still past the stall timeout.
    h.set_health(FakeHealth::Wedged);
    assert_eq!(h.ready().await, ok(), "they moved since the last check");
    tokio::time::sleep(stall * 2).await;
    assert_eq!(h.ready().await, red("wedged"));
    let (status, _, _) = h.get("/health").await;
    assert_eq!(status, StatusCode::OK);
    // No step in flight: still heartbeats are an idle shard, not a wedged one.
    h.set_health(FakeHealth::Ready);
    h.resume();
    assert_eq!(stream_events(held).await.len(), 2);
    h.set_health(FakeHealth::Wedged);
    tokio::time::sleep(stall * 2).await;
    assert_eq!(h.ready().await, ok());
}

#[tokio::test]
async fn a_silent_shard_is_excused_while_the_step_in_flight_is_recent() {
    let h = setup(Script::Hash)
        .paused()
        .stall_timeout(Duration::from_secs(3600))
        .build();
    let held = hold_stream(&h).await;
    h.until_steps_held(1).await;
    h.set_health(FakeHealth::Silent);
    assert_eq!(h.ready().await, ok());
    h.set_health(FakeHealth::Ready);
    h.resume();
    assert_eq!(stream_events(held).await.len(), 2);
}

#[tokio::test]
async fn draining_refuses_new_requests_everywhere_while_those_in_flight_finish() {
    let h = setup(Script::Hash).chat_template().paused().build();
    let (tgi_stream, chat_stream, whole) = three_in_flight(&h).await;
    let infer = h.infer.clone();
    let drained =
        tokio::spawn(async move { drain::drain(&infer, Duration::from_secs(3600)).await });
    while !h.infer.drain().is_draining() {
        tokio::task::yield_now().await;
    }
    assert_eq!(h.ready().await, red("draining"));
    let (status, _, _) = h.get("/health").await;
    assert_eq!(status, StatusCode::OK, "alive while draining");
    assert_every_route_refuses(&h, SHUTTING_DOWN, "shutting down").await;
    assert_eq!(h.infer.in_flight(), 3, "the refused took no slot");

    h.resume();
    let events = stream_events(tgi_stream).await;
    assert_eq!(events.len(), 2);
    let last: Value = serde_json::from_str(&events[1]).unwrap();
    assert!(last["generated_text"].is_string(), "a whole stream: {last}");
    let events = stream_events(chat_stream).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert!(events.iter().all(|e| !e.contains("error")), "{events:?}");
    let (status, _, text) = whole.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(drained.await.unwrap(), Outcome::Drained);
    // Still refusing once drained, until the router exits.
    let (status, v) = h.post("/generate", json!({"inputs": "hi"})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn a_drain_past_its_timeout_cuts_what_is_left_with_an_error() {
    let h = setup(Script::Hash).chat_template().paused().build();
    let (tgi_stream, chat_stream, whole) = three_in_flight(&h).await;
    // The paused shard never answers: the timeout comes first.
    let outcome = drain::drain(&h.infer, Duration::from_millis(10)).await;
    assert_eq!(outcome, Outcome::Cut);
    let events = stream_events(tgi_stream).await;
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error_type"], "shutting_down", "{events:?}");
    let events = stream_events(chat_stream).await;
    let error = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find(|e| e.get("error").is_some())
        .unwrap_or_else(|| panic!("no error event in {events:?}"));
    assert_eq!(error["error"]["type"], "server_error", "{error}");
    let (status, headers, text) = whole.await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    assert_eq!(headers["retry-after"], "1");
    assert!(text.contains("--shutdown-timeout"), "{text}");
    until_in_flight_is_zero(&h).await;
}

/// Waits until every request has released its permit.
async fn until_in_flight_is_zero(h: &Harness) {
    while h.infer.in_flight() > 0 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn the_served_model_name_is_what_openai_clients_and_metrics_see() {
    let h = setup(Script::Hash).served_model_name("chat-model").build();
    let (status, _, text) = h.get("/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["data"][0]["id"], "chat-model");
    let (status, v) = h
        .post("/v1/completions", json!({"prompt": "hi", "max_tokens": 2}))
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["model"], "chat-model");
    let (_, _, text) = h.get("/info").await;
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (&v["model_id"], &v["served_model_name"]),
        (&json!("test-model"), &json!("chat-model"))
    );
    let (_, _, text) = h.get("/metrics").await;
    assert!(text.contains("cadence_requests_succeeded_total{model=\"chat-model\"} 1\n"));
    assert!(text.contains("vllm:num_requests_waiting{model_name=\"chat-model\"} 0\n"));
}

//! API keys' tenants: each request's tokens counted to the tenant of the key it presented,
//! and `--max-concurrent-requests-per-key` refusing a tenant's extra request while
//! another tenant is admitted.

use super::*;
use crate::access::{self, Access};
use crate::tenants::{fingerprint, ApiKey, Tenants};

fn keys() -> Vec<ApiKey> {
    vec![
        ApiKey::from_line("key-a team-a").unwrap(),
        ApiKey::from_line("key-a2 team-a").unwrap(),
        ApiKey::from_line("key-b team-b").unwrap(),
        ApiKey::bare("key-c"),
    ]
}

/// The app behind the key check, its harness's shard paused or delayed as set up.
fn app_with_keys(setup: Setup, per_key: Option<usize>) -> (Harness, Router) {
    let mut setup = setup;
    setup.tenants = Some(Arc::new(Tenants::new(&keys(), per_key, 0)));
    let h = setup.build();
    let access = Access {
        api_keys: keys(),
        payload_limit: 1 << 20,
        ..Default::default()
    };
    let app = access::layers(h.app.clone(), access);
    (h, app)
}

/// `name{model="test-model",tenant="tenant"}`'s value in the metrics text.
fn tenant_value(text: &str, name: &str, tenant: &str) -> f64 {
    let series = format!("{name}{{model=\"test-model\",tenant=\"{tenant}\"}} ");
    let line = text
        .lines()
        .find(|l| l.starts_with(&series))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"));
    line[series.len()..].parse().unwrap()
}

#[tokio::test]
async fn tokens_are_counted_to_the_tenant_of_the_key_and_two_keys_share_one_account() {
    let (h, app) = app_with_keys(setup(Script::Hash), None);
    let generate = json!({"inputs": "hello world", "parameters": {"max_new_tokens": 3}});
    for key in ["key-a", "key-a2"] {
        let (status, _, text) = send(&app, post_json("/generate", &generate, Some(key))).await;
        assert_eq!(status, StatusCode::OK, "{text}");
    }
    let completions = json!({"prompt": "hi", "max_tokens": 4, "n": 2});
    let (status, _, text) = send(
        &app,
        post_json("/v1/completions", &completions, Some("key-c")),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let usage: Value = serde_json::from_str::<Value>(&text).unwrap()["usage"].clone();
    let (_, text) = h.get_text("/metrics").await;
    let a = "team-a";
    assert_eq!(tenant_value(&text, "cadence_tenant_requests_total", a), 2.0);
    let prompt = 2 * prompt_tokens("hello world");
    assert_eq!(
        tenant_value(&text, "cadence_tenant_prompt_tokens_total", a),
        prompt as f64
    );
    assert_eq!(
        tenant_value(&text, "cadence_tenant_generation_tokens_total", a),
        6.0
    );
    let c = fingerprint("key-c");
    assert_eq!(
        tenant_value(&text, "cadence_tenant_generation_tokens_total", &c),
        usage["completion_tokens"].as_f64().unwrap()
    );
    assert_eq!(
        tenant_value(&text, "cadence_tenant_prompt_tokens_total", &c),
        usage["prompt_tokens"].as_f64().unwrap(),
        "the prompt once for its two samples, as the usage reports it"
    );
    assert_eq!(
        tenant_value(&text, "cadence_tenant_requests_total", "team-b"),
        0.0
    );
    assert_eq!(
        tenant_value(&text, "cadence_tenant_running_requests", a),
        0.0
    );
    for key in ["key-a", "key-a2", "key-b", "key-c"] {
        assert!(
            !text.contains(&format!("\"{key}\"")),
            "{key} shown:\n{text}"
        );
    }
    h.assert_protocol_ok();
}

#[tokio::test]
async fn a_tenant_at_its_limit_gets_429_and_another_tenant_is_admitted() {
    let (h, app) = app_with_keys(setup(Script::Hash).paused(), Some(1));
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 2}});
    let first = tokio::spawn({
        let app = app.clone();
        let body = body.clone();
        async move { send(&app, post_json("/generate", &body, Some("key-a"))).await }
    });
    while h.infer.in_flight() < 1 {
        tokio::task::yield_now().await;
    }
    // The same tenant under its other key: refused, and no global place taken.
    let (status, headers, text) = send(&app, post_json("/generate", &body, Some("key-a2"))).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{text}");
    assert_eq!(headers["retry-after"], "1");
    assert!(text.contains("--max-concurrent-requests-per-key"), "{text}");
    assert_eq!(h.infer.in_flight(), 1);
    let second = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_json("/generate", &body, Some("key-b"))).await }
    });
    while h.infer.in_flight() < 2 {
        tokio::task::yield_now().await;
    }
    let (_, text) = h.get_text("/metrics").await;
    assert_eq!(
        tenant_value(&text, "cadence_tenant_running_requests", "team-a"),
        1.0
    );
    assert_eq!(
        tenant_value(&text, "cadence_tenant_running_requests", "team-b"),
        1.0
    );
    assert_eq!(
        tenant_value(&text, "cadence_tenant_requests_rejected_total", "team-a"),
        1.0
    );
    h.resume();
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
    assert_eq!(second.await.unwrap().0, StatusCode::OK);
    let (_, text) = h.get_text("/metrics").await;
    assert_eq!(
        tenant_value(&text, "cadence_tenant_running_requests", "team-a"),
        0.0
    );
    let (status, _, _) = send(
        &app,
        post_json("/generate", &json!({"inputs": "hi"}), Some("key-a2")),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the tenant's request ended: admitted again"
    );
    h.assert_protocol_ok();
}

/// A client that sends its next request as soon as it has read the previous one's end
/// (as `cadence bench --max-concurrency 1` does) is admitted under a limit of one: the
/// request gives its places back before its last event goes out, not after, so the
/// next request cannot race the loop retiring it. Two worker threads let the handler
/// read the end while the loop is still between sending it and retiring the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_sent_on_reading_the_previous_ones_end_is_admitted_under_a_limit_of_one() {
    let (h, app) = app_with_keys(setup(Script::Hash), Some(1));
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 1}});
    for (i, path) in ["/generate", "/generate_stream"]
        .repeat(150)
        .iter()
        .enumerate()
    {
        let (status, _, text) = send(&app, post_json(path, &body, Some("key-a"))).await;
        assert_eq!(status, StatusCode::OK, "request {i} to {path}: {text}");
    }
    h.assert_protocol_ok();
}

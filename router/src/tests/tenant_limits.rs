//! Tenants, part two: tokens per minute per tenant (429 with the seconds to wait, other
//! tenants untouched), `GET /v1/usage` (a tenant's own account, an admin key's view of
//! all, the same numbers as `/metrics`) and a key file reloaded while serving.

use super::*;
use crate::access::{self, Access};
use crate::tenants::reload::KeyFile;
use crate::tenants::{ApiKey, KeyRing, Tenants};

const KEY_FILE: &str = "\
key-a team-a tokens_per_minute=20
key-b team-b
key-admin ops role=admin
";

fn key_file_keys(text: &str) -> Vec<ApiKey> {
    crate::tenants::keys::parse_key_file(text).unwrap()
}

/// The app behind a key ring holding `text`'s keys; the tenants and the ring returned
/// so a test can reload them.
fn app_with_key_file(text: &str) -> (Harness, Router, Arc<Tenants>, KeyRing) {
    let keys = key_file_keys(text);
    let tenants = Arc::new(Tenants::new(&keys, None, 0));
    let mut setup = setup(Script::Hash).chat_template();
    setup.tenants = Some(tenants.clone());
    let h = setup.build();
    let ring = KeyRing::new(&keys);
    let access = Access {
        key_ring: Some(ring.clone()),
        payload_limit: 1 << 20,
        ..Default::default()
    };
    let app = access::layers(h.app.clone(), access);
    (h, app, tenants, ring)
}

fn get_with_key(path: &str, key: &str) -> Request<Body> {
    Request::get(path)
        .header("authorization", format!("Bearer {key}"))
        .body(Body::empty())
        .unwrap()
}

async fn usage_of(app: &Router, key: &str) -> Value {
    let (status, _, text) = send(app, get_with_key("/v1/usage", key)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    serde_json::from_str(&text).unwrap()
}

#[tokio::test]
async fn a_tenant_past_its_tokens_per_minute_gets_429_with_the_wait_in_every_api_shape() {
    let (h, app, _, _) = app_with_key_file(KEY_FILE);
    // 20 tokens a minute: one request of ~30 prompt and generated tokens, then owed.
    let body = json!({"inputs": "hello world ".repeat(4), "parameters": {"max_new_tokens": 20}});
    let (status, _, text) = send(&app, post_json("/generate", &body, Some("key-a"))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let refused = [
        ("/generate", json!({"inputs": "hi"})),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 2})),
        (
            "/v1/messages",
            json!({"model": "test-model", "max_tokens": 2,
                   "messages": [{"role": "user", "content": "hi"}]}),
        ),
    ];
    for (path, body) in refused {
        let (status, headers, text) = send(&app, post_json(path, &body, Some("key-a"))).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{path}: {text}");
        let wait: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
        assert!(
            wait > 1,
            "{path}: the bucket's wait, not the default second: {wait}"
        );
        assert!(text.contains("20 tokens per minute"), "{path}: {text}");
    }
    // Another tenant is not limited by team-a's bucket.
    let (status, _, text) = send(&app, post_json("/generate", &body, Some("key-b"))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let a = &usage_of(&app, "key-a").await["data"][0];
    assert_eq!(
        (a["requests"].as_u64(), a["rejected_requests"].as_u64()),
        (Some(1), Some(3))
    );
    assert_eq!(a["tokens_per_minute"], 20);
    assert!(a["tokens_available"].as_i64().unwrap() <= 0, "{a}");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn usage_shows_a_tenant_its_own_account_and_an_admin_every_one_as_metrics_counts() {
    let (h, app, _, _) = app_with_key_file(KEY_FILE);
    let body = json!({"prompt": "hi there", "max_tokens": 5});
    let (status, _, text) = send(&app, post_json("/v1/completions", &body, Some("key-b"))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    let own = usage_of(&app, "key-b").await;
    let data = own["data"].as_array().unwrap();
    assert_eq!(data.len(), 1, "only its own tenant: {own}");
    let b = &data[0];
    assert_eq!(b["tenant"], "team-b");
    assert_eq!(b["prompt_tokens"], answer["usage"]["prompt_tokens"]);
    assert_eq!(b["generation_tokens"], answer["usage"]["completion_tokens"]);
    assert_eq!(b["total_tokens"], answer["usage"]["total_tokens"]);
    assert_eq!(
        (b["requests"].as_u64(), b["running_requests"].as_u64()),
        (Some(1), Some(0))
    );
    assert!(b["tokens_per_minute"].is_null(), "no limit: {b}");
    let all = usage_of(&app, "key-admin").await;
    let names: Vec<&str> = all["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tenant"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["ops", "team-a", "team-b"]);
    let (_, metrics) = h.get_text("/metrics").await;
    for t in all["data"].as_array().unwrap() {
        let tenant = t["tenant"].as_str().unwrap();
        for (field, series) in [
            ("requests", "cadence_tenant_requests_total"),
            ("prompt_tokens", "cadence_tenant_prompt_tokens_total"),
            (
                "generation_tokens",
                "cadence_tenant_generation_tokens_total",
            ),
        ] {
            let line = metrics
                .lines()
                .find(|l| l.starts_with(series) && l.contains(&format!("tenant=\"{tenant}\"")))
                .unwrap_or_else(|| panic!("{series} of {tenant} in\n{metrics}"));
            let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
            assert_eq!(value, t[field].as_f64().unwrap(), "{tenant} {field}");
        }
    }
    let (status, _, _) = send(&app, get("/v1/usage")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "usage needs a key");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn without_keys_usage_is_a_404_that_says_why() {
    let h = setup(Script::Hash).build();
    let (status, text) = h.get_text("/v1/usage").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{text}");
    assert!(text.contains("--api-key-file"), "{text}");
}

#[tokio::test]
async fn a_reloaded_key_file_refuses_a_removed_key_at_once_and_admits_a_new_one() {
    let (h, app, tenants, ring) = app_with_key_file(KEY_FILE);
    let path = std::env::temp_dir().join(format!("cadence-keys-{}", uuid::Uuid::new_v4()));
    std::fs::write(&path, "key-a team-a\nkey-c team-c tokens_per_minute=100\n").unwrap();
    let file = KeyFile {
        path: path.clone(),
        fixed: vec![],
        ring,
        tenants,
    };
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 2}});
    let (status, _, _) = send(&app, post_json("/generate", &body, Some("key-b"))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(file.reload().unwrap(), 2);
    let (status, _, _) = send(&app, post_json("/generate", &body, Some("key-b"))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "a removed key");
    let (status, _, text) = send(&app, post_json("/generate", &body, Some("key-c"))).await;
    assert_eq!(status, StatusCode::OK, "a new key: {text}");
    let c = &usage_of(&app, "key-c").await["data"][0];
    assert_eq!(
        (c["tenant"].as_str(), c["tokens_per_minute"].as_u64()),
        (Some("team-c"), Some(100))
    );
    let a = &usage_of(&app, "key-a").await["data"][0];
    assert!(
        a["tokens_per_minute"].is_null(),
        "team-a's limit is gone with its option"
    );
    std::fs::write(&path, "key-a team-a bogus\n").unwrap();
    assert!(file.reload().unwrap_err().contains("line 1"));
    let (status, _, _) = send(&app, post_json("/generate", &body, Some("key-c"))).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "a bad file leaves the keys in force"
    );
    std::fs::remove_file(&path).unwrap();
    h.assert_protocol_ok();
}

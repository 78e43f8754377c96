//! Invalid requests: each parameter refused with a 422 naming it, and requests that
//! could never fit the KV cache.

use super::*;

#[tokio::test]
async fn each_invalid_parameter_is_a_422_naming_the_field_on_both_routes() {
    let h = harness(Script::Hash);
    let p = |params: Value| json!({"inputs": "hello", "parameters": params});
    let cases = [
        (json!({"inputs": ""}), "inputs"),
        (json!({"parameters": {}}), "inputs"),
        (
            p(json!({"max_new_tokens": "ten"})),
            "parameters.max_new_tokens",
        ),
        (
            p(json!({"max_new_tokens": -1})),
            "parameters.max_new_tokens",
        ),
        (p(json!({"max_new_tokens": 0})), "max_new_tokens"),
        (p(json!({"temprature": 0.5})), "temprature"),
        (json!({"inputs": "a", "prameters": {}}), "prameters"),
        (p(json!({"temperature": 0.0})), "temperature"),
        (p(json!({"temperature": -1.0})), "temperature"),
        (p(json!({"top_p": 0.0})), "top_p"),
        (p(json!({"top_p": 1.5})), "top_p"),
        (p(json!({"top_k": 0})), "top_k"),
        (p(json!({"typical_p": 0.0})), "typical_p"),
        (p(json!({"min_p": 1.0})), "min_p"),
        (p(json!({"repetition_penalty": 0.0})), "repetition_penalty"),
        (p(json!({"frequency_penalty": 3.0})), "frequency_penalty"),
        (p(json!({"stop": ["a", "b", "c"]})), "stop"),
        (p(json!({"stop": [""]})), "stop"),
        (p(json!({"best_of": 2})), "best_of"), // greedy
        (p(json!({"best_of": 0})), "best_of"),
        (p(json!({"best_of": 5, "do_sample": true})), "max_best_of"),
        (p(json!({"top_n_tokens": 6})), "max_top_n_tokens"),
        (p(json!({"watermark": true})), "watermark"),
        (
            p(json!({"grammar": {"type": "yaml", "value": {}}})),
            "parameters.grammar.type",
        ),
        (
            p(json!({"grammar": {"type": "json"}})),
            "parameters.grammar.value",
        ),
        (
            p(json!({"grammar": {"type": "json", "value": {"type": "nope"}}})),
            "parameters.grammar",
        ),
        (
            p(json!({"grammar": {"type": "regex", "value": "(unclosed"}})),
            "parameters.grammar",
        ),
        (p(json!({"adapter_id": "lora-x"})), "adapter_id"),
        (p(json!({"top_n_tokens": 50})), "top_n_tokens"),
        (p(json!({"truncate": 0})), "truncate"),
        (p(json!({"priority": 1.5})), "parameters.priority"),
        // 60 input tokens > max_input_tokens (48).
        (json!({"inputs": "x".repeat(60)}), "inputs"),
        // 41 input tokens + 30 new > max_total_tokens (64).
        (
            json!({"inputs": "x".repeat(40), "parameters": {"max_new_tokens": 30}}),
            "max_new_tokens",
        ),
    ];
    for (body, needle) in cases {
        expect_422(&h, body, needle).await;
    }
    // Malformed JSON.
    let (status, text) = h
        .post_raw("/generate", "{\"inputs\": ", Some("application/json"))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error_type"], "validation");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn requests_that_could_never_fit_in_the_kv_cache_are_rejected() {
    // 8 blocks of 4 = 32 tokens of KV.
    let h = setup(Script::Hash).blocks(8).build();
    let body = json!({"inputs": "x".repeat(20), "parameters": {"max_new_tokens": 20}});
    let (status, v) = h.post("/generate", body).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(v["error"].as_str().unwrap().contains("KV blocks"), "{v}");
    let body = json!({"inputs": "x".repeat(40), "parameters": {"max_new_tokens": 1}});
    let (status, v) = h.post("/generate", body).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(v["error"].as_str().unwrap().starts_with("inputs"), "{v}");
}

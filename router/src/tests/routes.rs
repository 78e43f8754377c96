//! The routes around generation: /info and /health, API keys and the payload limit,
//! /tokenize and the OpenAPI document, /metrics.

use super::*;

#[tokio::test]
async fn info_and_health_answer() {
    let h = harness(Script::Hash);
    let (status, _, text) = h.get("/info").await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["router"], "cadence");
    assert_eq!(v["max_total_tokens"], 64);
    assert_eq!(v["served_model_name"], "test-model");
    let (status, _, text) = h.get("/health").await;
    assert_eq!((status, text.as_str()), (StatusCode::OK, "{}"));
    let (status, _, text) = h.get("/ready").await;
    assert_eq!(
        (status, text.as_str()),
        (StatusCode::OK, r#"{"status":"ready"}"#)
    );
}

#[tokio::test]
async fn api_keys_guard_every_route_but_the_open_ones_and_payload_limit_is_a_422() {
    let h = harness(Script::Hash);
    let access = crate::access::Access {
        api_keys: vec![crate::tenants::ApiKey::bare("sekret")],
        cors_allow_origin: vec!["https://example.com".into()],
        payload_limit: 200,
        ..Default::default()
    };
    let app = crate::access::layers(h.app.clone(), access);
    let body = json!({"inputs": "hello", "parameters": {"max_new_tokens": 2}});
    let (status, _, text) = send(&app, post_json("/generate", &body, None)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{text}");
    let (status, _, _) = send(&app, post_json("/generate", &body, Some("wrong"))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, text) = send(
        &app,
        post_json("/v1/completions", &json!({"prompt": "a"}), None),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(text.contains("invalid_api_key"), "{text}");
    let (status, _, _) = send(&app, post_json("/generate", &body, Some("sekret"))).await;
    assert_eq!(status, StatusCode::OK);
    for probe in ["/health", "/ready"] {
        let (status, _, _) = send(&app, get(probe)).await;
        assert_eq!(status, StatusCode::OK, "{probe} is open");
    }
    let (status, _, _) = send(&app, get("/openapi.json")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = send(&app, get("/v1/models")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // CORS: the allowed origin is echoed.
    let request = Request::get("/health")
        .header("origin", "https://example.com")
        .body(Body::empty())
        .unwrap();
    let (_, headers, _) = send(&app, request).await;
    assert_eq!(
        headers["access-control-allow-origin"],
        "https://example.com"
    );
    // Over the payload limit: 422 naming it, on both API shapes.
    let big = json!({"inputs": "x".repeat(300)});
    let (status, _, text) = send(&app, post_json("/generate", &big, Some("sekret"))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{text}");
    assert!(text.contains("payload_limit"), "{text}");
    let big = json!({"prompt": "x".repeat(300)});
    let (status, _, text) = send(&app, post_json("/v1/completions", &big, Some("sekret"))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("\"param\":\"payload_limit\""), "{text}");
}

#[tokio::test]
async fn tokenize_returns_ids_with_character_offsets_and_the_openapi_document_lists_routes() {
    let h = harness(Script::Hash);
    let (status, _, text) = h
        .send(post_json("/tokenize", &json!({"inputs": "héllo"}), None))
        .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let tokens: Vec<Value> = serde_json::from_str(&text).unwrap();
    let expected = testing::tokenizer().encode("héllo").unwrap();
    assert_eq!(
        tokens
            .iter()
            .map(|t| t["id"].as_u64().unwrap() as u32)
            .collect::<Vec<_>>(),
        expected
    );
    let last = tokens.last().unwrap();
    assert_eq!(last["stop"], 5, "offsets count characters, not bytes");
    let (status, _, text) = h.get("/openapi.json").await;
    assert_eq!(status, StatusCode::OK);
    let doc: Value = serde_json::from_str(&text).unwrap();
    for path in [
        "/generate",
        "/generate_stream",
        "/",
        "/tokenize",
        "/info",
        "/health",
        "/ready",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/responses",
        "/v1/responses/{id}",
        "/v1/messages",
        "/v1/messages/count_tokens",
    ] {
        assert!(doc["paths"].get(path).is_some(), "{path}");
    }
}

#[tokio::test]
async fn metrics_count_tokens_requests_and_blocks() {
    let h = setup(Script::Hash)
        .step_delay(Duration::from_millis(5))
        .build();
    let (status, _) = h
        .post(
            "/generate",
            json!({"inputs": "hello", "parameters": {"max_new_tokens": 5}}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, text) = h.get("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert!(text.contains("cadence_generation_tokens_total{model=\"test-model\"} 5\n"));
    assert!(text.contains("cadence_requests_succeeded_total{model=\"test-model\"} 1\n"));
    assert!(text.contains("cadence_kv_blocks_used{model=\"test-model\"} 0\n"));
    assert!(text.contains("cadence_e2e_request_latency_seconds_count{model=\"test-model\"} 1\n"));
    // The gateways' gauges, under vLLM's names, with the cache's shape.
    assert!(text.contains("vllm:num_requests_running{model_name=\"test-model\"} 0\n"));
    assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"test-model\"} 0\n"));
    assert!(text.contains(
        "vllm:cache_config_info{model_name=\"test-model\",block_size=\"4\",num_gpu_blocks=\"64\"} 1\n"
    ));
    // vLLM's request-level series count the same request: 5 tokens, 4 gaps between them,
    // finished by its length.
    for line in [
        "vllm:generation_tokens_total{model_name=\"test-model\"} 5\n",
        "vllm:request_success_total{model_name=\"test-model\",finished_reason=\"length\"} 1\n",
        "vllm:request_success_total{model_name=\"test-model\",finished_reason=\"stop\"} 0\n",
        "vllm:e2e_request_latency_seconds_count{model_name=\"test-model\"} 1\n",
        "vllm:time_to_first_token_seconds_count{model_name=\"test-model\"} 1\n",
        "vllm:inter_token_latency_seconds_count{model_name=\"test-model\"} 4\n",
        "vllm:request_generation_tokens_sum{model_name=\"test-model\"} 5.0\n",
        "vllm:request_params_max_tokens_sum{model_name=\"test-model\"} 5.0\n",
    ] {
        assert!(text.contains(line), "{line} in:\n{text}");
    }
    h.assert_protocol_ok();
}

//! Anthropic's Messages API over HTTP: the answer and its events agree, the errors take
//! Anthropic's shape naming the field, and `x-api-key` opens the routes.

use super::*;

fn messages_request(extra: Value) -> Value {
    let mut body = json!({
        "model": "test-model",
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// An SSE answer's (event name, data) pairs.
async fn events(h: &Harness, body: &Value) -> Vec<(String, Value)> {
    let (status, _, text) = h.send(post_json("/v1/messages", body, None)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let mut out = Vec::new();
    let mut name = None;
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("event:") {
            name = Some(n.trim().to_string());
        } else if let Some(data) = line.strip_prefix("data:") {
            let data: Value = serde_json::from_str(data.trim()).unwrap();
            let name = name.take().expect("an event line before each data line");
            assert_eq!(data["type"], name.as_str());
            out.push((name, data));
        }
    }
    out
}

#[tokio::test]
async fn a_tool_use_answer_and_its_events_agree() {
    let mut script = ids(&format!("ok {TOOL_CALL}"));
    script.push(testing::eos_id());
    let h = setup(Script::Fixed(script))
        .chat_template_source(TOOL_TEMPLATE)
        .build();
    // The whole room the context leaves (64 tokens, the prompt's 2): the call fits.
    let room = json!({"max_tokens": 62});
    let (status, v) = h.post("/v1/messages", messages_request(room.clone())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(
        (v["type"].as_str(), v["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(v["stop_reason"], "tool_use");
    assert_eq!(v["content"][0], json!({"type": "text", "text": "ok"}));
    assert_eq!(v["content"][1]["type"], "tool_use");
    assert_eq!(v["content"][1]["name"], "f");
    assert_eq!(v["content"][1]["input"], json!({}));
    assert!(v["content"][1]["id"]
        .as_str()
        .unwrap()
        .starts_with("toolu_"));
    let generated = ids(&format!("ok {TOOL_CALL}")).len() + 1;
    assert_eq!(v["usage"]["output_tokens"], generated);
    assert_eq!(v["usage"]["input_tokens"], prompt_tokens("hi") - 1);
    let streamed = events(
        &h,
        &messages_request(json!({"stream": true, "max_tokens": 62})),
    )
    .await;
    let names: Vec<&str> = streamed.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(
        &names[names.len() - 5..],
        [
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let start = &streamed[0].1["message"];
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["usage"]["input_tokens"], v["usage"]["input_tokens"]);
    let text: String = streamed
        .iter()
        .filter(|(_, d)| d["index"] == 0 && d["delta"]["type"] == "text_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, "ok");
    let n = streamed.len();
    assert_eq!(streamed[n - 5].1["content_block"]["name"], "f");
    assert_eq!(streamed[n - 4].1["delta"]["partial_json"], "{}");
    assert_eq!(streamed[n - 2].1["delta"]["stop_reason"], "tool_use");
    assert_eq!(streamed[n - 2].1["usage"]["output_tokens"], generated);
    // count_tokens counts the prompt the answer was generated from.
    let (status, count) = h
        .post("/v1/messages/count_tokens", messages_request(json!({})))
        .await;
    assert_eq!(status, StatusCode::OK, "{count}");
    assert_eq!(count["input_tokens"], v["usage"]["input_tokens"]);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn errors_take_anthropic_s_shape_and_name_the_field() {
    let h = setup(Script::Hash)
        .chat_template_source(TOOL_TEMPLATE)
        .build();
    let without_max_tokens = {
        let mut b = messages_request(json!({}));
        b.as_object_mut().unwrap().remove("max_tokens");
        b
    };
    let cases = [
        (without_max_tokens, "max_tokens"),
        (messages_request(json!({"temperature": 1.5})), "temperature"),
        (
            messages_request(json!({"messages": [{"role": "tool", "content": "x"}]})),
            "messages[0].role",
        ),
        (
            messages_request(json!({"messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]})),
            "messages[0].content[0].type",
        ),
        (
            messages_request(json!({"max_tokens": "many"})),
            "max_tokens",
        ),
        (
            messages_request(json!({"stop_sequences": [""]})),
            "stop_sequences",
        ),
    ];
    for (body, field) in cases {
        let (status, v) = h.post("/v1/messages", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(field), "{field}: {message}");
    }
}

/// The token limit is named `max_tokens`, as the client sent it, never TGI's name.
#[tokio::test]
async fn errors_name_max_tokens_not_tgis_parameter() {
    let h = setup(Script::Hash)
        .chat_template_source(TOOL_TEMPLATE)
        .build();
    let body = messages_request(json!({"max_tokens": 100}));
    let (status, v) = h.post("/v1/messages", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("messages tokens + max_tokens must be <= "),
        "{message}"
    );
    assert!(!message.contains("parameters."), "{message}");
}

#[tokio::test]
async fn x_api_key_opens_every_route_and_a_bad_key_is_anthropic_s_401() {
    let h = setup(Script::Hash)
        .chat_template_source(TOOL_TEMPLATE)
        .build();
    let access = crate::access::Access {
        api_keys: vec![crate::tenants::ApiKey::bare("sekret")],
        payload_limit: 1 << 20,
        ..Default::default()
    };
    let app = crate::access::layers(h.app.clone(), access);
    let with_key = |path: &str, body: &Value, key: &str| {
        Request::post(path)
            .header("content-type", "application/json")
            .header("x-api-key", key)
            .header("anthropic-version", "2023-06-01")
            .body(Body::from(body.to_string()))
            .unwrap()
    };
    let body = messages_request(json!({"max_tokens": 2}));
    let (status, _, text) = send(&app, with_key("/v1/messages", &body, "sekret")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let generate = json!({"inputs": "hi", "parameters": {"max_new_tokens": 2}});
    let (status, _, text) = send(&app, with_key("/generate", &generate, "sekret")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    for key in [None, Some("wrong")] {
        let request = match key {
            Some(key) => with_key("/v1/messages", &body, key),
            None => post_json("/v1/messages", &body, None),
        };
        let (status, _, text) = send(&app, request).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "authentication_error", "{v}");
    }
    let (status, _, _) = send(&app, post_json("/v1/messages", &body, Some("sekret"))).await;
    assert_eq!(status, StatusCode::OK, "the bearer key opens it too");
}

//! OpenAI's completions and chat completions: errors in OpenAI's shape, streams, echo,
//! usage chunks.

use super::*;

#[tokio::test]
async fn openai_errors_are_400_in_openai_shape_naming_the_parameter() {
    let h = harness(Script::Hash);
    let cases = [
        (json!({"prompt": "hi", "temperature": 3}), "temperature"),
        (json!({"prompt": "hi", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": "hi", "top_p": 0}), "top_p"),
        (json!({"prompt": "hi", "n": 0}), "n"),
        (json!({"prompt": "hi", "n": 9}), "best_of"),
        (json!({"prompt": "hi", "logprobs": 9}), "logprobs"),
        (json!({"prompt": "hi", "stop": ["a", "b", "c"]}), "stop"),
        (
            json!({"prompt": "hi", "logit_bias": {"x": 1}}),
            "logit_bias",
        ),
        (
            json!({"prompt": "hi", "logit_bias": {"5": 101}}),
            "logit_bias",
        ),
        (
            json!({"prompt": "hi", "frequency_penalty": 9}),
            "frequency_penalty",
        ),
        (json!({"prompt": 5}), "prompt"),
        (json!({"prompt": ""}), "prompt"),
        (json!({"prompt": [1, 999999]}), "prompt"),
        (json!({"prompt": "hi", "seed": -1}), "seed"),
        (json!({"prompt": "hi", "priority": "high"}), "priority"),
    ];
    for (body, param) in cases {
        let (status, _, text) = h.send(post_json("/v1/completions", &body, None)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{text}");
        assert_eq!(v["error"]["param"], param, "{body}: {text}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(param),
            "{text}"
        );
    }
    // No chat template in the test model: chat completions say so, naming messages.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
    let (status, _, text) = h.send(post_json("/v1/chat/completions", &chat, None)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("\"param\":\"messages\""), "{text}");
    // ... and the server still serves.
    let (status, _, text) = h
        .send(post_json(
            "/v1/completions",
            &json!({"prompt": "hi", "max_tokens": 3, "n": 2}),
            None,
        ))
        .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(v["usage"]["completion_tokens"], 6);
    h.assert_protocol_ok();
}

/// A streamed completion put back together: each choice's text, and its logprobs lists
/// concatenated, by choice index.
fn streamed_choices(chunks: &[Value]) -> Vec<(String, Value)> {
    let mut choices: Vec<(String, Value)> = Vec::new();
    for choice in chunks.iter().flat_map(|c| c["choices"].as_array().unwrap()) {
        let index = choice["index"].as_u64().unwrap() as usize;
        if choices.len() <= index {
            choices.resize(index + 1, (String::new(), json!({})));
        }
        let (text, logprobs) = &mut choices[index];
        text.push_str(choice["text"].as_str().unwrap());
        if let Some(lp) = choice["logprobs"].as_object() {
            for (key, values) in lp {
                let list = logprobs[key.as_str()]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let more = values.as_array().unwrap().iter().cloned();
                logprobs[key.as_str()] = list.into_iter().chain(more).collect();
            }
        }
    }
    choices
}

/// TGI's names (`parameters.max_new_tokens`, `truncate`) never reach an OpenAI client:
/// each limit is named as the client named it.
#[tokio::test]
async fn openai_errors_name_the_clients_fields_not_tgis() {
    let h = harness(Script::Hash);
    let long = "a ".repeat(80);
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 100}),
            "prompt tokens + max_tokens must be <= ",
        ),
        (
            "/v1/completions",
            json!({"prompt": long, "max_tokens": 1}),
            "prompt must have less than ",
        ),
    ];
    let chat = setup(Script::Hash)
        .chat_template_source(TOOL_TEMPLATE)
        .build();
    let messages = json!([{"role": "user", "content": "hi"}]);
    let chat_cases = [
        (
            "/v1/chat/completions",
            json!({"messages": messages, "max_completion_tokens": 100}),
            "messages tokens + max_completion_tokens must be <= ",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 100}),
            "messages tokens + max_tokens must be <= ",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": long}]}),
            "messages must have less than ",
        ),
    ];
    let routes = cases.into_iter().map(|c| (&h, c));
    for (h, (path, body, start)) in routes.chain(chat_cases.into_iter().map(|c| (&chat, c))) {
        let (status, v) = h.post(path, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(start), "{message}");
        assert!(!message.contains("parameters."), "{message}");
        assert!(!message.contains("max_new_tokens"), "{message}");
    }
}

#[tokio::test]
async fn several_prompts_count_every_prompt_in_x_prompt_tokens_streamed_or_not() {
    let h = harness(Script::Hash);
    let prompts = ["hello", "hi there"];
    let total = prompts.iter().map(|p| prompt_tokens(p)).sum::<usize>();
    let body = json!({"prompt": prompts, "max_tokens": 2, "temperature": 0});
    let (status, headers, text) = h.send(post_json("/v1/completions", &body, None)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], total);
    assert_eq!(headers["x-prompt-tokens"], total.to_string().as_str());
    let mut body = body;
    body["stream"] = json!(true);
    let (headers, _) = openai_stream(&h, "/v1/completions", body).await;
    assert_eq!(headers["x-prompt-tokens"], total.to_string().as_str());
    h.assert_protocol_ok();
}

/// Two prompts, two choices each, echoed: the whole answer and the streamed choices
/// (text and logprobs put back together).
async fn echo_whole_and_streamed(h: &Harness, logprobs: Value) -> (Value, Vec<(String, Value)>) {
    let mut body = json!({"prompt": ["hello", "hi"], "n": 2, "echo": true, "max_tokens": 3,
                          "temperature": 0});
    if !logprobs.is_null() {
        body["logprobs"] = logprobs;
    }
    let (status, whole) = h.post("/v1/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    body["stream"] = json!(true);
    let (_, chunks) = openai_stream(h, "/v1/completions", body).await;
    let choices = streamed_choices(&chunks);
    assert_eq!(choices.len(), 4);
    (whole, choices)
}

#[tokio::test]
async fn streamed_echo_is_the_prompt_as_sent_like_the_whole_answer() {
    let h = harness(Script::Hash);
    let (whole, choices) = echo_whole_and_streamed(&h, Value::Null).await;
    for (index, (text, _)) in choices.iter().enumerate() {
        let prompt = ["hello", "hi"][index / 2];
        assert!(text.starts_with(prompt), "{index}: {text:?}");
        assert_eq!(whole["choices"][index]["text"], text.as_str(), "{index}");
    }
    h.assert_protocol_ok();
}

#[tokio::test]
async fn streamed_echo_with_logprobs_sends_the_prompt_logprobs_like_the_whole_answer() {
    let h = harness(Script::Hash);
    let (whole, choices) = echo_whole_and_streamed(&h, json!(1)).await;
    for (index, (_, logprobs)) in choices.iter().enumerate() {
        let expected = &whole["choices"][index]["logprobs"];
        let prompt_len = prompt_tokens(["hello", "hi"][index / 2]);
        // The prompt's tokens first (the first without a logprob), then the 3 generated.
        assert_eq!(expected["tokens"].as_array().unwrap().len(), prompt_len + 3);
        assert_eq!(expected["token_logprobs"][0], Value::Null);
        assert_eq!(expected["token_logprobs"][1], -1.0);
        assert_eq!(logprobs, expected, "choice {index}");
        // Every offset points at its token in the choice's text (the BOS, a special
        // token the echo does not show, at 0 and taking no room).
        let text = whole["choices"][index]["text"].as_str().unwrap();
        let tokens = expected["tokens"].as_array().unwrap();
        let offsets = expected["text_offset"].as_array().unwrap();
        for (i, (token, offset)) in tokens.iter().zip(offsets).enumerate() {
            let (token, at) = (token.as_str().unwrap(), offset.as_u64().unwrap() as usize);
            if i == 0 && token == "<|bos|>" {
                assert_eq!(at, 0);
                continue;
            }
            let at_offset = text.get(at..at + token.len());
            assert_eq!(
                at_offset,
                Some(token),
                "choice {index} token {i} in {text:?}"
            );
        }
    }
    h.assert_protocol_ok();
}

#[tokio::test]
async fn stream_chunks_carry_null_usage_only_when_the_usage_chunk_is_asked() {
    let h = setup(Script::Hash).chat_template().build();
    let requests = [
        ("/v1/completions", json!({"prompt": "hello"})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hello"}]}),
        ),
    ];
    for (path, mut body) in requests {
        body["max_tokens"] = json!(3);
        body["stream"] = json!(true);
        let (_, chunks) = openai_stream(&h, path, body.clone()).await;
        for chunk in &chunks {
            assert!(chunk.get("usage").is_none(), "{path}: {chunk}");
        }
        body["stream_options"] = json!({"include_usage": true});
        let (_, chunks) = openai_stream(&h, path, body).await;
        let (last, tokens) = chunks.split_last().unwrap();
        assert_eq!(last["choices"], json!([]), "{path}");
        assert_eq!(last["usage"]["completion_tokens"], 3, "{path}");
        for chunk in tokens {
            assert_eq!(chunk.get("usage"), Some(&Value::Null), "{path}: {chunk}");
        }
    }
    h.assert_protocol_ok();
}

#[tokio::test]
async fn streaming_best_of_must_equal_n_either_way() {
    let h = harness(Script::Hash);
    for best_of in [1, 3] {
        let body = json!({"prompt": "hi", "n": 2, "best_of": best_of, "stream": true});
        let (status, _, text) = h.send(post_json("/v1/completions", &body, None)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], "best_of", "{text}");
    }
}

#[tokio::test]
async fn a_request_priority_is_accepted_on_openai_and_tgi_routes() {
    let h = harness(Script::Hash);
    let body = json!({"prompt": "hi", "max_tokens": 2, "priority": -3});
    let (status, v) = h.post("/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 2, "priority": 7}});
    let (status, v) = h.post("/generate", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    h.assert_protocol_ok();
}

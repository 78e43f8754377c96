//! TGI's generating routes: text and details, EOS and stop sequences, streaming,
//! seeds, truncation, `best_of`, and the operator headers.

use super::*;

#[tokio::test]
async fn bodies_without_json_content_type_and_tgi_client_nulls_are_accepted() {
    let h = harness(Script::Hash);
    let body = json!({"inputs": "hello", "parameters": {"max_new_tokens": 3}}).to_string();
    let (status, text) = h.post_raw("/generate", &body, None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let (status, text) = h.post_raw("/generate", &body, Some("text/plain")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    // What text-generation's Client sends to `/`.
    let body = json!({
        "inputs": "hello",
        "stream": false,
        "parameters": {
            "best_of": null, "decoder_input_details": false, "details": true,
            "do_sample": false, "frequency_penalty": null, "grammar": null,
            "max_new_tokens": 4, "repetition_penalty": null, "return_full_text": false,
            "seed": null, "stop": [], "temperature": null, "top_k": null,
            "top_n_tokens": null, "top_p": null, "truncate": null, "typical_p": null,
            "watermark": false, "adapter_id": null
        }
    });
    let (status, v) = h.post("/", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // `/` answers a one-element array, as TGI does.
    assert_eq!(v[0]["details"]["generated_tokens"], 4);
    assert_eq!(v[0]["details"]["seed"], Value::Null);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn generate_returns_text_and_details_and_stops_at_max_new_tokens() {
    let h = harness(Script::Fixed(ids("abc")));
    let (status, v) = h
        .post(
            "/generate",
            json!({"inputs": "hi", "parameters": {"max_new_tokens": 5, "details": true}}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["generated_text"], "abcab");
    let d = &v["details"];
    assert_eq!(d["finish_reason"], "length");
    assert_eq!(d["generated_tokens"], 5);
    assert_eq!(d["prefill"], json!([]));
    assert_eq!(d["tokens"].as_array().unwrap().len(), 5);
    assert_eq!(
        d["tokens"][0],
        json!({"id": b'a', "text": "a", "logprob": -0.5, "special": false})
    );
    // Without details there is no details key; return_full_text prepends the prompt.
    let (_, v) = h
        .post(
            "/generate",
            json!({"inputs": "hi ", "parameters": {"max_new_tokens": 2, "return_full_text": true}}),
        )
        .await;
    assert_eq!(v, json!({"generated_text": "hi ab"}));
    h.assert_protocol_ok();
}

#[tokio::test]
async fn eos_ends_generation_and_is_not_in_the_text() {
    let mut script = ids("ok");
    script.push(testing::eos_id());
    let h = harness(Script::Fixed(script));
    let (_, v) = h
        .post(
            "/generate",
            json!({"inputs": "hi", "parameters": {"max_new_tokens": 10, "details": true}}),
        )
        .await;
    assert_eq!(v["generated_text"], "ok");
    assert_eq!(v["details"]["finish_reason"], "eos_token");
    assert_eq!(v["details"]["generated_tokens"], 3);
    let last = &v["details"]["tokens"][2];
    assert_eq!(last["special"], true);
    assert_eq!(last["text"], "");
}

#[tokio::test]
async fn ignore_eos_generates_to_the_token_limit() {
    let mut script = ids("ok");
    script.push(testing::eos_id());
    let h = harness(Script::Fixed(script));
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 7, "details": true,
                      "ignore_eos": true}});
    let (_, v) = h.post("/generate", body).await;
    assert_eq!(v["details"]["finish_reason"], "length");
    assert_eq!(v["details"]["generated_tokens"], 7);
    // The script repeats: o k EOS o k EOS o; the EOS tokens decode to nothing.
    assert_eq!(v["generated_text"], "okoko");
    let (status, _, text) = h
        .send(post_json(
            "/v1/completions",
            &json!({"prompt": "hi", "max_tokens": 5, "ignore_eos": true}),
            None,
        ))
        .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 5, "{text}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{text}");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn stop_sequences_end_generation_and_are_never_streamed() {
    let h = harness(Script::Fixed(ids("one two###three")));
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 30, "stop": ["###"], "details": true}});
    let (_, v) = h.post("/generate", body.clone()).await;
    assert_eq!(v["generated_text"], "one two");
    assert_eq!(v["details"]["finish_reason"], "stop_sequence");
    let (status, events) = h.stream(body).await;
    assert_eq!(status, StatusCode::OK);
    let texts: String = events
        .iter()
        .map(|e| e["token"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, "one two");
    assert!(events
        .iter()
        .all(|e| !e["token"]["text"].as_str().unwrap().contains('#')));
    let last = events.last().unwrap();
    assert_eq!(last["generated_text"], "one two");
    assert_eq!(last["details"]["finish_reason"], "stop_sequence");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn streaming_sends_one_event_per_token_and_whole_multibyte_characters() {
    let h = harness(Script::Fixed(ids("日本 é👍")));
    let n = ids("日本 é👍").len();
    let body =
        json!({"inputs": "hi", "parameters": {"max_new_tokens": n, "details": true, "seed": 5}});
    let (status, events) = h.stream(body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(events.len(), n);
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["index"], i + 1);
        let text = e["token"]["text"].as_str().unwrap();
        assert!(!text.contains('\u{FFFD}'));
        if i + 1 < n {
            assert_eq!(e["generated_text"], Value::Null);
            assert_eq!(e["details"], Value::Null);
        }
    }
    assert_eq!(events[0]["token"]["text"], ""); // first byte of 日
    assert_eq!(events[2]["token"]["text"], "日");
    let texts: String = events
        .iter()
        .map(|e| e["token"]["text"].as_str().unwrap())
        .collect();
    let last = events.last().unwrap();
    assert_eq!(texts, "日本 é👍");
    assert_eq!(last["generated_text"], "日本 é👍");
    assert_eq!(last["details"]["generated_tokens"], n);
    assert_eq!(last["details"]["seed"], 5);
    // `/` with stream: true streams too.
    let (status, text) = h
        .post_raw(
            "/",
            &json!({"inputs": "hi", "stream": true, "parameters": {"max_new_tokens": 2}})
                .to_string(),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(text.matches("data:").count(), 2);
}

#[tokio::test]
async fn sampling_without_a_seed_reports_a_random_one() {
    let h = harness(Script::Hash);
    let (_, v) = h
        .post("/generate", json!({"inputs": "hi", "parameters": {"max_new_tokens": 2, "temperature": 0.7, "details": true}}))
        .await;
    assert!(v["details"]["seed"].is_u64(), "{v}");
    let (_, v) = h
        .post(
            "/generate",
            json!({"inputs": "hi", "parameters": {"max_new_tokens": 2, "details": true}}),
        )
        .await;
    assert_eq!(v["details"]["seed"], Value::Null);
}

#[tokio::test]
async fn truncate_keeps_the_last_input_tokens() {
    let h = harness(Script::Hash);
    let body =
        json!({"inputs": "x".repeat(100), "parameters": {"max_new_tokens": 2, "truncate": 10}});
    let (status, v) = h.post("/generate", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let s = h.shard_state();
    assert!(s.violations.is_empty());
}

#[tokio::test]
async fn best_of_generates_siblings_with_distinct_derived_seeds_and_timing_headers() {
    let h = harness(Script::Hash);
    let body = json!({"inputs": "hello", "parameters": {
        "best_of": 3, "do_sample": true, "seed": 7, "details": true, "max_new_tokens": 4}});
    let (status, headers, text) = h.send(post_json("/generate", &body, None)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let others = v["details"]["best_of_sequences"].as_array().unwrap();
    assert_eq!(others.len(), 2);
    let mut seeds: Vec<u64> = others.iter().map(|o| o["seed"].as_u64().unwrap()).collect();
    seeds.push(v["details"]["seed"].as_u64().unwrap());
    seeds.sort();
    seeds.dedup();
    assert_eq!(seeds.len(), 3, "each sample has its own seed");
    assert!(
        seeds.contains(&7),
        "the first sample keeps the request's seed"
    );
    assert_eq!(headers["x-generated-tokens"], "12");
    assert_eq!(
        headers["x-prompt-tokens"],
        prompt_tokens("hello").to_string().as_str()
    );
    for name in ["x-queue-time", "x-inference-time", "x-time-per-token"] {
        assert!(headers.contains_key(name), "{name}");
    }
    h.assert_protocol_ok();
}

#[tokio::test]
async fn best_of_siblings_fork_from_the_first_sample_and_compute_the_prompt_once() {
    let h = harness(Script::Seeded);
    let inputs = "hello worlds!!";
    let prompt_len = prompt_tokens(inputs);
    // A partial last block of 3 tokens: without the fork each sibling would compute them.
    assert_eq!(prompt_len % BLOCK_SIZE, 3);
    let body = json!({"inputs": inputs, "parameters": {
        "best_of": 3, "do_sample": true, "seed": 7, "details": true, "max_new_tokens": 6}});
    let (status, v) = h.post("/generate", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let mut samples: Vec<(u64, String)> = v["details"]["best_of_sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                o["seed"].as_u64().unwrap(),
                o["generated_text"].as_str().unwrap().into(),
            )
        })
        .collect();
    samples.push((
        v["details"]["seed"].as_u64().unwrap(),
        v["generated_text"].as_str().unwrap().into(),
    ));
    {
        let s = h.shard_state();
        // Sample 0 computes the prompt; each fork recomputes only the last prompt
        // token (into a copy of the shared partial block) for its own logits.
        assert_eq!(s.prompt_computed, prompt_len + 2);
    }
    h.assert_protocol_ok();
    let texts: std::collections::HashSet<&String> = samples.iter().map(|(_, t)| t).collect();
    assert_eq!(texts.len(), 3, "seeds give distinct samples: {samples:?}");
    // Each sample is what a lone request with its seed generates.
    for (seed, text) in &samples {
        let (status, alone) = h
            .post(
                "/generate",
                json!({"inputs": inputs, "parameters": {
                    "do_sample": true, "seed": seed, "max_new_tokens": 6}}),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(&alone["generated_text"], text, "seed {seed}");
    }
    h.assert_protocol_ok();
    // Every block was released (full prompt blocks stay cached, unreferenced).
    let (_, _, metrics) = h.get("/metrics").await;
    assert!(metrics.contains("cadence_kv_blocks_used{model=\"test-model\"} 0\n"));
}

#[tokio::test]
async fn streams_carry_the_operator_headers_known_when_they_start() {
    let h = harness(Script::Hash);
    let inputs = "hello wörld";
    let body = json!({"inputs": inputs, "stream": true, "parameters": {"max_new_tokens": 3}});
    for path in ["/generate_stream", "/"] {
        let (status, headers, text) = h.send(post_json(path, &body, None)).await;
        assert_eq!(status, StatusCode::OK, "{path}: {text}");
        assert_eq!(headers["content-type"], "text/event-stream", "{path}");
        assert_eq!(
            headers["x-prompt-tokens"],
            prompt_tokens(inputs).to_string().as_str(),
            "{path}"
        );
        assert_eq!(headers["x-compute-characters"], "11", "{path}");
        assert_eq!(headers["x-accel-buffering"], "no", "{path}");
        assert_eq!(text.matches("data:").count(), 3, "{path}: {text}");
    }
    let body = json!({"prompt": inputs, "stream": true, "max_tokens": 3});
    let (status, headers, text) = h.send(post_json("/v1/completions", &body, None)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(
        headers["x-prompt-tokens"],
        prompt_tokens(inputs).to_string().as_str()
    );
    assert_eq!(headers["x-accel-buffering"], "no");
    h.assert_protocol_ok();
}

//! Structured outputs: TGI's grammar, JSON schemas with fast-forwarded tokens,
//! choices, and the limits a constraint must respect.

use super::*;

/// Whether `text` matches `regex` as a whole (checked with llguidance's own regex
/// compiler, independent of the masks under test: a one-grammar matcher fed the bytes).
fn full_match(regex: &str, text: &str) -> bool {
    use llguidance::api::TopLevelGrammar;
    let env = toktrie::ApproximateTokEnv::single_byte_env();
    let factory = llguidance::ParserFactory::new_simple(&env).unwrap();
    let parser = factory.create_parser(TopLevelGrammar::from_regex(regex));
    let mut m = llguidance::Matcher::new(parser);
    let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
    m.consume_tokens(&tokens).is_ok() && m.is_accepting().unwrap_or(false)
}

#[tokio::test]
async fn tgi_grammar_constrains_the_output_and_ends_it_with_eos() {
    for setup in [setup(Script::Hash), setup(Script::Hash).synchronous()] {
        let h = setup.build();
        let regex = "[0-9]{3}-[a-z]{2}";
        let body = json!({"inputs": "hello", "parameters": {
            "max_new_tokens": 20, "details": true,
            "grammar": {"type": "regex", "value": regex}}});
        let (status, v) = h.post("/generate", body).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let text = v["generated_text"].as_str().unwrap();
        assert!(full_match(regex, text), "{text:?}");
        assert_eq!(v["details"]["finish_reason"], "eos_token", "{v}");
        h.assert_protocol_ok();
        let (_, _, metrics) = h.get("/metrics").await;
        assert!(metrics.contains("cadence_constrained_requests_total{model=\"test-model\"} 1\n"));
    }
}

#[tokio::test]
async fn a_json_schema_output_parses_and_forced_keys_are_fast_forwarded() {
    let h = harness(Script::Hash);
    let schema = json!({"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 5},
                       "tag": {"enum": ["red", "green"]}},
        "required": ["name", "tag"], "additionalProperties": false});
    let body = json!({"prompt": "hello", "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}});
    let (status, v) = h.post("/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(
        parsed["name"].as_str().unwrap().chars().count() <= 5,
        "{parsed}"
    );
    assert!(
        ["red", "green"].contains(&parsed["tag"].as_str().unwrap()),
        "{parsed}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    h.assert_protocol_ok();
    let forced = h.shard_state().forced;
    assert!(forced > 0, "the keys are forced");
    let (_, _, metrics) = h.get("/metrics").await;
    let line =
        format!("cadence_grammar_fast_forward_tokens_total{{model=\"test-model\"}} {forced}\n");
    assert!(metrics.contains(&line), "{metrics}");
    // Usage counts forced tokens as generated.
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64().unwrap() as usize,
        ids(text).len() + 1,
        "the text's tokens and the EOS"
    );
}

#[tokio::test]
async fn choices_with_n_samples_each_match_and_bad_grammars_are_400s_naming_the_field() {
    let h = harness(Script::Seeded);
    let body = json!({"prompt": "hello", "max_tokens": 10, "n": 3, "seed": 7,
        "guided_choice": ["yes", "no", "maybe"]});
    let (status, v) = h.post("/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    for choice in v["choices"].as_array().unwrap() {
        let text = choice["text"].as_str().unwrap();
        assert!(["yes", "no", "maybe"].contains(&text), "{text:?}");
    }
    let cases = [
        (json!({"guided_regex": "(a"}), "guided_regex"),
        (
            json!({"guided_grammar": "start: nothing_here"}),
            "guided_grammar",
        ),
        (
            json!({"response_format": {"type": "json_schema",
                 "json_schema": {"schema": {"type": "object", "minProperties": "x"}}}}),
            "response_format",
        ),
    ];
    for (mut body, field) in cases {
        body["prompt"] = json!("hello");
        let (status, v) = h.post("/v1/completions", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
    }
    h.assert_protocol_ok();
}

#[tokio::test]
async fn forced_tokens_respect_max_new_tokens_and_stop_strings() {
    let h = harness(Script::Hash);
    let grammar = |choice: &str| json!({"type": "regex", "value": regex_escape(choice)});
    let (status, v) = h
        .post(
            "/generate",
            json!({"inputs": "hi", "parameters": {"max_new_tokens": 3, "details": true,
                "grammar": grammar("abcdefgh")}}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["generated_text"], "abc");
    assert_eq!(v["details"]["finish_reason"], "length");
    assert_eq!(v["details"]["generated_tokens"], 3);
    let (status, v) = h
        .post(
            "/generate",
            json!({"inputs": "hi", "parameters": {"max_new_tokens": 20, "details": true,
                "stop": ["lo w"], "grammar": grammar("hello world")}}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["generated_text"], "hel");
    assert_eq!(v["details"]["finish_reason"], "stop_sequence");
    assert!(h.shard_state().forced > 0);
    h.assert_protocol_ok();
}

/// `text` as a regex matching exactly it (letters and spaces only here).
fn regex_escape(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c == ' ' {
                "\\x20".to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

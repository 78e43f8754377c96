//! Speculative decoding through the whole router: proposals (the router's n-gram lookup,
//! the fake shard's draft model) verified by the fake shard as the real shards do, greedy
//! (accept while the proposal is the model's own token), must answer exactly as without
//! speculation, ends included (EOS, a stop string, the token limit inside an accepted run),
//! and the metrics count what was proposed and accepted.

use super::*;

/// A generate request's text, finish reason and token count.
async fn generate(h: &Harness, body: Value) -> (String, String, u64) {
    let (status, v) = h.post("/generate", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    (
        v["generated_text"].as_str().unwrap().to_string(),
        v["details"]["finish_reason"].as_str().unwrap().to_string(),
        v["details"]["generated_tokens"].as_u64().unwrap(),
    )
}

fn body(inputs: &str, max_new_tokens: u32, stop: &[&str]) -> Value {
    json!({"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens, "stop": stop,
           "details": true}})
}

/// (proposed, accepted) tokens over every step the fake ran.
fn verified(h: &Harness) -> (usize, usize) {
    let s = h.shard_state();
    (s.proposed, s.accepted)
}

/// Answers with speculation by `method` equal those without, for each body; returns the
/// speculative harness for further checks.
async fn same_answers(script: Script, method: SpeculativeMethod, bodies: &[Value]) -> Harness {
    let plain = harness(script.clone());
    let spec = setup(script).speculative(method, 4, 32).build();
    for b in bodies {
        let want = generate(&plain, b.clone()).await;
        let got = generate(&spec, b.clone()).await;
        assert_eq!(got, want, "{b}");
    }
    plain.assert_protocol_ok();
    spec.assert_protocol_ok();
    spec
}

#[tokio::test]
async fn ngram_proposals_hit_a_repeating_output_and_answer_as_without_them() {
    let script = Script::Fixed(ids("the cat sat. "));
    let bodies = [
        body("hi", 40, &[]),
        body("the cat", 25, &[]),
        body("x", 3, &[]),
        body("x", 1, &[]),
    ];
    let h = same_answers(script, SpeculativeMethod::Ngram, &bodies).await;
    let (proposed, accepted) = verified(&h);
    assert!(accepted > 20, "{accepted} of {proposed} accepted");
    // Every accepted token is one step saved: fewer steps than tokens.
    let steps = h.shard_state().steps;
    assert!(steps < 40 + 25 + 3 + 1, "{steps} steps");
}

#[tokio::test]
async fn a_draft_that_is_sometimes_wrong_changes_nothing_but_the_step_count() {
    let bodies = [body("hello there", 30, &[]), body("a", 17, &[])];
    let h = same_answers(Script::Hash, SpeculativeMethod::Draft, &bodies).await;
    let (proposed, accepted) = verified(&h);
    assert!(
        0 < accepted && accepted < proposed,
        "{accepted} of {proposed}"
    );
}

#[tokio::test]
async fn eos_a_stop_string_and_the_token_limit_inside_an_accepted_run_end_it_there() {
    let mut eos_script = ids("ab ab ab ab");
    eos_script.push(testing::eos_id());
    let bodies = [body("q", 40, &[])];
    let h = same_answers(Script::Fixed(eos_script), SpeculativeMethod::Ngram, &bodies).await;
    let (text, finish, _) = generate(&h, body("q", 40, &[])).await;
    assert_eq!(
        (text.as_str(), finish.as_str()),
        ("ab ab ab ab", "eos_token")
    );

    let script = Script::Fixed(ids("one two one two one STOP"));
    let bodies = [body("q", 40, &["STOP"]), body("q", 40, &["o o"])];
    let h = same_answers(script, SpeculativeMethod::Ngram, &bodies).await;
    let (text, finish, _) = generate(&h, body("q", 40, &["STOP"])).await;
    assert_eq!(
        (text.as_str(), finish.as_str()),
        ("one two one two one ", "stop_sequence")
    );

    // The limit falls inside runs the proposals would carry past it.
    let script = Script::Fixed(ids("xyxyxyxyxyxyxyxy"));
    let bodies: Vec<Value> = (1..12).map(|n| body("q", n, &[])).collect();
    let h = same_answers(script, SpeculativeMethod::Ngram, &bodies).await;
    let (_, finish, tokens) = generate(&h, body("q", 9, &[])).await;
    assert_eq!((finish.as_str(), tokens), ("length", 9));
}

#[tokio::test]
async fn streams_carry_every_token_of_an_accepted_run_in_order() {
    let script = Script::Fixed(ids("abcabcabcabc"));
    let h = setup(script)
        .speculative(SpeculativeMethod::Ngram, 4, 32)
        .build();
    let (status, events) = h.stream(body("go", 20, &[])).await;
    assert_eq!(status, StatusCode::OK);
    let text: String = events
        .iter()
        .map(|e| e["token"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, "abcabcabcabcabcabcab");
    assert_eq!(events.len(), 20);
    assert!(verified(&h).1 > 0);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn concurrent_requests_with_proposals_answer_as_alone_through_preemption() {
    let script = Script::Fixed(ids("lo la lo la lo"));
    let h = setup(script.clone())
        .speculative(SpeculativeMethod::Ngram, 4, 12)
        .blocks(24)
        .build();
    let alone = harness(script);
    let bodies: Vec<Value> = (0..8)
        .map(|i| body(&format!("prompt {i}"), 10 + i, &[]))
        .collect();
    let sent = bodies.iter().map(|b| {
        let app = h.app.clone();
        let b = b.clone();
        tokio::spawn(async move { send(&app, post_json("/generate", &b, None)).await })
    });
    let answers = futures::future::join_all(sent).await;
    for (b, answer) in bodies.iter().zip(answers) {
        let (status, _, text) = answer.unwrap();
        assert_eq!(status, StatusCode::OK, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let (want, _, _) = generate(&alone, b.clone()).await;
        assert_eq!(v["generated_text"], want);
    }
    h.assert_protocol_ok();
    let (_, _, metrics) = h.get("/metrics").await;
    assert!(
        metrics.contains("vllm:spec_decode_num_drafts_total"),
        "{metrics}"
    );
    assert!(
        metrics.contains("cadence_kv_blocks_used{model=\"test-model\"} 0"),
        "{metrics}"
    );
}

#[tokio::test]
async fn constrained_and_best_of_requests_never_carry_proposals() {
    let script = Script::Fixed(ids("aaaaaaaaaaaaaaaaaaaa"));
    let h = setup(script)
        .speculative(SpeculativeMethod::Ngram, 4, 32)
        .build();
    let b = json!({"inputs": "a", "parameters": {"max_new_tokens": 8, "best_of": 2,
                   "do_sample": true}});
    let (status, v) = h.post("/generate", b).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(verified(&h), (0, 0));
    h.assert_protocol_ok();
}

//! The batching loop through the routes: preemption, a failed step, async scheduling.

use super::*;

#[tokio::test]
async fn preemption_under_a_tiny_cache_gives_the_same_greedy_output() {
    async fn run_all(num_blocks: usize) -> (Vec<String>, usize) {
        let h = setup(Script::Hash)
            .blocks(num_blocks)
            .max_concurrent(64)
            .build();
        let prompts = [
            "alpha",
            "beta gamma",
            "delta epsilon zeta",
            "eta",
            "theta iota",
        ];
        let outputs = futures::future::join_all(prompts.iter().map(|p| {
            h.post(
                "/generate",
                json!({"inputs": p, "parameters": {"max_new_tokens": 20}}),
            )
        }))
        .await;
        h.assert_protocol_ok();
        let s = h.shard_state();
        assert!(s.max_live_blocks <= num_blocks);
        let texts = outputs
            .into_iter()
            .map(|(status, v)| {
                assert_eq!(status, StatusCode::OK, "{v}");
                v["generated_text"].as_str().unwrap().to_string()
            })
            .collect();
        // Removals beyond one per request are preemptions.
        (texts, s.removed.len())
    }
    let (roomy, roomy_removed) = run_all(200).await;
    // 10 blocks of 4: five requests of ~25 tokens each cannot all stay resident.
    let (tight, tight_removed) = run_all(10).await;
    assert_eq!(roomy, tight);
    assert!(roomy.iter().all(|t| t.len() == 20));
    assert!(
        tight_removed > roomy_removed,
        "the tiny cache should force preemptions"
    );
}

#[tokio::test]
async fn a_failed_step_fails_requests_in_flight_and_later_requests_succeed() {
    let h = harness(Script::Hash);
    h.shard_state().fail_steps = 1;
    let (status, v) = h.post("/generate", json!({"inputs": "hi"})).await;
    assert_eq!(status, StatusCode::FAILED_DEPENDENCY, "{v}");
    assert_eq!(v["error_type"], "generation");
    let (status, v) = h
        .post(
            "/generate",
            json!({"inputs": "hi", "parameters": {"max_new_tokens": 3}}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn async_scheduling_overlaps_steps_and_answers_as_the_synchronous_loop() {
    async fn run_all(setup: Setup) -> (Vec<Value>, usize) {
        let h = setup
            .step_delay(Duration::from_millis(2))
            .max_concurrent(64)
            .build();
        let bodies = [
            ("alpha", json!({"max_new_tokens": 12})),
            ("beta gamma", json!({"max_new_tokens": 3})),
            ("delta", json!({"max_new_tokens": 30, "stop": ["z"]})),
            ("eta theta", json!({"max_new_tokens": 1})),
            ("iota", json!({"max_new_tokens": 20, "stop": ["nn"]})),
        ]
        .map(|(inputs, mut parameters)| {
            parameters["details"] = json!(true);
            json!({"inputs": inputs, "parameters": parameters})
        });
        let outputs =
            futures::future::join_all(bodies.iter().map(|b| h.post("/generate", b.clone()))).await;
        h.assert_protocol_ok();
        let answers = outputs
            .into_iter()
            .map(|(status, v)| {
                assert_eq!(status, StatusCode::OK, "{v}");
                json!([
                    v["generated_text"],
                    v["details"]["finish_reason"],
                    v["details"]["generated_tokens"]
                ])
            })
            .collect();
        let most = h.shard_state().max_outstanding;
        (answers, most)
    }
    let (overlapped, most_in_flight) = run_all(setup(Script::Hash)).await;
    let (synchronous, one_at_a_time) = run_all(setup(Script::Hash).synchronous()).await;
    assert_eq!(overlapped, synchronous);
    assert_eq!(most_in_flight, 2, "the next step is sent while one runs");
    assert_eq!(one_at_a_time, 1);
    assert!(
        overlapped.iter().any(|a| a[1] == "stop_sequence"),
        "a request should end on a stop string (the step sent ahead computed past it)"
    );
}

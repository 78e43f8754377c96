//! Several shard groups behind one router (`--replicas`): requests spread by load, a
//! prompt prefix returns to the replica that caches it, a replica that fails its check
//! gets nothing new while the others serve, and /metrics sums the replicas.

use super::*;

fn prompt_computed(shard: &FakeShard) -> usize {
    shard.state.lock().unwrap().prompt_computed
}

async fn generate(app: &Router, inputs: &str) -> Value {
    let body = json!({"inputs": inputs, "parameters": {"max_new_tokens": 4}});
    let (status, _, text) = send(app, post_json("/generate", &body, None)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    serde_json::from_str(&text).unwrap()
}

#[tokio::test]
async fn concurrent_requests_spread_over_the_replicas_and_answer_as_one_replica_does() {
    let one = setup(Script::Hash).build();
    let two = setup(Script::Hash)
        .replicas(2)
        .step_delay(Duration::from_millis(5))
        .build();
    let prompts: Vec<String> = (0..8).map(|i| format!("prompt number {i} here")).collect();
    let sent = prompts.iter().map(|p| {
        let app = two.app.clone();
        let p = p.clone();
        tokio::spawn(async move { generate(&app, &p).await })
    });
    let answers = futures::future::join_all(sent).await;
    for (p, answer) in prompts.iter().zip(answers) {
        let alone = generate(&one.app, p).await;
        assert_eq!(answer.unwrap()["generated_text"], alone["generated_text"]);
    }
    for (i, shard) in two.replicas.iter().enumerate() {
        assert!(prompt_computed(shard) > 0, "replica {i} got no request");
        assert!(shard.state.lock().unwrap().violations.is_empty());
    }
}

#[tokio::test]
async fn a_prompt_prefix_goes_back_to_the_replica_that_caches_it_against_the_load() {
    let h = setup(Script::Hash).replicas(2).build();
    let shared = "a long shared system prompt, then: ";
    generate(&h.app, &format!("{shared}first")).await; // ties go to replica 0
    assert_eq!(prompt_computed(&h.replicas[1]), 0);
    // Replica 0 now holds a request: by load alone the next would go to replica 1.
    h.replicas[0].paused.send_replace(true);
    let held = hold_stream(&h).await;
    let app = h.app.clone();
    let second = format!("{shared}second");
    let follows = tokio::spawn(async move { generate(&app, &second).await });
    while h.infer.in_flight() < 2 {
        tokio::task::yield_now().await;
    }
    h.replicas[0].paused.send_replace(false);
    follows.await.unwrap();
    drop(held);
    assert_eq!(
        prompt_computed(&h.replicas[1]),
        0,
        "the prefix went to replica 1"
    );
    // A different prompt, with replica 0 busy again, goes to the idle replica 1.
    h.replicas[0].paused.send_replace(true);
    let held = hold_stream(&h).await;
    let app = h.app.clone();
    let other = tokio::spawn(async move { generate(&app, "something else entirely").await });
    tokio::time::timeout(Duration::from_secs(5), other)
        .await
        .expect("replica 1 answers while replica 0 is paused")
        .unwrap();
    assert!(prompt_computed(&h.replicas[1]) > 0);
    h.replicas[0].paused.send_replace(false);
    drop(held);
}

#[tokio::test]
async fn a_replica_that_fails_its_check_gets_no_new_request_while_ready_stays_green() {
    let h = setup(Script::Hash).replicas(2).build();
    *h.replicas[1].health.lock().unwrap() = FakeHealth::Fails;
    let (status, _, _) = h.get("/ready").await;
    assert_eq!(status, StatusCode::OK, "replica 0 still serves");
    let (_, _, metrics) = h.get("/metrics").await;
    assert!(metrics.contains("cadence_replica_ready{model=\"test-model\",replica=\"1\"} 0\n"));
    assert!(metrics.contains("cadence_replica_ready{model=\"test-model\",replica=\"0\"} 1\n"));
    for i in 0..6 {
        generate(&h.app, &format!("request {i}")).await;
    }
    assert_eq!(prompt_computed(&h.replicas[1]), 0);
    // Both down: red, naming the first replica's reason.
    h.set_health(FakeHealth::Fails);
    assert_eq!(
        h.ready().await,
        (StatusCode::SERVICE_UNAVAILABLE, "shard_error".into())
    );
    // Replica 1 back: green again, and it gets requests once more.
    *h.replicas[1].health.lock().unwrap() = FakeHealth::Ready;
    assert_eq!(h.ready().await.0, StatusCode::OK);
    generate(&h.app, "after the recovery").await;
    assert!(prompt_computed(&h.replicas[1]) > 0);
}

#[tokio::test]
async fn metrics_sum_the_replicas_and_show_each_one() {
    let h = setup(Script::Hash).replicas(2).blocks(40).build();
    h.replicas[1].paused.send_replace(true);
    h.replicas[0].paused.send_replace(true);
    let a = hold_stream(&h).await;
    let b = hold_stream(&h).await;
    while h
        .replicas
        .iter()
        .any(|r| r.state.lock().unwrap().outstanding == 0)
    {
        tokio::task::yield_now().await;
    }
    let (_, _, text) = h.get("/metrics").await;
    let m = "model=\"test-model\"";
    assert!(
        text.contains(&format!("cadence_kv_blocks_total{{{m}}} 80\n")),
        "{text}"
    );
    assert!(text.contains("vllm:num_requests_waiting{model_name=\"test-model\"}"));
    for replica in ["0", "1"] {
        assert!(text.contains(&format!(
            "cadence_replica_waiting_requests{{{m},replica=\"{replica}\"}}"
        )));
    }
    for r in &h.replicas {
        r.paused.send_replace(false);
    }
    drop((a, b));
}

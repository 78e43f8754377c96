//! Beam search through the router with the fake shard (`Script::Beams`: each beam row
//! returns its most likely tokens from a distribution the test can read): the answers
//! match a plain search of that distribution written here over whole sequences, with
//! the fake checking that no beam writes a block another holds; beams and ordinary
//! requests share steps; a small cache preempts beams; the blocks all come back; the
//! fields are refused with each API's names.

use super::fake_shard::beam_candidates;
use super::*;

/// What the plain search keeps of a hypothesis: its tokens, score and cumulative logprob.
type Reference = Vec<(Vec<u32>, f32, f32)>;

/// Transformers' beam search, written over whole sequences: the top `2 × width`
/// continuations over all beams; those among the first `width` that end (EOS, the limit)
/// are hypotheses (when there is room under `early` and a running beam could still win),
/// the first `width` that do not are the next beams.
fn plain_search(prompt: &[u32], width: usize, penalty: f32, early: &str, max: usize) -> Reference {
    let eos = testing::eos_id();
    let keep = 2 * width;
    let mut running: Vec<(Vec<u32>, f32)> = vec![(Vec::new(), 0.0)];
    let mut finished: Vec<(Vec<u32>, f32, f32)> = Vec::new();
    let mut may_improve = true;
    for generated in 1..=max {
        let mut all = Vec::new();
        for (tokens, score) in &running {
            let history: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
            for (token, logprob) in beam_candidates(&history).into_iter().take(keep) {
                let mut next = tokens.clone();
                next.push(token);
                all.push((score + logprob, next));
            }
        }
        all.sort_by(|a, b| b.0.total_cmp(&a.0));
        all.truncate(keep);
        let ends = |tokens: &Vec<u32>| generated == max || tokens.last() == Some(&eos);
        let full = early == "true" && finished.len() == width;
        let norm =
            |score: f32, len: usize| (score as f64 / (len as f64).powf(penalty as f64)) as f32;
        for (rank, (score, tokens)) in all.iter().enumerate() {
            if rank < width && ends(tokens) && !full && may_improve {
                finished.push((tokens.clone(), norm(*score, generated), *score));
            }
        }
        finished.sort_by(|a, b| b.1.total_cmp(&a.1));
        finished.truncate(width);
        running = all
            .iter()
            .filter(|(_, t)| !ends(t))
            .take(width)
            .map(|(s, t)| (t.clone(), *s))
            .collect();
        if may_improve {
            let len = if early == "never" && penalty > 0.0 {
                max
            } else {
                generated
            };
            let best = running.first().map_or(-1e9, |r| norm(r.1, len));
            let worst = if finished.len() == width {
                finished[width - 1].1
            } else {
                -1e9
            };
            may_improve = best > worst;
        }
        if running.is_empty() || !may_improve || (early == "true" && finished.len() == width) {
            break;
        }
    }
    finished
}

fn text(tokens: &[u32]) -> String {
    let eos = testing::eos_id();
    tokens
        .iter()
        .filter(|&&t| t != eos)
        .map(|&t| char::from(t as u8))
        .collect()
}

fn logprob_sum(tokens: &Value) -> f32 {
    tokens
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["logprob"].as_f64().unwrap() as f32)
        .sum()
}

fn early_value(early: &str) -> Value {
    match early {
        "true" => json!(true),
        "never" => json!("never"),
        _ => json!(false),
    }
}

/// `/generate` with `num_beams`: the best beam, then the others, against the plain search.
async fn check_generate(
    h: &Harness,
    prompt: &str,
    width: usize,
    penalty: f32,
    early: &str,
    max: usize,
) {
    let body = json!({"inputs": prompt, "parameters": {
        "num_beams": width, "length_penalty": penalty, "early_stopping": early_value(early),
        "max_new_tokens": max, "details": true}});
    let (status, v) = h.post("/generate", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let ids = testing::tokenizer().encode(prompt).unwrap();
    let expected = plain_search(&ids, width, penalty, early, max);
    assert_eq!(expected.len(), width);
    let details = &v["details"];
    let none = Vec::new();
    let others = details["best_of_sequences"].as_array().unwrap_or(&none);
    assert_eq!(others.len(), width - 1, "{v}");
    let answers = std::iter::once((&v["generated_text"], &details["tokens"]))
        .chain(others.iter().map(|o| (&o["generated_text"], &o["tokens"])));
    for (i, ((text_got, tokens), (tokens_want, _, cumulative))) in
        answers.zip(&expected).enumerate()
    {
        let case = format!("width {width} penalty {penalty} early {early} beam {i}");
        assert_eq!(text_got, &text(tokens_want), "{case}: {v}");
        let ids: Vec<u64> = tokens
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_u64().unwrap())
            .collect();
        let want: Vec<u64> = tokens_want.iter().map(|&t| t as u64).collect();
        assert_eq!(ids, want, "{case}");
        assert!((logprob_sum(tokens) - cumulative).abs() < 1e-4, "{case}");
    }
}

#[tokio::test]
async fn beam_answers_match_a_plain_search_for_every_width_penalty_and_early_stopping() {
    let h = setup(Script::Beams).synchronous().build();
    for width in [1, 2, 4, 8] {
        for (penalty, early) in [
            (1.0, "false"),
            (0.0, "true"),
            (2.0, "never"),
            (-1.0, "false"),
        ] {
            check_generate(&h, "hello world, beams", width, penalty, early, 12).await;
        }
    }
    h.assert_protocol_ok();
    let (_, metrics) = h.get_text("/metrics").await;
    assert!(
        metrics.contains("cadence_kv_blocks_used{model=\"test-model\"} 0\n"),
        "{metrics}"
    );
    assert!(metrics.contains("cadence_kv_blocks_shared_by_beams{model=\"test-model\"} 0\n"));
}

#[tokio::test]
async fn beams_and_ordinary_requests_share_steps_and_a_small_cache_preempts_beams() {
    // 12 blocks of 4 tokens: four searches 4 beams wide with ordinary requests beside
    // them do not fit at once. The shard holds the first step until all eight are routed,
    // so they contend for the blocks whatever order they reach the scheduler in. (With
    // 14 blocks, about one order in ten ran the searches one after another and fit.)
    let h = setup(Script::Beams)
        .synchronous()
        .blocks(12)
        .paused()
        .build();
    let prompts: Vec<String> = (0..4)
        .map(|i| format!("prompt number {i} for beams"))
        .collect();
    let searches = prompts
        .iter()
        .map(|prompt| check_generate(&h, prompt, 4, 1.0, "false", 10));
    let ordinary = (0..4).map(|i| {
        let body = json!({"inputs": format!("plain {i}"), "parameters": {"max_new_tokens": 8}});
        h.post("/generate", body)
    });
    let release = async {
        let mut polls = 0;
        while routed_requests(&h).await < 8.0 {
            polls += 1;
            assert!(
                polls < 1_000_000,
                "the eight requests never reached the router"
            );
            tokio::task::yield_now().await;
        }
        h.resume();
    };
    let (_, answers, ()) = tokio::join!(
        futures::future::join_all(searches),
        futures::future::join_all(ordinary),
        release
    );
    for (status, v) in answers {
        assert_eq!(status, StatusCode::OK, "{v}");
    }
    h.assert_protocol_ok();
    let (_, metrics) = h.get_text("/metrics").await;
    assert!(
        metrics.contains("cadence_kv_blocks_used{model=\"test-model\"} 0\n"),
        "{metrics}"
    );
    let preempted = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("cadence_preemptions_total{model=\"test-model\",kind=\"recompute\"} ")
        })
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(preempted > 0.0, "{metrics}");
}

#[tokio::test]
async fn beams_share_the_prompt_blocks_while_they_run() {
    let h = setup(Script::Beams)
        .synchronous()
        .step_delay(Duration::from_millis(5))
        .build();
    // A prompt of several full blocks: every beam points to them.
    let prompt = "a prompt of blocks every beam shares";
    let body = json!({"inputs": prompt, "parameters": {"num_beams": 4, "max_new_tokens": 16}});
    let mut request = Box::pin(h.post("/generate", body));
    let mut shared = 0.0f64;
    let (status, v) = loop {
        tokio::select! {
            answer = &mut request => break answer,
            () = tokio::time::sleep(Duration::from_millis(1)) => {
                let (_, metrics) = h.get_text("/metrics").await;
                let now = metrics
                    .lines()
                    .find_map(|l| {
                        l.strip_prefix("cadence_kv_blocks_shared_by_beams{model=\"test-model\"} ")
                    })
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(0.0);
                shared = shared.max(now);
            }
        }
    };
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(shared >= 3.0, "{shared}");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn beam_fields_are_refused_with_each_apis_names() {
    let h = harness(Script::Beams);
    let p = |params: Value| json!({"inputs": "hi", "parameters": params});
    for (params, needle) in [
        (json!({"num_beams": 0}), "parameters.num_beams"),
        (json!({"num_beams": 33}), "parameters.num_beams"),
        (
            json!({"num_beams": 2, "temperature": 0.7}),
            "parameters.temperature",
        ),
        (
            json!({"num_beams": 2, "do_sample": true}),
            "parameters.do_sample",
        ),
        (json!({"num_beams": 2, "stop": ["x"]}), "parameters.stop"),
        (json!({"length_penalty": 2.0}), "parameters.length_penalty"),
        (json!({"early_stopping": true}), "parameters.early_stopping"),
    ] {
        let (status, v) = h.post("/generate", p(params.clone())).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{params}: {v}");
        assert!(
            v["error"].as_str().unwrap().contains(needle),
            "{params}: {v}"
        );
    }
    let (status, v) = h.post("/generate_stream", p(json!({"num_beams": 2}))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert!(v["error"].as_str().unwrap().contains("num_beams"), "{v}");
    for (body, param) in [
        (
            json!({"use_beam_search": true, "n": 2, "temperature": 0.7}),
            "temperature",
        ),
        (
            json!({"use_beam_search": true, "n": 2, "top_p": 0.5}),
            "top_p",
        ),
        (json!({"use_beam_search": true, "n": 0}), "n"),
        (json!({"use_beam_search": true, "n": 40}), "n"),
        (json!({"use_beam_search": true, "n": 3, "best_of": 2}), "n"),
        (
            json!({"use_beam_search": true, "n": 2, "stream": true}),
            "use_beam_search",
        ),
        (json!({"length_penalty": 0.5}), "length_penalty"),
    ] {
        let mut body = body;
        body["prompt"] = json!("hi");
        let (status, v) = h.post("/v1/completions", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    h.assert_protocol_ok();
}

#[tokio::test]
async fn openai_beams_answer_the_n_best_in_order() {
    let h = setup(Script::Beams).synchronous().chat_template().build();
    let body = json!({"prompt": "hello world, beams", "use_beam_search": true, "n": 2,
                      "best_of": 4, "max_tokens": 12, "temperature": 0, "logprobs": 0});
    let (status, v) = h.post("/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let ids = testing::tokenizer().encode("hello world, beams").unwrap();
    let expected = plain_search(&ids, 4, 1.0, "false", 12);
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{v}");
    for (choice, (tokens, _, _)) in choices.iter().zip(&expected) {
        assert_eq!(choice["text"], text(tokens), "{v}");
    }
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "use_beam_search": true,
                      "n": 3, "max_tokens": 6});
    let (status, v) = h.post("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 3, "{v}");
    h.assert_protocol_ok();
}

/// Requests the router has sent to the (one) replica so far.
async fn routed_requests(h: &Harness) -> f64 {
    let (_, metrics) = h.get_text("/metrics").await;
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("cadence_replica_requests_total{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

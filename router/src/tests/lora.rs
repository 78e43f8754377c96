use super::*;

/// Folders the fake's LoadAdapter knows, and the KV blocks each adapter takes.
const FOLDERS: &[(&str, u32)] = &[("/loras/sql", 3), ("/loras/chat", 2), ("/loras/math", 4)];

/// A router whose fake knows `FOLDERS` (and refuses `/loras/bad`), with `lora` on.
fn lora_setup(lora: LoraConfig) -> Setup {
    let s = setup(Script::Hash).lora(lora);
    for &(folder, blocks) in FOLDERS {
        s.shard.adapters.add(folder, blocks);
    }
    s.shard.adapters.refuse(
        "/loras/bad",
        "DoRA adapters are not supported (use_dora: true)",
    );
    s
}

/// `--lora-adapters` with `names` from `FOLDERS` (sql, chat, math).
fn named(names: &[&str]) -> LoraConfig {
    LoraConfig {
        adapters: names
            .iter()
            .map(|n| (n.to_string(), format!("/loras/{n}").into()))
            .collect(),
        ..Default::default()
    }
}

/// Waits (at most 10 s, so a bug fails instead of hanging) until `done` holds.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "timed out waiting until {what}");
}

fn generate_body(adapter: Option<&str>, max_new_tokens: u32) -> Value {
    json!({"inputs": "Tell me", "parameters": {"max_new_tokens": max_new_tokens,
           "adapter_id": adapter}})
}

/// A temporary `--lora-dir` holding adapter folders `names` (each with its config).
struct LoraDir(std::path::PathBuf);

impl LoraDir {
    fn new(tag: &str, names: &[&str]) -> Self {
        let root = std::env::temp_dir().join(format!("cadence-{tag}-{}", std::process::id()));
        for name in names {
            std::fs::create_dir_all(root.join(name)).unwrap();
            std::fs::write(root.join(name).join("adapter_config.json"), "{}").unwrap();
        }
        Self(root)
    }

    fn folder(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for LoraDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test]
async fn requests_with_mixed_adapters_run_in_one_batch_each_with_its_own_adapter() {
    let h = lora_setup(named(&["sql", "chat"]))
        .step_delay(Duration::from_millis(2))
        .start()
        .await
        .unwrap();
    let adapters = [None, Some("sql"), Some("chat"), Some("sql")];
    // Each alone first: the reference text.
    let mut alone = Vec::new();
    for a in adapters {
        let (status, v) = h.post("/generate", generate_body(a, 24)).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        alone.push(v["generated_text"].as_str().unwrap().to_string());
    }
    assert_ne!(alone[0], alone[1]);
    assert_ne!(alone[1], alone[2]);
    assert_eq!(alone[1], alone[3]);
    // Then together: the same texts, from batches mixing adapters.
    let together = futures::future::join_all(
        adapters
            .iter()
            .map(|&a| h.post("/generate", generate_body(a, 24))),
    )
    .await;
    for ((status, v), want) in together.iter().zip(&alone) {
        assert_eq!(*status, StatusCode::OK, "{v}");
        assert_eq!(v["generated_text"], *want);
    }
    let s = h.shard_state();
    assert!(s.max_step_adapters >= 2, "{}", s.max_step_adapters);
    let mut loaded = s.adapter_loads.clone();
    loaded.sort();
    assert_eq!(loaded, ["chat", "sql"]);
    assert!(s.pages_in >= 2);
    drop(s);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn a_request_waiting_for_its_adapters_load_does_not_hold_back_the_others() {
    let dir = LoraDir::new("lora-slow", &["slow"]);
    let h = lora_setup(LoraConfig {
        dir: Some(dir.0.clone()),
        ..Default::default()
    })
    .build();
    h.shard.adapters.add(&dir.folder("slow"), 2);
    h.shard.adapters.held.send_replace(true);
    let app = h.app.clone();
    let waiting = tokio::spawn(async move {
        send(
            &app,
            post_json("/generate", &generate_body(Some("slow"), 4), None),
        )
        .await
    });
    until("the load started", || {
        h.infer.adapters().status("slow") != crate::lora::Status::Unknown
    })
    .await;
    // The base model's request goes by while the load is held.
    let (status, v) = h.post("/generate", generate_body(None, 4)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(!waiting.is_finished());
    assert_eq!(h.shard_state().pages_in, 0);
    h.shard.adapters.held.send_replace(false);
    let (status, _, text) = waiting.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(h.shard_state().pages_in, 1);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn unknown_adapters_are_a_404_on_openai_and_a_422_on_tgi_when_lora_is_on() {
    let h = lora_setup(named(&["sql"])).start().await.unwrap();
    let (status, v) = h
        .post(
            "/v1/completions",
            json!({"model": "nope", "prompt": "hi", "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        v["error"],
        json!({"message": "The model `nope` does not exist.", "type": "NotFoundError",
               "param": "model", "code": 404})
    );
    let (status, v) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (StatusCode::NOT_FOUND, &json!("model"))
    );
    expect_422(&h, generate_body(Some("nope"), 2), "parameters.adapter_id").await;
    // The base model by either name, and the adapter, whose name the answer carries.
    for (model, answered) in [("test-model", "test-model"), ("sql", "sql")] {
        let body = json!({"model": model, "prompt": "hi", "max_tokens": 2});
        let (status, v) = h.post("/v1/completions", body).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!(v["model"], answered);
    }
    let (status, v) = h
        .post("/generate", generate_body(Some("test-model"), 2))
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn without_lora_options_only_the_base_models_names_are_served_and_adapter_ids_are_refused() {
    let h = harness(Script::Hash);
    let body = json!({"model": "whatever-a-client-sends", "prompt": "hi", "max_tokens": 2});
    let (status, v) = h.post("/v1/completions", body).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(
        v["error"]["message"],
        "The model `whatever-a-client-sends` does not exist."
    );
    let body = json!({"model": "test-model", "prompt": "hi", "max_tokens": 2});
    let (status, v) = h.post("/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["model"], "test-model");
    expect_422(&h, generate_body(Some("sql"), 2), "no adapters are loaded").await;
    let (status, _) = h
        .post_raw("/v1/load_lora_adapter", "{}", Some("application/json"))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, _, text) = h.get("/metrics").await;
    assert!(!text.contains("lora"), "no LoRA series without LoRA");
    let (_, _, text) = h.get("/info").await;
    assert!(!text.contains("\"lora\""), "{text}");
}

/// The plain-text answer of a POST with a JSON body.
async fn post_text(h: &Harness, path: &str, body: Value) -> (StatusCode, String) {
    h.post_raw(path, &body.to_string(), Some("application/json"))
        .await
}

#[tokio::test]
async fn runtime_loading_and_unloading_answer_as_vllm_does() {
    let h = lora_setup(LoraConfig {
        allow_runtime: true,
        ..Default::default()
    })
    .build();
    let load = |name: &str, path: &str| json!({"lora_name": name, "lora_path": path});
    let (status, text) = post_text(&h, "/v1/load_lora_adapter", load("sql", "/loras/sql")).await;
    assert_eq!(
        (status, text.as_str()),
        (
            StatusCode::OK,
            "Success: LoRA adapter 'sql' added successfully."
        )
    );
    let (_, v) = h.get_json("/v1/models").await;
    assert_eq!(
        v["data"][1],
        json!({"id": "sql", "object": "model", "created": 0, "owned_by": "cadence",
               "root": "/loras/sql", "parent": "test-model"})
    );
    assert_eq!(v["data"][0]["parent"], Value::Null);
    let (status, v) = h
        .post("/v1/load_lora_adapter", load("sql", "/loras/chat"))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        v["error"]["message"],
        "The lora adapter 'sql' has already been loaded."
    );
    let (status, v) = h
        .post("/v1/load_lora_adapter", json!({"lora_name": "x"}))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    // The shards' refusal is a 400 with their reason; the name stays free.
    let (status, v) = h
        .post("/v1/load_lora_adapter", load("bad", "/loras/bad"))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("use_dora"), "{message}");
    let (_, v) = h.get_json("/v1/models").await;
    assert_eq!(v["data"].as_array().unwrap().len(), 2, "{v}");
    let (status, _) = h.post("/generate", generate_body(Some("bad"), 2)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    // A request with it, then unloaded: 404 after, and its host copy dropped.
    let (status, _) = h.post("/generate", generate_body(Some("sql"), 2)).await;
    assert_eq!(status, StatusCode::OK);
    let (status, text) =
        post_text(&h, "/v1/unload_lora_adapter", json!({"lora_name": "sql"})).await;
    assert_eq!(
        (status, text.as_str()),
        (
            StatusCode::OK,
            "Success: LoRA adapter 'sql' removed successfully."
        )
    );
    let (status, v) = h
        .post("/v1/unload_lora_adapter", json!({"lora_name": "sql"}))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        v["error"]["message"],
        "The lora adapter 'sql' cannot be found."
    );
    let body = json!({"model": "sql", "prompt": "hi", "max_tokens": 2});
    assert_eq!(
        h.post("/v1/completions", body).await.0,
        StatusCode::NOT_FOUND
    );
    until("sql is dropped and forgotten", || {
        h.shard_state().adapter_drops == ["sql"]
            && h.infer.adapters().status("sql") == crate::lora::Status::Unknown
    })
    .await;
    // Loaded again under the same name from another folder.
    let (status, text) = post_text(&h, "/v1/load_lora_adapter", load("sql", "/loras/math")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let (status, v) = h.post("/generate", generate_body(Some("sql"), 2)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn an_adapter_unloaded_while_its_request_runs_waits_for_it_to_finish() {
    let h = lora_setup(LoraConfig {
        allow_runtime: true,
        ..named(&["sql"])
    })
    .step_delay(Duration::from_millis(2))
    .start()
    .await
    .unwrap();
    let (_, alone) = h.post("/generate", generate_body(Some("sql"), 30)).await;
    let app = h.app.clone();
    let running = tokio::spawn(async move {
        send(
            &app,
            post_json("/generate", &generate_body(Some("sql"), 30), None),
        )
        .await
    });
    until("the second request runs", || {
        h.shard_state().joined_request_ids.len() == 2
    })
    .await;
    let (status, _) = post_text(&h, "/v1/unload_lora_adapter", json!({"lora_name": "sql"})).await;
    assert_eq!(status, StatusCode::OK);
    // A new request cannot name it; the running one finishes with its adapter.
    let (status, _) = h.post("/generate", generate_body(Some("sql"), 2)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let (status, _, text) = running.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["generated_text"], alone["generated_text"]);
    until("sql is paged out and dropped", || {
        let s = h.shard_state();
        s.paged.is_empty() && s.adapter_drops == ["sql"]
    })
    .await;
    h.assert_protocol_ok();
}

#[tokio::test]
async fn the_lora_dir_resolves_an_unknown_name_on_first_use_and_a_refusal_fails_only_its_request() {
    let dir = LoraDir::new("lora-dir", &["good", "bad"]);
    let h = lora_setup(LoraConfig {
        dir: Some(dir.0.clone()),
        ..Default::default()
    })
    .build();
    h.shard.adapters.add(&dir.folder("good"), 2);
    h.shard
        .adapters
        .refuse(&dir.folder("bad"), "unknown module fc9");
    let body = |model: &str| json!({"model": model, "prompt": "hi", "max_tokens": 3});
    let (status, v) = h.post("/v1/completions", body("good")).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["model"], "good");
    let (_, models) = h.get_json("/v1/models").await;
    assert_eq!(models["data"][1]["root"], dir.folder("good"));
    for missing in ["missing", "..", "good/../good"] {
        let (status, v) = h.post("/v1/completions", body(missing)).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{missing}: {v}");
    }
    // The shards refuse it: that request fails naming why, the server goes on.
    let (status, v) = h.post("/v1/completions", body("bad")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("unknown module fc9"), "{message}");
    assert_eq!(v["error"]["param"], "model");
    let (status, v) = h.post("/v1/completions", body("good")).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(h.shard_state().adapter_loads, ["good", "bad"]);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn a_start_adapter_the_shards_refuse_stops_the_start_with_their_reason() {
    let config = LoraConfig {
        adapters: vec![
            ("sql".into(), "/loras/sql".into()),
            ("dora".into(), "/loras/bad".into()),
        ],
        ..Default::default()
    };
    let Err(why) = lora_setup(config).start().await else {
        panic!("a refused adapter must stop the start");
    };
    assert!(
        why.contains("\"dora\"") && why.contains("use_dora"),
        "{why}"
    );
}

#[tokio::test]
async fn past_max_cpu_adapters_the_least_recently_used_idle_host_copy_is_dropped() {
    let h = lora_setup(LoraConfig {
        max_cpu_adapters: 1,
        ..named(&["sql", "chat"])
    })
    .start()
    .await
    .unwrap();
    // Two loaded, one allowed: the one loaded first (neither used yet) goes.
    until("one adapter is dropped", || {
        h.shard_state().adapter_drops.len() == 1
    })
    .await;
    let dropped = h.shard_state().adapter_drops[0].clone();
    let kept = if dropped == "sql" { "chat" } else { "sql" };
    // The dropped one loads again when a request names it; the other is idle but not
    // paged in, so it goes.
    let (status, v) = h.post("/generate", generate_body(Some(&dropped), 2)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    until("the other is dropped", || {
        h.shard_state().adapter_drops.len() == 2
    })
    .await;
    let s = h.shard_state();
    assert_eq!(s.adapter_drops[1], kept);
    assert_eq!(s.adapter_loads.iter().filter(|&n| *n == dropped).count(), 2);
    drop(s);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn metrics_and_info_show_the_adapters() {
    let h = lora_setup(named(&["sql", "chat"]))
        .step_delay(Duration::from_millis(2))
        .start()
        .await
        .unwrap();
    let app = h.app.clone();
    let running = tokio::spawn(async move {
        send(
            &app,
            post_json("/generate", &generate_body(Some("sql"), 40), None),
        )
        .await
    });
    let seen = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let (_, text) = h.get_text("/metrics").await;
            if text.contains("running_lora_adapters=\"sql\"") {
                return text;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("sql among the running adapters");
    let info = seen
        .lines()
        .find(|l| l.starts_with("vllm:lora_requests_info{"))
        .unwrap();
    assert!(info.starts_with(
        "vllm:lora_requests_info{max_lora=\"32\",running_lora_adapters=\"sql\",waiting_lora_adapters=\"\"} "
    ));
    let stamp: f64 = info.rsplit_once(' ').unwrap().1.parse().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(stamp > 1.0e9 && stamp <= now, "a unix time: {stamp}");
    running.await.unwrap();
    h.post("/generate", generate_body(Some("chat"), 2)).await;
    let (_, text) = h.get_text("/metrics").await;
    let value = |name: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{")))
            .unwrap_or_else(|| panic!("{name} missing"));
        line.rsplit_once(' ').unwrap().1.parse().unwrap()
    };
    assert_eq!(value("cadence_lora_adapter_loads_total"), 2.0);
    assert_eq!(value("cadence_lora_adapter_page_ins_total"), 2.0);
    assert_eq!(value("cadence_lora_adapters_host"), 2.0);
    // Both idle but resident: 3 + 2 blocks, counted as used.
    assert_eq!(value("cadence_lora_adapters_resident"), 2.0);
    assert_eq!(value("cadence_lora_adapter_blocks"), 5.0);
    assert_eq!(value("cadence_lora_adapter_evictions_total"), 0.0);
    assert!(value("cadence_kv_blocks_used") >= 5.0);
    let (_, v) = h.get_json("/info").await;
    assert_eq!(
        v["lora"],
        json!({"adapters": ["chat", "sql"], "max_cpu_adapters": 64,
               "max_adapters_per_batch": 32, "lora_dir": null, "runtime_loading": false})
    );
    h.assert_protocol_ok();
}

#[tokio::test]
async fn an_adapter_too_large_for_the_cache_with_its_request_fails_that_request_clearly() {
    // 16 blocks of 4 tokens; "math" takes 4, so a request needing 13 KV blocks cannot fit.
    let h = lora_setup(named(&["math"]))
        .blocks(16)
        .start()
        .await
        .unwrap();
    let body = json!({"inputs": "x".repeat(40), "parameters": {"max_new_tokens": 12,
                      "adapter_id": "math"}});
    let (status, v) = h.post("/generate", body).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    let message = v["error"].as_str().unwrap();
    assert!(message.contains("\"math\" takes 4 KV blocks"), "{message}");
    let (status, _) = h.post("/generate", generate_body(Some("math"), 2)).await;
    assert_eq!(status, StatusCode::OK);
    h.assert_protocol_ok();
}

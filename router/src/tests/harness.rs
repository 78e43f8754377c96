//! The harness of the end-to-end tests: `Setup` / `Harness`, a router in front of a
//! `FakeShard`, and the helpers that send it requests and read its answers.

use super::*;

/// The grammar compiler over the test tokenizer.
pub(super) fn testing_constraints() -> Constraints {
    let tokenizer = testing::tokenizer();
    let env = tok_env(
        tokenizer.tokenizer.clone(),
        tokenizer.vocab_size(),
        &[testing::eos_id()],
    )?;
    Ok(Arc::new(Compiler::new(&env, Duration::from_secs(5))?))
}

pub(super) struct Harness {
    pub(super) app: Router,
    /// Replica 0's shard.
    pub(super) shard: FakeShard,
    /// Every replica's shard, in replica order (`shard` first).
    pub(super) replicas: Vec<FakeShard>,
    pub(super) infer: Infer,
}

/// A router in front of a `FakeShard`, configured by chaining: 64 KV blocks, 16
/// concurrent requests, 64 waiting, 32 tokens per step, no step delay unless changed.
pub(super) struct Setup {
    pub(super) shard: FakeShard,
    pub(super) max_concurrent: usize,
    pub(super) max_waiting: usize,
    pub(super) async_scheduling: bool,
    pub(super) chat: Option<Arc<ChatTemplate>>,
    /// `--reasoning-parser`.
    pub(super) reasoning: Option<crate::reasoning::ReasoningParser>,
    pub(super) served_model_name: String,
    /// `--ready-stall-timeout-ms`.
    pub(super) stall_timeout: Duration,
    /// Shard groups behind the router (`--replicas`), each a fake like `shard`.
    pub(super) replicas: usize,
    /// Speculative decoding (`--speculative`).
    pub(super) speculative: Option<SpeculativeConfig>,
    /// The LoRA flags.
    pub(super) lora: LoraConfig,
    /// The API keys' tenants (`--api-key-file`, `--max-concurrent-requests-per-key`).
    pub(super) tenants: Option<Arc<crate::tenants::Tenants>>,
}

pub(super) fn setup(script: Script) -> Setup {
    Setup {
        shard: FakeShard::new(script, 64),
        max_concurrent: 16,
        max_waiting: 64,
        async_scheduling: true,
        chat: None,
        reasoning: None,
        served_model_name: "test-model".into(),
        stall_timeout: Duration::from_secs(5),
        replicas: 1,
        speculative: None,
        lora: LoraConfig::default(),
        tenants: None,
    }
}

pub(super) fn harness(script: Script) -> Harness {
    setup(script).build()
}

impl Setup {
    pub(super) fn blocks(mut self, num_blocks: usize) -> Self {
        self.shard.num_blocks = num_blocks;
        self
    }

    pub(super) fn max_concurrent(mut self, requests: usize) -> Self {
        self.max_concurrent = requests;
        self
    }

    pub(super) fn max_waiting(mut self, requests: usize) -> Self {
        self.max_waiting = requests;
        self
    }

    /// The shard holds every step until `Harness::resume`.
    pub(super) fn paused(self) -> Self {
        self.shard.paused.send_replace(true);
        self
    }

    /// Each step scheduled only after the previous one's tokens are back.
    pub(super) fn synchronous(mut self) -> Self {
        self.async_scheduling = false;
        self
    }

    /// A chat template (`role: content` lines, then `assistant:`).
    pub(super) fn chat_template(self) -> Self {
        self.chat_template_source(
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:",
        )
    }

    pub(super) fn chat_template_source(mut self, template: &str) -> Self {
        let chat = ChatTemplate::new(template.into(), "<|bos|>".into(), testing::EOS.into());
        self.chat = Some(Arc::new(chat.unwrap()));
        self
    }

    pub(super) fn reasoning_parser(mut self, parser: crate::reasoning::ReasoningParser) -> Self {
        self.reasoning = Some(parser);
        self
    }

    /// The names clients know the model by (`--served-model-name`, comma-separated).
    pub(super) fn served_model_name(mut self, name: &str) -> Self {
        self.served_model_name = name.into();
        self
    }

    /// How long a step may be awaited before `/ready` asks whether it is stalled.
    pub(super) fn stall_timeout(mut self, timeout: Duration) -> Self {
        self.stall_timeout = timeout;
        self
    }

    /// `n` shard groups behind the router, each a fake with the same script and blocks.
    pub(super) fn replicas(mut self, n: usize) -> Self {
        self.replicas = n;
        self
    }

    /// Speculative decoding by `method`, up to `k` proposals per request, while a step
    /// holds at most `max_step_tokens` tokens.
    pub(super) fn speculative(
        mut self,
        method: SpeculativeMethod,
        k: usize,
        max_step_tokens: usize,
    ) -> Self {
        self.speculative = Some(SpeculativeConfig {
            method,
            max_tokens: k,
            ngram_min: 1,
            ngram_max: 3,
            max_step_tokens,
        });
        self
    }

    /// The LoRA flags (`--lora-adapters` are loaded by `start`).
    pub(super) fn lora(mut self, config: LoraConfig) -> Self {
        self.lora = config;
        self
    }

    /// Builds the harness and loads the `--lora-adapters`, as the router's start does.
    pub(super) async fn start(self) -> Result<Harness, String> {
        let h = self.build();
        h.infer.adapters().load_at_start().await?;
        Ok(h)
    }

    /// How long each step takes (so requests stay in flight a while).
    pub(super) fn step_delay(mut self, delay: Duration) -> Self {
        self.shard.delay = delay;
        self
    }

    pub(super) fn build(self) -> Harness {
        let Setup {
            shard,
            max_concurrent,
            max_waiting,
            async_scheduling,
            chat,
            reasoning,
            served_model_name,
            stall_timeout,
            replicas,
            speculative,
            lora,
            tenants,
        } = self;
        let limits = Limits {
            max_input_tokens: 48,
            max_total_tokens: 64,
            max_stop_sequences: 2,
            max_top_n_tokens: 5,
            max_best_of: 4,
            block_size: BLOCK_SIZE,
            num_blocks: shard.num_blocks,
        };
        // As `--served-model-name a,b` gives them: the first is the one answers report.
        let served_model_names: Vec<String> =
            served_model_name.split(',').map(String::from).collect();
        let served_model_name = served_model_names[0].clone();
        let info = Info {
            model_id: "test-model".into(),
            served_model_name: served_model_names[0].clone(),
            served_model_names: served_model_names.clone(),
            model_dtype: "float32".into(),
            model_device_type: "cpu".into(),
            model_pipeline_tag: "text-generation",
            max_input_tokens: limits.max_input_tokens,
            max_total_tokens: limits.max_total_tokens,
            max_batch_tokens: MAX_BATCH_TOKENS,
            max_batch_size: MAX_BATCH_SIZE,
            max_concurrent_requests: max_concurrent,
            scheduling_policy: "fcfs",
            max_best_of: limits.max_best_of,
            max_stop_sequences: limits.max_stop_sequences,
            max_top_n_tokens: limits.max_top_n_tokens,
            block_size: BLOCK_SIZE,
            num_blocks: shard.num_blocks,
            world_size: 1,
            replicas,
            kernels: [("isa".to_string(), "scalar".to_string())].into(),
            quantization: [("weights".to_string(), "float32".to_string())].into(),
            speculative: Default::default(),
            lora: None,
            version: "test",
            router: "cadence",
        };
        let validation = Validation {
            tokenizer: testing::tokenizer(),
            limits,
            model_id: "test-model".into(),
            constraints: testing_constraints(),
        };
        let mut scheduler = SchedulerConfig::new(
            MAX_BATCH_TOKENS,
            MAX_BATCH_SIZE,
            shard.num_blocks,
            BLOCK_SIZE,
        );
        scheduler.speculative_max_step_tokens = speculative.map_or(0, |s| s.max_step_tokens);
        scheduler.max_adapters_per_batch = lora.max_adapters_per_batch;
        let fakes: Vec<FakeShard> = std::iter::once(shard.clone())
            .chain((1..replicas).map(|_| {
                let mut other = FakeShard::new(shard.script.clone(), shard.num_blocks);
                other.delay = shard.delay;
                other.adapters = shard.adapters.clone();
                other
            }))
            .collect();
        let groups = fakes
            .iter()
            .map(|f| Arc::new(f.clone()) as Arc<dyn AdapterShards>)
            .collect();
        let adapters = Registry::new(lora, groups);
        let config = LoopConfig {
            scheduler,
            eos_token_ids: vec![testing::eos_id()],
            max_waiting_requests: max_waiting,
            served_model_name,
            async_scheduling,
            mask_shape: MaskShape {
                logits_width: testing::tokenizer().vocab_size(),
                eos: vec![testing::eos_id()].into(),
            },
            grammar_fast_forward: true,
            speculative,
            adapters,
        };
        let loops = fakes.iter().map(|f| (f.clone(), config.clone())).collect();
        let mut infer = Infer::spawn_replicas(loops, validation, max_concurrent);
        if let Some(tenants) = tenants {
            infer = infer.with_tenants(tenants);
        }
        let probes = fakes
            .iter()
            .map(|f| Arc::new(f.clone()) as Arc<dyn HealthProbe>)
            .collect();
        let mut readiness = Readiness::for_replicas(probes, stall_timeout);
        // A silent fake never answers: no need to wait the production second for it.
        readiness.probe_timeout = Duration::from_millis(20);
        let app = router(
            AppState {
                infer: infer.clone(),
                info,
                shards: Vec::new(),
                chat,
                reasoning,
                readiness,
                responses: Default::default(),
            },
            Router::new(),
        );
        Harness {
            app,
            shard,
            replicas: fakes,
            infer,
        }
    }
}

impl Harness {
    pub(super) async fn send(&self, request: Request<Body>) -> (StatusCode, HeaderMap, String) {
        send(&self.app, request).await
    }

    pub(super) async fn get(&self, path: &str) -> (StatusCode, HeaderMap, String) {
        self.send(get(path)).await
    }

    pub(super) async fn get_text(&self, path: &str) -> (StatusCode, String) {
        let (status, _, text) = self.get(path).await;
        (status, text)
    }

    pub(super) async fn get_json(&self, path: &str) -> (StatusCode, Value) {
        let (status, text) = self.get_text(path).await;
        let value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        (status, value)
    }

    pub(super) async fn post_raw(
        &self,
        path: &str,
        body: &str,
        content_type: Option<&str>,
    ) -> (StatusCode, String) {
        let mut req = Request::post(path);
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        let (status, _, text) = self
            .send(req.body(Body::from(body.to_string())).unwrap())
            .await;
        (status, text)
    }

    pub(super) async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        let (status, text) = self
            .post_raw(path, &body.to_string(), Some("application/json"))
            .await;
        let value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        (status, value)
    }

    pub(super) async fn stream(&self, body: Value) -> (StatusCode, Vec<Value>) {
        let (status, text) = self
            .post_raw(
                "/generate_stream",
                &body.to_string(),
                Some("application/json"),
            )
            .await;
        let events = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| serde_json::from_str(d.trim()).unwrap())
            .collect();
        (status, events)
    }

    pub(super) fn shard_state(&self) -> MutexGuard<'_, FakeState> {
        self.shard.state.lock().unwrap()
    }

    /// Lets the paused shard run its steps.
    pub(super) fn resume(&self) {
        self.shard.paused.send_replace(false);
    }

    /// What the fake answers to `Health` from now on.
    pub(super) fn set_health(&self, health: FakeHealth) {
        *self.shard.health.lock().unwrap() = health;
    }

    /// `/ready`'s status and its `reason` (empty when ready).
    pub(super) async fn ready(&self) -> (StatusCode, String) {
        let (status, _, text) = self.get("/ready").await;
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{text}"));
        let reason = v["reason"].as_str().unwrap_or_default().to_string();
        (status, reason)
    }

    /// Waits until the paused shard holds `n` steps.
    pub(super) async fn until_steps_held(&self, n: usize) {
        while self.shard_state().outstanding < n {
            tokio::task::yield_now().await;
        }
    }

    pub(super) fn assert_protocol_ok(&self) {
        let s = self.shard_state();
        assert!(s.violations.is_empty(), "{:?}", s.violations);
    }
}

/// Sends `request` to `app`: status, headers and body text.
pub(super) async fn send(app: &Router, request: Request<Body>) -> (StatusCode, HeaderMap, String) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, headers, String::from_utf8(bytes.to_vec()).unwrap())
}

pub(super) fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

pub(super) fn post_json(path: &str, body: &Value, key: Option<&str>) -> Request<Body> {
    let mut b = Request::post(path).header("content-type", "application/json");
    if let Some(key) = key {
        b = b.header("authorization", format!("Bearer {key}"));
    }
    b.body(Body::from(body.to_string())).unwrap()
}

/// `text`'s token ids, without the BOS token the tokenizer adds.
pub(super) fn ids(text: &str) -> Vec<u32> {
    testing::tokenizer().encode(text).unwrap()[1..].to_vec()
}

/// How many tokens the router counts for prompt `text` (BOS included).
pub(super) fn prompt_tokens(text: &str) -> usize {
    ids(text).len() + 1
}

pub(super) async fn expect_422(h: &Harness, body: Value, needle: &str) {
    for path in ["/generate", "/generate_stream"] {
        let (status, v) = h.post(path, body.clone()).await;
        assert_eq!(
            status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{path} {body}: {v}"
        );
        assert_eq!(v["error_type"], "validation", "{v}");
        let msg = v["error"].as_str().unwrap();
        assert!(
            msg.contains(needle),
            "{path}: {msg:?} should name {needle:?}"
        );
    }
}

/// Reads a streamed answer to its end: its `data:` events.
pub(super) async fn stream_events(response: axum::response::Response) -> Vec<String> {
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim().to_string())
        .collect()
}

/// Starts a stream of two tokens and returns its response, the body unread.
pub(super) async fn hold_stream(h: &Harness) -> axum::response::Response {
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 2}});
    let response = h
        .app
        .clone()
        .oneshot(post_json("/generate_stream", &body, None))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    response
}

/// The chunks of an OpenAI stream (it must end with `[DONE]`, left out), and its headers.
pub(super) async fn openai_stream(h: &Harness, path: &str, body: Value) -> (HeaderMap, Vec<Value>) {
    let (status, headers, text) = h.send(post_json(path, &body, None)).await;
    assert_eq!(status, StatusCode::OK, "{body}: {text}");
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let chunks = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    (headers, chunks)
}

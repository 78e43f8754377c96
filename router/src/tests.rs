//! Tests of the whole router without a shard process: the HTTP routes, validation, the
//! batching loop and the Step protocol, against `FakeShard`, an in-memory shard that
//! checks every diff it receives and generates tokens as a pure function of each
//! request's token history (so recompute preemption must reproduce the same output).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::api::{AppState, Info};
use crate::args::Limits;
use crate::chat::ChatTemplate;
use crate::client::{Backend, ShardHealth};
use crate::constraints::{tok_env, Compiler, MaskShape};
use crate::detokenize::testing;
use crate::error::ShardError;
use crate::infer::{Infer, LoopConfig, SpeculativeConfig, SpeculativeMethod};
use crate::lora::{AdapterShards, LoraConfig, Registry, Reply};
use crate::pb;
use crate::readiness::{HealthProbe, Readiness};
use crate::scheduler::SchedulerConfig;
use crate::server::router;
use crate::validation::{Constraints, Validation};

/// Anthropic's Messages API.
mod anthropic;
/// `/health`, `/ready`, the drain, and what gateways read.
mod lifecycle;
/// LoRA adapters: host loads, paging into the KV pool, the HTTP surface.
mod lora;
/// Several shard groups behind one router.
mod replicas;
/// The request id from HTTP to the shard.
mod request_ids;
/// Proposals verified in one forward (speculative decoding).
mod speculative;
/// API keys' tenants: accounting and per-key limits.
mod tenants;

/// The grammar compiler over the test tokenizer.
fn testing_constraints() -> Constraints {
    let tokenizer = testing::tokenizer();
    let env = tok_env(
        tokenizer.tokenizer.clone(),
        tokenizer.vocab_size(),
        &[testing::eos_id()],
    )?;
    Ok(Arc::new(Compiler::new(&env, Duration::from_secs(5))?))
}

const BLOCK_SIZE: usize = 4;
const MAX_BATCH_TOKENS: usize = 32;
const MAX_BATCH_SIZE: usize = 8;

#[derive(Default)]
struct FakeRequest {
    tokens: Vec<u32>,
    prompt_len: usize,
    computed: usize,
    blocks: Vec<u32>,
    seed: u64,
    /// Return the prompt's logprobs with the first token (each -1.0).
    prompt_logprobs: bool,
    /// Its LoRA adapter ("" = the base model): mixed into its tokens.
    adapter: String,
}

/// How the fake picks tokens.
#[derive(Clone)]
enum Script {
    /// A function of the whole token history: lowercase letters.
    Hash,
    /// The n-th generated token is `tokens[n % len]`.
    Fixed(Vec<u32>),
    /// Like `Hash`, with the request's sampling seed mixed in (parallel samples differ).
    Seeded,
}

#[derive(Default)]
struct FakeState {
    requests: HashMap<u64, FakeRequest>,
    /// Protocol violations seen (the test asserts none).
    violations: Vec<String>,
    /// Requests ever removed, in order.
    removed: Vec<u64>,
    /// Fail the next this-many steps.
    fail_steps: usize,
    steps: usize,
    max_live_blocks: usize,
    /// Prompt positions computed, over every step.
    prompt_computed: usize,
    /// Steps handed over (by `step` calls) and run: like the shards, steps run in the
    /// order they were handed over, whatever order their futures are polled in.
    handed_over: u64,
    run: u64,
    /// Ended sessions: a step handed over in an earlier session fails, as on a stream the
    /// router has closed.
    session: u64,
    /// A step failed: the session is over until the router ends it (a step sent ahead
    /// of the failure fails too).
    broken: bool,
    /// Step calls received and not yet answered, and the most at once.
    outstanding: usize,
    max_outstanding: usize,
    /// Tokens received as forced (fast-forwarded) by continuing requests.
    forced: usize,
    /// The `request_id` of every request that joined, in order.
    joined_request_ids: Vec<String>,
    /// Speculative decoding: proposals verified, and accepted.
    proposed: usize,
    accepted: usize,
    /// LoRA adapters parsed into host memory (the blocks each takes), and those paged
    /// into the pool (their blocks).
    host_adapters: HashMap<String, u32>,
    paged: HashMap<String, Vec<u32>>,
    /// LoadAdapter calls answered (refusals included), DropAdapter calls, in order.
    adapter_loads: Vec<String>,
    adapter_drops: Vec<String>,
    /// Adapters paged in and out over every step.
    pages_in: usize,
    pages_out: usize,
    /// The most distinct adapters among the requests one step computed.
    max_step_adapters: usize,
}

/// What the fake's LoadAdapter makes of each adapter folder (shared by every replica's
/// fake, as the folders are).
#[derive(Clone, Default)]
struct FakeAdapters {
    /// Folder -> KV blocks its weights take, or the refusal's message.
    folders: Arc<Mutex<HashMap<String, Result<u32, String>>>>,
    /// While true, LoadAdapter waits (a slow load).
    held: Arc<tokio::sync::watch::Sender<bool>>,
}

impl FakeAdapters {
    fn add(&self, folder: &str, num_blocks: u32) {
        self.folders
            .lock()
            .unwrap()
            .insert(folder.into(), Ok(num_blocks));
    }

    fn refuse(&self, folder: &str, why: &str) {
        self.folders
            .lock()
            .unwrap()
            .insert(folder.into(), Err(why.into()));
    }
}

/// What the fake answers to `Health`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FakeHealth {
    Ready,
    /// Up, its KV cache not allocated yet.
    NotReady,
    /// The call fails (a shard that is gone).
    Fails,
    /// No answer ever (a frozen shard).
    Silent,
    /// Answers ready, its heartbeats standing still (a wedged forward).
    Wedged,
}

#[derive(Clone)]
struct FakeShard {
    state: Arc<Mutex<FakeState>>,
    /// One step at a time, as the shard's forward thread.
    executor: Arc<tokio::sync::Mutex<()>>,
    script: Script,
    num_blocks: usize,
    delay: Duration,
    /// While true, every step waits (its requests stay in flight until the test resumes).
    paused: Arc<tokio::sync::watch::Sender<bool>>,
    /// Answered to `Health`, whatever the steps do (as the shards' event loop).
    health: Arc<Mutex<FakeHealth>>,
    /// The forward heartbeats `Health` reports.
    heartbeats: Arc<std::sync::atomic::AtomicU64>,
    /// The adapter folders LoadAdapter finds.
    adapters: FakeAdapters,
}

impl FakeShard {
    fn new(script: Script, num_blocks: usize) -> Self {
        Self {
            state: Arc::default(),
            executor: Arc::default(),
            script,
            num_blocks,
            delay: Duration::ZERO,
            paused: Arc::new(tokio::sync::watch::channel(false).0),
            health: Arc::new(Mutex::new(FakeHealth::Ready)),
            heartbeats: Arc::default(),
            adapters: FakeAdapters::default(),
        }
    }

    fn next_token(&self, r: &FakeRequest) -> u32 {
        self.token_after(r, &r.tokens)
    }

    /// The token the fake samples after `tokens` (a prefix of `r`'s).
    fn token_after(&self, r: &FakeRequest, tokens: &[u32]) -> u32 {
        match &self.script {
            Script::Hash | Script::Seeded => {
                let mut h: u64 = 0xcbf29ce484222325;
                if matches!(self.script, Script::Seeded) {
                    h = (h ^ r.seed).wrapping_mul(0x100000001b3);
                }
                // An adapter changes the model, so its tokens.
                for b in r.adapter.bytes() {
                    h = (h ^ b as u64).wrapping_mul(0x100000001b3);
                }
                for &t in tokens {
                    h = (h ^ t as u64).wrapping_mul(0x100000001b3);
                }
                b'a' as u32 + (h % 26) as u32
            }
            Script::Fixed(fixed) => fixed[(tokens.len() - r.prompt_len) % fixed.len()],
        }
    }

    /// The fake draft model's proposals after `r`'s tokens: the model's own tokens, except
    /// at every third position, where it is off by one (so some are rejected).
    fn draft(&self, r: &FakeRequest, k: usize) -> Vec<u32> {
        let mut tokens = r.tokens.clone();
        for _ in 0..k {
            let mut t = self.token_after(r, &tokens);
            if tokens.len().is_multiple_of(3) {
                t += 1;
            }
            tokens.push(t);
        }
        tokens.split_off(r.tokens.len())
    }

    /// Verifies request `r`'s `k` proposals (its last `k` known tokens, after the last
    /// sampled one) as the shards do, greedily: the accepted ones and the model's own next
    /// token; cuts its tokens, computed count and blocks to the verified ones.
    fn verify(&self, r: &mut FakeRequest, k: usize) -> (Vec<u32>, usize) {
        let first = r.tokens.len() - k; // index of the first proposal
        let mut out = Vec::new();
        for j in 0..=k {
            let token = self.token_after(r, &r.tokens[..first + j]);
            out.push(token);
            if j == k || token != r.tokens[first + j] {
                break;
            }
        }
        let accepted = out.len() - 1;
        r.tokens.truncate(first + accepted);
        r.computed = first + accepted;
        r.blocks.truncate(r.computed.div_ceil(BLOCK_SIZE));
        r.tokens.push(*out.last().expect("one token at least"));
        (out, accepted)
    }

    /// `token` if the mask allows it, else the next allowed id above it (wrapping).
    fn masked(token: u32, mask: Option<&pb::AllowedTokens>) -> u32 {
        let Some(mask) = mask else {
            return token;
        };
        let words: Vec<u32> = mask
            .words
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let width = words.len() as u32 * 32;
        let ok = |t: u32| words[t as usize / 32] >> (t % 32) & 1 == 1;
        (0..width)
            .map(|i| (token + i) % width)
            .find(|&t| ok(t))
            .expect("the router never sends an empty mask")
    }

    fn apply(&self, s: &mut FakeState, req: pb::StepRequest) -> pb::StepResponse {
        for a in &req.allowed {
            if !req.joined.iter().any(|j| j.id == a.id)
                && !req.continuing.iter().any(|c| c.id == a.id)
            {
                s.violations
                    .push(format!("a mask for request {} not in the step", a.id));
            }
        }
        let mut v = Vec::new();
        for id in &req.removed {
            if s.requests.remove(id).is_none() {
                v.push(format!("removed unknown request {id}"));
            }
            s.removed.push(*id);
        }
        self.page(s, &req, &mut v);
        for j in &req.joined {
            s.joined_request_ids.push(j.request_id.clone());
            if s.requests.contains_key(&j.id) {
                v.push(format!("request {} joined twice", j.id));
            }
            s.requests.insert(
                j.id,
                FakeRequest {
                    tokens: j.token_ids.clone(),
                    prompt_len: j.prompt_len as usize,
                    computed: j.num_cached as usize,
                    blocks: j.block_table.clone(),
                    seed: j.sampling.as_ref().map_or(0, |p| p.seed),
                    prompt_logprobs: j.prompt_logprobs,
                    adapter: j.adapter_id.clone(),
                },
            );
        }
        let mut scheduled: Vec<(u64, usize)> = req
            .joined
            .iter()
            .map(|j| (j.id, j.num_compute as usize))
            .collect();
        let mut speculating: HashMap<u64, usize> = HashMap::new();
        for c in &req.continuing {
            match s.requests.get_mut(&c.id) {
                Some(r) => {
                    r.blocks.extend(&c.new_blocks);
                    r.tokens.extend(&c.forced_tokens);
                    s.forced += c.forced_tokens.len();
                    let k = c.proposed_tokens.len() + c.num_draft_tokens as usize;
                    if k > 0 {
                        if r.computed + 1 != r.tokens.len() || !c.forced_tokens.is_empty() {
                            v.push(format!("request {} speculates but does not decode", c.id));
                        }
                        if c.num_compute as usize != 1 + k {
                            v.push(format!(
                                "request {}: {k} proposals in {}",
                                c.id, c.num_compute
                            ));
                        }
                        let proposals = match c.num_draft_tokens as usize {
                            0 => c.proposed_tokens.clone(),
                            n => self.draft(r, n),
                        };
                        r.tokens.extend(proposals);
                        speculating.insert(c.id, k);
                    }
                }
                None => v.push(format!("continuing unknown request {}", c.id)),
            }
            scheduled.push((c.id, c.num_compute as usize));
        }
        // Blocks may be shared (prefix caching), but never written while shared.
        let mut holders: HashMap<u32, usize> = HashMap::new();
        for (&id, r) in &s.requests {
            for &b in &r.blocks {
                if b as usize >= self.num_blocks {
                    v.push(format!("request {id} uses block {b} beyond the cache"));
                }
                *holders.entry(b).or_default() += 1;
            }
        }
        s.max_live_blocks = s.max_live_blocks.max(holders.len());
        self.check_adapters(s, &holders, &mut v);
        let step_adapters: std::collections::HashSet<&str> = scheduled
            .iter()
            .filter_map(|(id, _)| s.requests.get(id))
            .filter(|r| !r.adapter.is_empty())
            .map(|r| r.adapter.as_str())
            .collect();
        s.max_step_adapters = s.max_step_adapters.max(step_adapters.len());
        let mut generations = Vec::new();
        let mut computed_tokens = 0;
        for (id, n) in scheduled {
            let Some(r) = s.requests.get(&id) else {
                continue;
            };
            if n == 0 || r.computed + n > r.tokens.len() {
                v.push(format!(
                    "request {id}: computes {n} of {} known tokens from {}",
                    r.tokens.len(),
                    r.computed
                ));
                continue;
            }
            if r.blocks.len() * BLOCK_SIZE < r.computed + n {
                v.push(format!(
                    "request {id}: {} blocks for {} tokens",
                    r.blocks.len(),
                    r.computed + n
                ));
            }
            for p in r.computed..r.computed + n {
                if let Some(&b) = r.blocks.get(p / BLOCK_SIZE) {
                    if holders[&b] > 1 {
                        v.push(format!("request {id} writes shared block {b}"));
                    }
                }
            }
            computed_tokens += n;
            s.prompt_computed += r.prompt_len.saturating_sub(r.computed).min(n);
            let done = r.computed + n == r.tokens.len();
            let mask = req.allowed.iter().find(|a| a.id == id);
            if let Some(&k) = speculating.get(&id) {
                let r = s.requests.get_mut(&id).unwrap();
                let (tokens, accepted) = self.verify(r, k);
                s.proposed += k;
                s.accepted += accepted;
                generations.push(pb::Generation {
                    id,
                    logprobs: vec![-0.5; tokens.len()],
                    token_ids: tokens,
                    num_proposed: k as u32,
                    num_accepted: accepted as u32,
                    ..Default::default()
                });
                continue;
            }
            let token = done.then(|| Self::masked(self.next_token(r), mask));
            let r = s.requests.get_mut(&id).unwrap();
            r.computed += n;
            if let Some(token) = token {
                // With the first sampled token only, as the shards.
                let first = r.tokens.len() == r.prompt_len;
                let prompt_logprobs = if first && r.prompt_logprobs {
                    vec![-1.0; r.prompt_len - 1]
                } else {
                    Vec::new()
                };
                r.tokens.push(token);
                generations.push(pb::Generation {
                    id,
                    token_ids: vec![token],
                    logprobs: vec![-0.5],
                    prompt_logprobs,
                    ..Default::default()
                });
            }
        }
        s.violations.extend(v);
        pb::StepResponse {
            generations,
            forward_ns: 1000,
            computed_tokens: computed_tokens as u32,
        }
    }
}

impl FakeShard {
    /// The step's adapters out, then in (after swaps and copies, before joins, as the
    /// contract orders them): only host-loaded adapters are paged in, each once, into
    /// blocks of the cache, as many as its load said.
    fn page(&self, s: &mut FakeState, req: &pb::StepRequest, v: &mut Vec<String>) {
        for name in &req.adapters_out {
            if s.paged.remove(name).is_none() {
                v.push(format!("adapter {name} paged out but not in"));
            }
            s.pages_out += 1;
        }
        for a in &req.adapters_in {
            match s.host_adapters.get(&a.name) {
                None => v.push(format!("adapter {} paged in before it was loaded", a.name)),
                Some(&n) if n as usize != a.blocks.len() => v.push(format!(
                    "adapter {} takes {n} blocks, paged into {}",
                    a.name,
                    a.blocks.len()
                )),
                Some(_) => {}
            }
            if let Some(&b) = a.blocks.iter().find(|&&b| b as usize >= self.num_blocks) {
                v.push(format!("adapter {} in block {b} beyond the cache", a.name));
            }
            if s.paged.insert(a.name.clone(), a.blocks.clone()).is_some() {
                v.push(format!("adapter {} paged in twice", a.name));
            }
            s.pages_in += 1;
        }
    }

    /// After the step's diff: every live request's adapter is paged in, and no block holds
    /// both an adapter and a request's KV, or two adapters.
    fn check_adapters(&self, s: &FakeState, holders: &HashMap<u32, usize>, v: &mut Vec<String>) {
        for (id, r) in &s.requests {
            if !r.adapter.is_empty() && !s.paged.contains_key(&r.adapter) {
                v.push(format!(
                    "request {id} runs adapter {} not paged in",
                    r.adapter
                ));
            }
        }
        let mut owner: HashMap<u32, &str> = HashMap::new();
        for (name, blocks) in &s.paged {
            for &b in blocks {
                if holders.contains_key(&b) {
                    v.push(format!(
                        "adapter {name}'s block {b} is in a request's table"
                    ));
                }
                if let Some(other) = owner.insert(b, name) {
                    v.push(format!("block {b} holds adapters {other} and {name}"));
                }
            }
        }
    }
}

impl AdapterShards for FakeShard {
    fn load_adapter(&self, name: &str, path: &str) -> Reply<Vec<pb::LoadAdapterResponse>> {
        let shard = self.clone();
        let (name, path) = (name.to_string(), path.to_string());
        Box::pin(async move {
            let _ = shard.adapters.held.subscribe().wait_for(|held| !held).await;
            let found = shard.adapters.folders.lock().unwrap().get(&path).cloned();
            let mut s = shard.state.lock().unwrap();
            s.adapter_loads.push(name.clone());
            let num_blocks = match found {
                None => return Err(format!("{path}: no adapter_config.json")),
                Some(Err(why)) => return Err(format!("adapter {name:?}: {why}")),
                Some(Ok(n)) => n,
            };
            if s.host_adapters.insert(name.clone(), num_blocks).is_some() {
                s.violations.push(format!("adapter {name} loaded twice"));
            }
            Ok(vec![pb::LoadAdapterResponse {
                num_blocks,
                max_rank: 8,
                target_modules: vec!["q_proj".into(), "v_proj".into()],
                bytes: 1 << 20,
            }])
        })
    }

    fn drop_adapter(&self, name: &str) -> Reply<()> {
        let mut s = self.state.lock().unwrap();
        if s.paged.contains_key(name) {
            s.violations
                .push(format!("adapter {name} dropped while paged in"));
        }
        if s.host_adapters.remove(name).is_none() {
            s.violations
                .push(format!("adapter {name} dropped but not loaded"));
        }
        s.adapter_drops.push(name.to_string());
        Box::pin(async { Ok(()) })
    }
}

impl Backend for FakeShard {
    fn step(
        &self,
        req: pb::StepRequest,
    ) -> impl Future<Output = Result<pb::StepResponse, ShardError>> + Send + 'static {
        let turn = {
            let mut s = self.state.lock().unwrap();
            s.outstanding += 1;
            s.max_outstanding = s.max_outstanding.max(s.outstanding);
            s.handed_over += 1;
            (s.handed_over - 1, s.session)
        };
        let (turn, session) = turn;
        let shard = self.clone();
        async move {
            let _ = shard.paused.subscribe().wait_for(|paused| !paused).await;
            let _running = loop {
                let running = shard.executor.lock().await;
                if shard.state.lock().unwrap().run == turn {
                    break running;
                }
                drop(running);
                tokio::time::sleep(Duration::from_millis(1)).await;
            };
            if !shard.delay.is_zero() {
                tokio::time::sleep(shard.delay).await;
            }
            let mut s = shard.state.lock().unwrap();
            s.outstanding -= 1;
            s.run += 1;
            s.steps += 1;
            if session != s.session {
                return Err(ShardError {
                    rank: 0,
                    message: "the session ended".into(),
                });
            }
            if s.fail_steps > 0 || s.broken {
                s.fail_steps = s.fail_steps.saturating_sub(1);
                s.broken = true;
                return Err(ShardError {
                    rank: 0,
                    message: "boom".into(),
                });
            }
            Ok(shard.apply(&mut s, req))
        }
    }

    fn end_session(&self) {
        let mut s = self.state.lock().unwrap();
        s.requests.clear();
        // A new session starts with no adapter paged in.
        s.paged.clear();
        s.broken = false;
        s.session += 1;
    }
}

impl HealthProbe for FakeShard {
    fn probe(
        &self,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<ShardHealth, ShardError>> + Send>> {
        let health = *self.health.lock().unwrap();
        let beats = &self.heartbeats;
        // A shard that answers beats on: its forward (if any) makes progress.
        let heartbeats = match health {
            FakeHealth::Wedged => beats.load(std::sync::atomic::Ordering::Relaxed),
            _ => beats.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1,
        };
        let answer = move |ready| ShardHealth { ready, heartbeats };
        Box::pin(async move {
            match health {
                FakeHealth::Ready | FakeHealth::Wedged => Ok(answer(true)),
                FakeHealth::NotReady => Ok(answer(false)),
                FakeHealth::Fails => Err(ShardError {
                    rank: 0,
                    message: "Unavailable: connection refused".into(),
                }),
                FakeHealth::Silent => std::future::pending().await,
            }
        })
    }
}

struct Harness {
    app: Router,
    /// Replica 0's shard.
    shard: FakeShard,
    /// Every replica's shard, in replica order (`shard` first).
    replicas: Vec<FakeShard>,
    infer: Infer,
}

/// A router in front of a `FakeShard`, configured by chaining: 64 KV blocks, 16
/// concurrent requests, 64 waiting, 32 tokens per step, no step delay unless changed.
struct Setup {
    shard: FakeShard,
    max_concurrent: usize,
    max_waiting: usize,
    async_scheduling: bool,
    chat: Option<Arc<ChatTemplate>>,
    served_model_name: String,
    /// `--ready-stall-timeout-ms`.
    stall_timeout: Duration,
    /// Shard groups behind the router (`--replicas`), each a fake like `shard`.
    replicas: usize,
    /// Speculative decoding (`--speculative`).
    speculative: Option<SpeculativeConfig>,
    /// The LoRA flags.
    lora: LoraConfig,
    /// The API keys' tenants (`--api-key-file`, `--max-concurrent-requests-per-key`).
    tenants: Option<crate::tenants::Tenants>,
}

fn setup(script: Script) -> Setup {
    Setup {
        shard: FakeShard::new(script, 64),
        max_concurrent: 16,
        max_waiting: 64,
        async_scheduling: true,
        chat: None,
        served_model_name: "test-model".into(),
        stall_timeout: Duration::from_secs(5),
        replicas: 1,
        speculative: None,
        lora: LoraConfig::default(),
        tenants: None,
    }
}

fn harness(script: Script) -> Harness {
    setup(script).build()
}

impl Setup {
    fn blocks(mut self, num_blocks: usize) -> Self {
        self.shard.num_blocks = num_blocks;
        self
    }

    fn max_concurrent(mut self, requests: usize) -> Self {
        self.max_concurrent = requests;
        self
    }

    fn max_waiting(mut self, requests: usize) -> Self {
        self.max_waiting = requests;
        self
    }

    /// The shard holds every step until `Harness::resume`.
    fn paused(self) -> Self {
        self.shard.paused.send_replace(true);
        self
    }

    /// Each step scheduled only after the previous one's tokens are back.
    fn synchronous(mut self) -> Self {
        self.async_scheduling = false;
        self
    }

    /// A chat template (`role: content` lines, then `assistant:`).
    fn chat_template(self) -> Self {
        self.chat_template_source(
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:",
        )
    }

    fn chat_template_source(mut self, template: &str) -> Self {
        let chat = ChatTemplate::new(template.into(), "<|bos|>".into(), testing::EOS.into());
        self.chat = Some(Arc::new(chat.unwrap()));
        self
    }

    /// The name clients know the model by (`--served-model-name`).
    fn served_model_name(mut self, name: &str) -> Self {
        self.served_model_name = name.into();
        self
    }

    /// How long a step may be awaited before `/ready` asks whether it is stalled.
    fn stall_timeout(mut self, timeout: Duration) -> Self {
        self.stall_timeout = timeout;
        self
    }

    /// `n` shard groups behind the router, each a fake with the same script and blocks.
    fn replicas(mut self, n: usize) -> Self {
        self.replicas = n;
        self
    }

    /// Speculative decoding by `method`, up to `k` proposals per request, while a step
    /// holds at most `max_step_tokens` tokens.
    fn speculative(mut self, method: SpeculativeMethod, k: usize, max_step_tokens: usize) -> Self {
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
    fn lora(mut self, config: LoraConfig) -> Self {
        self.lora = config;
        self
    }

    /// Builds the harness and loads the `--lora-adapters`, as the router's start does.
    async fn start(self) -> Result<Harness, String> {
        let h = self.build();
        h.infer.adapters().load_at_start().await?;
        Ok(h)
    }

    /// How long each step takes (so requests stay in flight a while).
    fn step_delay(mut self, delay: Duration) -> Self {
        self.shard.delay = delay;
        self
    }

    fn build(self) -> Harness {
        let Setup {
            shard,
            max_concurrent,
            max_waiting,
            async_scheduling,
            chat,
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
        let info = Info {
            model_id: "test-model".into(),
            served_model_name: served_model_name.clone(),
            model_dtype: "float32".into(),
            model_device_type: "cpu".into(),
            model_pipeline_tag: "text-generation",
            max_input_tokens: limits.max_input_tokens,
            max_total_tokens: limits.max_total_tokens,
            max_batch_tokens: MAX_BATCH_TOKENS,
            max_batch_size: MAX_BATCH_SIZE,
            max_concurrent_requests: max_concurrent,
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
        let app = router(AppState {
            infer: infer.clone(),
            info,
            shards: Vec::new(),
            chat,
            readiness,
            responses: Default::default(),
        });
        Harness {
            app,
            shard,
            replicas: fakes,
            infer,
        }
    }
}

impl Harness {
    async fn send(&self, request: Request<Body>) -> (StatusCode, HeaderMap, String) {
        send(&self.app, request).await
    }

    async fn get(&self, path: &str) -> (StatusCode, HeaderMap, String) {
        self.send(get(path)).await
    }

    async fn get_text(&self, path: &str) -> (StatusCode, String) {
        let (status, _, text) = self.get(path).await;
        (status, text)
    }

    async fn get_json(&self, path: &str) -> (StatusCode, Value) {
        let (status, text) = self.get_text(path).await;
        let value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        (status, value)
    }

    async fn post_raw(
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

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        let (status, text) = self
            .post_raw(path, &body.to_string(), Some("application/json"))
            .await;
        let value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        (status, value)
    }

    async fn stream(&self, body: Value) -> (StatusCode, Vec<Value>) {
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

    fn shard_state(&self) -> MutexGuard<'_, FakeState> {
        self.shard.state.lock().unwrap()
    }

    /// Lets the paused shard run its steps.
    fn resume(&self) {
        self.shard.paused.send_replace(false);
    }

    /// What the fake answers to `Health` from now on.
    fn set_health(&self, health: FakeHealth) {
        *self.shard.health.lock().unwrap() = health;
    }

    /// `/ready`'s status and its `reason` (empty when ready).
    async fn ready(&self) -> (StatusCode, String) {
        let (status, _, text) = self.get("/ready").await;
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{text}"));
        let reason = v["reason"].as_str().unwrap_or_default().to_string();
        (status, reason)
    }

    /// Waits until the paused shard holds `n` steps.
    async fn until_steps_held(&self, n: usize) {
        while self.shard_state().outstanding < n {
            tokio::task::yield_now().await;
        }
    }

    fn assert_protocol_ok(&self) {
        let s = self.shard_state();
        assert!(s.violations.is_empty(), "{:?}", s.violations);
    }
}

/// Sends `request` to `app`: status, headers and body text.
async fn send(app: &Router, request: Request<Body>) -> (StatusCode, HeaderMap, String) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, headers, String::from_utf8(bytes.to_vec()).unwrap())
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

fn post_json(path: &str, body: &Value, key: Option<&str>) -> Request<Body> {
    let mut b = Request::post(path).header("content-type", "application/json");
    if let Some(key) = key {
        b = b.header("authorization", format!("Bearer {key}"));
    }
    b.body(Body::from(body.to_string())).unwrap()
}

/// `text`'s token ids, without the BOS token the tokenizer adds.
fn ids(text: &str) -> Vec<u32> {
    testing::tokenizer().encode(text).unwrap()[1..].to_vec()
}

/// How many tokens the router counts for prompt `text` (BOS included).
fn prompt_tokens(text: &str) -> usize {
    ids(text).len() + 1
}

async fn expect_422(h: &Harness, body: Value, needle: &str) {
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

#[tokio::test]
async fn each_invalid_parameter_is_a_422_naming_the_field_on_both_routes() {
    let h = harness(Script::Hash);
    let p = |params: Value| json!({"inputs": "hello", "parameters": params});
    let cases = [
        (json!({"inputs": ""}), "inputs"),
        (json!({"parameters": {}}), "inputs"),
        (
            p(json!({"max_new_tokens": "ten"})),
            "parameters.max_new_tokens",
        ),
        (
            p(json!({"max_new_tokens": -1})),
            "parameters.max_new_tokens",
        ),
        (p(json!({"max_new_tokens": 0})), "max_new_tokens"),
        (p(json!({"temprature": 0.5})), "temprature"),
        (json!({"inputs": "a", "prameters": {}}), "prameters"),
        (p(json!({"temperature": 0.0})), "temperature"),
        (p(json!({"temperature": -1.0})), "temperature"),
        (p(json!({"top_p": 0.0})), "top_p"),
        (p(json!({"top_p": 1.5})), "top_p"),
        (p(json!({"top_k": 0})), "top_k"),
        (p(json!({"typical_p": 0.0})), "typical_p"),
        (p(json!({"min_p": 1.0})), "min_p"),
        (p(json!({"repetition_penalty": 0.0})), "repetition_penalty"),
        (p(json!({"frequency_penalty": 3.0})), "frequency_penalty"),
        (p(json!({"stop": ["a", "b", "c"]})), "stop"),
        (p(json!({"stop": [""]})), "stop"),
        (p(json!({"best_of": 2})), "best_of"), // greedy
        (p(json!({"best_of": 0})), "best_of"),
        (p(json!({"best_of": 5, "do_sample": true})), "max_best_of"),
        (p(json!({"top_n_tokens": 6})), "max_top_n_tokens"),
        (p(json!({"watermark": true})), "watermark"),
        (
            p(json!({"grammar": {"type": "yaml", "value": {}}})),
            "parameters.grammar.type",
        ),
        (
            p(json!({"grammar": {"type": "json"}})),
            "parameters.grammar.value",
        ),
        (
            p(json!({"grammar": {"type": "json", "value": {"type": "nope"}}})),
            "parameters.grammar",
        ),
        (
            p(json!({"grammar": {"type": "regex", "value": "(unclosed"}})),
            "parameters.grammar",
        ),
        (p(json!({"adapter_id": "lora-x"})), "adapter_id"),
        (p(json!({"top_n_tokens": 50})), "top_n_tokens"),
        (p(json!({"truncate": 0})), "truncate"),
        // 60 input tokens > max_input_tokens (48).
        (json!({"inputs": "x".repeat(60)}), "inputs"),
        // 41 input tokens + 30 new > max_total_tokens (64).
        (
            json!({"inputs": "x".repeat(40), "parameters": {"max_new_tokens": 30}}),
            "max_new_tokens",
        ),
    ];
    for (body, needle) in cases {
        expect_422(&h, body, needle).await;
    }
    // Malformed JSON.
    let (status, text) = h
        .post_raw("/generate", "{\"inputs\": ", Some("application/json"))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error_type"], "validation");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn requests_that_could_never_fit_in_the_kv_cache_are_rejected() {
    // 8 blocks of 4 = 32 tokens of KV.
    let h = setup(Script::Hash).blocks(8).build();
    let body = json!({"inputs": "x".repeat(20), "parameters": {"max_new_tokens": 20}});
    let (status, v) = h.post("/generate", body).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(v["error"].as_str().unwrap().contains("KV blocks"), "{v}");
    let body = json!({"inputs": "x".repeat(40), "parameters": {"max_new_tokens": 1}});
    let (status, v) = h.post("/generate", body).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(v["error"].as_str().unwrap().starts_with("inputs"), "{v}");
}

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
async fn beyond_max_concurrent_requests_is_429_and_cancelled_streams_free_their_slot() {
    let h = setup(Script::Hash)
        .step_delay(Duration::from_millis(5))
        .max_concurrent(1)
        .build();
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 60}}).to_string();
    let req = Request::post("/generate_stream")
        .body(Body::from(body.clone()))
        .unwrap();
    let resp = h.app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let (status, v) = h.post("/generate", json!({"inputs": "hi"})).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(v["error_type"], "overloaded");
    // The client goes away: the request is cancelled and removed from the shard.
    drop(resp);
    let mut ok = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let s = h.shard_state();
        if s.removed.contains(&0) || s.requests.is_empty() {
            ok = true;
            break;
        }
    }
    assert!(ok, "the cancelled request should be dropped");
    let (status, v) = h
        .post(
            "/generate",
            json!({"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn info_and_health_answer() {
    let h = harness(Script::Hash);
    let (status, _, text) = h.get("/info").await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["router"], "cadence");
    assert_eq!(v["max_total_tokens"], 64);
    assert_eq!(v["served_model_name"], "test-model");
    let (status, _, text) = h.get("/health").await;
    assert_eq!((status, text.as_str()), (StatusCode::OK, "{}"));
    let (status, _, text) = h.get("/ready").await;
    assert_eq!(
        (status, text.as_str()),
        (StatusCode::OK, r#"{"status":"ready"}"#)
    );
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

#[tokio::test]
async fn api_keys_guard_every_route_but_the_open_ones_and_payload_limit_is_a_422() {
    let h = harness(Script::Hash);
    let access = crate::access::Access {
        api_keys: vec![crate::tenants::ApiKey::bare("sekret")],
        cors_allow_origin: vec!["https://example.com".into()],
        payload_limit: 200,
    };
    let app = crate::access::layers(h.app.clone(), access);
    let body = json!({"inputs": "hello", "parameters": {"max_new_tokens": 2}});
    let (status, _, text) = send(&app, post_json("/generate", &body, None)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{text}");
    let (status, _, _) = send(&app, post_json("/generate", &body, Some("wrong"))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, text) = send(
        &app,
        post_json("/v1/completions", &json!({"prompt": "a"}), None),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(text.contains("invalid_api_key"), "{text}");
    let (status, _, _) = send(&app, post_json("/generate", &body, Some("sekret"))).await;
    assert_eq!(status, StatusCode::OK);
    for probe in ["/health", "/ready"] {
        let (status, _, _) = send(&app, get(probe)).await;
        assert_eq!(status, StatusCode::OK, "{probe} is open");
    }
    let (status, _, _) = send(&app, get("/openapi.json")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = send(&app, get("/v1/models")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // CORS: the allowed origin is echoed.
    let request = Request::get("/health")
        .header("origin", "https://example.com")
        .body(Body::empty())
        .unwrap();
    let (_, headers, _) = send(&app, request).await;
    assert_eq!(
        headers["access-control-allow-origin"],
        "https://example.com"
    );
    // Over the payload limit: 422 naming it, on both API shapes.
    let big = json!({"inputs": "x".repeat(300)});
    let (status, _, text) = send(&app, post_json("/generate", &big, Some("sekret"))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{text}");
    assert!(text.contains("payload_limit"), "{text}");
    let big = json!({"prompt": "x".repeat(300)});
    let (status, _, text) = send(&app, post_json("/v1/completions", &big, Some("sekret"))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("\"param\":\"payload_limit\""), "{text}");
}

#[tokio::test]
async fn tokenize_returns_ids_with_character_offsets_and_the_openapi_document_lists_routes() {
    let h = harness(Script::Hash);
    let (status, _, text) = h
        .send(post_json("/tokenize", &json!({"inputs": "héllo"}), None))
        .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let tokens: Vec<Value> = serde_json::from_str(&text).unwrap();
    let expected = testing::tokenizer().encode("héllo").unwrap();
    assert_eq!(
        tokens
            .iter()
            .map(|t| t["id"].as_u64().unwrap() as u32)
            .collect::<Vec<_>>(),
        expected
    );
    let last = tokens.last().unwrap();
    assert_eq!(last["stop"], 5, "offsets count characters, not bytes");
    let (status, _, text) = h.get("/openapi.json").await;
    assert_eq!(status, StatusCode::OK);
    let doc: Value = serde_json::from_str(&text).unwrap();
    for path in [
        "/generate",
        "/generate_stream",
        "/",
        "/tokenize",
        "/info",
        "/health",
        "/ready",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/responses",
        "/v1/responses/{id}",
        "/v1/messages",
        "/v1/messages/count_tokens",
    ] {
        assert!(doc["paths"].get(path).is_some(), "{path}");
    }
}
#[tokio::test]
async fn metrics_count_tokens_requests_and_blocks() {
    let h = setup(Script::Hash)
        .step_delay(Duration::from_millis(5))
        .build();
    let (status, _) = h
        .post(
            "/generate",
            json!({"inputs": "hello", "parameters": {"max_new_tokens": 5}}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, text) = h.get("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert!(text.contains("cadence_generation_tokens_total{model=\"test-model\"} 5\n"));
    assert!(text.contains("cadence_requests_succeeded_total{model=\"test-model\"} 1\n"));
    assert!(text.contains("cadence_kv_blocks_used{model=\"test-model\"} 0\n"));
    assert!(text.contains("cadence_e2e_request_latency_seconds_count{model=\"test-model\"} 1\n"));
    // The gateways' gauges, under vLLM's names, with the cache's shape.
    assert!(text.contains("vllm:num_requests_running{model_name=\"test-model\"} 0\n"));
    assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"test-model\"} 0\n"));
    assert!(text.contains(
        "vllm:cache_config_info{model_name=\"test-model\",block_size=\"4\",num_gpu_blocks=\"64\"} 1\n"
    ));
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

/// The chunks of an OpenAI stream (it must end with `[DONE]`, left out), and its headers.
async fn openai_stream(h: &Harness, path: &str, body: Value) -> (HeaderMap, Vec<Value>) {
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

/// How every generating route must refuse a request: the status, then the error's type
/// in TGI's shape and in OpenAI's.
struct Refusal {
    status: StatusCode,
    tgi_type: &'static str,
    openai_type: &'static str,
}

const OVERLOADED: Refusal = Refusal {
    status: StatusCode::TOO_MANY_REQUESTS,
    tgi_type: "overloaded",
    openai_type: "rate_limit_exceeded",
};

const SHUTTING_DOWN: Refusal = Refusal {
    status: StatusCode::SERVICE_UNAVAILABLE,
    tgi_type: "shutting_down",
    openai_type: "server_error",
};

/// Asks every generating route, streaming and not, `best_of` / `n` included, to generate
/// while the router is overloaded: each must answer 429 in its own error shape, saying
/// `why`, with `Retry-After`. Returns how many were asked.
async fn assert_every_route_overloaded(h: &Harness, why: &str) -> u64 {
    assert_every_route_refuses(h, OVERLOADED, why).await
}

/// Asks every generating route, streaming and not, `best_of` / `n` included, to
/// generate: each must refuse as `refusal` says in its own error shape, saying `why`,
/// with `Retry-After`. Returns how many were asked.
async fn assert_every_route_refuses(h: &Harness, refusal: Refusal, why: &str) -> u64 {
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let requests = [
        ("/generate", json!({"inputs": "hi"})),
        (
            "/generate",
            json!({"inputs": "hi", "parameters": {"best_of": 2, "do_sample": true}}),
        ),
        ("/generate_stream", json!({"inputs": "hi"})),
        ("/", json!({"inputs": "hi"})),
        ("/", json!({"inputs": "hi", "stream": true})),
        ("/v1/completions", json!({"prompt": "hi"})),
        (
            "/v1/completions",
            json!({"prompt": ["hi", "ho"], "n": 2, "best_of": 3}),
        ),
        ("/v1/completions", json!({"prompt": "hi", "stream": true})),
        ("/v1/chat/completions", chat(json!({}))),
        (
            "/v1/chat/completions",
            chat(json!({"n": 2, "stream": true})),
        ),
    ];
    for (path, body) in &requests {
        let (status, headers, text) = h.send(post_json(path, body, None)).await;
        assert_eq!(status, refusal.status, "{path} {body}: {text}");
        assert_eq!(headers["retry-after"], "1", "{path} {body}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let message = if path.starts_with("/v1/") {
            assert_eq!(v["error"]["type"], refusal.openai_type, "{path}: {v}");
            &v["error"]["message"]
        } else {
            assert_eq!(v["error_type"], refusal.tgi_type, "{path}: {v}");
            &v["error"]
        };
        assert!(message.as_str().unwrap().contains(why), "{path}: {v}");
    }
    requests.len() as u64
}

/// The value of `cadence_requests_rejected_total`.
async fn rejected(h: &Harness) -> u64 {
    let (_, _, text) = h.get("/metrics").await;
    let key = "cadence_requests_rejected_total{model=\"test-model\"} ";
    let line = text.lines().find(|l| l.starts_with(key)).unwrap();
    line[key.len()..].parse().unwrap()
}

/// Reads a streamed answer to its end: its `data:` events.
async fn stream_events(response: axum::response::Response) -> Vec<String> {
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
async fn hold_stream(h: &Harness) -> axum::response::Response {
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

#[tokio::test]
async fn beyond_max_concurrent_requests_every_route_is_429_with_retry_after_and_counted() {
    let h = setup(Script::Hash)
        .chat_template()
        .max_concurrent(1)
        .paused()
        .build();
    // The one slot in flight, held as long as the shard is paused.
    let held = hold_stream(&h).await;
    assert_eq!(rejected(&h).await, 0);
    let asked = assert_every_route_overloaded(&h, "too many requests in flight").await;
    assert_eq!(rejected(&h).await, asked);
    h.resume();
    assert_eq!(stream_events(held).await.len(), 2);
    let (status, v) = h.post("/generate", json!({"inputs": "hi"})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(rejected(&h).await, asked);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn beyond_max_waiting_requests_every_route_is_429_with_retry_after_and_counted() {
    let h = setup(Script::Hash)
        .chat_template()
        .max_waiting(1)
        .paused()
        .build();
    // The first request leaves the queue at its first step, which the paused shard
    // holds; the loop waits for that step, so the second stays in the queue's one place.
    let running = hold_stream(&h).await;
    h.until_steps_held(1).await;
    let waiting = hold_stream(&h).await;
    let asked = assert_every_route_overloaded(&h, "the queue is full").await;
    assert_eq!(rejected(&h).await, asked);
    h.resume();
    assert_eq!(stream_events(running).await.len(), 2);
    assert_eq!(stream_events(waiting).await.len(), 2);
    let (status, v) = h.post("/generate", json!({"inputs": "hi"})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(rejected(&h).await, asked);
    h.assert_protocol_ok();
}

#[tokio::test]
async fn streaming_refuses_best_of_on_the_tgi_routes_and_frees_the_slot() {
    let h = setup(Script::Hash).max_concurrent(1).build();
    let parameters = json!({"best_of": 2, "do_sample": true, "max_new_tokens": 2});
    for (path, body) in [
        (
            "/generate_stream",
            json!({"inputs": "hi", "parameters": parameters}),
        ),
        (
            "/",
            json!({"inputs": "hi", "parameters": parameters, "stream": true}),
        ),
    ] {
        let (status, v) = h.post(path, body).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{path}: {v}");
        assert_eq!(
            v["error"], "parameters.best_of > 1 is not supported when streaming",
            "{path}"
        );
    }
    let body = json!({"inputs": "hi", "parameters": parameters});
    let (status, v) = h.post("/generate", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(rejected(&h).await, 0);
    h.assert_protocol_ok();
}

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

/// A call as the model writes it, and a chat template short enough for it to fit the
/// test model's 64 tokens: it reads `tools` (so it has a tool section and no tool
/// prompt is added) and renders the last message's text alone.
const TOOL_CALL: &str = "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>";
const TOOL_TEMPLATE: &str = "{% if tools %}{% endif %}{{ messages[-1].content }}";

fn tool_request(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// One streamed chat choice put back together.
#[derive(Clone, Default)]
struct StreamedChat {
    content: String,
    /// (id, name, arguments)
    calls: Vec<(String, String, String)>,
    /// Only the last chunk of a choice carries it.
    finish_reason: Value,
}

fn streamed_chat(chunks: &[Value]) -> Vec<StreamedChat> {
    let mut choices: Vec<StreamedChat> = Vec::new();
    for choice in chunks.iter().flat_map(|c| c["choices"].as_array().unwrap()) {
        let index = choice["index"].as_u64().unwrap() as usize;
        if choices.len() <= index {
            choices.resize(index + 1, StreamedChat::default());
        }
        let streamed = &mut choices[index];
        assert!(
            streamed.finish_reason.is_null(),
            "a chunk after the finish reason: {choice}"
        );
        streamed.finish_reason = choice["finish_reason"].clone();
        if let Some(text) = choice["delta"]["content"].as_str() {
            streamed.content.push_str(text);
        }
        for call in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let k = call["index"].as_u64().unwrap() as usize;
            if let Some(id) = call["id"].as_str() {
                assert_eq!(k, streamed.calls.len(), "{call}");
                let name = call["function"]["name"].as_str().unwrap().to_string();
                streamed.calls.push((id.to_string(), name, String::new()));
            }
            let arguments = call["function"]["arguments"].as_str().unwrap();
            streamed.calls[k].2.push_str(arguments);
        }
    }
    choices
}

#[tokio::test]
async fn chat_tool_calls_are_read_back_alike_whole_and_streamed() {
    let mut script = ids(&format!("ok {TOOL_CALL}"));
    script.push(testing::eos_id());
    let h = setup(Script::Fixed(script))
        .chat_template_source(TOOL_TEMPLATE)
        .build();
    let (status, v) = h
        .post("/v1/chat/completions", tool_request(json!({"n": 2})))
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    for (i, choice) in v["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
        let message = &choice["message"];
        assert_eq!(message["content"], "ok");
        let calls = message["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(
            calls[0]["function"],
            json!({"name": "f", "arguments": "{}"})
        );
        assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    }
    let body = tool_request(json!({"n": 2, "stream": true}));
    let (_, chunks) = openai_stream(&h, "/v1/chat/completions", body).await;
    let choices = streamed_chat(&chunks);
    assert_eq!(choices.len(), 2);
    for choice in choices {
        assert_eq!(choice.content, "ok");
        let [(id, name, arguments)] = choice.calls.as_slice() else {
            panic!("one call: {:?}", choice.calls);
        };
        assert!(id.starts_with("call_"));
        assert_eq!((name.as_str(), arguments.as_str()), ("f", "{}"));
        assert_eq!(choice.finish_reason, "tool_calls");
    }
    // A named function ends with "stop", as OpenAI's.
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "f"}}});
    let (_, v) = h.post("/v1/chat/completions", tool_request(named)).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "f"
    );
    h.assert_protocol_ok();
}

#[tokio::test]
async fn a_chat_tool_call_cut_short_is_content_and_none_leaves_the_text_alone() {
    let mut script = ids(TOOL_CALL);
    script.push(testing::eos_id());
    let h = setup(Script::Fixed(script))
        .chat_template_source(TOOL_TEMPLATE)
        .build();
    let cut = testing::tokenizer().decode(&ids(TOOL_CALL)[..20]);
    for stream in [false, true] {
        let body = tool_request(json!({"max_tokens": 20, "stream": stream}));
        let choice = if stream {
            let (_, chunks) = openai_stream(&h, "/v1/chat/completions", body).await;
            streamed_chat(&chunks).remove(0)
        } else {
            let (status, v) = h.post("/v1/chat/completions", body).await;
            assert_eq!(status, StatusCode::OK, "{v}");
            let choice = &v["choices"][0];
            assert!(choice["message"].get("tool_calls").is_none(), "{v}");
            StreamedChat {
                content: choice["message"]["content"].as_str().unwrap().to_string(),
                calls: Vec::new(),
                finish_reason: choice["finish_reason"].clone(),
            }
        };
        assert_eq!(choice.content, cut, "stream: {stream}");
        assert!(choice.calls.is_empty());
        assert_eq!(choice.finish_reason, "length");
    }
    let (_, v) = h
        .post(
            "/v1/chat/completions",
            tool_request(json!({"tool_choice": "none"})),
        )
        .await;
    assert_eq!(v["choices"][0]["message"]["content"], TOOL_CALL, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    h.assert_protocol_ok();
}

#[tokio::test]
async fn chat_tool_errors_name_their_field() {
    let h = setup(Script::Hash)
        .chat_template_source(TOOL_TEMPLATE)
        .build();
    let history = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"}
    ]});
    let cases = [
        (
            tool_request(json!({"tools": [{"type": "function", "function": {"name": "a b"}}]})),
            "tools[0].function.name",
        ),
        (
            tool_request(json!({"response_format": {"type": "json_object"}})),
            "response_format",
        ),
        (
            tool_request(json!({"tool_choice": "sometimes"})),
            "tool_choice",
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}),
            "tool_choice",
        ),
        (
            tool_request(history),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            tool_request(json!({"functions": [{"name": "f"}]})),
            "functions",
        ),
    ];
    for (body, param) in cases {
        let (status, v) = h.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    // With tool_choice "none", response_format applies and the tools only reach the
    // template.
    let body = tool_request(json!({"tool_choice": "none",
        "response_format": {"type": "json_object"}, "max_tokens": 2}));
    let (status, v) = h.post("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    h.assert_protocol_ok();
}

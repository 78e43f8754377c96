//! `FakeShard`: an in-memory shard that checks every diff it receives and generates
//! tokens as a pure function of each request's token history (so recompute preemption
//! must reproduce the same output), with scripted failures, health and adapters.

use super::*;

pub(super) const BLOCK_SIZE: usize = 4;
pub(super) const MAX_BATCH_TOKENS: usize = 32;
pub(super) const MAX_BATCH_SIZE: usize = 8;

#[derive(Default)]
pub(super) struct FakeRequest {
    pub(super) tokens: Vec<u32>,
    pub(super) prompt_len: usize,
    pub(super) computed: usize,
    pub(super) blocks: Vec<u32>,
    pub(super) seed: u64,
    /// Return the prompt's logprobs with the first token (each -1.0).
    pub(super) prompt_logprobs: bool,
    /// Its LoRA adapter ("" = the base model): mixed into its tokens.
    pub(super) adapter: String,
    /// Candidates returned per sampled token (a beam search's rows): then it samples
    /// the most likely of `beam_candidates`.
    pub(super) top_n: usize,
}

/// The fake's distribution after `history` for rows that ask for alternatives: the 26
/// lowercase letters and EOS with logprobs drawn from the history (a pure function, so a
/// test can search it itself), most likely first.
pub(super) fn beam_candidates(history: &[u32]) -> Vec<(u32, f32)> {
    let mut h: u64 = 0xcbf29ce484222325;
    for &t in history {
        h = (h ^ t as u64).wrapping_mul(0x100000001b3);
    }
    let eos = crate::detokenize::testing::eos_id();
    let mut all: Vec<(u32, f32)> = (b'a' as u32..=b'z' as u32)
        .chain([eos])
        .map(|t| {
            let x =
                (h ^ (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0x100000001b3);
            let x = (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (t, -(((x >> 40) % 800) as f32) / 100.0 - 0.25)
        })
        .collect();
    all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    all
}

/// How the fake picks tokens.
#[derive(Clone)]
pub(super) enum Script {
    /// A function of the whole token history: lowercase letters.
    Hash,
    /// The n-th generated token is `tokens[n % len]`.
    Fixed(Vec<u32>),
    /// Like `Hash`, with the request's sampling seed mixed in (parallel samples differ).
    Seeded,
    /// Like `Hash`, but a row asking for alternatives samples the most likely of
    /// `beam_candidates` and returns them (a beam search's rows).
    Beams,
}

#[derive(Default)]
pub(super) struct FakeState {
    pub(super) requests: HashMap<u64, FakeRequest>,
    /// Protocol violations seen (the test asserts none).
    pub(super) violations: Vec<String>,
    /// Requests ever removed, in order.
    pub(super) removed: Vec<u64>,
    /// Fail the next this-many steps.
    pub(super) fail_steps: usize,
    pub(super) steps: usize,
    pub(super) max_live_blocks: usize,
    /// Prompt positions computed, over every step.
    pub(super) prompt_computed: usize,
    /// Steps handed over (by `step` calls) and run: like the shards, steps run in the
    /// order they were handed over, whatever order their futures are polled in.
    pub(super) handed_over: u64,
    pub(super) run: u64,
    /// Ended sessions: a step handed over in an earlier session fails, as on a stream the
    /// router has closed.
    pub(super) session: u64,
    /// A step failed: the session is over until the router ends it (a step sent ahead
    /// of the failure fails too).
    pub(super) broken: bool,
    /// Step calls received and not yet answered, and the most at once.
    pub(super) outstanding: usize,
    pub(super) max_outstanding: usize,
    /// Tokens received as forced (fast-forwarded) by continuing requests.
    pub(super) forced: usize,
    /// The `request_id` of every request that joined, in order.
    pub(super) joined_request_ids: Vec<String>,
    /// Speculative decoding: proposals verified, and accepted.
    pub(super) proposed: usize,
    pub(super) accepted: usize,
    /// LoRA adapters parsed into host memory (the blocks each takes), and those paged
    /// into the pool (their blocks).
    pub(super) host_adapters: HashMap<String, u32>,
    pub(super) paged: HashMap<String, Vec<u32>>,
    /// LoadAdapter calls answered (refusals included), DropAdapter calls, in order.
    pub(super) adapter_loads: Vec<String>,
    pub(super) adapter_drops: Vec<String>,
    /// Adapters paged in and out over every step.
    pub(super) pages_in: usize,
    pub(super) pages_out: usize,
    /// The most distinct adapters among the requests one step computed.
    pub(super) max_step_adapters: usize,
}

/// What the fake's LoadAdapter makes of each adapter folder (shared by every replica's
/// fake, as the folders are).
#[derive(Clone, Default)]
pub(super) struct FakeAdapters {
    /// Folder -> KV blocks its weights take, or the refusal's message.
    pub(super) folders: Arc<Mutex<HashMap<String, Result<u32, String>>>>,
    /// While true, LoadAdapter waits (a slow load).
    pub(super) held: Arc<tokio::sync::watch::Sender<bool>>,
}

impl FakeAdapters {
    pub(super) fn add(&self, folder: &str, num_blocks: u32) {
        self.folders
            .lock()
            .unwrap()
            .insert(folder.into(), Ok(num_blocks));
    }

    pub(super) fn refuse(&self, folder: &str, why: &str) {
        self.folders
            .lock()
            .unwrap()
            .insert(folder.into(), Err(why.into()));
    }
}

/// What the fake answers to `Health`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FakeHealth {
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
pub(super) struct FakeShard {
    pub(super) state: Arc<Mutex<FakeState>>,
    /// One step at a time, as the shard's forward thread.
    pub(super) executor: Arc<tokio::sync::Mutex<()>>,
    pub(super) script: Script,
    pub(super) num_blocks: usize,
    pub(super) delay: Duration,
    /// While true, every step waits (its requests stay in flight until the test resumes).
    pub(super) paused: Arc<tokio::sync::watch::Sender<bool>>,
    /// Answered to `Health`, whatever the steps do (as the shards' event loop).
    pub(super) health: Arc<Mutex<FakeHealth>>,
    /// The forward heartbeats `Health` reports.
    pub(super) heartbeats: Arc<std::sync::atomic::AtomicU64>,
    /// The adapter folders LoadAdapter finds.
    pub(super) adapters: FakeAdapters,
}

impl FakeShard {
    pub(super) fn new(script: Script, num_blocks: usize) -> Self {
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

    pub(super) fn next_token(&self, r: &FakeRequest) -> u32 {
        self.token_after(r, &r.tokens)
    }

    /// The token the fake samples after `tokens` (a prefix of `r`'s).
    pub(super) fn token_after(&self, r: &FakeRequest, tokens: &[u32]) -> u32 {
        match &self.script {
            Script::Hash | Script::Seeded | Script::Beams => {
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
    pub(super) fn draft(&self, r: &FakeRequest, k: usize) -> Vec<u32> {
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
    pub(super) fn verify(&self, r: &mut FakeRequest, k: usize) -> (Vec<u32>, usize) {
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
    pub(super) fn masked(token: u32, mask: Option<&pb::AllowedTokens>) -> u32 {
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

    pub(super) fn apply(&self, s: &mut FakeState, req: pb::StepRequest) -> pb::StepResponse {
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
                    top_n: j.top_n_tokens as usize,
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
            let mut top = Vec::new();
            if done && r.top_n > 0 && matches!(self.script, Script::Beams) {
                top = beam_candidates(&r.tokens);
                top.truncate(r.top_n);
            }
            let token = done.then(|| match top.first() {
                Some(&(best, _)) => best,
                None => Self::masked(self.next_token(r), mask),
            });
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
                let (logprob, top_tokens) = match top.first() {
                    Some(&(_, best)) => (
                        best,
                        vec![pb::TopTokens {
                            ids: top.iter().map(|c| c.0).collect(),
                            logprobs: top.iter().map(|c| c.1).collect(),
                        }],
                    ),
                    None => (-0.5, Vec::new()),
                };
                generations.push(pb::Generation {
                    id,
                    token_ids: vec![token],
                    logprobs: vec![logprob],
                    top_tokens,
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
    pub(super) fn page(&self, s: &mut FakeState, req: &pb::StepRequest, v: &mut Vec<String>) {
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
    pub(super) fn check_adapters(
        &self,
        s: &FakeState,
        holders: &HashMap<u32, usize>,
        v: &mut Vec<String>,
    ) {
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

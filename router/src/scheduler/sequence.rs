//! The scheduler's view of one request: its tokens, how far they are computed, where its
//! KV is, what it may still compute, and what it proposes to follow its next token.

use std::sync::Arc;
use std::time::Instant;

use crate::blocks::RequestId;
use crate::pb;

/// What a decoding request proposes to follow its sampled token at its next step
/// (speculative decoding), set by the batching loop before each schedule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Proposal {
    #[default]
    None,
    /// Tokens the router proposes (n-gram lookup, or the synthetic benchmark proposer).
    Tokens(Vec<u32>),
    /// This many tokens for the shard's draft model to propose.
    Draft(usize),
}

impl Proposal {
    pub(super) fn len(&self) -> usize {
        match self {
            Proposal::None => 0,
            Proposal::Tokens(t) => t.len(),
            Proposal::Draft(k) => *k,
        }
    }

    /// The first `k` proposals.
    pub(super) fn take(self, k: usize) -> Proposal {
        match self {
            Proposal::None => Proposal::None,
            _ if k == 0 => Proposal::None,
            Proposal::Tokens(mut t) => {
                t.truncate(k);
                Proposal::Tokens(t)
            }
            Proposal::Draft(n) => Proposal::Draft(n.min(k)),
        }
    }
}

/// The scheduler's view of one request.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// Assigned in arrival order, so a smaller id arrived earlier.
    pub id: RequestId,
    /// Every known token: the prompt, then the generated ones.
    pub token_ids: Vec<u32>,
    pub prompt_len: usize,
    /// Leading tokens whose KV is in this request's blocks (or its swapped-out copy).
    pub num_computed: usize,
    /// Whether the shards hold state for this request (it joined and was not removed).
    pub on_shard: bool,
    /// Blocks of its table the shards already know.
    pub blocks_sent: usize,
    pub sampling: pb::SamplingParams,
    pub top_n_tokens: u32,
    pub adapter_id: String,
    /// The id its log lines carry (`request_id`), sent to the shards with it.
    pub request_id: Arc<str>,
    pub num_preemptions: u32,
    /// The shards return the prompt tokens' logprobs with the first sampled token.
    pub prompt_logprobs: bool,
    pub arrived: Instant,
    /// Host blocks holding its KV while swapped out, in table order.
    pub swapped: Vec<u32>,
    /// Whether it has ever been admitted (left the queue for the first time).
    pub started: bool,
    /// Sampled tokens the shards know and the router does not yet (0 or 1: the step in
    /// flight when the next one was scheduled ahead).
    pub pending: usize,
    /// It generates at most this many tokens: never scheduled past them.
    pub max_new_tokens: usize,
    /// Trailing tokens of `token_ids` the router appended without the shards sampling
    /// them (forced by a grammar); sent with its next continuing step.
    pub forced_unsent: usize,
    /// Speculative decoding: what it proposes at its next decode (consumed by the schedule).
    pub proposal: Proposal,
    /// Proposals in the step in flight, computed but not yet verified: the shards' answer
    /// says how many of them count (`Scheduler::verified`).
    pub verifying: usize,
    /// KV-pool blocks its adapter's weights take, known once the adapter's host load has
    /// finished (`adapter_loaded`); None before that, and without an adapter.
    pub adapter_blocks: Option<usize>,
    /// Member of the batch being formed or run (dynamic and static batching).
    pub(super) in_batch: bool,
    /// Its tenant (the API key's; empty: the anonymous tenant of requests without a key)
    /// and the tenant's weight: `fair` scheduling divides service by it.
    pub tenant: Arc<str>,
    pub weight: f64,
    /// `priority` scheduling: lower runs first.
    pub priority: i64,
    /// Prompt tokens charged to its tenant's virtual counter so far: recomputation after
    /// a preemption is not charged twice.
    pub(super) charged_prompt: usize,
}

impl Sequence {
    pub fn new(id: RequestId, prompt: Vec<u32>, sampling: pb::SamplingParams) -> Self {
        Self {
            id,
            prompt_len: prompt.len(),
            token_ids: prompt,
            num_computed: 0,
            on_shard: false,
            blocks_sent: 0,
            sampling,
            top_n_tokens: 0,
            adapter_id: String::new(),
            request_id: "".into(),
            num_preemptions: 0,
            prompt_logprobs: false,
            arrived: Instant::now(),
            swapped: Vec::new(),
            started: false,
            pending: 0,
            max_new_tokens: usize::MAX,
            forced_unsent: 0,
            proposal: Proposal::None,
            verifying: 0,
            adapter_blocks: None,
            in_batch: false,
            tenant: "".into(),
            weight: 1.0,
            priority: 0,
            charged_prompt: 0,
        }
    }

    pub(super) fn has_adapter(&self) -> bool {
        !self.adapter_id.is_empty()
    }

    /// Its adapter's host load has not finished: it cannot join yet.
    pub(super) fn awaits_adapter(&self) -> bool {
        self.has_adapter() && self.adapter_blocks.is_none()
    }

    /// Tokens whose KV it holds once it has generated every token it may (its last sampled
    /// token needs none); without a token limit, its known tokens.
    pub(super) fn final_kv_tokens(&self) -> usize {
        let len = self.token_ids.len();
        if self.max_new_tokens == usize::MAX {
            return len;
        }
        let left = self.max_new_tokens.saturating_sub(self.num_generated());
        len + left.saturating_sub(1)
    }

    pub fn num_generated(&self) -> usize {
        self.token_ids.len() - self.prompt_len
    }

    /// Tokens to compute before it samples: the known ones, and the pending one.
    pub(super) fn remaining(&self) -> usize {
        self.token_ids.len() + self.pending - self.num_computed
    }

    /// It decodes at the next step (it has sampled, the token is known, nothing is forced
    /// or pending): what a proposal can follow.
    pub fn decodes_next(&self) -> bool {
        self.on_shard
            && self.pending == 0
            && self.forced_unsent == 0
            && self.remaining() == 1
            && !self.at_limit()
    }

    /// Its last allowed token is known or pending: nothing more to compute.
    pub(super) fn at_limit(&self) -> bool {
        self.num_generated() + self.pending >= self.max_new_tokens
    }
}

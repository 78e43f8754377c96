//! Speculative decoding in the batching loop: each eligible request's proposer state (its
//! n-gram index and running acceptance), the proposals set on the scheduler before each
//! schedule, and what a verification changes. The scheduler decides which proposals fit a
//! step (the load switch, `speculative_max_step_tokens`); the shards verify them.
//!
//! Eligible: a request with one sample and no grammar (a grammar's mask exists only for the
//! position it was computed at). Its k each step comes from its acceptance so far
//! (`AcceptanceTracker::choose_k`), except under the synthetic proposer, which always
//! proposes the most (its acceptance is set by hand, for measuring).

use std::collections::HashMap;

use crate::blocks::RequestId;
use crate::scheduler::{Proposal, Scheduler};
use crate::speculative::{AcceptanceTracker, NgramIndex};

/// Who proposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Prompt lookup over the request's own tokens, in the router.
    Ngram,
    /// The shards' draft model.
    Draft,
    /// Benchmarking: arbitrary tokens the shards accept at a set rate.
    Synthetic,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Ngram => "ngram",
            Method::Draft => "draft",
            Method::Synthetic => "synthetic",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct SpeculativeConfig {
    pub method: Method,
    /// Most proposals per request and step.
    pub max_tokens: usize,
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// Speculation is worth trying only while a step holds at most this many tokens: the
    /// loop then stops scheduling ahead, since proposals need the last token.
    pub max_step_tokens: usize,
}

impl SpeculativeConfig {
    /// The cost of one proposed token relative to a step without proposals, for choosing
    /// k: verifying it (a fraction of a small step) and, with a draft model, proposing it.
    fn proposal_cost(&self) -> f64 {
        match self.method {
            Method::Ngram | Method::Synthetic => 0.1,
            Method::Draft => 0.4,
        }
    }
}

/// One request's proposer.
struct Proposer {
    ngram: Option<NgramIndex>,
    acceptance: AcceptanceTracker,
}

pub(super) struct Speculation {
    config: SpeculativeConfig,
    requests: HashMap<RequestId, Proposer>,
}

impl Speculation {
    pub fn new(config: SpeculativeConfig) -> Self {
        Self {
            config,
            requests: HashMap::new(),
        }
    }

    /// Starts proposing for `id`, whose known tokens are `tokens` (its prompt).
    pub fn start(&mut self, id: RequestId, tokens: &[u32]) {
        let ngram = (self.config.method == Method::Ngram).then(|| {
            let mut index = NgramIndex::new(self.config.ngram_min, self.config.ngram_max);
            index.extend(tokens);
            index
        });
        let proposer = Proposer {
            ngram,
            acceptance: AcceptanceTracker::new(),
        };
        self.requests.insert(id, proposer);
    }

    /// Tokens appended to `id` (sampled, or accepted proposals).
    pub fn extend(&mut self, id: RequestId, tokens: &[u32]) {
        if let Some(index) = self.requests.get_mut(&id).and_then(|p| p.ngram.as_mut()) {
            index.extend(tokens);
        }
    }

    pub fn verified(&mut self, id: RequestId, proposed: usize, accepted: usize) {
        if let Some(p) = self.requests.get_mut(&id) {
            p.acceptance.record(proposed, accepted);
        }
    }

    pub fn forget(&mut self, id: RequestId) {
        self.requests.remove(&id);
    }

    /// Every request was failed (a step failed, or a drain was cut).
    pub fn forget_all(&mut self) {
        self.requests.clear();
    }

    /// Whether the next step may carry proposals: then it cannot be scheduled ahead of the
    /// answer that brings the tokens they follow.
    pub fn may_speculate(&self, scheduler: &Scheduler) -> bool {
        !self.requests.is_empty() && scheduler.num_running() < self.config.max_step_tokens
    }

    /// Sets a proposal on every eligible running request that decodes next.
    pub fn propose(&mut self, scheduler: &mut Scheduler) {
        if self.requests.is_empty() || scheduler.num_running() >= self.config.max_step_tokens {
            return;
        }
        let max = self.config.max_tokens;
        let cost = self.config.proposal_cost();
        let mut proposals = Vec::new();
        for seq in scheduler.running() {
            let Some(p) = self.requests.get_mut(&seq.id) else {
                continue;
            };
            if !seq.decodes_next() {
                continue;
            }
            let proposal = match self.config.method {
                Method::Synthetic => {
                    let last = *seq.token_ids.last().expect("a request has tokens");
                    Proposal::Tokens(vec![last; max])
                }
                method => match p.acceptance.choose_k(max, cost) {
                    0 => Proposal::None,
                    k if method == Method::Draft => Proposal::Draft(k),
                    k => {
                        let tokens = p.ngram.as_ref().map(|n| n.propose(k)).unwrap_or_default();
                        if tokens.is_empty() {
                            Proposal::None
                        } else {
                            Proposal::Tokens(tokens)
                        }
                    }
                },
            };
            if proposal != Proposal::None {
                proposals.push((seq.id, proposal));
            }
        }
        for (id, proposal) in proposals {
            scheduler.propose(id, proposal);
        }
    }
}

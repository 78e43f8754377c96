//! A request's samples (`best_of` / `n` of them) in the batching loop: each is its own
//! sequence with its own seed; the first is queued, the others wait until it has
//! computed the prompt and then fork from it, sharing its KV blocks copy-on-write.

use std::sync::Arc;

use super::batching_loop::Loop;
use super::handle::Admission;
use super::output::{Entry, Shared};
use crate::blocks::RequestId;
use crate::client::Backend;
use crate::scheduler::Sequence;

/// A sample 1.. of a `best_of` request, held until sample 0 has computed the prompt.
pub(super) struct Sibling {
    pub seq: Sequence,
    pub entry: Entry,
}

/// The seed of sample `index` of a request: the request's own for the first, then
/// distinct ones derived from it (SplitMix64), so a seeded request is reproducible.
fn sample_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed.wrapping_add((index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl<B: Backend> Loop<B> {
    /// Queues a request's samples. This is the one place siblings are created: each is
    /// its own sequence with a seed derived from the request's (the first keeps it).
    /// Only the first is queued; the others wait in `siblings` until it has computed the
    /// prompt, then fork from it (`start_siblings`) and share its blocks copy-on-write.
    pub(super) fn admit(&mut self, admission: Admission) {
        let Admission {
            request,
            samples,
            permit,
            queued_at,
            slot,
            context,
        } = admission;
        let shared = Shared {
            queued_at,
            slot: Arc::new(slot),
            permit: Arc::new(permit),
            context,
        };
        if request.grammar.is_some() {
            self.metrics.constrained_requests.add(1);
            match request.grammar_compile_time {
                Some(took) => self.metrics.grammar_compile.observe(took.as_secs_f64()),
                None => self.metrics.grammar_cache_hits.add(1),
            }
        }
        let first = self.next_id;
        tracing::info!(
            request_id = &*shared.context.id,
            id = first,
            tenant = shared.context.tenant.as_deref(),
            input_tokens = request.input_ids.len(),
            max_new_tokens = request.max_new_tokens,
            best_of = request.best_of,
            "admitted"
        );
        for (index, events) in samples.into_iter().enumerate() {
            // Siblings get their id when they start (a fork's id must be the newest).
            let id = if index == 0 { first } else { RequestId::MAX };
            if index == 0 {
                self.next_id += 1;
            }
            let seed = request.seed.map(|s| sample_seed(s, index));
            let mut sampling = request.sampling.clone();
            sampling.seed = seed.unwrap_or(0);
            let mut seq = Sequence::new(id, request.input_ids.clone(), sampling);
            seq.max_new_tokens = request.max_new_tokens;
            seq.top_n_tokens = request.top_n_tokens;
            seq.adapter_id = request.adapter_id.clone();
            seq.request_id = shared.context.id.clone();
            // Siblings share the prompt: its logprobs come with the first only.
            seq.prompt_logprobs = request.prompt_logprobs && index == 0;
            let entry = Entry::new(events, &request, &seq, seed, &shared);
            self.metrics.prompt_tokens.add(seq.prompt_len as u64);
            // Billed once per request, as the answers' usage reports it: siblings share
            // the prompt's blocks.
            if let (0, Some(tenant)) = (index, shared.permit.tenant()) {
                tenant.prompt_tokens.add(seq.prompt_len as u64);
            }
            tracing::debug!(
                request_id = &*shared.context.id,
                first,
                index,
                input_tokens = seq.prompt_len,
                "queued"
            );
            if index == 0 {
                // Proposals need one sample (siblings fork from shared blocks) and no
                // grammar (its mask exists only for the next position).
                let eligible = request.best_of == 1 && request.grammar.is_none();
                if let (Some(speculation), true) = (self.speculation.as_mut(), eligible) {
                    speculation.start(id, &seq.token_ids);
                }
                self.scheduler.add(seq);
                self.entries.insert(id, entry);
            } else {
                self.siblings
                    .entry(first)
                    .or_default()
                    .push(Sibling { seq, entry });
            }
        }
    }

    /// Starts the siblings waiting on `first`: forked from it when it has just computed
    /// the prompt (`fork`: its first token is being applied, not yet appended), else (it
    /// ended before that, or the batch is full) queued as independent requests, which
    /// still share the prompt's full blocks through the prefix cache.
    pub(super) fn start_siblings(&mut self, first: RequestId, fork: bool) {
        let Some(siblings) = self.siblings.remove(&first) else {
            return;
        };
        let started_at = self.entries.get(&first).and_then(|e| e.started_at);
        for Sibling { mut seq, mut entry } in siblings {
            if entry.events.is_closed() {
                continue;
            }
            let id = self.next_id;
            self.next_id += 1;
            if fork && self.scheduler.fork(first, id, seq.sampling.seed) {
                tracing::debug!(request_id = &*entry.request_id, id, first, "forked");
                entry.spans.scheduled();
                entry.slot = None;
                entry.started_at = started_at;
            } else {
                seq.id = id;
                self.scheduler.add(seq);
            }
            self.entries.insert(id, entry);
        }
    }
}

//! What a beam search asks of the scheduler. A beam is a sequence like any other; after
//! each round the batching loop ranks the beams' candidates (`infer::beam_search`) and
//! here each survivor becomes a sequence: the parent itself when it goes on with the
//! token its row sampled (the shards already appended it), else a fork that shares every
//! block of its parent (reference-counted; the partial last block is copied when the
//! fork first writes into it) and joins the shards with the chosen token to compute.
//! A beam that has sampled waits (`park`) until every beam of its group has: nothing is
//! scheduled for it meanwhile.

use crate::blocks::RequestId;

use super::sequence::Proposal;
use super::{Scheduler, Sequence};

impl Scheduler {
    /// Running request `id` sampled a token the router does not append (yet): it has
    /// nothing to compute until `append_tokens` or `finish`.
    pub fn park(&mut self, id: RequestId) {
        if let Some(i) = self.running_index(id) {
            self.running[i].pending = 0;
        }
    }

    /// Forks running request `parent` (caught up, its sample not appended) into `child`
    /// (an id greater than every other) going on with `token`: shares all its blocks and
    /// joins at the next step to compute `token`. False when it cannot (the parent is not
    /// running or has not caught up, or the batch is full): the caller queues the beam.
    pub fn fork_beam(&mut self, parent: RequestId, child: RequestId, token: u32) -> bool {
        self.caught_up(parent) && self.fork_running(parent, child, |seq| seq.token_ids.push(token))
    }

    /// Queues a beam that could not fork, first in line (its group waits for it): it
    /// computes its tokens again, sharing the full blocks the prefix cache still holds.
    pub fn queue_beam(&mut self, mut seq: Sequence) {
        seq.num_computed = 0;
        seq.on_shard = false;
        seq.blocks_sent = 0;
        seq.pending = 0;
        seq.swapped.clear();
        seq.proposal = Proposal::None;
        self.waiting.push_front(seq);
    }

    /// Whether running request `id` holds every known token's KV on the shards, with
    /// nothing pending: a token appended now is what it computes next.
    pub fn caught_up(&self, id: RequestId) -> bool {
        self.running_index(id).is_some_and(|i| {
            let s = &self.running[i];
            s.on_shard && s.pending == 0 && s.num_computed == s.token_ids.len()
        })
    }

    /// Whether request `id` is in the running batch.
    pub fn is_running(&self, id: RequestId) -> bool {
        self.running_index(id).is_some()
    }

    /// Blocks the running requests of `ids` save by sharing: the entries of their block
    /// tables less the distinct blocks among them.
    pub fn blocks_saved(&self, ids: impl Iterator<Item = RequestId>) -> usize {
        let mut entries = 0;
        let mut distinct = std::collections::HashSet::new();
        for id in ids {
            let table = self.blocks.table(id);
            entries += table.len();
            distinct.extend(table.iter().copied());
        }
        entries - distinct.len()
    }
}

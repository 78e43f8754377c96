//! Beam groups: the requests searched with beams. A group starts as one sequence (the
//! prompt); each round, every live beam's row returns its `keep` most likely tokens
//! (`top_n_tokens`, one top-k over the whole batch in the shard), the group waits until
//! every beam has answered (a beam that sampled is parked), then ranks them
//! (`beam_search::Search::round`) and turns the survivors into the next round's
//! sequences: a parent goes on with its own sampled token, other survivors fork from
//! their parent's blocks (`Scheduler::fork_beam`), and the beams nobody continues are
//! finished at once (their blocks freed). When a beam of a group waits in the queue
//! (preempted, or queued because it could not fork), the group's parked beams give
//! their blocks back too (`yield_blocks`): the group is preempted as a whole, and its
//! next beams compute their tokens again (the prefix cache shares what it still holds).
//! At the end the hypotheses, best first, are sent to the request's samples.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use super::beam_search::{Beam, Candidates, History, Hypothesis, Round, Search};
use super::entry::Entry;
use crate::blocks::RequestId;
use crate::pb;
use crate::scheduler::{Scheduler, Sequence};
use crate::validation::BeamSearch;

/// A live beam: its sequence and, once its row answered this round, what it returned.
struct LiveBeam {
    id: RequestId,
    beam: Beam,
    /// The token its row sampled (the shards appended it) and its candidates.
    answer: Option<(u32, Candidates)>,
}

struct Group {
    search: Search,
    /// The prompt's sequence as admitted: a beam that cannot fork is built from it.
    template: Sequence,
    /// One per sample (`width` of them): the hypotheses go to them, best first.
    entries: Vec<Entry>,
    live: Vec<LiveBeam>,
    /// Candidates per row.
    keep: usize,
    top_n: usize,
    /// The tokens that end a hypothesis (none with `ignore_eos`).
    eos: HashSet<u32>,
}

/// Every beam group of a batching loop, and which group each beam's sequence is in.
#[derive(Default)]
pub(super) struct BeamGroups {
    groups: HashMap<RequestId, Group>,
    group_of: HashMap<RequestId, RequestId>,
}

/// A finished search: its hypotheses, best first, and the samples they go to.
pub(super) struct Finished {
    pub hypotheses: Vec<Hypothesis>,
    pub entries: Vec<Entry>,
}

impl BeamGroups {
    /// Starts a group: `seq` (the prompt, id `seq.id`) is queued, asking for `keep`
    /// candidates per row; `entries` receive the hypotheses.
    pub fn admit(
        &mut self,
        mut seq: Sequence,
        entries: Vec<Entry>,
        params: BeamSearch,
        keep: usize,
        eos: HashSet<u32>,
        scheduler: &mut Scheduler,
    ) {
        let id = seq.id;
        let top_n = seq.top_n_tokens as usize;
        seq.top_n_tokens = keep as u32;
        seq.sampling.do_sample = false;
        let search = Search::new(params, seq.max_new_tokens);
        let group = Group {
            search,
            template: seq.clone(),
            entries,
            live: vec![LiveBeam {
                id,
                beam: Beam {
                    cumulative: 0.0,
                    history: History::default(),
                },
                answer: None,
            }],
            keep,
            top_n,
            eos,
        };
        scheduler.add(seq);
        self.groups.insert(id, group);
        self.group_of.insert(id, id);
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Whether `id` is a beam's sequence.
    pub fn owns(&self, id: RequestId) -> bool {
        self.group_of.contains_key(&id)
    }

    /// When `id`'s group was queued (its first beam leaving the queue frees the
    /// request's place in it).
    pub fn left_queue(&mut self, id: RequestId) -> Option<Instant> {
        let group = self.groups.get_mut(self.group_of.get(&id)?)?;
        let mut queued_at = None;
        for entry in &mut group.entries {
            entry.slot = None;
            queued_at = Some(entry.queued_at);
        }
        queued_at
    }

    /// Beam `id` answered: records its row and parks it. Returns its group's id when
    /// every live beam of the group has answered.
    pub fn record(
        &mut self,
        generation: &pb::Generation,
        scheduler: &mut Scheduler,
    ) -> Option<RequestId> {
        let first = *self.group_of.get(&generation.id)?;
        let group = self.groups.get_mut(&first)?;
        let beam = group.live.iter_mut().find(|b| b.id == generation.id)?;
        let sampled = *generation.token_ids.first()?;
        let tokens = generation
            .top_tokens
            .first()
            .map(|top| {
                top.ids
                    .iter()
                    .copied()
                    .zip(top.logprobs.iter().copied())
                    .collect()
            })
            .unwrap_or_default();
        beam.answer = Some((
            sampled,
            Candidates {
                tokens,
                top_n: group.top_n,
            },
        ));
        scheduler.park(generation.id);
        group
            .live
            .iter()
            .all(|b| b.answer.is_some())
            .then_some(first)
    }

    /// Ranks group `first`'s round and makes its next beams; the finished search when it
    /// is over. `next_id` hands out the forks' ids.
    pub fn advance(
        &mut self,
        first: RequestId,
        scheduler: &mut Scheduler,
        next_id: &mut RequestId,
    ) -> Option<Finished> {
        let group = self.groups.get_mut(&first)?;
        let beams: Vec<Beam> = group.live.iter().map(|b| b.beam.clone()).collect();
        let rows: Vec<Candidates> = group
            .live
            .iter()
            .map(|b| b.answer.as_ref().map(|a| a.1.clone()).unwrap_or_default())
            .collect();
        let eos = &group.eos;
        let round = group
            .search
            .round(&beams, &rows, group.keep, |t| eos.contains(&t));
        let survivors = match round {
            Round::Done(hypotheses) => {
                let group = self.groups.remove(&first).expect("present");
                for beam in &group.live {
                    scheduler.finish(beam.id);
                    self.group_of.remove(&beam.id);
                }
                return Some(Finished {
                    hypotheses,
                    entries: group.entries,
                });
            }
            Round::Continue(survivors) => survivors,
        };
        let old = std::mem::take(&mut group.live);
        let mut kept = vec![false; old.len()];
        let mut next = Vec::with_capacity(survivors.len());
        for survivor in survivors {
            let parent = &old[survivor.parent];
            let sampled = parent.answer.as_ref().map(|a| a.0);
            // The parent goes on with the token its row sampled: the shards have it.
            if !kept[survivor.parent]
                && sampled == Some(survivor.token)
                && scheduler.caught_up(parent.id)
                && scheduler.append_tokens(parent.id, &[survivor.token])
            {
                kept[survivor.parent] = true;
                next.push(LiveBeam {
                    id: parent.id,
                    beam: survivor.beam,
                    answer: None,
                });
                continue;
            }
            let id = *next_id;
            *next_id += 1;
            if !scheduler.fork_beam(parent.id, id, survivor.token) {
                let mut seq = group.template.clone();
                seq.id = id;
                seq.token_ids.extend(survivor.beam.history.tokens());
                scheduler.queue_beam(seq);
            }
            self.group_of.insert(id, first);
            next.push(LiveBeam {
                id,
                beam: survivor.beam,
                answer: None,
            });
        }
        for (beam, kept) in old.iter().zip(kept) {
            if !kept {
                scheduler.finish(beam.id);
                self.group_of.remove(&beam.id);
            }
        }
        group.live = next;
        None
    }

    /// The groups with a beam waiting in the queue give back the blocks of their parked
    /// beams (whose answers they keep), so that the waiting beam can be admitted.
    pub fn yield_blocks(&mut self, scheduler: &mut Scheduler) {
        for group in self.groups.values_mut() {
            let waits = group
                .live
                .iter()
                .any(|b| b.answer.is_none() && !scheduler.is_running(b.id));
            for beam in &mut group.live {
                let parked = beam.answer.is_some();
                if parked
                    && (waits || !scheduler.is_running(beam.id))
                    && scheduler.finish(beam.id).is_some()
                {
                    tracing::debug!(id = beam.id, "parked beam gave its blocks back");
                }
            }
        }
    }

    /// Blocks the live beams save by sharing, over every group.
    pub fn blocks_saved(&self, scheduler: &Scheduler) -> usize {
        self.groups
            .values()
            .map(|g| scheduler.blocks_saved(g.live.iter().map(|b| b.id)))
            .sum()
    }

    /// Takes out the groups whose every sample's client went away (their beams finished).
    pub fn drop_cancelled(&mut self, scheduler: &mut Scheduler) -> bool {
        let gone: Vec<RequestId> = self
            .groups
            .iter()
            .filter(|(_, g)| g.entries.iter().all(|e| e.events.is_closed()))
            .map(|(&id, _)| id)
            .collect();
        for &first in &gone {
            self.remove(first, scheduler);
        }
        !gone.is_empty()
    }

    /// Takes out the group beam `id` is in, its beams finished; its samples.
    pub fn remove_with(&mut self, id: RequestId, scheduler: &mut Scheduler) -> Vec<Entry> {
        match self.group_of.get(&id) {
            Some(&first) => self.remove(first, scheduler),
            None => Vec::new(),
        }
    }

    fn remove(&mut self, first: RequestId, scheduler: &mut Scheduler) -> Vec<Entry> {
        let Some(group) = self.groups.remove(&first) else {
            return Vec::new();
        };
        for beam in &group.live {
            scheduler.finish(beam.id);
            self.group_of.remove(&beam.id);
        }
        group.entries
    }

    /// Every group's samples, the groups forgotten (the scheduler is reset apart).
    pub fn drain(&mut self) -> Vec<Entry> {
        self.group_of.clear();
        self.groups.drain().flat_map(|(_, g)| g.entries).collect()
    }
}

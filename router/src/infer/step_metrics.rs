//! What the batching loop records in the metrics once per schedule and once per step.

use std::collections::BTreeSet;

use super::book::RequestBook;
use crate::metrics::{LoadGauges, Metrics};
use crate::scheduler::{Schedule, Scheduler, Sequence};

/// Step-level metrics, and the end of the queue wait for requests admitted now.
pub(super) fn record_schedule(m: &Metrics, schedule: &Schedule, book: &mut RequestBook) {
    m.preemptions_recompute.add(schedule.preempted.len() as u64);
    m.preemptions_swap.add(schedule.swapped_out.len() as u64);
    m.prefix_queries.add(schedule.prefix_queried as u64);
    m.prefix_hits.add(schedule.prefix_hits as u64);
    if let (Some(spec), true) = (m.speculative(), schedule.speculation_off > 0) {
        spec.record_step_off();
    }
    if let Some(step) = &schedule.step {
        let size = step.joined.len() + step.continuing.len();
        if size > 0 {
            m.batch_size.observe(size as f64);
            m.batch_tokens.observe(schedule.num_tokens as f64);
            m.step_tokens.add(schedule.num_tokens as u64);
        }
    }
    for &id in &schedule.admitted {
        if let Some(queued_at) = book.left_queue(id) {
            m.queue_time.observe(queued_at.elapsed().as_secs_f64());
        }
    }
}

/// Queue and KV gauges after a step (and the adapters', when `adapters` is on).
pub(super) fn record_state(m: &LoadGauges, s: &Scheduler, adapters: bool) {
    m.waiting.set(s.num_waiting() as f64);
    m.running.set(s.num_running() as f64);
    let swapped = s.waiting().iter().filter(|q| !q.swapped.is_empty()).count();
    m.swapped.set(swapped as f64);
    m.kv_blocks_used.set(s.blocks().num_used() as f64);
    m.kv_blocks_cached.set(s.blocks().num_cached() as f64);
    m.kv_utilization.set(s.kv_utilization());
    if adapters {
        let distinct = |seqs: &mut dyn Iterator<Item = &Sequence>| {
            let names: BTreeSet<String> = seqs
                .filter(|q| !q.adapter_id.is_empty())
                .map(|q| q.adapter_id.clone())
                .collect();
            names.into_iter().collect()
        };
        let running = distinct(&mut s.running().iter());
        let waiting = distinct(&mut s.waiting().iter());
        m.adapters.record(running, waiting);
        let blocks = s.blocks();
        m.adapters
            .resident
            .set(blocks.resident_adapters().count() as f64);
        m.adapters.blocks.set(blocks.num_adapter_blocks() as f64);
        m.adapters
            .blocks_in_use
            .set(blocks.num_adapter_blocks_in_use() as f64);
    }
}

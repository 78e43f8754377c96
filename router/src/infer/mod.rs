//! The batching loop and its handle.
//!
//! One task owns every piece of batch state (the scheduler, each request's decoding
//! state); HTTP handlers talk to it over channels. Each iteration: take new requests,
//! drop those whose client left, schedule, send the Step diff to the shards, then turn
//! the sampled tokens into text, check EOS / stop strings / length, stream, and retire
//! finished requests (their blocks are freed at once, their shard state at the next step).
//!
//! Asynchronous scheduling (unless `--no-async-scheduling`; `cadence launch` has it on for
//! every device, see docs/scheduler.md): while step N runs, the loop schedules step
//! N + 1 ahead (`Scheduler::schedule_ahead`, N's samples pending) and sends it, then waits
//! for N's tokens. The shards run steps in the order sent, so they go from N to N + 1
//! without waiting for the router, and the router's work and the round trip overlap the
//! forward. A request that ends at step N (EOS, a stop string) has one more token computed
//! by N + 1, which is dropped. With speculative decoding, a step is not scheduled ahead
//! while proposals are possible: they follow the token the step in flight samples.
//!
//! - `handle`: `Infer`, what the HTTP side holds; `Infer::submit` is the one way in.
//! - `admission`: what a request brings to its loop and holds until it ends.
//! - `balance`: which replica (shard group and its loop) a new request goes to.
//! - `batching_loop`: the loop itself: scheduling, sending steps, applying their answers.
//! - `book`: the request book, the one owner of the loop's requests: admits, emits their
//!   tokens, retires and fails them.
//! - `emit`: the one way a token reaches its request (counted, turned into its event).
//! - `entry`: one sample's decoding state: its text, stop strings, grammar and end.
//! - `siblings`: a request's `best_of` samples, forked from the first.
//! - `beam`: beam groups (a request searched with `num_beams`): their rounds, forks and
//!   end; `beam_search`: the ranking of a round and the finished hypotheses.
//! - `adapters`: the LoRA adapters' loads as the loop learns of them.
//! - `step_metrics`: what the loop records per schedule and per step.
//! - `speculation`: speculative decoding's proposers, one per eligible request.
//! - `spans`: each request's trace spans (queue, prefill chunks, decode) when traced.
//! - `progress`: when the loop started waiting for the step in flight (for `/ready`).
//! - `events`: what a handler receives; `samples`: those events gathered, and ranked.

mod adapters;
mod admission;
pub mod balance;
mod batching_loop;
mod beam;
mod beam_search;
mod book;
mod emit;
mod entry;
mod events;
mod handle;
mod progress;
mod samples;
mod siblings;
mod spans;
mod speculation;
mod step_metrics;

pub use batching_loop::LoopConfig;
pub use events::{End, EventResult, FinishReason, Token, TokenEvent};
pub use handle::{Infer, Submitted};
pub use progress::StepClock;
pub use samples::{best_first, collect, Sample};
pub use speculation::{Method as SpeculativeMethod, SpeculativeConfig};

//! The router's side of speculative decoding, as building blocks the batching loop calls:
//! `ngram` proposes tokens by prompt lookup (one index per request, extended as tokens
//! are known), `policy` chooses how many to propose (per request, from its acceptance
//! rate; the scheduler fits them under the step's load threshold), and `metrics` counts verifications for
//! /metrics (under vLLM's names).

pub mod metrics;
pub mod ngram;
pub mod policy;

pub use metrics::SpecDecodeMetrics;
pub use ngram::NgramIndex;
pub use policy::{best_k, expected_tokens, AcceptanceTracker, INITIAL_ACCEPTANCE};

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

/// The in-memory shard.
mod fake_shard;
/// The router in front of it, and the helpers that send requests.
mod harness;
use fake_shard::*;
use harness::*;

/// Anthropic's Messages API.
mod anthropic;
/// The batching loop through the routes: preemption, failures, async scheduling.
mod batching;
/// Beam search: answers against a plain search, block sharing, preemption, refusals.
mod beams;
/// Structured outputs: grammars, JSON schemas, choices.
mod constraints;
/// TGI's generating routes and their streams.
mod generate;
/// `/health`, `/ready`, the drain, and what gateways read.
mod lifecycle;
/// LoRA adapters: host loads, paging into the KV pool, the HTTP surface.
mod lora;
/// OpenAI's completions and chat completions.
mod openai;
/// 429s and 503s on every route, and the slots cancelled streams free.
mod overload;
/// `--reasoning-parser` on every chat route, and `chat_template_kwargs`.
mod reasoning;
/// Unknown routes, methods and models; CORS preflights; counted rejections.
mod rejections;
/// Several shard groups behind one router.
mod replicas;
/// The request id from HTTP to the shard.
mod request_ids;
/// /info, API keys, /tokenize, the OpenAPI document, /metrics.
mod routes;
/// Proposals verified in one forward (speculative decoding).
mod speculative;
/// Tokens per minute per tenant, `/v1/usage`, the key file reloaded.
mod tenant_limits;
/// API keys' tenants: accounting and per-key limits.
mod tenants;
/// Tool calling on chat completions.
mod tools;
/// Invalid requests and what can never fit.
mod validation;

// Shared with the other files' tests (the drain refuses as overload does; Anthropic's
// tools use chat's template).
use overload::{assert_every_route_refuses, SHUTTING_DOWN};
use tools::{TOOL_CALL, TOOL_TEMPLATE};

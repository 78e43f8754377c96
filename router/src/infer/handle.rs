//! The HTTP side's handle on the batching loops, and the one way any route's request gets
//! in: `Infer::submit` refuses requests while draining, checks the admission limits,
//! validates, picks a replica (`balance`; one batching loop per replica) and queues the
//! request's samples for its loop.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use super::admission::{Admission, Held, QueueSlot};
use super::balance::{Balancer, ReplicaLoad};
use super::batching_loop::{self, LoopConfig, Shared};
use super::events::EventResult;
use super::progress::StepClock;
use crate::client::Backend;
use crate::drain::Drain;
use crate::error::InferError;
use crate::lora::{AdapterPin, Registry};
use crate::metrics::{LoadGauges, Metrics};
use crate::request_scope::RequestContext;
use crate::scheduler::objectives::ObjectivePriorities;
use crate::tenants::{TenantHold, Tenants};
use crate::validation::{Extra, GenerateParameters, Prompt, ValidRequest, Validation};

/// How often a drain checks whether the requests in flight have ended.
const IDLE_POLL: Duration = Duration::from_millis(10);

/// A queued request: what validation made of it, one event stream per sample.
pub struct Submitted {
    pub request: ValidRequest,
    pub samples: Vec<mpsc::UnboundedReceiver<EventResult>>,
}

/// One shard group and its batching loop.
struct Replica {
    tx: mpsc::UnboundedSender<Admission>,
    progress: Arc<StepClock>,
    load: Arc<LoadGauges>,
    /// Requests sent to this replica and not ended.
    assigned: Arc<AtomicUsize>,
}

/// What the HTTP side holds: validation, the admission limits, the way to each replica's
/// loop, the metrics, the loops' progress and the drain.
#[derive(Clone)]
pub struct Infer {
    pub validation: Arc<Validation>,
    limiter: Arc<Semaphore>,
    max_concurrent_requests: usize,
    queued: Arc<AtomicUsize>,
    max_waiting_requests: usize,
    metrics: Arc<Metrics>,
    drain: Arc<Drain>,
    replicas: Arc<[Replica]>,
    balancer: Arc<Balancer>,
    adapters: Arc<Registry>,
    tenants: Arc<Tenants>,
    /// The gateway objectives' priorities (`--objective-priorities`).
    objectives: Arc<ObjectivePriorities>,
}

impl Infer {
    /// Starts the batching loop of one shard group on the current runtime.
    pub fn spawn<B: Backend>(
        backend: B,
        validation: Validation,
        max_concurrent_requests: usize,
        config: LoopConfig,
    ) -> Self {
        Self::spawn_replicas(vec![(backend, config)], validation, max_concurrent_requests)
    }

    /// Starts one batching loop per replica (a shard group and its loop's configuration,
    /// at least one). The queue bound (`max_waiting_requests`) is replica 0's; it bounds
    /// the requests waiting on all of them together.
    pub fn spawn_replicas<B: Backend>(
        replicas: Vec<(B, LoopConfig)>,
        validation: Validation,
        max_concurrent_requests: usize,
    ) -> Self {
        let first = &replicas.first().expect("at least one replica").1;
        let metrics = Arc::new(
            Metrics::with_replicas(&first.served_model_name, replicas.len())
                .with_max_model_len(validation.limits.max_total_tokens),
        );
        let max_waiting_requests = first.max_waiting_requests;
        let adapters = first.adapters.clone();
        if adapters.enabled() {
            metrics.enable_lora(adapters.metrics().clone());
        }
        let balancer = Arc::new(Balancer::new(first.scheduler.block_size));
        let drain = Arc::new(Drain::default());
        let tokenizer = validation.tokenizer.clone();
        let handles = replicas
            .into_iter()
            .enumerate()
            .map(|(i, (backend, config))| {
                let (tx, rx) = mpsc::unbounded_channel();
                let replica = Replica {
                    tx,
                    progress: Arc::new(StepClock::default()),
                    load: metrics.load(i).clone(),
                    assigned: Arc::new(AtomicUsize::new(0)),
                };
                let shared = Shared {
                    metrics: metrics.clone(),
                    load: replica.load.clone(),
                    progress: replica.progress.clone(),
                    drain: drain.clone(),
                };
                let tokenizer = tokenizer.clone();
                tokio::spawn(batching_loop::run(backend, rx, tokenizer, config, shared));
                replica
            })
            .collect();
        Self {
            validation: Arc::new(validation),
            limiter: Arc::new(Semaphore::new(max_concurrent_requests)),
            max_concurrent_requests,
            queued: Arc::new(AtomicUsize::new(0)),
            max_waiting_requests,
            metrics,
            drain,
            replicas: handles,
            balancer,
            adapters,
            tenants: Arc::new(Tenants::default()),
            objectives: Arc::default(),
        }
    }

    /// Accounts requests to the tenants of the API keys, and holds each to its own
    /// limit of requests in flight (`tenants`); exported by `/metrics`.
    pub fn with_tenants(mut self, tenants: Arc<Tenants>) -> Self {
        self.metrics.enable_tenants(tenants.clone());
        self.tenants = tenants;
        self
    }

    /// Runs a request without a `priority` at its gateway objective's.
    pub fn with_objective_priorities(mut self, objectives: ObjectivePriorities) -> Self {
        self.objectives = Arc::new(objectives);
        self
    }

    /// The API keys' tenants and their accounts (empty without keys).
    pub fn tenants(&self) -> &Arc<Tenants> {
        &self.tenants
    }

    /// The LoRA adapters requests may name.
    pub fn adapters(&self) -> &Arc<Registry> {
        &self.adapters
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// How many replicas (shard groups, each with its loop) serve requests.
    pub fn num_replicas(&self) -> usize {
        self.replicas.len()
    }

    /// When replica `i`'s loop started waiting for the step in flight (`/ready` reads it).
    pub fn progress(&self, i: usize) -> &StepClock {
        &self.replicas[i].progress
    }

    /// Whether replica `i` gets new requests (its readiness check, kept by `/ready` and
    /// the replica monitor).
    pub fn set_replica_ready(&self, i: usize, ready: bool) {
        self.replicas[i]
            .load
            .ready
            .set(if ready { 1.0 } else { 0.0 });
    }

    pub fn drain(&self) -> &Drain {
        &self.drain
    }

    /// Requests admitted and not ended yet (queued, validating or generating).
    pub fn in_flight(&self) -> usize {
        self.max_concurrent_requests - self.limiter.available_permits()
    }

    /// Resolves once no request is in flight: every admitted request has ended (each
    /// holds a permit from admission to its end). Polled: `acquire_many` would hold the
    /// permits it gathers while it waits, and `in_flight` would read them as requests.
    pub async fn until_idle(&self) {
        while self.in_flight() > 0 {
            tokio::time::sleep(IDLE_POLL).await;
        }
    }

    /// Admits, validates and queues a request of any route as its `best_of` samples.
    /// Every error comes before any token, so a handler can still answer with a status
    /// code.
    pub async fn submit(
        &self,
        prompt: Prompt,
        mut parameters: GenerateParameters,
        extra: Extra,
    ) -> Result<Submitted, InferError> {
        // Before validation: a draining or overloaded router spends nothing on tokenizing.
        if self.drain.is_draining() {
            return Err(Drain::refusal());
        }
        let context = RequestContext::current();
        // The tenant's own limit first: a refused request takes no global place.
        let tenant = self
            .tenants
            .admit(context.tenant.as_deref())
            .map_err(|refusal| {
                self.metrics.requests_rejected.add(1);
                InferError::RateLimited {
                    message: refusal.message,
                    retry_after: refusal.retry_after,
                }
            })?;
        let permit = self.try_permit()?;
        // Again, holding the permit: a drain that began since waits for it, or this
        // request sees the drain.
        if self.drain.is_draining() {
            return Err(Drain::refusal());
        }
        parameters.priority = self
            .objectives
            .priority(parameters.priority, context.objective.as_deref());
        let request = self
            .validation
            .validate_prompt(prompt, parameters, extra)
            .await?;
        let adapter = self.pin_adapter(&request.adapter_id)?;
        self.enqueue(request, permit, adapter, tenant, context)
    }

    /// Keeps the request's adapter in use (and starts its load) or answers 422 naming
    /// `parameters.adapter_id`.
    fn pin_adapter(&self, name: &str) -> Result<Option<AdapterPin>, InferError> {
        if name.is_empty() {
            return Ok(None);
        }
        match self.adapters.pin(name) {
            Some(pin) => Ok(Some(pin)),
            None if self.adapters.enabled() => Err(InferError::Validation(format!(
                "parameters.adapter_id: unknown adapter {name:?}"
            ))),
            None => Err(InferError::Validation(format!(
                "parameters.adapter_id: unknown adapter {name:?} (no adapters are loaded)"
            ))),
        }
    }

    /// Takes a slot among the concurrent requests, or answers 429.
    fn try_permit(&self) -> Result<OwnedSemaphorePermit, InferError> {
        self.limiter
            .clone()
            .try_acquire_owned()
            .map_err(|_| self.reject("too many requests in flight, try again later".into()))
    }

    /// Queues a validated request (taken a permit, and its tenant's, for) as its
    /// `best_of` samples, or answers 429 when the waiting queue is full.
    fn enqueue(
        &self,
        request: ValidRequest,
        permit: OwnedSemaphorePermit,
        adapter: Option<AdapterPin>,
        tenant: Option<TenantHold>,
        context: RequestContext,
    ) -> Result<Submitted, InferError> {
        let Some(slot) = QueueSlot::try_take(&self.queued, self.max_waiting_requests) else {
            return Err(self.reject(format!(
                "the queue is full ({} requests waiting), try again later",
                self.max_waiting_requests
            )));
        };
        let (senders, samples): (Vec<_>, Vec<_>) = (0..request.best_of.max(1))
            .map(|_| mpsc::unbounded_channel())
            .unzip();
        let replica = &self.replicas[self.pick_replica(&request)];
        replica.load.routed.add(1);
        let admission = Admission {
            request: request.clone(),
            samples: senders,
            permit: Held::new(permit, &replica.assigned, adapter, tenant),
            queued_at: Instant::now(),
            slot,
            context,
        };
        replica
            .tx
            .send(admission)
            .map_err(|_| InferError::Generation("the batching loop has stopped".into()))?;
        Ok(Submitted { request, samples })
    }

    /// The replica for a request, by load and prompt-prefix affinity (`balance`).
    fn pick_replica(&self, request: &ValidRequest) -> usize {
        let loads: Vec<ReplicaLoad> = self
            .replicas
            .iter()
            .map(|r| ReplicaLoad {
                assigned: r.assigned.load(Ordering::Acquire),
                kv_usage: r.load.kv_usage(),
                ready: r.load.ready.get() > 0.0,
            })
            .collect();
        self.balancer.pick(&request.input_ids, &loads)
    }

    /// A 429, counted: the one place `cadence_requests_rejected_total` grows.
    fn reject(&self, message: String) -> InferError {
        self.metrics.requests_rejected.add(1);
        InferError::Overloaded(message)
    }
}

//! What a request brings from the HTTP side to its batching loop (`Admission`), and what
//! it holds until it ends: its place in the bounded waiting queue (`QueueSlot`, until its
//! first step) and its places among the requests in flight (`Held`, until its last
//! sample ends). Each frees itself when dropped, so a cancelled or failed request cannot
//! keep one.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::events::EventResult;
use crate::lora::AdapterPin;
use crate::request_scope::RequestContext;
use crate::tenants::{TenantHold, TenantUsage};
use crate::validation::ValidRequest;

/// A validated request on its way to the loop.
pub(super) struct Admission {
    pub request: ValidRequest,
    /// One channel per sample (`best_of` of them), in sample order.
    pub samples: Vec<mpsc::UnboundedSender<EventResult>>,
    pub permit: Held,
    pub queued_at: Instant,
    /// One place in the bounded waiting queue for all the samples of the request.
    pub slot: QueueSlot,
    /// Its request id and trace.
    pub context: RequestContext,
}

/// A place in the bounded waiting queue, held from submission until the request's first
/// step (or its end, whichever comes first).
pub(super) struct QueueSlot(Arc<AtomicUsize>);

impl QueueSlot {
    /// A place among at most `max` counted by `queued`, if one is free.
    pub(super) fn try_take(queued: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(queued.clone()))
    }
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a request holds from admission to its end: its place among the concurrent
/// requests, its count on the replica it went to (which the balancer reads), its LoRA
/// adapter in use (never dropped from the shards' host memory meanwhile) and its
/// tenant's place and account.
pub(super) struct Held {
    _permit: OwnedSemaphorePermit,
    _on_replica: Assigned,
    _adapter: Option<AdapterPin>,
    tenant: Option<TenantHold>,
}

impl Held {
    /// Holds `permit`, counts the request on its replica's `assigned`, and keeps its
    /// adapter and its tenant's place.
    pub(super) fn new(
        permit: OwnedSemaphorePermit,
        assigned: &Arc<AtomicUsize>,
        adapter: Option<AdapterPin>,
        tenant: Option<TenantHold>,
    ) -> Self {
        Self {
            _permit: permit,
            _on_replica: Assigned::new(assigned),
            _adapter: adapter,
            tenant,
        }
    }

    /// The account the request's tokens count to, when it has a tenant.
    pub(super) fn tenant(&self) -> Option<&TenantUsage> {
        self.tenant.as_ref().map(|t| &*t.usage)
    }
}

/// One request counted on a replica while it lives.
struct Assigned(Arc<AtomicUsize>);

impl Assigned {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(count.clone())
    }
}

impl Drop for Assigned {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

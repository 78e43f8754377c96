//! What the batching loop knows of LoRA adapters: which ones its steps have paged in (as
//! told to the registry), and, before each schedule, which adapters being unloaded its
//! scheduler must page out, and which adapters the waiting requests wait for have
//! finished loading (their requests may then join) or were refused (their requests fail
//! with the shards' message).

use std::sync::Arc;

use tokio::sync::watch;

use crate::blocks::RequestId;
use crate::error::InferError;
use crate::lora::{Registry, Residency, Status};
use crate::scheduler::Scheduler;

pub(super) struct Adapters {
    /// The adapters this replica's steps have paged in, as told to the registry.
    residency: Residency,
    /// Wakes the loop when an adapter's load ends or an adapter is unloaded.
    changes: watch::Receiver<u64>,
    /// The registry's version last applied (`sync`).
    seen: u64,
}

impl Adapters {
    pub(super) fn new(registry: Arc<Registry>) -> Self {
        Self {
            changes: registry.subscribe(),
            residency: Residency::new(registry),
            seen: 0,
        }
    }

    /// Whether any LoRA option is on.
    pub(super) fn enabled(&self) -> bool {
        self.residency.registry().enabled()
    }

    pub(super) fn residency(&mut self) -> &mut Residency {
        &mut self.residency
    }

    /// Resolves when an adapter's load ends or an adapter is unloaded.
    pub(super) async fn changed(&mut self) {
        let _ = self.changes.changed().await;
    }

    /// Brings `scheduler` up to date with the registry; returns the waiting requests to
    /// fail because their adapter could not be loaded or was unloaded.
    pub(super) fn sync(&mut self, scheduler: &mut Scheduler) -> Vec<(RequestId, InferError)> {
        let mut refused = Vec::new();
        let registry = self.residency.registry().clone();
        if !registry.enabled() {
            return refused;
        }
        let version = *self.changes.borrow();
        if version != self.seen {
            self.seen = version;
            scheduler.set_doomed(registry.removing());
        }
        for name in scheduler.adapters_awaited() {
            let why = match registry.status(&name) {
                Status::Ready(num_blocks) => {
                    scheduler.adapter_loaded(&name, num_blocks);
                    continue;
                }
                Status::Pending => continue,
                Status::Failed(why) => format!("LoRA adapter {name:?} could not be loaded: {why}"),
                Status::Unknown => format!("LoRA adapter {name:?} was unloaded"),
            };
            for id in scheduler.waiting_for_adapter(&name) {
                let error = InferError::Validation(format!("parameters.adapter_id: {why}"));
                refused.push((id, error));
            }
        }
        refused
    }
}

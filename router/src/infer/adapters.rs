//! What the batching loop does about LoRA adapters before each schedule: it learns which
//! adapters being unloaded its scheduler must page out, and which adapters the waiting
//! requests wait for have finished loading (their requests may then join) or were
//! refused (their requests fail with the shards' message).

use super::batching_loop::Loop;
use crate::client::Backend;
use crate::error::InferError;
use crate::lora::Status;

impl<B: Backend> Loop<B> {
    pub(super) fn sync_adapters(&mut self) {
        let registry = self.residency.registry().clone();
        if !registry.enabled() {
            return;
        }
        let version = *self.adapter_changes.borrow();
        if version != self.adapters_seen {
            self.adapters_seen = version;
            self.scheduler.set_doomed(registry.removing());
        }
        for name in self.scheduler.adapters_awaited() {
            let why = match registry.status(&name) {
                Status::Ready(num_blocks) => {
                    self.scheduler.adapter_loaded(&name, num_blocks);
                    continue;
                }
                Status::Pending => continue,
                Status::Failed(why) => format!("LoRA adapter {name:?} could not be loaded: {why}"),
                Status::Unknown => format!("LoRA adapter {name:?} was unloaded"),
            };
            for id in self.scheduler.waiting_for_adapter(&name) {
                self.fail(
                    id,
                    InferError::Validation(format!("parameters.adapter_id: {why}")),
                );
            }
        }
    }
}

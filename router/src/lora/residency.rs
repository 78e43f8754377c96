//! What one replica's batching loop has told the registry it holds paged in: an adapter
//! counts from the step that pages it in (before it is sent) to the answer of the step
//! that pages it out, so the registry never drops the host copy of an adapter a shard may
//! still hold. The counts (an adapter may leave and come back within one step) are
//! released together when the shards' session ends.

use std::collections::HashMap;
use std::sync::Arc;

use super::Registry;

pub struct Residency {
    registry: Arc<Registry>,
    counts: HashMap<String, usize>,
}

impl Residency {
    pub fn new(registry: Arc<Registry>) -> Self {
        Self {
            registry,
            counts: HashMap::new(),
        }
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// A step about to be sent pages these adapters in.
    pub fn paged_in<'a>(&mut self, names: impl IntoIterator<Item = &'a str>) {
        for name in names {
            *self.counts.entry(name.to_string()).or_default() += 1;
            self.registry.paged_in(name);
            self.registry.metrics().page_ins.add(1);
        }
    }

    /// The step that paged these adapters out has been answered (or failed: either way the
    /// shards no longer hold them).
    pub fn paged_out(&mut self, names: &[String]) {
        for name in names {
            let Some(n) = self.counts.get_mut(name) else {
                continue;
            };
            *n -= 1;
            if *n == 0 {
                self.counts.remove(name);
            }
            self.registry.paged_out(name);
            self.registry.metrics().evictions.add(1);
        }
    }

    /// The shards' session ended: they hold no adapter paged in.
    pub fn release_all(&mut self) {
        for (name, n) in std::mem::take(&mut self.counts) {
            for _ in 0..n {
                self.registry.paged_out(&name);
            }
        }
    }
}

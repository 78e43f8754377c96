//! The Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models",
//! OSDI 2024): a counter of the service each tenant has received, in weighted tokens
//! divided by the tenant's weight. `fair` admission serves the backlogged tenant with the
//! smallest counter; a tenant that becomes backlogged after being idle is lifted to the
//! smallest counter among the backlogged ones (or, when none is, to the counter of the
//! last tenant that stopped being backlogged), so idleness banks no credit.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Service of one computed prompt token (the paper's w_p).
pub const PROMPT_TOKEN_COST: f64 = 1.0;
/// Service of one generated token (the paper's w_q): a decode step costs more per token
/// than a prefill chunk.
pub const GENERATED_TOKEN_COST: f64 = 2.0;

/// Each tenant's virtual counter and who is backlogged (has a waiting request).
#[derive(Debug, Default)]
pub struct VirtualCounters {
    counters: HashMap<Arc<str>, f64>,
    /// The tenants with a waiting request at the last `observe_backlog`.
    backlogged: HashSet<Arc<str>>,
    /// The counter of the tenant that last stopped being backlogged.
    last_left: f64,
}

impl VirtualCounters {
    /// Tenant `tenant`'s counter (0 before its first service).
    pub fn counter(&self, tenant: &str) -> f64 {
        self.counters.get(tenant).copied().unwrap_or(0.0)
    }

    /// Adds service to `tenant`'s counter: `prompt` computed prompt tokens and `generated`
    /// generated tokens, divided by its weight.
    pub fn charge(&mut self, tenant: &Arc<str>, weight: f64, prompt: usize, generated: usize) {
        if prompt == 0 && generated == 0 {
            return;
        }
        let service = PROMPT_TOKEN_COST * prompt as f64 + GENERATED_TOKEN_COST * generated as f64;
        let counter = self.counters.entry(tenant.clone()).or_insert(0.0);
        *counter += service / weight.max(f64::MIN_POSITIVE);
    }

    /// Takes the set of tenants with a waiting request now: those that just became
    /// backlogged are lifted (no banked credit), those that left are remembered.
    pub fn observe_backlog<'a>(&mut self, waiting: impl Iterator<Item = &'a Arc<str>>) {
        let now: HashSet<Arc<str>> = waiting.cloned().collect();
        for left in self.backlogged.difference(&now) {
            self.last_left = self.counter(left);
        }
        let stayed: Vec<f64> = now
            .intersection(&self.backlogged)
            .map(|t| self.counter(t))
            .collect();
        let floor = match stayed.iter().copied().reduce(f64::min) {
            Some(min) => min,
            None => self.last_left,
        };
        for arrived in now.difference(&self.backlogged) {
            let counter = self.counters.entry(arrived.clone()).or_insert(0.0);
            *counter = counter.max(floor);
        }
        self.backlogged = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newly_backlogged_tenant_is_lifted_to_the_smallest_backlogged_counter() {
        let (a, b, c): (Arc<str>, Arc<str>, Arc<str>) = ("a".into(), "b".into(), "c".into());
        let mut v = VirtualCounters::default();
        v.observe_backlog([&a, &b].into_iter());
        v.charge(&a, 1.0, 100, 0);
        v.charge(&b, 2.0, 100, 10);
        assert_eq!((v.counter("a"), v.counter("b")), (100.0, 60.0));
        v.observe_backlog([&a, &b, &c].into_iter());
        assert_eq!(v.counter("c"), 60.0, "lifted to b's, the smallest");
        // Nobody backlogged: the next one starts from the last that left.
        v.observe_backlog(std::iter::empty());
        v.observe_backlog(std::iter::once(&Arc::<str>::from("d")));
        assert!(v.counter("d") >= 60.0);
    }
}

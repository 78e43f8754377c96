//! How many tokens to propose: per request, the k that maximizes expected tokens per unit
//! of step cost given its running acceptance rate; per step, how many of those proposals
//! fit under the load threshold (past it, extra tokens cost more than they save).

/// The acceptance assumed before a request's first verification: high enough that a new
/// request speculates, so its rate gets measured.
pub const INITIAL_ACCEPTANCE: f64 = 0.6;
/// Weight of each observed proposal in the moving average (about the last 10 count).
const EMA_WEIGHT: f64 = 0.1;
/// After choosing 0 this many times in a row, propose 1 once so a request whose rate
/// was underestimated can recover.
const PROBE_AFTER_ZEROS: u32 = 8;

/// Expected tokens one verification of `k` proposals yields (accepted + the model's own
/// token) when each proposal is accepted with probability `a` given the ones before it:
/// 1 + a + ... + a^k.
pub fn expected_tokens(a: f64, k: usize) -> f64 {
    if a >= 1.0 {
        return (k + 1) as f64;
    }
    (1.0 - a.powi(k as i32 + 1)) / (1.0 - a)
}

/// The k in 0..=k_max with the most expected tokens per unit of cost, a step without
/// proposals costing 1 and each proposal `proposal_cost` more; the smallest such k on
/// ties.
pub fn best_k(a: f64, k_max: usize, proposal_cost: f64) -> usize {
    let per_cost = |k: usize| expected_tokens(a, k) / (1.0 + proposal_cost * k as f64);
    let mut best = 0;
    for k in 1..=k_max {
        if per_cost(k) > per_cost(best) {
            best = k;
        }
    }
    best
}

/// One request's running acceptance rate and its choice of k.
#[derive(Debug, Clone)]
pub struct AcceptanceTracker {
    acceptance: f64,
    zeros_in_a_row: u32,
}

impl Default for AcceptanceTracker {
    fn default() -> Self {
        Self::new()
    }
}

impl AcceptanceTracker {
    pub fn new() -> Self {
        Self {
            acceptance: INITIAL_ACCEPTANCE,
            zeros_in_a_row: 0,
        }
    }

    /// The estimated probability that a proposal is accepted given the ones before it.
    pub fn acceptance(&self) -> f64 {
        self.acceptance
    }

    /// Folds in one verification: `accepted` of `proposed` proposals. Each accepted
    /// proposal is one observed success and the first rejected one (when there is one) one
    /// failure; proposals after it were never tested, so they do not count (counting
    /// them would bias the rate down).
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        debug_assert!(accepted <= proposed, "{accepted} accepted of {proposed}");
        let accepted = accepted.min(proposed);
        for _ in 0..accepted {
            self.acceptance += EMA_WEIGHT * (1.0 - self.acceptance);
        }
        if accepted < proposed {
            self.acceptance -= EMA_WEIGHT * self.acceptance;
        }
    }

    /// How many tokens to propose this step (at most `k_max`, which the caller caps by
    /// the tokens left to generate); `proposal_cost` is the cost of one more token in the
    /// step relative to the step itself. Call once per step the request decodes in.
    pub fn choose_k(&mut self, k_max: usize, proposal_cost: f64) -> usize {
        let k = best_k(self.acceptance, k_max, proposal_cost);
        if k > 0 || k_max == 0 {
            self.zeros_in_a_row = 0;
            return k;
        }
        if self.zeros_in_a_row >= PROBE_AFTER_ZEROS {
            self.zeros_in_a_row = 0;
            return 1;
        }
        self.zeros_in_a_row += 1;
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn expected_tokens_is_the_mean_of_the_accepted_run_plus_one() {
        for a in [0.0_f64, 0.1, 0.5, 0.6, 0.93, 0.999_999, 1.0] {
            for k in 0..8 {
                // Accepted j < k with probability a^j (1 - a) (rejected at j), k with a^k.
                let mut mean = 0.0;
                for j in 0..k {
                    mean += (j + 1) as f64 * a.powi(j as i32) * (1.0 - a);
                }
                mean += (k + 1) as f64 * a.powi(k as i32);
                let e = expected_tokens(a, k);
                assert!((e - mean).abs() < 1e-6, "a {a} k {k}: {e} vs {mean}");
            }
        }
    }

    #[test]
    fn best_k_maximizes_tokens_per_cost() {
        // a 0.6, cost 0.1: per-cost values 1, 1.4545, 1.6333, 1.6738, 1.6469.
        assert_eq!(best_k(0.6, 4, 0.1), 3);
        assert_eq!(best_k(0.6, 2, 0.1), 2);
        // Proposals that are never accepted are never worth it.
        assert_eq!(best_k(0.0, 4, 0.01), 0);
        // 1.2 / 1.5 < 1: not worth one proposal.
        assert_eq!(best_k(0.2, 4, 0.5), 0);
        // Always accepted and cheap: as many as allowed.
        assert_eq!(best_k(1.0, 7, 0.1), 7);
        // Free proposals: any acceptance above 0 makes more better.
        assert_eq!(best_k(0.3, 5, 0.0), 5);
        assert_eq!(best_k(0.9, 0, 0.1), 0);
    }

    #[test]
    fn the_moving_average_counts_accepted_proposals_and_the_first_rejection() {
        let mut t = AcceptanceTracker::new();
        t.record(4, 2);
        // Two successes then one failure, each moving the estimate 10% of the way.
        let mut a = INITIAL_ACCEPTANCE;
        a += 0.1 * (1.0 - a);
        a += 0.1 * (1.0 - a);
        a -= 0.1 * a;
        assert!(close(t.acceptance(), a), "{} vs {a}", t.acceptance());
        // All accepted: successes only.
        t.record(3, 3);
        for _ in 0..3 {
            a += 0.1 * (1.0 - a);
        }
        assert!(close(t.acceptance(), a));
        // Nothing proposed: nothing observed.
        t.record(0, 0);
        assert!(close(t.acceptance(), a));
    }

    #[test]
    fn a_new_request_speculates_and_k_follows_its_acceptance() {
        let mut t = AcceptanceTracker::new();
        assert_eq!(t.choose_k(4, 0.1), best_k(INITIAL_ACCEPTANCE, 4, 0.1));
        assert!(t.choose_k(4, 0.1) > 0);
        for _ in 0..50 {
            t.record(4, 4);
        }
        assert_eq!(t.choose_k(4, 0.1), 4);
        for _ in 0..50 {
            t.record(1, 0);
        }
        assert_eq!(t.choose_k(4, 0.1), 0);
    }

    #[test]
    fn after_eight_zeros_in_a_row_it_probes_with_one_proposal() {
        let mut t = AcceptanceTracker::new();
        for _ in 0..60 {
            t.record(2, 0);
        }
        for round in 0..3 {
            let chosen: Vec<usize> = (0..9).map(|_| t.choose_k(4, 0.2)).collect();
            assert_eq!(chosen, [0, 0, 0, 0, 0, 0, 0, 0, 1], "round {round}");
            // The probe was rejected too.
            t.record(1, 0);
        }
        // A capped k of 0 is not a choice: no probe.
        assert!((0..20).all(|_| t.choose_k(0, 0.2) == 0));
        // Accepted probes raise the estimate until proposals pay without probing.
        let mut steps = 0;
        loop {
            let k = t.choose_k(4, 0.2);
            if k > 1 {
                break;
            }
            if k == 1 {
                t.record(1, 1);
            }
            steps += 1;
            assert!(steps < 1000, "never recovered");
        }
        assert!(steps > PROBE_AFTER_ZEROS as usize);
    }
}

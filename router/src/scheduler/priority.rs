//! Request priorities (`--scheduling-policy priority`): a lower value runs first, as in
//! vLLM, and a request's effective priority improves by one level for every
//! `AGING_INTERVAL` since it arrived, so a low-priority request cannot starve: after
//! `(p_low - p_high) × AGING_INTERVAL` it ranks with a fresh `p_high` request.

use std::time::{Duration, Instant};

/// Time for a request's effective priority to improve by one level.
pub const AGING_INTERVAL: Duration = Duration::from_secs(1);

/// `priority` of a request that arrived at `arrived`, aged as of `now`. Aging is
/// continuous, so two requests' order never flips back and forth: it depends only on their
/// priorities and arrival times.
pub fn effective(priority: i64, arrived: Instant, now: Instant) -> f64 {
    let waited = now.saturating_duration_since(arrived);
    priority as f64 - waited.as_secs_f64() / AGING_INTERVAL.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_gains_one_level_per_aging_interval() {
        let now = Instant::now();
        let then = now - AGING_INTERVAL * 5 - Duration::from_millis(1);
        assert_eq!(effective(3, now, now), 3.0);
        let aged = effective(3, then, now);
        assert!((-2.01..-2.0).contains(&aged), "{aged}");
    }
}

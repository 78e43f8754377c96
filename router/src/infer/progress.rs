//! Whether the batching loop is making progress, shared with the HTTP side for `/ready`:
//! the loop records when it started waiting for a step's answer, and that it stopped
//! waiting (the answer came and nothing else is in flight). One writer (the loop), any
//! number of readers, no lock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Since when the loop has been waiting for a step's answer, if it is.
#[derive(Debug)]
pub struct StepClock {
    /// The origin of `waiting_since`.
    epoch: Instant,
    /// Nanoseconds after `epoch` plus one since the loop waits for an answer; 0 while no
    /// step is in flight.
    waiting_since: AtomicU64,
}

impl Default for StepClock {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            waiting_since: AtomicU64::new(0),
        }
    }
}

impl StepClock {
    /// A step is in flight and the loop waits for its answer from now on: called when a
    /// step is sent with none before it, and when an answer came while the next step was
    /// already sent (the clock restarts at each answer, so a long run of steps is never
    /// overdue, only a step that takes long).
    pub fn waiting(&self) {
        let since = self.epoch.elapsed().as_nanos() as u64 + 1;
        self.waiting_since.store(since, Ordering::Release);
    }

    /// No step is in flight: the loop has nothing to wait for.
    pub fn idle(&self) {
        self.waiting_since.store(0, Ordering::Release);
    }

    /// How long the loop has been waiting for the answer of the step in flight; `None`
    /// when no step is in flight.
    pub fn waited(&self) -> Option<Duration> {
        match self.waiting_since.load(Ordering::Acquire) {
            0 => None,
            since => Some(
                self.epoch
                    .elapsed()
                    .saturating_sub(Duration::from_nanos(since - 1)),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_runs_only_while_a_step_is_in_flight() {
        let clock = StepClock::default();
        assert_eq!(clock.waited(), None);
        clock.waiting();
        let first = clock.waited().expect("a step is in flight");
        assert!(clock.waited().unwrap() >= first, "the wait only grows");
        clock.idle();
        assert_eq!(clock.waited(), None);
    }
}

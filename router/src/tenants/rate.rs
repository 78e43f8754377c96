//! A tenant's tokens per minute, as a token bucket: it holds at most a minute's tokens and
//! refills continuously at the rate. A request is admitted while the bucket is not empty;
//! its prompt tokens are taken when it is queued and its generated tokens as they come,
//! so a long answer may take the bucket below zero and the tenant's next request waits
//! until the debt is refilled (the `Retry-After` it is told).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

#[derive(Debug)]
pub struct TokenBucket {
    /// Tokens per minute; 0: no limit.
    per_minute: AtomicU64,
    /// Tokens left (negative: owed) as of the instant.
    level: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    /// A full bucket of `per_minute` tokens (0: unlimited).
    pub fn new(per_minute: u64) -> Self {
        Self {
            per_minute: AtomicU64::new(per_minute),
            level: Mutex::new((per_minute as f64, Instant::now())),
        }
    }

    /// The rate in force (0: unlimited).
    pub fn per_minute(&self) -> u64 {
        self.per_minute.load(Ordering::Acquire)
    }

    /// A new rate (a reloaded key file); the tokens left stay, within the new capacity.
    pub fn set_per_minute(&self, per_minute: u64) {
        self.per_minute.store(per_minute, Ordering::Release);
        let mut level = self.level.lock().expect("bucket lock");
        level.0 = level.0.min(per_minute as f64);
    }

    /// The tokens left now (the capacity when unlimited).
    pub fn available(&self, now: Instant) -> f64 {
        let mut level = self.level.lock().expect("bucket lock");
        self.refill(&mut level, now);
        level.0
    }

    /// Ok while tokens are left; else the whole seconds until there are.
    pub fn check(&self, now: Instant) -> Result<(), u64> {
        let per_minute = self.per_minute();
        if per_minute == 0 {
            return Ok(());
        }
        let mut level = self.level.lock().expect("bucket lock");
        self.refill(&mut level, now);
        if level.0 > 0.0 {
            return Ok(());
        }
        let per_second = per_minute as f64 / 60.0;
        // Until the level is above zero again: at least a second.
        Err(((-level.0 + 1.0) / per_second).ceil().max(1.0) as u64)
    }

    /// Takes `tokens` (the level may go below zero).
    pub fn take(&self, tokens: u64, now: Instant) {
        if self.per_minute() == 0 {
            return;
        }
        let mut level = self.level.lock().expect("bucket lock");
        self.refill(&mut level, now);
        level.0 -= tokens as f64;
    }

    fn refill(&self, level: &mut (f64, Instant), now: Instant) {
        let per_minute = self.per_minute() as f64;
        let elapsed = now.saturating_duration_since(level.1).as_secs_f64();
        level.0 = (level.0 + elapsed * per_minute / 60.0).min(per_minute);
        level.1 = now.max(level.1);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_bucket_refuses_once_empty_and_says_when_it_has_refilled() {
        let start = Instant::now();
        let bucket = TokenBucket::new(600); // 10 tokens a second
        assert!(bucket.check(start).is_ok());
        bucket.take(500, start);
        assert!(bucket.check(start).is_ok(), "100 left");
        bucket.take(149, start); // 49 owed
        let wait = bucket.check(start).unwrap_err();
        assert_eq!(wait, 5, "49 owed + 1 at 10 a second");
        assert!(bucket.check(start + Duration::from_secs(wait)).is_ok());
    }

    #[test]
    fn a_bucket_holds_at_most_a_minute_and_zero_means_unlimited() {
        let start = Instant::now();
        let bucket = TokenBucket::new(60);
        let later = start + Duration::from_secs(3600);
        assert_eq!(
            bucket.available(later),
            60.0,
            "no credit beyond a minute's tokens"
        );
        let unlimited = TokenBucket::new(0);
        unlimited.take(1_000_000, start);
        assert!(unlimited.check(start).is_ok());
        bucket.set_per_minute(30);
        assert_eq!(
            bucket.available(later),
            30.0,
            "a lower rate caps what is left"
        );
    }
}

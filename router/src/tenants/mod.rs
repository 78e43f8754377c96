//! Tenants: whom an API key belongs to, for per-key accounting and per-key limits.
//!
//! Every accepted key names a tenant: a line of `--api-key-file` may give the name after
//! the key (`KEY NAME`, `keys`); a key given alone (or by `--api-key`) is named by a
//! fingerprint of it, `key-` and the first 8 hex digits of its SHA-256, so `/metrics` and
//! the logs never show a key. Several keys may share a tenant (a rotated key keeps its
//! account). `reload` re-reads the key file on SIGHUP or when it changes.
//!
//! `access` puts the tenant of the key a request presented into the request
//! (`Tenant`), `request_scope` carries it into the request's context, and
//! `Infer::submit` takes the tenant's place (`Tenants::admit`): a permit among its
//! `--max-concurrent-requests-per-key`, a check of its tokens per minute (`rate`), and
//! the counters the batching loop adds the request's tokens to while it runs. `metrics`
//! exports the counters per tenant, `usage` answers `GET /v1/usage` from them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics::series::Counter;

pub mod keys;
pub mod rate;
pub mod reload;

pub use keys::{fingerprint, ApiKey, KeyOptions, KeyRing, KeySet};
use rate::TokenBucket;

/// The tenant a request's key belongs to (a request extension set by `access`).
#[derive(Debug, Clone)]
pub struct Tenant(pub Arc<str>);

/// Set beside `Tenant` when the key is an admin key (`role=admin`).
#[derive(Debug, Clone, Copy)]
pub struct AdminKey;

/// One tenant's account: what its requests asked and got, and its requests in flight.
#[derive(Debug)]
pub struct TenantUsage {
    /// Requests admitted (past the limits and validation).
    pub requests: Counter,
    /// Requests answered 429 for the tenant's own limits.
    pub rejected: Counter,
    /// Prompt tokens of its admitted requests, once per request (as usage reports them).
    pub prompt_tokens: Counter,
    /// Tokens generated for it (every sample's).
    pub generation_tokens: Counter,
    /// Its requests admitted and not ended (counted atomically: admissions race).
    pub in_flight: AtomicUsize,
    /// Its tokens per minute (unlimited at rate 0).
    pub bucket: TokenBucket,
    /// Its share under `--scheduling-policy fair` (f64 bits; a reload may change it).
    weight: AtomicU64,
    limiter: Option<Arc<Semaphore>>,
}

impl TenantUsage {
    /// Its share under fair scheduling: its key's `weight=W`, else 1 (the last line's
    /// when lines of its keys differ).
    pub fn weight(&self) -> f64 {
        f64::from_bits(self.weight.load(Ordering::Acquire))
    }

    /// Counts prompt tokens booked for one of its requests.
    pub fn add_prompt_tokens(&self, tokens: u64) {
        self.prompt_tokens.add(tokens);
        self.charge(tokens);
    }

    /// Counts one generated token (once per token of every request: no clock read
    /// without a rate to charge).
    pub fn add_generated_token(&self) {
        self.generation_tokens.add(1);
        self.charge(1);
    }

    fn charge(&self, tokens: u64) {
        if self.bucket.per_minute() != 0 {
            self.bucket.take(tokens, Instant::now());
        }
    }
}

/// A request's hold on its tenant's account, from admission to its end.
#[derive(Debug)]
pub struct TenantHold {
    pub usage: Arc<TenantUsage>,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Drop for TenantHold {
    fn drop(&mut self) {
        self.usage.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why a tenant's request is refused (429).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub message: String,
    /// Seconds until the limit lets a request through again.
    pub retry_after: u64,
}

/// Every tenant: those of the keys at start, and those a reloaded key file adds (a
/// tenant whose keys were removed keeps its account and counters).
#[derive(Debug, Default)]
pub struct Tenants {
    by_name: RwLock<BTreeMap<Arc<str>, Arc<TenantUsage>>>,
    max_concurrent_per_key: Option<usize>,
    /// `--max-tokens-per-minute-per-key` (0: none); a key file's option overrides it.
    tokens_per_minute: u64,
}

impl Tenants {
    /// The tenants of `keys`; each may have `max_concurrent_per_key` requests in flight
    /// and use `tokens_per_minute` (0: unlimited) unless its key says otherwise.
    pub fn new(
        keys: &[ApiKey],
        max_concurrent_per_key: Option<usize>,
        tokens_per_minute: u64,
    ) -> Self {
        let tenants = Self {
            by_name: RwLock::default(),
            max_concurrent_per_key,
            tokens_per_minute,
        };
        tenants.update(keys);
        tenants
    }

    /// Adds the tenants `keys` name that have no account yet and sets every named
    /// tenant's token rate (its key's option, else the flag's) and weight.
    pub fn update(&self, keys: &[ApiKey]) {
        let mut by_name = self.by_name.write().expect("tenants lock");
        for key in keys {
            let rate = key
                .options
                .tokens_per_minute
                .unwrap_or(self.tokens_per_minute);
            let weight = key.options.weight.unwrap_or(1.0).to_bits();
            match by_name.get(&key.tenant) {
                Some(usage) => {
                    usage.bucket.set_per_minute(rate);
                    usage.weight.store(weight, Ordering::Release);
                }
                None => {
                    let usage = TenantUsage {
                        requests: Counter::default(),
                        rejected: Counter::default(),
                        prompt_tokens: Counter::default(),
                        generation_tokens: Counter::default(),
                        in_flight: AtomicUsize::new(0),
                        bucket: TokenBucket::new(rate),
                        weight: AtomicU64::new(weight),
                        limiter: self
                            .max_concurrent_per_key
                            .map(|n| Arc::new(Semaphore::new(n))),
                    };
                    by_name.insert(key.tenant.clone(), Arc::new(usage));
                }
            }
        }
    }

    /// The tenant's hold for a new request; `None` for a request without a tenant (no
    /// keys configured). Err: the tenant is at one of its limits (the caller answers 429).
    pub fn admit(&self, tenant: Option<&str>) -> Result<Option<TenantHold>, Refusal> {
        let Some(usage) = tenant.and_then(|t| self.get(t)) else {
            return Ok(None);
        };
        if let Err(retry_after) = usage.bucket.check(Instant::now()) {
            usage.rejected.add(1);
            return Err(Refusal {
                message: format!(
                    "this API key's tenant has used its {} tokens per minute \
                     (--max-tokens-per-minute-per-key or the key's tokens_per_minute), \
                     try again in {retry_after} s",
                    usage.bucket.per_minute()
                ),
                retry_after,
            });
        }
        let permit = match &usage.limiter {
            None => None,
            Some(limiter) => match limiter.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    usage.rejected.add(1);
                    return Err(Refusal {
                        message: format!(
                            "this API key has {} requests in flight \
                             (--max-concurrent-requests-per-key), try again later",
                            self.max_concurrent_per_key.unwrap_or_default()
                        ),
                        retry_after: crate::error::RETRY_AFTER_SECONDS.into(),
                    });
                }
            },
        };
        usage.requests.add(1);
        usage.in_flight.fetch_add(1, Ordering::AcqRel);
        Ok(Some(TenantHold {
            usage,
            _permit: permit,
        }))
    }

    /// A tenant's account.
    pub fn get(&self, tenant: &str) -> Option<Arc<TenantUsage>> {
        self.by_name
            .read()
            .expect("tenants lock")
            .get(tenant)
            .cloned()
    }

    /// Each tenant's name and account, in name order (a snapshot).
    pub fn iter(&self) -> impl Iterator<Item = (Arc<str>, Arc<TenantUsage>)> {
        let by_name = self.by_name.read().expect("tenants lock");
        let all: Vec<_> = by_name
            .iter()
            .map(|(n, u)| (n.clone(), u.clone()))
            .collect();
        all.into_iter()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.read().expect("tenants lock").is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_at_its_limit_is_refused_until_a_request_ends() {
        let keys = [
            ApiKey::from_line("k1 a").unwrap(),
            ApiKey::from_line("k2 b").unwrap(),
        ];
        let tenants = Tenants::new(&keys, Some(1), 0);
        let first = tenants.admit(Some("a")).unwrap().expect("a tenant");
        let refusal = tenants.admit(Some("a")).unwrap_err();
        assert!(refusal.message.contains("in flight"), "{refusal:?}");
        let other = tenants.admit(Some("b")).unwrap();
        assert!(other.is_some(), "another tenant's limit is its own");
        let usage = first.usage.clone();
        assert_eq!((usage.requests.get(), usage.rejected.get()), (1, 1));
        assert_eq!(usage.in_flight.load(Ordering::Acquire), 1);
        drop(first);
        assert_eq!(usage.in_flight.load(Ordering::Acquire), 0);
        assert!(tenants.admit(Some("a")).unwrap().is_some());
        assert!(tenants.admit(None).unwrap().is_none());
    }

    #[test]
    fn a_tenant_past_its_tokens_per_minute_is_refused_with_the_wait_and_others_are_not() {
        let keys = [
            ApiKey::from_line("k1 a tokens_per_minute=120").unwrap(),
            ApiKey::from_line("k2 b").unwrap(),
        ];
        let tenants = Tenants::new(&keys, None, 6000);
        let hold = tenants.admit(Some("a")).unwrap().unwrap();
        hold.usage.add_prompt_tokens(100);
        for _ in 0..30 {
            hold.usage.add_generated_token();
        }
        // 10 owed at 2 tokens a second: 6 s (until the level is above zero).
        let refusal = tenants.admit(Some("a")).unwrap_err();
        assert!((5..=6).contains(&refusal.retry_after), "{refusal:?}");
        assert!(
            refusal.message.contains("120 tokens per minute"),
            "{refusal:?}"
        );
        assert_eq!(hold.usage.rejected.get(), 1);
        let b = tenants.admit(Some("b")).unwrap().unwrap();
        assert_eq!(b.usage.bucket.per_minute(), 6000, "the flag's rate");
    }

    #[test]
    fn an_update_adds_tenants_keeps_accounts_and_sets_rates() {
        let tenants = Tenants::new(&[ApiKey::from_line("k1 a").unwrap()], None, 0);
        tenants.get("a").unwrap().requests.add(3);
        tenants.update(&[
            ApiKey::from_line("k1 a tokens_per_minute=60 weight=2").unwrap(),
            ApiKey::from_line("k3 c").unwrap(),
        ]);
        let a = tenants.get("a").unwrap();
        assert_eq!((a.requests.get(), a.bucket.per_minute()), (3, 60));
        assert_eq!(
            a.weight(),
            2.0,
            "a reload sets the weight the fair policy reads"
        );
        let names: Vec<_> = tenants.iter().map(|(n, _)| n.to_string()).collect();
        assert_eq!(names, ["a", "c"]);
    }
}

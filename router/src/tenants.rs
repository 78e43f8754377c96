//! Tenants: whom an API key belongs to, for per-key accounting and per-key limits.
//!
//! Every accepted key names a tenant: a line of `--api-key-file` may give the name after
//! the key (`KEY NAME`); a key given alone (or by `--api-key`) is named by a fingerprint
//! of it, `key-` and the first 8 hex digits of its SHA-256, so `/metrics` and the logs
//! never show a key. Several keys may share a tenant (a rotated key keeps its account).
//!
//! `access` puts the tenant of the key a request presented into the request
//! (`Tenant`), `request_scope` carries it into the request's context, and
//! `Infer::submit` takes the tenant's place (`Tenants::admit`): a permit among its
//! `--max-concurrent-requests-per-key`, and the counters the batching loop adds the
//! request's tokens to while it runs. `metrics` exports the counters per tenant.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics::series::Counter;

/// An accepted API key and its tenant's name.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiKey {
    pub key: String,
    pub tenant: Arc<str>,
    /// The tenant's share under `--scheduling-policy fair` (1 unless the line gives one).
    pub weight: f64,
}

impl ApiKey {
    /// A key given alone: its tenant is its fingerprint.
    pub fn bare(key: &str) -> Self {
        Self {
            key: key.to_string(),
            tenant: fingerprint(key).into(),
            weight: 1.0,
        }
    }

    /// A line of a key file: `KEY`, `KEY NAME` or `KEY NAME WEIGHT` (the name: letters,
    /// digits, `-`, `_`, `.`, at most 64, so it is a safe Prometheus label value; the
    /// weight: the tenant's share under fair scheduling, a positive number).
    pub fn from_line(line: &str) -> Result<Self, String> {
        let mut words = line.split_whitespace();
        let key = words.next().ok_or("an empty line holds no key")?;
        let Some(name) = words.next() else {
            return Ok(Self::bare(key));
        };
        let weight = match words.next() {
            None => 1.0,
            Some(w) => match w.parse::<f64>() {
                Ok(w) if w.is_finite() && w > 0.0 => w,
                _ => return Err(format!("tenant weight {w:?}: use a positive number")),
            },
        };
        if words.next().is_some() {
            return Err("a line holds a key, at most one tenant name and its weight".into());
        }
        let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
        if name.len() > 64 || !name.chars().all(allowed) {
            return Err(format!(
                "tenant name {name:?}: use at most 64 letters, digits, '-', '_' or '.'"
            ));
        }
        Ok(Self {
            key: key.to_string(),
            tenant: name.into(),
            weight,
        })
    }
}

/// `key-` and the first 8 hex digits of the key's SHA-256: names a key without showing it.
pub fn fingerprint(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let mut name = String::from("key-");
    for byte in &digest[..4] {
        let _ = write!(name, "{byte:02x}");
    }
    name
}

/// The tenant a request's key belongs to (a request extension set by `access`).
#[derive(Debug, Clone)]
pub struct Tenant(pub Arc<str>);

/// One tenant's account: what its requests asked and got, and its requests in flight.
#[derive(Debug)]
pub struct TenantUsage {
    /// Requests admitted (past the limits and validation).
    pub requests: Counter,
    /// Requests answered 429 for the tenant's own limit.
    pub rejected: Counter,
    /// Prompt tokens of its admitted requests, once per request (as usage reports them).
    pub prompt_tokens: Counter,
    /// Tokens generated for it (every sample's).
    pub generation_tokens: Counter,
    /// Its requests admitted and not ended (counted atomically: admissions race).
    pub in_flight: AtomicUsize,
    /// Its share under fair scheduling (the key file's weight; the last line's when its
    /// keys' lines differ).
    pub weight: f64,
    limiter: Option<Arc<Semaphore>>,
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

/// Every tenant, known from the keys at start.
#[derive(Debug, Default)]
pub struct Tenants {
    by_name: BTreeMap<Arc<str>, Arc<TenantUsage>>,
    max_concurrent_per_key: Option<usize>,
}

impl Tenants {
    /// The tenants of `keys`; each may have `max_concurrent_per_key` requests in flight.
    pub fn new(keys: &[ApiKey], max_concurrent_per_key: Option<usize>) -> Self {
        let by_name = keys
            .iter()
            .map(|k| {
                let usage = TenantUsage {
                    requests: Counter::default(),
                    rejected: Counter::default(),
                    prompt_tokens: Counter::default(),
                    generation_tokens: Counter::default(),
                    in_flight: AtomicUsize::new(0),
                    weight: k.weight,
                    limiter: max_concurrent_per_key.map(|n| Arc::new(Semaphore::new(n))),
                };
                (k.tenant.clone(), Arc::new(usage))
            })
            .collect();
        Self {
            by_name,
            max_concurrent_per_key,
        }
    }

    /// The tenant's hold for a new request; `None` for a request without a tenant (no
    /// keys configured). Err: the tenant is at its limit (the caller answers 429).
    pub fn admit(&self, tenant: Option<&str>) -> Result<Option<TenantHold>, String> {
        let Some(usage) = tenant.and_then(|t| self.by_name.get(t)) else {
            return Ok(None);
        };
        let permit = match &usage.limiter {
            None => None,
            Some(limiter) => match limiter.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    usage.rejected.add(1);
                    return Err(format!(
                        "this API key has {} requests in flight \
                         (--max-concurrent-requests-per-key), try again later",
                        self.max_concurrent_per_key.unwrap_or_default()
                    ));
                }
            },
        };
        usage.requests.add(1);
        usage.in_flight.fetch_add(1, Ordering::AcqRel);
        Ok(Some(TenantHold {
            usage: usage.clone(),
            _permit: permit,
        }))
    }

    /// Each tenant's name and account, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &TenantUsage)> {
        self.by_name.iter().map(|(name, usage)| (&**name, &**usage))
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_file_line_names_its_tenant_or_is_named_by_its_fingerprint() {
        let named = ApiKey::from_line("  sk-alpha   team-a ").unwrap();
        assert_eq!((named.key.as_str(), &*named.tenant), ("sk-alpha", "team-a"));
        let bare = ApiKey::from_line("sk-beta").unwrap();
        assert_eq!(&*bare.tenant, fingerprint("sk-beta"));
        let weighted = ApiKey::from_line("k a 2.5").unwrap();
        assert_eq!((&*weighted.tenant, weighted.weight), ("a", 2.5));
        assert_eq!(named.weight, 1.0);
        assert!(ApiKey::from_line("k a b").unwrap_err().contains("weight"));
        assert!(ApiKey::from_line("k a 0").unwrap_err().contains("weight"));
        assert!(ApiKey::from_line("k a 1 x")
            .unwrap_err()
            .contains("at most one"));
        assert!(ApiKey::from_line("k a\"b")
            .unwrap_err()
            .contains("tenant name"));
    }

    #[test]
    fn a_fingerprint_is_the_sha256_prefix_and_never_the_key() {
        // SHA-256("abc") = ba7816bf 8f01cfea ... (FIPS 180-2's first example).
        assert_eq!(fingerprint("abc"), "key-ba7816bf");
        assert!(!fingerprint("secret-key").contains("secret"));
    }

    #[test]
    fn a_tenant_at_its_limit_is_refused_until_a_request_ends() {
        let keys = [
            ApiKey::from_line("k1 a").unwrap(),
            ApiKey::from_line("k2 b").unwrap(),
        ];
        let tenants = Tenants::new(&keys, Some(1));
        let first = tenants.admit(Some("a")).unwrap().expect("a tenant");
        assert!(tenants.admit(Some("a")).unwrap_err().contains("in flight"));
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
}

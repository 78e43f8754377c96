//! API keys: the lines of `--api-key-file`, and the set of accepted keys a request's key
//! is looked up in.
//!
//! A line is `KEY [TENANT] [OPTION=VALUE ...]`: the tenant's name (letters, digits, `-`,
//! `_`, `.`, at most 64, so it is a safe Prometheus label value; a key without one is
//! named by its fingerprint), then options: `tokens_per_minute=N` (this tenant's token
//! rate, instead of `--max-tokens-per-minute-per-key`), `weight=W` (its share under the
//! fair scheduling policy) and `role=admin` (its key may read every tenant's usage).
//!
//! Keys are kept as SHA-256 digests and a presented key is compared with every one of
//! them in constant time: neither the time an answer takes nor a memory dump tells which
//! prefix of a key was right.

use std::fmt::Write as _;
use std::sync::{Arc, RwLock};

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// What a key file line may set besides the key and its tenant.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeyOptions {
    /// Tokens (prompt + generated) per minute for this key's tenant; None: the flag's.
    pub tokens_per_minute: Option<u64>,
    /// The tenant's weight under the fair policy; None: 1.
    pub weight: Option<f64>,
    /// May read every tenant's usage (`GET /v1/usage`).
    pub admin: bool,
}

/// An accepted API key and its tenant's name.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiKey {
    pub key: String,
    pub tenant: Arc<str>,
    pub options: KeyOptions,
}

impl ApiKey {
    /// A key given alone: its tenant is its fingerprint.
    pub fn bare(key: &str) -> Self {
        Self {
            key: key.to_string(),
            tenant: fingerprint(key).into(),
            options: KeyOptions::default(),
        }
    }

    /// A line of a key file (see the module's documentation).
    pub fn from_line(line: &str) -> Result<Self, String> {
        // A word starting with `#` begins a comment to the end of the line.
        let mut words = line
            .split_whitespace()
            .take_while(|w| !w.starts_with('#'))
            .peekable();
        let key = words.next().ok_or("an empty line holds no key")?;
        let mut parsed = match words.next_if(|w| !w.contains('=')) {
            None => Self::bare(key),
            Some(name) => Self {
                key: key.to_string(),
                tenant: tenant_name(name)?.into(),
                options: KeyOptions::default(),
            },
        };
        for word in words {
            parsed.options.set(word)?;
        }
        Ok(parsed)
    }
}

fn tenant_name(name: &str) -> Result<&str, String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    if name.len() > 64 || !name.chars().all(allowed) {
        return Err(format!(
            "tenant name {name:?}: use at most 64 letters, digits, '-', '_' or '.' \
             (after the key: the tenant's name, then OPTION=VALUE words)"
        ));
    }
    Ok(name)
}

impl KeyOptions {
    fn set(&mut self, word: &str) -> Result<(), String> {
        let Some((name, value)) = word.split_once('=') else {
            return Err(format!(
                "{word:?}: after the key and the tenant's name only OPTION=VALUE words \
                 (tokens_per_minute=N, weight=W, role=admin)"
            ));
        };
        match name {
            "tokens_per_minute" => match value.parse::<u64>() {
                Ok(n) if n > 0 => self.tokens_per_minute = Some(n),
                _ => return Err(format!("tokens_per_minute={value}: a positive integer")),
            },
            "weight" => match value.parse::<f64>() {
                Ok(w) if w.is_finite() && w > 0.0 => self.weight = Some(w),
                _ => return Err(format!("weight={value}: a positive number")),
            },
            "role" if value == "admin" => self.admin = true,
            "role" => return Err(format!("role={value}: the only role is admin")),
            _ => {
                return Err(format!(
                    "unknown option {name:?} (tokens_per_minute, weight or role)"
                ))
            }
        }
        Ok(())
    }
}

/// The lines of a key file's text; an error names the line.
pub fn parse_key_file(text: &str) -> Result<Vec<ApiKey>, String> {
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        keys.push(ApiKey::from_line(line).map_err(|e| format!("line {}: {e}", i + 1))?);
    }
    Ok(keys)
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

/// Whom a matching key belongs to.
#[derive(Debug, Clone)]
pub struct KeyOwner {
    pub tenant: Arc<str>,
    pub admin: bool,
}

/// The accepted keys, as digests.
#[derive(Debug, Default)]
pub struct KeySet {
    entries: Vec<([u8; 32], KeyOwner)>,
}

impl KeySet {
    pub fn new(keys: &[ApiKey]) -> Self {
        let entries = keys
            .iter()
            .map(|k| {
                let owner = KeyOwner {
                    tenant: k.tenant.clone(),
                    admin: k.options.admin,
                };
                (Sha256::digest(k.key.as_bytes()).into(), owner)
            })
            .collect();
        Self { entries }
    }

    /// The owner of `key`: every stored digest is compared, in constant time each, and
    /// the loop does not stop at a match.
    pub fn owner(&self, key: &str) -> Option<&KeyOwner> {
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let mut found = None;
        for (stored, owner) in &self.entries {
            if bool::from(stored.ct_eq(&digest)) {
                found = Some(owner);
            }
        }
        found
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The key set in force, replaced whole when the key file is reloaded: a request sees the
/// old set or the new one, never half of each.
#[derive(Debug, Clone, Default)]
pub struct KeyRing(Arc<RwLock<Arc<KeySet>>>);

impl KeyRing {
    pub fn new(keys: &[ApiKey]) -> Self {
        Self(Arc::new(RwLock::new(Arc::new(KeySet::new(keys)))))
    }

    pub fn current(&self) -> Arc<KeySet> {
        self.0.read().expect("key ring lock").clone()
    }

    pub fn replace(&self, keys: &[ApiKey]) {
        *self.0.write().expect("key ring lock") = Arc::new(KeySet::new(keys));
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
        assert!(ApiKey::from_line("k a b")
            .unwrap_err()
            .contains("OPTION=VALUE"));
        assert!(ApiKey::from_line("k a\"b")
            .unwrap_err()
            .contains("tenant name"));
    }

    #[test]
    fn options_follow_the_tenant_or_the_key() {
        let k = ApiKey::from_line("sk team-a tokens_per_minute=600 weight=2 role=admin").unwrap();
        let expected = KeyOptions {
            tokens_per_minute: Some(600),
            weight: Some(2.0),
            admin: true,
        };
        assert_eq!((&*k.tenant, &k.options), ("team-a", &expected));
        let bare = ApiKey::from_line("sk weight=0.5").unwrap();
        assert_eq!(&*bare.tenant, fingerprint("sk"));
        assert_eq!(bare.options.weight, Some(0.5));
        for (line, says) in [
            ("sk a tokens_per_minute=0", "positive integer"),
            ("sk a weight=-1", "positive number"),
            ("sk a role=root", "only role"),
            ("sk a colour=red", "unknown option"),
        ] {
            let error = ApiKey::from_line(line).unwrap_err();
            assert!(error.contains(says), "{line}: {error}");
        }
    }

    #[test]
    fn a_key_file_error_names_its_line() {
        let error = parse_key_file("# keys\nk1 a\n\nk2 b c\n").unwrap_err();
        assert!(error.starts_with("line 4:"), "{error}");
        assert_eq!(parse_key_file("k1 a\n# x\nk2\n").unwrap().len(), 2);
        let commented = parse_key_file("k1 a   # the same account\nk2 # bare\n").unwrap();
        assert_eq!(&*commented[0].tenant, "a");
        assert_eq!(&*commented[1].tenant, fingerprint("k2"));
    }

    #[test]
    fn a_fingerprint_is_the_sha256_prefix_and_never_the_key() {
        // SHA-256("abc") = ba7816bf 8f01cfea ... (FIPS 180-2's first example).
        assert_eq!(fingerprint("abc"), "key-ba7816bf");
        assert!(!fingerprint("secret-key").contains("secret"));
    }

    #[test]
    fn the_key_set_finds_owners_and_nothing_for_a_prefix_or_a_longer_key() {
        let keys = [
            ApiKey::from_line("sk-one a").unwrap(),
            ApiKey::from_line("sk-two b role=admin").unwrap(),
        ];
        let set = KeySet::new(&keys);
        assert_eq!(&*set.owner("sk-one").unwrap().tenant, "a");
        assert!(set.owner("sk-two").unwrap().admin);
        for wrong in ["sk-on", "sk-one ", "sk-onex", ""] {
            assert!(set.owner(wrong).is_none(), "{wrong:?}");
        }
        let ring = KeyRing::new(&keys);
        ring.replace(&keys[1..]);
        assert!(ring.current().owner("sk-one").is_none(), "a removed key");
        assert_eq!(ring.current().len(), 1);
    }
}

//! `--api-key-file` read again while serving: on SIGHUP, and when its content changes
//! (checked every second, so a Kubernetes Secret's update or an editor's save is enough).
//! The new key set replaces the old one whole for every request that arrives after it;
//! requests in flight are not touched. A file that no longer parses, or holds no key,
//! leaves the old keys in force and logs why. Keys are never logged.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::keys::{parse_key_file, ApiKey, KeyRing};
use super::Tenants;

/// How often the file's content is compared with what was loaded.
const POLL: Duration = Duration::from_secs(1);

/// What a reload needs: the file, the keys given on the command line (kept), and where
/// the keys and the tenants' accounts live.
#[derive(Debug, Clone)]
pub struct KeyFile {
    pub path: PathBuf,
    pub fixed: Vec<ApiKey>,
    pub ring: KeyRing,
    pub tenants: Arc<Tenants>,
}

impl KeyFile {
    /// Reads the file; on success puts its keys (and the fixed ones) in force.
    pub fn reload(&self) -> Result<usize, String> {
        let text = std::fs::read_to_string(&self.path).map_err(|e| e.to_string())?;
        self.apply(&text)
    }

    fn apply(&self, text: &str) -> Result<usize, String> {
        let mut keys = self.fixed.clone();
        keys.extend(parse_key_file(text)?);
        if keys.is_empty() {
            return Err("the file holds no key".into());
        }
        self.tenants.update(&keys);
        self.ring.replace(&keys);
        Ok(keys.len())
    }

    /// Reloads on SIGHUP and on a change of content, until the process ends.
    pub fn watch(self) {
        tokio::spawn(async move {
            let mut loaded = digest(&self.path);
            let mut hangup = hangup_signal();
            loop {
                let asked = tokio::select! {
                    _ = tokio::time::sleep(POLL) => false,
                    _ = recv(&mut hangup) => true,
                };
                let now = digest(&self.path);
                if !asked && now == loaded {
                    continue;
                }
                loaded = now;
                let why = if asked { "SIGHUP" } else { "file changed" };
                match self.reload() {
                    Ok(keys) => tracing::info!(
                        path = %self.path.display(), keys, why, "API keys reloaded"
                    ),
                    Err(e) => tracing::error!(
                        path = %self.path.display(), error = %e, why,
                        "API key file not reloaded; the previous keys stay in force"
                    ),
                }
            }
        });
    }
}

/// The SHA-256 of the file's content (None: unreadable now).
fn digest(path: &std::path::Path) -> Option<[u8; 32]> {
    std::fs::read(path).ok().map(|b| Sha256::digest(&b).into())
}

#[cfg(unix)]
type Hangup = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangup = Option<()>;

#[cfg(unix)]
fn hangup_signal() -> Hangup {
    use tokio::signal::unix::{signal, SignalKind};
    signal(SignalKind::hangup()).ok()
}

#[cfg(not(unix))]
fn hangup_signal() -> Hangup {
    None
}

async fn recv(hangup: &mut Hangup) {
    #[cfg(unix)]
    if let Some(signal) = hangup {
        signal.recv().await;
        return;
    }
    let _ = hangup;
    std::future::pending::<()>().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_adds_and_removes_keys_and_a_bad_file_changes_nothing() {
        let fixed = vec![ApiKey::bare("cli-key")];
        let tenants = Arc::new(Tenants::new(&fixed, None, 0));
        let file = KeyFile {
            path: PathBuf::from("/nonexistent"),
            fixed: fixed.clone(),
            ring: KeyRing::new(&fixed),
            tenants: tenants.clone(),
        };
        assert_eq!(file.apply("k1 a\nk2 b\n").unwrap(), 3);
        assert!(file.ring.current().owner("k2").is_some());
        assert_eq!(file.apply("k1 a\n").unwrap(), 2);
        let keys = file.ring.current();
        assert!(
            keys.owner("k2").is_none(),
            "a removed key is refused at once"
        );
        assert!(keys.owner("cli-key").is_some(), "--api-key's keys stay");
        assert!(tenants.get("b").is_some(), "its tenant's account stays");
        assert!(file.apply("k1 a\nk3 b c\n").unwrap_err().contains("line 2"));
        assert!(
            file.ring.current().owner("k1").is_some(),
            "the old keys stay in force"
        );
        assert!(file.reload().is_err(), "an unreadable file changes nothing");
    }
}

//! Graceful drain, on SIGTERM or SIGINT: from the signal on `/ready` is red and every new
//! generation request is answered 503 with `Retry-After` (so a load balancer sends it
//! elsewhere), while the requests in flight run to their end. Those still running when
//! `--shutdown-timeout` is up are cut: each ends with an error event (503 if nothing was
//! sent yet), and the router exits.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;

use crate::error::InferError;
use crate::infer::Infer;

/// What the HTTP side, the batching loop and `serve` share about a drain.
#[derive(Debug)]
pub struct Drain {
    draining: AtomicBool,
    /// Set when the shutdown timeout is up: the loop fails what it still holds.
    cut: watch::Sender<bool>,
}

impl Default for Drain {
    fn default() -> Self {
        Self {
            draining: AtomicBool::new(false),
            cut: watch::channel(false).0,
        }
    }
}

impl Drain {
    /// From now on no new request is admitted.
    pub fn begin(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// The answer to a request that arrives while draining.
    pub fn refusal() -> InferError {
        InferError::ShuttingDown("the server is shutting down, try another replica".into())
    }

    /// Asks the batching loop to fail every request it still holds.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Resolves once `cut` was called.
    pub async fn cut_requested(&self) {
        let mut cut = self.cut.subscribe();
        // The sender lives in `self`: waiting cannot fail while it is borrowed.
        let _ = cut.wait_for(|&cut| cut).await;
    }
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every request in flight finished.
    Drained,
    /// The timeout came first: the requests left were failed.
    Cut,
}

/// Drains `infer`: refuses new requests, waits up to `timeout` for those in flight to
/// end, then cuts the ones left.
pub async fn drain(infer: &Infer, timeout: Duration) -> Outcome {
    infer.drain().begin();
    tracing::info!(
        requests = infer.in_flight(),
        ?timeout,
        "draining: waiting for the requests in flight"
    );
    match tokio::time::timeout(timeout, infer.until_idle()).await {
        Ok(()) => Outcome::Drained,
        Err(_) => {
            infer.drain().cut();
            Outcome::Cut
        }
    }
}

//! `GET /ready`: whether this replica should get traffic. Two signals, because neither
//! alone tells a stuck engine from a busy one:
//!
//! - the batching loop's step clock (`infer::StepClock`): how long the loop has waited
//!   for the answer of the step in flight;
//! - the shards' `Health` RPC, which a shard answers on its gRPC event loop, off the
//!   thread that runs the forward pass: a shard in a long prefill still answers, a frozen
//!   or dead one does not. The answer carries the forward thread's heartbeats (one per
//!   layer computed): they grow during a long prefill and stand still in a wedged
//!   forward, which the event loop would otherwise hide.
//!
//! The rule, in order: draining is red; a shard that answers not warmed up, or fails the
//! call, is red. A shard that answers within the probe timeout (1 s) and is warmed up is
//! green, however long the step in flight has run (a long forward is busy, not stuck),
//! unless the step in flight has been awaited longer than `--ready-stall-timeout-ms` and
//! the heartbeats have not moved for as long (wedged). A shard that does not answer in
//! time is red when a step has been awaited longer than the stall timeout (stalled) or
//! when no step is in flight (nothing shows the engine alive), and green while the step
//! in flight is younger than that (steps are still coming back, so the silence is a
//! hiccup).
//!
//! With several replicas (`--replicas`) the rule is applied to each: `/ready` is green
//! while any replica is, and a replica that is red gets no new requests. `monitor`
//! applies the rule every second whoever asks, so heartbeats are watched and a replica's
//! state stays fresh between probes of `/ready`.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::client::{ShardClient, ShardHealth};
use crate::error::ShardError;
use crate::infer::Infer;

/// How long `/ready` waits for the shards' `Health` answer.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Asks every shard whether it is up and warmed up (the production one: `Health` on
/// every rank; tests use a fake).
pub trait HealthProbe: Send + Sync + 'static {
    fn probe(&self) -> Pin<Box<dyn Future<Output = Result<ShardHealth, ShardError>> + Send>>;
}

impl HealthProbe for ShardClient {
    fn probe(&self) -> Pin<Box<dyn Future<Output = Result<ShardHealth, ShardError>> + Send>> {
        let shards = self.clone();
        Box::pin(async move { shards.health().await })
    }
}

/// Why `/ready` is red.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotReady {
    /// SIGTERM or SIGINT arrived: the requests in flight are finishing.
    Draining,
    /// A shard answered that it has no KV cache yet.
    WarmingUp,
    /// The `Health` call failed (a shard is gone).
    ShardError(String),
    /// No step in flight and no `Health` answer in time.
    ShardSilent,
    /// A step awaited this long and no `Health` answer in time.
    Stalled(Duration),
    /// A step awaited this long while the shards answered `Health` with heartbeats that
    /// have not moved for the second duration.
    Wedged(Duration, Duration),
}

impl NotReady {
    /// A stable token for scripts and dashboards.
    pub fn reason(&self) -> &'static str {
        match self {
            NotReady::Draining => "draining",
            NotReady::WarmingUp => "warming_up",
            NotReady::ShardError(_) => "shard_error",
            NotReady::ShardSilent => "shard_silent",
            NotReady::Stalled(_) => "stalled",
            NotReady::Wedged(..) => "wedged",
        }
    }

    pub fn message(&self, probe_timeout: Duration) -> String {
        let silent = format!("the shards did not answer Health within {probe_timeout:?}");
        match self {
            NotReady::Draining => "the server is shutting down".into(),
            NotReady::WarmingUp => "a shard has not allocated its KV cache yet".into(),
            NotReady::ShardError(e) => format!("Health failed: {e}"),
            NotReady::ShardSilent => silent,
            NotReady::Stalled(waited) => {
                format!("no step completed for {waited:.1?} with a step in flight, and {silent}")
            }
            NotReady::Wedged(waited, still) => format!(
                "no step completed for {waited:.1?} with a step in flight, and the shards' \
                 forward made no progress (no heartbeat) for {still:.1?}"
            ),
        }
    }
}

/// The 503 body of `/ready`: TGI's error shape plus the reason's token.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct NotReadyBody {
    pub error: String,
    pub error_type: &'static str,
    /// `draining`, `warming_up`, `shard_error`, `shard_silent`, `stalled` or `wedged`.
    pub reason: &'static str,
}

/// Heartbeats last seen, and when they last changed.
type LastBeat = (u64, Instant);

/// How often `monitor` checks every replica.
pub const MONITOR_INTERVAL: Duration = Duration::from_secs(1);

/// What `/ready` checks against.
#[derive(Clone)]
pub struct Readiness {
    /// One per replica, in replica order.
    probes: Vec<Arc<dyn HealthProbe>>,
    /// Per replica: the heartbeats last seen and when they last changed.
    beats: Arc<[Mutex<Option<LastBeat>>]>,
    /// A step awaited longer than this is overdue (`--ready-stall-timeout-ms`).
    pub stall_timeout: Duration,
    pub probe_timeout: Duration,
}

impl Readiness {
    pub fn new(probe: Arc<dyn HealthProbe>, stall_timeout: Duration) -> Self {
        Self::for_replicas(vec![probe], stall_timeout)
    }

    /// One probe per replica, in replica order.
    pub fn for_replicas(probes: Vec<Arc<dyn HealthProbe>>, stall_timeout: Duration) -> Self {
        Self {
            beats: probes.iter().map(|_| Mutex::new(None)).collect(),
            probes,
            stall_timeout,
            probe_timeout: PROBE_TIMEOUT,
        }
    }

    /// Applies the rule of the module documentation to every replica at once, records
    /// each one's state (the balancer skips red replicas), and is green if any is.
    pub async fn check(&self, infer: &Infer) -> Result<(), NotReady> {
        if infer.drain().is_draining() {
            return Err(NotReady::Draining);
        }
        let checks = (0..self.probes.len()).map(|i| self.check_replica(infer, i));
        let outcomes = futures::future::join_all(checks).await;
        for (i, outcome) in outcomes.iter().enumerate() {
            infer.set_replica_ready(i, outcome.is_ok());
        }
        match outcomes.iter().find(|o| o.is_ok()) {
            Some(_) => Ok(()),
            None => outcomes.into_iter().next().unwrap_or(Ok(())),
        }
    }

    /// Checks every replica each `MONITOR_INTERVAL` until a drain begins, so a replica
    /// that fails stops getting requests whether or not anyone probes `/ready`, and the
    /// heartbeats are sampled often enough to time how long they stood still.
    pub fn monitor(self, infer: Infer) {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(MONITOR_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if infer.drain().is_draining() {
                    return;
                }
                let _ = self.check(&infer).await;
            }
        });
    }

    /// How long replica `i`'s heartbeats have stood at `beats` (zero when they moved
    /// since the last check, or on the first).
    fn heartbeats_still_for(&self, i: usize, beats: u64) -> Duration {
        let mut last = self.beats[i].lock().expect("heartbeat lock");
        match *last {
            Some((seen, since)) if seen == beats => since.elapsed(),
            _ => {
                *last = Some((beats, Instant::now()));
                Duration::ZERO
            }
        }
    }

    /// The rule for replica `i`.
    async fn check_replica(&self, infer: &Infer, i: usize) -> Result<(), NotReady> {
        match tokio::time::timeout(self.probe_timeout, self.probes[i].probe()).await {
            Ok(Ok(h)) if h.ready => {
                let still = self.heartbeats_still_for(i, h.heartbeats);
                match infer.progress(i).waited() {
                    Some(waited) if waited > self.stall_timeout && still > self.stall_timeout => {
                        Err(NotReady::Wedged(waited, still))
                    }
                    _ => Ok(()),
                }
            }
            Ok(Ok(_)) => Err(NotReady::WarmingUp),
            Ok(Err(e)) => Err(NotReady::ShardError(e.to_string())),
            // Read after the wait: the step clock as of now.
            Err(_) => match infer.progress(i).waited() {
                Some(waited) if waited < self.stall_timeout => Ok(()),
                Some(waited) => Err(NotReady::Stalled(waited)),
                None => Err(NotReady::ShardSilent),
            },
        }
    }
}

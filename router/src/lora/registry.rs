//! The adapter registry: every adapter the router knows, by name, and where its weights
//! are. One per router, shared by the HTTP side (which resolves names and pins the
//! adapters of the requests it submits) and every replica's batching loop (which asks
//! whether an adapter's host load is done and reports what it pages in and out).
//!
//! An adapter's host state (`Load`): `Known` (its folder only), `Loading` (LoadAdapter
//! running on every rank, on its own task, never on a batching loop), `Host` (parsed in
//! the shards' host memory: it may be paged in), `Failed` (the shards refused it; the
//! requests waiting for it fail with the shards' message), `Dropping` (DropAdapter
//! running; a request arriving meanwhile loads it again afterwards).
//!
//! An adapter is *in use* while a request naming it is queued or running (`pins`) and
//! *resident* while a replica has it paged in (`resident`, counted from the step that
//! pages it in to the answer of the step that pages it out). Neither kind is ever
//! dropped from host memory. `--max-cpu-adapters` bounds the others: past it the least
//! recently used host-loaded adapter that is neither in use nor resident is dropped
//! (back to `Known`: the next request naming it loads it again).
//!
//! Unloading (`unload`) unregisters the name at once (new requests get 404 / 422; it is
//! no longer listed) but never cuts a request: the requests already holding it finish,
//! each replica pages it out once it runs no request with it, and then its host copy is
//! dropped and the entry deleted. Until then the name cannot be loaded again (409).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{oneshot, watch};

use super::config::{check_name, LoraConfig};
use super::shards::{drop_everywhere, load_everywhere, AdapterShards, HostAdapter};
use crate::metrics::LoraMetrics;

/// Where an adapter's weights are, as far as the shards' host memory goes.
#[derive(Debug, Clone)]
enum Load {
    Known,
    Loading,
    Host(HostAdapter),
    Failed(String),
    Dropping { reload: bool },
}

/// How an adapter came to be registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// `--lora-adapters` or `POST /v1/load_lora_adapter`: a failed load unregisters it.
    Named,
    /// Found in `--lora-dir` on first use: a failed load is tried again by the next use.
    Dir,
}

#[derive(Debug)]
struct Entry {
    path: PathBuf,
    origin: Origin,
    load: Load,
    /// Requests naming it, queued or running (`AdapterPin`s alive).
    pins: usize,
    /// Replicas that have it paged in (or have not yet confirmed paging it out).
    resident: usize,
    /// The registry's clock when a request last named it.
    last_used: u64,
    /// Unloaded: unregistered, deleted once neither in use nor resident.
    removing: bool,
    /// Those waiting for the load in progress (start, runtime load).
    waiters: Vec<oneshot::Sender<Result<(), String>>>,
}

#[derive(Debug, Default)]
struct Catalog {
    entries: HashMap<String, Entry>,
    clock: u64,
}

/// Work decided under the registry's lock, run once it is released.
enum Action {
    Load(String, PathBuf),
    Drop(String),
}

/// Whether a batching loop may page an adapter in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// Loaded in host memory; takes this many KV blocks when paged in.
    Ready(usize),
    /// Loading, or about to.
    Pending,
    /// The shards refused it: why.
    Failed(String),
    /// Not registered.
    Unknown,
}

/// Why `POST /v1/load_lora_adapter` did not load an adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// The name is taken.
    AlreadyLoaded,
    /// The name's previous adapter is still being unloaded (its requests finishing).
    BeingUnloaded,
    /// The name is not one requests can use.
    InvalidName(String),
    /// The shards refused it: their message.
    Refused(String),
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::AlreadyLoaded => write!(f, "the name is already taken"),
            LoadError::BeingUnloaded => {
                write!(f, "the name's previous adapter is still being unloaded")
            }
            LoadError::InvalidName(why) | LoadError::Refused(why) => write!(f, "{why}"),
        }
    }
}

/// A registered adapter as `/v1/models` and `/info` show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub name: String,
    pub path: PathBuf,
}

/// See the module documentation.
pub struct Registry {
    config: LoraConfig,
    groups: Vec<Arc<dyn AdapterShards>>,
    catalog: Mutex<Catalog>,
    /// Bumped on every change a batching loop may care about (a load done or failed, an
    /// unload, a drop done): loops waiting on adapters wake up.
    changed: watch::Sender<u64>,
    metrics: Arc<LoraMetrics>,
}

/// Keeps an adapter in use (its host copy is never dropped) while a request naming it is
/// queued or running.
pub struct AdapterPin {
    registry: Arc<Registry>,
    name: String,
}

impl Drop for AdapterPin {
    fn drop(&mut self) {
        self.registry.unpin(&self.name);
    }
}

impl std::fmt::Debug for AdapterPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AdapterPin({})", self.name)
    }
}

impl Registry {
    /// A registry over the shard groups `groups` (one per replica); nothing is loaded yet
    /// (`load_at_start`).
    pub fn new(config: LoraConfig, groups: Vec<Arc<dyn AdapterShards>>) -> Arc<Self> {
        let metrics = Arc::new(LoraMetrics {
            max_lora: config.max_adapters_per_batch,
            ..Default::default()
        });
        Arc::new(Self {
            config,
            groups,
            catalog: Mutex::default(),
            changed: watch::channel(0).0,
            metrics,
        })
    }

    /// A registry for a router without LoRA options: every name but the base model's is
    /// unknown.
    pub fn disabled() -> Arc<Self> {
        Self::new(LoraConfig::default(), Vec::new())
    }

    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// Whether any LoRA option is on (`LoraConfig::enabled`).
    pub fn enabled(&self) -> bool {
        self.config.enabled()
    }

    pub fn metrics(&self) -> &Arc<LoraMetrics> {
        &self.metrics
    }

    /// Bumped whenever a loop waiting on an adapter should look again.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn lock(&self) -> MutexGuard<'_, Catalog> {
        // Nothing panics while holding it; a poisoned lock is still consistent.
        self.catalog.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self, catalog: &Catalog) {
        let host = catalog
            .entries
            .values()
            .filter(|e| matches!(e.load, Load::Host(_)))
            .count();
        self.metrics.host.set(host as f64);
        self.changed.send_modify(|v| *v += 1);
    }

    /// Loads the `--lora-adapters` adapters, all at once; Err names the first refused one
    /// with the shards' message (the router then does not start).
    pub async fn load_at_start(self: &Arc<Self>) -> Result<(), String> {
        let mut waits = Vec::new();
        for (name, path) in &self.config.adapters {
            let waiting = self
                .register_and_load(name, path)
                .map_err(|e| format!("--lora-adapters {name}={}: {e}", path.display()))?;
            waits.push((name, path, waiting));
        }
        for (name, path, waiting) in waits {
            let loaded = waiting
                .await
                .unwrap_or_else(|_| Err("the load was cut".into()));
            if let Err(why) = loaded {
                return Err(format!(
                    "LoRA adapter {name:?} ({}) was refused: {why}",
                    path.display()
                ));
            }
        }
        Ok(())
    }

    /// `POST /v1/load_lora_adapter`: registers `name` for `path` and returns once every
    /// rank of every replica has parsed it.
    pub async fn load_runtime(self: &Arc<Self>, name: &str, path: &Path) -> Result<(), LoadError> {
        let waiting = self.register_and_load(name, path)?;
        match waiting.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(why)) => Err(LoadError::Refused(why)),
            Err(_) => Err(LoadError::Refused("the load was cut".into())),
        }
    }

    /// Registers a named adapter and starts its host load; the receiver gets its outcome.
    fn register_and_load(
        self: &Arc<Self>,
        name: &str,
        path: &Path,
    ) -> Result<oneshot::Receiver<Result<(), String>>, LoadError> {
        check_name(name).map_err(LoadError::InvalidName)?;
        let (tx, rx) = oneshot::channel();
        {
            let mut catalog = self.lock();
            if let Some(entry) = catalog.entries.get(name) {
                return Err(if entry.removing {
                    LoadError::BeingUnloaded
                } else {
                    LoadError::AlreadyLoaded
                });
            }
            catalog.clock += 1;
            let last_used = catalog.clock;
            catalog.entries.insert(
                name.to_string(),
                Entry {
                    path: path.to_path_buf(),
                    origin: Origin::Named,
                    load: Load::Loading,
                    pins: 0,
                    resident: 0,
                    last_used,
                    removing: false,
                    waiters: vec![tx],
                },
            );
        }
        self.run(vec![Action::Load(name.to_string(), path.to_path_buf())]);
        Ok(rx)
    }

    /// Whether requests may name `name`: a registered adapter (not being unloaded), or one
    /// `--lora-dir` holds (registered now, loaded on first use).
    pub fn resolve(&self, name: &str) -> bool {
        if let Some(entry) = self.lock().entries.get(name) {
            return !entry.removing;
        }
        // The folder is looked at without the lock held.
        let Some(folder) = self.config.find_in_dir(name) else {
            return false;
        };
        let mut catalog = self.lock();
        if let Some(entry) = catalog.entries.get(name) {
            return !entry.removing; // registered meanwhile
        }
        catalog.entries.insert(
            name.to_string(),
            Entry {
                path: folder,
                origin: Origin::Dir,
                load: Load::Known,
                pins: 0,
                resident: 0,
                last_used: 0,
                removing: false,
                waiters: Vec::new(),
            },
        );
        true
    }

    /// A request names adapter `name`: keeps it in use until the pin drops, and starts its
    /// host load when it is not loaded. None when requests cannot name it (`resolve`).
    pub fn pin(self: &Arc<Self>, name: &str) -> Option<AdapterPin> {
        if !self.resolve(name) {
            return None;
        }
        let actions = {
            let mut catalog = self.lock();
            catalog.clock += 1;
            let clock = catalog.clock;
            let entry = catalog.entries.get_mut(name)?;
            if entry.removing {
                return None; // unloaded since `resolve`
            }
            entry.pins += 1;
            entry.last_used = clock;
            match &mut entry.load {
                Load::Known | Load::Failed(_) => {
                    entry.load = Load::Loading;
                    vec![Action::Load(name.to_string(), entry.path.clone())]
                }
                Load::Dropping { reload } => {
                    *reload = true;
                    Vec::new()
                }
                Load::Loading | Load::Host(_) => Vec::new(),
            }
        };
        self.run(actions);
        Some(AdapterPin {
            registry: self.clone(),
            name: name.to_string(),
        })
    }

    fn unpin(self: &Arc<Self>, name: &str) {
        self.release(name, |entry| {
            entry.pins -= 1;
            entry.pins
        });
    }

    /// Lowers one of `name`'s holds (`lower` returns what is left of it); once none is
    /// left the adapter may be dropped or evicted.
    fn release(self: &Arc<Self>, name: &str, lower: impl FnOnce(&mut Entry) -> usize) {
        let actions = {
            let mut catalog = self.lock();
            let Some(entry) = catalog.entries.get_mut(name) else {
                return;
            };
            if lower(entry) > 0 {
                return;
            }
            let mut actions = Self::settle(&mut catalog, name);
            actions.extend(self.enforce_cap(&mut catalog));
            self.notify(&catalog);
            actions
        };
        self.run(actions);
    }

    /// Whether a loop may page adapter `name` in.
    pub fn status(&self, name: &str) -> Status {
        match self.lock().entries.get(name).map(|e| &e.load) {
            None => Status::Unknown,
            Some(Load::Host(h)) => Status::Ready(h.num_blocks),
            Some(Load::Failed(why)) => Status::Failed(why.clone()),
            Some(_) => Status::Pending,
        }
    }

    /// The adapters being unloaded (each loop pages them out once it runs none of their
    /// requests).
    pub fn removing(&self) -> HashSet<String> {
        let catalog = self.lock();
        catalog
            .entries
            .iter()
            .filter(|(_, e)| e.removing)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// A replica's step pages adapter `name` in (called before it is sent).
    pub fn paged_in(&self, name: &str) {
        if let Some(entry) = self.lock().entries.get_mut(name) {
            entry.resident += 1;
        }
    }

    /// A replica has paged adapter `name` out: the step that did has been answered, or
    /// its shards' session ended.
    pub fn paged_out(self: &Arc<Self>, name: &str) {
        self.release(name, |entry| {
            entry.resident = entry.resident.saturating_sub(1);
            entry.resident
        });
    }

    /// `POST /v1/unload_lora_adapter`: unregisters `name` (see the module documentation).
    /// False when no adapter goes by that name.
    pub fn unload(self: &Arc<Self>, name: &str) -> bool {
        let actions = {
            let mut catalog = self.lock();
            match catalog.entries.get_mut(name) {
                Some(entry) if !entry.removing => entry.removing = true,
                _ => return false,
            }
            let actions = Self::settle(&mut catalog, name);
            self.notify(&catalog);
            actions
        };
        self.run(actions);
        true
    }

    /// The registered adapters (not being unloaded, not refused), by name.
    pub fn listed(&self) -> Vec<Listed> {
        let catalog = self.lock();
        let mut listed: Vec<Listed> = catalog
            .entries
            .iter()
            .filter(|(_, e)| !e.removing && !matches!(e.load, Load::Failed(_)))
            .map(|(name, e)| Listed {
                name: name.clone(),
                path: e.path.clone(),
            })
            .collect();
        listed.sort_by(|a, b| a.name.cmp(&b.name));
        listed
    }

    /// A removed adapter that nothing holds any more: its host copy is dropped, or the
    /// entry deleted when there is none.
    fn settle(catalog: &mut Catalog, name: &str) -> Vec<Action> {
        let Some(entry) = catalog.entries.get_mut(name) else {
            return Vec::new();
        };
        if !entry.removing || entry.pins > 0 || entry.resident > 0 {
            return Vec::new();
        }
        match entry.load {
            Load::Host(_) => {
                entry.load = Load::Dropping { reload: false };
                vec![Action::Drop(name.to_string())]
            }
            Load::Known | Load::Failed(_) => {
                catalog.entries.remove(name);
                Vec::new()
            }
            // Settled again when the load or the drop ends.
            Load::Loading | Load::Dropping { .. } => Vec::new(),
        }
    }

    /// Drops the least recently used host copies that are neither in use nor resident
    /// while more than `--max-cpu-adapters` are loaded.
    fn enforce_cap(&self, catalog: &mut Catalog) -> Vec<Action> {
        let loaded = |e: &Entry| matches!(e.load, Load::Host(_)) && !e.removing;
        let host = catalog.entries.values().filter(|e| loaded(e)).count();
        let Some(excess) = host.checked_sub(self.config.max_cpu_adapters) else {
            return Vec::new();
        };
        let mut idle: Vec<(u64, String)> = catalog
            .entries
            .iter()
            .filter(|(_, e)| loaded(e) && e.pins == 0 && e.resident == 0)
            .map(|(n, e)| (e.last_used, n.clone()))
            .collect();
        idle.sort_unstable();
        idle.into_iter()
            .take(excess)
            .map(|(_, name)| {
                let entry = catalog.entries.get_mut(&name).expect("listed above");
                entry.load = Load::Dropping { reload: false };
                Action::Drop(name)
            })
            .collect()
    }

    /// Runs the work decided under the lock, each on its own task (none once the runtime
    /// is gone: the process is ending).
    fn run(self: &Arc<Self>, actions: Vec<Action>) {
        if actions.is_empty() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        for action in actions {
            let registry = self.clone();
            match action {
                Action::Load(name, path) => {
                    tokio::spawn(async move { registry.host_load(name, path).await });
                }
                Action::Drop(name) => {
                    tokio::spawn(async move { registry.host_drop(name).await });
                }
            }
        }
    }

    /// LoadAdapter everywhere, then the outcome: host-loaded, or refused (a named adapter
    /// is then unregistered; one from `--lora-dir` is tried again by its next use).
    async fn host_load(self: Arc<Self>, name: String, path: PathBuf) {
        tracing::info!(adapter = %name, path = %path.display(), "loading LoRA adapter");
        let loaded = load_everywhere(&self.groups, &name, &path.to_string_lossy()).await;
        let actions = {
            let mut catalog = self.lock();
            let Some(entry) = catalog.entries.get_mut(&name) else {
                return;
            };
            let outcome = match loaded {
                Ok(host) => {
                    tracing::info!(
                        adapter = %name,
                        num_blocks = host.num_blocks,
                        max_rank = host.max_rank,
                        targets = ?host.target_modules,
                        bytes = host.bytes,
                        "LoRA adapter loaded"
                    );
                    self.metrics.loads.add(1);
                    entry.load = Load::Host(host);
                    Ok(())
                }
                Err(why) => {
                    tracing::warn!(adapter = %name, error = %why, "LoRA adapter refused");
                    entry.load = Load::Failed(why.clone());
                    if entry.origin == Origin::Named {
                        entry.removing = true;
                    }
                    Err(why)
                }
            };
            for waiter in entry.waiters.drain(..) {
                let _ = waiter.send(outcome.clone());
            }
            let mut actions = Self::settle(&mut catalog, &name);
            actions.extend(self.enforce_cap(&mut catalog));
            self.notify(&catalog);
            actions
        };
        self.run(actions);
    }

    /// DropAdapter everywhere, then: deleted (unloaded), loaded again (a request named it
    /// meanwhile), or back to `Known`.
    async fn host_drop(self: Arc<Self>, name: String) {
        drop_everywhere(&self.groups, &name).await;
        tracing::info!(adapter = %name, "LoRA adapter dropped from host memory");
        let actions = {
            let mut catalog = self.lock();
            let Some(entry) = catalog.entries.get_mut(&name) else {
                return;
            };
            let Load::Dropping { reload } = entry.load else {
                return;
            };
            let actions = if entry.removing && entry.pins == 0 {
                catalog.entries.remove(&name);
                Vec::new()
            } else if reload {
                entry.load = Load::Loading;
                vec![Action::Load(name.clone(), entry.path.clone())]
            } else {
                entry.load = Load::Known;
                Vec::new()
            };
            self.notify(&catalog);
            actions
        };
        self.run(actions);
    }
}

//! LoRA adapters, the router's side: which adapters exist and where their weights are
//! (`registry`), the shards' host loads (`shards`), the flags (`config`), and what each
//! batching loop has paged in (`residency`). Paging adapters into the KV pool is the
//! block manager's and the scheduler's (`blocks::adapters`, `scheduler`).
//!
//! The flow: a request naming an adapter pins it (`Registry::pin`), which starts its host
//! load (LoadAdapter on every rank of every replica, on its own task) when it is not
//! loaded; the request waits in its replica's queue, passed over by the scheduler until
//! the load is done (`Registry::status`, polled by the loop, which wakes on
//! `Registry::subscribe`); then the scheduler pages the adapter in with the step that
//! admits it.

mod config;
mod registry;
mod residency;
mod shards;

pub use config::{check_name, parse_adapter, LoraConfig};
pub use registry::{AdapterPin, Listed, LoadError, Registry, Status};
pub use residency::Residency;
pub use shards::{AdapterShards, HostAdapter, Reply};

//! What every OpenAI answer repeats: its id, creation time, model and fingerprint.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::api::AppState;

pub(super) const FINGERPRINT: &str = concat!("cadence-", env!("CARGO_PKG_VERSION"));

/// What every body and chunk of one answer repeats.
#[derive(Clone)]
pub(super) struct Envelope {
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
}

impl Envelope {
    /// A new answer, created now, its id `<prefix>-<uuid>`, its `model` the adapter's
    /// name when the request used one (as vLLM answers), else the served model name.
    pub fn new(id_prefix: &str, state: &AppState, adapter: Option<&str>) -> Self {
        Self {
            id: format!("{id_prefix}-{}", uuid::Uuid::new_v4().simple()),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: adapter.map_or_else(|| state.info.served_model_name.clone(), str::to_string),
        }
    }
}

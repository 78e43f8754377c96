//! `cadence_http_requests_rejected_total`: every request answered a 4xx (bad key, bad
//! input, unknown route or model, too large, too many), by route, status and reason. Its
//! labels are bounded: a route is one the router serves (or `unmatched`), a reason one of
//! the error types the router writes.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::text::{Kind, Labels, Text};

/// One rejection's labels.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rejection {
    pub route: String,
    pub status: u16,
    pub reason: String,
}

/// The rejections counted so far.
#[derive(Debug, Default)]
pub struct Rejections(Mutex<BTreeMap<Rejection, u64>>);

impl Rejections {
    pub fn count(&self, rejection: Rejection) {
        let mut counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *counts.entry(rejection).or_default() += 1;
    }

    /// Writes the family (its samples once something was rejected); `l` holds the model
    /// label.
    pub(super) fn write(&self, w: &mut Text, l: &Labels) {
        let name = "cadence_http_requests_rejected_total";
        w.family(
            name,
            Kind::Counter,
            "Requests answered a 4xx (401, 404, 405, 413, 422, 429, other 4xx), by route, status and reason (the error's type).",
        );
        let counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for (r, n) in counts.iter() {
            let labels = l
                .with("route", &r.route)
                .with("status", r.status)
                .with("reason", &r.reason);
            w.sample(name, &labels, n);
        }
    }
}

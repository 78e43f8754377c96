//! `cadence_http_requests_rejected_total`: every request answered a 4xx (bad key, bad
//! input, unknown route or model, too large, too many), by route, status and reason. Its
//! labels are bounded: a route is one the router serves (or `unmatched`), a reason one of
//! the error types the router writes.

use std::collections::BTreeMap;
use std::sync::Mutex;

use prometheus_client::metrics::MetricType;

use super::families::{label, Families};

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

    /// Registers the family (its samples once something was rejected); `cadence`
    /// carries the model label.
    pub(super) fn write(&self, cadence: &mut Families) {
        let counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let samples = counts
            .iter()
            .map(|(r, n)| {
                let labels = vec![
                    label("route", &r.route),
                    label("status", r.status),
                    label("reason", &r.reason),
                ];
                (labels, *n as f64)
            })
            .collect();
        cadence.samples(
            "cadence_http_requests_rejected_total",
            "Requests answered a 4xx (401, 404, 405, 413, 422, 429, other 4xx), by route, status and reason (the error's type).",
            MetricType::Counter,
            samples,
        );
    }
}

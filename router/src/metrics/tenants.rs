//! Per-tenant accounting series (`crate::tenants`): requests admitted and refused, prompt
//! and generated tokens, requests in flight, one series per tenant named by its API key's
//! entry (never the key).

use std::sync::atomic::Ordering;

use prometheus_client::metrics::MetricType;

use super::families::{label, Families};
use crate::tenants::Tenants;

/// Registers the tenant series; `cadence` carries the model label.
pub(super) fn write(cadence: &mut Families, tenants: &Tenants) {
    if tenants.is_empty() {
        return;
    }
    let series: [(&str, MetricType, &str); 5] = [
        (
            "cadence_tenant_requests_total",
            MetricType::Counter,
            "Requests admitted, by the tenant of their API key.",
        ),
        (
            "cadence_tenant_requests_rejected_total",
            MetricType::Counter,
            "Requests answered 429 for their tenant's own limits (requests in flight, tokens per minute).",
        ),
        (
            "cadence_tenant_prompt_tokens_total",
            MetricType::Counter,
            "Prompt tokens of admitted requests (once per request, n samples or not), by tenant.",
        ),
        (
            "cadence_tenant_generation_tokens_total",
            MetricType::Counter,
            "Tokens generated, by tenant.",
        ),
        (
            "cadence_tenant_running_requests",
            MetricType::Gauge,
            "Requests admitted and not ended, by tenant.",
        ),
    ];
    for (i, (name, kind, help)) in series.into_iter().enumerate() {
        let samples = tenants
            .iter()
            .map(|(tenant, usage)| {
                let value = match i {
                    0 => usage.requests.get() as f64,
                    1 => usage.rejected.get() as f64,
                    2 => usage.prompt_tokens.get() as f64,
                    3 => usage.generation_tokens.get() as f64,
                    _ => usage.in_flight.load(Ordering::Acquire) as f64,
                };
                (vec![label("tenant", tenant)], value)
            })
            .collect();
        cadence.samples(name, help, kind, samples);
    }
}

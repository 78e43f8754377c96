//! OpenTelemetry traces, exported from the router over OTLP/HTTP (protobuf) by a batch
//! processor on the tokio runtime. Off unless `--otlp-endpoint` (or
//! `OTEL_EXPORTER_OTLP_ENDPOINT`) names a collector; then `tracer()` is `None` and no
//! span is ever built.
//!
//! Each generation request has a server span (`request_scope`), the caller's when it sent
//! a W3C `traceparent`, with children: `queue`, one `prefill` per chunk and `decode`
//! (recorded by the batching loop, `infer::spans`), and `stream` for streamed answers.

use std::sync::OnceLock;

use axum::http::HeaderMap;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::Context;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;

/// The environment variable other OpenTelemetry programs read the collector from.
pub const ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// The tracer, when traces are exported.
pub fn tracer() -> Option<&'static SdkTracer> {
    TRACER.get()
}

/// The exporter while it runs; `shutdown` exports what is still buffered.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Starts exporting to `endpoint` (a collector's OTLP/HTTP base URL, such as
    /// `http://collector:4318`; spans go to its `/v1/traces`), or to
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` when no flag names one; without either, does nothing.
    /// Must run on the tokio runtime the router serves on. A second start in one process
    /// keeps the first tracer.
    pub fn start(endpoint: Option<&str>, service_name: &str) -> Result<Self, String> {
        let from_env = std::env::var(ENDPOINT_ENV).ok();
        let Some(base) = endpoint
            .or(from_env.as_deref())
            .filter(|url| !url.is_empty())
        else {
            return Ok(Self { provider: None });
        };
        let url = traces_url(base);
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url.clone())
            .build()
            .map_err(|e| format!("--otlp-endpoint {base}: {e}"))?;
        // The batch delay and sizes come from the OTEL_BSP_* variables (default 5 s).
        let processor =
            BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
        let resource = Resource::builder()
            .with_service_name(service_name.to_string())
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource)
            .build();
        let _ = TRACER.set(provider.tracer("cadence-router"));
        tracing::info!(endpoint = %url, service_name, "exporting traces");
        Ok(Self {
            provider: Some(provider),
        })
    }

    /// Exports the spans still buffered and stops the exporter. Its wait for the export
    /// blocks a thread, so it runs apart from the runtime's workers, which the export
    /// itself needs.
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        }
    }
}

/// Where OTLP/HTTP takes spans, under a collector's base URL.
fn traces_url(base: &str) -> String {
    format!("{}/v1/traces", base.trim_end_matches('/'))
}

/// The caller's trace context from a W3C `traceparent` header (empty when there is none
/// or it is malformed: the request then starts a trace of its own).
pub fn caller_context(headers: &HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&Headers(headers))
}

struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use opentelemetry::trace::{TraceContextExt, TraceId};

    use super::*;

    #[test]
    fn spans_go_under_the_collectors_base_url() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
    }

    #[test]
    fn a_traceparent_makes_the_request_join_the_callers_trace() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "traceparent",
            HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        let parent = caller_context(&headers);
        let span = parent.span();
        let caller = span.span_context();
        assert!(caller.is_remote() && caller.is_sampled());
        assert_eq!(
            caller.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        let malformed = HeaderMap::from_iter([(
            axum::http::header::HeaderName::from_static("traceparent"),
            HeaderValue::from_static("00-zz-00f067aa0ba902b7-01"),
        )]);
        assert!(!caller_context(&malformed).has_active_span());
    }
}

//! What every generation request carries from its HTTP handler into the batching loop:
//! its request id (`request_id`), its tenant (`tenants`) and, with traces on, the context
//! of its server span.
//!
//! `scope` wraps the generation routes: it settles the id, opens the server span, runs
//! the handler inside the request's scope, and answers with `x-request-id`. The handler
//! future runs inside a task-local scope, so `Infer::submit` (the one way in) takes the
//! request's context with `RequestContext::current()` and no route has to pass it along.
//! A streamed answer's `stream` span, and the server span of a stream, end when its body
//! has been written (or the client left).

use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Body;
use axum::extract::{MatchedPath, Request};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::SdkTracer;

use crate::scheduler::objectives::OBJECTIVE_HEADER;
use crate::tenants::Tenant;
use crate::{request_id, telemetry};

/// The request a piece of work belongs to.
#[derive(Clone, Debug)]
pub struct RequestContext {
    pub id: Arc<str>,
    /// The request's server span, with traces on.
    pub trace: Option<Context>,
    /// The tenant of the API key it presented (`tenants`), when keys are required.
    pub tenant: Option<Arc<str>>,
    /// The gateway's `x-gateway-inference-objective` (`scheduler::objectives`).
    pub objective: Option<Arc<str>>,
}

tokio::task_local! {
    static CURRENT: RequestContext;
}

impl RequestContext {
    /// The context of the request being handled; outside `scope` (a test driving `Infer`
    /// directly), a fresh id without a trace.
    pub fn current() -> Self {
        CURRENT.try_with(Clone::clone).unwrap_or_else(|_| Self {
            id: request_id::generate().into(),
            trace: None,
            tenant: None,
            objective: None,
        })
    }
}

/// The middleware of the generation routes (see the module documentation).
pub async fn scope(request: Request, next: Next) -> Response {
    let id: Arc<str> = request_id::of_request(request.headers()).into();
    let trace = telemetry::tracer().map(|tracer| server_span(tracer, &request, &id));
    let context = RequestContext {
        id: id.clone(),
        trace: trace.clone(),
        tenant: request.extensions().get::<Tenant>().map(|t| t.0.clone()),
        objective: request
            .headers()
            .get(OBJECTIVE_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(Into::into),
    };
    let mut response = CURRENT.scope(context, next.run(request)).await;
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(request_id::HEADER, value);
    }
    match trace {
        Some(trace) => traced(response, trace),
        None => response,
    }
}

/// The request's server span, a child of the caller's `traceparent` when it sent one, in
/// a context for its children.
fn server_span(tracer: &SdkTracer, request: &Request, id: &str) -> Context {
    let route = request.extensions().get::<MatchedPath>().map_or_else(
        || request.uri().path().to_string(),
        |p| p.as_str().to_string(),
    );
    let method = request.method().to_string();
    let parent = telemetry::caller_context(request.headers());
    let name = format!("{method} {route}");
    let mut attributes = vec![
        KeyValue::new("http.request.method", method),
        KeyValue::new("http.route", route),
        KeyValue::new("cadence.request_id", id.to_string()),
    ];
    attributes.extend(gateway_attributes(request.headers()));
    let span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Server)
        .with_attributes(attributes)
        .start_with_context(tracer, &parent);
    parent.with_span(span)
}

/// The inference gateway's per-request headers (its fairness id and objective), kept on
/// the server span. cadence schedules every request alike (no tenants or priorities yet),
/// so they are recorded for the operator rather than acted on.
fn gateway_attributes(headers: &axum::http::HeaderMap) -> Vec<KeyValue> {
    [
        (
            "x-gateway-inference-fairness-id",
            "gateway.inference.fairness_id",
        ),
        (
            "x-gateway-inference-objective",
            "gateway.inference.objective",
        ),
    ]
    .into_iter()
    .filter_map(|(header, key)| {
        let value = headers.get(header)?.to_str().ok()?;
        Some(KeyValue::new(
            key,
            value.chars().take(256).collect::<String>(),
        ))
    })
    .collect()
}

/// Records the status on the server span; ends it now, or for a stream once its body
/// is written, beside the stream's own `stream` span.
fn traced(response: Response, trace: Context) -> Response {
    let status = response.status();
    let span = trace.span();
    span.set_attribute(KeyValue::new(
        "http.response.status_code",
        i64::from(status.as_u16()),
    ));
    if status.is_server_error() {
        span.set_status(Status::error(status.to_string()));
    }
    let streamed = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !streamed {
        span.end();
        return response;
    }
    let (parts, body) = response.into_parts();
    let tracer = telemetry::tracer().expect("a traced request has a tracer");
    let mut writing = StreamSpan {
        span: tracer
            .span_builder("stream")
            .with_start_time(SystemTime::now())
            .start_with_context(tracer, &trace),
        server: trace,
        chunks: 0,
        bytes: 0,
    };
    let body = body.into_data_stream().map(move |chunk| {
        if let Ok(bytes) = &chunk {
            writing.wrote(bytes.len());
        }
        chunk
    });
    Response::from_parts(parts, Body::from_stream(body))
}

/// A streamed body being written: its span and the server span end with it.
struct StreamSpan {
    span: opentelemetry_sdk::trace::Span,
    server: Context,
    chunks: usize,
    bytes: usize,
}

impl StreamSpan {
    fn wrote(&mut self, bytes: usize) {
        self.chunks += 1;
        self.bytes += bytes;
    }
}

impl Drop for StreamSpan {
    fn drop(&mut self) {
        self.span.set_attributes([
            KeyValue::new("cadence.stream.chunks", self.chunks as i64),
            KeyValue::new("cadence.stream.bytes", self.bytes as i64),
        ]);
        self.span.end();
        self.server.span().end();
    }
}

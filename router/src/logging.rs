//! The router's logs: human-readable text, or one JSON object per line in the schema the
//! shards and the launcher write too (docs/deploy.md, "Logs"):
//!
//! `{"timestamp", "level", "component": "router", ["request_id"], "target", "message",
//! "fields": {...}}`
//!
//! An event's `request_id` field becomes the top-level key, `message` the message; every
//! other field goes under `fields`.

use std::fmt;
use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;
use tracing_subscriber::EnvFilter;

use crate::args::LogFormat;

/// The event field lifted to the top level of a JSON line.
pub const REQUEST_ID_FIELD: &str = "request_id";

/// Installs the global subscriber (`RUST_LOG` filters, default info). A second call (a
/// Python process starting the router twice) keeps the first.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    match format {
        LogFormat::Json => {
            let _ = tracing_subscriber::registry()
                .with(JsonLines)
                .with(filter)
                .try_init();
        }
        LogFormat::Text => {
            let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_ansi(ansi)
                .try_init();
        }
    }
}

/// Writes every event as one JSON line on stdout.
struct JsonLines;

impl<S: Subscriber> Layer<S> for JsonLines {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut line = json_line(event, SystemTime::now());
        line.push('\n');
        // One write per line, so lines of concurrent events never interleave.
        let _ = std::io::stdout().lock().write_all(line.as_bytes());
    }
}

/// One line of the schema (serialized in this field order).
#[derive(Serialize)]
struct LogLine<'a> {
    timestamp: String,
    level: &'static str,
    component: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<String>,
    target: &'a str,
    message: String,
    fields: Map<String, Value>,
}

/// `event` as a JSON object (without the newline), stamped `now`.
pub fn json_line(event: &Event<'_>, now: SystemTime) -> String {
    let mut fields = Fields::default();
    event.record(&mut fields);
    let line = LogLine {
        timestamp: rfc3339_millis(now),
        level: event.metadata().level().as_str(),
        component: "router",
        request_id: fields.request_id,
        target: event.metadata().target(),
        message: fields.message,
        fields: fields.rest,
    };
    serde_json::to_string(&line).unwrap_or_default()
}

/// An event's fields, sorted into the schema's places.
#[derive(Default)]
struct Fields {
    message: String,
    request_id: Option<String>,
    rest: Map<String, Value>,
}

impl Fields {
    fn put(&mut self, field: &Field, value: Value) {
        match (field.name(), value) {
            ("message", Value::String(s)) => self.message = s,
            (REQUEST_ID_FIELD, Value::String(s)) => self.request_id = Some(s),
            (name, value) => {
                self.rest.insert(name.to_string(), value);
            }
        }
    }
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, Value::from(value));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, Value::from(value));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, Value::from(value));
    }

    /// `%value`, `?value` and the message itself.
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, Value::from(format!("{value:?}")));
    }
}

/// `t` as RFC 3339 in UTC with milliseconds: `2024-05-01T12:30:45.123Z`.
pub fn rfc3339_millis(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (year, month, day) = civil_date(secs / 86_400);
    let rem = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_millis()
    )
}

/// The proleptic Gregorian (year, month, day) of `days` since 1970-01-01, counted in
/// 400-year eras that start on March 1st (so the leap day ends a year).
fn civil_date(days: u64) -> (u64, u64, u64) {
    const DAYS_PER_ERA: u64 = 146_097;
    // 1970-01-01 is day 719_468 after 0000-03-01.
    let z = days + 719_468;
    let era = z / DAYS_PER_ERA;
    let day_of_era = z % DAYS_PER_ERA;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = era * 400 + year_of_era + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;

    #[test]
    fn timestamps_are_utc_with_milliseconds() {
        let at = |secs: u64, millis: u64| {
            rfc3339_millis(UNIX_EPOCH + Duration::from_millis(secs * 1000 + millis))
        };
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(951_782_400, 7), "2000-02-29T00:00:00.007Z"); // a leap day
        assert_eq!(at(951_955_199, 999), "2000-03-01T23:59:59.999Z");
        assert_eq!(at(1_700_000_000, 123), "2023-11-14T22:13:20.123Z");
        assert_eq!(at(4_107_542_400, 0), "2100-03-01T00:00:00.000Z"); // 2100 is not leap
    }

    /// Collects the JSON lines of the events emitted under it.
    struct Capture(Arc<Mutex<Vec<String>>>);

    impl<S: Subscriber> Layer<S> for Capture {
        fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
            let line = json_line(event, UNIX_EPOCH + Duration::from_millis(1_500));
            self.0.lock().unwrap().push(line);
        }
    }

    fn lines_of(emit: impl FnOnce()) -> Vec<Value> {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(Capture(lines.clone()));
        tracing::subscriber::with_default(subscriber, emit);
        let lines = lines.lock().unwrap();
        lines
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn keys(line: &Value) -> Vec<&str> {
        line.as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect()
    }

    /// An absent optional field (`ttft_ms` before any token) is left out of `fields`.
    #[test]
    fn a_request_line_has_the_schema_keys_in_order() {
        let lines = lines_of(|| {
            tracing::info!(
                request_id = "req-7",
                generated_tokens = 5u64,
                finish_reason = ?crate::infer::FinishReason::EosToken,
                ttft_ms = Option::<u64>::None,
                ok = true,
                "finished"
            );
        });
        let line = &lines[0];
        let order = [
            "timestamp",
            "level",
            "component",
            "request_id",
            "target",
            "message",
            "fields",
        ];
        assert_eq!(keys(line), order);
        assert_eq!(line["timestamp"], "1970-01-01T00:00:01.500Z");
        assert_eq!(line["level"], "INFO");
        assert_eq!(line["component"], "router");
        assert_eq!(line["request_id"], "req-7");
        assert_eq!(line["message"], "finished");
        assert_eq!(line["target"], module_path!());
        assert_eq!(
            line["fields"],
            serde_json::json!({"generated_tokens": 5, "finish_reason": "EosToken", "ok": true})
        );
    }

    #[test]
    fn a_line_about_no_request_has_no_request_id() {
        let lines = lines_of(|| tracing::warn!(address = %"127.0.0.1:8080", "listening"));
        let line = &lines[0];
        let order = [
            "timestamp",
            "level",
            "component",
            "target",
            "message",
            "fields",
        ];
        assert_eq!(keys(line), order);
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["message"], "listening");
        assert_eq!(
            line["fields"],
            serde_json::json!({"address": "127.0.0.1:8080"})
        );
    }
}

//! The one writer of the Prometheus text exposition format (version 0.0.4) that
//! `/metrics` answers with: a family's `# HELP` and `# TYPE` lines, its samples as
//! `name{labels} value`, and histograms as cumulative buckets, sum and count. Label values
//! are escaped here, once, whatever their source (model names, adapters, shard fields).

use std::fmt::{Display, Write};

/// A metric family's type, as its `# TYPE` line names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A sample's labels, rendered as they stand between its braces: `key="value",...`, in
/// the order they were added.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Labels(String);

impl Labels {
    /// One label.
    pub(crate) fn one(key: &str, value: impl Display) -> Self {
        Self::default().with(key, value)
    }

    /// These labels and `key="value"` after them, the value escaped.
    pub(crate) fn with(&self, key: &str, value: impl Display) -> Self {
        let mut pairs = self.0.clone();
        if !pairs.is_empty() {
            pairs.push(',');
        }
        let _ = write!(pairs, "{key}=\"{}\"", escape(&value.to_string()));
        Self(pairs)
    }
}

/// A label value as the format quotes it: backslash, double quote and line feed escaped.
pub(crate) fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Appends families to a `/metrics` answer.
pub(crate) struct Text<'a>(&'a mut String);

impl<'a> Text<'a> {
    pub(crate) fn new(out: &'a mut String) -> Self {
        Self(out)
    }

    /// A family's `# HELP` and `# TYPE` lines; its samples follow.
    pub(crate) fn family(&mut self, name: &str, kind: Kind, help: &str) {
        let kind = kind.as_str();
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    /// One sample: `name{labels} value`.
    pub(crate) fn sample(&mut self, name: &str, labels: &Labels, value: impl Display) {
        let _ = if labels.0.is_empty() {
            writeln!(self.0, "{name} {value}")
        } else {
            writeln!(self.0, "{name}{{{}}} {value}", labels.0)
        };
    }

    /// A family of one gauge sample.
    pub(crate) fn gauge(&mut self, name: &str, help: &str, labels: &Labels, value: f64) {
        self.family(name, Kind::Gauge, help);
        self.sample(name, labels, value);
    }

    /// A family of one counter sample.
    pub(crate) fn counter(&mut self, name: &str, help: &str, labels: &Labels, value: u64) {
        self.family(name, Kind::Counter, help);
        self.sample(name, labels, value);
    }

    /// A histogram family: a bucket per upper bound (its count written cumulated),
    /// `+Inf`, the observations' sum and their count.
    pub(crate) fn histogram(&mut self, name: &str, help: &str, labels: &Labels, h: Observed) {
        self.family(name, Kind::Histogram, help);
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (bound, n) in h.bounds.iter().zip(h.counts) {
            cumulative += n;
            self.sample(&bucket, &labels.with("le", bound), cumulative);
        }
        self.sample(&bucket, &labels.with("le", "+Inf"), h.count);
        self.sample(&format!("{name}_sum"), labels, h.sum);
        self.sample(&format!("{name}_count"), labels, h.count);
    }
}

/// What a histogram has observed: per upper bound in `bounds`, the observations at most
/// it and above the bound before (`counts`), and the observations' sum and count.
pub(crate) struct Observed<'a> {
    pub bounds: &'a [f64],
    pub counts: &'a [u64],
    pub sum: f64,
    pub count: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_headers_escaped_labels_and_cumulative_buckets() {
        let mut out = String::new();
        let mut w = Text::new(&mut out);
        let model = Labels::one("model", "a\"b\\c\nd");
        w.counter("c_total", "Things.", &model, 3);
        w.sample("bare", &Labels::default(), 1.5);
        let observed = Observed {
            bounds: &[1.0, 2.5],
            counts: &[1, 2],
            sum: 4.0,
            count: 4,
        };
        w.histogram("h", "Sizes.", &model, observed);
        assert_eq!(
            out,
            "# HELP c_total Things.\n# TYPE c_total counter\n\
             c_total{model=\"a\\\"b\\\\c\\nd\"} 3\n\
             bare 1.5\n\
             # HELP h Sizes.\n# TYPE h histogram\n\
             h_bucket{model=\"a\\\"b\\\\c\\nd\",le=\"1\"} 1\n\
             h_bucket{model=\"a\\\"b\\\\c\\nd\",le=\"2.5\"} 3\n\
             h_bucket{model=\"a\\\"b\\\\c\\nd\",le=\"+Inf\"} 4\n\
             h_sum{model=\"a\\\"b\\\\c\\nd\"} 4\n\
             h_count{model=\"a\\\"b\\\\c\\nd\"} 4\n"
        );
    }
}

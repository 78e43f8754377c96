//! How `/metrics` is written: each scrape registers the series in `prometheus-client`
//! registries, one per label rule (cadence's series carry `model`, vLLM's `model_name`,
//! the process's none), and the crate's Prometheus text encoder (format 0.0.4) writes
//! them: `# HELP` and `# TYPE` once per family, label values escaped, histograms as
//! cumulative buckets up to `+Inf`, their sum and count. Registering is cheap (the series
//! are shared handles); values read at scrape time (sums over replicas, per-label
//! accounts) are `Samples`.

use std::borrow::Cow;
use std::fmt::Display;

use prometheus_client::encoding::{prometheus_text, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};

use super::series::{encode_gauge_value, Counter};

/// The `Content-Type` of the answer (Prometheus text format 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// A sample's labels beyond its registry's, in the order they are written.
pub(crate) type Labels = Vec<(String, String)>;

/// One label.
pub(crate) fn label(key: &str, value: impl Display) -> (String, String) {
    (key.to_string(), value.to_string())
}

/// The families of one label rule, as registered for one scrape.
#[derive(Debug, Default)]
pub(crate) struct Families(Registry);

impl Families {
    /// Families whose every sample carries `key="value"` first.
    pub(crate) fn labelled(key: &'static str, value: &str) -> Self {
        let label = (Cow::Borrowed(key), Cow::Owned(value.to_string()));
        Self(Registry::with_labels(std::iter::once(label)))
    }

    /// Registers `metric` as family `name`. The crate appends `_total` to counters'
    /// names and a full stop to help texts, so both are taken off here: the code names
    /// every series as it is scraped.
    fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        let name = match metric.metric_type() {
            MetricType::Counter => name.strip_suffix("_total").unwrap_or_else(|| {
                panic!("counter {name} must end in _total");
            }),
            _ => name,
        };
        self.0
            .register(name, help.strip_suffix('.').unwrap_or(help), metric);
    }

    pub(crate) fn counter(&mut self, name: &str, help: &str, counter: &Counter) {
        self.register(name, help, counter.clone());
    }

    pub(crate) fn histogram(&mut self, name: &str, help: &str, h: histogram::Histogram) {
        self.register(name, help, h);
    }

    /// A gauge family of one sample read now.
    pub(crate) fn value(&mut self, name: &str, help: &str, value: f64) {
        self.samples(name, help, MetricType::Gauge, vec![(Labels::new(), value)]);
    }

    /// A counter family of one sample read now.
    pub(crate) fn count(&mut self, name: &str, help: &str, value: u64) {
        let samples = vec![(Labels::new(), value as f64)];
        self.samples(name, help, MetricType::Counter, samples);
    }

    /// A family of samples read now, each with its own labels (all with the same keys).
    pub(crate) fn samples(
        &mut self,
        name: &str,
        help: &str,
        kind: MetricType,
        samples: Vec<(Labels, f64)>,
    ) {
        self.register(name, help, Samples { kind, samples });
    }

    /// An info family: one sample whose labels say something, always 1.
    pub(crate) fn info(&mut self, name: &str, help: &str, labels: Labels) {
        self.samples(name, help, MetricType::Gauge, vec![(labels, 1.0)]);
    }

    /// Appends the families' text to `out`.
    pub(crate) fn encode(&self, out: &mut String) {
        prometheus_text::encode(out, &self.0).expect("writing to a String cannot fail");
    }
}

/// Values read at scrape time, each with its labels.
#[derive(Debug)]
struct Samples {
    kind: MetricType,
    samples: Vec<(Labels, f64)>,
}

impl EncodeMetric for Samples {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (labels, value) in &self.samples {
            let mut sample = encoder.encode_family(labels)?;
            match self.kind {
                MetricType::Counter => {
                    sample.encode_counter::<NoLabelSet, _, u64>(&(*value as u64), None)?
                }
                _ => encode_gauge_value(&mut sample, *value)?,
            }
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        self.kind
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::series::Histogram;

    #[test]
    fn writes_headers_escaped_labels_and_cumulative_buckets() {
        let mut f = Families::labelled("model", "a\"b\\c\nd");
        let c = Counter::default();
        c.add(3);
        f.counter("c_total", "Things.", &c);
        f.samples(
            "g",
            "Per kind.",
            MetricType::Gauge,
            vec![
                (vec![label("kind", "x")], 1.5),
                (vec![label("kind", "y")], 2.0),
            ],
        );
        let h = Histogram::new(&[1.0, 2.5]);
        for v in [0.5, 2.0, 2.0, 3.0] {
            h.observe(v);
        }
        f.histogram("h", "Sizes.", h.series());
        let mut out = String::new();
        f.encode(&mut out);
        let m = "model=\"a\\\"b\\\\c\\nd\"";
        assert_eq!(
            out,
            format!(
                "# HELP c_total Things.\n# TYPE c_total counter\nc_total{{{m}}} 3\n\
                 # HELP g Per kind.\n# TYPE g gauge\ng{{{m},kind=\"x\"}} 1.5\ng{{{m},kind=\"y\"}} 2\n\
                 # HELP h Sizes.\n# TYPE h histogram\n\
                 h_bucket{{{m},le=\"1\"}} 1\nh_bucket{{{m},le=\"2.5\"}} 3\n\
                 h_bucket{{{m},le=\"+Inf\"}} 4\nh_sum{{{m}}} 7.5\nh_count{{{m}}} 4\n"
            )
        );
    }
}

//! The kinds of series the router keeps, over `prometheus-client`'s metrics: counters and
//! gauges are one atomic each, a histogram one small lock of its own (no lock shared
//! between series). The batching loop writes them; `/metrics` registers clones of them
//! (they share their values) at scrape time.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::{counter, gauge, histogram, MetricType};

/// A count that only goes up.
#[derive(Debug, Default, Clone)]
pub struct Counter(counter::Counter<u64, AtomicU64>);

impl Counter {
    pub fn add(&self, n: u64) {
        self.0.inc_by(n);
    }

    pub fn get(&self) -> u64 {
        self.0.get()
    }
}

impl EncodeMetric for Counter {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }
}

/// A value that goes up and down (an f64, stored as bits).
#[derive(Debug, Default, Clone)]
pub struct Gauge(gauge::Gauge<f64, AtomicU64>);

impl Gauge {
    pub fn set(&self, value: f64) {
        self.0.set(value);
    }

    pub fn get(&self) -> f64 {
        self.0.get()
    }
}

/// Writes a gauge's value read at scrape time: whole numbers (requests, blocks) as integers, as they always
/// were on /metrics, fractions as floats.
pub(super) fn encode_gauge_value(
    encoder: &mut MetricEncoder,
    value: f64,
) -> Result<(), std::fmt::Error> {
    if value.fract() == 0.0 && value.abs() < 9.0e15 {
        encoder.encode_gauge(&(value as i64))
    } else {
        encoder.encode_gauge(&value)
    }
}

/// Observations counted in fixed buckets, with their sum and count. `twin` is the same
/// quantity under vLLM's name and buckets: every observation goes to both, so the two
/// cannot disagree on what they saw.
#[derive(Debug, Clone)]
pub struct Histogram {
    own: histogram::Histogram,
    twin: Option<histogram::Histogram>,
}

impl Histogram {
    pub(crate) fn new(bounds: &[f64]) -> Self {
        Self {
            own: histogram::Histogram::new(bounds.iter().copied()),
            twin: None,
        }
    }

    /// A histogram whose every observation is also counted in `twin_bounds`' buckets
    /// (`twin()`).
    pub(crate) fn with_twin(bounds: &[f64], twin_bounds: &[f64]) -> Self {
        Self {
            twin: Some(histogram::Histogram::new(twin_bounds.iter().copied())),
            ..Self::new(bounds)
        }
    }

    pub fn observe(&self, value: f64) {
        self.own.observe(value);
        if let Some(twin) = &self.twin {
            twin.observe(value);
        }
    }

    /// The series to register (a clone sharing its buckets).
    pub(crate) fn series(&self) -> histogram::Histogram {
        self.own.clone()
    }

    /// The twin's series, when it has one.
    pub(crate) fn twin(&self) -> Option<histogram::Histogram> {
        self.twin.clone()
    }
}

/// Histogram buckets as vLLM builds them for token counts: 1, 2, 5, 10, 20, 50, … up
/// to `max` (its `build_1_2_5_buckets`).
pub(crate) fn one_two_five_buckets(max: usize) -> Vec<f64> {
    let mut bounds = Vec::new();
    let mut scale = 1usize;
    loop {
        for m in [1usize, 2, 5] {
            match m.checked_mul(scale) {
                Some(v) if v <= max => bounds.push(v as f64),
                _ => return bounds,
            }
        }
        scale = match scale.checked_mul(10) {
            Some(s) => s,
            None => return bounds,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_two_five_buckets_stop_at_the_maximum() {
        assert_eq!(
            one_two_five_buckets(100),
            [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
        );
        assert_eq!(one_two_five_buckets(4), [1.0, 2.0]);
        assert_eq!(one_two_five_buckets(0), Vec::<f64>::new());
    }

    #[test]
    fn a_twin_histogram_sees_every_observation_in_its_own_buckets() {
        let h = Histogram::with_twin(&[1.0], &[0.5, 2.0]);
        h.observe(0.4);
        h.observe(3.0);
        let mut f = crate::metrics::Families::default();
        f.histogram("own", "Own.", h.series());
        f.histogram("twin", "Twin.", h.twin().unwrap());
        let mut text = String::new();
        f.encode(&mut text);
        for line in [
            "own_bucket{le=\"1\"} 1\n",
            "own_count 2\n",
            "own_sum 3.4\n",
            "twin_bucket{le=\"0.5\"} 1\n",
            "twin_bucket{le=\"2\"} 1\n",
            "twin_bucket{le=\"+Inf\"} 2\n",
            "twin_count 2\n",
            "twin_sum 3.4\n",
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
    }
}

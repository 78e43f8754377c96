//! The kinds of series the router keeps: counters, gauges and fixed-bucket histograms,
//! over atomics and one small lock per histogram, written by the batching loop and read
//! at scrape time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::text::{Labels, Observed, Text};

#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistogramData>,
}

#[derive(Debug, Default)]
struct HistogramData {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub(crate) fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            inner: Mutex::new(HistogramData {
                counts: vec![0; bounds.len()],
                ..Default::default()
            }),
        }
    }

    pub fn observe(&self, value: f64) {
        let mut d = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = self.bounds.iter().position(|&b| value <= b) {
            d.counts[i] += 1;
        }
        d.sum += value;
        d.count += 1;
    }

    /// Writes the histogram's family: `name`, `help`, every sample labelled `labels`.
    pub(crate) fn write(&self, w: &mut Text, name: &str, help: &str, labels: &Labels) {
        let d = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let observed = Observed {
            bounds: self.bounds,
            counts: &d.counts,
            sum: d.sum,
            count: d.count,
        };
        w.histogram(name, help, labels, observed);
    }
}

/// A gauge holding an f64 (stored as bits).
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }

    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

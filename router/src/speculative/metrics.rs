//! Speculative decoding's series on /metrics: vLLM's counters under vLLM's names and its
//! `model_name` label (so dashboards and benchmarks written for vLLM read them
//! unchanged), and cadence's own accepted-length histogram and switch-off counter under
//! the `model` label. Shown only once speculation is on (`Metrics::enable_speculative`).

use prometheus_client::metrics::MetricType;

use crate::metrics::families::{label, Families};
use crate::metrics::series::{Counter, Histogram};

/// Tokens one verification yields (1 + accepted).
const ACCEPTED_LENGTHS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0];

#[derive(Debug)]
pub struct SpecDecodeMetrics {
    drafts: Counter,
    draft_tokens: Counter,
    accepted_tokens: Counter,
    /// `accepted_per_position[i]`: verifications whose proposal i was accepted.
    accepted_per_position: Vec<Counter>,
    accepted_length: Histogram,
    steps_off: Counter,
}

impl SpecDecodeMetrics {
    /// Series for at most `num_speculative_tokens` proposals per request per step (one
    /// per-position counter each, all shown from the start).
    pub fn new(num_speculative_tokens: usize) -> Self {
        Self {
            drafts: Counter::default(),
            draft_tokens: Counter::default(),
            accepted_tokens: Counter::default(),
            accepted_per_position: (0..num_speculative_tokens)
                .map(|_| Counter::default())
                .collect(),
            accepted_length: Histogram::new(ACCEPTED_LENGTHS),
            steps_off: Counter::default(),
        }
    }

    /// One request's verification in a step: `accepted` of its `proposed` tokens (the
    /// accepted ones are always the first). A request without proposals in the step was
    /// not verified: nothing is recorded.
    pub fn record_verification(&self, proposed: usize, accepted: usize) {
        debug_assert!(accepted <= proposed, "{accepted} accepted of {proposed}");
        debug_assert!(proposed <= self.accepted_per_position.len());
        if proposed == 0 {
            return;
        }
        let accepted = accepted.min(proposed);
        self.drafts.add(1);
        self.draft_tokens.add(proposed as u64);
        self.accepted_tokens.add(accepted as u64);
        for position in self.accepted_per_position.iter().take(accepted) {
            position.add(1);
        }
        self.accepted_length.observe((1 + accepted) as f64);
    }

    /// A step that left a request's proposals out (some or all) because the step was past
    /// the load threshold.
    pub fn record_step_off(&self) {
        self.steps_off.add(1);
    }

    /// Registers the series: vLLM's in `vllm` (the `model_name` label), cadence's in
    /// `cadence` (the `model` label).
    pub(crate) fn write(&self, cadence: &mut Families, vllm: &mut Families) {
        let counters = [
            (
                "vllm:spec_decode_num_drafts_total",
                "Verifications: a request's step with proposed tokens.",
                &self.drafts,
            ),
            (
                "vllm:spec_decode_num_draft_tokens_total",
                "Proposed tokens.",
                &self.draft_tokens,
            ),
            (
                "vllm:spec_decode_num_accepted_tokens_total",
                "Accepted proposed tokens.",
                &self.accepted_tokens,
            ),
        ];
        for (name, help, c) in counters {
            vllm.counter(name, help, c);
        }
        let per_position = self
            .accepted_per_position
            .iter()
            .enumerate()
            .map(|(position, c)| (vec![label("position", position)], c.get() as f64))
            .collect();
        vllm.samples(
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted proposed tokens at each proposal position (0 is the first).",
            MetricType::Counter,
            per_position,
        );
        cadence.histogram(
            "cadence_spec_decode_accepted_length",
            "Tokens one verification yielded: 1 + the accepted proposals.",
            self.accepted_length.series(),
        );
        cadence.counter(
            "cadence_spec_decode_steps_off_total",
            "Steps that left proposals out because the step was past the speculative threshold (the load switch).",
            &self.steps_off,
        );
    }
}

#[cfg(test)]
mod tests {
    use crate::metrics::Metrics;

    /// The value of the sample line that starts with `series ` in `text`.
    fn value(text: &str, series: &str) -> f64 {
        let key = format!("{series} ");
        let line = text
            .lines()
            .find(|l| l.starts_with(&key))
            .unwrap_or_else(|| panic!("no {series} in:\n{text}"));
        line[key.len()..].parse().unwrap()
    }

    #[test]
    fn shown_only_once_speculation_is_enabled() {
        let m = Metrics::new("m");
        assert!(m.speculative().is_none());
        assert!(!m.render(None).contains("spec_decode"));
        m.enable_speculative(4);
        assert!(m.render(None).contains("vllm:spec_decode_num_drafts_total"));
        // Only the first call sets the positions.
        m.enable_speculative(9);
        let text = m.render(None);
        assert!(text.contains("position=\"3\""));
        assert!(!text.contains("position=\"4\""));
    }

    #[test]
    fn renders_vllm_counters_and_cadence_series_with_their_labels() {
        let m = Metrics::new("org/m\"x");
        let spec = m.enable_speculative(4);
        // (proposed, accepted) per verification.
        let verifications = [(4, 4), (4, 0), (3, 2), (2, 1), (1, 1), (0, 0)];
        for (proposed, accepted) in verifications {
            spec.record_verification(proposed, accepted);
        }
        spec.record_step_off();
        spec.record_step_off();
        let text = m.render(None);
        let vllm = |name: &str| value(&text, &format!("vllm:{name}{{model_name=\"org/m\\\"x\"}}"));
        let with_proposals: Vec<_> = verifications.iter().filter(|(p, _)| *p > 0).collect();
        assert_eq!(
            vllm("spec_decode_num_drafts_total"),
            with_proposals.len() as f64
        );
        let proposed: usize = verifications.iter().map(|(p, _)| p).sum();
        let accepted: usize = verifications.iter().map(|(_, a)| a).sum();
        assert_eq!(vllm("spec_decode_num_draft_tokens_total"), proposed as f64);
        assert_eq!(
            vllm("spec_decode_num_accepted_tokens_total"),
            accepted as f64
        );
        for position in 0..4 {
            let accepted_here = verifications.iter().filter(|(_, a)| *a > position).count();
            let series = format!(
                "vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name=\"org/m\\\"x\",position=\"{position}\"}}"
            );
            assert_eq!(value(&text, &series), accepted_here as f64, "{series}");
        }
        assert!(
            text.contains("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter\n")
        );
        let cadence = |series: &str| value(&text, &format!("cadence_spec_decode_{series}"));
        assert_eq!(cadence("steps_off_total{model=\"org/m\\\"x\"}"), 2.0);
        // Accepted lengths 5, 1, 3, 2, 2.
        let bucket = |le: &str| {
            cadence(&format!(
                "accepted_length_bucket{{model=\"org/m\\\"x\",le=\"{le}\"}}"
            ))
        };
        assert_eq!(bucket("1"), 1.0);
        assert_eq!(bucket("2"), 3.0);
        assert_eq!(bucket("3"), 4.0);
        assert_eq!(bucket("4"), 4.0);
        assert_eq!(bucket("5"), 5.0);
        assert_eq!(bucket("+Inf"), 5.0);
        assert_eq!(cadence("accepted_length_sum{model=\"org/m\\\"x\"}"), 13.0);
        assert_eq!(cadence("accepted_length_count{model=\"org/m\\\"x\"}"), 5.0);
    }
}

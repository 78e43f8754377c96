//! `/metrics` read back as a scraper reads it: the text parses as the Prometheus
//! exposition format, the label rule holds for every family, and vLLM's dashboards find
//! every series they query.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use super::*;

/// A label set, in order.
type Labels = Vec<(String, String)>;

/// One family as parsed: its type, and its samples (name, labels in order, value).
#[derive(Debug, Default)]
struct Family {
    kind: String,
    help: bool,
    samples: Vec<(String, Labels, f64)>,
}

/// A label set's `key="value",...`, the values unescaped.
fn parse_labels(text: &str) -> Labels {
    let mut labels = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"").expect("key=\"value\"");
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next().expect("closing quote") {
                (_, '\\') => match chars.next().expect("escaped char").1 {
                    'n' => value.push('\n'),
                    c @ ('\\' | '"') => value.push(c),
                    c => panic!("bad escape \\{c}"),
                },
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        labels.push((key.to_string(), value));
        rest = after[end + 1..]
            .strip_prefix(',')
            .unwrap_or(&after[end + 1..]);
    }
    labels
}

/// Parses the exposition, checking its grammar on the way: `# HELP` then `# TYPE` once
/// per family, before its samples; each sample named after the family it follows.
fn parse(text: &str) -> BTreeMap<String, Family> {
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    let mut current = String::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, _) = rest.split_once(' ').expect("help text");
            assert!(!families.contains_key(name), "second HELP for {name}");
            families.entry(name.to_string()).or_default().help = true;
            current = name.to_string();
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert_eq!(name, current, "TYPE right after its HELP");
            let family = families.get_mut(name).unwrap();
            assert!(family.kind.is_empty(), "second TYPE for {name}");
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            family.kind = kind.to_string();
        } else {
            assert!(
                !line.starts_with('#'),
                "only HELP and TYPE comments: {line}"
            );
            let (series, value) = line.rsplit_once(' ').expect("name value");
            let value: f64 = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap_or_else(|_| panic!("value of {line}")),
            };
            let (name, labels) = match series.split_once('{') {
                Some((name, labels)) => (name, parse_labels(labels.strip_suffix('}').unwrap())),
                None => (series, Vec::new()),
            };
            let name_ok = name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
            assert!(name_ok, "metric name {name}");
            let family = families
                .get_mut(&current)
                .expect("a sample after its family");
            let allowed: &[&str] = match family.kind.as_str() {
                "histogram" => &["_bucket", "_sum", "_count"],
                _ => &[""],
            };
            assert!(
                allowed
                    .iter()
                    .any(|suffix| name == format!("{current}{suffix}")),
                "{name} under family {current}"
            );
            family.samples.push((name.to_string(), labels, value));
        }
    }
    families
}

/// Metrics with every optional family on and something observed in each.
fn busy_metrics() -> Metrics {
    let m = Metrics::with_replicas("org/m\"x", 2).with_max_model_len(4096);
    m.load(0).waiting.set(2.0);
    m.load(1).kv_blocks_total.set(64.0);
    m.prompt_tokens.add(7);
    m.generation_tokens.add(5);
    m.preemptions_swap.add(1);
    m.batch_tokens.observe(12.0);
    m.queue_time.observe(0.01);
    m.ttft.observe(0.2);
    m.itl.observe(0.03);
    m.requests.admitted(1, 16);
    m.finish(&Finished {
        reason: FinishedReason::Stop,
        prompt_tokens: 7,
        generation_tokens: 5,
        e2e: Duration::from_millis(400),
        prefill: Duration::from_millis(150),
        decode: Duration::from_millis(200),
        inference: Duration::from_millis(350),
    });
    m.enable_speculative(2).record_verification(2, 1);
    m.enable_lora(Arc::new(LoraMetrics::default()));
    m.http_rejections.count(Rejection {
        route: "/v1/completions".into(),
        status: 404,
        reason: "NotFoundError".into(),
    });
    m.set_quantization(&[("weights".to_string(), "int4".to_string())].into());
    m
}

#[test]
fn exposition_parses_with_one_header_per_family_and_whole_histograms() {
    let families = parse(&busy_metrics().render(Some((10, 7))));
    assert!(families.len() > 60, "{} families", families.len());
    for (name, family) in &families {
        assert!(
            family.help && !family.kind.is_empty(),
            "{name}: HELP and TYPE"
        );
        if family.kind == "counter" {
            assert!(name.ends_with("_total"), "counter {name}");
        }
        if family.kind != "histogram" {
            continue;
        }
        // One histogram per label set: its buckets cumulative up to +Inf, which equals
        // its count; its sum beside.
        let bucket = format!("{name}_bucket");
        let mut bounds = Vec::new();
        for (sample, labels, value) in &family.samples {
            if *sample == bucket {
                let le = &labels.last().unwrap();
                assert_eq!(le.0, "le", "{name}: le is the last label");
                let bound: f64 = match le.1.as_str() {
                    "+Inf" => f64::INFINITY,
                    b => b.parse().unwrap(),
                };
                bounds.push((bound, *value));
            }
        }
        assert!(bounds
            .windows(2)
            .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
        let (last_bound, inf_count) = *bounds.last().unwrap();
        assert_eq!(last_bound, f64::INFINITY, "{name} ends with +Inf");
        let count = family
            .samples
            .iter()
            .find(|(s, ..)| *s == format!("{name}_count"))
            .unwrap();
        assert_eq!(count.2, inf_count, "{name}: +Inf bucket = count");
        assert!(family
            .samples
            .iter()
            .any(|(s, ..)| *s == format!("{name}_sum")));
    }
}

#[test]
fn every_family_follows_the_label_rule_with_one_label_set() {
    let families = parse(&busy_metrics().render(Some((10, 7))));
    for (name, family) in &families {
        let first_label = if name.starts_with("cadence_") {
            Some("model")
        } else if name == "vllm:lora_requests_info" {
            // As vLLM exports it: its labels name the adapters, not the model.
            None
        } else if name.starts_with("vllm:") {
            Some("model_name")
        } else {
            assert!(name.starts_with("process_"), "unexpected family {name}");
            None
        };
        let mut key_sets = BTreeSet::new();
        for (_, labels, _) in &family.samples {
            let keys: Vec<&str> = labels
                .iter()
                .map(|(k, _)| k.as_str())
                .filter(|k| *k != "le")
                .collect();
            match first_label {
                Some(label) => {
                    assert_eq!(keys.first(), Some(&label), "{name}'s first label");
                    assert_eq!(labels[0].1, "org/m\"x", "{name}'s model");
                }
                None => assert!(!keys.contains(&"model") && !keys.contains(&"model_name")),
            }
            key_sets.insert(keys.join(","));
        }
        assert!(key_sets.len() <= 1, "{name} has label sets {key_sets:?}");
    }
}

/// The request-level series vLLM's Grafana dashboard (its examples' `grafana.json`,
/// "vLLM" dashboard) queries, by the name each query reads; the dashboard's older
/// revision read `time_per_output_token_seconds` and `gpu_cache_usage_perc` instead of
/// their current names, so both are here.
const VLLM_DASHBOARD_SERIES: &[&str] = &[
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
];

#[test]
fn every_series_vllms_dashboard_queries_is_there_for_the_served_model() {
    // A fresh router, before any request: the dashboard's panels find their series
    // from the first scrape.
    let fresh = Metrics::new("org/m");
    let text = fresh.render(None);
    for series in VLLM_DASHBOARD_SERIES {
        let found = text
            .lines()
            .any(|l| l.starts_with(&format!("{series}{{model_name=\"org/m\"")));
        assert!(found, "{series}{{model_name=\"org/m\"}} in:\n{text}");
    }
    // Finish reasons are the label the dashboard groups by.
    for reason in ["stop", "length"] {
        let key = format!(
            "vllm:request_success_total{{model_name=\"org/m\",finished_reason=\"{reason}\"}} 0\n"
        );
        assert!(text.contains(&key), "{key}");
    }
}

#[test]
fn vllm_request_series_count_what_cadences_count() {
    let m = busy_metrics();
    let families = parse(&m.render(None));
    let value = |name: &str, labels: &[(&str, &str)]| {
        let family = name
            .strip_suffix("_count")
            .or_else(|| name.strip_suffix("_sum"))
            .filter(|f| families.contains_key(*f))
            .unwrap_or(name);
        families[family]
            .samples
            .iter()
            .find(|(s, l, _)| {
                s == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .unwrap_or_else(|| panic!("{name} {labels:?}"))
            .2
    };
    for (vllm, cadence) in [
        ("vllm:prompt_tokens_total", "cadence_prompt_tokens_total"),
        (
            "vllm:generation_tokens_total",
            "cadence_generation_tokens_total",
        ),
        (
            "vllm:time_to_first_token_seconds_count",
            "cadence_time_to_first_token_seconds_count",
        ),
        (
            "vllm:e2e_request_latency_seconds_count",
            "cadence_e2e_request_latency_seconds_count",
        ),
        (
            "vllm:e2e_request_latency_seconds_sum",
            "cadence_e2e_request_latency_seconds_sum",
        ),
        (
            "vllm:request_queue_time_seconds_count",
            "cadence_queue_time_seconds_count",
        ),
        (
            "vllm:iteration_tokens_total_sum",
            "cadence_batch_tokens_sum",
        ),
    ] {
        assert_eq!(value(vllm, &[]), value(cadence, &[]), "{vllm} = {cadence}");
    }
    let stop = value("vllm:request_success_total", &[("finished_reason", "stop")]);
    assert_eq!(stop, 1.0);
    assert_eq!(value("cadence_requests_succeeded_total", &[]), 1.0);
    assert_eq!(value("vllm:num_preemptions_total", &[]), 1.0);
    assert_eq!(value("vllm:request_prompt_tokens_sum", &[]), 7.0);
    assert_eq!(value("vllm:request_generation_tokens_sum", &[]), 5.0);
    assert_eq!(value("vllm:request_prefill_time_seconds_sum", &[]), 0.15);
    assert_eq!(value("vllm:request_decode_time_seconds_sum", &[]), 0.2);
    assert_eq!(value("vllm:request_params_max_tokens_sum", &[]), 16.0);
    // vLLM's buckets, not cadence's: 1-2-5 token counts up to the model's length.
    let prompt_bounds: Vec<String> = families["vllm:request_prompt_tokens"]
        .samples
        .iter()
        .filter_map(|(_, l, _)| l.iter().find(|(k, _)| k == "le").map(|(_, v)| v.clone()))
        .collect();
    assert_eq!(prompt_bounds.first().map(String::as_str), Some("1"));
    assert!(prompt_bounds.contains(&"2000".to_string()));
    assert!(!prompt_bounds.contains(&"5000".to_string()));
}

#[test]
fn process_and_build_series_describe_the_router_process() {
    let text = Metrics::new("m").render(None);
    let build = text
        .lines()
        .find(|l| l.starts_with("cadence_build_info{"))
        .unwrap();
    let labels = parse_labels(
        build
            .strip_prefix("cadence_build_info{")
            .unwrap()
            .rsplit_once("} ")
            .unwrap()
            .0,
    );
    let keys: Vec<&str> = labels.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["model", "version", "git_sha", "rustc", "profile"]);
    assert_eq!(labels[1].1, env!("CARGO_PKG_VERSION"));
    assert!(
        !labels[2].1.is_empty() && !labels[3].1.is_empty(),
        "{build}"
    );
    assert!(build.ends_with("} 1"));
    if cfg!(target_os = "linux") {
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_virtual_memory_bytes",
            "process_open_fds",
            "process_max_fds",
            "process_start_time_seconds",
        ] {
            let line = text
                .lines()
                .find(|l| l.starts_with(&format!("{name} ")))
                .unwrap_or_else(|| panic!("{name}"));
            let value: f64 = line.rsplit_once(' ').unwrap().1.parse().unwrap();
            assert!(value >= 0.0, "{line}");
        }
    }
}

//! The router process's own series under the names every Prometheus client exports
//! (`process_cpu_seconds_total`, `process_resident_memory_bytes`, …), read from
//! `/proc/self` at scrape time (Linux; elsewhere they are left out), and
//! `cadence_build_info`: which build is running. The shards are other processes: these
//! series are the router's only.

use std::fs;

use prometheus_client::metrics::MetricType;

use super::families::{label, Families, Labels};

/// The unit of `/proc/*/stat`'s times: USER_HZ, 100 on every Linux architecture.
const TICKS_PER_SECOND: f64 = 100.0;

/// What `/proc/self` says about the router process.
#[derive(Debug, Default, PartialEq)]
struct ProcessStats {
    cpu_seconds: f64,
    start_time_seconds: f64,
    virtual_memory_bytes: f64,
    resident_memory_bytes: f64,
    open_fds: f64,
    max_fds: Option<f64>,
}

impl ProcessStats {
    /// Read now; `None` where `/proc` is not there.
    fn read() -> Option<Self> {
        let stat = fs::read_to_string("/proc/self/stat").ok()?;
        let status = fs::read_to_string("/proc/self/status").ok()?;
        let boot_time = fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| field_after(&s, "btime"))?;
        let mut stats = parse_stat(&stat, boot_time)?;
        stats.resident_memory_bytes = field_after(&status, "VmRSS:")? * 1024.0;
        stats.open_fds = fs::read_dir("/proc/self/fd").map_or(0, |d| d.count()) as f64;
        stats.max_fds = fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|s| field_after(&s, "Max open files"));
        Some(stats)
    }
}

/// The first number after `key` on the line that starts with it.
fn field_after(text: &str, key: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].split_whitespace().next()?.parse().ok()
}

/// `/proc/self/stat`'s CPU times, start and virtual size; `boot_time` is unix seconds.
fn parse_stat(stat: &str, boot_time: f64) -> Option<ProcessStats> {
    // The command name (field 2) may hold spaces: fields count from after its ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let number = |field: usize| fields.get(field - 3)?.parse::<f64>().ok();
    Some(ProcessStats {
        cpu_seconds: (number(14)? + number(15)?) / TICKS_PER_SECOND,
        start_time_seconds: boot_time + number(22)? / TICKS_PER_SECOND,
        virtual_memory_bytes: number(23)?,
        ..Default::default()
    })
}

/// Registers the process series (no label: one router process).
pub(super) fn write(plain: &mut Families) {
    let Some(p) = ProcessStats::read() else {
        return;
    };
    let samples = |v: f64| vec![(Labels::new(), v)];
    plain.samples(
        "process_cpu_seconds_total",
        "Total user and system CPU time of the router process in seconds.",
        MetricType::Counter,
        samples(p.cpu_seconds),
    );
    let gauges = [
        (
            "process_resident_memory_bytes",
            "Resident memory size of the router process in bytes.",
            Some(p.resident_memory_bytes),
        ),
        (
            "process_virtual_memory_bytes",
            "Virtual memory size of the router process in bytes.",
            Some(p.virtual_memory_bytes),
        ),
        (
            "process_open_fds",
            "Open file descriptors of the router process.",
            Some(p.open_fds),
        ),
        (
            "process_max_fds",
            "Maximum open file descriptors of the router process (its soft limit).",
            p.max_fds,
        ),
        (
            "process_start_time_seconds",
            "Start time of the router process since the unix epoch in seconds.",
            Some(p.start_time_seconds),
        ),
    ];
    for (name, help, value) in gauges {
        if let Some(value) = value {
            plain.value(name, help, value);
        }
    }
}

/// Registers `cadence_build_info`; `cadence` carries the `model` label.
pub(super) fn write_build_info(cadence: &mut Families) {
    let labels = vec![
        label("version", env!("CARGO_PKG_VERSION")),
        // Set by build.rs; "unknown" where it could not tell.
        label(
            "git_sha",
            option_env!("CADENCE_GIT_SHA").unwrap_or("unknown"),
        ),
        label(
            "rustc",
            option_env!("CADENCE_RUSTC_VERSION").unwrap_or("unknown"),
        ),
        label(
            "profile",
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
        ),
    ];
    cadence.info(
        "cadence_build_info",
        "The router's build: version, git commit (unknown when built outside a git checkout), rustc version and profile, in the labels; always 1.",
        labels,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_stat_with_a_command_name_holding_spaces_and_parens() {
        // Fields 3.. of a real /proc/self/stat line (utime 250, stime 50 ticks, started
        // 1000 ticks after boot, 8 MiB virtual).
        let stat = "4242 (cadence (router) x) S 1 4242 4242 0 -1 4194304 100 0 0 0 \
                    250 50 0 0 20 0 8 0 1000 8388608 512 18446744073709551615";
        let stats = parse_stat(stat, 1_700_000_000.0).unwrap();
        assert_eq!(stats.cpu_seconds, 3.0);
        assert_eq!(stats.start_time_seconds, 1_700_000_010.0);
        assert_eq!(stats.virtual_memory_bytes, 8_388_608.0);
    }

    #[test]
    fn reads_this_process_on_linux() {
        if !cfg!(target_os = "linux") {
            return;
        }
        let p = ProcessStats::read().unwrap();
        assert!(p.resident_memory_bytes > 0.0);
        assert!(p.open_fds >= 3.0, "stdin, stdout, stderr at least");
        assert!(p.max_fds.unwrap() >= p.open_fds);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(p.start_time_seconds <= now + 1.0);
    }
}

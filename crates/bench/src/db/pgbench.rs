//! pgbench's figures: the rate from its summary, and latency percentiles from its
//! per-transaction log (`pgbench -l`).

use std::path::Path;

use crate::harness::stats::quantiles;

/// What one `pgbench -T` run printed and logged.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PgbenchFigures {
    /// Transactions per second, without the initial connection time.
    pub tps: f64,
    /// Transactions logged (every one the run finished).
    pub transactions: u64,
    /// Transactions logged as failed or skipped.
    pub failed: u64,
    /// The median transaction's latency, milliseconds.
    pub latency_ms_p50: f64,
    /// The 99th percentile, milliseconds.
    pub latency_ms_p99: f64,
}

/// The `tps = N (without initial connection time)` figure of pgbench's summary.
pub fn parse_tps(summary: &str) -> Result<f64, String> {
    summary
        .lines()
        .filter_map(|line| line.trim().strip_prefix("tps = "))
        .filter_map(|rest| rest.split_whitespace().next()?.parse::<f64>().ok())
        .next_back()
        .ok_or_else(|| format!("no `tps = ` line in pgbench's output: {}", tail(summary)))
}

/// Each transaction's latency in microseconds from pgbench's per-transaction log lines
/// (`client_id transaction_no time script_no time_epoch time_us [...]`, `time` in µs, or
/// `failed`/`skipped`), appended to `latencies_us`; returns the count of failed or skipped
/// transactions.
pub fn parse_log(text: &str, latencies_us: &mut Vec<u64>) -> Result<u64, String> {
    let mut failed = 0;
    for (i, line) in text.lines().enumerate() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.is_empty() {
            continue;
        }
        if fields.len() < 6 {
            return Err(format!("line {}: not a pgbench transaction log line: {line:?}", i + 1));
        }
        match fields[2].parse::<u64>() {
            Ok(us) => latencies_us.push(us),
            Err(_) if matches!(fields[2], "failed" | "skipped") => failed += 1,
            Err(_) => {
                return Err(format!("line {}: latency {:?} is not a number", i + 1, fields[2]));
            }
        }
    }
    Ok(failed)
}

/// The median and the 99th percentile of `latencies_us`, in milliseconds (NaN for none).
pub fn percentiles_ms(latencies_us: &mut [u64]) -> (f64, f64) {
    let [p50, p99] = quantiles(latencies_us, [0.5, 0.99]);
    (p50 / 1e3, p99 / 1e3)
}

/// The figures of a run: its summary on stdout and the log files `pgbench -l
/// --log-prefix=DIR/pgbench_log` wrote in `log_dir` (one per thread).
pub fn figures(summary: &str, log_dir: &Path) -> Result<PgbenchFigures, String> {
    let tps = parse_tps(summary)?;
    let mut latencies_us = Vec::new();
    let mut failed = 0;
    let entries = std::fs::read_dir(log_dir).map_err(|e| format!("{}: {e}", log_dir.display()))?;
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with("pgbench_log") {
            continue;
        }
        let text = std::fs::read_to_string(entry.path())
            .map_err(|e| format!("{}: {e}", entry.path().display()))?;
        failed += parse_log(&text, &mut latencies_us)
            .map_err(|e| format!("{}: {e}", entry.path().display()))?;
    }
    if latencies_us.is_empty() {
        return Err(format!("pgbench logged no transaction in {}", log_dir.display()));
    }
    let transactions = latencies_us.len() as u64;
    let (latency_ms_p50, latency_ms_p99) = percentiles_ms(&mut latencies_us);
    Ok(PgbenchFigures { tps, transactions, failed, latency_ms_p50, latency_ms_p99 })
}

/// The last lines of a command's output, for error messages.
pub(super) fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUMMARY: &str = "pgbench (15.18 (Debian 15.18-0+deb12u1))\n\
        starting vacuum...end.\n\
        transaction type: <builtin: TPC-B (sort of)>\n\
        number of transactions actually processed: 14115\n\
        latency average = 4.251 ms\n\
        initial connection time = 12.807 ms\n\
        tps = 940.934386 (without initial connection time)\n";

    #[test]
    fn the_rate_is_the_tps_line_without_the_connection_time() {
        assert_eq!(parse_tps(SUMMARY), Ok(940.934386));
        assert!(parse_tps("pgbench: error: connection failed\n").unwrap_err().contains("tps"));
    }

    #[test]
    fn latencies_come_from_the_third_field_and_failures_are_counted_apart() {
        let log = "0 1 13410 0 1796303111 968264\n\
                   1 1 8693 0 1796303111 976973\n\
                   2 7 failed 0 1796303112 1234\n\
                   3 9 skipped 0 1796303112 1300\n\n";
        let mut us = Vec::new();
        assert_eq!(parse_log(log, &mut us), Ok(2));
        assert_eq!(us, [13410, 8693]);
        assert!(parse_log("0 1 x 0 1 2\n", &mut us).unwrap_err().contains("line 1"));
        assert!(parse_log("tps = 3\n", &mut us).is_err());
    }

    #[test]
    fn percentiles_are_in_milliseconds_at_the_rounded_ranks() {
        // 1 ms .. 100 ms: rank (n - 1) q rounded, 50 -> 51 ms (index 50), 99 -> 99 ms.
        let mut us: Vec<u64> = (1..=100).rev().map(|ms| ms * 1000).collect();
        assert_eq!(percentiles_ms(&mut us), (51.0, 99.0));
        let (p50, p99) = percentiles_ms(&mut []);
        assert!(p50.is_nan() && p99.is_nan());
    }

    #[test]
    fn a_runs_figures_join_every_threads_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("pgbench_log.7"), "0 1 1000 0 1 2\n0 2 3000 0 1 2\n")
            .expect("log");
        std::fs::write(dir.path().join("pgbench_log.7.1"), "1 1 2000 0 1 2\n").expect("log");
        std::fs::write(dir.path().join("other"), "not a log").expect("other");
        let f = figures(SUMMARY, dir.path()).expect("figures");
        assert_eq!((f.transactions, f.failed), (3, 0));
        assert_eq!((f.latency_ms_p50, f.latency_ms_p99), (2.0, 3.0));
        let empty = tempfile::tempdir().expect("tempdir");
        assert!(figures(SUMMARY, empty.path()).unwrap_err().contains("no transaction"));
    }
}

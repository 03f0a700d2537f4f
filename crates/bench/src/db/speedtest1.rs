//! SQLite's `speedtest1` (test/speedtest1.c of SQLite's source, built by
//! `scripts/db/build-speedtest1.sh`): where its binary is, and its output parsed.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// One of speedtest1's tests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpeedTest {
    /// Its number (`100`, `110`, …).
    pub id: u32,
    /// What it does.
    pub name: String,
    /// Its time in seconds.
    pub seconds: f64,
}

/// What one speedtest1 run printed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Speedtest1Output {
    /// The `TOTAL` line, seconds.
    pub total_s: f64,
    /// Each test.
    pub tests: Vec<SpeedTest>,
}

/// The time at the end of a speedtest1 line (`....    0.028s`).
fn seconds_at_end(line: &str) -> Option<f64> {
    line.split_whitespace().last()?.strip_suffix('s')?.parse().ok()
}

/// speedtest1's tests and total from its output (lines ` 100 - 10000 INSERTs into table with
/// no index.....   0.028s` and `TOTAL.....   1.437s`).
pub fn parse(output: &str) -> Result<Speedtest1Output, String> {
    let mut tests = Vec::new();
    let mut total_s = None;
    for line in output.lines() {
        let trimmed = line.trim();
        if let Some(rest) = trimmed.strip_prefix("TOTAL") {
            total_s = Some(
                seconds_at_end(rest)
                    .ok_or_else(|| format!("a TOTAL line without a time: {line:?}"))?,
            );
            continue;
        }
        let Some((id, rest)) = trimmed.split_once(" - ") else { continue };
        let Ok(id) = id.trim().parse::<u32>() else { continue };
        let seconds =
            seconds_at_end(rest).ok_or_else(|| format!("test {id} without a time: {line:?}"))?;
        let name = rest.split("..").next().unwrap_or(rest).trim().to_string();
        tests.push(SpeedTest { id, name, seconds });
    }
    let total_s = total_s.ok_or_else(|| {
        format!("no TOTAL line in speedtest1's output: {}", super::pgbench::tail(output))
    })?;
    if tests.is_empty() {
        return Err("speedtest1 printed no test".into());
    }
    Ok(Speedtest1Output { total_s, tests })
}

/// Where `scripts/db/build-speedtest1.sh` keeps what it builds:
/// `${PMCACHE_DB_CACHE:-$HOME/.cache/pmcache-db}`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PMCACHE_DB_CACHE") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache").join("pmcache-db")
}

/// The speedtest1 binary: `given`, or the one `scripts/db/build-speedtest1.sh` built; an
/// error naming the script when there is none.
pub fn binary(given: Option<&PathBuf>) -> Result<PathBuf, String> {
    let path = given.cloned().unwrap_or_else(|| cache_dir().join("speedtest1"));
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "no speedtest1 at {}: build it with scripts/db/build-speedtest1.sh (SQLite's \
             test/speedtest1.c from Debian's sqlite3 source package, linked to the system's \
             libsqlite3), or give --speedtest1 PATH",
            path.display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUTPUT: &str = "-- Speedtest1 for SQLite 3.40.1 2022-12-28 14:03:47 df5c253c0b3d\n \
        100 - 10000 INSERTs into table with no index......................    0.028s\n \
        300 - Refill a 10000-row table using (b&1)==(a&1).................    0.061s\n \
        980 - PRAGMA integrity_check......................................    0.085s\n       \
        TOTAL.......................................................    1.437s\n";

    #[test]
    fn tests_and_total_are_read_from_the_dotted_lines() {
        let out = parse(OUTPUT).expect("parsed");
        assert_eq!(out.total_s, 1.437);
        assert_eq!(out.tests.len(), 3);
        assert_eq!(
            out.tests[1],
            SpeedTest {
                id: 300,
                name: "Refill a 10000-row table using (b&1)==(a&1)".into(),
                seconds: 0.061
            }
        );
        assert_eq!(out.tests[2].name, "PRAGMA integrity_check");
    }

    #[test]
    fn output_without_a_total_or_tests_is_an_error() {
        let cut = OUTPUT.lines().take(3).collect::<Vec<_>>().join("\n");
        assert!(parse(&cut).unwrap_err().contains("TOTAL"));
        assert!(parse("       TOTAL......    1.0s\n").unwrap_err().contains("no test"));
        assert!(parse(" 100 - x.....  fast\n TOTAL... 1s\n").unwrap_err().contains("test 100"));
    }
}

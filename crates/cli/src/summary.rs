//! `pmcache stats` for a person: a short summary of a stats reply, grouped as `casadm -P`
//! groups a cache's figures (usage, requests, cleaner, connections, errors), in human units.
//! `--all` prints every counter; `--json` and `--prometheus` the flat keys.

use pmcache_frontend::units::human;
use serde_json::{Map, Value};

/// A counter of the reply (0 when absent).
fn n(stats: &Map<String, Value>, key: &str) -> u64 {
    stats.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// A text field of the reply ("-" when absent).
fn text<'a>(stats: &'a Map<String, Value>, key: &str) -> &'a str {
    stats.get(key).and_then(Value::as_str).unwrap_or("-")
}

/// `count` with thousands separated by commas.
pub fn count(count: u64) -> String {
    let digits = count.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `part` as a percentage of `whole`, one decimal.
fn pct(part: u64, whole: u64) -> String {
    if whole == 0 { "-".into() } else { format!("{:.1} %", part as f64 * 100.0 / whole as f64) }
}

/// The summary of a stats reply.
pub fn summary(stats: &Map<String, Value>) -> String {
    let slots = n(stats, "slot_count");
    let block = n(stats, "block_size");
    let free: u64 = stats
        .get("members")
        .and_then(Value::as_array)
        .map_or(0, |members| members.iter().filter_map(|m| m["free"].as_u64()).sum());
    let dirty = n(stats, "dirty_slots").min(slots);
    let used = slots.saturating_sub(free);
    let clean = used.saturating_sub(dirty);
    let hits = n(stats, "read_hits");
    let (admitted, bypassed, sequential, cold) = (
        n(stats, "read_misses_admitted"),
        n(stats, "read_misses_bypassed"),
        n(stats, "read_misses_sequential"),
        n(stats, "read_misses_cold"),
    );
    let reads = hits + admitted + bypassed + sequential;
    let writes = n(stats, "writes");
    let mut out = String::new();
    let mut line = |group: &str, body: String| out += &format!("{group:<12}{body}\n");
    line(
        "cache",
        format!(
            "{} ({} medium{}), {} over a {} backing store ({}), admission {}",
            text(stats, "mode"),
            text(stats, "medium"),
            if stats.get("data_crc").and_then(Value::as_bool) == Some(true) {
                ", data checksums"
            } else {
                ""
            },
            human(slots * block),
            human(n(stats, "size_bytes")),
            text(stats, "backing_engine"),
            text(stats, "admission"),
        ),
    );
    line(
        "usage",
        format!(
            "occupancy {} ({}), dirty {} ({}), clean {} ({}), free {} ({}) of {} blocks of {}",
            count(used),
            pct(used, slots),
            count(dirty),
            pct(dirty, slots),
            count(clean),
            pct(clean, slots),
            count(free),
            pct(free, slots),
            count(slots),
            human(block)
        ),
    );
    line(
        "reads",
        format!(
            "{} blocks, hit ratio {}: {} hits, {} misses admitted, {} bypassed ({} sequential, {} \
             cold); {} read",
            count(reads),
            pct(hits, reads),
            count(hits),
            count(admitted),
            count(bypassed + sequential),
            count(sequential),
            count(cold),
            human(n(stats, "bytes_read"))
        ),
    );
    line(
        "writes",
        format!(
            "{} blocks ({} to cached blocks, {}), {} written; {} flushes, {} trims",
            count(writes),
            count(n(stats, "write_hits")),
            pct(n(stats, "write_hits"), writes),
            human(n(stats, "bytes_written")),
            count(n(stats, "flushes")),
            count(n(stats, "trims"))
        ),
    );
    let boosted = stats.get("cleaner_boosted").and_then(Value::as_bool).unwrap_or(false);
    line(
        "cleaner",
        format!(
            "{}, {:.0} blocks/s, {}; {} written back, {} evictions; writers stalled {} times, \
             paced {} times",
            text(stats, "cleaner_phase"),
            stats.get("cleaner_rate_blocks_per_s").and_then(Value::as_f64).unwrap_or(0.0),
            if boosted { "boosted" } else { "not boosted" },
            count(n(stats, "writebacks")),
            count(n(stats, "evictions")),
            count(n(stats, "stalls")),
            count(n(stats, "throttled_writes"))
        ),
    );
    if stats.contains_key("connections_open") {
        line(
            "connections",
            format!(
                "{} open, {} accepted, {} refused at the limit, {} dropped",
                count(n(stats, "connections_open")),
                count(n(stats, "connections_accepted")),
                count(n(stats, "connections_refused_at_limit")),
                count(
                    n(stats, "connections_dropped_idle")
                        + n(stats, "connections_dropped_write_timeout")
                )
            ),
        );
    }
    if stats.contains_key("vhost_requests") {
        let (requests, batches) = (n(stats, "vhost_requests"), n(stats, "vhost_batches"));
        line(
            "vhost",
            format!(
                "{} virtqueues, {} connections; {} requests in {} batches ({:.1} a batch), {} \
                 answered with an error, {} through a buffer of their own",
                count(n(stats, "vhost_queues")),
                count(n(stats, "vhost_connections")),
                count(requests),
                count(batches),
                requests as f64 / batches.max(1) as f64,
                count(n(stats, "vhost_request_errors")),
                count(n(stats, "vhost_requests_bounced"))
            ),
        );
    }
    let state = text(stats, "backing_state");
    let mut errors = format!(
        "backing store {state}, {} failed operations, {} write-back errors",
        count(n(stats, "backing_errors")),
        count(n(stats, "cleaner_errors"))
    );
    if let Some(last) = stats.get("backing_last_error").and_then(Value::as_str) {
        let failing: Vec<&str> = stats
            .get("backing_failing")
            .and_then(Value::as_array)
            .map(|ops| ops.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let what = if failing.is_empty() {
            String::new()
        } else {
            format!("{} failing ", failing.join(", "))
        };
        errors += &format!(" ({what}for {} ms; last: {last})", n(stats, "backing_failing_ms"));
    }
    errors += &format!(
        "; cached data: {} checksum mismatches, {} medium read errors ({} clean re-read, {} \
         dirty unreadable), {} slots retired",
        count(n(stats, "data_crc_mismatches")),
        count(n(stats, "medium_read_errors")),
        count(n(stats, "unreadable_clean")),
        count(n(stats, "unreadable_dirty")),
        count(n(stats, "retired_slots"))
    );
    line("errors", errors);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_grouped_by_thousands() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(1234567), "1,234,567");
    }

    /// The summary's figures come from the reply: occupancy from the members' free slots,
    /// the hit ratio over every block read, the errors with the last one while failing.
    #[test]
    fn a_summary_groups_the_figures() {
        let reply = serde_json::json!({
            "mode": "writeback", "medium": "volatile", "admission": "seq-cutoff=4M",
            "backing_engine": "rbd", "size_bytes": 1u64 << 30, "block_size": 4096,
            "slot_count": 1000, "dirty_slots": 100,
            "members": [{"free": 200}, {"free": 300}],
            "read_hits": 900, "read_misses_admitted": 50, "read_misses_bypassed": 30,
            "read_misses_sequential": 20, "read_misses_cold": 10,
            "writes": 2000, "write_hits": 500, "cleaner_phase": "rate",
            "cleaner_rate_blocks_per_s": 1234.4, "cleaner_boosted": true,
            "connections_open": 2, "backing_state": "unreachable", "backing_errors": 7,
            "backing_last_error": "write at byte 0 (+4096): timed out", "backing_failing_ms": 1500,
            "backing_failing": ["writes", "flushes"],
            "data_crc": true, "data_crc_mismatches": 3, "medium_read_errors": 1,
            "unreadable_clean": 2, "unreadable_dirty": 2, "retired_slots": 1,
        });
        let text = summary(reply.as_object().expect("object"));
        assert!(text.contains("writeback (volatile medium, data checksums)"), "{text}");
        assert!(text.contains("admission seq-cutoff=4M"), "{text}");
        assert!(
            text.contains(
                "occupancy 500 (50.0 %), dirty 100 (10.0 %), clean 400 (40.0 %), free 500 (50.0 %)"
            ),
            "{text}"
        );
        assert!(text.contains("1,000 blocks, hit ratio 90.0 %: 900 hits, 50 misses admitted, 50 bypassed (20 sequential, 10 cold)"), "{text}");
        assert!(text.contains("2,000 blocks (500 to cached blocks, 25.0 %)"), "{text}");
        assert!(text.contains("rate, 1234 blocks/s, boosted"), "{text}");
        assert!(text.contains("connections 2 open"), "{text}");
        assert!(text.contains("backing store unreachable, 7 failed operations"), "{text}");
        assert!(
            text.contains("(writes, flushes failing for 1500 ms; last: write at byte 0"),
            "{text}"
        );
        assert!(
            text.contains(
                "cached data: 3 checksum mismatches, 1 medium read errors (2 clean re-read, 2 \
                 dirty unreadable), 1 slots retired"
            ),
            "{text}"
        );
    }
}

//! Each personality run for a moment on a temporary directory: its loop runs in order, and
//! OLTP's writers keep to the ratios its semaphores set.

use super::personality::{
    OLTP_DB_HIGHWATER, OLTP_DB_TOKENS_PER_LOOP, OLTP_DB_WRITERS, OLTP_LOG_HIGHWATER,
    OLTP_LOG_TOKENS_PER_LOOP,
};
use super::*;

fn ops(result: &FsResult, name: &str) -> u64 {
    result.flowops.iter().find(|f| f.name == name).map(|f| f.ops).expect("a flowop of that name")
}

/// A tiny fileset (the paper's counts over 4096) with `threads` threads for `seconds`.
fn run_small(p: Personality, threads: usize, seconds: f64) -> FsResult {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = workload(p, Sizing { divisor: 4096 }, Threads::Count(threads));
    let result = run::run(&w, dir.path(), seconds, 5).expect("the run");
    let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
    assert!(left.is_empty(), "the filesets are removed after the run");
    result
}

/// Every thread runs the loop in order, so along the loop the counts never rise, and the
/// first flowop ran at most once per thread more often than the last.
fn assert_loops_in_order(result: &FsResult, threads: u64) {
    let counts: Vec<u64> = result.flowops.iter().map(|f| f.ops).collect();
    assert!(counts[0] > 0, "{}: no loop ran: {counts:?}", result.personality);
    for pair in counts.windows(2) {
        assert!(pair[0] >= pair[1], "{}: counts along the loop: {counts:?}", result.personality);
    }
    let spread = counts[0] - counts[counts.len() - 1];
    assert!(
        spread <= threads,
        "{}: {spread} unfinished loops of {threads} threads",
        result.personality
    );
    assert_eq!(result.ops, counts.iter().sum::<u64>(), "every flowop is an op here");
}

#[test]
fn fileserver_varmail_and_webserver_run_their_loops_and_count_every_flowop() {
    for p in [Personality::Fileserver, Personality::Varmail, Personality::Webserver] {
        let r = run_small(p, 3, 0.7);
        assert_loops_in_order(&r, 3);
        assert!(r.ops_per_s > 0.0 && r.mib_per_s > 0.0);
        assert_eq!(r.threads, "3");
        let reads: u64 =
            r.flowops.iter().filter(|f| f.name.starts_with("readfile")).map(|f| f.ops).sum();
        assert!((r.reads_per_s * r.seconds - reads as f64).abs() < 0.5);
    }
    let varmail = run_small(Personality::Varmail, 2, 0.5);
    assert!(ops(&varmail, "fsyncfile2") >= ops(&varmail, "closefile2"));
    let web = run_small(Personality::Webserver, 2, 0.5);
    let log = web.flowops.iter().find(|f| f.name == "appendlog").expect("appendlog");
    assert!(log.write_bytes >= log.ops, "each append writes at least a byte");
}

#[test]
fn oltp_writers_keep_to_their_semaphores_ratios() {
    let shadows = 4;
    let r = run_small(Personality::Oltp, shadows, 2.0);
    let reads = ops(&r, "shadowread");
    let posts_db = ops(&r, "shadow-post-dbwr");
    let posts_lg = ops(&r, "shadow-post-lg");
    let db_writes = ops(&r, "dbwrite-a");
    let db_loops = ops(&r, "dbwr-block");
    let lg_writes = ops(&r, "lg-write");
    let lg_loops = ops(&r, "lg-block");
    assert!(reads > 0 && posts_db > 0, "{r:?}");
    assert!(reads >= posts_lg && posts_lg >= posts_db, "a transaction reads, then posts");
    // A DB writer queues 100 writes per loop and ends a loop only with 1000 tokens: all
    // writers' writes are at most 100 per loop begun, the loops at most the tokens over 1000.
    let writers = OLTP_DB_WRITERS as u64;
    assert!(db_writes <= 100 * (db_loops + writers), "{db_writes} writes, {db_loops} loops");
    let slack = shadows as u64; // posts under way at the stop
    assert!(
        db_loops * OLTP_DB_TOKENS_PER_LOOP <= (posts_db + slack) * writers,
        "{db_loops} loops of 1000 tokens from {posts_db} posts to each writer"
    );
    // Posters block once `highwater` + the blocked value are unconsumed, so the writers keep
    // up: at most 3000 posts per writer are not yet consumed.
    let unconsumed_max = OLTP_DB_HIGHWATER + OLTP_DB_TOKENS_PER_LOOP;
    assert!(
        posts_db * writers
            <= (db_loops + writers) * OLTP_DB_TOKENS_PER_LOOP + unconsumed_max * writers,
        "posts {posts_db} ran ahead of {db_loops} writer loops"
    );
    // The log writer: one 256 KiB write per 3200 tokens.
    assert!(lg_writes <= lg_loops + 1);
    assert!(lg_loops * OLTP_LOG_TOKENS_PER_LOOP <= posts_lg + slack);
    assert!(
        posts_lg <= (lg_loops + 1) * OLTP_LOG_TOKENS_PER_LOOP + OLTP_LOG_HIGHWATER,
        "{posts_lg} posts, {lg_loops} log-writer loops"
    );
    // Only I/O flowops are ops: reads, writes and waits.
    let counted: u64 = r.flowops.iter().filter(|f| f.counted).map(|f| f.ops).sum();
    assert_eq!(r.ops, counted);
    assert_eq!(
        counted,
        reads + db_writes + lg_writes + ops(&r, "dbwr-aiowait") + ops(&r, "lg-aiowait")
    );
    let write_bytes: u64 = r.flowops.iter().map(|f| f.write_bytes).sum();
    assert_eq!(write_bytes, db_writes * 2048 + lg_writes * 256 * 1024);
}

#[test]
fn names_and_counts_are_checked() {
    assert_eq!(
        personalities(&["varmail".into(), "all".into()]).expect("names").len(),
        4,
        "varmail, then the other three"
    );
    assert!(personalities(&["mailserver".into()]).unwrap_err().contains("no personality"));
    assert_eq!(
        thread_counts(&["paper".into(), "2".into()]).expect("counts"),
        [Threads::Paper, Threads::Count(2)]
    );
    assert!(thread_counts(&["0".into()]).is_err());
}

#[test]
fn a_directory_without_room_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = workload(Personality::Oltp, Sizing::PAPER, Threads::Paper);
    w.filesets[0].entries = 1 << 30; // 1.5 EiB of data files
    let e = check_room(&w, dir.path()).expect_err("no room");
    assert!(e.contains("MiB free") && e.contains("smaller --scale"), "{e}");
    assert!(std::fs::read_dir(dir.path()).expect("dir").next().is_none());
    let e = check_room(&w, &dir.path().join("missing")).expect_err("missing");
    assert!(e.contains("--dir"), "{e}");
}

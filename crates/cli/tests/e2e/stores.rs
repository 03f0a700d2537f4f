//! One cache medium shared by several backing stores (`serve --store NAME=PATH`), through
//! real clients (qemu-io, nbdinfo): each store is its own NBD export with its own data,
//! stats, write-back and detach while the others are served; a kill -9 is recovered store by
//! store; a store whose backing store is missing is refused by name and the others are
//! served; a medium of one store and a shared one are never taken for each other; the state
//! record of a volatile medium is each store's own.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use pmcache_testkit::qemu_io;

use crate::common::*;

/// A cache medium in /dev/shm and two sparse backing files, `a` and `b`.
struct Shared {
    setup: Setup,
    b: PathBuf,
}

impl Shared {
    fn new(tag: &str) -> Self {
        let setup = Setup::new(tag, 32 * MIB, 64 * MIB);
        let b = setup.disk.path().join("b.img");
        std::fs::File::create(&b).and_then(|f| f.set_len(48 * MIB)).expect("backing b");
        Self { setup, b }
    }

    fn args(&self, stores: &[(&str, &Path)], extra: &[&str]) -> Vec<String> {
        let mut args = vec![
            "serve".to_string(),
            "--cache".into(),
            self.setup.cache_arg(),
            "--cache-size".into(),
            self.setup.cache_bytes.to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
        ];
        for (name, path) in stores {
            args.push("--store".into());
            args.push(format!("{name}={}", path.display()));
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    fn both(&self) -> [(&'static str, &Path); 2] {
        [("a", self.setup.backing.as_path()), ("b", self.b.as_path())]
    }

    fn serve(&self, stores: &[(&str, &Path)], extra: &[&str]) -> Server {
        let mut cmd = Command::new(PMCACHE);
        cmd.args(self.args(stores, extra));
        Server::spawn(cmd, self.setup.shm.path())
    }

    fn serve_refused(&self, stores: &[(&str, &Path)], extra: &[&str]) -> Output {
        run(Command::new(PMCACHE).args(self.args(stores, extra)), Duration::from_secs(30))
    }

    /// `pmcache <command> --cache C [--store NAME] [more]`.
    fn pmcache(&self, command: &str, store: Option<&str>, more: &[&str]) -> Output {
        let cache = self.setup.cache_arg();
        let mut args = vec![command, "--cache", &cache];
        if let Some(store) = store {
            args.extend(["--store", store]);
        }
        args.extend(more);
        self.setup.pmcache(&args)
    }

    fn stats(&self, store: &str) -> serde_json::Value {
        let out = self.pmcache("stats", Some(store), &["--json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("stats --json")
    }
}

fn uri(server: &Server, store: &str) -> String {
    format!("nbd://{}/{store}", server.addr())
}

fn io(server: &Server, store: &str, cmds: &[&str]) -> String {
    let cmds: Vec<String> = cmds.iter().map(|c| c.to_string()).collect();
    qemu_io(&uri(server, store), &cmds, Duration::from_secs(60))
}

/// qemu-io expected to fail: its output.
fn io_refused(server: &Server, store: &str, cmd: &str) -> String {
    let out = run(
        Command::new("qemu-io").args(["-f", "raw", &uri(server, store), "-c", cmd]),
        Duration::from_secs(60),
    );
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success() || text.contains("failed"), "qemu-io succeeded: {text}");
    text
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[test]
fn each_store_is_an_export_with_its_own_data_stats_and_detach() {
    let shared = Shared::new("stores");
    let server = shared.serve(&shared.both(), &["--cleaner", "order=none"]);
    // Both exports listed, each the size of its backing store.
    let list = run_ok(
        Command::new("nbdinfo").args(["--list", "--json", &format!("nbd://{}", server.addr())]),
        Duration::from_secs(30),
    );
    let list: serde_json::Value = serde_json::from_str(&list).expect("nbdinfo --json");
    let exports: Vec<(String, u64)> = list["exports"]
        .as_array()
        .expect("exports")
        .iter()
        .map(|e| {
            (e["export-name"].as_str().unwrap().to_string(), e["export-size"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(exports, [("a".to_string(), 32 * MIB), ("b".to_string(), 48 * MIB)]);

    io(&server, "a", &["write -P 0x11 0 1M"]);
    io(&server, "b", &["write -P 0x22 0 1M", "write -P 0x23 40M 64k"]);
    io(&server, "a", &["read -P 0x11 0 1M"]);
    io(&server, "b", &["read -P 0x22 0 1M", "read -P 0x23 40M 64k"]);
    // Past the end of a's device, inside b's: a's export is a's size.
    let out = io_refused(&server, "a", "read 40M 64k");
    assert!(!out.contains("read 65536/65536"), "{out}");

    let (a, b) = (shared.stats("a"), shared.stats("b"));
    assert_eq!((a["dirty_slots"].as_u64(), b["dirty_slots"].as_u64()), (Some(256), Some(272)));
    let all = shared.pmcache("stats", None, &[]);
    let all = text(&all);
    assert!(all.contains("== store a ==") && all.contains("== store b =="), "{all}");
    let out = shared.pmcache("flush", None, &[]);
    assert!(!out.status.success() && text(&out).contains("give --store"), "{}", text(&out));
    let prometheus = text(&shared.pmcache("stats", None, &["--prometheus"]));
    assert!(
        prometheus.contains("pmcache_dirty_slots{store=\"a\"} 256")
            && prometheus.contains("pmcache_dirty_slots{store=\"b\"} 272"),
        "{prometheus}"
    );
    // One store's mode changed: its blocks written back, the other's left dirty.
    let out = shared.pmcache("set", Some("a"), &["mode=writethrough"]);
    assert!(out.status.success(), "{}", text(&out));
    let (a, b) = (shared.stats("a"), shared.stats("b"));
    assert_eq!((a["mode"].as_str(), a["dirty_slots"].as_u64()), (Some("writethrough"), Some(0)));
    assert_eq!((b["mode"].as_str(), b["dirty_slots"].as_u64()), (Some("writeback"), Some(272)));

    // Store a detached: written back, its export gone, b served on.
    let out = shared.pmcache("detach", Some("a"), &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(read_file_at(&shared.setup.backing, 0, 1 << 20), vec![0x11; 1 << 20]);
    let out = io_refused(&server, "a", "read 0 4k");
    assert!(out.contains("no longer served"), "{out}");
    io(&server, "b", &["read -P 0x22 0 1M"]);
    assert_eq!(read_file_at(&shared.b, 0, 4096), vec![0; 4096], "b was written back");

    // kill -9 with b's blocks dirty: each store's cache is recovered on its own.
    server.kill9();
    let server = shared.serve(&shared.both(), &["--cleaner", "order=none"]);
    let logs = server.logs();
    assert!(logs.contains("store \"a\" (clean shutdown)"), "{logs}");
    assert!(logs.contains("store \"b\" (unclean shutdown): 0 clean and 272 dirty"), "{logs}");
    io(&server, "a", &["read -P 0x11 0 1M"]);
    io(&server, "b", &["read -P 0x22 0 1M", "read -P 0x23 40M 64k"]);
    let logs = server.terminate();
    assert!(logs.contains("store \"a\": cache marked clean"), "{logs}");
    assert!(logs.contains("store \"b\": cache marked clean"), "{logs}");
    // The medium is volatile: the stop wrote b back.
    assert_eq!(read_file_at(&shared.b, 40 * MIB, 65536), vec![0x23; 65536]);

    let check = shared.pmcache("check", None, &["--json"]);
    let check: serde_json::Value = serde_json::from_slice(&check.stdout).expect("check --json");
    let stores = check["stores"].as_array().expect("stores");
    assert_eq!(stores.len(), 2);
    assert_eq!(stores[1]["store"], "b");
    assert_eq!(
        (stores[1]["clean_shutdown"].as_bool(), stores[1]["dirty"].as_u64()),
        (Some(true), Some(0))
    );
}

#[test]
fn a_missing_backing_store_is_refused_by_name_and_the_others_served() {
    let shared = Shared::new("stores-missing");
    let server = shared.serve(&shared.both(), &[]);
    io(&server, "a", &["write -P 0x31 0 64k"]);
    io(&server, "b", &["write -P 0x32 0 64k"]);
    server.terminate();

    let moved = shared.b.with_extension("moved");
    std::fs::rename(&shared.b, &moved).expect("move b away");
    let server = shared.serve(&shared.both(), &[]);
    let logs = server.logs();
    assert!(logs.contains("not serving store \"b\": cannot open backing store"), "{logs}");
    io(&server, "a", &["read -P 0x31 0 64k"]);
    let out = io_refused(&server, "b", "read 0 4k");
    assert!(out.contains("export") || out.contains("b"), "{out}");
    assert!(!shared.setup.cache.with_extension("pm.b.ctl").exists());
    server.terminate();

    // A store the cache was not formatted with is refused by name, the others served.
    std::fs::rename(&moved, &shared.b).expect("move b back");
    let c = shared.setup.disk.path().join("c.img");
    std::fs::File::create(&c).and_then(|f| f.set_len(8 * MIB)).expect("backing c");
    let server = shared.serve(&[("a", &shared.setup.backing), ("c", &c)], &[]);
    let logs = server.logs();
    assert!(
        logs.contains("not serving store \"c\": store \"c\" is not on")
            && logs.contains("its stores: a, b"),
        "{logs}"
    );
    assert!(logs.contains("store \"b\" of") && logs.contains("is not served"), "{logs}");
    io(&server, "a", &["read -P 0x31 0 64k"]);
    server.terminate();
    // b's cache was left as it was: it still serves b's data.
    let server = shared.serve(&shared.both(), &[]);
    io(&server, "b", &["read -P 0x32 0 64k"]);
    server.terminate();
}

#[test]
fn a_medium_of_one_store_and_a_shared_one_are_not_taken_for_each_other() {
    let shared = Shared::new("stores-kinds");
    let server = shared.setup.serve(Via::Tcp, &[]);
    server.terminate();
    let out = shared.serve_refused(&shared.both(), &[]);
    assert!(!out.status.success());
    assert!(text(&out).contains("holds the cache of one backing store"), "{}", text(&out));
    std::fs::remove_file(&shared.setup.cache).expect("remove the medium");

    let server = shared.serve(&shared.both(), &[]);
    server.terminate();
    let out = shared.setup.serve_refused(&shared.setup.cache, &[]);
    assert!(!out.status.success());
    assert!(text(&out).contains("is a cache shared by several backing stores"), "{}", text(&out));
    // Names that cannot be a store's are refused before anything is opened.
    let out = shared.serve_refused(&[("a/b", &shared.b)], &[]);
    assert!(text(&out).contains("store name \"a/b\""), "{}", text(&out));
}

/// SIGTERM while the stores of a shared cache start: while the medium is still being formatted,
/// and again as soon as the first store is served, the others still starting. Every store
/// stops and is marked clean, whichever had started when the signal came, and the server
/// exits by itself.
#[test]
fn sigterm_while_the_stores_start_stops_every_store() {
    let shared = Shared::new("stores-early-term");
    let backings: Vec<(String, PathBuf)> = (0..8)
        .map(|i| {
            let path = shared.setup.disk.path().join(format!("s{i}.img"));
            std::fs::File::create(&path).and_then(|f| f.set_len(4 * MIB)).expect("backing");
            (format!("s{i}"), path)
        })
        .collect();
    let stores: Vec<(&str, &Path)> =
        backings.iter().map(|(name, path)| (name.as_str(), path.as_path())).collect();
    let all_marked_clean = |logs: &str| {
        for (name, _) in &backings {
            assert!(logs.contains(&format!("store \"{name}\": cache marked clean")), "{logs}");
        }
    };

    // The signal while the first store's window is formatted, before any store serves.
    let err_path = shared.setup.shm.path().join("early-term.err");
    let err = std::fs::File::create(&err_path).expect("stderr log");
    let mut child = Command::new(PMCACHE)
        .args(shared.args(&stores, &[]))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(err)
        .spawn()
        .expect("pmcache serve");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&err_path).unwrap_or_default().contains("store \"s0\" as a new")
    {
        assert!(child.try_wait().expect("try_wait").is_none(), "exited before formatting");
        assert!(std::time::Instant::now() < deadline, "s0 was never formatted");
        std::thread::sleep(Duration::from_millis(1));
    }
    let pid = child.id().to_string();
    run_ok(Command::new("kill").args(["-TERM", &pid]), Duration::from_secs(10));
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("not stopped: {}", std::fs::read_to_string(&err_path).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let logs = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert!(status.success(), "exited with {status}: {logs}");
    assert!(logs.contains("pmcache: shutting down"), "{logs}");
    all_marked_clean(&logs);

    // The signal at the first store's announcement (`serve` returns then).
    for _ in 0..3 {
        all_marked_clean(&shared.serve(&stores, &[]).terminate());
    }
}

#[test]
fn a_lost_volatile_medium_is_refused_for_the_store_it_held_dirty_blocks_of() {
    let shared = Shared::new("stores-volatile");
    let server = shared.serve(&shared.both(), &["--cleaner", "order=none"]);
    io(&server, "a", &["write -P 0x41 0 64k"]);
    io(&server, "b", &["write -P 0x42 0 64k"]);
    // a is detached (its record: the backing store holds every block); b is not.
    let out = shared.pmcache("detach", Some("a"), &[]);
    assert!(out.status.success(), "{}", text(&out));
    server.kill9();
    std::fs::remove_file(&shared.setup.cache).expect("the medium is lost");
    let out = shared.serve_refused(&shared.both(), &[]);
    assert!(!out.status.success());
    let out = text(&out);
    assert!(out.contains("store \"b\"") && !out.contains("store \"a\":"), "{out}");
    assert!(out.contains("nothing was created"), "{out}");
    assert!(!shared.setup.cache.exists(), "a medium was created");
    // Alone, a is served again on a new cache.
    let server = shared.serve(&[("a", &shared.setup.backing)], &[]);
    io(&server, "a", &["read -P 0x41 0 64k"]);
    server.terminate();
}

/// Each store's mode is its own, and so is its record: store a, served write-through and
/// switched to write-back at run time (`set --store a`), has its record say so before the
/// switch; a lost medium then refuses a by name, and not b, which stayed write-through.
#[test]
fn a_store_switched_to_write_back_is_refused_when_its_volatile_medium_is_lost() {
    let shared = Shared::new("stores-switch");
    let server =
        shared.serve(&shared.both(), &["--mode", "writethrough", "--cleaner", "order=none"]);
    let out = shared.pmcache("set", Some("a"), &["mode=writeback"]);
    assert!(out.status.success(), "{}", text(&out));
    io(&server, "a", &["write -P 0x51 0 1M"]);
    io(&server, "b", &["write -P 0x52 0 1M"]);
    let (a, b) = (shared.stats("a"), shared.stats("b"));
    assert_eq!((a["mode"].as_str(), a["dirty_slots"].as_u64()), (Some("writeback"), Some(256)));
    assert_eq!((b["mode"].as_str(), b["dirty_slots"].as_u64()), (Some("writethrough"), Some(0)));
    server.kill9();
    std::fs::remove_file(&shared.setup.cache).expect("the medium is lost");
    let out = shared.serve_refused(&shared.both(), &["--mode", "writethrough"]);
    assert!(!out.status.success(), "a new cache was served over a's stale backing store");
    let out = text(&out);
    assert!(
        out.contains("store \"a\": refusing to start") && !out.contains("store \"b\":"),
        "{out}"
    );
    assert!(!shared.setup.cache.exists(), "a medium was created");
    // b alone starts on a new cache, its data on its backing store.
    let server = shared.serve(&[("b", &shared.b)], &[]);
    io(&server, "b", &["read -P 0x52 0 1M"]);
    server.terminate();
}

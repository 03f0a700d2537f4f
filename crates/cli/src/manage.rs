//! `pmcache format`, `stats`, `set`, `flush` and `detach` (`check`: `crate::check`).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use pmcache_frontend::units::human;
use pmcache_media::MediumSync;

use pmcache_serve::CacheSpec;
use pmcache_serve::control::{self, default_control_path};
use pmcache_serve::open::open_existing;
use pmcache_serve::serving::store_control_path;

use pmcache_serve::CacheConfig;

use crate::args::{MEDIUM_SYNC_HELP, MediumArgs};

/// `pmcache format`: what a cache records of itself at format — its media and their size,
/// its block size, data checksums, the backing store it caches. How it is then served (mode,
/// policies, I/O engine) is `serve`'s to say, every time.
#[derive(Debug, clap::Args)]
pub struct FormatArgs {
    /// The cache medium: a file on a DAX file system, a device-dax node, or a file in
    /// /dev/shm (emulated PM); any other file only with --medium-sync msync. Created with
    /// --cache-size when missing or empty. Given several times, one medium per NUMA node as
    /// PATH@NODE, the cache is a set of members and each write lands on its writer's node
    /// (docs/NUMA.md); their order does not matter once formatted.
    #[arg(long, required = true, value_name = "PATH[@NODE]")]
    cache: Vec<CacheSpec>,
    /// The backing store: a file, a block device, or a Ceph RBD image as
    /// rbd:POOL[/NAMESPACE]/IMAGE[:id=USER][:conf=PATH][:KEY=VALUE]... (docs/RBD.md).
    #[arg(long)]
    backing: PathBuf,
    #[command(flatten)]
    medium: MediumArgs,
    /// Reformat a medium that is not blank (destroys its contents, dirty blocks included).
    #[arg(long)]
    force: bool,
}

/// Where to find a running server.
#[derive(Debug, clap::Args)]
pub struct ControlArgs {
    /// The cache medium the server runs on, the first given to `serve` (its control socket is
    /// this path + ".ctl"). Without it or --control: the server `pmcache serve` started with
    /// no arguments (its embedded default cache).
    #[arg(long, value_name = "PATH[@NODE]")]
    cache: Option<CacheSpec>,
    /// The control socket, if not the default.
    #[arg(long)]
    control: Option<PathBuf>,
    /// The backing store, on a cache shared by several (`serve --store NAME=PATH`): its
    /// control socket is the cache path + ".NAME.ctl".
    #[arg(long, value_name = "NAME", conflicts_with = "control")]
    store: Option<String>,
}

impl ControlArgs {
    fn cache_path(&self) -> PathBuf {
        self.cache
            .as_ref()
            .map_or_else(|| PathBuf::from(crate::args::DEFAULT_CACHE), |c| c.path.clone())
    }

    /// The control socket of the server (or of the store) asked for. On a cache shared by
    /// several backing stores, a store must be named.
    fn path(&self) -> Result<PathBuf, String> {
        match self.targets()?.as_slice() {
            [(_, path)] => Ok(path.clone()),
            several => {
                let names: Vec<&str> = several.iter().filter_map(|(n, _)| n.as_deref()).collect();
                Err(format!(
                    "{} is shared by several backing stores: give --store with one of {}",
                    self.cache_path().display(),
                    names.join(", ")
                ))
            }
        }
    }

    /// The control sockets asked for, each with its store's name: the one given, or the
    /// cache's; for a cache shared by several backing stores with none named, every store
    /// served.
    fn targets(&self) -> Result<Vec<(Option<String>, PathBuf)>, String> {
        if let Some(control) = &self.control {
            return Ok(vec![(None, control.clone())]);
        }
        let cache = self.cache_path();
        if let Some(store) = &self.store {
            pmcache_engine::stores::check_store_name(store).map_err(|e| e.to_string())?;
            return Ok(vec![(Some(store.clone()), store_control_path(&cache, store))]);
        }
        let plain = default_control_path(&cache);
        let stores = stores_served(&cache);
        if plain.exists() || stores.is_empty() {
            return Ok(vec![(None, plain)]);
        }
        Ok(stores
            .into_iter()
            .map(|name| {
                let path = store_control_path(&cache, &name);
                (Some(name), path)
            })
            .collect())
    }
}

/// The stores of the cache on `cache` that a server serves now: those with a control socket
/// (the cache path + `.NAME.ctl`), by name.
fn stores_served(cache: &Path) -> Vec<String> {
    let Some(file) = cache.file_name().and_then(|f| f.to_str()) else { return Vec::new() };
    let dir = cache.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let prefix = format!("{file}.");
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|name| {
            let store = name.strip_prefix(&prefix)?.strip_suffix(".ctl")?;
            pmcache_engine::stores::check_store_name(store).is_ok().then(|| store.to_owned())
        })
        .collect();
    names.sort();
    names
}

/// `pmcache stats`.
#[derive(Debug, clap::Args)]
pub struct StatsArgs {
    #[command(flatten)]
    server: ControlArgs,
    /// JSON instead of a table.
    #[arg(long, conflicts_with = "prometheus")]
    json: bool,
    /// Prometheus text exposition format.
    #[arg(long)]
    prometheus: bool,
    /// Every counter, one per line, instead of the summary.
    #[arg(long, conflicts_with_all = ["json", "prometheus"])]
    all: bool,
    /// Print again every SECONDS (until interrupted), the screen cleared between.
    #[arg(long, value_name = "SECONDS", conflicts_with_all = ["json", "prometheus"])]
    watch: Option<f64>,
}

/// `pmcache detach`.
#[derive(Debug, clap::Args)]
pub struct DetachArgs {
    /// The cache medium; every member's, for a cache of several, the first as `serve` was
    /// given it (that one names its control socket).
    #[arg(long, required = true, value_name = "PATH[@NODE]")]
    cache: Vec<CacheSpec>,
    /// The backing store (needed when no server is running on the cache).
    #[arg(long)]
    backing: Option<PathBuf>,
    /// Backing-store I/O engine (when no server is running).
    #[arg(long)]
    engine: Option<String>,
    /// How a medium that is neither DAX nor volatile is made durable, when no server is
    /// running: `msync` for a cache served with `--medium-sync msync`.
    #[arg(long, default_value = "auto", value_name = "auto|msync", long_help = MEDIUM_SYNC_HELP)]
    medium_sync: MediumSync,
    /// The control socket, if not the default.
    #[arg(long)]
    control: Option<PathBuf>,
    /// The backing store to detach, on a cache shared by several (`serve --store
    /// NAME=PATH`): it is written back and marked clean, and its export stops, while the
    /// other stores are served on.
    #[arg(long, value_name = "NAME", conflicts_with = "control")]
    store: Option<String>,
    /// Attach although the backing file is another file than the cache's (a copy, a move, a
    /// restore), vouching that it holds the same data (see `serve --backing-moved`).
    #[arg(long)]
    backing_moved: bool,
    /// The attachment state file `serve` keeps for a cache on a volatile medium (see `serve
    /// --state-file`); an offline detach records in it that the backing store holds every
    /// block.
    #[arg(long, value_name = "PATH")]
    state_file: Option<PathBuf>,
    /// The directory of the state records of block devices (see `serve --state-dir`).
    #[arg(long, value_name = "DIR", conflicts_with = "state_file")]
    state_dir: Option<PathBuf>,
}

pub fn format(args: FormatArgs) -> Result<(), String> {
    let config = CacheConfig {
        medium_sync: args.medium.medium_sync,
        cache_size: args.medium.cache_size,
        block_size: args.medium.block_size,
        data_crc: args.medium.data_crc,
        ..CacheConfig::of_media(args.cache, args.backing)
    };
    let engine = pmcache_serve::open::format(&config, args.force)?;
    let layout = engine.layout();
    let members = match layout.members().len() {
        1 => String::new(),
        n => format!(" in {n} members"),
    };
    println!(
        "formatted {}: {} slots of {} B ({}){members} caching {} ({})",
        config.describe(),
        layout.slot_count,
        layout.block_size,
        human(layout.slot_count * u64::from(layout.block_size)),
        config.backing.display(),
        human(engine.size_bytes())
    );
    engine.shutdown().map_err(|e| e.to_string())
}

pub fn stats(args: StatsArgs) -> Result<(), String> {
    let Some(seconds) = args.watch else { return stats_once(&args) };
    if !(seconds.is_finite() && seconds > 0.0) {
        return Err(format!("--watch {seconds}: give a number of seconds above 0"));
    }
    loop {
        print_all("\x1b[2J\x1b[H")?;
        stats_once(&args)?;
        std::thread::sleep(std::time::Duration::from_secs_f64(seconds));
    }
}

fn stats_once(args: &StatsArgs) -> Result<(), String> {
    let targets = args.server.targets()?;
    if let [(_, path)] = targets.as_slice() {
        return print_all(&stats_text(args, path)?);
    }
    // A cache shared by several backing stores: each store's, under its name.
    if args.json {
        let mut all = serde_json::Map::new();
        for (name, path) in &targets {
            all.insert(name.clone().unwrap_or_default(), fetch_stats(path)?);
        }
        return print_all(&format!("{}\n", serde_json::Value::Object(all)));
    }
    if args.prometheus {
        let mut bodies = Vec::with_capacity(targets.len());
        for (name, path) in &targets {
            bodies.push((name.clone().unwrap_or_default(), stats_text(args, path)?));
        }
        return print_all(&label_by_store(&bodies));
    }
    let mut text = String::new();
    for (name, path) in &targets {
        let body = stats_text(args, path)?;
        text += &format!("== store {} ==\n{body}\n", name.as_deref().unwrap_or(""));
    }
    print_all(&text)
}

/// Several stores' Prometheus expositions as one: every sample labelled `store="NAME"`, the
/// samples of a metric grouped under its one `# TYPE` line, as the format wants.
fn label_by_store(bodies: &[(String, String)]) -> String {
    let mut families: Vec<(String, String, Vec<String>)> = Vec::new();
    for (store, body) in bodies {
        let mut family: Option<usize> = None;
        for line in body.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split_whitespace().next().unwrap_or("").to_string();
                let at = families.iter().position(|(n, _, _)| *n == name).unwrap_or_else(|| {
                    families.push((name, line.to_string(), Vec::new()));
                    families.len() - 1
                });
                family = Some(at);
                continue;
            }
            let Some((metric, value)) = line.rsplit_once(' ') else { continue };
            let labelled = match metric.split_once('{') {
                Some((name, labels)) => format!("{name}{{store=\"{store}\",{labels} {value}"),
                None => format!("{metric}{{store=\"{store}\"}} {value}"),
            };
            match family {
                Some(at) => families[at].2.push(labelled),
                None => families.push((String::new(), String::new(), vec![labelled])),
            }
        }
    }
    let mut text = String::new();
    for (_, type_line, samples) in families {
        if !type_line.is_empty() {
            text += &type_line;
            text.push('\n');
        }
        for sample in samples {
            text += &sample;
            text.push('\n');
        }
    }
    text
}

/// One server's (or store's) stats, as its control socket at `path` answers them.
fn fetch_stats(path: &Path) -> Result<serde_json::Value, String> {
    let mut reply = String::new();
    control::request(path, "stats", |line| reply = line.to_string())?;
    serde_json::from_str(&reply).map_err(|e| format!("bad reply {reply:?}: {e}"))
}

/// One server's (or store's) stats as `args` asks to print them.
fn stats_text(args: &StatsArgs, path: &Path) -> Result<String, String> {
    let value = fetch_stats(path)?;
    let object = value.as_object().ok_or("the server's reply is not an object")?;
    let mut text = String::new();
    if args.json {
        text = format!("{value}\n");
    } else if args.prometheus {
        for (name, value) in object {
            if let Some(number) = value.as_f64() {
                let gauge = name.ends_with("slots")
                    || name == "connections_open"
                    || name == "block_size"
                    || name.starts_with("dram")
                    || name == "size_bytes"
                    || name == "backing_failing_ms";
                let kind = if gauge { "gauge" } else { "counter" };
                text += &format!("# TYPE pmcache_{name} {kind}\npmcache_{name} {number}\n");
            }
        }
        text += &member_metrics(object);
        if let Some(mode) = object.get("mode").and_then(|m| m.as_str()) {
            text += &format!(
                "# TYPE pmcache_mode_info gauge\npmcache_mode_info{{mode=\"{mode}\"}} 1\n"
            );
        }
        if let Some(state) = object.get("backing_state").and_then(|m| m.as_str()) {
            text += &format!(
                "# TYPE pmcache_backing_state_info gauge\npmcache_backing_state_info{{state=\"{state}\"}} 1\n"
            );
        }
        if let Some(medium) = object.get("medium").and_then(|m| m.as_str()) {
            text += &format!(
                "# TYPE pmcache_medium_info gauge\npmcache_medium_info{{medium=\"{medium}\"}} 1\n"
            );
        }
    } else if !args.all {
        text = crate::summary::summary(object);
        // Members in a table where there are several (a cache of one medium per node).
        if members_of(object).len() > 1 {
            text += &member_table(object);
        }
    } else {
        for (name, value) in object.iter().filter(|(name, _)| *name != "members") {
            text += &format!("{name:<24} {value}\n");
        }
        text += &member_table(object);
    }
    Ok(text)
}

/// The per-member figures of a stats reply (`members`: one object per member).
fn members_of(object: &serde_json::Map<String, serde_json::Value>) -> &[serde_json::Value] {
    object.get("members").and_then(|m| m.as_array()).map_or(&[], Vec::as_slice)
}

/// Field `name` of a member object, as text (`-` for none).
fn member_field(member: &serde_json::Value, name: &str) -> String {
    match member.get(name) {
        Some(serde_json::Value::Null) | None => "-".into(),
        Some(value) => value.to_string(),
    }
}

/// The members as a table: each one's node, slots, dirty and free slots, and the reads and
/// writes lanes made of it, local (from its node) or remote.
fn member_table(object: &serde_json::Map<String, serde_json::Value>) -> String {
    const COLUMNS: [&str; 9] = [
        "member",
        "node",
        "slots",
        "dirty",
        "free",
        "reads_local",
        "reads_remote",
        "writes_local",
        "writes_remote",
    ];
    let members = members_of(object);
    if members.is_empty() {
        return String::new();
    }
    let mut text = COLUMNS.map(|c| format!("{c:>14}")).join("") + "\n";
    for member in members {
        text += &(COLUMNS.map(|c| format!("{:>14}", member_field(member, c))).join("") + "\n");
    }
    text
}

/// The per-member figures in Prometheus's format, labelled by member and node.
fn member_metrics(object: &serde_json::Map<String, serde_json::Value>) -> String {
    let mut text = String::new();
    for name in
        ["slots", "dirty", "free", "reads_local", "reads_remote", "writes_local", "writes_remote"]
    {
        let kind = if name.starts_with("reads") || name.starts_with("writes") {
            "counter"
        } else {
            "gauge"
        };
        text += &format!("# TYPE pmcache_member_{name} {kind}\n");
        for member in members_of(object) {
            let value = member.get(name).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
            text += &format!(
                "pmcache_member_{name}{{member=\"{}\",node=\"{}\"}} {value}\n",
                member_field(member, "member"),
                member_field(member, "node")
            );
        }
    }
    text
}

/// Prints to stdout; a reader that went away (`| head`) is not an error.
fn print_all(text: &str) -> Result<(), String> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.to_string()),
        _ => Ok(()),
    }
}

fn progress_bar(total: u64) -> ProgressBar {
    let bar = ProgressBar::new(total.max(1));
    bar.set_style(
        ProgressStyle::with_template("writing back {bar:40} {pos}/{len} dirty blocks ({eta})")
            .expect("valid template"),
    );
    bar
}

/// `pmcache set`.
#[derive(Debug, clap::Args)]
pub struct SetArgs {
    #[command(flatten)]
    server: ControlArgs,
    /// Settings to change, `KEY=VALUE`; none lists them. `mode=write-back|write-through|
    /// write-around|pass-through|write-only`: leaving write-back (or write-only) writes every
    /// dirty block back first, with progress, and is refused, the mode unchanged, if that
    /// fails. `admission=always|seq-cutoff=SIZE|n-hit=N`. Any other key is the cleaner's
    /// (`order`, `target_pct`, `queue_depth`, ...: all or none are applied).
    #[arg(value_name = "KEY=VALUE")]
    settings: Vec<String>,
}

pub fn set(args: SetArgs) -> Result<(), String> {
    for pair in &args.settings {
        if pair.split_whitespace().count() != 1 || !pair.contains('=') {
            return Err(format!("{pair:?} is not of the form KEY=VALUE"));
        }
    }
    let command = std::iter::once("set").chain(args.settings.iter().map(String::as_str));
    let command = command.collect::<Vec<_>>().join(" ");
    let mut text = String::new();
    let mut bar: Option<ProgressBar> = None;
    let result = control::request(&args.server.path()?, &command, |line| {
        if let Some(setting) = line.strip_prefix("setting ") {
            let (key, value) = setting.split_once(' ').unwrap_or((setting, ""));
            text += &format!("{key:<20} {value}\n");
        } else if let Some((left, total)) = progress_line(line) {
            let bar = bar.get_or_insert_with(|| progress_bar(total));
            bar.set_position(total.saturating_sub(left));
        } else {
            print_warning(line);
        }
    });
    if let Some(bar) = &bar {
        bar.finish();
    }
    result?;
    print_all(&text)
}

/// `progress LEFT TOTAL`: dirty blocks left of a write-back of `TOTAL`.
fn progress_line(line: &str) -> Option<(u64, u64)> {
    let mut parts = line.split_whitespace();
    match (parts.next(), parts.next(), parts.next()) {
        (Some("progress"), Some(left), Some(total)) => {
            Some((left.parse().unwrap_or(0), total.parse().unwrap_or(0)))
        }
        _ => None,
    }
}

pub fn flush(args: ControlArgs) -> Result<(), String> {
    let mut bar: Option<ProgressBar> = None;
    control::request(&args.path()?, "flush", |line| {
        if let Some((left, total)) = progress_line(line) {
            let bar = bar.get_or_insert_with(|| progress_bar(total));
            bar.set_position(total.saturating_sub(left));
            return;
        }
        if let Some(total) = line.strip_prefix("done ") {
            if let Some(bar) = &bar {
                bar.finish();
            }
            println!("all dirty blocks written back ({total} were dirty)");
        } else {
            print_warning(line);
        }
    })
}

/// A server's `warning TEXT` reply line, on stderr.
fn print_warning(line: &str) {
    if let Some(warning) = line.strip_prefix("warning ") {
        eprintln!("pmcache: warning: {warning}");
    }
}

pub fn detach(args: DetachArgs) -> Result<(), String> {
    let first = &args.cache[0].path;
    let control_path = match &args.store {
        Some(store) => store_control_path(first, store),
        None => args.control.clone().unwrap_or_else(|| default_control_path(first)),
    };
    if std::os::unix::net::UnixStream::connect(&control_path).is_ok() {
        control::request(&control_path, "detach", |line| println!("server: {line}"))?;
        return wait_for_exit(&control_path);
    }
    if let Some(store) = &args.store {
        return Err(format!(
            "no server serves store {store:?} of {} ({} does not answer): a store of a shared \
             cache is detached online — start `pmcache serve --cache {} --store \
             {store}=PATH ...` and detach it then",
            first.display(),
            control_path.display(),
            first.display()
        ));
    }
    let backing = args.backing.clone().ok_or_else(|| {
        format!("no server runs on {}; give --backing to detach the cache offline", first.display())
    })?;
    // A missing medium is named as such, not created by the open below.
    for spec in &args.cache {
        std::fs::metadata(&spec.path).map_err(|e| format!("{}: {e}", spec.path.display()))?;
    }
    let cache_args = CacheConfig {
        medium_sync: args.medium_sync,
        engine: args.engine.clone(),
        backing_moved: args.backing_moved,
        ..CacheConfig::of_media(args.cache.clone(), backing)
    };
    // Attach only, never format: a medium whose superblock page reads blank may still hold
    // dirty entries in its metadata table, which formatting would zero.
    let engine = open_existing(&cache_args, 2)?;
    let dirty = engine.stats().dirty_slots;
    let bar = progress_bar(dirty);
    {
        let mut lane = engine.lane().map_err(|e| e.to_string())?;
        std::thread::scope(|scope| {
            let drain = scope.spawn(|| lane.drain());
            while !drain.is_finished() {
                bar.set_position(dirty.saturating_sub(engine.stats().dirty_slots));
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            drain.join().expect("drain thread panicked")
        })
        .map_err(|e| format!("write-back failed: {e}"))?;
    }
    bar.finish();
    // The backing store is to be used alone: the cache keeps no copy of its blocks, so an
    // attach after it was written without the cache serves none of them.
    let dropped = engine
        .drop_clean_copies()
        .map_err(|e| format!("dropping the cache's clean copies failed: {e}; not detached"))?;
    let left: u64 = engine.member_stats().iter().map(|member| member.dirty).sum();
    if left > 0 {
        return Err(format!(
            "{left} blocks are still dirty after the write-back: not detached (nothing \
             acknowledged is lost)"
        ));
    }
    let uuid = engine.superblock().uuid;
    engine.shutdown().map_err(|e| e.to_string())?;
    engine.backing().disclaim().map_err(|e| format!("{}: {e}", cache_args.describe()))?;
    println!(
        "detached {}: {dirty} dirty blocks written back, {dropped} clean copies dropped, cache \
         marked clean",
        cache_args.describe()
    );
    let state_path = match &args.state_file {
        Some(path) => path.clone(),
        None => pmcache_serve::state::locate(&cache_args.backing, args.state_dir.as_deref())
            .read_path()
            .to_owned(),
    };
    if pmcache_serve::state::mark_backing_complete(&state_path, first, uuid)? {
        println!("{}: the backing store holds every block", state_path.display());
    }
    Ok(())
}

/// Waits for a detaching server to remove its control socket (it does so once the cache is
/// marked clean), however long its write-back takes, showing its progress (the dirty count,
/// polled through `stats`: a bar on a terminal, otherwise a line every few seconds). A socket
/// that stays but no longer answers means the server ended without marking the cache clean:
/// its write-back or flush failed, it was killed, or a second signal stopped it at once.
fn wait_for_exit(control: &Path) -> Result<(), String> {
    const POLL: std::time::Duration = std::time::Duration::from_millis(100);
    const LINE_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
    let started = std::time::Instant::now();
    let terminal = std::io::stdout().is_terminal();
    let mut total: Option<u64> = None;
    let mut bar: Option<ProgressBar> = None;
    let mut last_line = started;
    loop {
        if !control.exists() {
            if let Some(bar) = &bar {
                bar.finish();
            }
            println!(
                "detached: the server wrote every block back, marked the cache clean and \
                 stopped ({:.1} s)",
                started.elapsed().as_secs_f64()
            );
            return Ok(());
        }
        match dirty_slots_of(control) {
            Some(dirty) => {
                let total = *total.get_or_insert(dirty);
                let done = total.saturating_sub(dirty);
                if terminal {
                    bar.get_or_insert_with(|| progress_bar(total)).set_position(done);
                } else if last_line.elapsed() >= LINE_EVERY {
                    last_line = std::time::Instant::now();
                    println!(
                        "detaching: {done} of {total} dirty blocks written back ({:.0} s)",
                        started.elapsed().as_secs_f64()
                    );
                }
            }
            // Gone between the two looks: removed, so detached (the next turn says so).
            None if !control.exists() => {}
            None if std::os::unix::net::UnixStream::connect(control).is_ok() => {}
            None => {
                if let Some(bar) = &bar {
                    bar.abandon();
                }
                return Err("the server stopped without marking the cache clean (its write-back \
                            or its backing store's flush failed, see its log; or it was killed, \
                            or stopped at once by a second signal): nothing acknowledged is \
                            lost, but not every block was written back; start it again (it \
                            recovers the cache) and detach again"
                    .into());
            }
        }
        std::thread::sleep(POLL);
    }
}

/// The dirty count a running server reports through its control socket (`None`: no answer).
fn dirty_slots_of(control: &Path) -> Option<u64> {
    let mut dirty = None;
    control::request(control, "stats", |line| {
        dirty = serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|stats| stats.get("dirty_slots").and_then(serde_json::Value::as_u64));
    })
    .ok()?;
    dirty
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixListener;
    use std::time::{Duration, Instant};

    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Format {
        #[command(flatten)]
        args: FormatArgs,
    }

    /// `format` takes what a cache records of itself, and refuses how it is served.
    #[test]
    fn format_offers_only_what_it_records() {
        let base = ["format", "--cache", "/dev/shm/x.pm", "--backing", "/tmp/b.img"];
        let recorded = [
            &["--cache-size", "64M"][..],
            &["--block-size", "8192"],
            &["--data-crc"],
            &["--medium-sync", "msync"],
            &["--force"],
        ];
        for extra in recorded {
            let argv = base.iter().chain(extra);
            assert!(Format::try_parse_from(argv).is_ok(), "{extra:?} refused");
        }
        for extra in [
            &["--mode", "writeback"][..],
            &["--engine", "psync"],
            &["--eviction", "fifo"],
            &["--admission", "always"],
            &["--placement", "interleave"],
            &["--backing-moved"],
            &["--backing-latency", "2ms"],
        ] {
            let argv = base.iter().chain(extra);
            match Format::try_parse_from(argv) {
                Ok(_) => panic!("format took {extra:?}, which a cache does not record"),
                Err(e) => assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument, "{e}"),
            }
        }
    }

    /// Stores' expositions merged: each sample labelled with its store (beside its own
    /// labels), one `# TYPE` line per metric, its samples together.
    #[test]
    fn prometheus_of_several_stores_labels_each_sample_and_groups_each_metric() {
        let body = |dirty: u32| {
            format!(
                "# TYPE pmcache_dirty_slots gauge\npmcache_dirty_slots {dirty}\n# TYPE \
                 pmcache_mode_info gauge\npmcache_mode_info{{mode=\"writeback\"}} 1\n"
            )
        };
        let merged = label_by_store(&[("a".into(), body(3)), ("b".into(), body(5))]);
        assert_eq!(
            merged,
            "# TYPE pmcache_dirty_slots gauge\n\
             pmcache_dirty_slots{store=\"a\"} 3\n\
             pmcache_dirty_slots{store=\"b\"} 5\n\
             # TYPE pmcache_mode_info gauge\n\
             pmcache_mode_info{store=\"a\",mode=\"writeback\"} 1\n\
             pmcache_mode_info{store=\"b\",mode=\"writeback\"} 1\n"
        );
    }

    /// A control socket that answers `stats` with a dirty count falling by one a call, from
    /// `dirty`, and then, after `for_how_long`, is removed (`clean`) or left unanswered.
    fn fake_detaching_server(
        path: &Path,
        dirty: u64,
        for_how_long: Duration,
        clean: bool,
    ) -> std::thread::JoinHandle<u64> {
        let listener = UnixListener::bind(path).expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let path = path.to_path_buf();
        std::thread::spawn(move || {
            let until = Instant::now() + for_how_long;
            let mut answered = 0u64;
            while Instant::now() < until {
                match listener.accept() {
                    Ok((stream, _)) => {
                        stream.set_nonblocking(false).expect("blocking");
                        let mut line = String::new();
                        let _ = BufReader::new(&stream).read_line(&mut line);
                        if line.trim() == "stats" {
                            let left = dirty.saturating_sub(answered);
                            answered += 1;
                            let _ = writeln!(&stream, "{{\"dirty_slots\":{left}}}");
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
            drop(listener);
            if clean {
                std::fs::remove_file(&path).expect("remove the socket");
            }
            answered
        })
    }

    /// A detach waits as long as the server's write-back takes, polling its progress, and
    /// succeeds when the server removes its control socket.
    #[test]
    fn a_detach_waits_for_the_write_back_with_its_progress_and_succeeds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cache.pm.ctl");
        let server = fake_detaching_server(&path, 1000, Duration::from_millis(1500), true);
        wait_for_exit(&path).expect("detached");
        assert!(server.join().expect("server") >= 5, "the progress was not polled");
    }

    /// A server that ends without removing its socket (its write-back failed) is reported as
    /// such.
    #[test]
    fn a_detach_whose_server_ends_without_marking_the_cache_clean_fails() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cache.pm.ctl");
        let server = fake_detaching_server(&path, 1000, Duration::from_millis(500), false);
        let error = wait_for_exit(&path).expect_err("not detached");
        assert!(error.contains("without marking the cache clean"), "{error}");
        server.join().expect("server");
    }
}

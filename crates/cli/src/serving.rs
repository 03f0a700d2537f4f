//! What both frontends of `pmcache serve` (NBD in `crate::nbd`, ublk in `crate::ublk`) do
//! around serving: open the cache (format or attach, after binding its control socket and
//! checking the state file of a volatile medium), start the cleaner, serve the control socket
//! and stop the frontend on SIGINT or SIGTERM, and at the end write back what must be, mark
//! the cache clean and remove the control socket.

use std::io::IsTerminal;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use pmcache_engine::{CacheMode, Error};
use pmcache_frontend::CacheEngine;
use pmcache_frontend::units::human;
use pmcache_media::{FileSystem, MediumKind};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::args::{DEFAULT_BACKING, DEFAULT_CACHE, ServeArgs, StoreSpec};
use crate::attachment::Attachment;
use crate::cache::{CacheArgs, CacheSpec, Opened, open_or_format};
use crate::control::{self, Frontend, default_control_path};
use crate::state;

const DEFAULT_BACKING_BYTES: u64 = 8 << 30;

fn ensure_default_backing(path: &Path) -> Result<(), String> {
    if path.exists() {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::File::create(path)
        .and_then(|f| f.set_len(DEFAULT_BACKING_BYTES))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// The cache a frontend serves, with what goes with it for as long as it is served: the
/// control socket, the state file of a volatile medium, the cleaner's thread. Both frontends
/// (NBD in `crate::nbd`, ublk in `crate::ublk`) open it, serve, and finish it.
pub(crate) struct Serving {
    /// The engine, for the whole process.
    pub(crate) engine: &'static CacheEngine,
    /// The cache medium's path.
    pub(crate) cache: PathBuf,
    /// The backing store's path.
    pub(crate) backing: PathBuf,
    /// The store's name, on a cache shared by several backing stores.
    pub(crate) store: Option<String>,
    /// The control socket's path.
    pub(crate) control_path: PathBuf,
    control_listener: Option<UnixListener>,
    control_file: RemoveOnDrop,
    state_path: PathBuf,
    /// The state record as the mode changes (`crate::attachment`).
    attachment: Arc<Attachment>,
    uuid: [u8; 16],
    /// The file system of a volatile medium.
    volatile: Option<String>,
    write_back_all: Arc<AtomicBool>,
    cleaner_thread: std::thread::JoinHandle<Option<pmcache_engine::Result<u64>>>,
    detach: Arc<AtomicBool>,
}

impl Serving {
    /// Opens (formats or attaches) the cache of `args` with room for `max_lanes` lanes, after
    /// binding its control socket and calling `before_open`, and starts its cleaner.
    pub(crate) fn open(
        args: &ServeArgs,
        max_lanes: usize,
        before_open: impl FnOnce() -> Result<(), String>,
    ) -> Result<Self, String> {
        let embedded = args.backing.is_none();
        let backing = args.backing.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_BACKING));
        if embedded {
            ensure_default_backing(&backing)?;
        }
        let cache_args = cache_args(args, backing.clone())?;
        let cache = cache_args.cache[0].path.clone();
        let cleaner_config = cleaner_config(args)?;
        // The control socket first: a second server on a live cache is refused before it
        // opens (and so touches) the medium. It is removed only when the cache is marked
        // clean, which is what an online `pmcache detach` waits for.
        let control_path = args.control.clone().unwrap_or_else(|| default_control_path(&cache));
        let control = Control::bind(control_path)?;
        before_open()?;
        // A backing store whose newest blocks may be in a volatile cache that is gone is
        // refused before the medium is opened (or created).
        let state = BackingState::check(args, &backing, &cache)?;
        let (engine, opened) = open_or_format(&cache_args, max_lanes)?;
        report_opened(&cache_args.describe(), &opened);
        let place = Place { cache, backing, store: None };
        Self::start(args, place, engine, control, state, cleaner_config)
    }

    /// [`Serving::open`] for a cache shared by the backing stores of `args.stores`: one
    /// `Serving` per store served, each with its own control socket (the cache path +
    /// `.NAME.ctl`), state record and cleaner. A store refused (its state record, its backing
    /// store, its cache) is named in the messages returned beside them, and the others are
    /// served; an error is about the cache as a whole.
    pub(crate) fn open_stores(
        args: &ServeArgs,
        max_lanes: usize,
        before_open: impl FnOnce() -> Result<(), String>,
    ) -> Result<(Vec<Self>, Vec<String>), String> {
        let cache_args = cache_args(args, args.stores[0].backing.clone())?;
        let cache = cache_args.cache[0].path.clone();
        let cleaner_config = cleaner_config(args)?;
        let mut controls = Vec::with_capacity(args.stores.len());
        for store in &args.stores {
            controls.push(Control::bind(store_control_path(&cache, &store.name))?);
        }
        before_open()?;
        let mut refused = Vec::new();
        let mut checked = Vec::new();
        for (store, control) in args.stores.iter().zip(controls) {
            match BackingState::check(args, &store.backing, &cache) {
                Ok(state) => checked.push((store.clone(), control, state)),
                Err(e) => refused.push(format!("store {:?}: {e}", store.name)),
            }
        }
        let new = crate::cache::before_open(&cache)? != crate::cache::Before::Holding;
        if checked.is_empty() || (new && !refused.is_empty()) {
            if new {
                refused.push(format!(
                    "a new cache is formatted for all its stores at once, so nothing was created \
                     on {}",
                    cache.display()
                ));
            }
            return Err(refused.join("\n"));
        }
        let stores: Vec<StoreSpec> = checked.iter().map(|(store, _, _)| store.clone()).collect();
        let opened = crate::stores::open_or_format(&cache_args, &stores, max_lanes)?;
        let mut servings = Vec::with_capacity(opened.len());
        for (one, (_, control, state)) in opened.into_iter().zip(checked) {
            let (engine, how) = match one.opened {
                Ok(opened) => opened,
                Err(e) => {
                    refused.push(format!("store {:?}: {e}", one.name));
                    continue;
                }
            };
            report_opened(&format!("{} store {:?}", cache.display(), one.name), &how);
            let place = Place { cache: cache.clone(), backing: one.backing, store: Some(one.name) };
            servings.push(Self::start(
                args,
                place,
                engine,
                control,
                state,
                cleaner_config.clone(),
            )?);
        }
        if servings.is_empty() {
            return Err(refused.join("\n"));
        }
        Ok((servings, refused))
    }

    /// Records the attachment of a volatile medium and starts the cleaner of `engine`.
    fn start(
        args: &ServeArgs,
        place: Place,
        engine: CacheEngine,
        control: Control,
        state: BackingState,
        cleaner_config: pmcache_engine::CleanerConfig,
    ) -> Result<Self, String> {
        let Place { cache, backing, store } = place;
        let BackingState { located, overrode } = state;
        // A volatile medium: the attachment is recorded (the backing store possibly stale)
        // before any client can write.
        let kind = crate::cache::kind_of(engine.medium());
        let file_system = FileSystem::of_path(&cache)
            .map(|fs| fs.name)
            .unwrap_or_else(|e| format!("a file system that could not be read ({e})"));
        let volatile = (kind == MediumKind::Volatile).then(|| file_system.clone());
        if kind == MediumKind::Msync {
            eprintln!(
                "pmcache: the cache medium is in msync mode ({file_system}): every persist waits \
                 for msync(MS_SYNC) of its pages, so each write waits for the device"
            );
        }
        let uuid = engine.superblock().uuid;
        let attachment = match &volatile {
            Some(fs) => {
                let may_dirty = matches!(args.mode, CacheMode::WriteBack | CacheMode::WriteOnly)
                    || engine.dirty_slots() > 0;
                let record = state::Record {
                    backing: state::absolute(&backing),
                    backing_id: located.backing_id.clone(),
                    cache: state::absolute(&cache),
                    cache_uuid: uuid,
                    cache_volatile: true,
                    backing_stale: may_dirty,
                    updated_unix_secs: state::now_unix_secs(),
                };
                located.store(&record)?;
                eprintln!(
                    "pmcache: the cache medium is volatile ({fs}: lost at a reboot): a stop \
                     writes every dirty block back first; the attachment is recorded in {}",
                    located.path.display()
                );
                Attachment::recorded(&located.path, record)
            }
            // A record that was overridden would refuse the next start again: it no longer
            // describes this backing store.
            None if overrode => {
                state::remove(located.read_path())?;
                Attachment::unrecorded()
            }
            None => Attachment::unrecorded(),
        };
        // Where the record is now, if there is one.
        let state_path =
            if volatile.is_some() { located.path.clone() } else { located.read_path().to_owned() };
        // The engine lives as long as the process; lanes borrow it from the serving threads.
        let engine: &'static CacheEngine = Box::leak(Box::new(engine));
        let mut cleaner = engine.cleaner(cleaner_config).map_err(|e| format!("cleaner: {e}"))?;
        // Set before the cleaner is stopped when every dirty block is to be written back (a
        // volatile medium, or a detach): the cleaner's thread then does it after its run,
        // through the cleaner's queue, which belongs to that thread.
        let write_back_all = Arc::new(AtomicBool::new(false));
        let cleaner_thread = {
            let write_back_all = write_back_all.clone();
            std::thread::Builder::new()
                .name("pmcache-cleaner".into())
                .spawn(move || {
                    cleaner.run(|note| {
                        if let Some(note) = note {
                            eprintln!("pmcache: {note}; the cleaner runs at a fixed priority");
                        }
                    });
                    write_back_all.load(Ordering::SeqCst).then(|| cleaner.drain())
                })
                .map_err(|e| format!("starting the cleaner: {e}"))?
        };
        Ok(Self {
            engine,
            cache,
            backing,
            store,
            control_path: control.path,
            control_listener: Some(control.listener),
            control_file: control.file,
            state_path,
            attachment: Arc::new(attachment),
            uuid,
            volatile,
            write_back_all,
            cleaner_thread,
            detach: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Serves the control socket and stops `frontend` on SIGINT or SIGTERM (a second signal
    /// ends the process at once).
    pub(crate) fn start_control(&mut self, frontend: impl Frontend) -> Result<(), String> {
        let engine = self.engine;
        if let Some(listener) = self.control_listener.take() {
            let served = control::Served {
                engine,
                frontend: frontend.clone(),
                attachment: self.attachment.clone(),
                detach: self.detach.clone(),
            };
            std::thread::Builder::new()
                .name("pmcache-control".into())
                .spawn(move || control::serve(listener, served))
                .map_err(|e| e.to_string())?;
        }
        let mut signals = Signals::new([SIGINT, SIGTERM]).map_err(|e| e.to_string())?;
        let volatile = self.volatile.is_some();
        let lost = if volatile {
            " (the medium is volatile: a reboot before that start loses the blocks not written \
             back)"
        } else {
            ""
        };
        let then = if volatile {
            "every dirty block is written back (the medium is volatile) and the cache is marked \
             clean"
        } else {
            "the cache is marked clean"
        };
        std::thread::Builder::new()
            .name("pmcache-signals".into())
            .spawn(move || {
                let mut received = signals.forever();
                if received.next().is_some() {
                    eprintln!(
                        "pmcache: shutting down: requests in flight finish, then {then} (a \
                         second SIGINT or SIGTERM stops at once)"
                    );
                    frontend.stop();
                }
                // A shutdown can wait (a client that stopped reading is cut after a grace
                // period; a detach writes everything back): a second signal ends the process
                // at once. Nothing acknowledged is lost by that: every acknowledged write is
                // already durable on the medium, and the next start recovers the cache as
                // after a crash (unclean shutdown).
                if let Some(signal) = received.next() {
                    eprintln!(
                        "pmcache: second signal: stopping at once, without a clean shutdown; \
                         acknowledged writes are on the medium and the next start recovers \
                         them{lost}"
                    );
                    std::process::exit(128 + signal);
                }
            })
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    /// From here the control socket stays unless the cache is marked clean: an online
    /// `pmcache detach` takes its removal for "every block written back and the cache marked
    /// clean", and a socket nobody answers on for a stop without that (an error, or a panic
    /// unwinding through here).
    pub(crate) fn keep_control_socket(&mut self) {
        self.control_file.keep();
    }

    /// After the frontend has stopped (`served` is how): stops the cleaner, writes every
    /// dirty block back if detaching or on a volatile medium, marks the cache clean, removes
    /// the control socket.
    pub(crate) fn finish(self, served: Result<(), String>) -> Result<(), String> {
        let Self { engine, cache, backing, control_path, state_path, uuid, volatile, .. } = self;
        // No mode change from here on (one in progress is done): the record is this stop's.
        self.attachment.stop();
        let label = match &self.store {
            Some(name) => format!("{} store {name:?}", cache.display()),
            None => cache.display().to_string(),
        };
        let detaching = self.detach.load(Ordering::SeqCst);
        let writing_back = detaching || volatile.is_some();
        self.write_back_all.store(writing_back, Ordering::SeqCst);
        let total = engine.dirty_slots();
        engine.stop_cleaner();
        // Every dirty block written back by the cleaner's thread after its run (its queue
        // belongs to that thread), when asked for above; this thread shows the progress.
        if writing_back {
            let started = Instant::now();
            let mut progress = Progress::new(total, &backing);
            while !self.cleaner_thread.is_finished() {
                progress.update(total.saturating_sub(engine.dirty_slots()));
                std::thread::sleep(Duration::from_millis(100));
            }
            progress.finish(total.saturating_sub(engine.dirty_slots()), started.elapsed());
        }
        let written_back = self
            .cleaner_thread
            .join()
            .map_err(|_| "the cleaner thread panicked".to_string())?
            .map(|drained| drained.map_err(|e| e.to_string()));
        match written_back {
            Some(Err(e)) if detaching => {
                return Err(format!(
                    "write-back before detach failed: {e}; the cache keeps its dirty blocks \
                     (nothing acknowledged is lost) and was not marked clean"
                ));
            }
            Some(Err(e)) => {
                return Err(format!(
                    "write-back before stopping failed: {e}; the cache was not marked clean and \
                     keeps its dirty blocks on {} (nothing acknowledged is lost while the medium \
                     lasts), but that medium is volatile ({}): a reboot loses them. Make the \
                     backing store take writes again (a block the cache cannot read back: write \
                     or trim it), then start pmcache again on the same cache (it recovers them) \
                     and stop or detach it",
                    cache.display(),
                    volatile.as_deref().unwrap_or("tmpfs")
                ));
            }
            Some(Ok(_)) | None => {}
        }
        // A detach hands the backing store over to be used alone: the cache keeps no copy of
        // its blocks, so an attach after the store was written without it serves none of them.
        let dropped = if detaching {
            let dropped = when_lanes_closed(|| engine.drop_clean_copies()).map_err(|e| {
                format!(
                    "dropping the cache's clean copies before detach failed: {e}; the cache was \
                     not marked clean (nothing acknowledged is lost)"
                )
            })?;
            let dirty: u64 = engine.member_stats().iter().map(|member| member.dirty).sum();
            if dirty > 0 {
                return Err(format!(
                    "{dirty} blocks are still dirty after the write-back before detach: not \
                     detached, and the cache was not marked clean (nothing acknowledged is lost)"
                ));
            }
            dropped
        } else {
            0
        };
        when_lanes_closed(|| engine.shutdown())
            .map_err(|e| format!("clean shutdown failed: {e}"))?;
        // The backing store holds every block now: recorded before the control socket goes
        // (an online `detach` waits for that).
        let recorded = if written_back.is_some() {
            state::mark_backing_complete(&state_path, &cache, uuid)
        } else {
            Ok(false)
        };
        // No dirty block left (written back, or never any): the cache's claim on the backing
        // store goes, and another cache attaches without a takeover; a stop that leaves dirty
        // blocks keeps it.
        if engine.dirty_slots() == 0
            && let Err(e) = engine.backing().disclaim()
        {
            eprintln!("pmcache: removing this cache's claim on the backing store: {e}");
        }
        // Nothing more goes to the backing store: what it holds for this host (an RBD image's
        // lock) is let go, so another host may attach at once.
        if let Err(e) = engine.backing().release() {
            eprintln!("pmcache: releasing the backing store: {e}");
        }
        let _ = std::fs::remove_file(&control_path);
        let what = match (detaching, written_back.is_some()) {
            (true, _) => {
                format!(" and detached (every block written back, {dropped} clean copies dropped)")
            }
            (false, true) => " (every block written back: the medium is volatile)".to_string(),
            (false, false) => String::new(),
        };
        eprintln!("pmcache: {label}: cache marked clean{what}");
        match recorded {
            Ok(true) => {
                eprintln!("pmcache: {}: the backing store holds every block", state_path.display())
            }
            Ok(false) => {}
            Err(e) => {
                return Err(format!(
                    "{e}; the cache was written back and marked clean, but the state file still \
                     says the backing store may lack blocks: if the medium is lost, start with \
                     --accept-stale-backing"
                ));
            }
        }
        served
    }
}

/// Runs `step`, an engine call that needs every lane dropped, again while lanes are open: the
/// frontend's threads have ended and dropped theirs (the cleaner too), but a control request
/// may still hold one for a moment (for up to a minute).
fn when_lanes_closed<T>(
    mut step: impl FnMut() -> pmcache_engine::Result<T>,
) -> pmcache_engine::Result<T> {
    let mut attempts = 0;
    loop {
        match step() {
            Err(Error::LanesOpen { .. }) if attempts < 600 => {
                attempts += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            done => return done,
        }
    }
}

/// Where a served cache is: its medium, its backing store, and its store's name on a medium
/// shared by several.
struct Place {
    cache: PathBuf,
    backing: PathBuf,
    store: Option<String>,
}

/// A bound control socket, removed when dropped until it is kept.
struct Control {
    path: PathBuf,
    listener: UnixListener,
    file: RemoveOnDrop,
}

impl Control {
    fn bind(path: PathBuf) -> Result<Self, String> {
        let listener = control::bind(&path)?;
        Ok(Self { file: RemoveOnDrop(Some(path.clone())), path, listener })
    }
}

/// The control socket of store `name` of the cache on `cache`: the cache path + `.NAME.ctl`.
pub(crate) fn store_control_path(cache: &Path, name: &str) -> PathBuf {
    let mut path = cache.as_os_str().to_owned();
    path.push(format!(".{name}.ctl"));
    PathBuf::from(path)
}

/// A backing store's state record, checked: where it is, and whether a refusal was
/// overridden by `--accept-stale-backing`.
struct BackingState {
    located: state::Located,
    overrode: bool,
}

impl BackingState {
    fn check(args: &ServeArgs, backing: &Path, cache: &Path) -> Result<Self, String> {
        let located = match &args.state_file {
            Some(path) => state::Located::given(path, backing),
            None => state::locate(backing, args.state_dir.as_deref()),
        };
        if let Some(warning) = &located.warning {
            eprintln!("pmcache: warning: {warning}");
        }
        let overrode = check_state(located.read_path(), cache, args.accept_stale_backing)?;
        Ok(Self { located, overrode })
    }
}

/// The cache options of `args`, over `backing`, with the media's directories checked.
fn cache_args(args: &ServeArgs, backing: PathBuf) -> Result<CacheArgs, String> {
    let caches = if args.cache.is_empty() {
        vec![CacheSpec { path: PathBuf::from(DEFAULT_CACHE), node: None }]
    } else {
        args.cache.clone()
    };
    for spec in &caches {
        if let Some(dir) = spec.path.parent().filter(|d| !d.as_os_str().is_empty())
            && !dir.is_dir()
        {
            return Err(format!(
                "the directory of the cache medium {} does not exist: {}",
                spec.path.display(),
                dir.display()
            ));
        }
    }
    // The first medium given names the cache (its control socket, its state record).
    Ok(CacheArgs {
        cache: caches,
        placement: args.placement,
        medium_sync: args.medium_sync,
        backing,
        cache_size: args.cache_size,
        block_size: args.block_size,
        data_crc: args.data_crc,
        mode: args.mode,
        engine: args.engine.clone(),
        eviction: args.eviction,
        admission: args.admission,
        backing_moved: args.backing_moved,
        backing_latency: args.backing_latency,
    })
}

/// The cleaner's settings of `args`.
fn cleaner_config(args: &ServeArgs) -> Result<pmcache_engine::CleanerConfig, String> {
    let mut config = pmcache_engine::CleanerConfig::default();
    config
        .set_all(args.cleaner.iter().map(String::as_str))
        .map_err(|e| format!("--cleaner: {e}"))?;
    Ok(config)
}

/// The startup report of the cache opened: formatted, or attached with what recovery found.
fn report_opened(cache: &str, opened: &Opened) {
    match opened {
        Opened::Formatted => eprintln!("pmcache: formatted {cache} as a new cache"),
        Opened::Attached(report) => eprintln!(
            "pmcache: attached {} ({} shutdown): {} clean and {} dirty blocks, {} made dirty by the synced rule, {} torn and {} corrupt entries dropped, in {:.1} ms",
            cache,
            if report.was_clean_shutdown { "clean" } else { "unclean" },
            report.clean,
            report.dirty,
            report.clean_made_dirty,
            report.torn,
            report.corrupt,
            report.duration_ns as f64 / 1e6
        ),
    }
    if let Opened::Attached(report) = opened
        && report.lost_entries > 0
    {
        eprintln!(
            "pmcache: {} entries on ranges of the medium recorded lost were not trusted (their \
             blocks were written back before the range was settled, or are older than the \
             backing store's)",
            report.lost_entries
        );
    }
    if let Opened::Attached(report) = opened
        && report.synced_seq_invalid
    {
        eprintln!(
            "pmcache: warning: the synced sequence word was corrupt; taken as 0, so every clean \
             block was made dirty (it will be written back again)"
        );
    }
}

/// Reads the state file and refuses (with what happened, what is lost and how to go on) a
/// backing store whose newest blocks may be in a volatile cache that is gone, or that is
/// still there but is not `cache`. Returns whether a refusal was overridden by
/// `--accept-stale-backing`.
fn check_state(path: &Path, cache: &Path, accept: bool) -> Result<bool, String> {
    let record = match state::load(path) {
        Ok(Some(record)) => record,
        Ok(None) => return Ok(false),
        Err(e) if accept => {
            eprintln!("pmcache: warning: {e}; starting anyway (--accept-stale-backing)");
            return Ok(true);
        }
        Err(e) => {
            return Err(format!(
                "{e}. It records whether the backing store may lack blocks held by a volatile \
                 cache; inspect it, or pass --accept-stale-backing to start anyway"
            ));
        }
    };
    let now = state::probe_medium(&record.cache);
    let same = state::same_file(&record.cache, cache);
    match state::check(&record, now, same) {
        Ok(()) => Ok(false),
        Err(refusal) => {
            let message = state::refusal_message(&refusal, &record, path, cache);
            if !accept {
                return Err(message);
            }
            eprintln!("pmcache: warning: --accept-stale-backing: {message}");
            eprintln!("pmcache: starting anyway: the backing store is served as it is");
            Ok(true)
        }
    }
}

/// Progress of the final write-back (the dirty count, polled) on stderr: a bar on a terminal,
/// otherwise a line at the start, at each quarter and at the end.
struct Progress {
    total: u64,
    bar: Option<ProgressBar>,
    quarters_said: u64,
}

impl Progress {
    fn new(total: u64, backing: &Path) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "pmcache: writing back {bar:40} {pos}/{len} dirty blocks ({eta})",
                )
                .expect("valid template"),
            );
            bar
        });
        if bar.is_none() {
            eprintln!("pmcache: writing back {total} dirty blocks to {}", backing.display());
        }
        Self { total, bar, quarters_said: 0 }
    }

    fn update(&mut self, cleaned: u64) {
        match &self.bar {
            Some(bar) => bar.set_position(cleaned.min(self.total)),
            None if self.total > 0 => {
                let quarters = (cleaned.min(self.total) * 4 / self.total).min(3);
                if quarters > self.quarters_said {
                    self.quarters_said = quarters;
                    eprintln!("pmcache: written back {cleaned} of {} dirty blocks", self.total);
                }
            }
            None => {}
        }
    }

    fn finish(&self, cleaned: u64, took: Duration) {
        if let Some(bar) = &self.bar {
            bar.set_position(cleaned.min(self.total));
            bar.abandon();
        }
        eprintln!(
            "pmcache: write-back ended after {:.1} s: {cleaned} of {} blocks written back",
            took.as_secs_f64(),
            self.total
        );
    }
}

/// Removes a file when dropped (the control socket, on every way out of `run` but those that
/// `keep` it).
struct RemoveOnDrop(Option<PathBuf>);

impl RemoveOnDrop {
    fn keep(&mut self) {
        self.0 = None;
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The startup line: the cache (size, medium kind, slots, mode) in front of its backing store.
pub(crate) fn print_serving(cache: &Path, backing: &Path, engine: &CacheEngine) {
    println!(
        "pmcache: serving {} ({} cache, medium: {}, {} slots of {} B, {}) in front of {} ({})",
        cache.display(),
        human(engine.superblock().geometry.medium_bytes),
        crate::cache::kind_of(engine.medium()),
        engine.superblock().geometry.slot_count,
        engine.block_size(),
        engine.mode(),
        backing.display(),
        human(engine.size_bytes())
    );
}

//! What every frontend (NBD in `crate::nbd`, ublk in `crate::ublk`, vhost-user-blk in
//! `crate::vhost`, or a program serving the engine's lanes itself) does around serving: open
//! the cache (format or attach, after binding its control socket and checking the state file
//! of a volatile medium), start the cleaner, serve the control socket and stop the frontend on
//! SIGINT or SIGTERM, and at the end write back what must be, mark the cache clean and remove
//! the control socket.

use std::io::IsTerminal;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use pmcache_engine::{CacheMode, Error};
use pmcache_frontend::{CacheEngine, ReadLatencies};
use pmcache_media::{FileSystem, MediumKind};

use crate::attachment::Attachment;
use crate::config::{ServeConfig, StoreSpec};
use crate::control::{self, Frontend, default_control_path};
use crate::open::{CacheConfig, Opened, open_or_format};
use crate::state;

/// What a server tells its operator as it starts: the `pmcache` command prints it, a server
/// inside another program may ignore it ([`Silent`]).
pub trait Announce: Send + Sync {
    /// A cache (or one store of a shared cache) is served: `ready` says where and how.
    fn serving(&self, ready: &Ready<'_>) {
        let _ = ready;
    }

    /// An NBD server listens on `addr`, every export of it served.
    fn listening(&self, addr: &pmcache_nbd::ListenAddr) {
        let _ = addr;
    }

    /// A line about the cache's life — formatted or attached, the medium's kind, written
    /// back, marked clean — on stderr unless overridden. Warnings and errors do not come
    /// here: they are always said, or returned.
    fn note(&self, line: &str) {
        eprintln!("pmcache: {line}");
    }

    /// Whether the final write-back draws a progress bar (on stderr, when it is a terminal,
    /// unless overridden) instead of noting its progress a quarter at a time.
    fn progress_bar(&self) -> bool {
        std::io::stderr().is_terminal()
    }
}

/// Announces nothing and notes nothing: a server inside a program that says what it wants
/// itself (warnings are still said on stderr).
pub struct Silent;

impl Announce for Silent {
    fn note(&self, _line: &str) {}

    fn progress_bar(&self) -> bool {
        false
    }
}

/// A cache being served, as [`Announce::serving`] is told of it.
pub struct Ready<'a> {
    /// The cache medium (the first member's path).
    pub cache: &'a Path,
    /// The backing store.
    pub backing: &'a Path,
    /// The store's name, on a cache shared by several backing stores.
    pub store: Option<&'a str>,
    /// The control socket.
    pub control: &'a Path,
    /// The cache.
    pub summary: CacheSummary,
    /// Where the frontend serves it.
    pub frontend: FrontendReady<'a>,
}

/// Where a frontend serves a cache.
pub enum FrontendReady<'a> {
    /// As an NBD export.
    Nbd {
        /// The server's address.
        addr: &'a pmcache_nbd::ListenAddr,
        /// The export's name.
        export: &'a str,
    },
    /// As `/dev/ublkbN`.
    #[cfg(feature = "ublk")]
    Ublk {
        /// The device.
        started: &'a pmcache_ublk::Started,
        /// Its queues and their depth.
        queues: u16,
        /// Tags per queue.
        depth: u16,
        /// The queues' polling budget (`None`: they sleep).
        poll_idle: Option<Duration>,
        /// Whether user recovery was asked for (the kernel may not offer it).
        user_recovery_asked: bool,
    },
    /// As a VM's virtio-blk disk, to a VMM on a vhost-user socket.
    VhostUserBlk {
        /// The socket the VMM connects to.
        socket: &'a Path,
        /// Virtqueues offered.
        queues: u16,
        /// Descriptors per virtqueue, at most.
        queue_size: u16,
        /// Offered read-only.
        read_only: bool,
    },
}

/// A served cache in figures, for the startup line.
#[derive(Clone, Debug)]
pub struct CacheSummary {
    /// The medium's size.
    pub medium_bytes: u64,
    /// The medium's kind (`pmcache_media::MediumKind::name`).
    pub medium_kind: &'static str,
    /// Cache slots.
    pub slots: u64,
    /// The block size.
    pub block_bytes: u32,
    /// The cache mode.
    pub mode: CacheMode,
    /// The size served (the backing store's).
    pub size_bytes: u64,
}

impl CacheSummary {
    /// The summary of `engine`.
    pub fn of(engine: &CacheEngine) -> Self {
        Self {
            medium_bytes: engine.superblock().geometry.medium_bytes,
            medium_kind: crate::open::kind_of(engine.medium()).name(),
            slots: engine.superblock().geometry.slot_count,
            block_bytes: engine.block_size(),
            mode: engine.mode(),
            size_bytes: engine.size_bytes(),
        }
    }
}

/// The cache a frontend serves, with what goes with it for as long as it is served: the
/// control socket, the state file of a volatile medium, the cleaner's thread. Both frontends
/// (NBD in `crate::nbd`, ublk in `crate::ublk`) open it, serve, and finish it; so does a
/// program that embeds the cache and serves the engine's lanes itself (libpmcache,
/// `crates/capi`; docs/EMBEDDING.md).
pub struct Serving {
    /// The engine.
    pub engine: Arc<CacheEngine>,
    /// The cache medium's path.
    pub cache: PathBuf,
    /// The backing store's path.
    pub backing: PathBuf,
    /// The store's name, on a cache shared by several backing stores.
    pub store: Option<String>,
    /// The control socket's path.
    pub control_path: PathBuf,
    control_listener: Option<UnixListener>,
    control_file: RemoveOnDrop,
    /// The control socket's thread, ended by `finish`.
    control_thread: Option<std::thread::JoinHandle<UnixListener>>,
    control_closing: Arc<AtomicBool>,
    announce: Arc<dyn Announce>,
    stop: crate::config::StopHandle,
    /// The read latencies of the frontend's connections or queues, for `pmcache stats`.
    pub latencies: Arc<ReadLatencies>,
    state_path: PathBuf,
    /// The state record as the mode changes (`crate::attachment`).
    attachment: Arc<Attachment>,
    uuid: [u8; 16],
    /// The file system of a volatile medium.
    volatile: Option<String>,
    write_back_all: Arc<AtomicBool>,
    cleaner_thread: std::thread::JoinHandle<Option<pmcache_engine::Result<u64>>>,
    detach: Arc<AtomicBool>,
    /// The backing store's health changes, said in the log; stopped when dropped.
    _health_watch: crate::health::HealthWatch,
}

impl Serving {
    /// Opens (formats or attaches) the cache of `config` with room for `max_lanes` lanes,
    /// after binding its control socket and calling `before_open`, and starts its cleaner.
    pub fn open(
        config: &ServeConfig,
        max_lanes: usize,
        before_open: impl FnOnce() -> Result<(), String>,
        announce: &Arc<dyn Announce>,
    ) -> Result<Self, String> {
        let backing = config.cache.backing.clone();
        let cache_config = checked_media(&config.cache, backing.clone())?;
        let cache = cache_config.cache[0].path.clone();
        // The control socket first: a second server on a live cache is refused before it
        // opens (and so touches) the medium. It is removed only when the cache is marked
        // clean, which is what an online `pmcache detach` waits for.
        let control_path = config.control.clone().unwrap_or_else(|| default_control_path(&cache));
        let control = Control::bind(control_path)?;
        before_open()?;
        // A backing store whose newest blocks may be in a volatile cache that is gone is
        // refused before the medium is opened (or created).
        let state = BackingState::check(config, &backing, &cache)?;
        let (engine, opened) = open_or_format(&cache_config, max_lanes)?;
        report_opened(&**announce, &cache_config.describe(), &opened);
        let place = Place { cache, backing, store: None };
        Self::start(config, place, engine, control, state, announce)
    }

    /// [`Serving::open`] for a cache shared by the backing stores of `config.stores`: one
    /// `Serving` per store served, each with its own control socket (the cache path +
    /// `.NAME.ctl`), state record and cleaner. A store refused (its state record, its backing
    /// store, its cache) is named in the messages returned beside them, and the others are
    /// served; an error is about the cache as a whole.
    pub fn open_stores(
        config: &ServeConfig,
        max_lanes: usize,
        before_open: impl FnOnce() -> Result<(), String>,
        announce: &Arc<dyn Announce>,
    ) -> Result<(Vec<Self>, Vec<String>), String> {
        let Some(first) = config.stores.first() else {
            return Err("a shared cache is served for one store at least".into());
        };
        let cache_config = checked_media(&config.cache, first.backing.clone())?;
        let cache = cache_config.cache[0].path.clone();
        let mut controls = Vec::with_capacity(config.stores.len());
        for store in &config.stores {
            controls.push(Control::bind(store_control_path(&cache, &store.name))?);
        }
        before_open()?;
        let mut refused = Vec::new();
        let mut checked = Vec::new();
        for (store, control) in config.stores.iter().zip(controls) {
            match BackingState::check(config, &store.backing, &cache) {
                Ok(state) => checked.push((store.clone(), control, state)),
                Err(e) => refused.push(format!("store {:?}: {e}", store.name)),
            }
        }
        let new = crate::open::before_open(&cache)? != crate::open::Before::Holding;
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
        let opened = crate::stores::open_or_format(&cache_config, &stores, max_lanes)?;
        let mut servings = Vec::with_capacity(opened.len());
        for (one, (_, control, state)) in opened.into_iter().zip(checked) {
            let (engine, how) = match one.opened {
                Ok(opened) => opened,
                Err(e) => {
                    refused.push(format!("store {:?}: {e}", one.name));
                    continue;
                }
            };
            report_opened(&**announce, &format!("{} store {:?}", cache.display(), one.name), &how);
            let place = Place { cache: cache.clone(), backing: one.backing, store: Some(one.name) };
            servings.push(Self::start(config, place, engine, control, state, announce)?);
        }
        if servings.is_empty() {
            return Err(refused.join("\n"));
        }
        Ok((servings, refused))
    }

    /// Records the attachment of a volatile medium and starts the cleaner of `engine`.
    fn start(
        config: &ServeConfig,
        place: Place,
        engine: CacheEngine,
        control: Control,
        state: BackingState,
        announce: &Arc<dyn Announce>,
    ) -> Result<Self, String> {
        let Place { cache, backing, store } = place;
        let BackingState { located, overrode } = state;
        // A volatile medium: the attachment is recorded (the backing store possibly stale)
        // before any client can write.
        let kind = crate::open::kind_of(engine.medium());
        let file_system = FileSystem::of_path(&cache)
            .map(|fs| fs.name)
            .unwrap_or_else(|e| format!("a file system that could not be read ({e})"));
        let volatile = (kind == MediumKind::Volatile).then(|| file_system.clone());
        config.stop.set_medium_volatile(volatile.is_some());
        if kind == MediumKind::Msync {
            announce.note(&format!(
                "the cache medium is in msync mode ({file_system}): every persist waits for \
                 msync(MS_SYNC) of its pages, so each write waits for the device"
            ));
        }
        let uuid = engine.superblock().uuid;
        let attachment = match &volatile {
            Some(fs) => {
                let may_dirty =
                    matches!(config.cache.mode, CacheMode::WriteBack | CacheMode::WriteOnly)
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
                announce.note(&format!(
                    "the cache medium is volatile ({fs}: lost at a reboot): a stop writes every \
                     dirty block back first; the attachment is recorded in {}",
                    located.path.display()
                ));
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
        let engine = Arc::new(engine);
        // Started first: a cleaner that fails to start stops it again (dropped).
        let label = match &store {
            Some(name) => format!("{} (store {name:?})", backing.display()),
            None => backing.display().to_string(),
        };
        let health_watch = crate::health::HealthWatch::start(engine.clone(), label)?;
        // Set before the cleaner is stopped when every dirty block is to be written back (a
        // volatile medium, or a detach): the cleaner's thread then does it after its run,
        // through the cleaner's queue, which belongs to that thread.
        let write_back_all = Arc::new(AtomicBool::new(false));
        let (started_tx, started) = std::sync::mpsc::sync_channel(1);
        let cleaner_thread = {
            let (engine, write_back_all) = (engine.clone(), write_back_all.clone());
            let config = config.cleaner.clone();
            std::thread::Builder::new()
                .name("pmcache-cleaner".into())
                .spawn(move || {
                    let mut cleaner = match engine.cleaner(config) {
                        Ok(cleaner) => cleaner,
                        Err(e) => {
                            let _ = started_tx.send(Err(format!("cleaner: {e}")));
                            return None;
                        }
                    };
                    let _ = started_tx.send(Ok(()));
                    cleaner.run(|note| {
                        if let Some(note) = note {
                            eprintln!("pmcache: {note}; the cleaner runs at a fixed priority");
                        }
                    });
                    write_back_all.load(Ordering::SeqCst).then(|| cleaner.drain())
                })
                .map_err(|e| format!("starting the cleaner: {e}"))?
        };
        if let Err(e) = started.recv().unwrap_or_else(|_| Err("the cleaner thread ended".into())) {
            let _ = cleaner_thread.join();
            return Err(e);
        }
        Ok(Self {
            engine,
            cache,
            backing,
            store,
            control_path: control.path,
            control_listener: Some(control.listener),
            control_file: control.file,
            control_thread: None,
            control_closing: Arc::new(AtomicBool::new(false)),
            latencies: Arc::new(ReadLatencies::default()),
            announce: announce.clone(),
            stop: config.stop.clone(),
            state_path,
            attachment: Arc::new(attachment),
            uuid,
            volatile,
            write_back_all,
            cleaner_thread,
            detach: Arc::new(AtomicBool::new(false)),
            _health_watch: health_watch,
        })
    }

    /// Serves the control socket, and has `frontend` stopped by the server's stop handle
    /// (SIGINT or SIGTERM, see `crate::signals`, or a library's own stop). A frontend calls
    /// it once it serves the cache; so does a program that serves the engine's lanes itself
    /// (`pmcache stats` then shows `frontend`'s counters, and `pmcache detach` calls its
    /// [`Frontend::stop`]).
    pub fn start_control(&mut self, frontend: impl Frontend) -> Result<(), String> {
        let engine = self.engine.clone();
        if let Some(listener) = self.control_listener.take() {
            let served = control::Served {
                engine,
                latencies: self.latencies.clone(),
                frontend: frontend.clone(),
                attachment: self.attachment.clone(),
                detach: self.detach.clone(),
                closing: self.control_closing.clone(),
            };
            self.control_thread = Some(
                std::thread::Builder::new()
                    .name("pmcache-control".into())
                    .spawn(move || control::serve(listener, served))
                    .map_err(|e| e.to_string())?,
            );
        }
        self.stop.register(move || frontend.stop());
        Ok(())
    }

    /// From here the control socket stays unless the cache is marked clean: an online
    /// `pmcache detach` takes its removal for "every block written back and the cache marked
    /// clean", and a socket nobody answers on for a stop without that (an error, or a panic
    /// unwinding through here). Called once the cache is served, after
    /// [`Serving::start_control`].
    pub fn keep_control_socket(&mut self) {
        self.control_file.keep();
    }

    /// After the frontend has stopped (`served` is how): stops the cleaner, writes every
    /// dirty block back if detaching or on a volatile medium, marks the cache clean, removes
    /// the control socket.
    pub fn finish(self, served: Result<(), String>) -> Result<(), String> {
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
            let mut progress = Progress::new(total, &backing, self.announce.clone());
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
        // The control thread ends (woken by a connection of its own) and hands its listener
        // back; the socket is removed while the listener still takes connections (an online
        // `detach` probing it sees a live server until the file is gone), then closed.
        self.control_closing.store(true, Ordering::SeqCst);
        let listener = self.control_thread.and_then(|thread| {
            let _ = std::os::unix::net::UnixStream::connect(&control_path);
            thread.join().ok()
        });
        let _ = std::fs::remove_file(&control_path);
        drop(listener);
        let what = match (detaching, written_back.is_some()) {
            (true, _) => {
                format!(" and detached (every block written back, {dropped} clean copies dropped)")
            }
            (false, true) => " (every block written back: the medium is volatile)".to_string(),
            (false, false) => String::new(),
        };
        self.announce.note(&format!("{label}: cache marked clean{what}"));
        match recorded {
            Ok(true) => self
                .announce
                .note(&format!("{}: the backing store holds every block", state_path.display())),
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

/// Serves each store of a shared cache on a thread of its own (`serve`: its frontend, until
/// it is stopped), finishes each as its frontend stops, and returns when all are finished:
/// the stores' errors, joined. The ublk and vhost-user-blk frontends serve stores this way.
pub(crate) fn serve_each_store<F>(servings: Vec<Serving>, serve: F) -> Result<(), String>
where
    F: Fn(&mut Serving) -> Result<(), String> + Clone + Send + 'static,
{
    let threads: Vec<_> = servings
        .into_iter()
        .map(|mut serving| {
            let name = serving.store.clone().unwrap_or_default();
            let serve = serve.clone();
            let refused = format!("starting store {name:?}");
            std::thread::Builder::new()
                .name(format!("pmcache-store-{name}"))
                .spawn(move || {
                    let served = serve(&mut serving);
                    serving.finish(served).map_err(|e| format!("store {name:?}: {e}"))
                })
                .map_err(|e| format!("{refused}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let errors: Vec<String> = threads
        .into_iter()
        .filter_map(|thread| match thread.join() {
            Ok(result) => result.err(),
            Err(_) => Some("a store's thread panicked".into()),
        })
        .collect();
    if errors.is_empty() { Ok(()) } else { Err(errors.join("; ")) }
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
pub fn store_control_path(cache: &Path, name: &str) -> PathBuf {
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
    fn check(config: &ServeConfig, backing: &Path, cache: &Path) -> Result<Self, String> {
        let located = match &config.state.file {
            Some(path) => state::Located::given(path, backing),
            None => state::locate(backing, config.state.dir.as_deref()),
        };
        if let Some(warning) = &located.warning {
            eprintln!("pmcache: warning: {warning}");
        }
        let overrode = check_state(located.read_path(), cache, config.state.accept_stale_backing)?;
        Ok(Self { located, overrode })
    }
}

/// The cache of `config` over `backing`, with the media's directories checked.
fn checked_media(config: &CacheConfig, backing: PathBuf) -> Result<CacheConfig, String> {
    if config.cache.is_empty() {
        return Err("no cache medium given".into());
    }
    for spec in &config.cache {
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
    Ok(CacheConfig { backing, ..config.clone() })
}

/// The startup report of the cache opened: formatted, or attached with what recovery found.
fn report_opened(announce: &dyn Announce, cache: &str, opened: &Opened) {
    match opened {
        Opened::Formatted => announce.note(&format!("formatted {cache} as a new cache")),
        Opened::Attached(report) => announce.note(&format!(
            "attached {} ({} shutdown): {} clean and {} dirty blocks, {} made dirty by the synced rule, {} torn and {} corrupt entries dropped, in {:.1} ms",
            cache,
            if report.was_clean_shutdown { "clean" } else { "unclean" },
            report.clean,
            report.dirty,
            report.clean_made_dirty,
            report.torn,
            report.corrupt,
            report.duration_ns as f64 / 1e6
        )),
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
    announce: Arc<dyn Announce>,
}

impl Progress {
    fn new(total: u64, backing: &Path, announce: Arc<dyn Announce>) -> Self {
        let bar = announce.progress_bar().then(|| {
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
            announce.note(&format!("writing back {total} dirty blocks to {}", backing.display()));
        }
        Self { total, bar, quarters_said: 0, announce }
    }

    fn update(&mut self, cleaned: u64) {
        match &self.bar {
            Some(bar) => bar.set_position(cleaned.min(self.total)),
            None if self.total > 0 => {
                let quarters = (cleaned.min(self.total) * 4 / self.total).min(3);
                if quarters > self.quarters_said {
                    self.quarters_said = quarters;
                    let line = format!("written back {cleaned} of {} dirty blocks", self.total);
                    self.announce.note(&line);
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
        self.announce.note(&format!(
            "write-back ended after {:.1} s: {cleaned} of {} blocks written back",
            took.as_secs_f64(),
            self.total
        ));
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

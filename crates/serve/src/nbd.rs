//! The cache served over NBD: an NBD export, one engine lane per client connection, stopped
//! by the control socket or a signal (`crate::serving`).

use std::sync::Arc;
use std::time::Duration;

use pmcache_frontend::CacheExport;
use pmcache_nbd::{ListenAddr, Server, ServerConfig, ShutdownHandle};

use crate::config::ServeConfig;
use crate::control::Frontend;
use crate::serving::{Announce, CacheSummary, FrontendReady, Ready, Serving};

impl Frontend for ShutdownHandle {
    fn stop(&self) {
        self.shutdown();
    }

    fn stats(&self) -> Vec<(&'static str, u64)> {
        let server = ShutdownHandle::stats(self);
        vec![
            ("connections_open", server.connections_open),
            ("connections_accepted", server.connections_accepted),
            ("connections_refused_at_limit", server.connections_refused_at_limit),
            ("connections_dropped_write_timeout", server.connections_dropped_write_timeout),
            ("connections_dropped_idle", server.connections_dropped_idle),
        ]
    }
}

/// Serves the cache of `config` over NBD as `server` says (its address, export name,
/// limits and TLS), until SIGINT or SIGTERM (with `config.stop_on_signals`), a
/// `pmcache detach`, or an error; then stops it (`Serving::finish`). A cache shared by
/// several backing stores is one export per store, named after it.
pub fn serve(
    config: &ServeConfig,
    server: ServerConfig,
    announce: Arc<dyn Announce>,
) -> Result<(), String> {
    crate::signals::stop_on_signals(config)?;
    if !config.stores.is_empty() {
        return serve_stores(config, server, announce);
    }
    // One lane per connection, plus two for control requests (a flush without a cleaner
    // drains through a lane) and the cleaner's.
    let mut serving = Serving::open(
        config,
        server.max_connections + 3,
        || remove_stale_listen_socket(&server.listen),
        &announce,
    )?;
    let engine = serving.engine.clone();
    let export = server.export_name.clone();
    let server =
        Server::bind(server, Arc::new(CacheExport::new(engine.clone(), serving.latencies.clone())))
            .map_err(|e| e.to_string())?;
    serving.start_control(server.shutdown_handle())?;
    let addr = server.local_addr();
    announce.serving(&Ready {
        cache: &serving.cache,
        backing: &serving.backing,
        store: None,
        control: &serving.control_path,
        summary: CacheSummary::of(&engine),
        frontend: FrontendReady::Nbd { addr: &addr, export: &export },
    });
    announce.listening(&addr);
    serving.keep_control_socket();
    let served = server.run().map_err(|e| e.to_string());
    serving.finish(served)
}

/// One export of a server of several (a store of a shared cache): stopping it closes that
/// export alone; the server stops with the last.
#[derive(Clone)]
struct StoreExport {
    handle: ShutdownHandle,
    index: usize,
}

impl Frontend for StoreExport {
    fn stop(&self) {
        self.handle.close_export(self.index);
    }

    fn stats(&self) -> Vec<(&'static str, u64)> {
        let mut stats = Frontend::stats(&self.handle);
        for (name, value) in &mut stats {
            if *name == "connections_open" {
                *value = self.handle.export_connections(self.index);
            }
        }
        stats
    }
}

/// `serve` for a cache shared by several backing stores: one export per store served, each
/// detached (written back, marked clean, its control socket removed) on its own while the
/// others are served; SIGINT or SIGTERM stops them all.
fn serve_stores(
    config: &ServeConfig,
    server: ServerConfig,
    announce: Arc<dyn Announce>,
) -> Result<(), String> {
    let (servings, refused) = Serving::open_stores(
        config,
        server.max_connections + 3,
        || remove_stale_listen_socket(&server.listen),
        &announce,
    )?;
    for why in &refused {
        eprintln!("pmcache: not serving {why}");
    }
    let exports = servings
        .iter()
        .map(|s| {
            (
                s.store.clone().unwrap_or_default(),
                Arc::new(CacheExport::new(s.engine.clone(), s.latencies.clone())),
            )
        })
        .collect();
    let server = Server::bind_exports(server, exports).map_err(|e| e.to_string())?;
    let handle = server.shutdown_handle();
    let addr = server.local_addr();
    let mut finishers = Vec::with_capacity(servings.len());
    for (index, mut serving) in servings.into_iter().enumerate() {
        serving.start_control(StoreExport { handle: handle.clone(), index })?;
        let name = serving.store.clone().unwrap_or_default();
        announce.serving(&Ready {
            cache: &serving.cache,
            backing: &serving.backing,
            store: Some(&name),
            control: &serving.control_path,
            summary: CacheSummary::of(&serving.engine),
            frontend: FrontendReady::Nbd { addr: &addr, export: &name },
        });
        serving.keep_control_socket();
        // The store is finished (written back if it must be, marked clean) once its export
        // is closed and its last connection gone, while the others are served on.
        let handle = handle.clone();
        finishers.push(
            std::thread::Builder::new()
                .name(format!("pmcache-store-{index}"))
                .spawn(move || {
                    while !(handle.is_export_closed(index) && handle.export_connections(index) == 0)
                    {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    serving.finish(Ok(())).map_err(|e| format!("store {name:?}: {e}"))
                })
                .map_err(|e| format!("starting a store's thread: {e}"))?,
        );
    }
    announce.listening(&addr);
    let served = server.run().map_err(|e| e.to_string());
    let mut errors: Vec<String> = served.err().into_iter().collect();
    for finisher in finishers {
        match finisher.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errors.push(e),
            Err(_) => errors.push("a store's thread panicked".into()),
        }
    }
    if errors.is_empty() { Ok(()) } else { Err(errors.join("; ")) }
}

/// [`remove_stale_socket`] for the unix socket an NBD server listens on.
fn remove_stale_listen_socket(listen: &ListenAddr) -> Result<(), String> {
    match listen {
        ListenAddr::Unix(path) => remove_stale_socket(path),
        ListenAddr::Tcp(_) => Ok(()),
    }
}

/// Removes a unix socket left behind by a server that was killed (nothing answers on it), so
/// a restart after a crash can listen again; refuses if a server still answers.
pub(crate) fn remove_stale_socket(path: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else { return Ok(()) };
    if !meta.file_type().is_socket() {
        return Err(format!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        ));
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(format!("{} is in use: another server listens on it", path.display()));
    }
    std::fs::remove_file(path).map_err(|e| format!("{}: {e}", path.display()))
}

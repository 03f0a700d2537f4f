//! `pmcache serve` over NBD: the cache as an NBD export, one engine lane per client
//! connection, stopped by the control socket or a signal (`crate::serving`).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use pmcache_frontend::{CacheEngine, CacheExport};
use pmcache_nbd::{ListenAddr, Server, ServerConfig, ShutdownHandle};

use crate::args::ServeArgs;
use crate::control::Frontend;
use crate::serving::{Serving, print_serving};

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

/// Runs the server until SIGINT, SIGTERM or `pmcache detach`.
pub fn run(args: &ServeArgs) -> Result<(), String> {
    // Mistakes in the arguments are refused before anything is opened (a recovery run and
    // then undone by a refused address would leave a clean cache marked unclean).
    if args.socket.is_none() && !args.listen.ip().is_loopback() && !args.allow_remote {
        return Err(format!(
            "refusing to listen on {}, which is not a loopback address, without --allow-remote \
             (NBD itself authenticates nobody: anyone who reaches the port reads and writes the \
             device unless --tls=require authenticates clients by a key or a certificate)",
            args.listen
        ));
    }
    let tls = args.tls.config()?;
    let listen = match &args.socket {
        Some(path) => ListenAddr::Unix(path.clone()),
        None => ListenAddr::Tcp(args.listen),
    };
    let warning = args.tls.check_remote(&listen, args.allow_remote, args.allow_unauthenticated)?;
    tls.load().map_err(|e| format!("TLS: {e}"))?;
    if !args.stores.is_empty() {
        return run_stores(args, listen, tls, warning);
    }
    // One lane per connection, plus two for control requests (a flush without a cleaner
    // drains through a lane) and the cleaner's.
    let mut serving = Serving::open(args, args.max_connections + 3, || match &args.socket {
        Some(socket) => remove_stale_socket(socket),
        None => Ok(()),
    })?;
    let engine = serving.engine;
    let config =
        ServerConfig { export_name: args.export.clone(), ..server_config(args, listen, tls) };
    if let Some(warning) = warning {
        eprintln!("{warning}");
    }
    let server =
        Server::bind(config, Arc::new(CacheExport::new(engine))).map_err(|e| e.to_string())?;
    serving.start_control(server.shutdown_handle())?;
    let uri = server.local_addr().nbd_uri(&args.export);
    print_how_to_connect(
        &server.local_addr(),
        &args.export,
        &uri,
        &serving.cache,
        &serving.backing,
        engine,
        &serving.control_path,
    );
    if let Some(lines) = args.tls.how_to_connect(&server.local_addr(), &args.export) {
        println!("{lines}");
    }
    println!("{}", args.tls.clients_line(&server.local_addr()));
    serving.keep_control_socket();
    let served = server.run().map_err(|e| e.to_string());
    serving.finish(served)
}

/// The NBD server's configuration from the command line (its export's name aside).
fn server_config(
    args: &ServeArgs,
    listen: ListenAddr,
    tls: pmcache_nbd::TlsConfig,
) -> ServerConfig {
    ServerConfig {
        listen,
        allow_remote: args.allow_remote,
        max_connections: args.max_connections,
        write_timeout: Duration::from_secs_f64(args.write_timeout),
        idle_timeout: (args.idle_timeout > 0.0).then(|| Duration::from_secs_f64(args.idle_timeout)),
        tls,
        ..ServerConfig::default()
    }
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

/// `run` for a cache shared by several backing stores: one export per store served, each
/// detached (written back, marked clean, its control socket removed) on its own while the
/// others are served; SIGINT or SIGTERM stops them all.
fn run_stores(
    args: &ServeArgs,
    listen: ListenAddr,
    tls: pmcache_nbd::TlsConfig,
    warning: Option<String>,
) -> Result<(), String> {
    let (servings, refused) =
        Serving::open_stores(args, args.max_connections + 3, || match &args.socket {
            Some(socket) => remove_stale_socket(socket),
            None => Ok(()),
        })?;
    for why in &refused {
        eprintln!("pmcache: not serving {why}");
    }
    let config = server_config(args, listen, tls);
    if let Some(warning) = warning {
        eprintln!("{warning}");
    }
    let exports = servings
        .iter()
        .map(|s| (s.store.clone().unwrap_or_default(), Arc::new(CacheExport::new(s.engine))))
        .collect();
    let server = Server::bind_exports(config, exports).map_err(|e| e.to_string())?;
    let handle = server.shutdown_handle();
    let addr = server.local_addr();
    let mut finishers = Vec::with_capacity(servings.len());
    for (index, mut serving) in servings.into_iter().enumerate() {
        serving.start_control(StoreExport { handle: handle.clone(), index })?;
        let name = serving.store.clone().unwrap_or_default();
        print_serving(&serving.cache, &serving.backing, serving.engine);
        println!("  store:       {name}");
        println!("  NBD URI:     {}", addr.nbd_uri(&name));
        println!("  stats:       pmcache stats --control {}", serving.control_path.display());
        println!(
            "  detach:      pmcache detach --cache {} --store {name}",
            serving.cache.display()
        );
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
    if let Some(lines) = args.tls.how_to_connect(&addr, "") {
        println!("{lines}");
    }
    println!("{}", args.tls.clients_line(&addr));
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

/// Removes a unix socket left behind by a server that was killed (nothing answers on it), so
/// a restart after a crash can listen again; refuses if a server still answers.
fn remove_stale_socket(path: &Path) -> Result<(), String> {
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

fn print_how_to_connect(
    addr: &ListenAddr,
    export: &str,
    uri: &str,
    cache: &Path,
    backing: &Path,
    engine: &CacheEngine,
    control: &Path,
) {
    print_serving(cache, backing, engine);
    println!("  NBD URI:     {uri}");
    println!("  qemu-io:     qemu-io -f raw {uri}");
    println!("  nbdinfo:     nbdinfo {uri}");
    println!("  nbdfuse:     mkdir -p mnt && nbdfuse mnt/disk {uri} &");
    match addr {
        ListenAddr::Tcp(sock) => println!(
            "  nbd-client:  nbd-client {} {} /dev/nbd0 -N {export}   (needs the kernel nbd module)",
            sock.ip(),
            sock.port()
        ),
        ListenAddr::Unix(path) => println!(
            "  nbd-client:  nbd-client -u {} /dev/nbd0 -N {export}   (needs the kernel nbd module)",
            path.display()
        ),
    }
    println!("  stats:       pmcache stats --control {}", control.display());
    println!(
        "  stop:        Ctrl-C (clean shutdown), or `pmcache detach --cache {}`",
        cache.display()
    );
}

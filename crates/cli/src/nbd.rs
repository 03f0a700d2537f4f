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
    // One lane per connection, plus two for control requests (a flush without a cleaner
    // drains through a lane) and the cleaner's.
    let mut serving = Serving::open(args, args.max_connections + 3, || match &args.socket {
        Some(socket) => remove_stale_socket(socket),
        None => Ok(()),
    })?;
    let engine = serving.engine;
    let config = ServerConfig {
        export_name: args.export.clone(),
        listen,
        allow_remote: args.allow_remote,
        max_connections: args.max_connections,
        write_timeout: Duration::from_secs_f64(args.write_timeout),
        idle_timeout: (args.idle_timeout > 0.0).then(|| Duration::from_secs_f64(args.idle_timeout)),
        tls,
        ..ServerConfig::default()
    };
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

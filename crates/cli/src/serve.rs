//! `pmcache serve`: the flags (`crate::args`) become one `pmcache_serve::ServeConfig` here,
//! which the serving library opens and serves over NBD or, with `--ublk`, as a kernel block
//! device; what it announces is printed here.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use pmcache_frontend::units::human;
use pmcache_nbd::{ListenAddr, ServerConfig};
use pmcache_serve::serving::FrontendReady;
use pmcache_serve::{Announce, CacheSpec, Ready, ServeConfig, StateConfig};

use crate::args::{DEFAULT_BACKING, DEFAULT_CACHE, ServeArgs, cache_config};
use crate::tls::TlsArgs;

/// The size of the backing file `pmcache serve` creates when given none.
const DEFAULT_BACKING_BYTES: u64 = 8 << 30;

/// Runs the server until SIGINT, SIGTERM or `pmcache detach`.
pub fn run(args: ServeArgs) -> Result<(), String> {
    if args.ublk {
        return run_ublk(&args);
    }
    if let Some(socket) = &args.vhost_user_blk {
        let vhost = pmcache_serve::vhost::VhostConfig {
            socket: socket.clone(),
            queues: args.vhost_queues,
            queue_size: args.vhost_queue_size,
            read_only: args.vhost_read_only,
        };
        let config = serve_config(&args)?;
        let announce = Printed { tls: args.tls.clone(), export: String::new() };
        return pmcache_serve::vhost::serve(&config, vhost, Arc::new(announce));
    }
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
    let config = serve_config(&args)?;
    let server = ServerConfig {
        listen,
        export_name: args.export.clone(),
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
    let export = if args.stores.is_empty() { args.export.clone() } else { String::new() };
    let announce = Printed { tls: args.tls.clone(), export };
    pmcache_serve::nbd::serve(&config, server, Arc::new(announce))
}

/// The server's configuration from its flags: the embedded default (a cache in /dev/shm in
/// front of a sparse file under ./pmcache-data, created when missing) where they name none.
pub fn serve_config(args: &ServeArgs) -> Result<ServeConfig, String> {
    let cache = if args.cache.is_empty() {
        vec![CacheSpec { path: PathBuf::from(DEFAULT_CACHE), node: None }]
    } else {
        args.cache.clone()
    };
    let backing = match (&args.backing, args.stores.first()) {
        (Some(backing), _) => backing.clone(),
        (None, Some(store)) => store.backing.clone(),
        (None, None) => {
            let backing = PathBuf::from(DEFAULT_BACKING);
            create_default_backing(&backing)?;
            backing
        }
    };
    let mut cleaner = pmcache_engine::CleanerConfig::default();
    cleaner
        .set_all(args.cleaner.iter().map(String::as_str))
        .map_err(|e| format!("--cleaner: {e}"))?;
    Ok(ServeConfig {
        cache: cache_config(cache, backing, &args.medium, &args.policy),
        stores: args.stores.clone(),
        control: args.control.clone(),
        cleaner,
        state: StateConfig {
            file: args.state_file.clone(),
            dir: args.state_dir.clone(),
            accept_stale_backing: args.accept_stale_backing,
        },
        stop_on_signals: true,
        stop: pmcache_serve::StopHandle::default(),
    })
}

/// Creates the default backing file, a sparse file of [`DEFAULT_BACKING_BYTES`], if missing.
fn create_default_backing(path: &Path) -> Result<(), String> {
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

/// What the server announces, printed on stdout: where each cache is served and how to reach
/// it.
struct Printed {
    tls: TlsArgs,
    /// The export name clients are told to ask for (empty on a cache shared by several
    /// backing stores: each store is an export of its own).
    export: String,
}

impl Announce for Printed {
    fn serving(&self, ready: &Ready<'_>) {
        print_serving(ready);
        if let Some(name) = ready.store {
            println!("  store:       {name}");
        }
        match &ready.frontend {
            FrontendReady::Nbd { addr, export } => print_nbd(ready, addr, export),
            #[cfg(feature = "ublk")]
            FrontendReady::Ublk { started, queues, depth, poll_idle, user_recovery_asked } => {
                crate::ublk::print_device(
                    ready,
                    started,
                    (*queues, *depth),
                    *poll_idle,
                    *user_recovery_asked,
                );
                notify_ready();
            }
            FrontendReady::VhostUserBlk { socket, queues, queue_size, read_only } => {
                print_vhost(ready, socket, *queues, *queue_size, *read_only);
                notify_ready();
            }
        }
    }

    fn listening(&self, addr: &ListenAddr) {
        notify_ready();
        if let Some(lines) = self.tls.how_to_connect(addr, &self.export) {
            println!("{lines}");
        }
        println!("{}", self.tls.clients_line(addr));
    }
}

/// The startup line: the cache (size, medium kind, slots, mode) in front of its backing store.
fn print_serving(ready: &Ready<'_>) {
    let s = &ready.summary;
    println!(
        "pmcache: serving {} ({} cache, medium: {}, {} slots of {} B, {}) in front of {} ({})",
        ready.cache.display(),
        human(s.medium_bytes),
        s.medium_kind,
        s.slots,
        s.block_bytes,
        s.mode,
        ready.backing.display(),
        human(s.size_bytes)
    );
}

/// How to reach an NBD export.
fn print_nbd(ready: &Ready<'_>, addr: &ListenAddr, export: &str) {
    let uri = addr.nbd_uri(export);
    println!("  NBD URI:     {uri}");
    if ready.store.is_some() {
        println!("  stats:       pmcache stats --control {}", ready.control.display());
        println!(
            "  detach:      pmcache detach --cache {} --store {export}",
            ready.cache.display()
        );
        return;
    }
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
    println!("  stats:       pmcache stats --control {}", ready.control.display());
    println!(
        "  stop:        Ctrl-C (clean shutdown), or `pmcache detach --cache {}`",
        ready.cache.display()
    );
}

/// How a VMM reaches a vhost-user-blk socket.
fn print_vhost(ready: &Ready<'_>, socket: &Path, queues: u16, queue_size: u16, read_only: bool) {
    println!(
        "  vhost-user-blk: {} ({queues} virtqueues of up to {queue_size} descriptors{})",
        socket.display(),
        if read_only { ", read-only" } else { "" }
    );
    println!(
        "  qemu:        -object memory-backend-memfd,id=mem,size=<guest RAM>,share=on -machine \
         memory-backend=mem -chardev socket,id=pmc,path={},reconnect-ms=1000 -device \
         vhost-user-blk-pci,chardev=pmc,num-queues={queues}",
        socket.display()
    );
    println!("  stats:       pmcache stats --control {}", ready.control.display());
    if ready.store.is_none() {
        println!(
            "  stop:        Ctrl-C (clean shutdown), or `pmcache detach --cache {}`",
            ready.cache.display()
        );
    }
}

#[cfg(feature = "ublk")]
fn run_ublk(args: &ServeArgs) -> Result<(), String> {
    let config = serve_config(args)?;
    let ublk = pmcache_serve::ublk::UblkConfig {
        queues: args.ublk_queues,
        depth: args.ublk_depth,
        user_recovery: args.ublk_recovery == crate::args::Switch::On,
        poll_idle: args.ublk_poll.then(|| Duration::from_micros(args.ublk_poll_idle_us)),
        recover: args.recover,
    };
    let announce = Printed { tls: args.tls.clone(), export: String::new() };
    pmcache_serve::ublk::serve(&config, ublk, Arc::new(announce))
}

#[cfg(not(feature = "ublk"))]
fn run_ublk(_args: &ServeArgs) -> Result<(), String> {
    Err(UBLK_NOT_BUILT.to_string())
}

/// Why `--ublk` and `pmcache ublk` fail in a build without the `ublk` feature, and how to get
/// one.
#[cfg(not(feature = "ublk"))]
pub const UBLK_NOT_BUILT: &str = "this pmcache was built without the ublk frontend (cargo \
    feature `ublk`, off by default: its kernel bindings are generated at build time with \
    libclang). Build it with `apt-get install -y libclang-dev && cargo build --release -p \
    pmcache-cli --features ublk`, or serve over NBD (`pmcache serve` without --ublk)";

/// Tells the service manager that the server is ready, when it runs as a `Type=notify`
/// systemd unit (`$NOTIFY_SOCKET`, `contrib/pmcache@.service`): units ordered after it (the
/// file systems on its device) start only then.
fn notify_ready() {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let bytes = path.as_encoded_bytes();
    let addr = match bytes.strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name),
        None => SocketAddr::from_pathname(&path),
    };
    let sent = addr
        .and_then(|addr| UnixDatagram::unbound()?.send_to_addr(b"READY=1\nSTATUS=serving", &addr));
    if let Err(e) = sent {
        eprintln!(
            "pmcache: warning: telling the service manager at {path:?} that it is ready: {e}"
        );
    }
}

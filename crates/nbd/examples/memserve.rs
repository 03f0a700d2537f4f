//! Serves a RAM-backed export over NBD, for pointing real clients (qemu-io, nbdinfo, fio)
//! at the server and for the benchmark script.
//!
//! ```text
//! memserve <size> [<ip:port> | <unix socket path>] [--name NAME] [--min-block BYTES]
//!          [--max-connections N] [--allow-remote]
//! ```
//!
//! `size` takes a K/M/G suffix (powers of 1024). The default listener is 127.0.0.1:10809; an
//! argument containing `/` is a unix socket path. Prints `READY <uri>` once listening and
//! shuts down cleanly on SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use pmcache_nbd::{BlockSizes, ListenAddr, MemExport, Server, ServerConfig};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

fn parse_size(s: &str) -> Option<u64> {
    let (digits, shift) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 10),
        b'M' | b'm' => (&s[..s.len() - 1], 20),
        b'G' | b'g' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: memserve <size> [<ip:port> | <socket path>] [--name NAME] [--min-block BYTES] \
         [--max-connections N] [--allow-remote]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_writer(std::io::stderr).init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut config = ServerConfig::default();
    let mut block_sizes = BlockSizes::default();
    let mut size_bytes = None;
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        let value = args.get(i + 1);
        match (arg, value) {
            ("--name", Some(v)) => config.export_name = v.clone(),
            ("--min-block", Some(v)) => match v.parse() {
                Ok(n) => block_sizes.min_bytes = n,
                Err(_) => return usage(),
            },
            ("--max-connections", Some(v)) => match v.parse() {
                Ok(n) => config.max_connections = n,
                Err(_) => return usage(),
            },
            ("--allow-remote", _) => {
                config.allow_remote = true;
                i += 1;
                continue;
            }
            _ if arg.starts_with("--") => return usage(),
            _ if size_bytes.is_none() => match parse_size(arg) {
                Some(n) => size_bytes = Some(n),
                None => return usage(),
            },
            _ if arg.contains('/') => {
                config.listen = ListenAddr::Unix(PathBuf::from(arg));
                i += 1;
                continue;
            }
            _ => match arg.parse::<SocketAddr>() {
                Ok(a) => {
                    config.listen = ListenAddr::Tcp(a);
                    i += 1;
                    continue;
                }
                Err(_) => return usage(),
            },
        }
        i += if arg.starts_with("--") { 2 } else { 1 };
    }
    let Some(size_bytes) = size_bytes else { return usage() };
    let export = match MemExport::new(size_bytes, block_sizes) {
        Ok(e) => Arc::new(e),
        Err(e) => {
            eprintln!("memserve: {e}");
            return ExitCode::FAILURE;
        }
    };
    let name = config.export_name.clone();
    let server = match Server::bind(config, export) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("memserve: {e}");
            return ExitCode::FAILURE;
        }
    };
    let handle = server.shutdown_handle();
    let mut signals = match Signals::new([SIGINT, SIGTERM]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("memserve: cannot install signal handlers: {e}");
            return ExitCode::FAILURE;
        }
    };
    std::thread::spawn(move || {
        if signals.forever().next().is_some() {
            handle.shutdown();
        }
    });
    println!("READY {}", server.local_addr().nbd_uri(&name));
    match server.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("memserve: {e}");
            ExitCode::FAILURE
        }
    }
}

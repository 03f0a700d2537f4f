//! The control socket of a running server: a unix socket speaking one command per connection,
//! one line each way (`stats` → a JSON object; `flush` → `progress <dirty> <total>` lines then
//! `done`; `detach` → write everything back, stop serving, mark the cache clean).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pmcache_nbd::server::ShutdownHandle;

use crate::cache::CacheEngine;

/// Binds the control socket, replacing a stale one (no server answering on it). Anything at
/// the path that is not a socket (a mistyped `--control` naming the medium, or any file) is
/// refused and left alone.
pub fn bind(path: &Path) -> Result<UnixListener, String> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(format!(
                "control socket {} exists and is not a socket; refusing to replace it (choose \
                 another --control path)",
                path.display()
            ));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(format!(
                "{} is in use: another pmcache server runs on this cache",
                path.display()
            ));
        }
        std::fs::remove_file(path).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    UnixListener::bind(path).map_err(|e| format!("control socket {}: {e}", path.display()))
}

/// The engine's statistics as a JSON object.
pub fn stats_json(engine: &CacheEngine) -> serde_json::Value {
    let stats = engine.stats();
    let mut object = serde_json::Map::new();
    for (name, value) in stats.counters() {
        object.insert(name.to_string(), value.into());
    }
    object.insert("block_size".into(), stats.block_size.into());
    object.insert("dram_bytes_per_slot".into(), stats.dram_bytes_per_slot.into());
    object.insert("mode".into(), engine.mode().to_string().into());
    object.insert("size_bytes".into(), engine.size_bytes().into());
    serde_json::Value::Object(object)
}

/// Serves control connections until the process ends.
pub fn serve(
    listener: UnixListener,
    engine: &'static CacheEngine,
    shutdown: ShutdownHandle,
    detach: Arc<AtomicBool>,
) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        if let Err(e) = handle(stream, engine, &shutdown, &detach) {
            eprintln!("pmcache: control connection: {e}");
        }
    }
}

fn handle(
    stream: UnixStream,
    engine: &'static CacheEngine,
    shutdown: &ShutdownHandle,
    detach: &AtomicBool,
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let mut command = String::new();
    reader.read_line(&mut command)?;
    match command.trim() {
        // A connection closed without a command: a liveness probe (`detach` waiting).
        "" => {}
        "stats" => writeln!(writer, "{}", stats_json(engine))?,
        "flush" => {
            let total = engine.stats().dirty_slots;
            let result = std::thread::scope(|scope| {
                let drain = scope.spawn(|| engine.lane().and_then(|mut lane| lane.drain()));
                while !drain.is_finished() {
                    let _ = writeln!(writer, "progress {} {total}", engine.stats().dirty_slots);
                    std::thread::sleep(Duration::from_millis(100));
                }
                drain.join().expect("drain thread panicked")
            });
            match result {
                Ok(()) => writeln!(writer, "done {total}")?,
                Err(e) => writeln!(writer, "error {e}")?,
            }
        }
        "detach" => {
            detach.store(true, Ordering::SeqCst);
            shutdown.shutdown();
            writeln!(writer, "detaching")?;
        }
        other => {
            writeln!(writer, "error unknown command {other:?}; expected stats, flush or detach")?
        }
    }
    Ok(())
}

/// Sends one command to a running server and returns its reply lines through `on_line`.
pub fn request(path: &Path, command: &str, mut on_line: impl FnMut(&str)) -> Result<(), String> {
    let stream = UnixStream::connect(path).map_err(|e| {
        format!("no pmcache server answers on {} ({e}); is it running?", path.display())
    })?;
    let mut writer = stream.try_clone().map_err(|e| e.to_string())?;
    writeln!(writer, "{command}").map_err(|e| e.to_string())?;
    for line in BufReader::new(stream).lines() {
        let line = line.map_err(|e| e.to_string())?;
        if let Some(message) = line.strip_prefix("error ") {
            return Err(message.to_string());
        }
        on_line(&line);
    }
    Ok(())
}

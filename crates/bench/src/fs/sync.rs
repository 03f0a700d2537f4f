//! What OLTP's threads wait on: filebench's `semblock`/`sempost` pair of counters, and a
//! thread's asynchronous writer (`aiowrite`/`aiowait`, glibc's POSIX AIO, which runs them on a thread of its own).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// A `semblock` flowop's semaphore: posts waiting to be consumed (`tokens`) and the posts
/// posters may still make before they block (`credits`, which start at the highwater mark).
/// `semblock value=V` returns V credits, then waits for V tokens and takes them; a blocking
/// `sempost` waits for a credit, takes it and adds a token.
#[derive(Debug)]
pub struct Throttle {
    counts: Mutex<Counts>,
    changed: Condvar,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    tokens: u64,
    credits: u64,
}

impl Throttle {
    /// A semaphore whose posters may run `highwater` posts ahead.
    pub fn new(highwater: u64) -> Self {
        Throttle {
            counts: Mutex::new(Counts { tokens: 0, credits: highwater }),
            changed: Condvar::new(),
        }
    }

    /// `semblock value`: false if `stop` was set while waiting.
    pub fn block(&self, value: u64, stop: &AtomicBool) -> bool {
        let mut counts = self.counts.lock().expect("throttle lock");
        counts.credits += value;
        self.changed.notify_all();
        let Some(mut counts) = self.wait_until(counts, |c| c.tokens >= value, stop) else {
            return false;
        };
        counts.tokens -= value;
        true
    }

    /// A blocking `sempost value=1`: false if `stop` was set while waiting.
    pub fn post(&self, stop: &AtomicBool) -> bool {
        let counts = self.counts.lock().expect("throttle lock");
        let Some(mut counts) = self.wait_until(counts, |c| c.credits > 0, stop) else {
            return false;
        };
        counts.credits -= 1;
        counts.tokens += 1;
        drop(counts);
        self.changed.notify_all();
        true
    }

    /// Waits until `ready` holds of the counts (`None`: `stop` was set first).
    fn wait_until<'a>(
        &self,
        mut counts: MutexGuard<'a, Counts>,
        ready: impl Fn(&Counts) -> bool,
        stop: &AtomicBool,
    ) -> Option<MutexGuard<'a, Counts>> {
        while !ready(&counts) {
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            counts = self
                .changed
                .wait_timeout(counts, Duration::from_millis(50))
                .expect("throttle lock")
                .0;
        }
        Some(counts)
    }

    /// Wakes every waiter (to see the stop flag).
    pub fn wake_all(&self) {
        self.changed.notify_all();
    }
}

/// One queued write.
struct Job {
    file: Arc<File>,
    offset: u64,
    len: usize,
}

/// A thread's asynchronous writer: `submit` queues a write (blocking when `depth` are
/// queued), `wait` returns when all are done. Writes run on one thread of their own in submission
/// order, as glibc's POSIX AIO runs a file's requests.
pub struct AioWriter {
    jobs: Option<SyncSender<Job>>,
    state: Arc<(Mutex<AioState>, Condvar)>,
    writer: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct AioState {
    outstanding: u64,
    error: Option<String>,
}

impl AioWriter {
    /// A writer of up to `depth` queued writes of at most `buffer_len` bytes.
    pub fn new(depth: usize, buffer_len: usize) -> Self {
        let (jobs, queue): (SyncSender<Job>, Receiver<Job>) = sync_channel(depth);
        let state: Arc<(Mutex<AioState>, Condvar)> = Arc::default();
        let writer_state = Arc::clone(&state);
        let writer = std::thread::Builder::new()
            .name("fs-aio".into())
            .spawn(move || {
                let buffer = vec![0x5au8; buffer_len];
                for job in queue {
                    let result = job.file.write_all_at(&buffer[..job.len], job.offset);
                    let (lock, done) = &*writer_state;
                    let mut s = lock.lock().expect("aio lock");
                    if let Err(e) = result {
                        s.error.get_or_insert_with(|| format!("aiowrite: {e}"));
                    }
                    s.outstanding -= 1;
                    drop(s);
                    done.notify_all();
                }
            })
            .expect("spawning the aio writer thread");
        AioWriter { jobs: Some(jobs), state, writer: Some(writer) }
    }

    /// Queues a write of `len` bytes at `offset` of `file`.
    pub fn submit(&self, file: Arc<File>, offset: u64, len: usize) -> Result<(), String> {
        self.state.0.lock().expect("aio lock").outstanding += 1;
        self.jobs
            .as_ref()
            .expect("open")
            .send(Job { file, offset, len })
            .map_err(|_| "aiowrite: the writer thread is gone".to_string())
    }

    /// `aiowait`: until every queued write is done (or `stop`); a write's error.
    pub fn wait(&self, stop: &AtomicBool) -> Result<bool, String> {
        let (lock, done) = &*self.state;
        let mut s = lock.lock().expect("aio lock");
        while s.outstanding > 0 {
            if stop.load(Ordering::Relaxed) {
                return Ok(false);
            }
            s = done.wait_timeout(s, Duration::from_millis(50)).expect("aio lock").0;
        }
        match s.error.take() {
            Some(e) => Err(e),
            None => Ok(true),
        }
    }
}

impl Drop for AioWriter {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn posters_run_highwater_ahead_and_a_block_consumes_its_value() {
        let t = Throttle::new(3);
        let stop = AtomicBool::new(false);
        for _ in 0..3 {
            assert!(t.post(&stop));
        }
        // A fourth post would block: no credit is left until the blocker runs.
        assert_eq!(*t.counts.lock().unwrap(), Counts { tokens: 3, credits: 0 });
        std::thread::scope(|s| {
            let blocker = s.spawn(|| t.block(5, &stop));
            for _ in 0..2 {
                assert!(t.post(&stop), "the block returned 5 credits");
            }
            assert!(blocker.join().unwrap());
        });
        assert_eq!(*t.counts.lock().unwrap(), Counts { tokens: 0, credits: 3 });
        // Stopping frees a waiting poster.
        let t = Throttle::new(0);
        let stop = AtomicBool::new(true);
        assert!(!t.post(&stop));
    }

    #[test]
    fn aiowait_returns_when_the_queued_writes_are_done() {
        let dir = tempfile::tempdir().unwrap();
        let file = Arc::new(File::create(dir.path().join("f")).unwrap());
        let aio = AioWriter::new(4, 4096);
        for i in 0..10 {
            aio.submit(Arc::clone(&file), i * 4096, 4096).unwrap();
        }
        assert!(aio.wait(&AtomicBool::new(false)).unwrap());
        assert_eq!(file.metadata().unwrap().len(), 40960);
    }
}

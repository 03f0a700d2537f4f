//! The cleaner thread's CPU priority (paper 002's adaptive priority): its nice value, set on its
//! own thread id, raised while writers stall and lowered again afterwards.

use rustix::process::{Pid, setpriority_process};
use rustix::thread::gettid;

/// A thread's nice value, changed through `setpriority(PRIO_PROCESS, tid)`, which on Linux
/// applies to that one thread.
pub struct ThreadPriority {
    tid: Pid,
    current: Option<i32>,
}

impl ThreadPriority {
    /// The calling thread.
    pub fn current_thread() -> Self {
        Self { tid: gettid(), current: None }
    }

    /// The thread id.
    pub fn tid(&self) -> i32 {
        self.tid.as_raw_nonzero().get()
    }

    /// Sets the nice value; a no-op when it is already set.
    pub fn set(&mut self, nice: i32) -> Result<(), String> {
        if self.current == Some(nice) {
            return Ok(());
        }
        setpriority_process(Some(self.tid), nice).map_err(|e| {
            format!(
                "setting the cleaner thread's nice value to {nice}: {e} (raising a thread's \
                 priority needs CAP_SYS_NICE or a RLIMIT_NICE that allows it)"
            )
        })?;
        self.current = Some(nice);
        Ok(())
    }

    /// Whether the thread may go from `base` to `boost` and back: tries it.
    pub fn probe(&mut self, base: i32, boost: i32) -> Result<(), String> {
        self.set(boost)?;
        self.set(base)
    }
}

//! The state record (`crate::state`) of a cache being served, kept in step with what the
//! cache may hold while its mode changes at run time (`pmcache set mode=...`, on every
//! frontend and every store of a shared medium alike, each with its own record).
//!
//! - A change after which the cache may take writes the backing store lacks (a switch to
//!   write-back or write-only) is recorded first: `backing_stale=true`, written and synced
//!   with its directory, and only then does the change take effect. If the record cannot be
//!   written, the change is refused and the mode stays as it was.
//! - The backing store is recorded complete (`backing_stale=false`) only in a mode that makes
//!   no dirty block, once the cache holds none: after a switch out of write-back has written
//!   every dirty block back, or a flush in such a mode.
//! - Once the server begins to stop, no mode changes: the stop writes back what it must and
//!   records the outcome itself.
//!
//! One lock orders all of it, so a record never says less than the mode in force allows.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::state;

/// The state record of a served cache, and whether the server is stopping.
pub(crate) struct Attachment {
    kept: Mutex<Kept>,
}

struct Kept {
    /// Where the record is and what it says now; `None` when no record is kept (a medium that
    /// survives a reboot).
    record: Option<(PathBuf, state::Record)>,
    /// The server has begun to stop: the mode no longer changes.
    stopping: bool,
}

impl Attachment {
    /// A cache with no state record (its medium survives a reboot): mode changes need none.
    pub(crate) fn unrecorded() -> Self {
        Self { kept: Mutex::new(Kept { record: None, stopping: false }) }
    }

    /// A cache whose attachment is recorded at `path` as `record` (as written there).
    pub(crate) fn recorded(path: &Path, record: state::Record) -> Self {
        Self {
            kept: Mutex::new(Kept { record: Some((path.to_path_buf(), record)), stopping: false }),
        }
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `change`, after which the cache may hold blocks the backing store lacks, once the
    /// record says the backing store may be stale (written and synced now if it did not say
    /// so). Refused, `change` not run, when the record cannot be written or the server is
    /// stopping.
    pub(crate) fn before_dirtying<T>(&self, change: impl FnOnce() -> T) -> Result<T, String> {
        let mut kept = self.kept();
        if kept.stopping {
            return Err("the server is stopping".into());
        }
        if let Some((path, record)) = &mut kept.record
            && !record.backing_stale
        {
            let stale = state::Record {
                backing_stale: true,
                updated_unix_secs: state::now_unix_secs(),
                ..record.clone()
            };
            state::store(path, &stale).map_err(|e| {
                format!(
                    "{e}: the state record must say that the backing store may lack blocks held \
                     only by the volatile cache before the cache may hold such blocks"
                )
            })?;
            *record = stale;
        }
        Ok(change())
    }

    /// Records the backing store complete if `complete()`, asked under the same lock as every
    /// mode change, says the cache holds no dirty block in a mode that makes none. Returns
    /// whether the record was written.
    pub(crate) fn backing_complete(&self, complete: impl FnOnce() -> bool) -> Result<bool, String> {
        let mut kept = self.kept();
        if kept.stopping {
            return Ok(false);
        }
        let Some((path, record)) = &mut kept.record else { return Ok(false) };
        if !record.backing_stale || !complete() {
            return Ok(false);
        }
        let written_back = state::Record {
            backing_stale: false,
            updated_unix_secs: state::now_unix_secs(),
            ..record.clone()
        };
        state::store(path, &written_back)?;
        *record = written_back;
        Ok(true)
    }

    /// The server begins to stop: from now on the mode does not change (a change in progress
    /// is done once this returns), and the stop records what its write-back achieved.
    pub(crate) fn stop(&self) {
        self.kept().stopping = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(cache: &Path) -> state::Record {
        state::Record {
            backing: PathBuf::from("/srv/backing.img"),
            backing_id: None,
            cache: cache.to_path_buf(),
            cache_uuid: [7; 16],
            cache_volatile: true,
            backing_stale: false,
            updated_unix_secs: 1,
        }
    }

    fn stale(path: &Path) -> bool {
        state::load(path).expect("load").expect("a record").backing_stale
    }

    /// A change that may dirty the cache runs only after the record says so; a record that
    /// cannot be written refuses it; complete only when asked and not stopping.
    #[test]
    fn the_record_says_stale_before_a_dirtying_change_and_complete_only_when_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("backing.img.pmcache-state");
        let record = record(&dir.path().join("cache.pm"));
        state::store(&path, &record).expect("store");
        let attachment = Attachment::recorded(&path, record);

        let seen = attachment.before_dirtying(|| stale(&path)).expect("recorded");
        assert!(seen, "the change ran before the record said stale");
        assert_eq!(attachment.backing_complete(|| false), Ok(false));
        assert!(stale(&path));
        assert_eq!(attachment.backing_complete(|| true), Ok(true));
        assert!(!stale(&path));
        assert_eq!(attachment.backing_complete(|| true), Ok(false), "already complete");

        // The record's path taken by a directory: the rename fails, the change is refused.
        std::fs::remove_file(&path).expect("rm");
        std::fs::create_dir(&path).expect("dir");
        std::fs::write(path.join("keep"), b"x").expect("not empty");
        let mut ran = false;
        let refused = attachment.before_dirtying(|| ran = true).expect_err("refused");
        assert!(!ran && refused.contains(&path.display().to_string()), "{refused}");
        std::fs::remove_dir_all(&path).expect("rm dir");

        attachment.stop();
        assert_eq!(attachment.before_dirtying(|| ()), Err("the server is stopping".into()));
        assert_eq!(attachment.backing_complete(|| true), Ok(false));
        assert!(!path.exists(), "written while stopping");

        let unrecorded = Attachment::unrecorded();
        assert_eq!(unrecorded.before_dirtying(|| 5), Ok(5));
        assert_eq!(unrecorded.backing_complete(|| true), Ok(false));
    }
}

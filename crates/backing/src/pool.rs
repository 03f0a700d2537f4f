//! A fixed pool of kernel contexts (io_uring rings, AIO contexts) for the synchronous calls.
//!
//! The pool is filled at open time and never grows: a thread takes a context for one
//! synchronous request and gives it back; when all are taken, callers wait (backpressure).

use std::ops::{Deref, DerefMut};
use std::sync::{Condvar, Mutex};

/// A bounded set of interchangeable contexts.
pub(crate) struct Pool<T> {
    items: Mutex<Vec<T>>,
    returned: Condvar,
}

impl<T> Pool<T> {
    pub fn new(items: Vec<T>) -> Self {
        assert!(!items.is_empty(), "a pool needs at least one context");
        Self { items: Mutex::new(items), returned: Condvar::new() }
    }

    /// Takes a context, waiting for one to be returned if all are in use.
    pub fn take(&self) -> PoolGuard<'_, T> {
        let mut items = self.items.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(item) = items.pop() {
                return PoolGuard { pool: self, item: Some(item) };
            }
            items = self.returned.wait(items).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A context on loan; returned to the pool on drop.
pub(crate) struct PoolGuard<'a, T> {
    pool: &'a Pool<T>,
    item: Option<T>,
}

impl<T> Deref for PoolGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.item.as_ref().expect("guard holds its item until drop")
    }
}

impl<T> DerefMut for PoolGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.item.as_mut().expect("guard holds its item until drop")
    }
}

impl<T> Drop for PoolGuard<'_, T> {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            self.pool.items.lock().unwrap_or_else(|e| e.into_inner()).push(item);
            self.pool.returned.notify_one();
        }
    }
}

impl<T> std::fmt::Debug for Pool<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let idle = self.items.lock().map_or(0, |items| items.len());
        f.debug_struct("Pool").field("idle", &idle).finish()
    }
}

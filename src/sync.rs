//! Concurrency primitives, swapped for loom's models under `--cfg loom`.
//!
//! Every atomic, cell and thread primitive that takes part in a lock-free protocol is imported
//! from here rather than from `std`, so that `RUSTFLAGS="--cfg loom"` model-checks the real code
//! (the pattern of tokio's `loom` shim). `UnsafeCell` exposes only closure-style `with` /
//! `with_mut` access so that loom can track every read and write of the cell.

#[cfg(loom)]
pub(crate) use loom::{
    hint::spin_loop,
    sync::{
        atomic::{fence, AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering},
        Arc,
    },
    thread::{current as current_thread, park, yield_now, Thread},
};
#[cfg(not(loom))]
pub(crate) use std::{
    hint::spin_loop,
    sync::{
        atomic::{fence, AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering},
        Arc,
    },
    thread::{current as current_thread, park_timeout, yield_now, Thread},
};

/// Parks the current thread for at most `timeout` (loom: until unparked; loom has no timeouts).
#[cfg(loom)]
pub(crate) fn park_timeout(_timeout: std::time::Duration) {
    park();
}

/// `UnsafeCell` with closure-style access (loom's API, mirrored for std).
#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell;

/// `UnsafeCell` with closure-style access (loom's API, mirrored for std).
#[cfg(not(loom))]
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    /// Wraps `value`.
    pub(crate) const fn new(value: T) -> Self {
        Self(std::cell::UnsafeCell::new(value))
    }

    /// Gives `f` a shared raw pointer to the contents.
    #[inline(always)]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    /// Gives `f` a mutable raw pointer to the contents.
    #[inline(always)]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

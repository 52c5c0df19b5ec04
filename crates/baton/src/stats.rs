//! Request and event counters, for benchmarks and the no-herd tests.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters, shared by everything one backend does.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) requests: AtomicU64,
    pub(crate) renewals: AtomicU64,
    pub(crate) watch_events: AtomicU64,
    pub(crate) wakeups: AtomicU64,
    pub(crate) predecessor_watches: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Requests sent to the backend: unary calls, watch creations, lease grants and revokes.
    pub requests: u64,
    /// Lease renewals sent, and renewal streams opened.
    pub renewals: u64,
    /// Watch events received.
    pub watch_events: u64,
    /// Times a waiting candidate was woken because its predecessor went away.
    pub wakeups: u64,
    /// Watches placed by waiting candidates on the entry ahead of them (once a waiter has
    /// one, it is queued; a watch placed again, after a broken one or a new campaign, counts
    /// again).
    pub predecessor_watches: u64,
}

impl Stats {
    pub(crate) fn request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            renewals: self.renewals.load(Ordering::Relaxed),
            watch_events: self.watch_events.load(Ordering::Relaxed),
            wakeups: self.wakeups.load(Ordering::Relaxed),
            predecessor_watches: self.predecessor_watches.load(Ordering::Relaxed),
        }
    }
}

//! Maps tokio's monotonic clock onto the cores' [`baton_core::Instant`].

use baton_core::Instant;

/// A clock origin. Each backend takes its own, so that tests running under tokio's paused clock
/// in different runtimes never compare instants from different timelines.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    origin: tokio::time::Instant,
}

impl Clock {
    pub(crate) fn new() -> Clock {
        Clock {
            origin: tokio::time::Instant::now(),
        }
    }

    /// Now, for the cores.
    pub(crate) fn now(self) -> Instant {
        self.to_core(tokio::time::Instant::now())
    }

    pub(crate) fn to_core(self, at: tokio::time::Instant) -> Instant {
        let nanos = at.saturating_duration_since(self.origin).as_nanos();
        Instant::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    pub(crate) fn to_tokio(self, at: Instant) -> tokio::time::Instant {
        self.origin + at.since_origin()
    }
}

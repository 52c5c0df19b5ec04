//! A monotonic instant supplied by the caller.

use std::ops::{Add, Sub};
use std::time::Duration;

/// A point on some monotonic clock, counted in nanoseconds from an origin the caller chooses.
///
/// Cores only compare instants and add durations to them; they never ask what time it is. The
/// driver maps its own clock (tokio's, or a simulator's) onto this type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant {
    nanos: u64,
}

impl Instant {
    /// The origin of the clock.
    pub const ZERO: Instant = Instant { nanos: 0 };

    /// An instant `nanos` nanoseconds after the origin.
    pub const fn from_nanos(nanos: u64) -> Instant {
        Instant { nanos }
    }

    /// An instant `millis` milliseconds after the origin.
    pub const fn from_millis(millis: u64) -> Instant {
        Instant {
            nanos: millis.saturating_mul(1_000_000),
        }
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.nanos
    }

    /// Time elapsed since the origin.
    pub const fn since_origin(self) -> Duration {
        Duration::from_nanos(self.nanos)
    }

    /// Time from `earlier` to `self`, or zero when `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.nanos.saturating_sub(earlier.nanos))
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;

    /// Saturates at the end of time rather than wrapping: a deadline that far away is "never".
    fn add(self, rhs: Duration) -> Instant {
        let add = u64::try_from(rhs.as_nanos()).unwrap_or(u64::MAX);
        Instant {
            nanos: self.nanos.saturating_add(add),
        }
    }
}

impl Sub<Instant> for Instant {
    type Output = Duration;

    fn sub(self, rhs: Instant) -> Duration {
        self.saturating_duration_since(rhs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let t = Instant::from_millis(5);
        assert_eq!(t + Duration::from_millis(5), Instant::from_millis(10));
        assert_eq!(Instant::from_millis(3) - t, Duration::ZERO);
        assert_eq!(t - Instant::from_millis(3), Duration::from_millis(2));
        assert_eq!(
            Instant::from_nanos(u64::MAX - 1) + Duration::from_secs(1),
            Instant::from_nanos(u64::MAX)
        );
    }
}

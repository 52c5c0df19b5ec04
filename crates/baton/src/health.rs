//! [`LeaseHealth`]: what a health check needs to know of the lease under a leadership.

use std::time::Duration;

use crate::lease_driver::LeaseWatch;

/// The lease under a [`Leadership`](crate::Leadership), as a health check sees it: whether it
/// is live, and how long renewals have gone unacknowledged. From
/// [`Leadership::lease_health`](crate::Leadership::lease_health).
///
/// Cheap to clone and `Send`; it only reads what the lease driver publishes, so it never blocks
/// and never talks to the backend. It outlives the leadership it came from (and then reports
/// the lease, which other elections may share).
///
/// A leader whose renewals stall is still safe (it stops at its local deadline), but it is
/// about to lose: a health check should say so before the lease runs out. This is the rule of
/// client-go's leader-election `HealthzAdaptor` (unhealthy when the last renewal is older than
/// the renew interval plus a tolerance), which `baton run --metrics` serves on `/healthz`:
///
/// ```
/// fn check(lease: &baton::LeaseHealth) -> Result<(), String> {
///     if !lease.is_live() {
///         return Err("the lease is over".into());
///     }
///     let age = lease.since_last_renewal();
///     let limit = 2 * lease.renew_interval();
///     if age > limit {
///         return Err(format!("renewals stalled for {age:?} (limit {limit:?})"));
///     }
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone)]
pub struct LeaseHealth {
    lease: LeaseWatch,
}

impl LeaseHealth {
    pub(crate) fn new(lease: LeaseWatch) -> LeaseHealth {
        LeaseHealth { lease }
    }

    /// Whether the lease is live: not over, and before its local deadline (counting time the
    /// host spent suspended).
    pub fn is_live(&self) -> bool {
        self.lease.is_live()
    }

    /// Time since the *send* of the latest acknowledged grant or renewal, which is what the
    /// local deadline counts from, on the lease's clock (it counts time the host spent
    /// suspended). While renewals are answered it stays below the renew interval plus a round
    /// trip; while they stall it grows until the lease ends, a TTL (less drift and the safety
    /// margin) after that send.
    pub fn since_last_renewal(&self) -> Duration {
        self.lease.since_acknowledged_send()
    }

    /// How often the lease is renewed.
    pub fn renew_interval(&self) -> Duration {
        self.lease.record.renew_interval
    }
}

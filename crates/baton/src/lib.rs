//! baton: leader election that is safe by construction.
//!
//! Campaign for an [`Election`], get a [`Leadership`] with a fencing token, learn of loss
//! *before* any rival can win ([`Leadership::lost`]), resign, and observe the current leader.
//!
//! Two rules make it safe:
//! 1. A holder stops acting at a local deadline measured on its own clock from the send time of
//!    its last acknowledged renewal, shrunk for clock drift and a safety margin, so it stops
//!    before the server could expire its lease and let a rival win. That clock counts time the
//!    host spent suspended (`CLOCK_BOOTTIME`), as the server's lease does.
//! 2. Every leadership carries a fencing token that strictly increases per election; resources
//!    admit only tokens at least as high as any they have seen ([`Fence`],
//!    [`Leadership::guarded_put`]).
//!
//! The decisions are made by the sans-IO cores in `baton-core`; this crate is the tokio driver
//! and the backends (etcd v3, feature `etcd`, on by default). It never blocks a runtime thread
//! and never reports leadership it does not hold.
#![warn(missing_docs)]

mod backend;
mod clock;
mod election;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
mod health;
pub mod metrics;
mod session;
mod stats;
mod url;
#[cfg(feature = "etcd")]
mod watch_hub;

pub use backend::Backend;
pub use baton_core::{
    format_duration, parse_duration, ElectionConfig, Fence, LossReason, StaleToken,
};
pub use election::{Candidacy, Election, LeaderInfo, Leadership, Observer};
pub use error::{Error, Result};
pub use health::LeaseHealth;
pub use stats::StatsSnapshot;
pub use url::BackendUrl;

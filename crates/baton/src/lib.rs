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
//! and the backends (etcd v3, feature `etcd`; ZooKeeper, feature `zookeeper`; PostgreSQL,
//! feature `postgres`; all three on by default).
//! It never blocks a runtime thread and never reports leadership it does not hold.
#![warn(missing_docs)]

mod backend;
mod clock;
mod driver;
mod election;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
mod fenced;
mod health;
mod lease_driver;
mod memory;
pub mod metrics;
#[cfg(feature = "postgres")]
pub mod postgres;
mod runner;
pub mod shards;
mod stats;
mod url;
#[cfg(feature = "zookeeper")]
mod zookeeper;

pub use backend::Backend;
pub use baton_core::{
    format_duration, parse_duration, BackendLimits, ConfigError, DurationError, ElectionConfig,
    Fence, LossReason, StaleToken,
};
pub use election::{
    Candidacy, CandidateOptions, Election, LeaderInfo, Leadership, Observed, Observer,
};
pub use error::{Error, Result};
pub use fenced::{FencedCompare, FencedOp, FencedTxn, FencedTxnResponse};
pub use health::LeaseHealth;
pub use memory::MemoryStore;
pub use runner::{Runner, Stopped};
pub use stats::StatsSnapshot;

/// The README's examples, compiled and run as doctests (they read `BATON_BACKEND`).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
pub use url::BackendUrl;

//! Sans-IO cores of baton.
//!
//! This crate holds the logic that decides *when* a leader must stop acting and *whether* a
//! fencing token may be admitted. It never reads a clock, opens a socket, spawns a task or draws
//! an unseeded random number: time arrives as an [`Instant`] argument and everything the outside
//! world must do leaves as an `Action` value. The same code therefore runs in production (driven by
//! `baton`'s tokio driver), under a paused clock in tests, and inside `baton lab`'s simulator.
//!
//! The pieces:
//! - [`LeaseCore`]: one lease (etcd lease, ZooKeeper session, ...) and safety rule 1, the local
//!   deadline measured from the send time of the last acknowledged renewal.
//! - [`Candidate`]: one campaign in one election: create a key, queue behind the predecessor,
//!   lead, lose or resign, optionally requeue.
//! - [`Fence`]: safety rule 2, the resource side of fencing tokens.
//! - [`ElectionConfig`]: the knobs, with [`ElectionConfig::validate`].
//! - [`shards::assign`]: which member owns which shard (balanced rendezvous hashing).
//! - [`parse_duration`]: the `500ms` / `2s` / `1m` syntax shared by every command-line flag.
#![warn(missing_docs)]

mod candidate;
mod config;
mod duration;
mod fence;
mod lease;
pub mod shards;
mod time;

pub use candidate::{Action as CandidateAction, Candidate, CandidateState, LossReason};
pub use config::{BackendLimits, ConfigError, ElectionConfig};
pub use duration::{format_duration, parse_duration, DurationError};
pub use fence::{Fence, StaleToken};
pub use lease::{Action as LeaseAction, LeaseCore, LeaseState};
pub use time::Instant;

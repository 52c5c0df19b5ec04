//! baton lab: bully, ring, Raft-style and lease election under identical faults.
//!
//! The part of baton that shows, with numbers and pictures, why the textbook election
//! algorithms are rarely used and what the lease-plus-fencing recipe buys.
//!
//! - [`model`]: the four algorithms as sans-IO state machines (the lease recipe runs
//!   `baton_core`'s own [`baton_core::LeaseCore`] and [`baton_core::Candidate`]).
//! - [`sim`]: the deterministic simulator (seeded randomness, virtual time, lossy network,
//!   partitions, crashes, pauses, clock drift) with per-step safety checks.
//! - [`scenario`]: the fault vocabulary and the named built-in scenarios.
//! - [`checker`]: safety properties and measurements over a recorded trace.
//! - [`report`]: the terminal table and the HTML report with timeline charts.
//! - [`LabArgs`] and [`run()`]: the `baton lab` command.
//!
//! This crate never reads a clock, touches the network or draws an unseeded random number:
//! the same arguments give byte-identical output.
#![warn(missing_docs)]

pub mod checker;
mod cli;
pub mod model;
pub mod report;
pub mod rng;
pub mod run;
pub mod scenario;
pub mod sim;

pub use cli::{run, run_to, LabArgs, LabError, DEFAULT_SEED};

//! baton lab: bully, ring, Raft-style and lease election under identical faults.
//!
//! Everything here is deterministic: models are sans-IO state machines, the simulator owns a
//! seeded generator and a virtual clock, and the same seed gives byte-identical output.
#![warn(missing_docs)]

pub mod checker;
pub mod model;
pub mod rng;
pub mod run;
pub mod scenario;
pub mod sim;

//! Choosing an algorithm by name and running it.

use std::fmt;

use crate::model::bully::Bully;
use crate::model::lease::Lease;
use crate::model::raft::{Raft, RaftConfig};
use crate::model::ring::Ring;
use crate::scenario::Scenario;
use crate::sim::{simulate, SimConfig, Trace};

/// The four algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AlgorithmKind {
    /// [`crate::model::bully`].
    Bully,
    /// [`crate::model::ring`].
    Ring,
    /// [`crate::model::raft`].
    Raft,
    /// [`crate::model::lease`].
    Lease,
}

impl AlgorithmKind {
    /// All four, in report order.
    pub const ALL: [AlgorithmKind; 4] = [
        AlgorithmKind::Bully,
        AlgorithmKind::Ring,
        AlgorithmKind::Raft,
        AlgorithmKind::Lease,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            AlgorithmKind::Bully => "bully",
            AlgorithmKind::Ring => "ring",
            AlgorithmKind::Raft => "raft",
            AlgorithmKind::Lease => "lease",
        }
    }

    /// The algorithm called `name`.
    pub fn parse(name: &str) -> Option<AlgorithmKind> {
        AlgorithmKind::ALL
            .into_iter()
            .find(|kind| kind.name() == name)
    }
}

impl fmt::Display for AlgorithmKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Options that change an algorithm's behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AlgorithmOptions {
    /// Raft: pre-vote.
    pub pre_vote: bool,
    /// Raft: check-quorum.
    pub check_quorum: bool,
}

/// Runs `kind` through `scenario`.
pub fn run_algorithm(
    kind: AlgorithmKind,
    options: AlgorithmOptions,
    scenario: &Scenario,
    config: &SimConfig,
) -> Trace {
    match kind {
        AlgorithmKind::Bully => simulate(&Bully::default(), scenario, config),
        AlgorithmKind::Ring => simulate(&Ring::default(), scenario, config),
        AlgorithmKind::Raft => {
            let raft = Raft {
                config: RaftConfig {
                    pre_vote: options.pre_vote,
                    check_quorum: options.check_quorum,
                    ..RaftConfig::default()
                },
            };
            simulate(&raft, scenario, config)
        }
        AlgorithmKind::Lease => simulate(&Lease::default(), scenario, config),
    }
}

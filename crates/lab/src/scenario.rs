//! Fault schedules: the named built-in scenarios and the vocabulary they are written in.
//!
//! Faults name their targets by role ("the leader", "a random node") rather than by id, and
//! the simulator resolves them when they fire. Every algorithm therefore meets the *same*
//! schedule, aimed at whichever node plays that role in its run.

use std::time::Duration;

use crate::model::NodeId;
use crate::rng::Rng;

/// Which node a fault hits, resolved when the fault fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The node acting as leader with the highest token (the highest live id if none leads).
    Leader,
    /// A node drawn at random among those not crashed.
    Random,
    /// A fixed node.
    Node(NodeId),
    /// Whichever node the fault at this index of the schedule hit.
    SameAs(usize),
}

/// Which nodes a partition cuts off from the rest (and from the coordination service, which
/// always stays with the rest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// One node alone.
    Isolate(Target),
    /// The leader plus enough others to make a minority.
    LeaderMinority,
    /// A minority of followers, always including the highest-id follower; the leader keeps the
    /// majority (and the service).
    FollowerMinority,
    /// A minority drawn at random.
    RandomMinority,
}

/// One fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Kill a node, losing everything but its stable storage; restart it after a while.
    Crash {
        /// The victim.
        target: Target,
        /// When to bring it back, if ever.
        restart_after: Option<Duration>,
    },
    /// A symmetric partition for `duration`.
    Partition {
        /// The side cut off.
        side: Side,
        /// How long it lasts.
        duration: Duration,
    },
    /// A partition that comes and goes: `cycles` times `on` cut, then `off` healed.
    Flap {
        /// The side cut off (chosen once, when the fault fires).
        side: Side,
        /// How long each cut lasts.
        on: Duration,
        /// How long each healed gap lasts.
        off: Duration,
        /// How many cuts.
        cycles: u32,
    },
    /// An asymmetric link: everything the target sends to its peers (and to the service) is
    /// lost, while it still receives. Its writes to the resource still go through.
    CutOutbound {
        /// The node whose outbound links fail.
        target: Target,
        /// How long.
        duration: Duration,
    },
    /// Freeze a process (GC pause, SIGSTOP, VM migration): it neither receives nor acts.
    Pause {
        /// The victim.
        target: Target,
        /// How long it is frozen.
        duration: Duration,
        /// Freeze it right after it issues its next write, so that write leaves only when it
        /// wakes: the classic "checked the lease, then paused, then wrote" race.
        mid_write: bool,
    },
    /// Make a node's clock run at `1 + rate_ppm / 10⁶` of real time from now on.
    ClockRate {
        /// The node.
        target: Target,
        /// Parts per million faster (negative: slower).
        rate_ppm: i32,
    },
}

/// A named fault schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scenario {
    /// Its name on the command line.
    pub name: &'static str,
    /// One line saying what happens.
    pub description: &'static str,
    /// How long the run lasts.
    pub duration: Duration,
    /// Faults and when they fire.
    pub faults: Vec<(Duration, Fault)>,
}

/// The built-in scenario names, in report order.
pub const BUILTIN: [&str; 7] = [
    "leader-crash",
    "minority-partition",
    "majority-partition",
    "asymmetric-link",
    "long-pause",
    "clock-drift",
    "churn",
];

/// How much a node's clock runs slow in `clock-drift`: 25%, far beyond the lease recipe's 1%
/// bound.
pub const DRIFT_BEYOND_BOUND_PPM: i32 = -250_000;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

impl Scenario {
    /// The built-in scenario `name`; `seed` only matters for `churn`, whose faults are drawn.
    pub fn builtin(name: &str, seed: u64) -> Option<Scenario> {
        let (name, description, faults) = match name {
            "leader-crash" => (
                "leader-crash",
                "the leader crashes at 5 s and restarts at 12 s",
                vec![(
                    secs(5),
                    Fault::Crash {
                        target: Target::Leader,
                        restart_after: Some(secs(7)),
                    },
                )],
            ),
            "minority-partition" => (
                "minority-partition",
                "the leader and a minority are cut off from the rest from 5 s to 12 s",
                vec![(
                    secs(5),
                    Fault::Partition {
                        side: Side::LeaderMinority,
                        duration: secs(7),
                    },
                )],
            ),
            "majority-partition" => (
                "majority-partition",
                "the leader keeps the majority; a minority of followers (with the highest id) is cut off from 5 s to 12 s",
                vec![(
                    secs(5),
                    Fault::Partition {
                        side: Side::FollowerMinority,
                        duration: secs(7),
                    },
                )],
            ),
            "asymmetric-link" => (
                "asymmetric-link",
                "everything the leader sends is lost from 5 s to 12 s; it still receives",
                vec![(
                    secs(5),
                    Fault::CutOutbound {
                        target: Target::Leader,
                        duration: secs(7),
                    },
                )],
            ),
            "long-pause" => (
                "long-pause",
                "the leader freezes for 4 s (over twice the lease TTL) right after issuing a write at 5 s",
                vec![(
                    secs(5),
                    Fault::Pause {
                        target: Target::Leader,
                        duration: secs(4),
                        mid_write: true,
                    },
                )],
            ),
            "clock-drift" => (
                "clock-drift",
                "the leader's clock runs 25% slow from 4 s (bound: 1%), and it is isolated from 5 s to 11 s",
                vec![
                    (
                        secs(4),
                        Fault::ClockRate {
                            target: Target::Leader,
                            rate_ppm: DRIFT_BEYOND_BOUND_PPM,
                        },
                    ),
                    (
                        secs(5),
                        Fault::Partition {
                            side: Side::Isolate(Target::SameAs(0)),
                            duration: secs(6),
                        },
                    ),
                    (
                        secs(11),
                        Fault::ClockRate {
                            target: Target::SameAs(0),
                            rate_ppm: 0,
                        },
                    ),
                ],
            ),
            "churn" => ("churn", "a fault every 1.5 s from 4 s to 15 s, drawn from the seed: crashes, flapping partitions, pauses, one-way links", churn(seed)),
            _ => return None,
        };
        Some(Scenario {
            name,
            description,
            duration: secs(20),
            faults,
        })
    }
}

fn churn(seed: u64) -> Vec<(Duration, Fault)> {
    // A sub-stream of its own so that the schedule does not depend on the simulator's draws.
    let mut rng = Rng::new(seed ^ 0xC4E1_5EED_C4E1_5EED);
    (0..8)
        .map(|step| {
            let at = ms(4_000 + 1_500 * step);
            let fault = match rng.below(5) {
                0 => Fault::Crash {
                    target: Target::Random,
                    restart_after: Some(secs(1)),
                },
                1 => Fault::Crash {
                    target: Target::Leader,
                    restart_after: Some(ms(1_200)),
                },
                2 => Fault::Flap {
                    side: Side::RandomMinority,
                    on: ms(300),
                    off: ms(200),
                    cycles: 3,
                },
                3 => Fault::Pause {
                    target: Target::Random,
                    duration: ms(600),
                    mid_write: false,
                },
                _ => Fault::CutOutbound {
                    target: Target::Random,
                    duration: ms(800),
                },
            };
            (at, fault)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_exists_and_unknown_names_do_not() {
        for name in BUILTIN {
            let scenario = Scenario::builtin(name, 1).expect("builtin");
            assert_eq!(scenario.name, name);
            assert!(scenario
                .faults
                .iter()
                .all(|(at, _)| *at < scenario.duration));
        }
        assert_eq!(Scenario::builtin("nope", 1), None);
    }

    #[test]
    fn churn_depends_on_the_seed_only() {
        assert_eq!(churn(5), churn(5));
        assert_ne!(churn(5), churn(6));
        assert_eq!(churn(5).len(), 8);
    }
}

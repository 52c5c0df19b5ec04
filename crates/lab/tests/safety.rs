//! Property tests over many seeds, one per safety claim of the lab. Each failure prints the
//! seed and the command that replays it. `BATON_LAB_SEEDS` overrides the number of seeds.

use std::fmt::Display;

use baton_lab::checker::{
    check_no_fenced_stale_write, check_no_overlap, check_one_leader_per_token, summarize,
};
use baton_lab::run::{run_algorithm, AlgorithmKind, AlgorithmOptions};
use baton_lab::scenario::{Scenario, BUILTIN};
use baton_lab::sim::{SimConfig, Trace};

fn seeds() -> std::ops::Range<u64> {
    let default = if cfg!(debug_assertions) { 50 } else { 500 };
    let count = std::env::var("BATON_LAB_SEEDS")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default);
    1..1 + count
}

fn run(
    kind: AlgorithmKind,
    options: AlgorithmOptions,
    scenario: &str,
    config: &SimConfig,
) -> Trace {
    let scenario = Scenario::builtin(scenario, config.seed).expect("builtin");
    run_algorithm(kind, options, &scenario, config)
}

/// The lease recipe's run of `scenario` with `seed`, every node's clock off by up to
/// `clock_drift_ppm`.
fn lease(scenario: &str, seed: u64, clock_drift_ppm: u32) -> Trace {
    let config = SimConfig {
        seed,
        clock_drift_ppm,
        ..SimConfig::default()
    };
    run(
        AlgorithmKind::Lease,
        AlgorithmOptions::default(),
        scenario,
        &config,
    )
}

fn replay(kind: AlgorithmKind, scenario: &str, seed: u64) -> String {
    format!("replay: baton lab -a {kind} -s {scenario} --seed {seed}")
}

/// Fails on `violation`, found in `kind`'s run of `scenario` with `seed` (described as `run`),
/// printing the command that replays it.
fn fail(kind: AlgorithmKind, scenario: &str, seed: u64, run: &str, violation: impl Display) -> ! {
    panic!(
        "seed {seed}: {run}: {violation}; {}",
        replay(kind, scenario, seed)
    )
}

#[test]
fn raft_never_elects_two_leaders_in_one_term() {
    let options = [
        AlgorithmOptions::default(),
        AlgorithmOptions {
            pre_vote: true,
            check_quorum: true,
        },
    ];
    for seed in seeds() {
        for scenario in BUILTIN {
            for options in options {
                let config = SimConfig {
                    seed,
                    clock_drift_ppm: 50_000,
                    ..SimConfig::default()
                };
                let trace = run(AlgorithmKind::Raft, options, scenario, &config);
                let described = format!("{scenario} ({options:?})");
                if let Some(violation) = trace
                    .violations
                    .iter()
                    .find(|v| matches!(v, baton_lab::sim::Violation::SharedToken { .. }))
                {
                    fail(AlgorithmKind::Raft, scenario, seed, &described, violation);
                }
                if let Err(violation) = check_one_leader_per_token(&trace) {
                    fail(AlgorithmKind::Raft, scenario, seed, &described, violation);
                }
            }
        }
    }
}

#[test]
fn a_deposed_raft_leader_may_still_believe_it_leads() {
    // The honest other half of Raft's guarantee: terms are unique, beliefs are not. Cut off
    // in a minority without check-quorum, the old leader keeps acting while the majority
    // elects a new one, in every seed.
    for seed in seeds() {
        let config = SimConfig {
            seed,
            ..SimConfig::default()
        };
        let trace = run(
            AlgorithmKind::Raft,
            AlgorithmOptions::default(),
            "minority-partition",
            &config,
        );
        assert!(
            check_no_overlap(&trace).is_err(),
            "seed {seed}: no deposed leader overlapped; {}",
            replay(AlgorithmKind::Raft, "minority-partition", seed)
        );
    }
}

#[test]
fn bully_and_ring_elect_one_leader_per_side_of_a_partition() {
    for seed in seeds() {
        for kind in [AlgorithmKind::Bully, AlgorithmKind::Ring] {
            for scenario in ["minority-partition", "majority-partition"] {
                let config = SimConfig {
                    seed,
                    ..SimConfig::default()
                };
                let trace = run(kind, AlgorithmOptions::default(), scenario, &config);
                let summary = summarize(&trace);
                assert_eq!(
                    summary.partition_sides_led,
                    Some(true),
                    "seed {seed}: {kind} {scenario}: the sides did not both lead; {}",
                    replay(kind, scenario, seed)
                );
            }
        }
    }
}

#[test]
fn lease_never_has_two_holders_while_drift_stays_within_its_bound() {
    for seed in seeds() {
        for scenario in BUILTIN.iter().filter(|name| **name != "clock-drift") {
            // Every node's clock off by up to the full 1% bound, either way.
            let trace = lease(scenario, seed, 10_000);
            if let Some(violation) = trace.violations.first() {
                fail(AlgorithmKind::Lease, scenario, seed, scenario, violation);
            }
            if let Err(violation) = check_no_overlap(&trace) {
                fail(AlgorithmKind::Lease, scenario, seed, scenario, violation);
            }
        }
    }
}

#[test]
fn lease_with_fencing_accepts_no_stale_write_even_beyond_the_bound() {
    let mut overlapping_runs = 0;
    let mut stale_writes = 0;
    for seed in seeds() {
        for scenario in BUILTIN {
            // Clocks far outside the bound everywhere, on top of the scenario's faults.
            let trace = lease(scenario, seed, 200_000);
            if let Err(violation) = check_no_fenced_stale_write(&trace) {
                fail(AlgorithmKind::Lease, scenario, seed, scenario, violation);
            }
            assert_eq!(trace.violation_counts[2], 0, "seed {seed}: {scenario}");
            overlapping_runs += u64::from(check_no_overlap(&trace).is_err());
            stale_writes += summarize(&trace).writes.stale;
        }
    }
    // The property is not vacuous: the bound really is broken, and stale writes really do
    // arrive (and are accepted by the unfenced copy).
    assert!(overlapping_runs > 0, "no run broke the lease bound");
    assert!(stale_writes > 0, "no stale write was ever attempted");
}

#[test]
fn clock_drift_beyond_the_bound_makes_lease_holders_overlap() {
    let overlaps = seeds()
        .filter(|&seed| {
            let config = SimConfig {
                seed,
                ..SimConfig::default()
            };
            let trace = run(
                AlgorithmKind::Lease,
                AlgorithmOptions::default(),
                "clock-drift",
                &config,
            );
            // The per-step monitor and the recomputation from intervals agree.
            assert_eq!(
                trace.violation_counts[0] > 0,
                check_no_overlap(&trace).is_err(),
                "seed {seed}"
            );
            trace.violation_counts[0] > 0
        })
        .count();
    assert!(
        overlaps * 2 > seeds().count(),
        "only {overlaps} runs overlapped"
    );
}

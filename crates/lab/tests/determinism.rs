//! The same seed gives the same trace and byte-identical output.

use baton_lab::run::{run_algorithm, AlgorithmKind, AlgorithmOptions};
use baton_lab::scenario::{Scenario, BUILTIN};
use baton_lab::sim::SimConfig;
use baton_lab::{run_to, LabArgs};

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[test]
fn same_seed_same_trace_hash_for_every_algorithm_and_scenario() {
    for scenario in BUILTIN {
        for kind in AlgorithmKind::ALL {
            let hash = |seed| {
                let config = SimConfig {
                    seed,
                    ..SimConfig::default()
                };
                let scenario = Scenario::builtin(scenario, seed).expect("builtin");
                run_algorithm(kind, AlgorithmOptions::default(), &scenario, &config).hash
            };
            assert_eq!(hash(7), hash(7), "{scenario}/{kind}");
            assert_ne!(hash(7), hash(8), "{scenario}/{kind}: the seed must matter");
        }
    }
}

#[test]
fn default_run_output_is_byte_identical() {
    let output = |jobs| {
        let mut out = Vec::new();
        let args = LabArgs {
            jobs: Some(jobs),
            ..LabArgs::default()
        };
        run_to(&args, &mut out).expect("runs");
        out
    };
    let first = output(1);
    // Thread count and scheduling must not change a byte.
    let second = output(2);
    assert_eq!(fnv(&first), fnv(&second));
    let text = String::from_utf8(first).expect("utf-8");
    assert!(text.starts_with("baton lab: 5 nodes, seed 42"));
    for scenario in BUILTIN {
        assert!(text.contains(scenario), "{scenario} missing");
    }
}

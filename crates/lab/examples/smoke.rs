use baton_lab::checker::summarize;
use baton_lab::run::{run_algorithm, AlgorithmKind, AlgorithmOptions};
use baton_lab::scenario::{Scenario, BUILTIN};
use baton_lab::sim::SimConfig;
fn main() {
    let seed: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(42);
    for name in BUILTIN {
        let scenario = Scenario::builtin(name, seed).unwrap();
        for kind in AlgorithmKind::ALL {
            let t = run_algorithm(
                kind,
                AlgorithmOptions::default(),
                &scenario,
                &SimConfig {
                    seed,
                    ..SimConfig::default()
                },
            );
            let s = summarize(&t);
            println!("{name:20} {kind:6} el={:3} sb={}/{}ms none={}ms tte={:?} msgs={} em={} w={:?} v={:?} ev={}", s.elections, s.split_brain.count, s.split_brain.total/1_000_000, s.leaderless/1_000_000, s.time_to_elect.iter().map(|x| x/1_000_000).collect::<Vec<_>>(), s.messages, s.election_messages, s.writes, s.violation_counts, s.events);
        }
    }
}

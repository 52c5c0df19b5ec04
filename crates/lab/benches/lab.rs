//! Benchmark: simulated events per second per core, and the wall time of all built-in
//! scenarios × 4 algorithms × 1,000 seeds on 2 threads (target: under 60 s).
//!
//! Run with `cargo bench -p baton-lab`. Plain std timing, no harness. `BATON_LAB_BENCH_SEEDS`
//! changes the seed count.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use baton_lab::checker::summarize;
use baton_lab::run::{run_algorithm, AlgorithmKind, AlgorithmOptions};
use baton_lab::scenario::{Scenario, BUILTIN};
use baton_lab::sim::SimConfig;

const THREADS: usize = 2;

fn one(scenario: &str, kind: AlgorithmKind, seed: u64) -> u64 {
    let scenario = Scenario::builtin(scenario, seed).expect("builtin");
    let config = SimConfig {
        seed,
        ..SimConfig::default()
    };
    let trace = run_algorithm(kind, AlgorithmOptions::default(), &scenario, &config);
    // Include the checker: it is part of every run the command makes.
    let summary = summarize(&trace);
    std::hint::black_box(summary.hash);
    trace.events
}

fn main() {
    let seeds: u64 = std::env::var("BATON_LAB_BENCH_SEEDS")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(1_000);

    // Per core: one thread, every algorithm on every scenario, 100 seeds.
    println!("events per second, one core (100 seeds per scenario):");
    let mut all_events = 0;
    let mut all_time = 0.0;
    for kind in AlgorithmKind::ALL {
        let started = Instant::now();
        let mut events = 0;
        for scenario in BUILTIN {
            for seed in 0..100 {
                events += one(scenario, kind, seed);
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        all_events += events;
        all_time += seconds;
        println!(
            "  {:<6} {:>6.2} M events/s ({} events in {:.2} s)",
            kind.name(),
            events as f64 / seconds / 1e6,
            events,
            seconds
        );
    }
    println!(
        "  all    {:>6.2} M events/s",
        all_events as f64 / all_time / 1e6
    );

    // The target: every scenario × 4 algorithms × `seeds` seeds on 2 threads.
    let work: Vec<(&str, AlgorithmKind, u64)> = BUILTIN
        .iter()
        .flat_map(|&scenario| {
            AlgorithmKind::ALL
                .into_iter()
                .flat_map(move |kind| (0..seeds).map(move |seed| (scenario, kind, seed)))
        })
        .collect();
    let next = AtomicUsize::new(0);
    let events = AtomicU64::new(0);
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..THREADS {
            scope.spawn(|| loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(scenario, kind, seed)) = work.get(index) else {
                    return;
                };
                events.fetch_add(one(scenario, kind, seed), Ordering::Relaxed);
            });
        }
    });
    let seconds = started.elapsed().as_secs_f64();
    let events = events.into_inner();
    println!(
        "\n{} scenarios x 4 algorithms x {seeds} seeds = {} runs on {THREADS} threads: {:.2} s ({:.2} M events/s, {:.0} runs/s; target < 60 s)",
        BUILTIN.len(),
        work.len(),
        seconds,
        events as f64 / seconds / 1e6,
        work.len() as f64 / seconds
    );
}

//! `baton lab`: the command-line face (arguments, errors, parallel runs, output).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::checker::{summarize, RunSummary};
use crate::model::MAX_NODES;
use crate::report::{chart_svg, claims, html, stacked_svg, table, Cell, LEGEND};
use crate::run::{run_algorithm, AlgorithmKind, AlgorithmOptions};
use crate::scenario::{Scenario, BUILTIN};
use crate::sim::{SimConfig, Trace};

/// The seed used when none is given.
pub const DEFAULT_SEED: u64 = 42;

/// Runs at or above which a progress bar is drawn (on a terminal's stderr only).
const PROGRESS_THRESHOLD: usize = 50;

/// Arguments of `baton lab`. With none, every algorithm runs on every built-in scenario with
/// seed 42 on 5 nodes.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct LabArgs {
    /// Algorithms, comma-separated: bully, ring, raft, lease [default: all]
    #[arg(long, short = 'a', value_delimiter = ',', value_name = "NAMES")]
    pub algorithms: Vec<String>,
    /// Scenarios, comma-separated (see --list) [default: all]
    #[arg(long, short = 's', value_delimiter = ',', value_name = "NAMES")]
    pub scenarios: Vec<String>,
    /// First seed
    #[arg(long, default_value_t = DEFAULT_SEED)]
    pub seed: u64,
    /// Number of consecutive seeds to run from --seed; the table aggregates them
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub seeds: u64,
    /// Number of nodes (3 to 32)
    #[arg(long, short = 'n', default_value_t = 5)]
    pub nodes: usize,
    /// Write an HTML report (and one SVG per chart) to this directory
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Raft: enable pre-vote
    #[arg(long)]
    pub pre_vote: bool,
    /// Raft: enable check-quorum
    #[arg(long)]
    pub check_quorum: bool,
    /// Worker threads [default: available cores]
    #[arg(long, value_name = "N")]
    pub jobs: Option<usize>,
    /// List the algorithms and scenarios, then exit
    #[arg(long)]
    pub list: bool,
}

impl Default for LabArgs {
    fn default() -> LabArgs {
        LabArgs {
            algorithms: Vec::new(),
            scenarios: Vec::new(),
            seed: DEFAULT_SEED,
            seeds: 1,
            nodes: 5,
            out: None,
            pre_vote: false,
            check_quorum: false,
            jobs: None,
            list: false,
        }
    }
}

/// Why `baton lab` could not run.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// An algorithm name that does not exist.
    #[error("unknown algorithm {name:?} (expected one of: bully, ring, raft, lease)")]
    UnknownAlgorithm {
        /// The name given.
        name: String,
    },
    /// A scenario name that does not exist.
    #[error("unknown scenario {name:?} (expected one of: {})", BUILTIN.join(", "))]
    UnknownScenario {
        /// The name given.
        name: String,
    },
    /// Too few or too many nodes.
    #[error("node count {nodes} is out of range (3 to {MAX_NODES})")]
    NodeCount {
        /// The count given.
        nodes: usize,
    },
    /// Zero seeds or zero jobs.
    #[error("--{what} must be at least 1")]
    Zero {
        /// Which flag.
        what: &'static str,
    },
    /// The report could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Standard output could not be written.
    #[error("cannot write to standard output: {0}")]
    Stdout(std::io::Error),
}

/// A validated plan.
#[derive(Debug, Clone)]
struct Plan {
    algorithms: Vec<AlgorithmKind>,
    scenarios: Vec<&'static str>,
    seeds: Vec<u64>,
    config: SimConfig,
    options: AlgorithmOptions,
    jobs: usize,
}

fn plan(args: &LabArgs) -> Result<Plan, LabError> {
    let algorithms = if args.algorithms.is_empty() {
        AlgorithmKind::ALL.to_vec()
    } else {
        let mut kinds = Vec::new();
        for name in &args.algorithms {
            let kind = AlgorithmKind::parse(name.trim())
                .ok_or_else(|| LabError::UnknownAlgorithm { name: name.clone() })?;
            if !kinds.contains(&kind) {
                kinds.push(kind);
            }
        }
        kinds
    };
    let scenarios = if args.scenarios.is_empty() {
        BUILTIN.to_vec()
    } else {
        let mut names = Vec::new();
        for name in &args.scenarios {
            let known = BUILTIN
                .into_iter()
                .find(|known| *known == name.trim())
                .ok_or_else(|| LabError::UnknownScenario { name: name.clone() })?;
            if !names.contains(&known) {
                names.push(known);
            }
        }
        names
    };
    if !(3..=MAX_NODES).contains(&args.nodes) {
        return Err(LabError::NodeCount { nodes: args.nodes });
    }
    if args.seeds == 0 {
        return Err(LabError::Zero { what: "seeds" });
    }
    let jobs = match args.jobs {
        Some(0) => return Err(LabError::Zero { what: "jobs" }),
        Some(jobs) => jobs,
        None => std::thread::available_parallelism().map_or(1, usize::from),
    };
    Ok(Plan {
        algorithms,
        scenarios,
        seeds: (0..args.seeds).map(|i| args.seed.wrapping_add(i)).collect(),
        config: SimConfig {
            nodes: args.nodes,
            ..SimConfig::default()
        },
        options: AlgorithmOptions {
            pre_vote: args.pre_vote,
            check_quorum: args.check_quorum,
        },
        jobs,
    })
}

/// Runs `baton lab` and prints the table to standard output.
pub fn run(args: &LabArgs) -> Result<(), LabError> {
    let mut stdout = std::io::stdout().lock();
    run_to(args, &mut stdout)?;
    stdout.flush().map_err(LabError::Stdout)
}

/// Runs `baton lab`, writing the table to `out` (the same bytes for the same arguments).
pub fn run_to(args: &LabArgs, out: &mut dyn Write) -> Result<(), LabError> {
    if args.list {
        return write_list(out).map_err(LabError::Stdout);
    }
    let plan = plan(args)?;
    let cells = run_plan(&plan);
    let header = header(&plan);
    let text = format!(
        "{header}\n{}\n{}\n{}",
        table(&cells),
        LEGEND,
        claims(&cells)
    );
    out.write_all(text.as_bytes()).map_err(LabError::Stdout)?;
    if let Some(dir) = &args.out {
        write_report(dir, &plan, &header, &cells)?;
        writeln!(out, "\nreport: {}", dir.join("index.html").display())
            .map_err(LabError::Stdout)?;
    }
    Ok(())
}

fn write_list(out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "algorithms: bully, ring, raft, lease\n\nscenarios:")?;
    for name in BUILTIN {
        let scenario = Scenario::builtin(name, DEFAULT_SEED).expect("builtin exists");
        writeln!(out, "  {name:<20} {}", scenario.description)?;
    }
    Ok(())
}

fn header(plan: &Plan) -> String {
    let seeds = match plan.seeds.as_slice() {
        [one] => format!("seed {one}"),
        many => format!(
            "seeds {}..={} ({} runs per row)",
            many[0],
            many[many.len() - 1],
            many.len()
        ),
    };
    let raft = match (plan.options.pre_vote, plan.options.check_quorum) {
        (false, false) => "raft without pre-vote or check-quorum",
        (true, false) => "raft with pre-vote",
        (false, true) => "raft with check-quorum",
        (true, true) => "raft with pre-vote and check-quorum",
    };
    format!(
        "baton lab: {} nodes, {seeds}, {raft}; lease TTL 1.5s, drift bound 1%; 20s per run\n\
         (replay any run with --seed N and the same --nodes; every write goes to a fenced and an unfenced copy of the resource)",
        plan.config.nodes
    )
}

/// Runs every (scenario, algorithm, seed) on `plan.jobs` threads; results are combined in a
/// fixed order, so the output does not depend on scheduling.
fn run_plan(plan: &Plan) -> Vec<Cell> {
    let mut work = Vec::new();
    for &scenario in &plan.scenarios {
        for &algorithm in &plan.algorithms {
            for &seed in &plan.seeds {
                work.push((scenario, algorithm, seed));
            }
        }
    }
    let results: Vec<Mutex<Option<RunSummary>>> = work.iter().map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let progress = work.len() >= PROGRESS_THRESHOLD && std::io::stderr().is_terminal();
    std::thread::scope(|scope| {
        for _ in 0..plan.jobs.min(work.len()).max(1) {
            scope.spawn(|| loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(scenario, algorithm, seed)) = work.get(index) else {
                    return;
                };
                let summary = summarize(&simulate_one(plan, scenario, algorithm, seed));
                *results[index].lock().expect("no panics while holding") = Some(summary);
                done.fetch_add(1, Ordering::Relaxed);
            });
        }
        if progress {
            scope.spawn(|| draw_progress(&done, work.len()));
        }
    });
    let mut cells: Vec<Cell> = Vec::new();
    for ((scenario, algorithm, seed), result) in work.iter().zip(results) {
        let summary = result
            .into_inner()
            .expect("no panics while holding")
            .expect("every run finished");
        match cells.last_mut() {
            Some(cell) if cell.scenario == *scenario && cell.algorithm == Some(*algorithm) => {
                cell.add(*seed, &summary)
            }
            _ => {
                let mut cell = Cell::new(scenario, *algorithm);
                cell.add(*seed, &summary);
                cells.push(cell);
            }
        }
    }
    cells
}

fn simulate_one(plan: &Plan, scenario: &str, algorithm: AlgorithmKind, seed: u64) -> Trace {
    let scenario = Scenario::builtin(scenario, seed).expect("validated name");
    let config = SimConfig {
        seed,
        ..plan.config.clone()
    };
    run_algorithm(algorithm, plan.options, &scenario, &config)
}

/// A progress bar on stderr, redrawn until every run is done.
fn draw_progress(done: &AtomicUsize, total: usize) {
    let mut stderr = std::io::stderr();
    loop {
        let finished = done.load(Ordering::Relaxed);
        let filled = finished * 40 / total.max(1);
        let _ = write!(
            stderr,
            "\r[{}{}] {finished}/{total} runs",
            "#".repeat(filled),
            " ".repeat(40 - filled)
        );
        let _ = stderr.flush();
        if finished >= total {
            let _ = writeln!(stderr);
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn write_report(dir: &Path, plan: &Plan, header: &str, cells: &[Cell]) -> Result<(), LabError> {
    let failed = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LabError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(failed(dir))?;
    let seed = plan.seeds[0];
    let mut charts = Vec::new();
    for &scenario in &plan.scenarios {
        let traces: Vec<(Trace, String)> = plan
            .algorithms
            .iter()
            .map(|&algorithm| {
                let title = format!("{scenario} / {algorithm} (seed {seed})");
                (simulate_one(plan, scenario, algorithm, seed), title)
            })
            .collect();
        for ((trace, title), algorithm) in traces.iter().zip(&plan.algorithms) {
            let svg = chart_svg(trace, title);
            let path = dir.join(format!("{scenario}-{algorithm}.svg"));
            std::fs::write(&path, &svg).map_err(failed(&path))?;
            charts.push((title.clone(), svg));
        }
        let stacked: Vec<(&Trace, String)> =
            traces.iter().map(|(t, title)| (t, title.clone())).collect();
        let path = dir.join(format!("{scenario}.svg"));
        std::fs::write(&path, stacked_svg(&stacked)).map_err(failed(&path))?;
    }
    let path = dir.join("index.html");
    std::fs::write(&path, html(header, cells, &charts)).map_err(failed(&path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(f: impl FnOnce(&mut LabArgs)) -> LabArgs {
        let mut args = LabArgs::default();
        f(&mut args);
        args
    }

    #[test]
    fn bad_input_gets_one_clear_line() {
        let message = |args: LabArgs| plan(&args).unwrap_err().to_string();
        assert_eq!(
            message(args(|a| a.algorithms = vec!["paxos".into()])),
            "unknown algorithm \"paxos\" (expected one of: bully, ring, raft, lease)"
        );
        assert!(message(args(|a| a.scenarios = vec!["meteor".into()]))
            .starts_with("unknown scenario \"meteor\" (expected one of: leader-crash,"));
        assert_eq!(
            message(args(|a| a.nodes = 2)),
            "node count 2 is out of range (3 to 32)"
        );
        assert_eq!(message(args(|a| a.seeds = 0)), "--seeds must be at least 1");
        assert_eq!(
            message(args(|a| a.jobs = Some(0))),
            "--jobs must be at least 1"
        );
    }

    #[test]
    fn defaults_cover_everything_once() {
        let plan = plan(&LabArgs::default()).expect("valid");
        assert_eq!(plan.algorithms, AlgorithmKind::ALL.to_vec());
        assert_eq!(plan.scenarios, BUILTIN.to_vec());
        assert_eq!(plan.seeds, vec![DEFAULT_SEED]);
        let plan = super::plan(&args(|a| {
            a.algorithms = vec!["raft".into(), "raft".into(), " lease".into()];
            a.seeds = 3;
            a.seed = 7;
        }))
        .expect("valid");
        assert_eq!(
            plan.algorithms,
            vec![AlgorithmKind::Raft, AlgorithmKind::Lease]
        );
        assert_eq!(plan.seeds, vec![7, 8, 9]);
    }

    #[test]
    fn list_names_every_scenario() {
        let mut out = Vec::new();
        run_to(&args(|a| a.list = true), &mut out).expect("lists");
        let text = String::from_utf8(out).expect("utf-8");
        assert!(BUILTIN.iter().all(|name| text.contains(name)));
    }
}

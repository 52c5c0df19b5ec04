//! Presentation: the terminal table, the claims, and the HTML report with timeline charts.
//!
//! Everything here is a pure function of the results, so equal seeds give byte-identical text.

use std::fmt::Write as _;

use crate::checker::{split_brain_periods, RunSummary};
use crate::model::members;
use crate::run::AlgorithmKind;
use crate::sim::{Nanos, Trace, WindowKind};

/// The results of one (scenario, algorithm) pair over all seeds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Cell {
    /// Scenario name.
    pub scenario: &'static str,
    /// Algorithm.
    pub algorithm: Option<AlgorithmKind>,
    /// Runs (seeds).
    pub runs: u64,
    /// Runs with any split brain.
    pub split_runs: u64,
    /// Sum over runs.
    pub elections: u64,
    /// Sum over runs of split-brain time.
    pub split_time: Nanos,
    /// Sum over runs of leaderless time.
    pub leaderless: Nanos,
    /// Sum and count of fault-to-election times, and the largest.
    pub elect_sum: Nanos,
    /// How many fault-to-election times.
    pub elect_count: u64,
    /// The largest fault-to-election time.
    pub elect_max: Nanos,
    /// Sum over runs.
    pub election_messages: u64,
    /// Sum over runs.
    pub writes: u64,
    /// Sum over runs: stale writes (all accepted without fencing).
    pub stale: u64,
    /// Sum over runs: stale writes accepted with fencing.
    pub stale_fenced: u64,
    /// Sum over runs: writes rejected by the fence.
    pub rejected: u64,
    /// Runs whose per-step checks found an overlap, a shared token, a fenced stale write.
    pub violation_runs: [u64; 3],
    /// Runs with a long partition, and of those, runs where both sides led at once.
    pub partition_runs: u64,
    /// See `partition_runs`.
    pub sides_led_runs: u64,
    /// Events simulated.
    pub events: u64,
    /// Combined trace hashes (order-dependent).
    pub hash: u64,
    /// The first seed whose run had a split brain, to replay.
    pub first_split_seed: Option<u64>,
}

impl Cell {
    /// An empty cell.
    pub fn new(scenario: &'static str, algorithm: AlgorithmKind) -> Cell {
        Cell {
            scenario,
            algorithm: Some(algorithm),
            ..Cell::default()
        }
    }

    /// Adds one run (call in seed order).
    pub fn add(&mut self, seed: u64, run: &RunSummary) {
        self.runs += 1;
        if run.split_brain.count > 0 {
            self.split_runs += 1;
            self.first_split_seed.get_or_insert(seed);
        }
        self.elections += run.elections;
        self.split_time += run.split_brain.total;
        self.leaderless += run.leaderless;
        self.elect_sum += run.time_to_elect.iter().sum::<Nanos>();
        self.elect_count += run.time_to_elect.len() as u64;
        self.elect_max = self
            .elect_max
            .max(run.time_to_elect.iter().copied().max().unwrap_or(0));
        self.election_messages += run.election_messages;
        self.writes += run.writes.total;
        self.stale += run.writes.stale;
        self.stale_fenced += run.writes.stale_accepted_fenced;
        self.rejected += run.writes.rejected_fenced;
        for (kind, count) in run.violation_counts.iter().enumerate() {
            self.violation_runs[kind] += u64::from(*count > 0);
        }
        if let Some(led) = run.partition_sides_led {
            self.partition_runs += 1;
            self.sides_led_runs += u64::from(led);
        }
        self.events += run.events;
        self.hash = self.hash.rotate_left(5) ^ run.hash;
    }
}

fn ms(nanos: f64) -> String {
    format!("{:.0}ms", nanos / 1e6)
}

/// A per-run mean: an integer for one run, one decimal otherwise.
fn mean(total: u64, runs: u64) -> String {
    if runs <= 1 {
        total.to_string()
    } else {
        format!("{:.1}", total as f64 / runs as f64)
    }
}

const HEADERS: [&str; 13] = [
    "scenario",
    "algorithm",
    "elections",
    "split runs",
    "split time",
    "no leader",
    "to elect",
    "max",
    "msgs/elect",
    "writes",
    "stale",
    "stale+fence",
    "rejected",
];

fn row(cell: &Cell) -> [String; 13] {
    let runs = cell.runs.max(1);
    let algorithm = cell.algorithm.map_or("", AlgorithmKind::name);
    [
        cell.scenario.to_string(),
        algorithm.to_string(),
        mean(cell.elections, runs),
        format!("{}/{}", cell.split_runs, cell.runs),
        ms(cell.split_time as f64 / runs as f64),
        ms(cell.leaderless as f64 / runs as f64),
        if cell.elect_count == 0 {
            "-".into()
        } else {
            ms(cell.elect_sum as f64 / cell.elect_count as f64)
        },
        if cell.elect_count == 0 {
            "-".into()
        } else {
            ms(cell.elect_max as f64)
        },
        if cell.elections == 0 {
            "-".into()
        } else {
            format!(
                "{:.1}",
                cell.election_messages as f64 / cell.elections as f64
            )
        },
        mean(cell.writes, runs),
        mean(cell.stale, runs),
        mean(cell.stale_fenced, runs),
        mean(cell.rejected, runs),
    ]
}

/// The summary table, as fixed-width text.
pub fn table(cells: &[Cell]) -> String {
    let rows: Vec<[String; 13]> = cells.iter().map(row).collect();
    let mut widths = HEADERS.map(str::len);
    for row in &rows {
        for (width, value) in widths.iter_mut().zip(row) {
            *width = (*width).max(value.len());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, values: &[&str]| {
        let mut text = String::new();
        for (i, (value, width)) in values.iter().zip(widths).enumerate() {
            if i < 2 {
                let _ = write!(text, "{value:<width$}  ");
            } else {
                let _ = write!(text, "{value:>width$}  ");
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut out, &HEADERS);
    let mut previous = "";
    for (cell, values) in cells.iter().zip(&rows) {
        if !previous.is_empty() && previous != cell.scenario {
            out.push('\n');
        }
        previous = cell.scenario;
        let refs: Vec<&str> = values.iter().map(String::as_str).collect();
        line(&mut out, &refs);
    }
    out
}

/// What the columns mean.
pub const LEGEND: &str = "\
elections: leaderships started per run. split runs: runs in which two or more nodes acted as
leader at once; split time: how long per run. no leader: time per run with nobody acting, after
the first election. to elect: mean time from a fault or heal to the next new leader (max: the
worst; faults after which nobody new took over before the next one are not counted).
msgs/elect: election messages (not heartbeats or lease renewals) per election. writes: writes
per run reaching the resource; stale: writes whose token was not newer than one the resource had
already seen from another leader (all accepted without fencing); stale+fence: stale writes the
fenced resource accepted anyway; rejected: writes the fence turned away.
";

/// The safety claims of the issue, checked over the cells, as text.
pub fn claims(cells: &[Cell]) -> String {
    let mut out = String::from("claims (checked after every simulated step):\n");
    let sum = |pick: &dyn Fn(&Cell) -> bool, value: &dyn Fn(&Cell) -> u64| -> u64 {
        cells.iter().filter(|c| pick(c)).map(value).sum()
    };
    let is = |kind: AlgorithmKind| move |c: &Cell| c.algorithm == Some(kind);
    for kind in [AlgorithmKind::Bully, AlgorithmKind::Ring] {
        let runs = sum(&is(kind), &|c| c.partition_runs);
        if runs > 0 {
            let led = sum(&is(kind), &|c| c.sides_led_runs);
            let _ = writeln!(
                out,
                "  {kind}: each side of a long partition elects its own leader: {led} of {runs} runs"
            );
        }
    }
    let raft = is(AlgorithmKind::Raft);
    let runs = sum(&raft, &|c| c.runs);
    if runs > 0 {
        let shared = sum(&raft, &|c| c.violation_runs[1]);
        let believing = sum(&raft, &|c| c.split_runs);
        let _ = writeln!(
            out,
            "  raft: two leaders in one term: {shared} of {runs} runs; a deposed leader still believing it leads: {believing} of {runs} runs"
        );
    }
    let lease = is(AlgorithmKind::Lease);
    let within =
        |c: &Cell| c.algorithm == Some(AlgorithmKind::Lease) && c.scenario != "clock-drift";
    let beyond =
        |c: &Cell| c.algorithm == Some(AlgorithmKind::Lease) && c.scenario == "clock-drift";
    let runs = sum(&within, &|c| c.runs);
    if runs > 0 {
        let overlap = sum(&within, &|c| c.violation_runs[0]);
        let _ = writeln!(
            out,
            "  lease, drift within its bound: two holders at once: {overlap} of {runs} runs"
        );
    }
    let runs = sum(&beyond, &|c| c.runs);
    if runs > 0 {
        let overlap = sum(&beyond, &|c| c.violation_runs[0]);
        let _ = writeln!(
            out,
            "  lease, drift beyond its bound (clock-drift): two holders at once: {overlap} of {runs} runs"
        );
    }
    let runs = sum(&lease, &|c| c.runs);
    if runs > 0 {
        let stale = sum(&lease, &|c| c.stale);
        let accepted = sum(&lease, &|c| c.stale_fenced);
        let _ = writeln!(
            out,
            "  lease + fencing: stale writes accepted: {accepted} (of {stale} stale writes, all accepted without fencing) in {runs} runs"
        );
    }
    out
}

// Charts.

const CHART_WIDTH: f64 = 960.0;
const LEFT: f64 = 44.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 26.0;
const ROW: f64 = 20.0;

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// One timeline chart: rows are nodes, bars are leaderships (labelled with their token),
/// faults are shaded, red marks where two or more act at once, and stale writes are marked
/// (× rejected by the fence, ● accepted even with fencing).
pub fn chart_svg(trace: &Trace, title: &str) -> String {
    let mut svg = String::new();
    chart_into(&mut svg, trace, title, 0.0);
    let height = chart_height(trace.nodes);
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{CHART_WIDTH}\" height=\"{height}\" viewBox=\"0 0 {CHART_WIDTH} {height}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{svg}</svg>\n"
    )
}

/// Several charts stacked in one SVG (one scenario, every algorithm).
pub fn stacked_svg(charts: &[(&Trace, String)]) -> String {
    let mut body = String::new();
    let mut y = 0.0;
    for (trace, title) in charts {
        chart_into(&mut body, trace, title, y);
        y += chart_height(trace.nodes);
    }
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{CHART_WIDTH}\" height=\"{y}\" viewBox=\"0 0 {CHART_WIDTH} {y}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{body}</svg>\n"
    )
}

fn chart_height(nodes: usize) -> f64 {
    TOP + ROW * nodes as f64 + 44.0
}

fn chart_into(svg: &mut String, trace: &Trace, title: &str, y0: f64) {
    let span = trace.duration.max(1) as f64;
    let plot = CHART_WIDTH - LEFT - RIGHT;
    let x = |t: Nanos| LEFT + plot * (t as f64 / span);
    let row_y = |node: usize| y0 + TOP + ROW * node as f64;
    let rows = ROW * trace.nodes as f64;
    let _ = writeln!(
        svg,
        "<text x=\"{LEFT}\" y=\"{:.1}\" font-weight=\"bold\" font-size=\"13\">{}</text>",
        y0 + 16.0,
        escape(title)
    );
    for node in 0..trace.nodes {
        let _ = writeln!(
            svg,
            "<text x=\"6\" y=\"{:.1}\">n{node}</text><line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/>",
            row_y(node) + 14.0,
            CHART_WIDTH - RIGHT,
            row_y(node) + ROW,
            row_y(node) + ROW
        );
    }
    for window in &trace.faults {
        let (fill, opacity) = match window.kind {
            WindowKind::Crash => ("#555", 0.35),
            WindowKind::Pause => ("#8e44ad", 0.3),
            WindowKind::Partition => ("#2980b9", 0.18),
            WindowKind::OneWay => ("#e67e22", 0.3),
            WindowKind::Clock => ("#f1c40f", 0.3),
        };
        let (x0, x1) = (x(window.start), x(window.end.max(window.start)));
        for node in members(window.nodes) {
            let _ = writeln!(
                svg,
                "<rect x=\"{x0:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{ROW}\" fill=\"{fill}\" fill-opacity=\"{opacity}\"><title>{}</title></rect>",
                row_y(node),
                (x1 - x0).max(1.0),
                escape(&window.label)
            );
        }
    }
    for interval in &trace.leaderships {
        let (x0, x1) = (x(interval.start), x(interval.end));
        let width = (x1 - x0).max(1.0);
        let y = row_y(interval.node) + 4.0;
        let _ = write!(
            svg,
            "<rect x=\"{x0:.1}\" y=\"{y:.1}\" width=\"{width:.1}\" height=\"12\" fill=\"#27ae60\"><title>n{} leads with token {}: {:.3}s to {:.3}s</title></rect>",
            interval.node,
            interval.token,
            interval.start as f64 / 1e9,
            interval.end as f64 / 1e9
        );
        if width > 24.0 {
            let _ = write!(
                svg,
                "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"white\" font-size=\"9\">{}</text>",
                x0 + 3.0,
                y + 9.5,
                interval.token
            );
        }
        svg.push('\n');
    }
    for (start, end) in split_brain_periods(trace) {
        let _ = writeln!(
            svg,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{rows:.1}\" fill=\"#e74c3c\" fill-opacity=\"0.35\"><title>two or more act as leader: {:.0} ms</title></rect>",
            x(start),
            y0 + TOP,
            (x(end) - x(start)).max(1.5),
            (end - start) as f64 / 1e6
        );
    }
    for write in trace.writes.iter().filter(|w| w.stale) {
        let (cx, cy) = (x(write.arrived), row_y(write.node) + 10.0);
        if write.accepted_fenced {
            let _ = writeln!(
                svg,
                "<circle cx=\"{cx:.1}\" cy=\"{cy:.1}\" r=\"3.5\" fill=\"#c0392b\" stroke=\"black\" stroke-width=\"0.5\"><title>stale write (token {}) accepted even with fencing</title></circle>",
                write.token
            );
        } else {
            let _ = writeln!(
                svg,
                "<path d=\"M{:.1},{:.1}l6,6m0,-6l-6,6\" stroke=\"#d35400\" stroke-width=\"1.6\"><title>stale write (token {}): rejected by the fence, accepted without it</title></path>",
                cx - 3.0,
                cy - 3.0,
                write.token
            );
        }
    }
    let axis_y = y0 + TOP + rows;
    let seconds = trace.duration / 1_000_000_000;
    for second in 0..=seconds {
        let tx = x(second * 1_000_000_000);
        let _ = writeln!(
            svg,
            "<line x1=\"{tx:.1}\" x2=\"{tx:.1}\" y1=\"{axis_y:.1}\" y2=\"{:.1}\" stroke=\"#999\"/><text x=\"{tx:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#555\">{second}s</text>",
            axis_y + 4.0,
            axis_y + 15.0
        );
    }
    let legend_y = axis_y + 32.0;
    let items: [(&str, &str); 7] = [
        ("#27ae60", "leader (token)"),
        ("#e74c3c", "two or more act"),
        ("#2980b9", "partitioned"),
        ("#e67e22", "cannot send"),
        ("#555", "crashed"),
        ("#8e44ad", "paused"),
        ("#f1c40f", "clock off"),
    ];
    let mut lx = LEFT;
    for (color, label) in items {
        let _ = write!(
            svg,
            "<rect x=\"{lx:.1}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{color}\" fill-opacity=\"0.7\"/><text x=\"{:.1}\" y=\"{legend_y:.1}\">{label}</text>",
            legend_y - 9.0,
            lx + 13.0
        );
        lx += 18.0 + 6.2 * label.len() as f64;
    }
    let _ = writeln!(
        svg,
        "<path d=\"M{lx:.1},{:.1}l6,6m0,-6l-6,6\" stroke=\"#d35400\" stroke-width=\"1.6\"/><text x=\"{:.1}\" y=\"{legend_y:.1}\">stale write rejected by fence</text><circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3.5\" fill=\"#c0392b\"/><text x=\"{:.1}\" y=\"{legend_y:.1}\">accepted despite fence</text>",
        legend_y - 8.0,
        lx + 10.0,
        lx + 190.0,
        legend_y - 4.0,
        lx + 197.0
    );
}

/// The self-contained HTML report: header, table, legend, claims, then one chart per
/// (scenario, algorithm) for the first seed.
pub fn html(header: &str, cells: &[Cell], charts: &[(String, String)]) -> String {
    let mut out = String::from(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>baton lab</title>\n<style>body{font-family:sans-serif;margin:24px;max-width:1000px}table{border-collapse:collapse;font-size:13px}td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:right}td:nth-child(-n+2),th:nth-child(-n+2){text-align:left}pre{background:#f6f6f6;padding:8px;white-space:pre-wrap}h2{margin-top:32px}</style>\n</head><body>\n<h1>baton lab</h1>\n",
    );
    let _ = writeln!(out, "<pre>{}</pre>", escape(header));
    out.push_str("<table>\n<tr>");
    for header in HEADERS {
        let _ = write!(out, "<th>{header}</th>");
    }
    out.push_str("</tr>\n");
    for cell in cells {
        out.push_str("<tr>");
        for value in row(cell) {
            let _ = write!(out, "<td>{}</td>", escape(&value));
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</table>\n");
    let _ = writeln!(out, "<pre>{}</pre>", escape(LEGEND));
    let _ = writeln!(out, "<pre>{}</pre>", escape(&claims(cells)));
    for (title, svg) in charts {
        let _ = writeln!(out, "<h2>{}</h2>\n{svg}", escape(title));
    }
    out.push_str("</body></html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::summarize;
    use crate::run::{run_algorithm, AlgorithmOptions};
    use crate::scenario::Scenario;
    use crate::sim::SimConfig;

    #[test]
    fn table_aligns_and_chart_is_well_formed() {
        let scenario = Scenario::builtin("long-pause", 1).expect("builtin");
        let trace = run_algorithm(
            AlgorithmKind::Lease,
            AlgorithmOptions::default(),
            &scenario,
            &SimConfig::default(),
        );
        let mut cell = Cell::new(scenario.name, AlgorithmKind::Lease);
        cell.add(1, &summarize(&trace));
        let text = table(&[cell.clone()]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("scenario"));
        assert!(lines[1].starts_with("long-pause"));
        let svg = chart_svg(&trace, "long-pause / lease");
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        // Every rect carries a tooltip except the background and the 7 legend swatches.
        assert_eq!(
            svg.matches("<rect").count(),
            svg.matches("</rect>").count() + 8
        );
        let page = html("header", &[cell], &[("t".into(), svg)]);
        assert!(page.contains("<table>") && page.contains("claims"));
    }
}

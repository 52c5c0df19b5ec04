//! The demo's summary (terminal and HTML) and its self-contained HTML report: an inline SVG
//! timeline in the style of `baton lab`'s charts (rows are candidates, bars are leaderships
//! labelled with their tokens), no scripts, no external resources.

use std::fmt::Write as _;
use std::time::Duration;

use super::store::Record;
use super::{FaultKind, Timeline};

/// One leadership, as the backend showed it, with what its job wrote.
#[derive(Debug, Clone)]
pub struct Leadership {
    pub id: String,
    pub token: u64,
    pub start: Duration,
    pub end: Option<Duration>,
    pub accepted: usize,
}

/// What the demo measured and checked.
#[derive(Debug, Clone)]
pub struct Summary {
    pub ttl: Duration,
    pub failover: Option<Duration>,
    pub handoff: Option<Duration>,
    pub late_write: Option<Record>,
    pub leaderships: Vec<Leadership>,
    pub accepted: usize,
    pub rejected: usize,
    /// Accepted writes whose token was below one accepted before them: must be 0.
    pub stale_accepted: usize,
}

impl Summary {
    pub fn of(t: &Timeline) -> Summary {
        // Checked from the store's record alone, not from the fence's answers: whatever the
        // fence did, no accepted write may carry a token below one accepted before it.
        let mut highest = 0;
        let mut stale_accepted = 0;
        for write in t.writes.iter().filter(|w| w.accepted) {
            if write.token < highest {
                stale_accepted += 1;
            }
            highest = highest.max(write.token);
        }
        let leaderships = t
            .terms
            .iter()
            .map(|term| Leadership {
                id: term.id.clone(),
                token: term.token,
                start: term.start,
                end: term.end,
                accepted: t
                    .writes
                    .iter()
                    .filter(|w| w.accepted && w.token == term.token)
                    .count(),
            })
            .collect();
        Summary {
            ttl: t.ttl,
            failover: t.failover,
            handoff: t.handoff,
            late_write: t.late_write.clone(),
            leaderships,
            accepted: t.writes.iter().filter(|w| w.accepted).count(),
            rejected: t.writes.iter().filter(|w| !w.accepted).count(),
            stale_accepted,
        }
    }

    /// The summary as label/value pairs (terminal and HTML show the same).
    fn lines(&self) -> Vec<(String, String)> {
        let ms = |d: Option<Duration>| {
            d.map_or("not measured".into(), |d| format!("{} ms", d.as_millis()))
        };
        let late = match &self.late_write {
            Some(w) => format!(
                "{}'s write with token {} rejected by the fence (the store had seen token {})",
                w.id,
                w.token,
                w.highest.unwrap_or(0)
            ),
            None => "not seen".into(),
        };
        let check = if self.stale_accepted == 0 {
            "0 (no write with a token lower than an accepted one was accepted: holds)".to_string()
        } else {
            format!(
                "{} (writes with a token lower than an accepted one were accepted: VIOLATED)",
                self.stale_accepted
            )
        };
        vec![
            (
                "failover (kill -9 → successor's first accepted write)".into(),
                format!(
                    "{} (TTL {})",
                    ms(self.failover),
                    baton::format_duration(self.ttl)
                ),
            ),
            (
                "handoff (SIGTERM → successor's first accepted write)".into(),
                ms(self.handoff),
            ),
            ("late write of the paused leader".into(), late),
            (
                "writes".into(),
                format!("{} accepted, {} rejected", self.accepted, self.rejected),
            ),
            ("stale writes accepted".into(), check),
        ]
    }

    /// The summary for the terminal.
    pub fn text(&self) -> String {
        let mut out = String::from("\nsummary\n");
        for (label, value) in self.lines() {
            let _ = writeln!(out, "  {label}: {value}");
        }
        out.push_str("  leaderships (token, candidate, from → to, writes accepted):\n");
        for l in &self.leaderships {
            let _ = writeln!(
                out,
                "    {:>12}  {:<8} {:>6.2}s → {}  {}",
                l.token,
                l.id,
                l.start.as_secs_f64(),
                l.end
                    .map_or("   end".into(), |e| format!("{:>5.2}s", e.as_secs_f64())),
                l.accepted
            );
        }
        out
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

// The timeline, in the proportions of `baton lab`'s charts.
const WIDTH: f64 = 960.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 30.0;
/// A row: fault labels on top, the leadership bar, then ticks for accepted writes.
const ROW: f64 = 36.0;

/// The timeline chart: one row per candidate, green bars for leaderships (labelled with their
/// tokens), ticks for accepted writes, marks for kill -9, SIGSTOP/SIGCONT and SIGTERM, and a
/// red cross for every write the fence rejected.
pub fn timeline_svg(t: &Timeline) -> String {
    let span = t
        .end
        .unwrap_or_else(|| t.epoch.elapsed())
        .as_secs_f64()
        .max(1.0);
    let plot = WIDTH - LEFT - RIGHT;
    let x = |d: Duration| LEFT + plot * (d.as_secs_f64() / span).min(1.0);
    let row_y = |index: usize| TOP + ROW * index as f64;
    let rows = ROW * t.rows.len() as f64;
    let height = TOP + rows + 56.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" viewBox=\"0 0 {WIDTH} {height}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>"
    );
    let _ = writeln!(
        svg,
        "<text x=\"{LEFT}\" y=\"16\" font-weight=\"bold\" font-size=\"13\">{} candidates, TTL {}</text>",
        t.rows.len(),
        baton::format_duration(t.ttl)
    );
    for (index, row) in t.rows.iter().enumerate() {
        let y = row_y(index);
        let _ = writeln!(
            svg,
            "<text x=\"6\" y=\"{:.1}\">{}</text><line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/>",
            y + 23.0,
            escape(&row.id),
            WIDTH - RIGHT,
            y + ROW,
            y + ROW
        );
    }
    // Paused windows first, under everything else.
    for stop in t.faults.iter().filter(|f| f.kind == FaultKind::Stop) {
        let resumed = t
            .faults
            .iter()
            .find(|f| f.id == stop.id && f.kind == FaultKind::ContRest && f.at >= stop.at)
            .map_or_else(|| t.end.unwrap_or(stop.at), |f| f.at);
        let (x0, x1) = (x(stop.at), x(resumed));
        let _ = writeln!(
            svg,
            "<rect x=\"{x0:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{ROW}\" fill=\"#8e44ad\" fill-opacity=\"0.18\"><title>{} paused (SIGSTOP) for {:.2}s</title></rect>",
            row_y(t.row(&stop.id)),
            (x1 - x0).max(1.0),
            escape(&stop.id),
            resumed.saturating_sub(stop.at).as_secs_f64()
        );
    }
    for term in &t.terms {
        let end = term.end.or(t.end).unwrap_or(term.start);
        let (x0, x1) = (x(term.start), x(end));
        let width = (x1 - x0).max(1.0);
        let y = row_y(t.row(&term.id)) + 12.0;
        let _ = write!(
            svg,
            "<rect x=\"{x0:.1}\" y=\"{y:.1}\" width=\"{width:.1}\" height=\"14\" fill=\"#27ae60\"><title>{} leads with token {}: {:.2}s to {:.2}s</title></rect>",
            escape(&term.id),
            term.token,
            term.start.as_secs_f64(),
            end.as_secs_f64()
        );
        // After kill -9 or SIGSTOP the backend still names the holder until its lease runs
        // out, but no job of it runs (or it is frozen): drawn paler, so the chart shows the
        // TTL a failover costs.
        let hit = t.faults.iter().find(|f| {
            f.id == term.id
                && matches!(f.kind, FaultKind::Kill9 | FaultKind::Stop)
                && f.at > term.start
                && f.at < end
        });
        if let Some(fault) = hit {
            let xf = x(fault.at);
            let _ = write!(
                svg,
                "<rect x=\"{xf:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"14\" fill=\"#a9dfbf\"><title>{}'s lease (token {}) still held after {}: no job acts for it until it runs out</title></rect>",
                (x1 - xf).max(1.0),
                escape(&term.id),
                term.token,
                if fault.kind == FaultKind::Kill9 { "kill -9" } else { "SIGSTOP" }
            );
        }
        let label = term.token.to_string();
        if width > 6.5 * label.len() as f64 + 6.0 {
            let _ = write!(
                svg,
                "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"white\" font-size=\"10\">{label}</text>",
                x0 + 3.0,
                y + 10.5
            );
        }
        svg.push('\n');
    }
    for write in t.writes.iter().filter(|w| w.accepted) {
        let (wx, y) = (x(write.at), row_y(t.row(&write.id)) + 28.0);
        let _ = writeln!(
            svg,
            "<line x1=\"{wx:.1}\" x2=\"{wx:.1}\" y1=\"{y:.1}\" y2=\"{:.1}\" stroke=\"#1e8449\" stroke-opacity=\"0.5\"/>",
            y + 5.0
        );
    }
    for fault in &t.faults {
        let (fx, y) = (x(fault.at), row_y(t.row(&fault.id)));
        // The two SIGCONTs come milliseconds apart: the job's label goes left of its line.
        let (color, label, what, dash, left) = match fault.kind {
            FaultKind::Kill9 => ("#000", "kill -9", "baton run", "", false),
            FaultKind::Stop => ("#8e44ad", "SIGSTOP", "job, guard and baton run", "", false),
            FaultKind::ContWorker => (
                "#8e44ad",
                "SIGCONT job",
                "the job only",
                " stroke-dasharray=\"3,2\"",
                true,
            ),
            FaultKind::ContRest => ("#8e44ad", "SIGCONT guard", "guard and baton run", "", false),
            FaultKind::Term => ("#2471a3", "SIGTERM", "baton run", "", false),
        };
        let (tx, anchor) = if left {
            (fx - 3.0, "end")
        } else {
            (fx + 3.0, "start")
        };
        let _ = writeln!(
            svg,
            "<line x1=\"{fx:.1}\" x2=\"{fx:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"{color}\" stroke-width=\"2\"{dash}><title>{label}: {}'s {what} at {:.2}s</title></line><text x=\"{tx:.1}\" y=\"{:.1}\" fill=\"{color}\" font-size=\"9\" text-anchor=\"{anchor}\">{label}</text>",
            y + 2.0,
            y + ROW - 2.0,
            escape(&fault.id),
            fault.at.as_secs_f64(),
            y + 9.0
        );
    }
    for write in t.writes.iter().filter(|w| !w.accepted) {
        let (wx, cy) = (x(write.at), row_y(t.row(&write.id)) + 19.0);
        let _ = writeln!(
            svg,
            "<path d=\"M{:.1},{:.1}l8,8m0,-8l-8,8\" stroke=\"#c0392b\" stroke-width=\"2.5\"><title>late write by {} with token {} rejected by the fence (the store had seen token {}) at {:.2}s</title></path>",
            wx - 4.0,
            cy - 4.0,
            escape(&write.id),
            write.token,
            write.highest.unwrap_or(0),
            write.at.as_secs_f64()
        );
    }
    let axis_y = TOP + rows;
    let step = if span > 30.0 { 5 } else { 1 };
    for second in (0..=span as u64).step_by(step) {
        let tx = x(Duration::from_secs(second));
        let _ = writeln!(
            svg,
            "<line x1=\"{tx:.1}\" x2=\"{tx:.1}\" y1=\"{axis_y:.1}\" y2=\"{:.1}\" stroke=\"#999\"/><text x=\"{tx:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#555\">{second}s</text>",
            axis_y + 4.0,
            axis_y + 15.0
        );
    }
    let legend_y = axis_y + 38.0;
    let _ = writeln!(
        svg,
        "<rect x=\"{LEFT}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"#27ae60\"/><text x=\"{:.1}\" y=\"{legend_y:.1}\">leader (token)</text>\
         <line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{legend_y:.1}\" stroke=\"#1e8449\"/><text x=\"{:.1}\" y=\"{legend_y:.1}\">accepted write</text>\
         <rect x=\"{:.1}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"#8e44ad\" fill-opacity=\"0.3\"/><text x=\"{:.1}\" y=\"{legend_y:.1}\">paused</text>\
         <path d=\"M{:.1},{:.1}l8,8m0,-8l-8,8\" stroke=\"#c0392b\" stroke-width=\"2.5\"/><text x=\"{:.1}\" y=\"{legend_y:.1}\">write rejected by the fence</text>",
        legend_y - 9.0,
        LEFT + 13.0,
        LEFT + 115.0,
        LEFT + 115.0,
        legend_y - 9.0,
        LEFT + 120.0,
        LEFT + 215.0,
        legend_y - 9.0,
        LEFT + 228.0,
        LEFT + 290.0,
        legend_y - 8.0,
        LEFT + 303.0
    );
    svg.push_str("</svg>\n");
    svg
}

const STYLE: &str = "body{font-family:sans-serif;margin:24px;max-width:1000px}\
table{border-collapse:collapse;font-size:13px;margin-bottom:12px}\
td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left;vertical-align:top}\
td.n{text-align:right}pre{background:#f6f6f6;padding:8px;white-space:pre-wrap;font-size:12px}\
h2{margin-top:32px}.failed{background:#fdecea;border:1px solid #c0392b;padding:8px 12px}\
.rejected{color:#c0392b;font-weight:bold}.loud{font-weight:bold}";

/// The whole report: summary, timeline, leaderships, candidates, events and every process's
/// log (the demo's temporary directory is gone by now: this is their only record).
pub fn html(
    t: &Timeline,
    summary: &Summary,
    failure: Option<&str>,
    server_log: Option<&str>,
) -> String {
    let mut out = format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>baton demo</title>\n<style>{STYLE}</style>\n</head><body>\n<h1>baton demo</h1>\n"
    );
    let _ = writeln!(
        out,
        "<p>Backend <code>{}</code>, election <code>{}</code>, {} candidates (<code>baton run --ttl {} --requeue</code>), each job writing to a fenced store every 150 ms with its token.</p>",
        escape(&t.backend),
        super::election(),
        t.rows.len(),
        baton::format_duration(t.ttl)
    );
    if let Some(failure) = failure {
        let _ = writeln!(
            out,
            "<p class=\"failed\">The demo failed: {}</p>",
            escape(failure)
        );
    }
    out.push_str("<h2>Summary</h2>\n<table>\n");
    for (label, value) in summary.lines() {
        let class = if label.starts_with("late write") && summary.late_write.is_some() {
            " class=\"rejected\""
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "<tr><th>{}</th><td{class}>{}</td></tr>",
            escape(&label),
            escape(&value)
        );
    }
    out.push_str("</table>\n<h2>Timeline</h2>\n");
    out.push_str(&timeline_svg(t));
    out.push_str("<h2>Leaderships</h2>\n<table>\n<tr><th>token</th><th>candidate</th><th>from</th><th>to</th><th>writes accepted</th></tr>\n");
    for l in &summary.leaderships {
        let _ = writeln!(
            out,
            "<tr><td class=\"n\">{}</td><td>{}</td><td class=\"n\">{:.2}s</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            l.token,
            escape(&l.id),
            l.start.as_secs_f64(),
            l.end.map_or("end".into(), |e| format!("{:.2}s", e.as_secs_f64())),
            l.accepted
        );
    }
    out.push_str("</table>\n<h2>Candidates</h2>\n<table>\n<tr><th>candidate</th><th>pid</th><th>state</th><th>exit</th><th>accepted</th><th>rejected</th></tr>\n");
    for row in &t.rows {
        let mine = t.writes.iter().filter(|w| w.id == row.id);
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            escape(&row.id),
            row.pid,
            super::view::state(t, row).0,
            escape(row.exit.as_deref().unwrap_or("-")),
            mine.clone().filter(|w| w.accepted).count(),
            mine.filter(|w| !w.accepted).count()
        );
    }
    out.push_str("</table>\n<h2>Events</h2>\n<table>\n");
    for event in &t.events {
        let class = match (event.loud, event.text.contains("REJECTED")) {
            (_, true) => " class=\"rejected\"",
            (true, false) => " class=\"loud\"",
            _ => "",
        };
        let _ = writeln!(
            out,
            "<tr><td class=\"n\">{:.2}s</td><td{class}>{}</td></tr>",
            event.at.as_secs_f64(),
            escape(&event.text)
        );
    }
    out.push_str("</table>\n<h2>Logs</h2>\n");
    for row in &t.rows {
        let _ = writeln!(
            out,
            "<details><summary>{} (baton run and its job)</summary><pre>{}</pre></details>",
            escape(&row.id),
            escape(&row.log)
        );
    }
    if let Some(log) = server_log {
        let _ = writeln!(
            out,
            "<details><summary>embedded server</summary><pre>{}</pre></details>",
            escape(log)
        );
    }
    out.push_str("</body></html>\n");
    out
}

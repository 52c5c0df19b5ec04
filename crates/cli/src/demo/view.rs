//! The live view: on a terminal, a table of candidates and the latest events, redrawn in place
//! about ten times a second; anywhere else (CI, a pipe, a file), one plain line per event.
//!
//! Writes to stdout never fail the demo: a closed or broken stdout only loses the view.

use std::io::Write;
use std::time::{Duration, Instant};

use super::{Fate, Timeline};

/// Redraws at most this often.
const FRAME: Duration = Duration::from_millis(100);
/// Events shown under the table, at most (fewer on a short terminal: a frame taller than
/// the screen could not be redrawn in place).
const RECENT: usize = 14;

pub struct View {
    tty: bool,
    /// Lines of the frame on screen (to move back over them).
    drawn: usize,
    /// Events printed so far (plain mode).
    printed: usize,
    last: Option<Instant>,
}

impl View {
    pub fn new() -> View {
        // SAFETY: isatty only inspects the descriptor.
        let tty = unsafe { libc::isatty(libc::STDOUT_FILENO) } == 1
            && std::env::var_os("TERM").is_some_and(|t| t != "dumb");
        View {
            tty,
            drawn: 0,
            printed: 0,
            last: None,
        }
    }

    /// Shows what is new; on a terminal at most once per [`FRAME`].
    pub fn draw(&mut self, t: &Timeline) {
        if !self.tty {
            self.print_events(t);
            return;
        }
        if self.last.is_some_and(|last| last.elapsed() < FRAME) {
            return;
        }
        self.last = Some(Instant::now());
        self.redraw(t);
    }

    /// The last frame (or the remaining events), leaving the terminal as it was.
    pub fn finish(&mut self, t: &Timeline) {
        if self.tty {
            self.redraw(t);
            print("\x1b[?25h\n");
        } else {
            self.print_events(t);
        }
    }

    fn print_events(&mut self, t: &Timeline) {
        let mut out = String::new();
        for event in t.events.iter().skip(self.printed) {
            let mark = if event.loud { "!! " } else { "" };
            out.push_str(&format!(
                "[{:6.2}s] {mark}{}\n",
                event.at.as_secs_f64(),
                event.text
            ));
        }
        self.printed = t.events.len();
        if !out.is_empty() {
            print(&out);
        }
    }

    fn redraw(&mut self, t: &Timeline) {
        let frame = frame(t);
        let mut out = String::new();
        if self.drawn == 0 {
            // Hide the cursor while redrawing (shown again by `finish`).
            out.push_str("\x1b[?25l");
        } else {
            // Back to the first line of the previous frame, and clear below.
            out.push_str(&format!("\x1b[{}F\x1b[J", self.drawn));
        }
        self.drawn = frame.lines().count();
        out.push_str(&frame);
        print(&out);
    }
}

const BOLD: &str = "\x1b[1m";
const DIM: &str = "\x1b[2m";
const RED: &str = "\x1b[1;31m";
const GREEN: &str = "\x1b[32m";
const MAGENTA: &str = "\x1b[35m";
const YELLOW: &str = "\x1b[33m";
const RESET: &str = "\x1b[0m";

/// One frame of the terminal view.
fn frame(t: &Timeline) -> String {
    let (width, height) = terminal_size();
    let clip = |text: &str| -> String { text.chars().take(width.saturating_sub(1)).collect() };
    let mut out = String::new();
    let elapsed = t.end.unwrap_or_else(|| t.epoch.elapsed());
    out.push_str(&format!(
        "{BOLD}baton demo{RESET}  {}  TTL {}  {:.1}s\n",
        clip(&t.backend),
        baton::format_duration(t.ttl),
        elapsed.as_secs_f64()
    ));
    out.push_str(&format!("{BOLD}{}{RESET}\n\n", clip(&t.step)));
    out.push_str(&format!(
        "  {DIM}{:<10} {:>8}  {:<9} {:>12} {:>9} {:>9}{RESET}\n",
        "candidate", "pid", "state", "token", "accepted", "rejected"
    ));
    for row in &t.rows {
        let (state, color) = state(t, row);
        let mine = t.writes.iter().filter(|w| w.id == row.id);
        let accepted = mine.clone().filter(|w| w.accepted).count();
        let rejected = mine.clone().filter(|w| !w.accepted).count();
        let token = mine
            .clone()
            .filter(|w| w.accepted)
            .map(|w| w.token)
            .max()
            .map_or("-".to_string(), |t| t.to_string());
        let rejected_text = if rejected > 0 {
            format!("{RED}{rejected:>9}{RESET}")
        } else {
            format!("{rejected:>9}")
        };
        out.push_str(&format!(
            "  {:<10} {:>8}  {color}{:<9}{RESET} {:>12} {:>9} {rejected_text}\n",
            row.id, row.pid, state, token, accepted
        ));
    }
    out.push_str(&format!("\n  {DIM}events{RESET}\n"));
    // Header (3), table (1 + rows), the events' title (2) and the cursor's line.
    let room = height.saturating_sub(7 + t.rows.len()).clamp(3, RECENT);
    let skip = t.events.len().saturating_sub(room);
    for event in &t.events[skip..] {
        let text = clip(&format!(
            "  [{:6.2}s] {}",
            event.at.as_secs_f64(),
            event.text
        ));
        if event.loud {
            out.push_str(&format!("{YELLOW}{BOLD}{text}{RESET}\n"));
        } else {
            out.push_str(&format!("{text}\n"));
        }
    }
    out
}

/// A candidate's state as the table shows it, and its colour.
pub fn state(t: &Timeline, row: &super::Row) -> (&'static str, &'static str) {
    match row.fate {
        Fate::Killed => ("killed", RED),
        Fate::Paused => ("paused", MAGENTA),
        Fate::Stopping => ("stopping", DIM),
        Fate::Stopped => ("stopped", DIM),
        Fate::Running => {
            if t.leader.as_ref().is_some_and(|l| l.id == row.id) {
                ("leader", GREEN)
            } else {
                ("waiting", "")
            }
        }
    }
}

/// Columns and lines of the terminal (a usual size if it cannot tell).
fn terminal_size() -> (usize, usize) {
    // SAFETY: an all-zero winsize is a valid value.
    let mut size: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ fills the winsize we own.
    let ok = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut size) } == 0;
    if ok && size.ws_col > 20 && size.ws_row > 10 {
        (size.ws_col as usize, size.ws_row as usize)
    } else {
        (100, 30)
    }
}

/// Writes to stdout, ignoring errors (a closed stdout must not end the demo before it has
/// cleaned up).
pub fn print(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(text.as_bytes());
    let _ = stdout.flush();
}

//! `baton demo` end to end, on the embedded server it starts (and once with `--backend` on the
//! test backend, beside other demos): it plays every step, its
//! report holds the timeline and the rejected late write, no stale write is accepted, and
//! nothing it started survives it, also when it is stopped with SIGINT or SIGTERM mid-run.
//!
//! Each demo gets a TMPDIR of its own: every process it starts names its temporary directory
//! on its command line (the store's socket, the server's data), so a scan of /proc for that
//! path finds anything left behind.

mod common;

use common::*;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A demo run in a scratch directory of its own.
struct Demo {
    child: Child,
    dir: PathBuf,
    tmp: PathBuf,
    report: PathBuf,
    lines: mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

impl Demo {
    fn start(name: &str) -> Demo {
        Demo::start_with(name, &[])
    }

    /// [`Demo::start`] with more flags.
    fn start_with(name: &str, flags: &[&str]) -> Demo {
        let dir = scratch(name);
        let tmp = dir.join("tmp");
        std::fs::create_dir_all(&tmp).unwrap();
        let report = dir.join("report.html");
        // On its embedded server, as the README runs it: nothing else is needed.
        let mut child = baton()
            .args(["demo", "--report"])
            .arg(&report)
            .args(flags)
            .env("TMPDIR", &tmp)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = err.read_to_string(&mut text);
            text
        });
        Demo {
            child,
            dir: dir.keep(),
            tmp,
            report,
            lines,
            stderr,
        }
    }

    /// Waits for a stdout line containing `needle`; returns every line read so far.
    fn wait_line(&self, needle: &str, limit: Duration, seen: &mut Vec<String>) {
        let give_up = Instant::now() + limit;
        while !seen.iter().any(|l| l.contains(needle)) {
            let left = give_up.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => seen.push(line),
                Err(_) => panic!(
                    "no line with {needle:?} within {limit:?}:\n{}",
                    seen.join("\n")
                ),
            }
        }
    }

    /// Waits for the demo to exit (killing it after `limit`); returns its code, stdout and
    /// stderr.
    fn finish(mut self, limit: Duration, mut seen: Vec<String>) -> (Option<i32>, String, String) {
        let give_up = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() >= give_up {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("baton demo did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(2)) {
            seen.push(line);
        }
        let stderr = self.stderr.join().unwrap();
        (status.code(), seen.join("\n"), stderr)
    }
}

/// Processes whose command line mentions `path`.
fn processes_naming(path: &Path) -> Vec<String> {
    let needle = path.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u64>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(&needle) && alive(pid) {
            found.push(format!("{pid}: {cmdline}"));
        }
    }
    found
}

/// Nothing the demo started is left: no process naming its TMPDIR, and the TMPDIR is empty.
fn assert_nothing_left(tmp: &Path) {
    let left = processes_naming(tmp);
    assert!(left.is_empty(), "processes left behind: {left:#?}");
    let files: Vec<_> = std::fs::read_dir(tmp)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(files.is_empty(), "temporary files left behind: {files:?}");
}

#[test]
fn the_demo_plays_every_step_fences_the_late_write_and_leaves_nothing_behind() {
    let started = Instant::now();
    let demo = Demo::start("demo");
    let (dir, tmp, report) = (demo.dir.clone(), demo.tmp.clone(), demo.report.clone());
    let (code, stdout, stderr) = demo.finish(Duration::from_secs(90), Vec::new());
    let took = started.elapsed();
    assert_eq!(code, Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(took < Duration::from_secs(60), "the demo took {took:?}");
    // Not a terminal: plain event lines, no escape codes.
    assert!(!stdout.contains('\x1b'), "{stdout}");
    for step in ["kill -9 node-", "SIGSTOP node-", "SIGTERM node-"] {
        assert!(stdout.contains(step), "no {step:?} in:\n{stdout}");
    }
    assert!(
        stdout.contains("REJECTED BY THE FENCE"),
        "the late write is not shown:\n{stdout}"
    );
    assert!(stdout.contains("stale writes accepted: 0 "), "{stdout}");
    assert!(stdout.contains("failover (kill -9"), "{stdout}");
    assert!(stdout.contains("handoff (SIGTERM"), "{stdout}");
    assert!(
        stdout.contains(&format!("report: {}", report.display())),
        "{stdout}"
    );
    let html = std::fs::read_to_string(&report).unwrap();
    assert!(html.contains("<svg") && html.contains("</svg>"), "no chart");
    assert!(
        html.contains("rejected by the fence (the store had seen token"),
        "the report does not show the rejected late write"
    );
    assert!(html.contains("0 (no write with a token lower than an accepted one"));
    assert!(!html.contains("The demo failed"));
    assert!(!html.contains("<script"), "the report must need no scripts");
    assert_nothing_left(&tmp);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Stops a demo with `signal` once a stdout line contains `when`; it must exit promptly with
/// 128+signal and leave nothing behind.
fn stopped_mid_run(name: &str, when: &str, signal_number: libc::c_int) {
    let demo = Demo::start(name);
    let (dir, tmp) = (demo.dir.clone(), demo.tmp.clone());
    let mut seen = Vec::new();
    demo.wait_line(when, Duration::from_secs(30), &mut seen);
    // The scan below can see the demo's processes (else "nothing left" would prove nothing).
    assert!(
        processes_naming(&tmp).len() >= 5,
        "{:#?}",
        processes_naming(&tmp)
    );
    let pid = demo.child.id() as i32;
    signal(pid, signal_number);
    let stopped = Instant::now();
    let (code, stdout, stderr) = demo.finish(Duration::from_secs(15), seen);
    let took = stopped.elapsed();
    assert_eq!(
        code,
        Some(128 + signal_number),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(took < Duration::from_secs(10), "it took {took:?} to stop");
    assert!(
        stderr.contains("every process it started is stopped"),
        "{stderr}"
    );
    assert_nothing_left(&tmp);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn ctrl_c_while_a_leader_is_paused_stops_everything_promptly() {
    // The hardest moment: three processes of one candidate are stopped (SIGSTOP).
    stopped_mid_run("demo-int", "SIGSTOP node-", libc::SIGINT);
}

#[test]
fn sigterm_right_after_the_first_leader_stops_everything_promptly() {
    stopped_mid_run("demo-term", "leads: its job writes", libc::SIGTERM);
}

#[test]
fn bad_flags_are_one_line_and_exit_2() {
    for flags in [
        &["--candidates", "2"][..],
        &["--ttl", "0s"],
        &["--ttl", "1 fortnight"],
        &["--ttl", "1500ms"],
        &["--backend", "foo://x"],
        &["--backend", "memory://x"],
        &["--report", "/nonexistent-dir/report.html"],
        // A directory nobody may create files in (not even root): told at once, not after
        // the whole demo has run.
        &["--report", "/sys/baton-demo-report.html"],
    ] {
        let output = baton()
            .arg("demo")
            .args(flags)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{flags:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{flags:?}: {stderr}");
        assert!(stderr.starts_with("baton: error: "), "{flags:?}: {stderr}");
    }
}

/// A step that fails (here the demo's own server is killed with SIGKILL under it) ends the demo
/// with one line on stderr naming the failure and where the report so far is, exit code 1,
/// and nothing left behind.
#[test]
fn a_failed_step_is_one_line_exit_1_and_a_report() {
    let demo = Demo::start("demo-failed");
    let (dir, tmp, report) = (demo.dir.clone(), demo.tmp.clone(), demo.report.clone());
    let mut seen = Vec::new();
    demo.wait_line("leads: its job writes", Duration::from_secs(30), &mut seen);
    let server = seen
        .iter()
        .find_map(|line| {
            let rest = line.split("embedded server (pid ").nth(1)?;
            rest.split(')').next()?.parse::<i32>().ok()
        })
        .unwrap_or_else(|| panic!("no server pid in:\n{}", seen.join("\n")));
    signal(server, libc::SIGKILL);
    let (code, stdout, stderr) = demo.finish(Duration::from_secs(60), seen);
    assert_eq!(code, Some(1), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("baton: error: "), "{stderr}");
    assert!(
        stderr.contains(&format!("the report so far is in {}", report.display())),
        "{stderr}"
    );
    let html = std::fs::read_to_string(&report).unwrap();
    assert!(
        html.contains("The demo failed"),
        "the report does not say it failed"
    );
    assert_nothing_left(&tmp);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A closed terminal or SSH session (SIGHUP) stops the demo as Ctrl-C does: exit 129, every
/// process and its temporary directory gone (it used to die of the signal and leave the
/// directory).
#[test]
fn sighup_stops_everything_and_leaves_no_directory() {
    stopped_mid_run("demo-hup", "leads: its job writes", libc::SIGHUP);
}

/// On a backend given with `--backend`, which other demos may use at the same time, the demo
/// campaigns in an election of its own (`demo-PID`): a candidate already leading the election
/// every demo used before ("demo", here with one of the demo's own ids) is not part of it, and
/// the demo plays every step (before, its candidates queued behind that leader and the first
/// step timed out; two demos counted each other's leaderships).
#[test]
fn on_a_shared_backend_the_demo_campaigns_in_an_election_of_its_own() {
    /// Stopped (SIGKILL to its group) even when an assertion fails first.
    struct Other(Child);
    impl Drop for Other {
        fn drop(&mut self) {
            if matches!(self.0.try_wait(), Ok(None)) {
                signal(-(self.0.id() as i32), libc::SIGKILL);
                let _ = self.0.wait();
            }
        }
    }
    let mut other = Other(
        baton()
            .args([
                "run",
                "--backend",
                &url(),
                "--election",
                "demo",
                "--id",
                "node-1",
            ])
            .args(["--ttl", "2s", "--", "sleep", "1000"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("the other leader", Duration::from_secs(10), || {
        let output = baton()
            .args(["leader", "--backend", &url(), "--election", "demo"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&output.stdout)
            .contains("\"node-1\"")
            .then_some(())
    });
    let demo = Demo::start_with("demo-shared", &["--backend", &url()]);
    let (dir, tmp) = (demo.dir.clone(), demo.tmp.clone());
    let election = format!("election demo-{}", demo.child.id());
    let (code, stdout, stderr) = demo.finish(Duration::from_secs(90), Vec::new());
    signal(other.0.id() as i32, libc::SIGTERM);
    let status = other.0.wait().unwrap();
    assert_eq!(code, Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains(&election), "no {election:?} in:\n{stdout}");
    assert!(stdout.contains("stale writes accepted: 0 "), "{stdout}");
    assert_eq!(
        status.code(),
        Some(128 + libc::SIGTERM),
        "the other leader: {status}"
    );
    assert_nothing_left(&tmp);
    std::fs::remove_dir_all(dir).unwrap();
}

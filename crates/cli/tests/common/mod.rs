//! Helpers shared by the process-level tests.
// Each test binary uses a different subset.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub fn etcd() -> String {
    std::env::var("BATON_TEST_ETCD").expect(
        "BATON_TEST_ETCD is not set: run the tests with scripts/test, which starts a private etcd",
    )
}

pub fn url() -> String {
    format!("etcd://{}/baton-cli-test", etcd())
}

pub fn baton() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_baton"));
    command.env_remove("BATON_BACKEND");
    command.env_remove("BATON_ELECTION");
    command.env_remove("BATON_ID");
    command
}

pub fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{name}-{}-{nanos}", std::process::id())
}

pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(unique(&format!("baton-{name}")));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Waits until `check` returns `Some`, failing after `limit`.
pub fn wait_for<T>(what: &str, limit: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub fn read_number(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether a process exists and is not a zombie.
pub fn alive(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        }
        Err(_) => false,
    }
}

pub fn process_group(pid: u64) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = stat.rsplit(')').next().unwrap();
    // Fields after the command: state ppid pgrp ...
    after.split_whitespace().nth(2).unwrap().parse().unwrap()
}

pub fn signal(pid: i32, signal: libc::c_int) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// Deletes every key of `election` behind baton's back, as an operator with etcdctl would.
pub fn delete_election_keys(election: &str) {
    let status = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", &etcd(), "del", "--prefix"])
        .arg(format!("/baton-cli-test/{election}/"))
        .stdout(Stdio::null())
        .status()
        .expect("etcdctl (from etcd-client) must be installed; scripts/test installs it");
    assert!(status.success());
}

/// `baton run --backend URL --election ELECTION --ttl 2s EXTRA.. -- sh -c SCRIPT`.
pub fn run_script(election: &str, extra: &[&str], script: &str) -> Command {
    let mut command = baton();
    command
        .args([
            "run",
            "--backend",
            &url(),
            "--election",
            election,
            "--ttl",
            "2s",
        ])
        .args(extra)
        .args(["--", "sh", "-c", script]);
    command
}

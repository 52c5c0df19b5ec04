//! Containment with real processes against a real etcd: commands that leave their process
//! group (`timeout`), start a new session and exit at once (`setsid -f`), use job control, or
//! double-fork, under every way a term ends (SIGTERM, kill -9 of `baton run`, kill -9 of the
//! guard, a lost lease, the command's own exit). Nothing of the command may be alive one second
//! later, and the successor's command must not start while any of it lives.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How the command gets its long-lived process out of reach of a process-group kill. Every
/// process of the command appends its pid to `PIDS`; `LIFE` is how long the leftovers live.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// GNU timeout puts itself (and its child) into a new process group.
    Timeout,
    /// `setsid -f` starts a new session; the process baton started exits at once.
    SetsidFork,
    /// Job control puts a background job into its own process group.
    JobControl,
    /// fork, setsid, fork: the daemon's parent exits, so it is re-parented.
    DoubleFork,
}

impl Shape {
    fn script(self, pids: &Path, life: u32) -> String {
        let p = pids.display();
        match self {
            Shape::Timeout => format!(
                "echo $$ >> {p}; timeout 600 sh -c 'echo $PPID >> {p}; echo $$ >> {p}; exec sleep {life}'"
            ),
            Shape::SetsidFork => {
                format!("echo $$ >> {p}; setsid -f sh -c 'echo $$ >> {p}; exec sleep {life}'")
            }
            Shape::JobControl => format!(
                "echo $$ >> {p}; set -m; sh -c 'echo $$ >> {p}; exec sleep {life}' & wait"
            ),
            Shape::DoubleFork => format!(
                "echo $$ >> {p}; ( setsid sh -c 'sh -c \"echo \\$\\$ >> {p}; exec sleep {life}\" & echo $$ >> {p}' & ); sleep {life}"
            ),
        }
    }

    /// How many pids the command records once all of it is running.
    fn processes(self) -> usize {
        match self {
            Shape::Timeout => 3,
            Shape::SetsidFork | Shape::JobControl => 2,
            Shape::DoubleFork => 3,
        }
    }
}

/// How the term ends.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ending {
    Sigterm,
    KillSupervisor,
    KillGuard,
    LeaseLost,
    OwnExit,
}

fn pids_in(path: &Path) -> Vec<u64> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// `baton run` of `script` with stderr to `dir/NAME.stderr`.
fn start(election: &str, dir: &Path, name: &str, extra: &[&str], script: &str) -> Child {
    let stderr = std::fs::File::create(dir.join(format!("{name}.stderr"))).unwrap();
    run_script(
        election,
        &[&["--id", name, "--grace", "1s"], extra].concat(),
        script,
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(stderr)
    .spawn()
    .unwrap()
}

/// `a`, running `sleep 600` as the election's leader, once its command has started.
fn start_leader(election: &str, dir: &Path) -> Child {
    let a = start(election, dir, "a", &[], "exec sleep 600");
    wait_leading(dir, "a");
    a
}

/// Waits until `NAME.stderr` in `dir` says its command started.
fn wait_leading(dir: &Path, name: &str) {
    wait_for(&format!("{name} leads"), Duration::from_secs(5), || {
        std::fs::read_to_string(dir.join(format!("{name}.stderr")))
            .unwrap_or_default()
            .contains("command started")
            .then_some(())
    });
}

/// The successor's script: it records, the moment it starts, whether any of `pids` is alive.
fn successor_script(dir: &Path, pids: &Path) -> String {
    format!(
        "for p in $(cat {pids}); do s=$(cut -d' ' -f3 /proc/$p/stat 2>/dev/null); \
         if [ -n \"$s\" ] && [ \"$s\" != Z ]; then echo $p >> {d}/overlap; fi; done; \
         echo $BATON_TOKEN > {d}/b.token; exec sleep 600",
        pids = pids.display(),
        d = dir.display()
    )
}

fn guard_of(supervisor: u32) -> i32 {
    wait_for("the guard", Duration::from_secs(2), || {
        let children =
            std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children"))
                .ok()?;
        children.split_whitespace().next()?.parse().ok()
    })
}

fn check(shape: Shape, ending: Ending) {
    let name = format!("{shape:?}-{ending:?}").to_lowercase();
    let dir = scratch(&name);
    let election = unique(&name);
    let pids = dir.join("a.pids");
    let life = if ending == Ending::OwnExit { 2 } else { 600 };
    let mut a = start(&election, &dir, "a", &[], &shape.script(&pids, life));
    wait_for("a's command runs", Duration::from_secs(5), || {
        (pids_in(&pids).len() >= shape.processes()).then_some(())
    });
    // Every process of a's command had started by now.
    let running_at = Instant::now();
    let mut b = start(&election, &dir, "b", &[], &successor_script(&dir, &pids));
    wait_queued(&election, 2);
    assert!(!dir.join("b.token").exists(), "b must wait while a leads");
    match ending {
        Ending::Sigterm => signal(a.id() as i32, libc::SIGTERM),
        Ending::KillSupervisor => signal(a.id() as i32, libc::SIGKILL),
        Ending::KillGuard => signal(guard_of(a.id()), libc::SIGKILL),
        Ending::LeaseLost => delete_leader_key(&election),
        Ending::OwnExit => {}
    }
    let limit = if ending == Ending::OwnExit {
        Duration::from_secs(4)
    } else {
        Duration::from_millis(1500)
    };
    let all = pids_in(&pids);
    wait_for(
        &format!("every process of a's command gone ({all:?})"),
        limit,
        || all.iter().all(|&p| !alive(p)).then_some(()),
    );
    if ending == Ending::OwnExit {
        // The term lasted as long as the leftovers did (they live 2 s).
        assert!(running_at.elapsed() >= Duration::from_millis(1500));
    }
    let status = wait_for("a exits", Duration::from_secs(3), || a.try_wait().unwrap());
    let expected = match ending {
        Ending::Sigterm => Some(143),
        Ending::KillSupervisor => None,
        Ending::KillGuard | Ending::LeaseLost => Some(3),
        Ending::OwnExit => Some(0),
    };
    let stderr = std::fs::read_to_string(dir.join("a.stderr")).unwrap_or_default();
    assert_eq!(status.code(), expected, "{stderr}");
    wait_for("b runs", Duration::from_secs(8), || {
        dir.join("b.token").exists().then_some(())
    });
    let overlap = std::fs::read_to_string(dir.join("overlap")).unwrap_or_default();
    assert!(overlap.is_empty(), "b started while a's {overlap} lived");
    signal(b.id() as i32, libc::SIGTERM);
    let _ = b.wait();
}

macro_rules! matrix {
    ($($name:ident: $shape:ident, $ending:ident;)*) => {
        $(
            #[test]
            fn $name() {
                check(Shape::$shape, Ending::$ending);
            }
        )*
    };
}

matrix! {
    timeout_sigterm: Timeout, Sigterm;
    timeout_kill_supervisor: Timeout, KillSupervisor;
    timeout_kill_guard: Timeout, KillGuard;
    timeout_lease_lost: Timeout, LeaseLost;
    timeout_own_exit: Timeout, OwnExit;
    setsid_sigterm: SetsidFork, Sigterm;
    setsid_kill_supervisor: SetsidFork, KillSupervisor;
    setsid_kill_guard: SetsidFork, KillGuard;
    setsid_lease_lost: SetsidFork, LeaseLost;
    setsid_own_exit: SetsidFork, OwnExit;
    job_control_sigterm: JobControl, Sigterm;
    job_control_kill_supervisor: JobControl, KillSupervisor;
    job_control_kill_guard: JobControl, KillGuard;
    job_control_lease_lost: JobControl, LeaseLost;
    job_control_own_exit: JobControl, OwnExit;
    double_fork_sigterm: DoubleFork, Sigterm;
    double_fork_kill_supervisor: DoubleFork, KillSupervisor;
    double_fork_kill_guard: DoubleFork, KillGuard;
    double_fork_lease_lost: DoubleFork, LeaseLost;
    double_fork_own_exit: DoubleFork, OwnExit;
}

/// The weaker mechanisms hold too: the same daemonizing command under cgroup v1 freezer and
/// under the subreaper alone, with the supervisor and then the guard killed.
#[test]
fn every_containment_mode_holds_a_daemon() {
    for mode in ["cgroup", "freezer", "subreaper"] {
        for kill_guard in [false, true] {
            let name = format!("mode-{mode}-{kill_guard}");
            let dir = scratch(&name);
            let election = unique(&name);
            let pids = dir.join("a.pids");
            let script = Shape::SetsidFork.script(&pids, 600);
            let mut a = start(&election, &dir, "a", &["--containment", mode], &script);
            wait_for("a's command runs", Duration::from_secs(5), || {
                (pids_in(&pids).len() >= 2).then_some(())
            });
            let stderr = std::fs::read_to_string(dir.join("a.stderr")).unwrap();
            let said = match mode {
                "cgroup" => "containment: cgroup v2",
                "freezer" => "containment: cgroup v1 freezer",
                _ => "containment: process tree under child subreapers",
            };
            assert!(stderr.contains(said), "{mode}: {stderr}");
            if kill_guard {
                signal(guard_of(a.id()), libc::SIGKILL);
            } else {
                signal(a.id() as i32, libc::SIGKILL);
            }
            let all = pids_in(&pids);
            wait_for(
                &format!("{mode}: all gone"),
                Duration::from_millis(1500),
                || all.iter().all(|&p| !alive(p)).then_some(()),
            );
            let _ = a.wait();
            // The cgroup is removed by whoever survived, supervisor or guard.
            wait_for(
                &format!("{mode}: no cgroup left"),
                Duration::from_secs(2),
                || (!cgroup_dirs(a.id()).iter().any(|d| d.exists())).then_some(()),
            );
        }
    }
}

/// A command that daemonizes a worker and exits at once: in every containment mode (with the
/// subreaper alone, the guard's "no child left" is the only proof), the term lasts until the
/// detached worker has finished, and the waiter's command starts only after that.
#[test]
fn a_detached_worker_holds_the_term_until_it_ends_in_every_mode() {
    for mode in ["cgroup", "freezer", "subreaper"] {
        let name = format!("detached-{mode}");
        let dir = scratch(&name);
        let election = unique(&name);
        let d = dir.display();
        let a_script = format!(
            "setsid -f sh -c 'echo $$ > {d}/worker.pid; sleep 0.8; date +%s%N > {d}/worker.end'; exit 0"
        );
        let mut a = start(&election, &dir, "a", &["--containment", mode], &a_script);
        let worker = wait_for(
            &format!("{mode}: a's worker runs"),
            Duration::from_secs(5),
            || read_number(&dir.join("worker.pid")),
        );
        let b_script = format!("date +%s%N > {d}/b.start; exec sleep 30");
        let mut b = start(&election, &dir, "b", &["--containment", mode], &b_script);
        let started = wait_for(&format!("{mode}: b runs"), Duration::from_secs(10), || {
            read_number(&dir.join("b.start"))
        });
        let ended = read_number(&dir.join("worker.end"))
            .unwrap_or_else(|| panic!("{mode}: b started before a's worker ended"));
        assert!(
            started > ended,
            "{mode}: b started at {started}, the worker ended at {ended}"
        );
        assert!(!alive(worker), "{mode}: the worker outlived the term");
        assert_eq!(a.wait().unwrap().code(), Some(0), "{mode}");
        signal(b.id() as i32, libc::SIGTERM);
        let _ = b.wait();
    }
}

fn cgroup_dirs(pid: u32) -> Vec<PathBuf> {
    [
        "/sys/fs/cgroup/unified",
        "/sys/fs/cgroup/freezer",
        "/sys/fs/cgroup",
    ]
    .iter()
    .map(|root| PathBuf::from(root).join(format!("baton-{pid}")))
    .collect()
}

/// A stopped guard (SIGSTOP for 3 × TTL) is treated as failed: its command is killed within
/// about a second, `baton run` reports the loss (exit 3), and the successor starts only after.
#[test]
fn a_stopped_guard_gets_its_command_killed() {
    let dir = scratch("stopped-guard");
    let election = unique("stopped-guard");
    let pids = dir.join("a.pids");
    let mut a = start(
        &election,
        &dir,
        "a",
        &[],
        &Shape::SetsidFork.script(&pids, 600),
    );
    wait_for("a runs", Duration::from_secs(5), || {
        (pids_in(&pids).len() >= 2).then_some(())
    });
    let mut b = start(&election, &dir, "b", &[], &successor_script(&dir, &pids));
    wait_queued(&election, 2);
    let guard = guard_of(a.id());
    signal(guard, libc::SIGSTOP);
    let all = pids_in(&pids);
    wait_for("a's command killed", Duration::from_secs(3), || {
        all.iter().all(|&p| !alive(p)).then_some(())
    });
    let status = wait_for("a exits", Duration::from_secs(3), || a.try_wait().unwrap());
    let stderr = std::fs::read_to_string(dir.join("a.stderr")).unwrap();
    assert_eq!(status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("guard stopped responding"), "{stderr}");
    wait_for("b runs", Duration::from_secs(8), || {
        dir.join("b.token").exists().then_some(())
    });
    assert!(!dir.join("overlap").exists());
    // The stopped guard itself was killed too (SIGKILL ends a stopped process).
    assert!(!alive(guard as u64));
    signal(b.id() as i32, libc::SIGTERM);
    let _ = b.wait();
}

/// stderr closed by its reader (`baton run ... 2>&1 | head -n1`): writing notes must neither
/// kill nor block the supervisor. It still stops its command on loss and exits 3.
#[test]
fn closed_stderr_does_not_kill_the_supervisor() {
    let dir = scratch("closed-stderr");
    let election = unique("closed-stderr");
    let pids = dir.join("a.pids");
    let mut a = run_script(
        &election,
        &["--id", "a"],
        &Shape::SetsidFork.script(&pids, 600),
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Read the first line, then close the pipe, as `head -n1` does.
    let mut stderr = a.stderr.take().unwrap();
    let mut first = Vec::new();
    let mut byte = [0u8; 1];
    use std::io::Read;
    while stderr.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {
        first.push(byte[0]);
    }
    drop(stderr);
    wait_for("a runs", Duration::from_secs(5), || {
        (pids_in(&pids).len() >= 2).then_some(())
    });
    // Losing leadership makes it write notes into the closed pipe.
    delete_election_keys(&election);
    let all = pids_in(&pids);
    wait_for("a's command killed", Duration::from_millis(1500), || {
        all.iter().all(|&p| !alive(p)).then_some(())
    });
    let status = wait_for("a exits", Duration::from_secs(3), || a.try_wait().unwrap());
    assert_eq!(
        status.code(),
        Some(3),
        "exit {status:?} (101 would be a panic)"
    );
}

/// stderr a pipe that is full and that nobody reads (a log shipper that hung): writing to it
/// would block, and it must never hold up renewals. The command keeps its term for three TTLs;
/// a loss still kills it at once and `baton run` exits 3, its notes left unsaid.
#[test]
fn a_full_stderr_nobody_reads_holds_up_nothing() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let dir = scratch("full-stderr");
    let election = unique("full-stderr");
    let pids = dir.join("a.pids");
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the array we own with two new descriptors, which we then own.
    let (_unread, full) = unsafe {
        assert_eq!(
            libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK),
            0
        );
        (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
    };
    let chunk = [b'x'; 4096];
    // SAFETY: writes from a buffer we own, then fcntl, on the descriptor we own.
    unsafe {
        while libc::write(fds[1], chunk.as_ptr().cast(), chunk.len()) > 0 {}
        // Blocking again, as a terminal's or a shipper's pipe is: a write would hang.
        let flags = libc::fcntl(fds[1], libc::F_GETFL);
        libc::fcntl(fds[1], libc::F_SETFL, flags & !libc::O_NONBLOCK);
    }
    let mut a = run_script(
        &election,
        &["--id", "a", "--ttl", "2s"],
        &Shape::SetsidFork.script(&pids, 600),
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::from(full))
    .spawn()
    .unwrap();
    wait_for("a runs", Duration::from_secs(5), || {
        (pids_in(&pids).len() >= 2).then_some(())
    });
    let all = pids_in(&pids);
    // The script exits at once; the worker it forked away holds the term.
    let worker = *all.last().unwrap();
    std::thread::sleep(Duration::from_secs(6));
    assert!(alive(worker), "the term ended within 3 TTLs");
    assert_eq!(a.try_wait().unwrap(), None);
    delete_election_keys(&election);
    wait_for("a's command killed", Duration::from_millis(1500), || {
        all.iter().all(|&p| !alive(p)).then_some(())
    });
    let status = wait_for("a exits", Duration::from_secs(5), || a.try_wait().unwrap());
    assert_eq!(status.code(), Some(3), "exit {status:?}");
}

/// Stray signals to the guard (`pkill -USR1 -f JOB` for log rotation matches its command line
/// too): the job keeps running under the same token, nothing is reported as the command's exit.
#[test]
fn stray_signals_to_the_guard_change_nothing() {
    let dir = scratch("stray");
    let election = unique("stray");
    let token_file = dir.join("token");
    let script = format!(
        "echo $BATON_TOKEN >> {}; echo $$ > {}/pid; exec sleep 600",
        token_file.display(),
        dir.display()
    );
    let mut a = start(&election, &dir, "a", &["--requeue"], &script);
    let pid = wait_for("a runs", Duration::from_secs(5), || {
        read_number(&dir.join("pid"))
    });
    let guard = guard_of(a.id());
    for stray in [
        libc::SIGUSR1,
        libc::SIGHUP,
        libc::SIGUSR2,
        libc::SIGTERM,
        libc::SIGINT,
    ] {
        signal(guard, stray);
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        alive(pid),
        "{}",
        std::fs::read_to_string(dir.join("a.stderr")).unwrap()
    );
    assert!(alive(guard as u64));
    assert_eq!(
        std::fs::read_to_string(&token_file)
            .unwrap()
            .lines()
            .count(),
        1
    );
    assert!(a.try_wait().unwrap().is_none());
    signal(a.id() as i32, libc::SIGTERM);
    let _ = a.wait();
}

/// The guard's dead-man kill (the supervisor frozen past its deadline) is a loss, reported as
/// such: with `--requeue` the supervisor, once resumed, campaigns again and reruns the command
/// with a larger token instead of exiting as if the command had ended.
#[test]
fn a_dead_man_kill_is_a_loss_and_requeue_campaigns_again() {
    let dir = scratch("deadman");
    let election = unique("deadman");
    let token_file = dir.join("tokens");
    let script = format!(
        "echo $BATON_TOKEN >> {}; exec sleep 600",
        token_file.display()
    );
    let mut a = start(&election, &dir, "a", &["--requeue"], &script);
    let tokens = |n: usize| {
        let text = std::fs::read_to_string(&token_file).unwrap_or_default();
        let found: Vec<u64> = text.lines().filter_map(|l| l.parse().ok()).collect();
        (found.len() >= n).then_some(found)
    };
    wait_for("first term", Duration::from_secs(5), || tokens(1));
    signal(a.id() as i32, libc::SIGSTOP);
    // The guard kills the command at the local deadline (< TTL); stay stopped past it.
    std::thread::sleep(Duration::from_secs(3));
    signal(a.id() as i32, libc::SIGCONT);
    let found = wait_for("second term", Duration::from_secs(8), || tokens(2));
    assert!(found[1] > found[0], "{found:?}");
    let stderr = std::fs::read_to_string(dir.join("a.stderr")).unwrap();
    assert!(stderr.contains("leadership lost"), "{stderr}");
    assert!(a.try_wait().unwrap().is_none(), "{stderr}");
    signal(a.id() as i32, libc::SIGTERM);
    let _ = a.wait();
}

/// A chaos run: three `baton run --requeue` nodes whose commands write to a fenced register
/// every 20 ms (and each leave a daemon behind), under a seeded sequence of faults on the
/// current leader: kill -9 of `baton run`, kill -9 of its guard, SIGTERM, and SIGSTOP of its
/// whole tree for 3 × TTL. The fence never accepts a stale token; outside pauses no stale write
/// is even attempted (nothing of a deposed leader acts beside its successor); after a pause the
/// stale writes are rejected; and at the end nothing of any command is left.
#[test]
fn chaos_keeps_zero_stale_writes_accepted_and_zero_orphans() {
    let seed: u64 = std::env::var("BATON_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("chaos seed {seed} (replay with BATON_CHAOS_SEED={seed})");
    let mut rng = seed | 1;
    let mut next = move || {
        // xorshift64*: deterministic per seed.
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let dir = scratch("chaos");
    let election = unique("chaos");
    let d = dir.display();
    let script = |node: usize| {
        format!(
            "echo $$ >> {d}/pids; setsid -f sh -c 'echo $$ >> {d}/pids; exec sleep 600'; \
             while true; do flock {d}/reg.lock sh -c 'h=$(cat {d}/reg 2>/dev/null || echo 0); \
             if [ $BATON_TOKEN -ge $h ]; then echo $BATON_TOKEN > {d}/reg; echo ok $BATON_TOKEN {node} >> {d}/log; \
             else echo stale $BATON_TOKEN {node} >> {d}/log; fi'; sleep 0.02; done"
        )
    };
    let spawn = |node: usize| -> Child {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("n{node}.stderr")))
            .unwrap();
        run_script(
            &election,
            &["--id", &format!("n{node}"), "--requeue", "--grace", "500ms"],
            &script(node),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap()
    };
    let mut nodes: Vec<Child> = (0..3).map(spawn).collect();
    let log = |line: &str| {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("log"))
            .unwrap();
        writeln!(file, "{line}").unwrap();
    };
    let leader = || -> Option<usize> {
        let text = std::fs::read_to_string(dir.join("log")).ok()?;
        let last = text.lines().rev().find(|l| l.starts_with("ok "))?;
        last.split_whitespace().nth(2)?.parse().ok()
    };
    for round in 0..6 {
        // Wait for a leader to be writing.
        let before = std::fs::read_to_string(dir.join("log"))
            .unwrap_or_default()
            .len();
        wait_for("a leader writes", Duration::from_secs(10), || {
            let now = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
            (now.len() > before + 40).then_some(())
        });
        let node = leader().unwrap();
        let fault = next() % 4;
        log(&format!("round {round} fault {fault} node {node}"));
        let supervisor = nodes[node].id() as i32;
        match fault {
            0 => signal(supervisor, libc::SIGKILL),
            1 => signal(guard_of(supervisor as u32), libc::SIGKILL),
            2 => signal(supervisor, libc::SIGTERM),
            _ => {
                let tree: Vec<i32> = std::iter::once(supervisor)
                    .chain(descendants(supervisor))
                    .collect();
                for &pid in &tree {
                    signal(pid, libc::SIGSTOP);
                }
                std::thread::sleep(Duration::from_secs(6));
                for &pid in &tree {
                    signal(pid, libc::SIGCONT);
                }
            }
        }
        // Restart a node whose `baton run` ended.
        std::thread::sleep(Duration::from_millis(500));
        for (index, child) in nodes.iter_mut().enumerate() {
            if child.try_wait().unwrap().is_some() {
                *child = spawn(index);
            }
        }
        log(&format!("end {round}"));
    }
    for child in &nodes {
        signal(child.id() as i32, libc::SIGTERM);
    }
    for child in &mut nodes {
        let _ = child.wait();
    }
    let text = std::fs::read_to_string(dir.join("log")).unwrap();
    let mut highest = 0;
    let mut pausing = false;
    let mut rejected_in_pauses = 0;
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words[0] {
            "round" => pausing = words[3] == "3",
            "ok" => {
                let token: u64 = words[1].parse().unwrap();
                assert!(
                    token >= highest,
                    "seed {seed}: stale write accepted: {line}"
                );
                highest = token;
            }
            "stale" => {
                assert!(
                    pausing,
                    "seed {seed}: a deposed leader acted beside its successor: {line}\n{text}"
                );
                rejected_in_pauses += 1;
            }
            _ => {}
        }
    }
    eprintln!("seed {seed}: {rejected_in_pauses} stale writes after pauses, all rejected");
    let pids = pids_in(&dir.join("pids"));
    wait_for("no orphans", Duration::from_secs(2), || {
        pids.iter().all(|&p| !alive(p)).then_some(())
    });
}

/// A process chain that re-spawns itself in the background and exits, faster than a walk of
/// /proc can follow (the idiom "restart myself with `sh $0 &`"), under the weakest mode: the
/// guard's "no child left" answer catches it; once `baton run` has exited nothing writes.
#[test]
fn a_self_respawning_chain_dies_with_the_term_even_under_the_subreaper() {
    let dir = scratch("respawn");
    let election = unique("respawn");
    let chain = dir.join("chain.sh");
    let beats = dir.join("beats");
    let stop = dir.join("stop");
    std::fs::write(
        &chain,
        format!(
            "[ -e {stop} ] && exit 0\necho x >> {beats}\nsh {chain} &\n",
            stop = stop.display(),
            beats = beats.display(),
            chain = chain.display()
        ),
    )
    .unwrap();
    let script = format!("sh {}; sleep 600", chain.display());
    let mut a = start(
        &election,
        &dir,
        "a",
        &["--containment", "subreaper"],
        &script,
    );
    wait_for("the chain runs", Duration::from_secs(5), || {
        (std::fs::metadata(&beats).map_or(0, |m| m.len()) > 100).then_some(())
    });
    signal(a.id() as i32, libc::SIGTERM);
    let status = wait_for("a exits", Duration::from_secs(5), || a.try_wait().unwrap());
    let stopped_at = std::fs::metadata(&beats).unwrap().len();
    std::thread::sleep(Duration::from_millis(500));
    let later = std::fs::metadata(&beats).unwrap().len();
    // Bound the chain in any case before asserting.
    std::fs::write(&stop, "").unwrap();
    assert_eq!(status.code(), Some(143));
    assert_eq!(
        later, stopped_at,
        "the chain kept running after the term ended"
    );
}

/// A command that reads the terminal (started from one, as a user would): it runs in the
/// terminal's foreground group, reads its line, and is not stopped by SIGTTIN.
#[test]
fn a_command_reads_the_terminal() {
    let dir = scratch("tty");
    let election = unique("tty");
    let got = dir.join("got");
    let inner = format!(
        "{baton} run --backend {url} --election {election} --ttl 2s -- sh -c 'read x; echo $x > {got}'",
        baton = env!("CARGO_BIN_EXE_baton"),
        url = url(),
        got = got.display()
    );
    let mut script = std::process::Command::new("script")
        .args(["-qfec", &inner, "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("script (util-linux) is installed");
    std::thread::sleep(Duration::from_secs(1));
    use std::io::Write;
    script
        .stdin
        .as_mut()
        .unwrap()
        .write_all(b"hello\n")
        .unwrap();
    let status = wait_for("baton exits", Duration::from_secs(5), || {
        script.try_wait().unwrap()
    });
    assert_eq!(std::fs::read_to_string(&got).unwrap_or_default(), "hello\n");
    assert_eq!(status.code(), Some(0));
}

/// SIGHUP (a closed terminal or SSH session) stops the command and resigns like SIGTERM: the
/// successor starts at once, not a TTL later (the TTL is 10 s: a lease that ran out would have
/// taken 6.7 s at the least).
#[test]
fn sighup_resigns_at_once() {
    let dir = scratch("hup");
    let election = unique("hup");
    let pids = dir.join("a.pids");
    let ttl: &[&str] = &["--ttl", "10s"];
    let mut a = start(
        &election,
        &dir,
        "a",
        ttl,
        &Shape::SetsidFork.script(&pids, 600),
    );
    wait_for("a runs", Duration::from_secs(5), || {
        (pids_in(&pids).len() >= 2).then_some(())
    });
    let mut b = start(&election, &dir, "b", ttl, &successor_script(&dir, &pids));
    wait_queued(&election, 2);
    signal(a.id() as i32, libc::SIGHUP);
    wait_for("b runs well within a TTL", Duration::from_secs(5), || {
        dir.join("b.token").exists().then_some(())
    });
    let status = wait_for("a exits", Duration::from_secs(3), || a.try_wait().unwrap());
    assert_eq!(status.code(), Some(129));
    assert!(!dir.join("overlap").exists());
    signal(b.id() as i32, libc::SIGTERM);
    let _ = b.wait();
}

/// A command that is stopped (SIGSTOP, Ctrl-Z) when its term ends gracefully gets SIGCONT
/// with its SIGTERM: its handler runs and cleans up, and the successor starts at once. Before,
/// the stopped command sat out the whole grace (10 s here) and was killed without cleaning up.
#[test]
fn a_stopped_command_gets_its_sigterm_at_once() {
    let dir = scratch("stopped-cmd");
    let election = unique("stopped-cmd");
    let pids = dir.join("a.pids");
    let script = format!(
        "trap 'echo cleaned > {d}/cleaned; exit 0' TERM; echo $$ > {p}; \
         while :; do sleep 0.1; done",
        d = dir.display(),
        p = pids.display()
    );
    let slow: &[&str] = &["--id", "a", "--grace", "10s", "--ttl", "10s"];
    let mut a = run_script(&election, slow, &script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let command = wait_for("a runs", Duration::from_secs(5), || {
        pids_in(&pids).first().copied()
    });
    let mut b = start(&election, &dir, "b", &[], &successor_script(&dir, &pids));
    wait_queued(&election, 2);
    signal(command as i32, libc::SIGSTOP);
    signal(a.id() as i32, libc::SIGTERM);
    wait_for(
        "b runs well within the grace",
        Duration::from_secs(3),
        || dir.join("b.token").exists().then_some(()),
    );
    let status = wait_for("a exits", Duration::from_secs(3), || a.try_wait().unwrap());
    assert_eq!(status.code(), Some(143));
    assert!(dir.join("cleaned").exists(), "the handler never ran");
    assert!(!dir.join("overlap").exists());
    signal(b.id() as i32, libc::SIGTERM);
    let _ = b.wait();
}

/// Signals with no handler whose default is to terminate (SIGVTALRM, realtime signals) do not
/// end the guard either.
#[test]
fn uncommon_signals_to_the_guard_change_nothing() {
    let dir = scratch("uncommon");
    let election = unique("uncommon");
    let script = format!("echo $$ > {}/pid; exec sleep 600", dir.display());
    let mut a = start(&election, &dir, "a", &[], &script);
    let pid = wait_for("a runs", Duration::from_secs(5), || {
        read_number(&dir.join("pid"))
    });
    let guard = guard_of(a.id());
    for stray in [
        libc::SIGVTALRM,
        libc::SIGPROF,
        libc::SIGRTMIN(),
        libc::SIGTTIN,
    ] {
        signal(guard, stray);
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(alive(guard as u64) && alive(pid));
    assert!(a.try_wait().unwrap().is_none());
    signal(a.id() as i32, libc::SIGTERM);
    let _ = a.wait();
}

/// `baton run` nested in `baton run`: when the outer one loses, both containments die and no
/// cgroup directory is left behind.
#[test]
fn nested_runs_leave_no_cgroup_behind() {
    let dir = scratch("nested");
    let outer = unique("nested-out");
    let inner = unique("nested-in");
    let script = format!(
        "{baton} run --backend {url} --election {inner} --ttl 2s -- sh -c 'echo $$ > {d}/inner; exec sleep 600'",
        baton = env!("CARGO_BIN_EXE_baton"),
        url = url(),
        d = dir.display()
    );
    let mut a = start(&outer, &dir, "a", &["--containment", "cgroup"], &script);
    let inner_pid = wait_for("inner runs", Duration::from_secs(5), || {
        read_number(&dir.join("inner"))
    });
    delete_leader_key(&outer);
    let status = wait_for("a exits", Duration::from_secs(3), || a.try_wait().unwrap());
    assert_eq!(status.code(), Some(3));
    assert!(!alive(inner_pid));
    wait_for("no cgroup left", Duration::from_secs(2), || {
        (!cgroup_dirs(a.id()).iter().any(|d| d.exists())).then_some(())
    });
}

/// `killall -9 baton`: the supervisor and the guard die in the same instant, so neither is left
/// to kill anything. Without a PID namespace the command's own process still dies (its
/// parent-death signal is SIGKILL); what it started outlives it (documented).
#[test]
fn killing_supervisor_and_guard_together_kills_the_command_itself() {
    let dir = scratch("kill-both");
    let election = unique("kill-both");
    let pid_file = dir.join("pid");
    let script = format!("echo $$ > {}; exec sleep 600", pid_file.display());
    let mut a = start(&election, &dir, "a", &[], &script);
    let cmd = wait_for("a's command runs", Duration::from_secs(5), || {
        read_number(&pid_file)
    });
    let guard = guard_of(a.id());
    // SAFETY: kill(2) on processes this test started.
    unsafe {
        libc::kill(a.id() as i32, libc::SIGKILL);
        libc::kill(guard, libc::SIGKILL);
    }
    let _ = a.wait();
    wait_for(
        "the command dies with its guard",
        Duration::from_millis(1500),
        || (!alive(cmd)).then_some(()),
    );
}

/// With `--pid-namespace on`, killing the supervisor and the guard together kills every
/// process of the command, however it left the process group or the session: the namespace's
/// init dies with the guard and the kernel kills the rest. The command sees namespace PIDs, so
/// the test collects the host PIDs by walking `baton run`'s tree.
#[test]
fn a_pid_namespace_dies_with_supervisor_and_guard_killed_together() {
    for shape in [
        Shape::Timeout,
        Shape::SetsidFork,
        Shape::JobControl,
        Shape::DoubleFork,
    ] {
        let name = format!("pidns-{shape:?}").to_lowercase();
        let dir = scratch(&name);
        let election = unique(&name);
        let pids = dir.join("a.pids");
        let script = shape.script(&pids, 600);
        let mut a = start(&election, &dir, "a", &["--pid-namespace", "on"], &script);
        wait_for("a's command runs", Duration::from_secs(5), || {
            (pids_in(&pids).len() >= shape.processes()).then_some(())
        });
        let stderr = std::fs::read_to_string(dir.join("a.stderr")).unwrap();
        assert!(
            stderr.contains("in a PID namespace of its own"),
            "{shape:?}: {stderr}"
        );
        // Inside, the command is PID 2 (the namespace's init is 1) and /proc agrees.
        let inside = pids_in(&pids);
        assert_eq!(inside[0], 2, "{shape:?}: {inside:?}");
        let guard = guard_of(a.id());
        let tree = descendants(a.id() as i32);
        // Guard, init, and at least the long-lived process (the command's first process may
        // have exited already, as with `setsid -f`).
        assert!(tree.len() >= 3, "{shape:?}: {tree:?}");
        // SAFETY: kill(2) on processes this test started.
        unsafe {
            libc::kill(a.id() as i32, libc::SIGKILL);
            libc::kill(guard, libc::SIGKILL);
        }
        let _ = a.wait();
        wait_for(
            &format!("{shape:?}: every process gone ({tree:?})"),
            Duration::from_millis(1500),
            || tree.iter().all(|&p| !alive(p as u64)).then_some(()),
        );
    }
}

/// Under a PID namespace a term ends as it does without one: the command's exit code once
/// everything it started is gone (the term lasting while a daemon lives), 143 on SIGTERM with
/// nothing left, 3 when the lease is lost; the successor never overlaps.
#[test]
fn a_pid_namespace_ends_terms_as_usual() {
    let dir = scratch("pidns-ends");
    let election = unique("pidns-ends");
    let ns = ["--pid-namespace", "on"];
    // The command exits 7 at once; its daemon lives 2 s more, and so does the term.
    let started = Instant::now();
    let mut a = start(&election, &dir, "a", &ns, "setsid -f sleep 2; exit 7");
    let status = wait_for("a exits", Duration::from_secs(6), || a.try_wait().unwrap());
    assert_eq!(status.code(), Some(7));
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "the term ended before the daemon"
    );
    // SIGTERM, then a lost lease: nothing is left either way.
    for (ending, expected) in [(Ending::Sigterm, 143), (Ending::LeaseLost, 3)] {
        let mut a = start(&election, &dir, "a", &ns, "setsid -f sleep 600; sleep 600");
        let supervisor = a.id() as i32;
        wait_for("a's command runs", Duration::from_secs(5), || {
            (descendants(supervisor).len() >= 4).then_some(())
        });
        let tree = descendants(supervisor);
        match ending {
            Ending::Sigterm => signal(supervisor, libc::SIGTERM),
            _ => delete_leader_key(&election),
        }
        let status = wait_for("a exits", Duration::from_secs(5), || a.try_wait().unwrap());
        let stderr = std::fs::read_to_string(dir.join("a.stderr")).unwrap_or_default();
        assert_eq!(status.code(), Some(expected), "{ending:?}: {stderr}");
        assert!(
            tree.iter().all(|&p| !alive(p as u64)),
            "{ending:?}: left running: {tree:?}"
        );
    }
}

/// Asking for a PID namespace where none can be made is bad input: one line, exit 2. (As an
/// unprivileged user: run as `nobody` through `setpriv`, when the test runs as root.)
#[test]
fn a_pid_namespace_that_cannot_be_made_is_refused() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        let output = run_script(&unique("pidns-refused"), &["--pid-namespace", "on"], "true")
            .output()
            .unwrap();
        check_refused(&output);
        return;
    }
    let mut command = run_script(&unique("pidns-refused"), &["--pid-namespace", "on"], "true");
    let program = command.get_program().to_owned();
    let args: Vec<_> = command.get_args().map(|a| a.to_owned()).collect();
    command = std::process::Command::new("setpriv");
    command
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(program)
        .args(args)
        .env("BATON_CONTAINMENT", "subreaper");
    let output = command.output().unwrap();
    check_refused(&output);
}

fn check_refused(output: &std::process::Output) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--pid-namespace on: cannot create a PID namespace"),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

/// Under a PID namespace a command that exits and leaves nothing behind is reported as such:
/// no note of processes living on (there are none), whatever its exit.
#[test]
fn a_pid_namespace_command_that_leaves_nothing_is_not_said_to_leave_processes() {
    let dir = scratch("pidns-nothing-left");
    let election = unique("pidns-nothing-left");
    let ns = ["--pid-namespace", "on"];
    for (script, expected) in [
        ("exit 7", 7),
        ("kill -9 $$", 137),
        ("exec /nonexistent", 127),
    ] {
        let mut a = start(&election, &dir, "a", &ns, script);
        let status = wait_for("a exits", Duration::from_secs(5), || a.try_wait().unwrap());
        let stderr = std::fs::read_to_string(dir.join("a.stderr")).unwrap_or_default();
        assert_eq!(status.code(), Some(expected), "{script}: {stderr}");
        assert!(!stderr.contains("still run"), "{script}: {stderr}");
    }
}

/// A script without a `#!` line runs with /bin/sh, as execvp runs it, with or without a PID
/// namespace (its init starting CMD through posix_spawnp would refuse it: "Exec format
/// error").
#[test]
fn a_script_without_a_shebang_runs_in_every_mode() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch("no-shebang");
    let script = dir.join("job");
    std::fs::write(&script, "exit 5\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    for mode in ["off", "on"] {
        let output = baton()
            .args([
                "run",
                "--backend",
                &url(),
                "--election",
                &unique("no-shebang"),
            ])
            .args(["--pid-namespace", mode, "--"])
            .arg(&script)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(5),
            "--pid-namespace {mode}: {stderr}"
        );
    }
}

/// Stray signals to `baton run` itself (`pkill -USR1 -f JOB` to reopen logs, `pkill -QUIT -f
/// JOB` for a JVM's thread dump: both match its command line too): the term goes on with the
/// same command and token; the supervisor neither dies nor gives up its lease.
#[test]
fn stray_signals_to_the_supervisor_change_nothing() {
    let dir = scratch("stray-supervisor");
    let election = unique("stray-supervisor");
    let script = format!("echo $$ > {}/pid; exec sleep 600", dir.display());
    let mut a = start(&election, &dir, "a", &[], &script);
    let pid = wait_for("a runs", Duration::from_secs(5), || {
        read_number(&dir.join("pid"))
    });
    for stray in [
        libc::SIGUSR1,
        libc::SIGUSR2,
        libc::SIGQUIT,
        libc::SIGALRM,
        libc::SIGVTALRM,
        libc::SIGPROF,
        libc::SIGIO,
        libc::SIGPWR,
        libc::SIGRTMIN(),
        libc::SIGRTMAX(),
    ] {
        signal(a.id() as i32, stray);
        std::thread::sleep(Duration::from_millis(50));
        let stderr = std::fs::read_to_string(dir.join("a.stderr")).unwrap_or_default();
        assert!(
            a.try_wait().unwrap().is_none(),
            "signal {stray} ended baton run: {stderr}"
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(alive(pid));
    signal(a.id() as i32, libc::SIGTERM);
    let status = wait_for("a exits", Duration::from_secs(3), || a.try_wait().unwrap());
    assert_eq!(status.code(), Some(143));
}

/// SIGTERM to a candidate that is still campaigning: its standby guard (and, under a PID
/// namespace, its launcher, already in the cgroup) end before it exits, so no cgroup directory
/// is left behind.
#[test]
fn sigterm_while_campaigning_leaves_no_cgroup_behind() {
    let dir = scratch("campaign-term");
    let election = unique("campaign-term");
    let mut a = start_leader(&election, &dir);
    for mode in ["off", "on"] {
        let mut b = start(
            &election,
            &dir,
            "b",
            &["--containment", "cgroup", "--pid-namespace", mode],
            "exec sleep 600",
        );
        let cgroup = PathBuf::from("/sys/fs/cgroup/unified").join(format!("baton-{}", b.id()));
        // Without a PID namespace the guard starts the command itself and the cgroup stays
        // empty until then; with one, the launcher waits in it.
        let guard = child_running(b.id() as i32, "__guard");
        if mode == "on" {
            child_running(guard, "__launch");
        }
        wait_for("b's standby is ready", Duration::from_secs(5), || {
            let members = std::fs::read_to_string(cgroup.join("cgroup.procs")).ok()?;
            (mode == "off" || !members.trim().is_empty()).then_some(())
        });
        signal(b.id() as i32, libc::SIGTERM);
        let status = wait_for("b exits", Duration::from_secs(5), || b.try_wait().unwrap());
        assert_eq!(status.code(), Some(143));
        assert!(!cgroup.exists(), "--pid-namespace {mode}: {cgroup:?} left");
    }
    signal(a.id() as i32, libc::SIGTERM);
    let _ = a.wait();
}

/// A waiting candidate's standby guard killed (a stray kill -9, the OOM killer), or under a
/// PID namespace its standby launcher, the namespace's init: when it is elected it still runs
/// its command, with another guard, instead of failing the term.
#[test]
fn a_standby_guard_or_launcher_killed_while_campaigning_is_replaced() {
    let dir = scratch("standby-killed");
    for (victim, mode) in [("guard", "off"), ("launcher", "on")] {
        let election = unique("standby-killed");
        let mut a = start_leader(&election, &dir);
        let token = dir.join(format!("b-{victim}.token"));
        let script = format!("echo $BATON_TOKEN > {}; exec sleep 600", token.display());
        let mut b = start(&election, &dir, "b", &["--pid-namespace", mode], &script);
        // By command line: a PID namespace probe may briefly be b's first child.
        let guard = child_running(b.id() as i32, "__guard");
        let target = match victim {
            "guard" => guard,
            _ => child_running(guard, "__launch"),
        };
        std::thread::sleep(Duration::from_millis(200));
        signal(target, libc::SIGKILL);
        std::thread::sleep(Duration::from_millis(200));
        signal(a.id() as i32, libc::SIGTERM);
        let _ = a.wait();
        wait_for(
            &format!("b runs its command after its {victim} was killed"),
            Duration::from_secs(5),
            || {
                let stderr = std::fs::read_to_string(dir.join("b.stderr")).unwrap_or_default();
                assert!(b.try_wait().unwrap().is_none(), "b exited: {stderr}");
                read_number(&token)
            },
        );
        signal(b.id() as i32, libc::SIGTERM);
        let status = b.wait().unwrap();
        assert_eq!(status.code(), Some(143));
    }
}

/// The child of `parent` whose command line contains `word`, once there is one.
fn child_running(parent: i32, word: &str) -> i32 {
    wait_for(
        &format!("{parent}'s {word}"),
        Duration::from_secs(2),
        || {
            let children =
                std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
            children.split_whitespace().find_map(|child| {
                let line = std::fs::read(format!("/proc/{child}/cmdline")).ok()?;
                String::from_utf8_lossy(&line)
                    .contains(word)
                    .then(|| child.parse().ok())?
            })
        },
    )
}

/// A program removed while its `baton run` waits in line: once elected, the start fails as
/// a shell's would (exit 127, one line naming the program), in every way CMD can be started:
/// by the guard itself (in the cgroup, or with no cgroup) and by a PID namespace's init.
#[test]
fn a_program_gone_by_the_election_ends_the_term_with_127_in_every_mode() {
    let dir = scratch("gone-by-election");
    for (name, extra) in [
        ("direct", &[][..]),
        ("subreaper", &["--containment", "subreaper"][..]),
        ("pidns", &["--pid-namespace", "on"][..]),
    ] {
        let election = unique("gone-by-election");
        let a = start_leader(&election, &dir);
        let program = dir.join(format!("{name}.sh"));
        write_executable(&program, "#!/bin/sh\nexit 0\n");
        let b = waiting_candidate(&election, &program, extra, None);
        std::fs::remove_file(&program).unwrap();
        let (code, stderr) = hand_over(a, b);
        assert_eq!(code, Some(127), "{name}: {stderr}");
        let line = format!(
            "baton: error: cannot start {}: no such file",
            program.display()
        );
        assert!(stderr.contains(&line), "{name}: {stderr}");
    }
}

/// The program is looked up at the election, as a shell would then: one installed earlier in
/// `PATH` while the candidate waits in line (an upgrade) is the one that runs, not the one found
/// when the campaign began. A script's `#!` interpreter removed meanwhile is named in the error.
#[test]
fn the_program_is_looked_up_at_the_election() {
    let dir = scratch("path-at-election");
    let (new, old) = (dir.join("new"), dir.join("old"));
    std::fs::create_dir_all(&new).unwrap();
    std::fs::create_dir_all(&old).unwrap();
    let ran = dir.join("ran");
    let tool = |says: &str| format!("#!/bin/sh\necho {says} > {}\n", ran.display());
    write_executable(&old.join("tool"), &tool("old"));
    let path = format!(
        "{}:{}:{}",
        new.display(),
        old.display(),
        std::env::var("PATH").unwrap()
    );
    let election = unique("path-at-election");
    let a = start_leader(&election, &dir);
    let b = waiting_candidate(&election, Path::new("tool"), &[], Some(&path));
    write_executable(&new.join("tool"), &tool("new"));
    let (code, stderr) = hand_over(a, b);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "new\n");
    // The interpreter goes while b waits.
    let shell = dir.join("myshell");
    std::fs::copy("/bin/sh", &shell).unwrap();
    let script = dir.join("job");
    write_executable(&script, &format!("#!{}\nexit 0\n", shell.display()));
    let election = unique("path-at-election");
    let a = start_leader(&election, &dir);
    let b = waiting_candidate(&election, &script, &[], None);
    std::fs::remove_file(&shell).unwrap();
    let (code, stderr) = hand_over(a, b);
    assert_eq!(code, Some(127), "{stderr}");
    let line = format!(
        "baton: error: cannot start {}: its #! interpreter {}: no such file",
        script.display(),
        shell.display()
    );
    assert!(stderr.contains(&line), "{stderr}");
}

/// `b`, a `baton run` of `program` with `extra` flags (and `PATH`, if given) waiting in line
/// behind `election`'s leader, once its standby guard is up (past the check of the program).
fn waiting_candidate(election: &str, program: &Path, extra: &[&str], path: Option<&str>) -> Child {
    let mut command = baton();
    command
        .args(["run", "--backend", &url(), "--election", election])
        .args(["--ttl", "2s", "--id", "b"])
        .args(extra)
        .arg("--")
        .arg(program)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(path) = path {
        command.env("PATH", path);
    }
    let b = command.spawn().unwrap();
    child_running(b.id() as i32, "__guard");
    b
}

/// SIGTERM to the leader `a`: `b` is elected; returns b's exit code and stderr once it ends.
fn hand_over(mut a: Child, mut b: Child) -> (Option<i32>, String) {
    signal(a.id() as i32, libc::SIGTERM);
    let _ = a.wait();
    let status = wait_for("b ends", Duration::from_secs(10), || b.try_wait().unwrap());
    let mut stderr = String::new();
    std::io::Read::read_to_string(b.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    (status.code(), stderr)
}

/// Writes an executable file.
fn write_executable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Signals `baton run` was started with ignored stay ignored, for it and for CMD, as they would
/// be through a plain exec: under `nohup` (SIGHUP) or as a script's background job (SIGINT) a
/// closed terminal does not end the job. SIGTERM still stops it. Started normally, CMD ignores
/// neither, and nothing else (not even SIGPIPE, which Rust ignores in baton itself).
#[test]
fn signals_ignored_at_start_stay_ignored_for_baton_run_and_the_command() {
    let dir = scratch("nohup");
    let baton_path = baton().get_program().to_owned();
    // What this process ignores, inherited by everything it starts, but SIGPIPE (which Rust
    // ignores here and resets in what it starts).
    let sig_ign = |status: &str| {
        let hex = status
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:"))?
            .trim()
            .to_string();
        u64::from_str_radix(&hex, 16).ok()
    };
    let pipe_bit = 1u64 << (libc::SIGPIPE - 1);
    let inherited =
        sig_ign(&std::fs::read_to_string("/proc/self/status").unwrap()).unwrap() & !pipe_bit;
    let bit = |signal: libc::c_int| 1u64 << (signal - 1);
    // SIGUSR1 and SIGCHLD: baton handles both itself (the guard's parent-death signal; waiting
    // for its children), yet CMD inherits them ignored, in every way it is started. (Set by
    // this test before the exec: a shell's `trap '' CHLD` does not ignore SIGCHLD, and a shell
    // as CMD would not pass it on.)
    for flags in [
        &[][..],
        &["--pid-namespace", "on"],
        &["--containment", "freezer"],
    ] {
        let mask_file = dir.join("direct-mask");
        let mut command = baton();
        command
            .args(["run", "--backend", &url(), "--election", &unique("nohup")])
            .args(["--ttl", "2s"])
            .args(flags)
            .args(["--", "grep", "SigIgn", "/proc/self/status"])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&mask_file).unwrap())
            .stderr(Stdio::piped());
        // SAFETY: `signal` is async-signal-safe.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut command, || {
                libc::signal(libc::SIGUSR1, libc::SIG_IGN);
                libc::signal(libc::SIGCHLD, libc::SIG_IGN);
                Ok(())
            });
        }
        let output = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(0), "{flags:?}: {stderr}");
        let mask = sig_ign(&std::fs::read_to_string(&mask_file).unwrap()).unwrap();
        let expected = inherited | bit(libc::SIGUSR1) | bit(libc::SIGCHLD);
        assert_eq!(mask, expected, "{flags:?}: SigIgn {mask:x}");
    }
    for (trap, flags, ignored) in [
        (
            "trap '' HUP INT;",
            "",
            bit(libc::SIGHUP) | bit(libc::SIGINT),
        ),
        ("", "", 0),
    ] {
        let election = unique("nohup");
        let mask_file = dir.join("mask");
        let _ = std::fs::remove_file(&mask_file);
        let script = format!(
            "grep SigIgn /proc/self/status > {}; exec sleep 600",
            mask_file.display()
        );
        let stderr = std::fs::File::create(dir.join("a.stderr")).unwrap();
        let mut a = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "{trap} exec {} run --backend {} --election {election} --ttl 2s {flags} -- sh -c '{script}'",
                baton_path.to_string_lossy(),
                url()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let mask = wait_for("the command's mask", Duration::from_secs(5), || {
            sig_ign(&std::fs::read_to_string(&mask_file).ok()?)
        });
        assert_eq!(
            mask,
            inherited | ignored,
            "{trap:?} {flags}: SigIgn {mask:x}, this test's {inherited:x}"
        );
        if ignored & bit(libc::SIGHUP) != 0 {
            for number in [libc::SIGHUP, libc::SIGINT] {
                signal(a.id() as i32, number);
                std::thread::sleep(Duration::from_millis(300));
                let text = std::fs::read_to_string(dir.join("a.stderr")).unwrap();
                assert!(a.try_wait().unwrap().is_none(), "signal {number}: {text}");
            }
        }
        signal(a.id() as i32, libc::SIGTERM);
        let status = wait_for("a exits", Duration::from_secs(5), || a.try_wait().unwrap());
        let text = std::fs::read_to_string(dir.join("a.stderr")).unwrap();
        assert_eq!(status.code(), Some(143), "{trap:?} {flags}: {text}");
    }
}

/// Started with SIGCHLD ignored (the kernel would reap its children behind its back), `baton
/// run` still waits for its guard: a guard killed with SIGKILL ends the term at once, with the
/// guard's real status, and no false word of processes surviving SIGKILL.
#[test]
fn a_killed_guard_ends_the_term_at_once_when_sigchld_was_ignored() {
    let dir = scratch("sigchld-ignored");
    let mut command = baton();
    command
        .args(["run", "--backend", &url(), "--election", &unique("sigchld")])
        .args(["--ttl", "2s", "--", "sleep", "600"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("a.stderr")).unwrap());
    // SAFETY: `signal` is async-signal-safe.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || {
            libc::signal(libc::SIGCHLD, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut a = command.spawn().unwrap();
    wait_leading(&dir, "a");
    let killed = Instant::now();
    signal(guard_of(a.id()), libc::SIGKILL);
    let status = wait_for("a exits", Duration::from_secs(10), || a.try_wait().unwrap());
    let took = killed.elapsed();
    let stderr = std::fs::read_to_string(dir.join("a.stderr")).unwrap();
    assert_eq!(status.code(), Some(3), "{stderr}");
    assert!(took < Duration::from_secs(2), "{took:?}: {stderr}");
    assert!(stderr.contains("guard died (status 137)"), "{stderr}");
    assert!(!stderr.contains("survived SIGKILL"), "{stderr}");
}

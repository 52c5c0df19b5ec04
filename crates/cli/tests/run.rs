//! `baton run` as real processes against a real etcd (started by `scripts/test`): kill -9,
//! SIGSTOP longer than the TTL, SIGTERM handoff, loss, bad input.

mod common;

use common::*;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// `a` leading (its command running, with `a_token`) and `b` queued behind it; their files are
/// in the scratch directory returned first (bound first, it is dropped after them: removed once
/// their processes are gone, if the test passed).
fn leader_and_waiter(name: &str, ttl: &str) -> (Scratch, String, Runner, u64, Runner) {
    let dir = scratch(name);
    let election = unique(name);
    let a = Runner::start(&url(), &election, ttl, &dir, "a");
    let a_token = a.wait_running(Duration::from_secs(5));
    let b = Runner::start(&url(), &election, ttl, &dir, "b");
    wait_queued(&election, 2);
    (dir, election, a, a_token, b)
}

#[test]
fn child_gets_its_environment_and_its_exit_code_propagates() {
    let dir = scratch("env");
    let election = unique("env");
    let out = dir.join("env");
    let fds = dir.join("fds");
    let status = baton()
        .args([
            "run",
            "--backend",
            &url(),
            "--election",
            &election,
            "--id",
            "me",
            "--ttl",
            "2s",
        ])
        .arg("--")
        .args([
            "sh",
            "-c",
            &format!(
                "env > {}; ls -l /proc/$$/fd > {}; exit 42",
                out.display(),
                fds.display()
            ),
        ])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(42));
    let env = std::fs::read_to_string(&out).unwrap();
    assert!(
        env.contains(&format!("BATON_ELECTION={election}\n")),
        "{env}"
    );
    assert!(env.contains("BATON_ID=me\n"), "{env}");
    let token: u64 = env
        .lines()
        .find_map(|l| l.strip_prefix("BATON_TOKEN="))
        .unwrap()
        .parse()
        .unwrap();
    assert!(token > 0);
    assert!(!env.contains("BATON_SUPERVISOR_PID"));
    // Nothing of baton's pipes and sockets (control, status, the launcher's) reaches CMD:
    // every pipe it holds is one this test process holds too (stderr, or what the test
    // harness passed down), and it holds no socket.
    let ours: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .map(|target| target.display().to_string())
        .collect();
    let listing = std::fs::read_to_string(&fds).unwrap();
    for target in listing
        .lines()
        .filter_map(|l| l.split_once(" -> ").map(|(_, t)| t))
    {
        assert!(!target.starts_with("socket:"), "{listing}");
        if target.starts_with("pipe:") {
            assert!(
                ours.iter().any(|o| o == target),
                "not ours: {target}\n{listing}"
            );
        }
    }
    // It resigned on the way out.
    let leader = baton()
        .args(["leader", "--backend", &url(), "--election", &election])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8(leader.stdout).unwrap(),
        format!("{{\"election\":\"{election}\",\"leader\":null}}\n")
    );
}

#[test]
fn kill_9_of_the_supervisor_kills_its_group_and_the_successor_takes_over() {
    let (_dir, _, a, a_token, b) = leader_and_waiter("kill9", "2s");
    assert_eq!(b.token(), None, "b must not run while a leads");
    let (a_child, a_grandchild) = (a.child_pid().unwrap(), a.grandchild_pid().unwrap());
    signal(a.child.id() as i32, libc::SIGKILL);
    // No orphaned leader: the command and its own children die at once.
    wait_for("a's command dies", Duration::from_millis(1500), || {
        (!alive(a_child) && !alive(a_grandchild)).then_some(())
    });
    let b_token = b.wait_running(Duration::from_secs(6));
    assert!(b_token > a_token, "{b_token} after {a_token}");
}

#[test]
fn sigstop_longer_than_the_ttl_kills_the_stale_child_on_resume_and_fences_it() {
    let (_dir, election, a, a_token, b) = leader_and_waiter("stop", "2s");
    let a_child = a.child_pid().unwrap();
    let a_group = process_group(a_child);
    let a_supervisor = a.child.id() as i32;
    // Freeze a's whole tree (supervisor and command group) for 3 × TTL.
    signal(a_supervisor, libc::SIGSTOP);
    signal(-a_group, libc::SIGSTOP);
    let b_token = b.wait_running(Duration::from_secs(6));
    assert!(b_token > a_token);
    std::thread::sleep(Duration::from_millis(6_000u64.saturating_sub(2_300)));
    let resumed = Instant::now();
    signal(-a_group, libc::SIGCONT);
    signal(a_supervisor, libc::SIGCONT);
    wait_for("a's stale command killed", Duration::from_secs(1), || {
        (!alive(a_child)).then_some(())
    });
    let killed_after = resumed.elapsed();
    assert!(
        killed_after < Duration::from_millis(500),
        "{killed_after:?}"
    );
    // Fencing: a write with a's old token is refused by etcd itself, b's is accepted.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let backend = baton::Backend::connect(&url()).await.unwrap();
        let election = baton::Election::new(
            &backend,
            &election,
            baton::ElectionConfig::default().with_ttl(Duration::from_secs(2)),
        )
        .unwrap();
        let key = format!("/baton-cli-test-data/{}", unique("stop"));
        let stale = election.guarded_put(a_token, &key, "a").await;
        assert!(
            matches!(stale, Err(baton::Error::Fenced { .. })),
            "{stale:?}"
        );
        election.guarded_put(b_token, &key, "b").await.unwrap();
        let mut fence = baton::Fence::new();
        fence.admit(b_token).unwrap();
        assert!(fence.admit(a_token).is_err());
    });
    // a's supervisor reports the loss and exits 3 (no --requeue).
    let mut a = a;
    let status = wait_for("a exits", Duration::from_secs(3), || {
        a.child.try_wait().unwrap()
    });
    assert_eq!(status.code(), Some(3), "{}", a.stderr());
    assert!(a.stderr().contains("leadership lost"), "{}", a.stderr());
}

#[test]
fn sigterm_hands_over_to_the_successor_at_once() {
    // A 10 s TTL: a takeover within 5 s can only come from the resign (a lease that ran out
    // would have taken 6.7 s at the least).
    let (_dir, _, a, a_token, b) = leader_and_waiter("term", "10s");
    let a_child = a.child_pid().unwrap();
    let a_grandchild = a.grandchild_pid().unwrap();
    let sent = Instant::now();
    signal(a.child.id() as i32, libc::SIGTERM);
    let b_token = b.wait_running(Duration::from_secs(5));
    let handoff = sent.elapsed();
    assert!(b_token > a_token);
    assert!(!alive(a_child), "a's command must stop before b's starts");
    assert!(!alive(a_grandchild), "and so must everything it started");
    assert!(handoff < Duration::from_secs(5), "{handoff:?}");
    let mut a = a;
    let status = a.child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{}", a.stderr());
}

#[test]
fn deleted_leader_key_kills_the_command_and_exits_3() {
    let dir = scratch("deleted");
    let election = unique("deleted");
    let mut a = Runner::start(&url(), &election, "2s", &dir, "a");
    a.wait_running(Duration::from_secs(5));
    let a_child = a.child_pid().unwrap();
    delete_election_keys(&election);
    wait_for("command killed", Duration::from_millis(1500), || {
        (!alive(a_child)).then_some(())
    });
    let status = wait_for("a exits", Duration::from_secs(2), || {
        a.child.try_wait().unwrap()
    });
    assert_eq!(status.code(), Some(3));
    assert!(
        a.stderr().contains("leader entry deleted"),
        "{}",
        a.stderr()
    );
}

#[test]
fn observe_prints_the_current_state_then_each_change() {
    let dir = scratch("observe");
    let election = unique("observe");
    let out = std::fs::File::create(dir.join("observe.out")).unwrap();
    let observer = Reaped(
        baton()
            .args(["observe", "--backend", &url(), "--election", &election])
            .stdout(out)
            .spawn()
            .unwrap(),
    );
    let lines = || std::fs::read_to_string(dir.join("observe.out")).unwrap_or_default();
    wait_for("initial line", Duration::from_secs(3), || {
        (!lines().is_empty()).then_some(())
    });
    let status = baton()
        .args([
            "run",
            "--backend",
            &url(),
            "--election",
            &election,
            "--id",
            "x",
            "--ttl",
            "2s",
        ])
        .args(["--", "sleep", "0.3"])
        .status()
        .unwrap();
    assert!(status.success());
    let text = wait_for("three lines", Duration::from_secs(3), || {
        let text = lines();
        (text.lines().count() >= 3).then_some(text)
    });
    let got: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        got[0],
        serde_json::json!({"election": election, "leader": null})
    );
    assert_eq!(got[1]["leader"]["id"], "x");
    assert!(got[1]["leader"]["token"].as_u64().unwrap() > 0);
    assert_eq!(
        got[2],
        serde_json::json!({"election": election, "leader": null})
    );
    drop(observer);
}

#[test]
fn lab_runs_without_a_backend_and_repeats_itself_exactly() {
    let run = || {
        baton()
            .args([
                "lab",
                "--scenarios",
                "leader-crash,clock-drift",
                "--seed",
                "7",
            ])
            .output()
            .unwrap()
    };
    let (first, second) = (run(), run());
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert_eq!(first.stdout, second.stdout);
    let table = String::from_utf8(first.stdout).unwrap();
    assert!(
        table.contains("clock-drift") && table.contains("lease"),
        "{table}"
    );
}

#[test]
fn bad_input_gets_one_line_and_exit_code_2() {
    // URL stands for the test etcd's URL.
    let cases = [
        "run --backend nope://x:1 --election e -- true",
        "run --backend etcd://127.0.0.1:1/x --election e -- true",
        "run --backend URL --election e --ttl 10 -- true",
        "run --backend URL --election e --ttl 0s -- true",
        "run --backend URL --election e --ttl 1500ms -- true",
        "run --backend URL --election e",
        "run --backend URL --election a/b -- true",
        "run --backend URL --election e --grace soon -- true",
        "run --backend URL --election e --ttl -1s -- true",
        "run --backend URL --election e --max-drift-ppm 600000 -- true",
        "leader --backend etcd://127.0.0.1 --election e",
        "observe --election e",
        "frobnicate",
        "lab --algorithms paxos",
        "lab --nodes 1",
        "bench handoff --backend etcd://127.0.0.1:1/x",
        "run --backend URL --election e --ttl 9000000001s -- true",
        "run --backend URL --election @candidates -- true",
        "run --backend URL/@ids --election e -- true",
        "run --backend URL --election e --containment jail -- true",
        "run --backend URL --election e --pid-namespace maybe -- true",
        "run --backend memory://x --election e -- true",
        "leader --backend memory://x --election e",
        "bench herd --backend memory://x",
        "run --backend zk://127.0.0.1:1/x --election e -- true",
        // Accepts connections and never answers: one line too (not the ZooKeeper client's
        // warnings for each attempt before it).
        "run --backend zk://SILENT/x --election e -- true",
        "run --backend zk://127.0.0.1:2181/zookeeper/x --election e -- true",
        "leader --backend zk://127.0.0.1:2181/a//b --election e",
        "run --backend ZK --election e --ttl 1s -- true",
        "run --backend ZK --election e --ttl 100000h -- true",
        // A program that cannot start: refused before campaigning (see the test below).
        "run --backend URL --election e -- /no/such/program",
        "run --backend URL --election e -- no-such-program-on-path",
        "run --backend URL --election e -- /",
        "run --backend URL --election e -- /etc/passwd",
        "shards --backend URL --group g --shards 2 -- no-such-program-on-path",
    ];
    // PostgreSQL: a wrong password, a server that is not there, a bad schema name, a role
    // without the right to create baton's schema.
    let mut cases = cases.to_vec();
    if backend() == TestBackend::Postgres {
        cases.extend([
            "run --backend postgres://baton:wrong@PG/baton --election e -- true",
            "run --backend postgres://baton:baton@127.0.0.1:1/baton --election e -- true",
            "run --backend postgres://baton:baton@PG/baton?schema=Bad-Name --election e -- true",
            "leader --backend postgres://baton_readonly:readonly@PG/baton?schema=fresh --election e",
        ]);
    }
    let pg = std::env::var("BATON_TEST_PG_ADDR").unwrap_or_default();
    let url = url();
    // ZooKeeper's session bounds (2 s to 60 s on the test server) are
    // read from the server: a TTL outside them is refused before anything is created.
    let zk = format!("zk://{}/baton-cli-test", zookeeper());
    // Kept open (never accepted from) for the whole loop.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent = listener.local_addr().unwrap().to_string();
    for case in cases {
        // Only the etcd API insists on whole seconds.
        if case.contains("1500ms") && !speaks_etcd() {
            continue;
        }
        let args: Vec<String> = case
            .split_whitespace()
            .map(|arg| match arg {
                "URL" => url.clone(),
                "ZK" => zk.clone(),
                _ => arg
                    .replace("@PG/", &format!("@{pg}/"))
                    .replace("SILENT", &silent),
            })
            .collect();
        let output = baton().args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("baton: error: "), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        // A negative duration is the option's bad value, not an unknown flag.
        if case.contains("--ttl -1s") {
            assert!(
                stderr.contains("invalid value '-1s' for '--ttl"),
                "{stderr}"
            );
        }
    }
}

/// exec decides with the effective IDs and capabilities, and so does the program check: a
/// service run as another user with `CAP_DAC_OVERRIDE` (systemd's `User=` with
/// `AmbientCapabilities=`) may start a program only root may execute; without it, it may not.
/// The backend is unreachable on purpose: the check comes before connecting, so "cannot reach"
/// says the check let the program through. (As root only: handing out capabilities needs it.)
#[test]
fn the_program_check_asks_with_the_credentials_exec_uses() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch("program-credentials");
    let program = dir.join("root-only");
    std::fs::copy("/bin/true", &program).unwrap();
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o700)).unwrap();
    let program = program.to_str().unwrap();
    let attempt = |setpriv: &[&str]| {
        let mut command = baton();
        command.args([
            "run",
            "--backend",
            "etcd://127.0.0.1:1/x",
            "--election",
            "e",
        ]);
        command.args(["--", program]);
        if !setpriv.is_empty() {
            let baton = command.get_program().to_owned();
            let args: Vec<_> = command.get_args().map(|a| a.to_owned()).collect();
            command = std::process::Command::new("setpriv");
            command.args(setpriv).arg("--").arg(baton).args(args);
        }
        let output = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert_eq!(output.status.code(), Some(2), "{setpriv:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{setpriv:?}: {stderr}");
        stderr
    };
    let passed = "baton: error: cannot reach";
    let stderr = attempt(&[]);
    assert!(stderr.starts_with(passed), "{stderr}");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    let nobody = ["--reuid=65534", "--regid=65534", "--clear-groups"];
    let stderr = attempt(&nobody);
    assert!(
        stderr.starts_with(&format!(
            "baton: error: cannot start {program}: not executable (Permission denied"
        )),
        "{stderr}"
    );
    let capable = [
        &nobody[..],
        &["--inh-caps=+dac_override", "--ambient-caps=+dac_override"],
    ]
    .concat();
    let stderr = attempt(&capable);
    assert!(stderr.starts_with(passed), "{stderr}");
}

/// A command whose program cannot start (a typo, a path that is not there) is refused before
/// the campaign: one line and exit 2, not a wait in line and then, once elected, exit 127 (with
/// `--requeue`, a loop of winning and failing). Behind a running leader it ends at once.
#[test]
fn a_program_that_cannot_start_is_refused_before_campaigning() {
    let dir = scratch("no-program");
    let election = unique("no-program");
    let leader = Runner::start(&url(), &election, "2s", &dir, "a");
    leader.wait_running(Duration::from_secs(5));
    // A script whose #! line names a missing interpreter fails at exec as a missing program
    // does; one whose interpreter is there (after a space, with an argument) runs.
    let write_script = |name: &str, text: &str| {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path.to_str().unwrap().to_string()
    };
    let orphan = write_script("orphan.sh", "#!/no/such/interpreter -e\nexit 0\n");
    let fine = write_script("fine.sh", "#! /bin/sh -e\nexit 7\n");
    // Saved with Windows line endings: the interpreter is "/bin/sh\r", shown escaped.
    let crlf = write_script("crlf.sh", "#!/bin/sh\r\nexit 0\r\n");
    let status = baton()
        .args(["run", "--backend", &url(), "--election", &unique("fine")])
        .args(["--", &fine])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(7));
    for program in [
        "/no/such/program",
        "no-such-program-on-path",
        &orphan,
        &crlf,
    ] {
        let mut candidate = baton()
            .args(["run", "--backend", &url(), "--election", &election])
            .args(["--requeue", "--", program])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let status = wait_for("the candidate is refused", Duration::from_secs(10), || {
            candidate.try_wait().unwrap()
        });
        let mut stderr = String::new();
        std::io::Read::read_to_string(candidate.stderr.as_mut().unwrap(), &mut stderr).unwrap();
        assert_eq!(status.code(), Some(2), "{program}: {stderr}");
        let why = if program == crlf {
            "its #! interpreter /bin/sh\\r: no such file (the script has Windows line endings)"
                .to_string()
        } else if program == orphan {
            "its #! interpreter /no/such/interpreter: no such file".to_string()
        } else if program.contains('/') {
            "no such file".to_string()
        } else {
            format!(
                "command not found in PATH ({})",
                std::env::var("PATH").unwrap()
            )
        };
        assert_eq!(
            stderr.trim(),
            format!("baton: error: cannot start {program}: {why}")
        );
    }
    let mut leader = leader;
    assert!(
        leader.child.try_wait().unwrap().is_none(),
        "{}",
        leader.stderr()
    );
}

/// A graceful stop sends SIGTERM once to each process of the command: a trap runs once (each
/// process found both in the cgroup and in the process tree got it twice, 1-2 ms apart, and a
/// handler that had run already ran again; found by a helper attack on `baton shards`).
#[test]
fn a_graceful_stop_signals_each_process_once() {
    let dir = scratch("term-once");
    let election = unique("term-once");
    let log = dir.join("terms");
    let ready = dir.join("ready");
    // A busy loop of builtins: the shell runs its trap at once on each SIGTERM.
    let script = format!(
        "trap 'echo term >> {}' TERM; touch {}; while :; do :; done",
        log.display(),
        ready.display()
    );
    let mut child = run_script(&election, &["--grace", "1s"], &script)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the command starts", Duration::from_secs(10), || {
        ready.exists().then_some(())
    });
    signal(child.id() as i32, libc::SIGTERM);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(143), "{status:?}");
    let terms = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(terms.lines().count(), 1, "SIGTERMs seen: {terms:?}");
}

#[test]
fn requeue_runs_the_command_again_with_a_larger_token_after_a_loss() {
    let dir = scratch("requeue");
    let election = unique("requeue");
    let log = dir.join("tokens");
    // Each term's command also notes its nice value and scheduling policy (fields 19 and 41 of
    // /proc/PID/stat): the supervisor and guard lower theirs only on their way out, never for a
    // command (both are inherited). The token is written last, so a term the test has counted
    // has written everything else already.
    let script = format!(
        "echo $$ > {dir}/pid; cut -d' ' -f19,41 /proc/$$/stat >> {dir}/policies; echo $BATON_TOKEN >> {}; exec sleep 1000",
        log.display(),
        dir = dir.display()
    );
    let mut child = run_script(&election, &["--requeue"], &script)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let tokens = || -> Vec<u64> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.parse().ok())
            .collect()
    };
    wait_for("first term", Duration::from_secs(5), || {
        (tokens().len() == 1).then_some(())
    });
    let first_pid = read_number(&dir.join("pid")).expect("the first term's pid");
    delete_election_keys(&election);
    let second = wait_for("second term", Duration::from_secs(5), || {
        let t = tokens();
        (t.len() == 2).then_some(t)
    });
    assert!(second[1] > second[0], "{second:?}");
    assert!(!alive(first_pid), "the first term's command must be gone");
    let policies = std::fs::read_to_string(dir.join("policies")).unwrap();
    assert_eq!(policies.lines().count(), 2, "{policies:?}");
    let normal = format!("0 {}", libc::SCHED_OTHER);
    assert!(policies.lines().all(|p| p == normal), "{policies:?}");
    signal(child.id() as i32, libc::SIGTERM);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM));
}

#[test]
fn a_stalled_supervisor_cannot_keep_its_command_running() {
    let (_dir, _, a, a_token, b) = leader_and_waiter("stall", "2s");
    let a_child = a.child_pid().unwrap();
    // Freeze only the supervisor: its command's group keeps running, and only the guard's
    // dead-man switch can stop it.
    signal(a.child.id() as i32, libc::SIGSTOP);
    let mut a_dead_at = None;
    let b_started_at = wait_for("b runs", Duration::from_secs(6), || {
        if a_dead_at.is_none() && !alive(a_child) {
            a_dead_at = Some(Instant::now());
        }
        b.token().map(|_| Instant::now())
    });
    let a_dead_at = a_dead_at.expect("a's command still ran when b's started");
    assert!(a_dead_at < b_started_at);
    assert!(b.token().unwrap() > a_token);
    signal(a.child.id() as i32, libc::SIGCONT);
    let mut a = a;
    let status = wait_for("a exits", Duration::from_secs(3), || {
        a.child.try_wait().unwrap()
    });
    assert_eq!(status.code(), Some(3), "{}", a.stderr());
}

/// The term lasts while anything the command started still runs (a worker it left behind):
/// `baton run` says so, resigns only once the worker is gone, and exits with the command's code.
#[test]
fn the_term_lasts_while_what_the_command_left_running_lives() {
    let dir = scratch("leftover");
    let election = unique("leftover");
    let pid_file = dir.join("worker");
    let script = format!("sleep 1 & echo $! > {}; exit 7", pid_file.display());
    let started = Instant::now();
    let output = run_script(&election, &[], &script).output().unwrap();
    assert_eq!(output.status.code(), Some(7));
    assert!(started.elapsed() >= Duration::from_secs(1));
    let worker = read_number(&pid_file).unwrap();
    assert!(!alive(worker));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("processes it started still run"),
        "{stderr}"
    );
}

/// A fixed `--id` restarted at once after a crash (systemd's `Restart=`, a container that
/// keeps its hostname and PID): the crashed run's entry holds the id until its lease expires,
/// and the new run waits for it rather than exit, then leads.
#[test]
fn a_fixed_id_restarted_after_a_crash_waits_for_its_old_entry_and_leads() {
    let dir = scratch("fixed-id");
    let election = unique("fixed-id");
    let start = |name: &str| {
        let script = token_script(&dir, name);
        run_script(&election, &["--id", "fixed"], &script)
            .stderr(std::fs::File::create(dir.join(format!("{name}.stderr"))).unwrap())
            .spawn()
            .unwrap()
    };
    let token = |name: &str| read_number(&dir.join(format!("{name}.token")));
    let mut first = start("first");
    let crashed = wait_for("the first run leads", Duration::from_secs(10), || {
        token("first")
    });
    signal(first.id() as i32, libc::SIGKILL);
    let _ = first.wait();
    let mut second = start("second");
    let took_over = wait_leads(&mut second, &dir, "second", Duration::from_secs(20));
    assert!(took_over > crashed, "{took_over} after {crashed}");
    let stderr = std::fs::read_to_string(dir.join("second.stderr")).unwrap();
    assert!(stderr.contains("waiting up to 14s for the id"), "{stderr}");
    signal(second.id() as i32, libc::SIGTERM);
    let _ = second.wait();
}

/// `--value` is published with the candidate and shown by `baton leader`; a second live
/// candidate with the same id is refused with one line and exit code 2, once it has waited
/// 2 × TTL + 10 s for the id (an entry of a crashed earlier run would have expired by then).
#[test]
fn leader_value_is_shown_and_duplicate_ids_are_refused() {
    let dir = scratch("value");
    let election = unique("value");
    let mut a = run_script(
        &election,
        &["--id", "same", "--value", "10.0.0.7:8080"],
        &format!("touch {}/running; exec sleep 600", dir.display()),
    )
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for("a runs", Duration::from_secs(5), || {
        dir.join("running").exists().then_some(())
    });
    let leader = baton()
        .args(["leader", "--backend", &url(), "--election", &election])
        .output()
        .unwrap();
    let text = String::from_utf8(leader.stdout).unwrap();
    assert!(text.contains("\"id\":\"same\""), "{text}");
    assert!(text.contains("\"value\":\"10.0.0.7:8080\""), "{text}");
    let duplicate = run_script(&election, &["--id", "same"], "true")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&duplicate.stderr);
    assert_eq!(duplicate.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("already campaigning"), "{stderr}");
    assert!(
        stderr.contains("the id was still in use after 14s: another live candidate has it"),
        "{stderr}"
    );
    assert_eq!(
        stderr
            .lines()
            .filter(|l| l.starts_with("baton: error"))
            .count(),
        1,
        "{stderr}"
    );
    signal(a.id() as i32, libc::SIGTERM);
    let _ = a.wait();
}

/// stdout that cannot be written (a full disk, `/dev/full`): one line that says it was stdout,
/// exit 1, for `leader`, `observe`, the benchmarks (`println!` would panic) and the lab.
#[test]
fn an_unwritable_stdout_is_one_line_naming_stdout() {
    let election = unique("stdout-full");
    let endpoint = etcd_api();
    let load = [
        "--endpoint",
        &endpoint,
        "--op",
        "create",
        "--window",
        "200ms",
    ];
    let written = "baton: error: writing to stdout: No space left on device (os error 28)\n";
    // The lab's table: not bad input either (exit 1, not 2).
    let lab = "baton: error: cannot write to standard output: No space left on device (os error \
               28)\n";
    let commands: [(&[&str], &str); 4] = [
        (
            &["leader", "--backend", &url(), "--election", &election],
            written,
        ),
        (
            &["observe", "--backend", &url(), "--election", &election],
            written,
        ),
        (&[&["bench", "load"][..], &load[..]].concat(), written),
        (&["lab", "--seeds", "2"], lab),
    ];
    for (command, expected) in commands {
        let output = baton()
            .args(command)
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{command:?}: {stderr}");
        assert_eq!(stderr, expected, "{command:?}");
    }
}

/// `baton observe … | head -n1`: once its reader is gone, the next change ends `observe`
/// quietly (no panic, no noise), instead of it writing into a closed pipe forever.
#[test]
fn observe_ends_quietly_when_its_reader_closes_the_pipe() {
    use std::io::BufRead;
    let election = unique("observe-pipe");
    let mut observer = Reaped(
        baton()
            .args(["observe", "--backend", &url(), "--election", &election])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut first = String::new();
    std::io::BufReader::new(observer.0.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.contains("\"leader\":null"), "{first}");
    // The reader is gone (dropped above) and nothing changes: it ends anyway, at once,
    // quietly (not at the next change, which may be days away).
    let exited = wait_for("observe ends", Duration::from_secs(5), || {
        observer.0.try_wait().unwrap()
    });
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut observer.0.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(exited.success(), "{exited}: {stderr}");
    assert!(stderr.is_empty(), "{stderr}");
}

/// A key with no lease under an election (an `etcdctl put` into baton's prefix) is no baton
/// candidate, and no lease ever removes it: a candidate queued behind it says so on stderr,
/// naming the key, rather than wait in silence; once the key is deleted it leads. On etcd
/// whatever backend the other tests use (the key layout is etcd's).
#[test]
fn a_key_with_no_lease_ahead_in_the_election_is_named() {
    let dir = scratch("foreign-key");
    let election = unique("foreign");
    // With a newline in it: the warning still is one line (the key quoted and escaped).
    let key = format!("/baton-cli-test/{election}/@candidates/garbage\nsecond line");
    let etcdctl = |args: &[&str]| {
        let status = std::process::Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &etcd()])
            .args(args)
            .stdout(Stdio::null())
            .status()
            .expect("etcdctl (from etcd-client) must be installed; scripts/test installs it");
        assert!(status.success(), "etcdctl {args:?}");
    };
    etcdctl(&["put", &key, ""]);
    let stderr_path = dir.join("b.stderr");
    let mut child = baton()
        .args([
            "run",
            "--backend",
            &format!("etcd://{}/baton-cli-test", etcd()),
        ])
        .args(["--election", &election, "--ttl", "2s", "--"])
        .args(["sh", "-c", &token_script(&dir, "b")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let escaped = key.replace('\n', "\\n");
    let stderr = wait_for("the warning", Duration::from_secs(10), || {
        let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
        (stderr.contains("a key with no lease is ahead in the election")
            && stderr.contains(&escaped))
        .then_some(stderr)
    });
    assert!(
        stderr.lines().all(|line| line.starts_with("baton: ")),
        "{stderr}"
    );
    assert_eq!(
        read_number(&dir.join("b.token")),
        None,
        "it led behind the key"
    );
    etcdctl(&["del", &key]);
    wait_leads(&mut child, &dir, "b", Duration::from_secs(10));
    signal(child.id() as i32, libc::SIGTERM);
    child.wait().unwrap();
}

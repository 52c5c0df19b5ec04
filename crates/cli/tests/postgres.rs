//! Faults only PostgreSQL has, against real processes: baton's connections terminated by an
//! operator (`pg_terminate_backend`), and the database restarted while a leader holds. Built
//! with the `postgres` feature; `scripts/test` starts the servers.
#![cfg(feature = "postgres")]

mod common;

use common::*;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// The schema of these tests.
const SCHEMA: &str = "baton_cli_pg";

fn url_at(addr: &str) -> String {
    format!("postgres://baton:baton@{addr}/baton?schema={SCHEMA}")
}

/// The PostgreSQL these tests may stop and start: `BATON_TEST_PG_RESTART_ADDR`, its data
/// directory `BATON_TEST_PG_RESTART_DATA`.
fn restartable() -> (String, String) {
    let need = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!(
                "{name} is not set: run the tests with scripts/test, which starts a second \
                 private PostgreSQL for the restart test"
            )
        })
    };
    (
        need("BATON_TEST_PG_RESTART_ADDR"),
        need("BATON_TEST_PG_RESTART_DATA"),
    )
}

/// Runs one statement on a raw connection to `addr` as user baton; its rows' first columns.
fn sql(addr: &str, statement: &str) -> Vec<String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let url = format!("postgres://baton:baton@{addr}/baton?application_name=baton-test");
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        let rows = client.simple_query(statement).await.unwrap();
        rows.iter()
            .filter_map(|message| match message {
                tokio_postgres::SimpleQueryMessage::Row(row) => {
                    Some(row.get(0).unwrap_or("").to_string())
                }
                _ => None,
            })
            .collect()
    })
}

/// Terminates every connection of application `app` (only this test's, not those of tests
/// running beside it); returns one row per connection it ended.
fn terminate_connections_of(addr: &str, app: &str) -> Vec<String> {
    sql(
        addr,
        &format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = '{app}' AND pid <> pg_backend_pid()"
        ),
    )
}

/// `pg_ctl` on the restartable cluster, as user postgres.
fn pg_ctl(data: &str, action: &str) {
    let bin = "/usr/lib/postgresql/15/bin/pg_ctl";
    let log = format!("{data}/../postgres.log");
    let mut command = std::process::Command::new("runuser");
    command.args(["-u", "postgres", "--", bin, "-D", data, "-w"]);
    match action {
        "stop" => command.args(["-m", "fast", "stop"]),
        _ => command.args(["-l", &log, "start"]),
    };
    let status = command
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "pg_ctl {action}: {status}");
}

/// A PostgreSQL that does not answer behind PgBouncer is an unreachable backend: one line and
/// exit 2, as when PostgreSQL itself does not answer. PgBouncer completes the connection from
/// what it knows of the server and holds the statements (here: the database PAUSEd on its
/// console); that was "create schema timed out", exit 1.
#[test]
fn a_database_that_does_not_answer_behind_pgbouncer_is_unreachable() {
    let pgbouncer = std::env::var("BATON_TEST_PGBOUNCER").expect(
        "BATON_TEST_PGBOUNCER is not set: run the tests with scripts/test, which starts PgBouncer",
    );
    let addr = pgbouncer
        .trim_start_matches("postgres://baton:baton@")
        .trim_end_matches("/baton")
        .to_string();
    let url = format!("postgres://baton:baton@{addr}/paused?schema={SCHEMA}");
    // PgBouncer learns the server's parameters on its first connection.
    let election = unique("paused");
    let leader = |url: &str| {
        baton()
            .args(["leader", "--backend", url, "--election", &election])
            .output()
            .unwrap()
    };
    assert!(leader(&url).status.success());
    let console = |command: &str| {
        let status = std::process::Command::new("psql")
            .args([
                &format!("postgres://postgres:postgres@{addr}/pgbouncer"),
                "-c",
                command,
            ])
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "{command}");
    };
    console("PAUSE paused");
    let output = leader(&url);
    console("RESUME paused");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!("baton: error: cannot reach postgres at {addr}")),
        "{stderr}"
    );
    assert!(leader(&url).status.success());
}

/// An operator terminating every connection baton has, again and again, changes no
/// leadership: renewals reconnect before the deadline, the notification connection comes back,
/// the waiter never starts while the leader runs, and a later handoff is as prompt as ever.
#[test]
fn terminated_connections_change_no_leader() {
    let addr = postgres();
    let dir = scratch("pg-terminate");
    let election = unique("terminate");
    // Only this test's connections are terminated, not those of tests running beside it.
    let app = format!("baton-{election}");
    let url = format!("{}&application_name={app}", url_at(&addr));
    let leader = Runner::start(&url, &election, "2s", &dir, "l");
    let token = leader.wait_running(Duration::from_secs(5));
    let waiter = Runner::start(&url, &election, "2s", &dir, "w");
    std::thread::sleep(Duration::from_millis(500));
    let mut terminated = 0;
    for _ in 0..6 {
        let ended = terminate_connections_of(&addr, &app);
        terminated += ended.len();
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            waiter.token().is_none(),
            "the waiter started while the leader held"
        );
        assert!(
            leader.child_pid().is_some_and(alive),
            "the leader lost its term: {}",
            leader.stderr()
        );
    }
    assert!(
        terminated >= 12,
        "only {terminated} connections were terminated"
    );
    assert_eq!(leader.token(), Some(token));
    // Handing over still works at once.
    let sent = Instant::now();
    signal(leader.child.id() as i32, libc::SIGTERM);
    let next = waiter.wait_running(Duration::from_secs(5));
    assert!(next > token);
    assert!(
        sent.elapsed() < Duration::from_secs(3),
        "handoff took {:?}",
        sent.elapsed()
    );
}

/// Connections terminated in quick succession, one of them the notification connection before
/// its probe came back, do not switch notifications off: that connection closing was taken
/// for a pooler that does not pass notifications, and the process polled for the rest of its
/// life (with the warning that says so).
#[test]
fn connections_terminated_in_quick_succession_leave_notifications_on() {
    let addr = postgres();
    let dir = scratch("pg-terminate-fast");
    let election = unique("terminate-fast");
    let app = format!("baton-{election}");
    let url = format!("{}&application_name={app}", url_at(&addr));
    let leader = Runner::start(&url, &election, "3s", &dir, "l");
    leader.wait_running(Duration::from_secs(5));
    let waiter = Runner::start(&url, &election, "3s", &dir, "w");
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..60 {
        terminate_connections_of(&addr, &app);
        std::thread::sleep(Duration::from_millis(100));
    }
    // The notification connections come back once the terminations stop.
    std::thread::sleep(Duration::from_secs(2));
    for (name, runner) in [("leader", &leader), ("waiter", &waiter)] {
        assert!(
            !runner.stderr().contains("notifications do not reach baton"),
            "the {name} gave notifications up: {}",
            runner.stderr()
        );
    }
    signal(leader.child.id() as i32, libc::SIGTERM);
    waiter.wait_running(Duration::from_secs(5));
}

/// A schema that holds another application's tables of the names baton uses is refused before
/// baton creates anything there: it used to create its other tables beside them and fail at
/// the first renewal (`column "key" does not exist`), leaving its tables in the schema.
#[test]
fn a_schema_with_tables_of_its_own_is_refused_and_left_alone() {
    let addr = postgres();
    let schema = format!("app_{}", std::process::id());
    sql(
        &addr,
        &format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}; \
             CREATE TABLE {schema}.sessions (id bigint PRIMARY KEY, who text)"
        ),
    );
    let url = format!("postgres://baton:baton@{addr}/baton?schema={schema}");
    for command in ["run", "leader"] {
        let mut args = vec![command, "--backend", &url, "--election", "e"];
        if command == "run" {
            args.extend(["--", "true"]);
        }
        let output = baton().args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{command}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{command}: {stderr}");
        assert!(
            stderr.contains("tables that are not baton's (sessions"),
            "{stderr}"
        );
    }
    let tables = sql(
        &addr,
        &format!(
            "SELECT string_agg(tablename, ',' ORDER BY tablename) FROM pg_tables \
             WHERE schemaname = '{schema}'"
        ),
    );
    assert_eq!(tables, ["sessions"]);
    sql(&addr, &format!("DROP SCHEMA {schema} CASCADE"));
}

/// `baton run` of a command that writes its token to `DIR/NAME.token`, first noting in
/// `DIR/overlap` whether process `before` (the previous leader's command) was still alive.
fn successor(url: &str, election: &str, dir: &Path, name: &str, before: u64) -> Child {
    let d = dir.display();
    let script = format!(
        "s=$(cut -d' ' -f3 /proc/{before}/stat 2>/dev/null); \
         if [ -n \"$s\" ] && [ \"$s\" != Z ]; then touch {d}/overlap; fi; \
         echo $BATON_TOKEN > {d}/{name}.token; exec sleep 600"
    );
    baton()
        .args([
            "run",
            "--backend",
            url,
            "--election",
            election,
            "--ttl",
            "2s",
        ])
        .args(["--id", name, "--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Holds `rows` (a `SELECT … FOR UPDATE` of baton's schema) locked for `seconds`, from a
/// `psql` of its own, as an operator's session or a migration would.
fn lock_rows(addr: &str, rows: &str, seconds: u32) -> Child {
    let lock = format!("BEGIN; {rows} FOR UPDATE; SELECT pg_sleep({seconds}); COMMIT;");
    std::process::Command::new("psql")
        .args([
            &format!("postgres://baton:baton@{addr}/baton"),
            "-qc",
            &lock,
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// A leader `a` (TTL `ttl`) running its command, and a waiter `b` in line behind it that
/// records whether a's command still ran when b's started.
struct Locked {
    addr: String,
    dir: Scratch,
    election: String,
    leader: Runner,
    token: u64,
    command: u64,
    waiter: Child,
}

fn leader_and_waiter(name: &str, ttl: &str) -> Locked {
    let addr = postgres();
    let dir = scratch(&format!("pg-{name}"));
    let url = url_at(&addr);
    let election = unique(name);
    let leader = Runner::start(&url, &election, ttl, &dir, "a");
    let token = leader.wait_running(Duration::from_secs(10));
    let command = leader.child_pid().unwrap();
    let waiter = successor(&url, &election, &dir, "b", command);
    std::thread::sleep(Duration::from_millis(500));
    Locked {
        addr,
        dir,
        election,
        leader,
        token,
        command,
        waiter,
    }
}

/// A leader's session row locked from outside blocks its renewals: its command stops at the
/// local deadline all the same; the session expires by the database's clock, so the waiter
/// leads (with a higher token, never beside the old command) while the row is still locked;
/// the old leader exits 3 once its revoke gets through.
#[test]
fn a_leaders_session_row_locked_from_outside_stops_it_at_its_deadline() {
    let Locked {
        addr,
        dir,
        election,
        mut leader,
        token,
        command,
        mut waiter,
    } = leader_and_waiter("locked-session", "2s");
    let mut locker = lock_rows(
        &addr,
        &format!(
            "SELECT 1 FROM {SCHEMA}.sessions WHERE id = (SELECT session FROM {SCHEMA}.entries \
             WHERE election = '{election}' AND candidate = 'a')"
        ),
        6,
    );
    wait_for("the leader's command stops", Duration::from_secs(3), || {
        (!alive(command)).then_some(())
    });
    let next = wait_for("b leads", Duration::from_secs(10), || {
        read_number(&dir.join("b.token"))
    });
    assert!(next > token, "{next} after {token}");
    assert!(
        !dir.join("overlap").exists(),
        "b started beside a's command"
    );
    assert!(locker.wait().unwrap().success());
    let status = wait_for("a exits", Duration::from_secs(15), || {
        leader.child.try_wait().unwrap()
    });
    assert_eq!(status.code(), Some(3), "{}", leader.stderr());
    signal(waiter.id() as i32, libc::SIGTERM);
    let _ = waiter.wait();
}

/// The README's "rows locked from outside": the leader's entry locked (`SELECT … FOR UPDATE`
/// on `entries`) when it is asked to stop (SIGTERM): its command stops within the grace, but
/// its resign waits for the lock, so the waiter is elected only once the lock is released,
/// never beside the old command; the old leader then exits 143.
#[test]
fn a_leaders_entry_locked_from_outside_holds_the_handoff_until_it_is_released() {
    let Locked {
        addr,
        dir,
        election,
        mut leader,
        token,
        command,
        mut waiter,
    } = leader_and_waiter("locked-entry", "10s");
    let mut locker = lock_rows(
        &addr,
        &format!(
            "SELECT 1 FROM {SCHEMA}.entries WHERE election = '{election}' AND candidate = 'a'"
        ),
        4,
    );
    // Let the lock be taken first.
    std::thread::sleep(Duration::from_millis(300));
    let locked_at = Instant::now();
    signal(leader.child.id() as i32, libc::SIGTERM);
    wait_for("the leader's command stops", Duration::from_secs(2), || {
        (!alive(command)).then_some(())
    });
    let next = wait_for("b leads", Duration::from_secs(15), || {
        read_number(&dir.join("b.token"))
    });
    assert!(
        locked_at.elapsed() >= Duration::from_secs(3),
        "b led {:?} into a 4 s lock",
        locked_at.elapsed()
    );
    assert!(next > token, "{next} after {token}");
    assert!(
        !dir.join("overlap").exists(),
        "b started beside a's command"
    );
    assert!(locker.wait().unwrap().success());
    let status = wait_for("a exits", Duration::from_secs(15), || {
        leader.child.try_wait().unwrap()
    });
    assert_eq!(
        status.code(),
        Some(128 + libc::SIGTERM),
        "{}",
        leader.stderr()
    );
    signal(waiter.id() as i32, libc::SIGTERM);
    let _ = waiter.wait();
}

/// A session with `synchronous_commit = off` (here from the URL's options) is no reason to
/// refuse: `baton run` leads and its command gets a token, and every commit of that term (the
/// grant, the campaign, the resign, the revoke) was made durable all the same (the library's
/// `commits_wait_for_the_flush_whatever_the_session_says` watches each commit).
#[test]
fn a_session_with_synchronous_commit_off_runs() {
    let addr = postgres();
    let url = format!(
        "postgres://baton:baton@{addr}/baton?schema={SCHEMA}&options=-c%20synchronous_commit%3Doff"
    );
    let election = unique("sync-off");
    let output = baton()
        .args([
            "run",
            "--backend",
            &url,
            "--election",
            &election,
            "--ttl",
            "2s",
        ])
        .args(["--", "sh", "-c", "echo token=$BATON_TOKEN"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stdout.starts_with("token="), "{stdout}");
    assert!(
        stdout.trim()["token=".len()..].parse::<u64>().is_ok(),
        "{stdout}"
    );
    assert!(stderr.contains("elected with token"), "{stderr}");
    assert!(
        !stderr.contains("warning") && !stderr.contains("error"),
        "nothing to warn of: {stderr}"
    );
}

/// A schema an earlier release made (no `fence_durable` trigger on `fences`), used by roles
/// that do not own it: one that may fence is warned, once, that its owner must connect; a
/// read-only one says nothing; the owner's `baton leader` adds the trigger, after which nobody
/// is warned.
#[test]
fn an_earlier_releases_schema_warns_only_those_who_may_fence() {
    let addr = postgres();
    let schema = format!("old_fences_cli_{}", std::process::id());
    let owner = format!("postgres://baton:baton@{addr}/baton?schema={schema}");
    let leader = |url: &str| {
        let output = baton()
            .args(["leader", "--backend", url, "--election", "e"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        assert!(output.status.success(), "{url}: {stderr}");
        stderr
    };
    assert_eq!(leader(&owner), "");
    sql(
        &addr,
        &format!(
            "DROP TRIGGER fence_durable ON {schema}.fences; \
             GRANT USAGE ON SCHEMA {schema} TO baton_limited, baton_readonly; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} \
             TO baton_limited; \
             GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO baton_readonly"
        ),
    );
    let writer = format!("postgres://baton_limited:limited@{addr}/baton?schema={schema}");
    let reader = format!("postgres://baton_readonly:readonly@{addr}/baton?schema={schema}");
    let warned = leader(&writer);
    assert_eq!(warned.lines().count(), 1, "{warned}");
    assert!(
        warned.contains(&format!("{schema}.fences lacks the trigger"))
            && warned.contains("let the table's owner connect once"),
        "{warned}"
    );
    assert_eq!(leader(&reader), "");
    assert_eq!(leader(&owner), "");
    assert_eq!(leader(&writer), "");
    sql(&addr, &format!("DROP SCHEMA {schema} CASCADE"));
}

/// PostgreSQL stopped while a leader holds: renewals fail, so the leader's command is killed
/// at its local deadline (within the TTL) and its `baton run` says so; the waiter does not
/// start meanwhile. Once the database is back, the election resumes with a larger token.
#[test]
fn restarted_database_loses_the_lease_at_the_deadline_and_the_election_resumes() {
    let (addr, data) = restartable();
    let dir = scratch("pg-restart");
    let election = unique("restart");
    let leader = Runner::start(&url_at(&addr), &election, "2s", &dir, "l");
    let token = leader.wait_running(Duration::from_secs(5));
    let pid = leader.child_pid().unwrap();
    let mut waiter = Runner::start_with(
        &url_at(&addr),
        &election,
        &["--ttl", "2s", "--requeue"],
        &dir,
        "w",
    );
    std::thread::sleep(Duration::from_millis(500));
    pg_ctl(&data, "stop");
    // Every renewal the database acknowledged was sent before this.
    let stopped = Instant::now();
    let dead = wait_for(
        "the leader's command killed",
        Duration::from_secs(5),
        || (!alive(pid)).then(Instant::now),
    );
    let held = dead.saturating_duration_since(stopped);
    assert!(
        held < Duration::from_millis(2_300),
        "the command ran {held:?} after the database stopped (TTL 2s)"
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        waiter.token().is_none(),
        "the waiter started without a database"
    );
    pg_ctl(&data, "start");
    let next = waiter.wait_running(Duration::from_secs(15));
    assert!(next > token, "token {next} after {token}");
    let status = wait_for("the old leader exits", Duration::from_secs(10), || {
        leader_status(&leader)
    });
    assert_eq!(status, Some(3), "{}", leader.stderr());
    let _ = waiter.child.kill();
}

fn leader_status(runner: &Runner) -> Option<Option<i32>> {
    // SAFETY: waitpid on our own child, non-blocking.
    let mut status = 0;
    let pid = runner.child.id() as i32;
    let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    (done == pid).then(|| libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)))
}

/// libpq's environment fills in what the URL leaves out (here, everything): the same
/// variables psql reads. A wrong password from it is one line and exit 2.
#[test]
fn libpq_environment_fills_in_the_url() {
    let addr = postgres();
    let (host, port) = addr.rsplit_once(':').unwrap();
    let leader = |password: &str| {
        baton()
            .args([
                "leader",
                "--backend",
                &format!("postgres://?schema={SCHEMA}"),
            ])
            .args(["--election", "env-check"])
            .env("PGHOST", host)
            .env("PGPORT", port)
            .env("PGUSER", "baton")
            .env("PGPASSWORD", password)
            .env("PGDATABASE", "baton")
            .env("PGSSLMODE", "require")
            .output()
            .unwrap()
    };
    let good = leader("baton");
    assert_eq!(
        good.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&good.stderr)
    );
    assert!(String::from_utf8_lossy(&good.stdout).contains("\"leader\":null"));
    let bad = leader("wrong");
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("password"), "{stderr}");
}

/// libfaketime, which shifts what a process reads as the wall clock.
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// The client host's wall clock stepped an hour ahead, then an hour behind, while a leader
/// holds and a waiter waits, changes nothing: a session's expiry is decided by the database's
/// clock and the local deadline by the monotonic clock; no client wall clock is compared with
/// anything. The leader keeps its term, the waiter waits, and a crash is still taken over
/// within the TTL. (libfaketime steps CLOCK_REALTIME of both `baton run` processes.)
#[test]
fn the_client_hosts_clock_stepped_changes_nothing() {
    assert!(
        std::path::Path::new(FAKETIME).exists(),
        "{FAKETIME} is missing: scripts/test installs Debian's faketime"
    );
    let addr = postgres();
    let dir = scratch("pg-clock");
    let shift = dir.join("faketime");
    std::fs::write(&shift, "+0\n").unwrap();
    let shift_text = shift.display().to_string();
    let env = [
        ("LD_PRELOAD", FAKETIME),
        ("FAKETIME_TIMESTAMP_FILE", shift_text.as_str()),
        ("FAKETIME_NO_CACHE", "1"),
        ("DONT_FAKE_MONOTONIC", "1"),
    ];
    // The shift takes effect in a process started that way.
    let wall = |offset: &str| {
        std::fs::write(&shift, format!("{offset}\n")).unwrap();
        let out = std::process::Command::new("date")
            .arg("+%s")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<i64>()
            .unwrap()
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (wall("+1h") - now - 3600).abs() < 30,
        "libfaketime has no effect"
    );
    wall("+0");
    let election = unique("clock");
    let flags = ["--ttl", "2s"];
    let leader = Runner::start_env(&url_at(&addr), &election, &flags, &dir, "l", &env);
    let token = leader.wait_running(Duration::from_secs(5));
    let waiter = Runner::start_env(&url_at(&addr), &election, &flags, &dir, "w", &env);
    std::thread::sleep(Duration::from_millis(500));
    for offset in ["+1h", "-1h"] {
        wall(offset);
        std::thread::sleep(Duration::from_secs(3));
        assert!(
            leader.child_pid().is_some_and(alive),
            "the leader lost its term after the clock moved {offset}: {}",
            leader.stderr()
        );
        assert!(
            waiter.token().is_none(),
            "the waiter started after {offset}"
        );
    }
    // A crash is taken over within the TTL (plus the database's look), clock still shifted.
    let killed = Instant::now();
    signal(-process_group(leader.child.id() as u64), libc::SIGKILL);
    let next = waiter.wait_running(Duration::from_secs(6));
    assert!(next > token);
    let took = killed.elapsed();
    assert!(
        took > Duration::from_millis(1_000) && took < Duration::from_millis(3_500),
        "failover took {took:?} at TTL 2s"
    );
}

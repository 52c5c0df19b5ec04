//! `baton server` as a process: Debian's etcdctl against it, restarts with the same data
//! directory, kill -9 in the middle of a write load, and bad input.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{baton, read_number, scratch, signal, token_script, wait_for, wait_leads, Runner};

/// A `baton server` process of this test's own.
struct ServerProcess {
    child: Option<Child>,
    addr: String,
    data: PathBuf,
}

impl ServerProcess {
    /// Starts a server on `listen` (port 0: a free one) over `data`.
    fn start(listen: &str, data: &Path) -> ServerProcess {
        ServerProcess::start_with(listen, data, &[])
    }

    /// [`ServerProcess::start`] with more flags.
    fn start_with(listen: &str, data: &Path, flags: &[&str]) -> ServerProcess {
        let (child, addr) = launch(server_command(listen, data, flags));
        ServerProcess {
            child: Some(child),
            addr,
            data: data.to_path_buf(),
        }
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// SIGTERM and wait: a clean stop.
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id() as i32, libc::SIGTERM);
            let status = child.wait().unwrap();
            assert!(status.success(), "baton server exited with {status}");
        }
    }

    /// SIGKILL and reap: a crash.
    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// [`ServerProcess::kill9`] if `crash`, else [`ServerProcess::stop`].
    fn halt(&mut self, crash: bool) {
        if crash {
            self.kill9();
        } else {
            self.stop();
        }
    }

    /// Starts again on the same address and data directory (in place: dropping a
    /// `ServerProcess` removes its data directory).
    fn restart(&mut self) {
        self.restart_with(&[]);
    }

    /// [`ServerProcess::restart`] with more flags.
    fn restart_with(&mut self, flags: &[&str]) {
        assert!(self.child.is_none());
        let (child, _) = launch(server_command(&self.addr, &self.data, flags));
        self.child = Some(child);
    }
}

/// `baton server --listen LISTEN --data DATA FLAGS…`.
fn server_command(listen: &str, data: &Path, flags: &[&str]) -> Command {
    let mut command = baton();
    command
        .args(["server", "--listen", listen, "--data"])
        .arg(data)
        .args(flags);
    command
}

/// Starts a `baton server` command and waits for its ready line; returns the process (stdout
/// and stderr piped; stdout read up to the ready line) and the address it serves.
fn launch(mut command: Command) -> (Child, String) {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: serde_json::Value = match serde_json::from_str(&line) {
        Ok(ready) => ready,
        Err(_) => {
            let _ = child.kill();
            let output = child.wait_with_output().unwrap();
            panic!(
                "baton server did not start: {line:?} {}",
                String::from_utf8_lossy(&output.stderr)
            )
        }
    };
    let addr = ready["listening"].as_str().unwrap().to_string();
    (child, addr)
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill9();
        // Each test's data directory holds a Raft log of a few MiB: leave nothing behind.
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

fn etcdctl(server: &ServerProcess) -> Command {
    let mut command = Command::new("etcdctl");
    command
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", &server.addr, "--command-timeout=5s"]);
    command
}

/// Runs etcdctl; returns stdout, failing the test on a non-zero exit.
fn ctl(server: &ServerProcess, args: &[&str]) -> String {
    let output = etcdctl(server)
        .args(args)
        .output()
        .expect("etcdctl (from etcd-client) must be installed; scripts/test installs it");
    assert!(
        output.status.success(),
        "etcdctl {args:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// Runs etcdctl expecting failure; returns stderr.
fn ctl_fails(server: &ServerProcess, args: &[&str]) -> String {
    let output = etcdctl(server).args(args).output().unwrap();
    assert!(!output.status.success(), "etcdctl {args:?} succeeded");
    String::from_utf8(output.stderr).unwrap()
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

fn revision_of(server: &ServerProcess) -> i64 {
    json(&ctl(server, &["get", "nothing-here", "-w", "json"]))["header"]["revision"]
        .as_i64()
        .unwrap()
}

#[test]
fn etcdctl_put_get_delete_and_past_revisions() {
    let dir = scratch("server-kv");
    let server = ServerProcess::start("127.0.0.1:0", &dir);
    assert_eq!(
        revision_of(&server),
        1,
        "an empty store is at revision 1, as etcd"
    );
    assert_eq!(ctl(&server, &["put", "/app/a", "1"]), "OK\n");
    assert_eq!(ctl(&server, &["put", "/app/b", "2"]), "OK\n");
    assert_eq!(ctl(&server, &["put", "/app/a", "3"]), "OK\n");
    assert_eq!(ctl(&server, &["get", "/app/a"]), "/app/a\n3\n");
    assert_eq!(
        ctl(&server, &["get", "--prefix", "/app/"]),
        "/app/a\n3\n/app/b\n2\n"
    );
    let a = json(&ctl(&server, &["get", "/app/a", "-w", "json"]));
    assert_eq!(a["kvs"][0]["create_revision"], 2);
    assert_eq!(a["kvs"][0]["mod_revision"], 4);
    assert_eq!(a["kvs"][0]["version"], 2);
    assert_eq!(a["header"]["revision"], 4);
    // The value at an older revision, sorted and limited reads, counts.
    assert_eq!(ctl(&server, &["get", "/app/a", "--rev=2"]), "/app/a\n1\n");
    assert_eq!(
        ctl(
            &server,
            &[
                "get",
                "--prefix",
                "/app/",
                "--sort-by=MODIFY",
                "--order=DESCEND",
                "--limit=1"
            ]
        ),
        "/app/a\n3\n"
    );
    let counted = json(&ctl(
        &server,
        &["get", "--prefix", "/app/", "--limit=1", "-w", "json"],
    ));
    assert_eq!(counted["count"], 2);
    assert_eq!(counted["more"], true);
    assert_eq!(
        ctl(&server, &["get", "--prefix", "/app/", "--keys-only"]),
        "/app/a\n\n/app/b\n\n"
    );
    assert_eq!(ctl(&server, &["del", "--prefix", "/app/"]), "2\n");
    assert_eq!(ctl(&server, &["get", "--prefix", "/app/"]), "");
    // A future revision and a compacted one are errors, as on etcd.
    let future = ctl_fails(&server, &["get", "/app/a", "--rev=1000"]);
    assert!(
        future.contains("required revision is a future revision"),
        "{future}"
    );
    ctl(&server, &["compaction", "4"]);
    let compacted = ctl_fails(&server, &["get", "/app/a", "--rev=3"]);
    assert!(
        compacted.contains("required revision has been compacted"),
        "{compacted}"
    );
}

#[test]
fn etcdctl_txn_compares_and_branches() {
    let dir = scratch("server-txn");
    let server = ServerProcess::start("127.0.0.1:0", &dir);
    ctl(&server, &["put", "k", "v1"]);
    let txn = |script: &str| {
        let mut child = etcdctl(&server)
            .args(["txn"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(script.as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success());
        String::from_utf8(output.stdout).unwrap()
    };
    // compares, blank line, success ops, blank line, failure ops, blank line.
    let out = txn("value(\"k\") = \"v1\"\n\nput k v2\nput other x\n\nput k failed\n\n");
    assert!(out.starts_with("SUCCESS"), "{out}");
    assert_eq!(ctl(&server, &["get", "k", "--print-value-only"]), "v2\n");
    let out = txn("value(\"k\") = \"v1\"\n\nput k v3\n\nget k\n\n");
    assert!(out.starts_with("FAILURE"), "{out}");
    assert!(out.contains("k\nv2"), "{out}");
    let out = txn("create(\"missing\") = \"0\"\nversion(\"k\") > \"1\"\n\ndel k\n\n\n");
    assert!(out.starts_with("SUCCESS"), "{out}");
    assert_eq!(ctl(&server, &["get", "k"]), "");
    // Both writes of the first txn share one revision.
    let other = json(&ctl(&server, &["get", "other", "-w", "json"]));
    assert_eq!(other["kvs"][0]["mod_revision"], 3);
}

#[test]
fn etcdctl_leases_grant_keep_alive_revoke() {
    let dir = scratch("server-lease");
    let server = ServerProcess::start("127.0.0.1:0", &dir);
    let granted = ctl(&server, &["lease", "grant", "30"]);
    // "lease 694d77b7a4a3d00b granted with TTL(30s)"
    let id = granted.split_whitespace().nth(1).unwrap().to_string();
    assert!(granted.contains("granted with TTL(30s)"), "{granted}");
    ctl(&server, &["put", "--lease", &id, "leased", "x"]);
    let ttl = ctl(&server, &["lease", "timetolive", &id, "--keys"]);
    assert!(ttl.contains("granted with TTL(30s)"), "{ttl}");
    assert!(ttl.contains("attached keys([leased])"), "{ttl}");
    assert!(ctl(&server, &["lease", "list"]).contains(&id));
    let kept = ctl(&server, &["lease", "keep-alive", "--once", &id]);
    assert!(kept.contains("keepalived with TTL(30)"), "{kept}");
    let revoked = ctl(&server, &["lease", "revoke", &id]);
    assert!(revoked.contains("revoked"), "{revoked}");
    assert_eq!(ctl(&server, &["get", "leased"]), "");
    let gone = ctl(&server, &["lease", "timetolive", &id]);
    assert!(gone.contains("already expired"), "{gone}");
    let unknown = ctl_fails(&server, &["lease", "revoke", "1234"]);
    assert!(unknown.contains("requested lease not found"), "{unknown}");
}

/// A lease nobody keeps alive expires at its TTL (1 s here), taking its keys with it.
#[test]
fn a_lease_expires_at_its_ttl() {
    let dir = scratch("server-expiry");
    let server = ServerProcess::start("127.0.0.1:0", &dir);
    // Before the grant: the lease cannot run out less than its TTL after this.
    let start = Instant::now();
    let granted = ctl(&server, &["lease", "grant", "1"]);
    let id = granted.split_whitespace().nth(1).unwrap().to_string();
    ctl(&server, &["put", "--lease", &id, "short", "x"]);
    wait_for("the leased key to go", Duration::from_secs(5), || {
        ctl(&server, &["get", "short"]).is_empty().then_some(())
    });
    // Never early: the clock started before the grant was even asked for. Not much late
    // either (the lateness itself is measured by `baton bench load --op expiry`).
    let elapsed = start.elapsed();
    assert!(
        elapsed >= Duration::from_secs(1),
        "expired early: {elapsed:?}"
    );
    assert!(
        elapsed < Duration::from_millis(2_500),
        "expired late: {elapsed:?}"
    );
}

#[test]
fn etcdctl_watch_live_and_from_a_past_revision() {
    let dir = scratch("server-watch");
    let server = ServerProcess::start("127.0.0.1:0", &dir);
    ctl(&server, &["put", "/w/a", "1"]);
    ctl(&server, &["put", "/w/b", "2"]);
    // From revision 2: the history first, then what happens next.
    let mut watch = etcdctl(&server)
        .args(["watch", "--prefix", "/w/", "--rev=2"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    let mut next = || lines.next().unwrap().unwrap();
    assert_eq!([next(), next(), next()], ["PUT", "/w/a", "1"]);
    assert_eq!([next(), next(), next()], ["PUT", "/w/b", "2"]);
    ctl(&server, &["del", "/w/a"]);
    // etcdctl prints a deletion's (empty) value too.
    assert_eq!([next(), next(), next()], ["DELETE", "/w/a", ""]);
    ctl(&server, &["put", "/w/c", "3"]);
    assert_eq!([next(), next(), next()], ["PUT", "/w/c", "3"]);
    watch.kill().unwrap();
    watch.wait().unwrap();
    // History that was compacted away: the watch is cancelled with etcd's answer.
    ctl(&server, &["compaction", "4"]);
    let output = etcdctl(&server)
        .args(["watch", "--prefix", "/w/", "--rev=2"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(
        said.contains("required revision has been compacted"),
        "{said}"
    );
}

#[test]
fn etcdctl_lock_and_elect() {
    let dir = scratch("server-lock");
    let server = ServerProcess::start("127.0.0.1:0", &dir);
    // The first holder keeps the lock while its command runs; the second waits for it.
    let marker = dir.join("order");
    let hold = |name: &str, seconds: &str| {
        etcdctl(&server)
            .args(["lock", "the-lock", "--", "sh", "-c"])
            .arg(format!(
                "echo {name} start >> {m}; sleep {seconds}; echo {name} end >> {m}",
                m = marker.display()
            ))
            .spawn()
            .unwrap()
    };
    let mut first = hold("first", "1");
    wait_for("the first holder", Duration::from_secs(5), || {
        std::fs::read_to_string(&marker)
            .ok()
            .filter(|s| s.contains("first start"))
    });
    let mut second = hold("second", "0");
    assert!(first.wait().unwrap().success());
    assert!(second.wait().unwrap().success());
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap(),
        "first start\nfirst end\nsecond start\nsecond end\n"
    );
    // An election: a candidate leads; an observer sees its proposal.
    let mut candidate = etcdctl(&server)
        .args(["elect", "the-election", "proposal-a"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut led = BufReader::new(candidate.stdout.take().unwrap()).lines();
    let key = led.next().unwrap().unwrap();
    assert!(key.starts_with("the-election/"), "{key}");
    assert_eq!(led.next().unwrap().unwrap(), "proposal-a");
    let mut observer = etcdctl(&server)
        .args(["elect", "--listen", "the-election"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut seen = BufReader::new(observer.stdout.take().unwrap()).lines();
    assert_eq!(seen.next().unwrap().unwrap(), key);
    assert_eq!(seen.next().unwrap().unwrap(), "proposal-a");
    for child in [&mut candidate, &mut observer] {
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

#[test]
fn etcdctl_endpoint_status_and_member_list() {
    let dir = scratch("server-status");
    let server = ServerProcess::start("127.0.0.1:0", &dir);
    let status = json(&ctl(&server, &["endpoint", "status", "-w", "json"]));
    let status = &status[0]["Status"];
    assert!(
        status["version"]
            .as_str()
            .unwrap()
            .starts_with("3.4.0+baton."),
        "{status}"
    );
    let member = status["header"]["member_id"].as_u64().unwrap();
    assert_eq!(status["leader"].as_u64().unwrap(), member);
    assert!(status["raftIndex"].as_u64().unwrap() >= 1);
    let members = json(&ctl(&server, &["member", "list", "-w", "json"]));
    let members = members["members"].as_array().unwrap();
    assert_eq!(members.len(), 1);
    assert_eq!(members[0]["ID"].as_u64().unwrap(), member);
    assert_eq!(
        members[0]["clientURLs"][0].as_str().unwrap(),
        format!("http://{}", server.addr)
    );
}

/// `etcdctl put KEY` with the value on stdin (a value this big is no argument).
fn put_from_stdin(server: &ServerProcess, key: &str, value: &[u8]) -> (bool, String) {
    let mut child = etcdctl(server)
        .args(["put", key])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(value).unwrap();
    let output = child.wait_with_output().unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The peak resident memory of process `pid`, in bytes.
fn peak_rss(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM in {status}"));
    kib * 1024
}

/// `--quota-bytes`: writes that add data stop at the quota with etcd's "database space
/// exceeded", a deletion frees room at once, and a big value written over and over keeps the
/// server's memory near the quota: history and the in-memory log are bounded by bytes too
/// (before, 200 overwrites of 1.4 MB took the server to 1 GB; any client could exhaust memory).
#[test]
fn the_quota_bounds_the_data_and_the_memory() {
    let dir = scratch("server-quota");
    let server = ServerProcess::start_with("127.0.0.1:0", &dir, &["--quota-bytes", "4MiB"]);
    let value = vec![b'v'; 1_400_000];
    let refused = (0..10).find_map(|i| {
        let (ok, stderr) = put_from_stdin(&server, &format!("/q/{i:02}"), &value);
        (!ok).then_some((i, stderr))
    });
    let (at, stderr) = refused.expect("10 values of 1.4 MB were all taken under a 4 MiB quota");
    assert!(stderr.contains("database space exceeded"), "{stderr}");
    // 4 MiB takes two or three such values (with their keys and bookkeeping), not more.
    assert!((2..=3).contains(&at), "refused at the write of value {at}");
    // A txn that only deletes passes at the quota (baton's resign is one): here every value.
    let mut txn = etcdctl(&server)
        .arg("txn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    txn.stdin
        .take()
        .unwrap()
        .write_all(b"\ndel /q/ /q0\n\n\n")
        .unwrap();
    let output = txn.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "a deleting txn at the quota: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let left = ctl(&server, &["get", "--prefix", "/q/", "--keys-only"]);
    assert_eq!(left.trim(), "", "left after the deleting txn");
    // Room again at once; then the same key over and over: 25 × 1.4 MB through the log and
    // the history, which held all of it before (about 70 MB more memory).
    let before = peak_rss(server.pid());
    for round in 0..25 {
        let (ok, stderr) = put_from_stdin(&server, "/same", &value);
        assert!(ok, "overwrite {round}: {stderr}");
    }
    let peak = peak_rss(server.pid());
    eprintln!("peak RSS {} MiB, {} MiB before", peak >> 20, before >> 20);
    // History within 1 MiB (plus the last revision), the log snapshotted past 1 MiB and held
    // to 2 MiB, a snapshot being built: a few values' worth above the peak before.
    assert!(
        peak < before + (24 << 20),
        "peak RSS {} MiB (it was {} MiB before the overwrites)",
        peak >> 20,
        before >> 20
    );
    let at_two = ctl_fails(&server, &["get", "/same", "--rev=2"]);
    assert!(at_two.contains("compacted"), "{at_two}");
}

/// Big values written at once by several clients go into one log entry (group commit), which
/// can leave the log past twice its bound on its own. The snapshot asked for when it was
/// appended is built from what is applied then, without it, so the log stayed past the bound
/// after the purge, the proposer held every later write back for good, and nothing asked for
/// another snapshot: a server at a 4 MiB quota could stop answering writes (resigns and lease
/// expiries included) until it was restarted. Now no entry carries more than the bound but for
/// its last command, and the snapshot task asks again while the log is past the bound (unit
/// tests in node.rs: the race is rare end to end). Every write must be answered.
#[test]
fn big_values_written_at_once_never_wedge_the_log() {
    let dir = scratch("server-quota-burst");
    let server = ServerProcess::start_with("127.0.0.1:0", &dir, &["--quota-bytes", "4MiB"]);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let value = vec![b'v'; 1_400_000];
    // Four writers overwrite one key (the live data stays at one value, under the quota),
    // 6 times each, released together each round.
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(4));
    let writers: Vec<_> = (0..4)
        .map(|writer| {
            let (addr, value, barrier) = (server.addr.clone(), value.clone(), barrier.clone());
            runtime.spawn(async move {
                let mut client = etcd_client::Client::connect([addr], None).await.unwrap();
                for round in 0..6 {
                    barrier.wait().await;
                    let put = client.put("/burst", value.clone(), None);
                    match tokio::time::timeout(Duration::from_secs(20), put).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(error)) => panic!("writer {writer}, round {round}: {error}"),
                        Err(_) => panic!("writer {writer}, round {round}: no answer in 20 s"),
                    }
                }
            })
        })
        .collect();
    for writer in writers {
        runtime.block_on(writer).unwrap();
    }
    let (ok, stderr) = put_from_stdin(&server, "/after", b"small");
    assert!(ok, "a small write after the burst: {stderr}");
}

/// A server restarted at its quota counts its data again from what it restored (the counts are
/// not in the snapshot): writes that add data are still refused, and a deletion frees room.
#[test]
fn the_quota_holds_across_a_restart() {
    let dir = scratch("server-quota-restart");
    let mut server = ServerProcess::start_with("127.0.0.1:0", &dir, &["--quota-bytes", "4MiB"]);
    let value = vec![b'v'; 1_400_000];
    let refused = (0..10).find(|i| !put_from_stdin(&server, &format!("/r/{i:02}"), &value).0);
    let refused = refused.expect("the quota never refused a write");
    server.stop();
    server.restart_with(&["--quota-bytes", "4MiB"]);
    let (ok, stderr) = put_from_stdin(&server, "/r/after", &value);
    assert!(
        !ok && stderr.contains("database space exceeded"),
        "{stderr}"
    );
    ctl(&server, &["del", "/r/00"]);
    let (ok, stderr) = put_from_stdin(&server, &format!("/r/{refused:02}"), &value);
    assert!(ok, "after a deletion: {stderr}");
}

/// SIGHUP (the terminal or SSH session that started it closed) stops the server as SIGTERM
/// does: a clean exit 0, and a restart finds every write (it used to die of the signal).
#[test]
fn sighup_stops_the_server_cleanly() {
    let dir = scratch("server-hup");
    let mut server = ServerProcess::start("127.0.0.1:0", &dir);
    ctl(&server, &["put", "/hup", "kept"]);
    let before = revision_of(&server);
    let mut child = server.child.take().unwrap();
    signal(child.id() as i32, libc::SIGHUP);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "baton server exited with {status}");
    server.restart();
    assert_eq!(revision_of(&server), before);
    assert!(ctl(&server, &["get", "/hup"]).contains("kept"));
}

/// A restart with the same data directory keeps keys, revisions and leases; a surviving lease
/// starts again with its full TTL.
#[test]
fn restart_keeps_keys_revisions_and_leases() {
    restart_keeps(false);
}

/// The same after kill -9 of the server (no shutdown of its own): every acknowledged key and
/// revision is in its log, and the lease restarts with its full TTL.
#[test]
fn kill_9_and_restart_keep_keys_revisions_and_leases() {
    restart_keeps(true);
}

/// Keys, revisions and a lease across a restart: after SIGTERM, or after kill -9 if `crash`.
fn restart_keeps(crash: bool) {
    let dir = scratch("server-restart");
    let mut server = ServerProcess::start("127.0.0.1:0", &dir);
    for i in 0..50 {
        ctl(&server, &["put", &format!("/r/{i:02}"), &i.to_string()]);
    }
    let granted = ctl(&server, &["lease", "grant", "20"]);
    let id = granted.split_whitespace().nth(1).unwrap().to_string();
    ctl(&server, &["put", "--lease", &id, "/r/leased", "x"]);
    let before = revision_of(&server);
    // Let some of the TTL go by first: 5 s, so a lease that kept counting would show 15 s or
    // less after the restart.
    std::thread::sleep(Duration::from_secs(5));
    server.halt(crash);
    server.restart();
    let ttl = ctl(&server, &["lease", "timetolive", &id]);
    let remaining: u64 = ttl
        .split("remaining(")
        .nth(1)
        .and_then(|rest| rest.split("s)").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{ttl}"));
    assert!(
        remaining >= 17,
        "a surviving lease restarts with its full TTL: {ttl}"
    );
    assert_eq!(revision_of(&server), before);
    let all = json(&ctl(
        &server,
        &["get", "--prefix", "/r/", "--limit=1", "-w", "json"],
    ));
    assert_eq!(all["count"], 51);
    assert_eq!(ctl(&server, &["get", "/r/07", "--print-value-only"]), "7\n");
    ctl(&server, &["put", "/r/after", "y"]);
    assert_eq!(revision_of(&server), before + 1, "revisions continue");
}

/// kill -9 in the middle of a write load: after a restart every acknowledged write is there.
#[test]
fn kill_9_loses_no_acknowledged_write() {
    let dir = scratch("server-kill9");
    let mut server = ServerProcess::start("127.0.0.1:0", &dir);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let addr = server.addr.clone();
    // 16 writers, each putting its own key with an increasing counter; each remembers the last
    // counter the server acknowledged.
    let count = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let acknowledged: Vec<_> = (0..16)
        .map(|writer| {
            let addr = addr.clone();
            let count = count.clone();
            runtime.spawn(async move {
                let mut client = etcd_client::Client::connect([addr], None).await.unwrap();
                let mut last = None;
                for counter in 0u64.. {
                    let put = client.put(format!("/load/{writer}"), counter.to_string(), None);
                    match tokio::time::timeout(Duration::from_secs(2), put).await {
                        Ok(Ok(_)) => last = Some(counter),
                        _ => break,
                    }
                    count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                last
            })
        })
        .collect();
    // Killed in the middle of the load, once it has written enough to mean something.
    wait_for("200 acknowledged writes", Duration::from_secs(30), || {
        (count.load(std::sync::atomic::Ordering::Relaxed) >= 200).then_some(())
    });
    server.kill9();
    let acknowledged: Vec<Option<u64>> = acknowledged
        .into_iter()
        .map(|writer| runtime.block_on(writer).unwrap())
        .collect();
    server.restart();
    for (writer, last) in acknowledged.iter().enumerate() {
        let Some(last) = last else { continue };
        let value = ctl(
            &server,
            &["get", &format!("/load/{writer}"), "--print-value-only"],
        );
        let stored: u64 = value.trim().parse().unwrap();
        // The last acknowledged write, or a later one whose answer the kill cut off.
        assert!(
            stored >= *last,
            "writer {writer}: acknowledged {last}, found {stored}"
        );
    }
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    let dir = scratch("server-bad");
    let server = ServerProcess::start("127.0.0.1:0", &dir);
    let dangling = dir.join("dangling");
    std::os::unix::fs::symlink(dir.join("nowhere"), &dangling).unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--listen".into(),
                server.addr.clone(),
                "--data".into(),
                dir.join("other").display().to_string(),
            ],
            "cannot listen on",
        ),
        (
            vec![
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--data".into(),
                dir.display().to_string(),
            ],
            "in use by another baton server",
        ),
        (
            vec![
                "--listen".into(),
                "nonsense".into(),
                "--data".into(),
                "x".into(),
            ],
            "invalid value 'nonsense'",
        ),
        (
            vec![
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--data".into(),
                "/proc/baton".into(),
            ],
            "data directory /proc/baton",
        ),
        (
            vec![
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--data".into(),
                dir.join("raft.redb").display().to_string(),
            ],
            "exists and is not a directory",
        ),
        (
            vec![
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--data".into(),
                dangling.display().to_string(),
            ],
            "exists and is not a directory",
        ),
        (
            vec![
                "--data".into(),
                "x".into(),
                "--grpc-keepalive-timeout".into(),
                "0s".into(),
            ],
            "the keepalive interval and timeout must be positive",
        ),
        (
            vec![
                "--data".into(),
                "x".into(),
                "--grpc-keepalive-interval".into(),
                "soon".into(),
            ],
            "invalid value 'soon'",
        ),
        (
            vec![
                "--data".into(),
                "x".into(),
                "--quota-bytes".into(),
                "1MiB".into(),
            ],
            "the quota must be at least 4 MiB",
        ),
        (
            vec![
                "--data".into(),
                "x".into(),
                "--quota-bytes".into(),
                "2 terabytes".into(),
            ],
            "is not a size",
        ),
        (
            vec![
                "--data".into(),
                "x".into(),
                "--quota-bytes".into(),
                "99999999999GiB".into(),
            ],
            "is too large",
        ),
    ];
    for (args, expected) in cases {
        let output = baton().arg("server").args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        // A log that is fine (here: in use by the running server) is never called damaged,
        // with advice to move it away: that would start an empty server, tokens from 1.
        assert!(!stderr.contains("damaged"), "{args:?}: {stderr}");
    }
}

/// Garbage on the gRPC port and oversized requests get errors, not a crash.
#[test]
fn malformed_and_oversized_requests_are_refused() {
    let dir = scratch("server-malformed");
    let server = ServerProcess::start("127.0.0.1:0", &dir);
    // Not HTTP/2 at all.
    let mut stream = std::net::TcpStream::connect(&server.addr).unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\x00\x01\x02garbage")
        .unwrap();
    drop(stream);
    // Values above etcd's request limit (1.5 MiB): one within gRPC's framing allowance gets
    // etcd's own answer, a larger one gRPC-Go's (as from etcd: ResourceExhausted).
    for (size, answer) in [
        (
            1600 * 1024,
            "code: 'Client specified an invalid argument', message: \"etcdserver: request is too large\"",
        ),
        (
            3 * 1024 * 1024,
            "code: 'Some resource has been exhausted', message: \"grpc: received message larger than max (",
        ),
    ] {
        let refused = with_client(&server, async |client| {
            client.put("big", vec![b'x'; size], None).await.unwrap_err()
        });
        let refused = refused.to_string();
        assert!(refused.contains(answer), "{size}: {refused}");
    }
    // An empty key.
    let empty = ctl_fails(&server, &["put", "", "v"]);
    assert!(
        empty.contains("key is not provided") || empty.contains("put command needs"),
        "{empty}"
    );
    // RPCs outside the served subset (a Maintenance method, the Auth service) are refused
    // with a message that says what is served, not gRPC's bare "Unimplemented".
    for args in [&["defrag"][..], &["alarm", "list"], &["user", "list"]] {
        let refused = ctl_fails(&server, args);
        assert!(
            refused.contains("code = Unimplemented desc = baton server does not implement"),
            "{args:?}: {refused}"
        );
    }
    // Still serving.
    assert_eq!(ctl(&server, &["put", "after", "ok"]), "OK\n");
    assert!(common::alive(server.pid() as u64));
}

/// Malformed HTTP/2 frames after a valid preface end that connection with an error, never the
/// server; gRPC messages that are not the protobuf they claim to be, and keys over the request
/// limit, get an error status; afterwards every write made before is still there.
#[test]
fn malformed_frames_messages_and_oversized_keys_get_errors() {
    let dir = scratch("server-frames");
    let server = ServerProcess::start("127.0.0.1:0", &dir);
    assert_eq!(ctl(&server, &["put", "before", "kept"]), "OK\n");
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    // A frame: 24-bit length, type, flags, 31-bit stream id, payload.
    let frame = |kind: u8, flags: u8, stream: u32, payload: &[u8]| {
        let mut bytes = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        bytes.extend([kind, flags]);
        bytes.extend(stream.to_be_bytes());
        bytes.extend(payload);
        bytes
    };
    let settings = frame(4, 0, 0, &[]);
    let mut oversized_header = (1u32 << 23).to_be_bytes()[1..].to_vec();
    oversized_header.extend([0, 0, 0, 0, 0, 1]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        // A DATA frame claiming 8 MiB, over the 16 KiB frame size the server allows.
        ("a frame over the size limit", oversized_header),
        // HEADERS whose block is not valid HPACK (an index past every table).
        (
            "undecodable headers",
            frame(1, 0x4 | 0x1, 1, &[0xff, 0xff, 0xff, 0xff, 0x7f]),
        ),
        // DATA on stream 0, which only carries connection frames.
        ("data on the connection's stream", frame(0, 0, 0, b"xyz")),
        // SETTINGS with a length that is not a multiple of 6.
        ("settings of a bad length", frame(4, 0, 0, &[0, 4, 0])),
        // WINDOW_UPDATE that overflows the window.
        (
            "a window past 2^31",
            frame(8, 0, 0, &0x7fff_ffffu32.to_be_bytes()),
        ),
    ];
    for (what, bad) in cases {
        let mut stream = std::net::TcpStream::connect(&server.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        stream.write_all(PREFACE).unwrap();
        stream.write_all(&settings).unwrap();
        stream.write_all(&bad).unwrap();
        // The server answers with its own frames and ends the connection (GOAWAY, then close)
        // rather than waiting on it: read to the end.
        let mut answer = Vec::new();
        let read = std::io::Read::read_to_end(&mut stream, &mut answer);
        assert!(
            read.is_ok() || answer.len() >= 9,
            "{what}: the connection was neither answered nor closed: {read:?}"
        );
        assert!(contains_goaway(&answer), "{what}: no GOAWAY in {answer:?}");
        assert!(
            common::alive(server.pid() as u64),
            "{what}: the server died"
        );
    }
    // A gRPC call whose message is not the request's protobuf.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let statuses = runtime.block_on(async {
        let channel = tonic::transport::Channel::from_shared(format!("http://{}", server.addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut statuses = Vec::new();
        for (path, body) in [
            // Field 1 (key), length-delimited, with a length far past the message's end.
            (
                "/etcdserverpb.KV/Put",
                vec![0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f],
            ),
            // A varint that never ends.
            ("/etcdserverpb.KV/Range", vec![0x08; 11]),
            // Field 0, which protobuf forbids.
            ("/etcdserverpb.Lease/LeaseGrant", vec![0x00, 0x01]),
            // A method nobody serves.
            ("/etcdserverpb.KV/Nothing", vec![]),
        ] {
            let mut grpc = tonic::client::Grpc::new(channel.clone());
            grpc.ready().await.unwrap();
            let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
            let answer: Result<tonic::Response<Vec<u8>>, tonic::Status> =
                grpc.unary(tonic::Request::new(body), path, RawCodec).await;
            statuses.push(answer.map(|_| ()).unwrap_err());
        }
        statuses
    });
    for status in &statuses[..3] {
        assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
        assert!(status.message().contains("decode"), "{status:?}");
    }
    assert_eq!(
        statuses[3].code(),
        tonic::Code::Unimplemented,
        "{:?}",
        statuses[3]
    );
    // Keys over the request limit get etcd's answer, as values do.
    let refused = with_client(&server, async |client| {
        client
            .put(vec![b'k'; 1600 * 1024], "v", None)
            .await
            .unwrap_err()
            .to_string()
    });
    assert!(
        refused.contains("etcdserver: request is too large"),
        "{refused}"
    );
    // Still serving, nothing lost.
    assert_eq!(
        ctl(&server, &["get", "before", "--print-value-only"]),
        "kept\n"
    );
    assert_eq!(ctl(&server, &["put", "after", "ok"]), "OK\n");
    assert!(common::alive(server.pid() as u64));
}

/// Whether `bytes`, the frames a server sent, hold a GOAWAY frame (type 7).
fn contains_goaway(mut bytes: &[u8]) -> bool {
    while bytes.len() >= 9 {
        let length = u32::from_be_bytes([0, bytes[0], bytes[1], bytes[2]]) as usize;
        if bytes[3] == 7 {
            return true;
        }
        bytes = &bytes[(9 + length).min(bytes.len())..];
    }
    false
}

/// A gRPC codec that sends and receives bytes as they are: lets a test send a message that is
/// not valid protobuf.
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        buf: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(buf, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        buf: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        let length = bytes::Buf::remaining(buf);
        Ok(Some(bytes::Buf::copy_to_bytes(buf, length).to_vec()))
    }
}

/// A server whose stdout's reader is gone, or whose stdout and stderr are both closed, starts
/// and serves all the same: what it prints is for people, never a reason to stop serving.
#[test]
fn a_server_with_broken_or_closed_output_serves() {
    use std::os::unix::process::CommandExt;
    // stdout a pipe whose reader is gone: a warning on stderr, then the address there.
    let dir = scratch("server-broken-stdout");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut child = server_command("127.0.0.1:0", &dir, &[])
        .stdout(writer)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut lines = Vec::new();
    let addr = loop {
        let mut line = String::new();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "{lines:?}");
        if let Some(rest) = line.split("serving the etcd v3 API on ").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
        lines.push(line);
    };
    assert!(
        lines
            .iter()
            .any(|l| l.contains("warning: cannot print the listening address on stdout")),
        "{lines:?}"
    );
    with_addr(&addr, async |client| {
        client.put("k", "v", None).await.unwrap();
    });
    signal(child.id() as i32, libc::SIGTERM);
    assert!(child.wait().unwrap().success());
    // Both closed: found by its listening socket, it serves, and stops cleanly.
    let dir = scratch("server-closed-output");
    let mut command = server_command("127.0.0.1:0", &dir, &[]);
    // SAFETY: close is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            libc::close(1);
            libc::close(2);
            Ok(())
        });
    }
    let mut child = command.spawn().unwrap();
    let port = wait_for("the server listens", Duration::from_secs(20), || {
        listening_port(child.id())
    });
    with_addr(&format!("127.0.0.1:{port}"), async |client| {
        client.put("k", "v", None).await.unwrap();
        let got = client.get("k", None).await.unwrap();
        assert_eq!(got.kvs()[0].value(), b"v");
    });
    signal(child.id() as i32, libc::SIGTERM);
    assert!(child.wait().unwrap().success());
}

/// The TCP port process `pid` listens on, from its sockets' inodes in /proc/net/tcp.
fn listening_port(pid: u32) -> Option<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|link| {
            let link = link.to_string_lossy().to_string();
            Some(
                link.strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .collect();
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // local address, state 0A (LISTEN), inode
        let listening = fields.get(3) == Some(&"0A");
        let ours = fields
            .get(9)
            .is_some_and(|inode| inodes.iter().any(|i| i == inode));
        if !(listening && ours) {
            return None;
        }
        let port = fields[1].rsplit(':').next()?;
        u16::from_str_radix(port, 16).ok()
    })
}

/// Starts `baton server` expecting it to refuse: returns its one line of stderr (exit 2).
fn refused(data: &Path, flags: &[&str]) -> String {
    let output = baton()
        .args(["server", "--listen", "127.0.0.1:0", "--data"])
        .arg(data)
        .args(flags)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    stderr
}

/// Puts `count` keys through one connection.
fn put_many(server: &ServerProcess, count: usize) {
    with_client(server, async |client| {
        for i in 0..count {
            client
                .put(format!("/many/{}", i % 50), i.to_string(), None)
                .await
                .unwrap();
        }
    });
}

/// A snapshot with a flipped byte is refused, never served: its values and its revision (the
/// fencing tokens) would be wrong. A snapshot gone after the log was compacted into it is
/// refused too, with a line that says so.
#[test]
fn a_corrupt_or_missing_snapshot_is_refused() {
    let dir = scratch("server-snapshot");
    let mut server = ServerProcess::start_with("127.0.0.1:0", &dir, &["--snapshot-every", "20"]);
    // Past openraft's 1,000 entries kept after a snapshot, so the log is purged.
    put_many(&server, 1_200);
    let revision = revision_of(&server);
    server.stop();
    let path = dir.join("snapshot");
    let pristine = std::fs::read(&path).unwrap();
    let mut flipped = pristine.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x20;
    std::fs::write(&path, &flipped).unwrap();
    let line = refused(&dir, &[]);
    assert!(line.contains("corrupt"), "{line}");
    std::fs::remove_file(&path).unwrap();
    let line = refused(&dir, &[]);
    assert!(
        line.contains("snapshot") && line.contains("missing"),
        "{line}"
    );
    std::fs::write(&path, &pristine).unwrap();
    // The log emptied, or gone, beside the snapshot: refused, never a new member that cannot
    // lead this data.
    let log = dir.join("raft.redb");
    let log_pristine = refused_when_emptied(&dir);
    std::fs::remove_file(&log).unwrap();
    let line = refused(&dir, &[]);
    assert!(
        line.contains("raft.redb is missing beside a snapshot"),
        "{line}"
    );
    std::fs::write(&log, &log_pristine).unwrap();
    server.restart();
    assert_eq!(revision_of(&server), revision);
}

/// Empties the Raft log in `dir` and requires the server to refuse it as damaged, leaving the
/// file as it was (empty); returns the log's bytes from before, to put back.
fn refused_when_emptied(dir: &Path) -> Vec<u8> {
    let log = dir.join("raft.redb");
    let pristine = std::fs::read(&log).unwrap();
    std::fs::write(&log, b"").unwrap();
    let line = refused(dir, &[]);
    assert!(
        line.contains("is empty") && line.contains("damaged"),
        "{line}"
    );
    assert_eq!(std::fs::metadata(&log).unwrap().len(), 0);
    pristine
}

/// A Raft log emptied by accident is refused as damaged: redb would make an empty file into a
/// new database, and the server would start again from revision 1 (fencing tokens included).
#[test]
fn an_emptied_raft_log_is_refused_not_started_anew() {
    let dir = scratch("server-emptied");
    let mut server = ServerProcess::start("127.0.0.1:0", &dir);
    put_many(&server, 10);
    let revision = revision_of(&server);
    server.stop();
    // Refused, the file left as it was (still empty); the restored log serves again.
    let pristine = refused_when_emptied(&dir);
    std::fs::write(dir.join("raft.redb"), &pristine).unwrap();
    server.restart();
    assert_eq!(revision_of(&server), revision);
}

/// A first start that fails half-way through making its log (here the file size limit, as a
/// full disk) leaves no log behind, so the next start makes one and serves, rather than
/// calling a log that never held anything damaged.
#[test]
fn a_first_start_that_cannot_write_its_log_leaves_none() {
    let dir = scratch("server-first-full");
    let data = dir.join("d");
    let mut command = server_command("127.0.0.1:0", &data, &[]);
    command.stdout(Stdio::null()).stderr(Stdio::piped());
    limit_file_size(&mut command, 100 << 10);
    let output = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("File too large"), "{stderr}");
    let left: Vec<_> = std::fs::read_dir(&data)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    let server = ServerProcess::start("127.0.0.1:0", &data);
    assert_eq!(ctl(&server, &["put", "k", "v"]), "OK\n");
}

/// Watch ids on one stream count up and are not reused after a cancel, as on etcd.
#[test]
fn watch_ids_are_not_reused_on_a_stream() {
    let dir = scratch("server-watch-ids");
    let server = ServerProcess::start("127.0.0.1:0", &dir);
    with_client(&server, async |client| {
        let mut stream = client.watch("a", None).await.unwrap();
        let created = stream.message().await.unwrap().unwrap();
        assert!(created.created());
        let first = created.watch_id();
        stream.cancel(first).await.unwrap();
        let cancelled = stream.message().await.unwrap().unwrap();
        assert!(cancelled.canceled());
        // A new watch on the same stream.
        stream.watch("b", None).await.unwrap();
        let created = stream.message().await.unwrap().unwrap();
        assert!(created.created());
        assert_ne!(
            created.watch_id(),
            first,
            "a cancelled watch id was handed out again"
        );
    });
}

/// Runs `f` with an etcd client connected to `server`, on a runtime of its own.
fn with_client<T>(server: &ServerProcess, f: impl AsyncFnOnce(&mut etcd_client::Client) -> T) -> T {
    with_addr(&server.addr, f)
}

/// [`with_client`] for a server at `addr`.
fn with_addr<T>(addr: &str, f: impl AsyncFnOnce(&mut etcd_client::Client) -> T) -> T {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut client = etcd_client::Client::connect([addr], None).await.unwrap();
        f(&mut client).await
    })
}

/// `baton run`'s promise across a server restart: the server stopped (SIGTERM) and started
/// again on the same data directory within the TTL keeps the leader's lease (it restarts with
/// its full TTL), so the leader keeps running and the waiter never starts.
#[test]
fn a_server_restarted_within_the_ttl_keeps_the_leader() {
    restarted_within_the_ttl(false);
}

/// The same with the server killed (kill -9), not stopped.
#[test]
fn a_server_killed_and_restarted_within_the_ttl_keeps_the_leader() {
    restarted_within_the_ttl(true);
}

/// A leader and a waiter across a server restart within the TTL: after SIGTERM, or after
/// kill -9 if `crash`.
fn restarted_within_the_ttl(crash: bool) {
    let dir = scratch("server-restart-run");
    let mut server = ServerProcess::start("127.0.0.1:0", &dir.join("data"));
    let url = format!("etcd://{}/restart", server.addr);
    let leader = Runner::start(&url, "e", "4s", &dir, "a");
    let token = leader.wait_running(Duration::from_secs(10));
    let waiter = Runner::start(&url, "e", "4s", &dir, "b");
    std::thread::sleep(Duration::from_millis(500));
    server.halt(crash);
    server.restart();
    // Well past the TTL: renewals found the restarted server.
    std::thread::sleep(Duration::from_secs(6));
    assert!(
        common::alive(leader.child_pid().unwrap()),
        "{}",
        leader.stderr()
    );
    assert_eq!(leader.token(), Some(token));
    assert_eq!(
        waiter.token(),
        None,
        "the waiter ran while the leader held: {}",
        waiter.stderr()
    );
}

/// A server on `dir/data` whose empty state is saved in `dir/backup` before 100 writes: the
/// backup to restore under running candidates.
fn server_with_backup(dir: &Path) -> ServerProcess {
    let data = dir.join("data");
    let mut server = ServerProcess::start("127.0.0.1:0", &data);
    server.stop();
    copy_dir(&data, &dir.join("backup"));
    server.restart();
    put_many(&server, 100);
    server
}

/// An old copy of the data directory restored under running `baton run`s (the leader and a
/// waiter in its own process, both with --requeue): the leases are gone, so the leader's
/// command stops; the entries each creates again come out below its last one, so both
/// candidacies end saying the tokens went backwards (exit 1, --requeue notwithstanding), and
/// neither runs its command with a token below the one already issued.
#[test]
fn a_restored_data_directory_ends_the_leader_and_the_waiter() {
    let dir = scratch("server-restored-run");
    let data = dir.join("data");
    let mut server = server_with_backup(&dir);
    let url = format!("etcd://{}/restored", server.addr);
    let flags = ["--ttl", "2s", "--requeue"];
    let leader = Runner::start_with(&url, "e", &flags, &dir, "a");
    let token = leader.wait_running(Duration::from_secs(10));
    let command = leader.child_pid().unwrap();
    let mut waiter = Runner::start_with(&url, "e", &flags, &dir, "b");
    std::thread::sleep(Duration::from_millis(500));
    server.stop();
    std::fs::remove_dir_all(&data).unwrap();
    copy_dir(&dir.join("backup"), &data);
    server.restart();
    wait_for(
        "the leader's command to stop",
        Duration::from_secs(5),
        || (!common::alive(command)).then_some(()),
    );
    let exited = wait_for("the waiter to exit", Duration::from_secs(15), || {
        waiter.child.try_wait().unwrap()
    });
    assert_eq!(exited.code(), Some(1), "{}", waiter.stderr());
    let stderr = waiter.stderr();
    // Said once, as the error it exits with (not also as a warning before it).
    assert_eq!(stderr.matches("went backwards").count(), 1, "{stderr}");
    assert_eq!(
        waiter.token(),
        None,
        "the waiter ran after {token}: {stderr}"
    );
    // The leader, --requeue notwithstanding, ends too (exit 1), and never ran its command
    // again on a lower token.
    let mut leader = leader;
    let left = wait_for("the leader to exit", Duration::from_secs(15), || {
        leader.child.try_wait().unwrap()
    });
    let stderr = leader.stderr();
    assert_eq!(left.code(), Some(1), "{stderr}");
    assert_eq!(stderr.matches("went backwards").count(), 1, "{stderr}");
    assert_eq!(leader.token(), Some(token), "{stderr}");
}

/// Copies directory `from` (files only, as a data directory is) to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// A server stopped (SIGSTOP) for longer than the TTL: the leader's command is killed by its
/// own deadline while the server is frozen; once the server runs again the waiter leads with a
/// higher token, and never while the old command lives.
#[test]
fn a_server_stopped_beyond_the_ttl_stops_the_leader_first() {
    let dir = scratch("server-stop-run");
    let server = ServerProcess::start("127.0.0.1:0", &dir.join("data"));
    let url = format!("etcd://{}/stopped", server.addr);
    let leader = Runner::start(&url, "e", "2s", &dir, "a");
    let token = leader.wait_running(Duration::from_secs(10));
    let command = leader.child_pid().unwrap();
    let waiter = Runner::start(&url, "e", "2s", &dir, "b");
    std::thread::sleep(Duration::from_millis(500));
    signal(server.pid(), libc::SIGSTOP);
    let frozen = Instant::now();
    wait_for(
        "the leader's command to stop",
        Duration::from_secs(3),
        || (!common::alive(command)).then_some(()),
    );
    let stopped_after = frozen.elapsed();
    assert!(
        stopped_after < Duration::from_secs(2),
        "stopped after {stopped_after:?}"
    );
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        waiter.token(),
        None,
        "the waiter ran with the server frozen"
    );
    signal(server.pid(), libc::SIGCONT);
    let successor = waiter.wait_running(Duration::from_secs(15));
    assert!(
        successor > token,
        "tokens must increase: {token} then {successor}"
    );
}

/// After a server stall longer than the TTL, the candidates (with --requeue) campaigned again
/// during it, and their new leases were granted only when the server woke, late by their own
/// clocks. The first term after the stall must last: its lease is renewed at once, not left
/// to run out locally while the server holds it (terms of 0.1-0.7 s, each command SIGKILLed,
/// before).
#[test]
fn the_first_term_after_a_server_stall_lasts() {
    let dir = scratch("server-stall-term");
    let server = ServerProcess::start("127.0.0.1:0", &dir.join("data"));
    let url = format!("etcd://{}/stall", server.addr);
    let flags = ["--ttl", "2s", "--requeue"];
    let a = Runner::start_with(&url, "e", &flags, &dir, "a");
    let token = a.wait_running(Duration::from_secs(10));
    let b = Runner::start_with(&url, "e", &flags, &dir, "b");
    std::thread::sleep(Duration::from_millis(500));
    signal(server.pid(), libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(5));
    signal(server.pid(), libc::SIGCONT);
    // The first command running with a token from after the stall.
    let (runner, command) = wait_for("a leader after the stall", Duration::from_secs(15), || {
        [&a, &b].into_iter().find_map(|runner| {
            let pid = runner.child_pid()?;
            (runner.token()? > token && common::alive(pid)).then_some((runner, pid))
        })
    });
    let since = Instant::now();
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        common::alive(command),
        "the first term after the stall ended within {:?}: {}",
        since.elapsed(),
        runner.stderr()
    );
}

/// A Raft log cut short (a disk that filled up, a bad copy) is refused with one line and exit
/// code 2, not a panic inside redb; restored whole, the server starts again with its data.
#[test]
fn a_truncated_raft_log_is_refused_with_one_line() {
    let dir = scratch("server-truncated");
    let mut server = ServerProcess::start("127.0.0.1:0", &dir);
    put_many(&server, 10);
    let revision = revision_of(&server);
    server.stop();
    let path = dir.join("raft.redb");
    let pristine = std::fs::read(&path).unwrap();
    std::fs::write(&path, &pristine[..5_000]).unwrap();
    let line = refused(&dir, &[]);
    assert!(
        line.contains("raft.redb") && line.contains("damaged"),
        "{line}"
    );
    assert!(!line.contains("panicked"), "{line}");
    std::fs::write(&path, &pristine).unwrap();
    server.restart();
    assert_eq!(revision_of(&server), revision);
}

/// A write to the Raft log that fails (the disk is full; here the file size limit, which fails
/// writes the same way without needing a disk to fill) stops the server with one line and a
/// non-zero exit instead of leaving it listening while it can serve nothing; a restart on the
/// same data directory has every acknowledged write.
#[test]
fn a_failed_log_write_stops_the_server_with_one_line_and_loses_nothing() {
    let dir = scratch("server-full");
    let mut command = server_command("127.0.0.1:0", &dir, &[]);
    limit_file_size(&mut command, 3 << 20);
    let (mut child, listen) = launch(command);
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut first = String::new();
    stderr.read_line(&mut first).unwrap();
    assert!(first.contains("serving the etcd v3 API"), "{first}");
    let value = "z".repeat(200_000);
    let acknowledged = with_addr(&listen, async |client| {
        let mut acknowledged = Vec::new();
        for i in 0..40 {
            match client.put(format!("/full/{i}"), value.clone(), None).await {
                Ok(_) => acknowledged.push(format!("/full/{i}")),
                Err(_) => break,
            }
        }
        acknowledged
    });
    assert!(
        !acknowledged.is_empty() && acknowledged.len() < 40,
        "{} puts of 200 kB under a 3 MB file size limit",
        acknowledged.len()
    );
    let status = wait_for("the server to exit", Duration::from_secs(10), || {
        child.try_wait().unwrap()
    });
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    assert_eq!(status.code(), Some(1), "{rest}");
    assert_eq!(rest.trim().lines().count(), 1, "{rest}");
    assert!(
        rest.contains("the Raft node stopped")
            && rest.contains("File too large")
            && rest.contains("same data directory"),
        "{rest}"
    );
    // Restarted without the limit: every acknowledged write is there.
    let server = ServerProcess::start(&listen, &dir);
    for key in &acknowledged {
        let got = ctl(&server, &["get", key, "--print-value-only"]);
        assert_eq!(got.trim_end().len(), value.len(), "{key}");
    }
    assert_eq!(ctl(&server, &["put", "after", "ok"]), "OK\n");
}

/// Nobody reading the `{"listening":…}` line (stdout closed or full) does not stop a server
/// that is otherwise fine: it says so on stderr and serves.
#[test]
fn a_closed_or_full_stdout_does_not_stop_the_server() {
    let dir = scratch("server-stdout");
    for (round, stdout) in ["closed", "full"].into_iter().enumerate() {
        let listen = format!("127.0.0.1:{}", free_port());
        let mut command = server_command(&listen, &dir.join(format!("d{round}")), &[]);
        command.stderr(Stdio::piped());
        if stdout == "full" {
            command.stdout(std::fs::File::create("/dev/full").unwrap());
        } else {
            command.stdout(Stdio::piped());
        }
        let mut child = command.spawn().unwrap();
        drop(child.stdout.take());
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut lines = String::new();
        while !lines.contains("serving the etcd v3 API") {
            assert!(
                stderr.read_line(&mut lines).unwrap() > 0,
                "{stdout}: {lines}"
            );
        }
        assert!(
            lines.contains("cannot print the listening address"),
            "{stdout}: {lines}"
        );
        let put = with_addr(&listen, async |client| {
            client.put("k", "v", None).await.map(|_| ())
        });
        assert!(put.is_ok(), "{stdout}: {put:?}");
        signal(child.id() as i32, libc::SIGTERM);
        assert!(child.wait().unwrap().success(), "{stdout}");
    }
}

/// Files `command` writes cannot grow past `bytes`: writes beyond fail with EFBIG, as on a full
/// disk (SIGXFSZ, which would kill it instead, is ignored).
fn limit_file_size(command: &mut Command, bytes: libc::rlim_t) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        command.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A port that was free a moment ago (the server above needs a known one: its stdout is not
/// read).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `baton shards` across a server restart within the TTL: every shard keeps its owner and its
/// token (the leases restart with their full TTL), and no command is stopped or started again.
#[test]
fn baton_shards_across_a_server_restarted_within_the_ttl_keeps_every_owner() {
    let dir = scratch("server-restart-shards");
    let mut server = ServerProcess::start("127.0.0.1:0", &dir.join("data"));
    let url = format!("etcd://{}/shards", server.addr);
    let d = dir.display();
    let script = format!("echo $BATON_SHARD $BATON_TOKEN $$ >> {d}/starts; exec sleep 600");
    let members: Vec<Child> = ["a", "b"]
        .iter()
        .map(|id| {
            baton()
                .args(["shards", "--backend", &url, "--group", "g", "--id", id])
                .args(["--shards", "4", "--ttl", "4s", "--settle", "200ms"])
                .args(["--", "sh", "-c", &script])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let owners = || -> Option<std::collections::BTreeMap<u64, (String, u64)>> {
        let output = baton()
            .args([
                "shards",
                "status",
                "--backend",
                &url,
                "--group",
                "g",
                "--shards",
                "4",
            ])
            .output()
            .ok()?;
        let status: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
        common::balanced_owners(&status, 4, &["a", "b"])
    };
    let before = wait_for("4 shards over 2 members", Duration::from_secs(20), owners);
    let starts = || std::fs::read_to_string(dir.join("starts")).unwrap_or_default();
    wait_for("4 commands started", Duration::from_secs(10), || {
        (starts().lines().count() == 4).then_some(())
    });
    let started = starts();
    server.stop();
    server.restart();
    // Well past the TTL: renewals found the restarted server.
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(owners().as_ref(), Some(&before));
    assert_eq!(starts(), started, "a command was started again");
    for line in started.lines() {
        let pid: u64 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
        assert!(common::alive(pid), "a shard's command was stopped: {line}");
    }
    for mut member in members {
        signal(member.id() as i32, libc::SIGTERM);
        assert_eq!(member.wait().unwrap().code(), Some(128 + libc::SIGTERM));
    }
}

/// An old copy of the data directory restored under running `baton shards` members: the
/// leases are gone, so every shard's command stops; every entry made again comes out below
/// one already seen, so no command ever runs again on a token below one its shard already
/// issued, and each member ends saying the tokens went backwards.
#[test]
fn a_restored_data_directory_ends_baton_shards_without_a_lower_token() {
    let dir = scratch("server-restored-shards");
    let data = dir.join("data");
    let mut server = server_with_backup(&dir);
    let url = format!("etcd://{}/shards", server.addr);
    let d = dir.display();
    let script = format!("echo $BATON_SHARD $BATON_TOKEN $$ >> {d}/starts; exec sleep 600");
    let mut members: Vec<(Child, PathBuf)> = ["a", "b"]
        .iter()
        .map(|id| {
            let log = dir.join(format!("{id}.stderr"));
            let child = baton()
                .args(["shards", "--backend", &url, "--group", "g", "--id", id])
                .args(["--shards", "4", "--ttl", "2s", "--settle", "200ms"])
                .args(["--", "sh", "-c", &script])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap();
            (child, log)
        })
        .collect();
    let starts = || std::fs::read_to_string(dir.join("starts")).unwrap_or_default();
    wait_for("4 commands started", Duration::from_secs(20), || {
        (starts().lines().count() >= 4).then_some(())
    });
    let first: Vec<u64> = starts()
        .lines()
        .map(|line| line.split_whitespace().nth(2).unwrap().parse().unwrap())
        .collect();
    server.stop();
    std::fs::remove_dir_all(&data).unwrap();
    copy_dir(&dir.join("backup"), &data);
    server.restart();
    for pid in first {
        wait_for("a shard's command to stop", Duration::from_secs(5), || {
            (!common::alive(pid)).then_some(())
        });
    }
    for (member, log) in &mut members {
        let status = wait_for("a member to end", Duration::from_secs(20), || {
            member.try_wait().unwrap()
        });
        let stderr = std::fs::read_to_string(&*log).unwrap();
        assert!(!status.success(), "{stderr}");
        assert!(stderr.contains("went backwards"), "{stderr}");
    }
    // Per shard, the tokens its commands ran on only ever went up.
    let mut highest = std::collections::HashMap::new();
    for line in starts().lines() {
        let mut fields = line.split_whitespace();
        let shard = fields.next().unwrap().to_string();
        let token: u64 = fields.next().unwrap().parse().unwrap();
        let before = highest.insert(shard, token).unwrap_or(0);
        assert!(
            token > before,
            "a command ran on token {token} after {before}: {line}"
        );
    }
}

/// What a silent HTTP/2 client saw before `within` ran out: whether the server pinged it, and
/// whether (and when) the server closed the connection. The client sends the connection
/// preface and its settings, then answers nothing, as a stopped process or a vanished host.
fn silent_client(addr: &str, within: Duration) -> (bool, Option<Duration>) {
    use std::io::Read;
    let start = Instant::now();
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    // The preface, then an empty SETTINGS frame (length 0, type 4, no flags, stream 0).
    stream
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .unwrap();
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    let closed = loop {
        let left = within.saturating_sub(start.elapsed());
        if left.is_zero() {
            break None;
        }
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut buffer) {
            Ok(0) => break Some(start.elapsed()),
            Ok(n) => received.extend_from_slice(&buffer[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                break Some(start.elapsed())
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break None
            }
            Err(e) => panic!("reading from the server: {e}"),
        }
    };
    // Walk the frames: 3 bytes length, 1 type, 1 flags, 4 stream id, then the payload.
    let mut pinged = false;
    let mut at = 0;
    while at + 9 <= received.len() {
        let length = u32::from_be_bytes([0, received[at], received[at + 1], received[at + 2]]);
        let (kind, flags) = (received[at + 3], received[at + 4]);
        // PING (type 6) without ACK (flag 1): the server asking whether we are there.
        pinged |= kind == 6 && flags & 1 == 0;
        at += 9 + length as usize;
    }
    (pinged, closed)
}

/// A client that goes silent (a stopped process, a host gone without closing its connections)
/// is pinged after `--grpc-keepalive-interval` and cut off `--grpc-keepalive-timeout` later, so
/// its watches and streams do not stay for ever; the defaults (etcd's: 2 h, 20 s) leave a
/// connection that is merely quiet alone.
#[test]
fn a_silent_client_is_pinged_and_cut_off() {
    let dir = scratch("server-keepalive");
    let server = ServerProcess::start_with(
        "127.0.0.1:0",
        &dir.join("short"),
        &[
            "--grpc-keepalive-interval",
            "1s",
            "--grpc-keepalive-timeout",
            "1s",
        ],
    );
    let (pinged, closed) = silent_client(&server.addr, Duration::from_secs(10));
    assert!(pinged, "the server never pinged the silent client");
    let closed = closed.expect("the server kept a silent client's connection for 10 s");
    assert!(
        closed >= Duration::from_millis(1900),
        "closed after {closed:?}, before the interval and the timeout had passed"
    );
    // Other clients are served as before.
    assert_eq!(ctl(&server, &["put", "k", "v"]), "OK\n");

    let quiet = ServerProcess::start("127.0.0.1:0", &dir.join("default"));
    let (pinged, closed) = silent_client(&quiet.addr, Duration::from_secs(3));
    assert!(
        !pinged && closed.is_none(),
        "default keepalive: pinged {pinged}, closed {closed:?}"
    );
}

/// A waiting candidate outlives a server outage longer than its TTL. Its place is lost while
/// the server is down, and the entry it had comes back with the restarted server (which gives
/// every lease its full TTL again) under its own id: it waits that entry out and then leads,
/// rather than exit on "already campaigning" and leave the job with no candidate at all (the
/// leader, without `--requeue`, has rightly ended with its lease).
#[test]
fn a_waiter_outlives_a_server_outage_longer_than_its_ttl() {
    let dir = scratch("outage-waiter");
    let mut server = ServerProcess::start("127.0.0.1:0", &dir.join("data"));
    let url = format!("etcd://{}/outage", server.addr);
    let spawn = |name: &str| {
        let script = token_script(&dir, name);
        baton()
            .args(["run", "--backend", &url, "--election", "e", "--id", name])
            .args(["--ttl", "2s", "--", "sh", "-c", &script])
            .stderr(std::fs::File::create(dir.join(format!("{name}.stderr"))).unwrap())
            .spawn()
            .unwrap()
    };
    let token = |name: &str| read_number(&dir.join(format!("{name}.token")));
    let mut a = spawn("a");
    let first = wait_for("a leads", Duration::from_secs(10), || token("a"));
    let mut b = spawn("b");
    wait_for("b is queued", Duration::from_secs(10), || {
        let keys = ctl(&server, &["get", "/outage/e/", "--prefix", "--keys-only"]);
        (keys
            .lines()
            .filter(|line| line.contains("@candidates/"))
            .count()
            == 2)
            .then_some(())
    });
    server.kill9();
    let ended = wait_for("a's lease runs out", Duration::from_secs(10), || {
        a.try_wait().unwrap()
    });
    assert_eq!(ended.code(), Some(3), "a: {ended}");
    // Longer than the TTL in all.
    std::thread::sleep(Duration::from_secs(2));
    server.restart();
    let second = wait_leads(&mut b, &dir, "b", Duration::from_secs(20));
    assert!(second > first, "{second} after {first}");
    signal(b.id() as i32, libc::SIGTERM);
    let status = b.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "b: {status}");
    server.stop();
}

//! `baton shards` as processes: members split the shards, each shard's command writes to a
//! fenced register of its own; members are killed (-9), paused beyond the TTL, partitioned and
//! stopped. `scripts/test` runs this file against every backend (`BATON_TEST_BACKEND`).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use common::*;

const SHARDS: usize = 12;

/// Starts `baton shards` as `id` in `group` on `url` with `flags`, running `script` (sh) for each
/// owned shard; its stderr goes to `DIR/ID.stderr`.
fn start_member(url: &str, group: &str, id: &str, dir: &Path, flags: &str, script: &str) -> Child {
    let stderr = std::fs::File::create(dir.join(format!("{id}.stderr"))).unwrap();
    baton()
        .args(["shards", "--backend", url, "--group", group, "--id", id])
        .args(flags.split_whitespace())
        .args(["--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap()
}

/// A member of `group` running the fenced-register job for each shard it owns.
fn member(url: &str, group: &str, id: &str, dir: &Path) -> Child {
    member_with_ttl(url, group, id, dir, "2s")
}

fn member_with_ttl(url: &str, group: &str, id: &str, dir: &Path, ttl: &str) -> Child {
    let d = dir.display();
    // Per shard: a register (the highest token written) and a log line per write, "ok" when
    // the token is at least the register's, "stale" when the fence rejects it.
    let script = format!(
        "echo $$ >> {d}/pids.$BATON_ID; \
         while true; do flock {d}/reg$BATON_SHARD.lock sh -c \
         'h=$(cat {d}/reg$BATON_SHARD 2>/dev/null); h=${{h:-0}}; \
         if [ $BATON_TOKEN -ge $h ]; then echo $BATON_TOKEN > {d}/reg$BATON_SHARD; \
         echo ok $BATON_SHARD $BATON_TOKEN $BATON_ID >> {d}/log; \
         else echo stale $BATON_SHARD $BATON_TOKEN $BATON_ID >> {d}/log; fi'; sleep 0.05; done"
    );
    let flags = format!("--shards {SHARDS} --ttl {ttl} --grace 500ms --settle 300ms");
    start_member(url, group, id, dir, &flags, &script)
}

/// `baton shards status` as parsed JSON.
fn status(group: &str) -> serde_json::Value {
    let output = baton()
        .args(["shards", "status", "--backend", &url(), "--group", group])
        .args(["--shards", &SHARDS.to_string()])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// Owner id and token of every shard, once every shard is owned by one of `members` with
/// counts differing by at most one.
fn owners(group: &str, members: &[&str]) -> Option<BTreeMap<u64, (String, u64)>> {
    common::balanced_owners(&status(group), SHARDS, members)
}

/// The log's lines: (kind, shard, token, member).
fn log_lines(dir: &Path) -> Vec<(String, u64, u64, String)> {
    std::fs::read_to_string(dir.join("log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            Some((
                words.next()?.to_string(),
                words.next()?.parse().ok()?,
                words.next()?.parse().ok()?,
                words.next()?.to_string(),
            ))
        })
        .collect()
}

/// Every shard is being written by its owner.
fn wait_writing(dir: &Path, owners: &BTreeMap<u64, (String, u64)>) {
    wait_for("every owner writes", Duration::from_secs(10), || {
        let lines = log_lines(dir);
        owners
            .iter()
            .all(|(shard, (id, token))| {
                lines
                    .iter()
                    .any(|(kind, s, t, m)| kind == "ok" && s == shard && t == token && m == id)
            })
            .then_some(())
    });
}

fn pids_of(dir: &Path, id: &str) -> Vec<u64> {
    std::fs::read_to_string(dir.join(format!("pids.{id}")))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn stop(mut member: Child) -> Option<i32> {
    signal(member.id() as i32, libc::SIGTERM);
    member.wait().unwrap().code()
}

/// On a failed test: says where its files are (the scratch directory stays) and kills every
/// process that names that directory on its command line (members, supervisors, guards,
/// commands): none may outlive the test.
struct KillOnFailure(PathBuf);

impl Drop for KillOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("the test's files are in {}", self.0.display());
            let dir = self.0.display().to_string();
            for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
                let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                    continue;
                };
                let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
                if String::from_utf8_lossy(&cmdline).contains(&dir) {
                    signal(pid, libc::SIGKILL);
                }
            }
        }
    }
}

/// Three members split 12 shards evenly; kill -9 of one moves its shards to the other two within
/// the TTL and the settle time, with higher tokens, and leaves none of its commands running;
/// SIGTERM of another hands its shards over at once: that one has a 10 s TTL, so its shards
/// move long before its leases could have run out. No write is ever rejected by a fence: a
/// deposed owner never even attempts one beside its successor.
#[test]
fn a_killed_members_shards_move_and_nothing_of_it_acts() {
    let dir = scratch("shards-kill");
    let _kill = KillOnFailure(dir.to_path_buf());
    let group = unique("shards-kill");
    let url = url();
    let ids = ["m0", "m1", "m2"];
    let mut members: Vec<Option<Child>> = ids
        .iter()
        .map(|&id| {
            let ttl = if id == "m1" { "10s" } else { "2s" };
            Some(member_with_ttl(&url, &group, id, &dir, ttl))
        })
        .collect();
    let first = wait_for("12 shards over 3 members", Duration::from_secs(20), || {
        owners(&group, &ids)
    });
    wait_writing(&dir, &first);

    // kill -9 of m0: its supervisors die with it, and their guards kill the commands.
    let mut m0 = members[0].take().unwrap();
    signal(m0.id() as i32, libc::SIGKILL);
    let _ = m0.wait();
    let killed_at = std::time::Instant::now();
    let m0_pids = pids_of(&dir, "m0");
    assert!(!m0_pids.is_empty());
    wait_for("m0's commands are gone", Duration::from_secs(2), || {
        m0_pids.iter().all(|&pid| !alive(pid)).then_some(())
    });
    let second = wait_for("12 shards over 2 members", Duration::from_secs(15), || {
        owners(&group, &ids[1..])
    });
    let took = killed_at.elapsed();
    assert!(
        took < Duration::from_secs(8),
        "shards owned again after {took:?}"
    );
    for (shard, (id, token)) in &second {
        let (old_id, old_token) = &first[shard];
        if old_id == "m0" {
            assert!(
                token > old_token,
                "shard {shard}: token {token} after {old_token}"
            );
        } else {
            assert_eq!(
                (id, token),
                (old_id, old_token),
                "shard {shard} moved needlessly"
            );
        }
    }
    wait_writing(&dir, &second);

    // SIGTERM of m1: its shards go to m2 at once (no TTL to wait out).
    let m1 = members[1].take().unwrap();
    let stopped_at = std::time::Instant::now();
    assert_eq!(stop(m1), Some(128 + libc::SIGTERM));
    let stop_took = stopped_at.elapsed();
    let m1_pids = pids_of(&dir, "m1");
    assert!(
        m1_pids.iter().all(|&pid| !alive(pid)),
        "m1's commands outlived it"
    );
    let third = wait_for("12 shards on m2", Duration::from_secs(10), || {
        owners(&group, &ids[2..])
    });
    // m1 renewed at most 10 s / 3 before the SIGTERM: a lease that ran out would have taken
    // 6.7 s at the least.
    let handed = stopped_at.elapsed();
    assert!(
        handed < Duration::from_secs(5),
        "handover took {handed:?} (stop {stop_took:?})"
    );
    wait_writing(&dir, &third);
    let stderr = std::fs::read_to_string(dir.join("m1.stderr")).unwrap();
    assert!(stderr.contains("left; every shard released"), "{stderr}");

    assert_eq!(stop(members[2].take().unwrap()), Some(128 + libc::SIGTERM));
    assert!(pids_of(&dir, "m2").iter().all(|&pid| !alive(pid)));
    let stale: Vec<_> = log_lines(&dir)
        .into_iter()
        .filter(|(kind, ..)| kind == "stale")
        .collect();
    assert!(stale.is_empty(), "writes rejected by a fence: {stale:?}");
    // Every shard unowned now.
    let status = status(&group);
    assert!(
        status["shards"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["owner"].is_null()),
        "{status}"
    );
}

/// A member whose whole process tree is stopped for three TTLs: the others own its shards with
/// higher tokens meanwhile; when it resumes, its commands are killed before they get far, and
/// what they still try is rejected by the fence.
#[test]
fn a_paused_members_shards_move_and_its_late_writes_are_fenced() {
    let dir = scratch("shards-pause");
    let _kill = KillOnFailure(dir.to_path_buf());
    let group = unique("shards-pause");
    let url = url();
    let ids = ["p0", "p1"];
    let mut p0 = member(&url, &group, "p0", &dir);
    let p1 = member(&url, &group, "p1", &dir);
    let first = wait_for("12 shards over 2 members", Duration::from_secs(20), || {
        owners(&group, &ids)
    });
    wait_writing(&dir, &first);
    let tree: Vec<i32> = std::iter::once(p0.id() as i32)
        .chain(descendants(p0.id() as i32))
        .collect();
    for &pid in &tree {
        signal(pid, libc::SIGSTOP);
    }
    let second = wait_for("12 shards on p1", Duration::from_secs(15), || {
        owners(&group, &ids[1..])
    });
    // (p1's commands may not write yet: a frozen command of p0 can hold a register's lock.)
    std::thread::sleep(Duration::from_secs(4));
    let resumed_from = log_lines(&dir).len();
    for &pid in &tree {
        signal(pid, libc::SIGCONT);
    }
    let p0_pids = pids_of(&dir, "p0");
    wait_for(
        "p0's commands are killed on resume",
        Duration::from_secs(3),
        || p0_pids.iter().all(|&pid| !alive(pid)).then_some(()),
    );
    wait_writing(&dir, &second);
    let lines = log_lines(&dir);
    // Before the pause nothing was rejected; after it, p0 wrote nothing the fence accepted.
    assert!(
        lines[..resumed_from].iter().all(|(kind, ..)| kind == "ok"),
        "{:?}",
        &lines[..resumed_from]
    );
    // After the pause p0's commands are killed: at most a write that was under way when they
    // were frozen (holding the register's lock, having checked the register) completes, once
    // per shard; beyond that p0 writes nothing the fence accepts.
    let mut late: HashMap<u64, usize> = HashMap::new();
    for (kind, shard, token, id) in &lines[resumed_from..] {
        if id == "p0" && kind == "ok" {
            let count = late.entry(*shard).or_default();
            *count += 1;
            assert!(
                *count <= 1,
                "p0 wrote shard {shard} with token {token} after its pause"
            );
        }
    }
    // p0 is a member again (its lease is gone: it joins anew) and the shards spread out again.
    assert!(
        p0.try_wait().unwrap().is_none(),
        "p0 exited after the pause"
    );
    let third = wait_for(
        "12 shards over 2 members again",
        Duration::from_secs(20),
        || owners(&group, &ids),
    );
    wait_writing(&dir, &third);
    stop(p0);
    stop(p1);
}

/// A member whose `baton shards` process alone is stopped (its shard supervisors, guards and
/// commands run on, and hear no later deadline): every command of it stops by the last local
/// deadline it was sent, before the other member owns its shards; no write is rejected by a
/// fence; resumed, it rejoins and the shards spread out again.
#[test]
fn a_stopped_member_process_alone_has_its_commands_stopped_before_its_shards_move() {
    let dir = scratch("shards-stop-member");
    let _kill = KillOnFailure(dir.to_path_buf());
    let group = unique("shards-stop-member");
    let url = url();
    let ids = ["s0", "s1"];
    let mut s0 = member(&url, &group, "s0", &dir);
    let s1 = member(&url, &group, "s1", &dir);
    let first = wait_for("12 shards over 2 members", Duration::from_secs(20), || {
        owners(&group, &ids)
    });
    wait_writing(&dir, &first);
    signal(s0.id() as i32, libc::SIGSTOP);
    let s0_pids = pids_of(&dir, "s0");
    // By the local deadline (TTL 2 s), before the TTL has passed at the server.
    wait_for("s0's commands stop", Duration::from_secs(3), || {
        s0_pids.iter().all(|&pid| !alive(pid)).then_some(())
    });
    let second = wait_for("12 shards on s1", Duration::from_secs(15), || {
        owners(&group, &ids[1..])
    });
    wait_writing(&dir, &second);
    signal(s0.id() as i32, libc::SIGCONT);
    let third = wait_for(
        "12 shards over 2 members again",
        Duration::from_secs(20),
        || owners(&group, &ids),
    );
    wait_writing(&dir, &third);
    let stale: Vec<_> = log_lines(&dir)
        .into_iter()
        .filter(|(kind, ..)| kind == "stale")
        .collect();
    assert!(stale.is_empty(), "writes rejected by a fence: {stale:?}");
    assert!(s0.try_wait().unwrap().is_none(), "s0 exited after its stop");
    stop(s0);
    stop(s1);
}

/// A member cut off from the backend by a partition stops its commands by its own deadline;
/// the other member owns every shard meanwhile, with no write rejected by a fence.
#[test]
fn a_partitioned_members_commands_stop_before_its_shards_move() {
    let dir = scratch("shards-partition");
    let _kill = KillOnFailure(dir.to_path_buf());
    let group = unique("shards-partition");
    let proxy = proxy::Proxy::start(server());
    let ids = ["q0", "q1"];
    let q0 = member(
        &url_at(&format!("127.0.0.1:{}", proxy.port)),
        &group,
        "q0",
        &dir,
    );
    let q1 = member(&url(), &group, "q1", &dir);
    let first = wait_for("12 shards over 2 members", Duration::from_secs(20), || {
        owners(&group, &ids)
    });
    wait_writing(&dir, &first);
    proxy.set_partitioned(true);
    let q0_pids = pids_of(&dir, "q0");
    // Its commands stop by the local deadline, before the TTL has passed at the server.
    wait_for("q0's commands stop", Duration::from_secs(3), || {
        q0_pids.iter().all(|&pid| !alive(pid)).then_some(())
    });
    let second = wait_for("12 shards on q1", Duration::from_secs(15), || {
        owners(&group, &ids[1..])
    });
    wait_writing(&dir, &second);
    proxy.set_partitioned(false);
    let stale: Vec<_> = log_lines(&dir)
        .into_iter()
        .filter(|(kind, ..)| kind == "stale")
        .collect();
    assert!(stale.is_empty(), "writes rejected by a fence: {stale:?}");
    stop(q0);
    stop(q1);
}

/// Bad input: one line, exit 2.
#[test]
fn bad_input_gets_one_line_and_exit_code_2() {
    let url = url();
    let cases = [
        format!("shards --backend {url} --group g --shards 0 -- true"),
        format!("shards --backend {url} --group g --shards 4"),
        format!("shards --backend {url} --group a/b --shards 4 -- true"),
        format!("shards --backend {url} --group a:b --shards 4 -- true"),
        format!("shards --backend {url} --group g --shards 4 --ttl x -- true"),
        "shards --backend nope://x --group g --shards 4 -- true".to_string(),
        "shards --backend etcd://127.0.0.1:1/x --group g --shards 4 -- true".to_string(),
        format!("shards status --backend {url}"),
        format!("shards status --backend {url} --group nobody-here"),
        format!("shards status --backend {url} --group g --shards 0"),
    ];
    for case in cases {
        let args: Vec<&str> = case.split_whitespace().collect();
        let output = baton().args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        let lines = stderr.trim_end().lines().filter(|l| !l.is_empty()).count();
        assert!(
            lines == 1 || stderr.contains("Usage:"),
            "{args:?}: {stderr}"
        );
    }
}

/// The status contract: every shard, in order, with `owner: null` where nobody owns it.
#[test]
fn status_lists_every_shard_with_its_owner_or_null() {
    let group = unique("shards-status");
    let output = baton()
        .args([
            "shards",
            "status",
            "--backend",
            &url(),
            "--group",
            &group,
            "--shards",
            "3",
        ])
        .output()
        .unwrap();
    assert!(output.status.success());
    let text = String::from_utf8(output.stdout).unwrap();
    assert_eq!(
        text.trim(),
        format!(
            r#"{{"group":"{group}","shards":[{{"shard":0,"owner":null}},{{"shard":1,"owner":null}},{{"shard":2,"owner":null}}]}}"#
        )
    );
}

/// 3 members × 64 shards as processes (the library's conformance checks take 3 × 256 on every
/// backend; here every shard is four processes of a debug build, on two cores). Each shard's
/// command is a light one that checks, when it starts, that the shard's previous command is
/// gone (no two acting owners) and that its token is above the last one. kill -9 of one
/// member: every shard is owned again within TTL + settle (and some slack for the process
/// starts), the moved shards with higher tokens.
#[test]
fn three_members_own_64_shards_and_a_kill_9_moves_a_third() {
    let dir = scratch("shards-64");
    let _kill = KillOnFailure(dir.to_path_buf());
    let group = unique("shards-64");
    let url = url();
    let d = dir.display();
    // On start, under the shard's lock: the pid recorded by the shard's last command must be
    // gone (or a zombie); record ours and our token, then wait.
    let script = format!(
        "flock {d}/s$BATON_SHARD.lock sh -c 'p=$(cat {d}/s$BATON_SHARD.pid 2>/dev/null); \
         if [ -n \"$p\" ] && [ -r /proc/$p/stat ] && ! grep -q \") Z\" /proc/$p/stat; then \
         echo overlap $BATON_SHARD $p >> {d}/violations; fi; \
         t=$(cat {d}/s$BATON_SHARD.token 2>/dev/null); t=${{t:-0}}; \
         if [ $BATON_TOKEN -le $t ]; then echo token $BATON_SHARD $BATON_TOKEN $t >> {d}/violations; fi; \
         echo $1 > {d}/s$BATON_SHARD.pid; echo $BATON_TOKEN > {d}/s$BATON_SHARD.token' x $$; \
         exec sleep 1000"
    );
    let flags = "--shards 64 --ttl 3s --grace 500ms --settle 300ms";
    let spawn = |id: &str| start_member(&url, &group, id, &dir, flags, &script);
    let ids = ["b0", "b1", "b2"];
    let mut members: Vec<Child> = ids.iter().map(|id| spawn(id)).collect();
    let owned = |members: &[&str]| -> Option<BTreeMap<u64, (String, u64)>> {
        let output = baton()
            .args([
                "shards",
                "status",
                "--backend",
                &url,
                "--group",
                &group,
                "--shards",
                "64",
            ])
            .output()
            .unwrap();
        let status: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
        common::balanced_owners(&status, 64, members)
    };
    let first = wait_for("64 shards over 3 members", Duration::from_secs(60), || {
        owned(&ids)
    });
    let mut b0 = members.remove(0);
    signal(b0.id() as i32, libc::SIGKILL);
    let _ = b0.wait();
    let killed = std::time::Instant::now();
    let second = wait_for("64 shards over 2 members", Duration::from_secs(30), || {
        owned(&ids[1..])
    });
    let took = killed.elapsed();
    // TTL 3 s + settle 0.3 s, plus the membership read and ~21 process starts.
    assert!(took < Duration::from_secs(8), "owned again after {took:?}");
    let moved = first
        .iter()
        .filter(|(s, (id, _))| second[s].0 != *id)
        .count();
    let b0_owned = first.values().filter(|(id, _)| id == "b0").count();
    assert!(
        moved >= b0_owned && moved <= b0_owned + 8,
        "moved {moved}, b0 owned {b0_owned}"
    );
    for (shard, (id, token)) in &second {
        if first[shard].0 != *id {
            assert!(*token > first[shard].1, "shard {shard}");
        }
    }
    // Every command has started (its token recorded) before we look for violations.
    wait_for(
        "every shard's command started",
        Duration::from_secs(20),
        || {
            second
                .iter()
                .all(|(s, (_, token))| {
                    read_number(&dir.join(format!("s{s}.token"))) == Some(*token)
                })
                .then_some(())
        },
    );
    for member in members {
        assert_eq!(stop(member), Some(128 + libc::SIGTERM));
    }
    let violations = std::fs::read_to_string(dir.join("violations")).unwrap_or_default();
    assert!(violations.is_empty(), "{violations}");
}

/// kill -9 of a shard's supervisor and its guard together, while its command has forked a
/// daemon into a session of its own: `baton shards` empties the shard's cgroup (the daemon
/// dies) before it resigns the shard, and the shard runs again with a higher token.
#[test]
fn a_killed_supervisor_and_guard_leave_nothing_of_the_command() {
    let dir = scratch("shards-sup");
    let _kill = KillOnFailure(dir.to_path_buf());
    let group = unique("shards-sup");
    let d = dir.display();
    let script = format!(
        "setsid -f sh -c 'echo $$ >> {d}/daemons; exec sleep 600'; \
         echo $BATON_TOKEN >> {d}/tokens; exec sleep 600"
    );
    let mut member = start_member(
        &url(),
        &group,
        "m",
        &dir,
        "--shards 1 --ttl 3s --settle 100ms",
        &script,
    );
    let daemon = wait_for("the daemon", Duration::from_secs(20), || {
        read_number(&dir.join("daemons"))
    });
    // The command has recorded its token too (it does so after forking the daemon).
    wait_for("the first token", Duration::from_secs(5), || {
        read_number(&dir.join("tokens"))
    });
    let supervisor = wait_for("the supervisor", Duration::from_secs(5), || {
        children(member.id()).into_iter().find(|&pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.contains("__shard"))
        })
    });
    let guard = wait_for("the guard", Duration::from_secs(5), || {
        children(supervisor).into_iter().next()
    });
    signal(supervisor as i32, libc::SIGKILL);
    signal(guard as i32, libc::SIGKILL);
    wait_for("the daemon is killed", Duration::from_secs(3), || {
        (!alive(daemon)).then_some(())
    });
    // Then the shard runs again, with a higher token.
    let tokens = wait_for("a second term", Duration::from_secs(15), || {
        let text = std::fs::read_to_string(dir.join("tokens")).ok()?;
        let tokens: Vec<u64> = text.lines().filter_map(|l| l.parse().ok()).collect();
        (tokens.len() >= 2).then_some(tokens)
    });
    assert!(tokens[1] > tokens[0], "{tokens:?}");
    signal(member.id() as i32, libc::SIGTERM);
    assert_eq!(member.wait().unwrap().code(), Some(128 + libc::SIGTERM));
    let stderr = std::fs::read_to_string(dir.join("m.stderr")).unwrap();
    assert!(stderr.contains("its supervisor died"), "{stderr}");
    let daemons = std::fs::read_to_string(dir.join("daemons")).unwrap();
    for pid in daemons.lines().filter_map(|l| l.parse::<u64>().ok()) {
        assert!(!alive(pid), "daemon {pid} outlived baton shards");
    }
}

/// With `--pid-namespace on`, kill -9 of every baton process of a member at once (the member,
/// each shard's supervisor and guard) leaves nothing of its commands, not even daemons they
/// forked away: each shard's namespace dies with its guard.
#[test]
fn a_pid_namespace_leaves_nothing_when_every_baton_process_is_killed_at_once() {
    let dir = scratch("shards-pidns");
    let _kill = KillOnFailure(dir.to_path_buf());
    let group = unique("shards-pidns");
    let d = dir.display();
    let script = format!(
        "setsid -f sh -c 'echo $$ >> {d}/daemons.$BATON_SHARD; exec sleep 600'; exec sleep 600"
    );
    let mut member = start_member(
        &url(),
        &group,
        "m",
        &dir,
        "--shards 2 --ttl 3s --settle 100ms --pid-namespace on",
        &script,
    );
    wait_for("both shards' daemons", Duration::from_secs(20), || {
        (dir.join("daemons.0").exists() && dir.join("daemons.1").exists()).then_some(())
    });
    let tree = descendants(member.id() as i32);
    let baton_processes: Vec<i32> = tree
        .iter()
        .copied()
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.contains("__shard") || c.contains("__guard"))
        })
        .collect();
    // Two supervisors and two guards.
    assert_eq!(baton_processes.len(), 4, "{tree:?}");
    signal(member.id() as i32, libc::SIGKILL);
    for &pid in &baton_processes {
        signal(pid, libc::SIGKILL);
    }
    let _ = member.wait();
    wait_for(
        "every process of the member gone",
        Duration::from_millis(1500),
        || tree.iter().all(|&pid| !alive(pid as u64)).then_some(()),
    );
}

/// Ctrl-C in a terminal signals the whole process group (systemd signals every process of the
/// unit): the shards' supervisors ignore it, and `baton shards` stops each command with its
/// grace, so a command that cleans up on SIGINT or SIGTERM gets to finish.
#[test]
fn ctrl_c_to_the_process_group_gives_commands_their_grace() {
    let dir = scratch("shards-ctrlc");
    let _kill = KillOnFailure(dir.to_path_buf());
    let group = unique("shards-ctrlc");
    let d = dir.display();
    let script = format!(
        "trap 'sleep 1; echo clean $BATON_SHARD >> {d}/clean; exit 0' INT TERM; \
         echo $BATON_SHARD >> {d}/started; while true; do sleep 0.1; done"
    );
    let mut member = start_member(
        &url(),
        &group,
        "m",
        &dir,
        "--shards 2 --ttl 3s --grace 5s --settle 100ms",
        &script,
    );
    wait_for("both commands run", Duration::from_secs(20), || {
        let started = std::fs::read_to_string(dir.join("started")).ok()?;
        (started.lines().count() == 2).then_some(())
    });
    // baton() puts the member in a process group of its own: signal all of it.
    signal(-(member.id() as i32), libc::SIGINT);
    assert_eq!(member.wait().unwrap().code(), Some(128 + libc::SIGINT));
    let clean = std::fs::read_to_string(dir.join("clean")).unwrap_or_default();
    assert_eq!(clean.lines().count(), 2, "{clean}");
}

/// A member restarted at once with its fixed id after a crash waits for the crashed run's
/// entry to expire and joins (it owns the shard again, on a higher token); a second live member
/// with the same id is refused with exit 2 once that wait is over.
#[test]
fn a_fixed_id_restarted_after_a_crash_rejoins_and_a_live_duplicate_is_refused() {
    let dir = scratch("shards-fixed-id");
    let group = unique("fixed-id");
    let script = format!(
        "echo $BATON_TOKEN > {}/token.$BATON_SHARD; exec sleep 600",
        dir.display()
    );
    let flags = "--shards 1 --ttl 2s --grace 500ms --settle 300ms";
    let token = || read_number(&dir.join("token.0"));
    let mut first = start_member(&url(), &group, "fixed", &dir, flags, &script);
    let crashed = wait_for("the first run owns shard 0", Duration::from_secs(15), token);
    signal(first.id() as i32, libc::SIGKILL);
    let _ = first.wait();
    std::fs::remove_file(dir.join("token.0")).unwrap();
    let mut second = start_member(&url(), &group, "fixed", &dir, flags, &script);
    let took_over = wait_for(
        "the restarted run owns shard 0",
        Duration::from_secs(30),
        || {
            if let Some(status) = second.try_wait().unwrap() {
                let stderr = std::fs::read_to_string(dir.join("fixed.stderr")).unwrap_or_default();
                panic!("the restarted member ended with {status}: {stderr}");
            }
            token()
        },
    );
    assert!(took_over > crashed, "{took_over} after {crashed}");
    let duplicate = baton()
        .args([
            "shards",
            "--backend",
            &url(),
            "--group",
            &group,
            "--id",
            "fixed",
        ])
        .args(flags.split_whitespace())
        .args(["--", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&duplicate.stderr);
    assert_eq!(duplicate.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("already has id \"fixed\" (still in use after 14s)"),
        "{stderr}"
    );
    signal(second.id() as i32, libc::SIGTERM);
    let _ = second.wait();
}

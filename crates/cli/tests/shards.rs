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

/// A member of `group` running the fenced-register job for each shard it owns.
fn member(url: &str, group: &str, id: &str, dir: &Path) -> Child {
    let d = dir.display();
    // Per shard: a register (the highest token written) and a log line per write, "ok" when
    // the token is at least the register's, "stale" when the fence rejects it.
    let script = format!(
        "echo $$ >> {d}/pids.$BATON_ID; \
         while true; do flock {d}/reg$BATON_SHARD.lock sh -c \
         'h=$(cat {d}/reg$BATON_SHARD 2>/dev/null || echo 0); \
         if [ $BATON_TOKEN -ge $h ]; then echo $BATON_TOKEN > {d}/reg$BATON_SHARD; \
         echo ok $BATON_SHARD $BATON_TOKEN $BATON_ID >> {d}/log; \
         else echo stale $BATON_SHARD $BATON_TOKEN $BATON_ID >> {d}/log; fi'; sleep 0.05; done"
    );
    let stderr = std::fs::File::create(dir.join(format!("{id}.stderr"))).unwrap();
    baton()
        .args(["shards", "--backend", url, "--group", group, "--id", id])
        .args([
            "--shards",
            &SHARDS.to_string(),
            "--ttl",
            "2s",
            "--grace",
            "500ms",
        ])
        .args(["--settle", "300ms", "--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap()
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
    let status = status(group);
    let mut owners = BTreeMap::new();
    for shard in status["shards"].as_array()? {
        let owner = shard["owner"].as_object()?;
        let id = owner["id"].as_str()?.to_string();
        if !members.contains(&id.as_str()) {
            return None;
        }
        owners.insert(shard["shard"].as_u64()?, (id, owner["token"].as_u64()?));
    }
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for (id, _) in owners.values() {
        *counts.entry(id.as_str()).or_default() += 1;
    }
    let (min, max) = (counts.values().min()?, counts.values().max()?);
    (owners.len() == SHARDS && counts.len() == members.len() && max - min <= 1).then_some(owners)
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

struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Three members split 12 shards evenly; kill -9 of one moves its shards to the other two within
/// the TTL and the settle time, with higher tokens, and leaves none of its commands running;
/// SIGTERM of another hands its shards over at once. No write is ever rejected by a fence:
/// a deposed owner never even attempts one beside its successor.
#[test]
fn a_killed_members_shards_move_and_nothing_of_it_acts() {
    let dir = scratch("shards-kill");
    let _clean = Scratch(dir.clone());
    let group = unique("shards-kill");
    let url = url();
    let ids = ["m0", "m1", "m2"];
    let mut members: Vec<Option<Child>> = ids
        .iter()
        .map(|id| Some(member(&url, &group, id, &dir)))
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
    let third = wait_for("12 shards on m2", Duration::from_secs(5), || {
        owners(&group, &ids[2..])
    });
    let handed = stopped_at.elapsed();
    assert!(
        handed < Duration::from_secs(2),
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
    let _clean = Scratch(dir.clone());
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
    wait_writing(&dir, &second);
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
    let lines = log_lines(&dir);
    // Before the pause nothing was rejected; after it, p0 wrote nothing the fence accepted.
    assert!(
        lines[..resumed_from].iter().all(|(kind, ..)| kind == "ok"),
        "{:?}",
        &lines[..resumed_from]
    );
    for (kind, shard, token, id) in &lines[resumed_from..] {
        if id == "p0" {
            assert_eq!(
                kind, "stale",
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

/// A member cut off from the backend by a partition stops its commands by its own deadline;
/// the other member owns every shard meanwhile, with no write rejected by a fence.
#[test]
fn a_partitioned_members_commands_stop_before_its_shards_move() {
    let dir = scratch("shards-partition");
    let _clean = Scratch(dir.clone());
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

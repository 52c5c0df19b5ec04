//! Helpers shared by the process-level tests.
// Each test binary uses a different subset.
#![allow(dead_code)]

pub mod proxy;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Which backend the process tests run against: etcd by default, or the one named by
/// `BATON_TEST_BACKEND` (`etcd`, `zookeeper`, `postgres`, `server` for baton's own server);
/// `scripts/test` runs the fault tests on each, so every backend meets the same fault tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestBackend {
    Etcd,
    ZooKeeper,
    Postgres,
    /// `baton server`, through the etcd backend.
    Server,
}

pub fn backend() -> TestBackend {
    match std::env::var("BATON_TEST_BACKEND").as_deref() {
        Err(_) | Ok("etcd") => TestBackend::Etcd,
        Ok("zookeeper") => TestBackend::ZooKeeper,
        Ok("postgres") => TestBackend::Postgres,
        Ok("server") => TestBackend::Server,
        Ok(other) => {
            panic!("BATON_TEST_BACKEND={other:?}: expected etcd, zookeeper, postgres or server")
        }
    }
}

/// Whether the backend under test speaks the etcd API (etcd itself or `baton server`).
pub fn speaks_etcd() -> bool {
    matches!(backend(), TestBackend::Etcd | TestBackend::Server)
}

/// The `baton server` under test (`scripts/test` starts one).
pub fn baton_server() -> String {
    std::env::var("BATON_TEST_SERVER").expect(
        "BATON_TEST_SERVER is not set: run the tests with scripts/test, which starts a baton \
         server",
    )
}

/// `host:port` of the etcd API under test: etcd, or `baton server`.
pub fn etcd_api() -> String {
    match backend() {
        TestBackend::Server => baton_server(),
        _ => etcd(),
    }
}

pub fn etcd() -> String {
    std::env::var("BATON_TEST_ETCD").expect(
        "BATON_TEST_ETCD is not set: run the tests with scripts/test, which starts a private etcd",
    )
}

pub fn zookeeper() -> String {
    std::env::var("BATON_TEST_ZK").expect(
        "BATON_TEST_ZK is not set: run the tests with scripts/test, which starts a private \
         ZooKeeper",
    )
}

/// The PostgreSQL under test: `host:port` (user, password and database `baton`).
pub fn postgres() -> String {
    std::env::var("BATON_TEST_PG_ADDR").expect(
        "BATON_TEST_PG_ADDR is not set: run the tests with scripts/test, which starts a private \
         PostgreSQL",
    )
}

/// `host:port` of the server under test.
pub fn server() -> String {
    match backend() {
        TestBackend::Etcd => etcd(),
        TestBackend::ZooKeeper => zookeeper(),
        TestBackend::Postgres => postgres(),
        TestBackend::Server => baton_server(),
    }
}

/// The backend URL of the tests, reaching the server at `endpoint` (a proxy, say).
pub fn url_at(endpoint: &str) -> String {
    match backend() {
        TestBackend::Etcd | TestBackend::Server => format!("etcd://{endpoint}{ROOT}"),
        TestBackend::ZooKeeper => format!("zk://{endpoint}{ROOT}"),
        TestBackend::Postgres => {
            format!("postgres://baton:baton@{endpoint}/baton?schema={PG_SCHEMA}")
        }
    }
}

/// The schema of the process tests on PostgreSQL.
const PG_SCHEMA: &str = "baton_cli_test";

pub fn url() -> String {
    url_at(&server())
}

/// The etcd prefix or ZooKeeper chroot of the tests.
const ROOT: &str = "/baton-cli-test";

pub fn baton() -> Command {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(env!("CARGO_BIN_EXE_baton"));
    // Its own process group, as a shell job gets: the guard and the command share it, and the
    // tests signal whole groups.
    command.process_group(0);
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

/// A fresh directory under the system's temporary directory, removed when the test that made
/// it passes; a failing test leaves it behind, to be looked at.
pub fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(unique(&format!("baton-{name}")));
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// See [`scratch`].
#[derive(Debug)]
pub struct Scratch(PathBuf);

impl Scratch {
    /// The directory, no longer removed on drop: the caller cleans up.
    pub fn keep(self) -> PathBuf {
        let mut this = std::mem::ManuallyDrop::new(self);
        std::mem::take(&mut this.0)
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
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

/// A command that writes its token to `DIR/NAME.token` (read back with
/// `read_number`) and then runs until stopped.
pub fn token_script(dir: &Path, name: &str) -> String {
    format!(
        "echo $BATON_TOKEN > {}/{name}.token; exec sleep 600",
        dir.display()
    )
}

/// Waits until the `baton run` whose command is `token_script(dir, name)` (stderr in
/// `DIR/NAME.stderr`) leads, and returns its token; fails at once, with that stderr, if the run
/// ends first.
pub fn wait_leads(child: &mut Child, dir: &Path, name: &str, limit: Duration) -> u64 {
    wait_for(&format!("{name} leads"), limit, || {
        if let Some(status) = child.try_wait().unwrap() {
            let stderr = std::fs::read_to_string(dir.join(format!("{name}.stderr")));
            panic!("{name} ended with {status}: {}", stderr.unwrap_or_default());
        }
        read_number(&dir.join(format!("{name}.token")))
    })
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

/// Deletes every entry of `election` behind baton's back, as an operator would.
pub fn delete_election_keys(election: &str) {
    match backend() {
        TestBackend::Etcd | TestBackend::Server => {
            let status = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args(["--endpoints", &etcd_api(), "del", "--prefix"])
                .arg(format!("{ROOT}/{election}/"))
                .stdout(Stdio::null())
                .status()
                .expect("etcdctl (from etcd-client) must be installed; scripts/test installs it");
            assert!(status.success());
        }
        TestBackend::ZooKeeper => zk_delete(election, usize::MAX),
        TestBackend::Postgres => pg_delete(election, false),
    }
}

/// Deletes only the leader's entry of `election` (the first in the queue), as an operator
/// would: the leader loses, the waiters stay queued.
pub fn delete_leader_key(election: &str) {
    match backend() {
        TestBackend::Etcd | TestBackend::Server => {
            let output = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args(["--endpoints", &etcd_api(), "get", "--prefix", "--keys-only"])
                .args(["--sort-by=CREATE", "--order=ASCEND", "--limit=1"])
                .arg(format!("{ROOT}/{election}/"))
                .output()
                .expect("etcdctl (from etcd-client) must be installed; scripts/test installs it");
            let key = String::from_utf8(output.stdout).unwrap();
            let key = key.lines().next().expect("the election has a leader key");
            let status = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args(["--endpoints", &etcd_api(), "del", key])
                .stdout(Stdio::null())
                .status()
                .unwrap();
            assert!(status.success());
        }
        TestBackend::ZooKeeper => zk_delete(election, 1),
        TestBackend::Postgres => pg_delete(election, true),
    }
}

/// Waits until `election` has `count` candidates queued (the leader among them), as baton's
/// library lists them.
pub fn wait_queued(election: &str, count: usize) {
    wait_queued_at(&url(), election, count)
}

/// [`wait_queued`] on the backend at `url`.
pub fn wait_queued_at(url: &str, election: &str, count: usize) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let backend = baton::Backend::connect(url).await.unwrap();
        let config = baton::ElectionConfig::default().with_ttl(Duration::from_secs(2));
        let election = baton::Election::new(&backend, election, config).unwrap();
        let start = Instant::now();
        loop {
            let queued = election.participants().await.unwrap().len();
            if queued == count {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{count} candidates queued: not within 10s ({queued} are)"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        backend.close().await;
    });
}

/// Deletes the leader's entry of `election` (or every entry), through a raw connection.
fn pg_delete(election: &str, leader_only: bool) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let url = format!("postgres://baton:baton@{}/baton", postgres());
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        let sql = if leader_only {
            format!(
                "DELETE FROM {PG_SCHEMA}.entries WHERE election = $1 AND position = \
                 (SELECT min(position) FROM {PG_SCHEMA}.entries WHERE election = $1)"
            )
        } else {
            format!("DELETE FROM {PG_SCHEMA}.entries WHERE election = $1")
        };
        let deleted = client.execute(&sql, &[&election]).await.unwrap();
        assert!(deleted > 0, "{election} has no entry");
    });
}

/// Deletes the first `count` entries of `election` in queue order (by the sequence number
/// after the last `-`), through a raw ZooKeeper client.
fn zk_delete(election: &str, count: usize) {
    use zookeeper_client as zk;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let client = zk::Client::connector()
            .with_session_timeout(Duration::from_secs(10))
            .connect(&zookeeper())
            .await
            .unwrap();
        let folder = format!("{ROOT}/{election}/@candidates");
        let mut names = client.list_children(&folder).await.unwrap();
        names.sort_by_key(|name| {
            let (_, sequence) = name.rsplit_once('-').unwrap();
            sequence.parse::<u64>().unwrap()
        });
        assert!(!names.is_empty(), "{election} has no entry");
        for name in names.into_iter().take(count) {
            client
                .delete(&format!("{folder}/{name}"), None)
                .await
                .unwrap();
        }
    });
}

/// `baton run --backend URL --election ELECTION --ttl 2s EXTRA.. -- sh -c SCRIPT` (without
/// the `--ttl 2s` where EXTRA has a `--ttl` of its own).
pub fn run_script(election: &str, extra: &[&str], script: &str) -> Command {
    let mut command = baton();
    command.args(["run", "--backend", &url(), "--election", election]);
    if !extra.contains(&"--ttl") {
        command.args(["--ttl", "2s"]);
    }
    command.args(extra).args(["--", "sh", "-c", script]);
    command
}

/// One `baton run` whose child records its pid, token and a grandchild's pid in `dir`.
pub struct Runner {
    pub child: Child,
    dir: PathBuf,
    name: &'static str,
}

impl Runner {
    pub fn start(
        backend: &str,
        election: &str,
        ttl: &str,
        dir: &Path,
        name: &'static str,
    ) -> Runner {
        Runner::start_with(backend, election, &["--ttl", ttl], dir, name)
    }

    /// [`Runner::start`] with these flags instead of `--ttl TTL`.
    pub fn start_with(
        backend: &str,
        election: &str,
        flags: &[&str],
        dir: &Path,
        name: &'static str,
    ) -> Runner {
        Runner::start_env(backend, election, flags, dir, name, &[])
    }

    /// [`Runner::start_with`] with these environment variables added.
    pub fn start_env(
        backend: &str,
        election: &str,
        flags: &[&str],
        dir: &Path,
        name: &'static str,
        env: &[(&str, &str)],
    ) -> Runner {
        let script = format!(
            "echo $BATON_TOKEN > {d}/{n}.token.tmp; mv {d}/{n}.token.tmp {d}/{n}.token; \
             sleep 1000 & echo $! > {d}/{n}.grandchild; echo $$ > {d}/{n}.pid; wait",
            d = dir.display(),
            n = name
        );
        let stderr = std::fs::File::create(dir.join(format!("{name}.stderr"))).unwrap();
        let child = baton()
            .args(["run", "--backend", backend, "--election", election])
            .args(flags)
            .args(["--id", name, "--grace", "1s", "--", "sh", "-c", &script])
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        Runner {
            child,
            dir: dir.to_path_buf(),
            name,
        }
    }

    pub fn token(&self) -> Option<u64> {
        read_number(&self.dir.join(format!("{}.token", self.name)))
    }

    pub fn child_pid(&self) -> Option<u64> {
        read_number(&self.dir.join(format!("{}.pid", self.name)))
    }

    pub fn grandchild_pid(&self) -> Option<u64> {
        read_number(&self.dir.join(format!("{}.grandchild", self.name)))
    }

    /// Waits until the command runs; returns its token.
    pub fn wait_running(&self, limit: Duration) -> u64 {
        wait_for(&format!("{} running", self.name), limit, || {
            self.child_pid().and(self.token())
        })
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join(format!("{}.stderr", self.name))).unwrap_or_default()
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        if let Some(pid) = self.child_pid() {
            if alive(pid) {
                signal(-process_group(pid), libc::SIGKILL);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A child process killed and reaped when dropped: one a failed assertion leaves behind
/// would otherwise run on after the test binary (a `baton observe` retrying forever).
pub struct Reaped(pub std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Every descendant of `root` (through /proc's children lists).
pub fn descendants(root: i32) -> Vec<i32> {
    let mut found = Vec::new();
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for child in children(parent as u32) {
            found.push(child as i32);
            frontier.push(child as i32);
        }
    }
    found
}

/// The children of `pid`, started by any of its threads (`/proc/PID/task/TID/children` lists
/// those of one thread each).
pub fn children(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let list = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        found.extend(
            list.split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok()),
        );
    }
    found
}

/// From `baton shards status` output: each shard's owner id and token, once all `shards` are
/// owned by `members` (every one of them), with counts differing by at most one.
pub fn balanced_owners(
    status: &serde_json::Value,
    shards: usize,
    members: &[&str],
) -> Option<std::collections::BTreeMap<u64, (String, u64)>> {
    let mut owners = std::collections::BTreeMap::new();
    let mut counts: std::collections::HashMap<String, usize> = Default::default();
    for shard in status["shards"].as_array()? {
        let owner = shard["owner"].as_object()?;
        let id = owner["id"].as_str()?.to_string();
        if !members.contains(&id.as_str()) {
            return None;
        }
        *counts.entry(id.clone()).or_default() += 1;
        owners.insert(shard["shard"].as_u64()?, (id, owner["token"].as_u64()?));
    }
    let (min, max) = (counts.values().min()?, counts.values().max()?);
    (owners.len() == shards && counts.len() == members.len() && max - min <= 1).then_some(owners)
}

//! ZooKeeper helpers for the test binaries that run against a real ZooKeeper: the shared
//! server `scripts/test` started, raw client operations behind baton's back, and private
//! servers a test can stop, freeze or wipe.
// Each test binary uses a different subset.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use zookeeper_client as zk;

/// The chroot the tests' URLs use.
pub const CHROOT: &str = "/baton-test";

/// The ZooKeeper under test. Missing is a loud failure, never a skip.
pub fn zookeeper() -> String {
    std::env::var("BATON_TEST_ZK").expect(
        "BATON_TEST_ZK is not set: run the tests with scripts/test, which starts a private \
         ZooKeeper",
    )
}

pub fn url() -> String {
    format!("zk://{}{CHROOT}", zookeeper())
}

const PERSISTENT: zk::CreateOptions<'static> =
    zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());

/// A raw client of the server at `endpoint`.
pub async fn client(endpoint: &str) -> zk::Client {
    zk::Client::connector()
        .with_session_timeout(Duration::from_secs(10))
        .connect(endpoint)
        .await
        .unwrap()
}

/// `<chroot>/<election>/@candidates`.
pub fn candidates(chroot: &str, election: &str) -> String {
    format!("{chroot}/{election}/@candidates")
}

/// The entries of `election`, in queue order (by the sequence number after the last `-`).
pub async fn entries(client: &zk::Client, chroot: &str, election: &str) -> Vec<String> {
    let mut children = client
        .list_children(&candidates(chroot, election))
        .await
        .unwrap();
    children.sort_by_key(|name| {
        let (_, sequence) = name.rsplit_once('-').unwrap();
        sequence.parse::<u64>().unwrap()
    });
    children
}

/// Deletes the leader's entry of `election` behind the library's back, as an operator would.
pub async fn delete_leader_entry(endpoint: &str, chroot: &str, election: &str) {
    let client = client(endpoint).await;
    let first = entries(&client, chroot, election).await.remove(0);
    client
        .delete(&format!("{}/{first}", candidates(chroot, election)), None)
        .await
        .unwrap();
}

/// Deletes every entry of `election` (two: a leader's and a waiter's) in one transaction;
/// returns its zxid.
pub async fn delete_all_entries(endpoint: &str, chroot: &str, election: &str) -> u64 {
    let client = client(endpoint).await;
    let names = entries(&client, chroot, election).await;
    assert_eq!(names.len(), 2, "the leader's entry and the waiter's");
    let mut multi = client.new_multi_writer();
    for name in &names {
        multi
            .add_delete(&format!("{}/{name}", candidates(chroot, election)), None)
            .unwrap();
    }
    // A write to the election's node in the same transaction tells its zxid.
    multi
        .add_set_data(&format!("{chroot}/{election}"), b"", None)
        .unwrap();
    match multi.commit().await.unwrap().pop() {
        Some(zk::MultiWriteResult::SetData { stat }) => stat.mzxid as u64,
        other => panic!("unexpected answer {other:?}"),
    }
}

/// A ZooKeeper of a test's own, on a free loopback port, so it can be frozen or wiped without
/// disturbing the shared one. Killed (and its data removed) when dropped.
pub struct PrivateZk {
    port: u16,
    dir: PathBuf,
    /// `minSessionTimeout` in ms.
    min_session: u32,
    child: Option<Child>,
}

impl PrivateZk {
    /// A fresh server whose sessions can be as short as 2 s.
    pub async fn start() -> PrivateZk {
        PrivateZk::start_with_min_session(2000).await
    }

    pub async fn start_with_min_session(min_session: u32) -> PrivateZk {
        let dir = std::env::temp_dir().join(unique("baton-private-zk"));
        let mut zk = PrivateZk {
            port: free_port(),
            dir,
            min_session,
            child: None,
        };
        // Another test may take the same "free" port first: then try another one.
        for _ in 0..5 {
            if zk.spawn(true).await {
                return zk;
            }
            zk.kill();
            zk.port = free_port();
        }
        panic!("no free port for a private ZooKeeper after 5 tries");
    }

    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn url_at(&self, chroot: &str) -> String {
        format!("zk://{}{chroot}", self.endpoint())
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }

    /// Freezes the server (SIGSTOP): it neither answers nor expires sessions until `resume`.
    /// Stops the server, and returns once every one of its threads is stopped (a group stop
    /// reaches the threads one by one: one still running could answer a request sent after
    /// this returns).
    pub fn freeze(&self) {
        let pid = self.pid();
        // SAFETY: a signal to the server this test started.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let stopped = |stat: &str| {
            stat.rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with(['T', 't']))
        };
        for _ in 0..1000 {
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
                .map(|dir| dir.flatten().map(|task| task.path()).collect::<Vec<_>>())
                .unwrap_or_default();
            let all = tasks.iter().all(|task| {
                std::fs::read_to_string(task.join("stat")).is_ok_and(|stat| stopped(&stat))
            });
            if all {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        panic!("ZooKeeper (pid {pid}) did not stop within 1s of SIGSTOP");
    }

    pub fn resume(&self) {
        // SAFETY: as above.
        unsafe { libc::kill(self.pid(), libc::SIGCONT) };
    }

    /// Starts ZooKeeper (on an empty data directory if `wipe`) and waits until it serves.
    /// Returns false if another test's server answers on its port.
    async fn spawn(&mut self, wipe: bool) -> bool {
        if wipe {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        std::fs::create_dir_all(&self.dir).unwrap();
        let data = self.dir.join("data");
        let config = format!(
            "tickTime=1000\nminSessionTimeout={}\nmaxSessionTimeout=60000\ninitLimit=10\n\
             syncLimit=5\ndataDir={}\nclientPort={}\nclientPortAddress=127.0.0.1\n\
             admin.enableServer=false\nmaxClientCnxns=0\n4lw.commands.whitelist=srvr,conf\n\
             forceSync=no\n",
            self.min_session,
            data.display(),
            self.port
        );
        let config_path = self.dir.join("zoo.cfg");
        std::fs::write(&config_path, config).unwrap();
        let log = std::fs::File::create(self.dir.join("zookeeper.log")).unwrap();
        let child = Command::new("java")
            .args(["-Xmx256m", "-cp", "/usr/share/java/zookeeper.jar"])
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("java and ZooKeeper must be installed (scripts/test installs them)");
        self.child = Some(child);
        for _ in 0..300 {
            // Ours, serving: `conf` names our data directory (another test's server would
            // name its own).
            let conf = four_letters(self.port, "conf").await;
            if conf.contains("dataDir=") {
                return conf.contains(&*data.to_string_lossy())
                    && four_letters(self.port, "srvr").await.contains("Mode: ");
            }
            if let Ok(Some(_)) = self.child.as_mut().unwrap().try_wait() {
                // It exited (its port was taken, say).
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "private ZooKeeper did not start; see {}",
            self.dir.display()
        );
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Replaces the server by a fresh one with an empty data directory on the same port: its
    /// zxids start again from the bottom, and every session is gone.
    pub async fn wipe(&mut self) {
        self.kill();
        assert!(
            self.spawn(true).await,
            "port {} was taken by another test's server",
            self.port
        );
    }

    /// Restarts the server (SIGKILL, then the same port and data): sessions and znodes
    /// survive, as after a crash.
    pub async fn restart(&mut self) {
        let min_session = self.min_session;
        self.restart_with_min_session(min_session).await
    }

    /// Restarts the server on the same port and data with another `minSessionTimeout`.
    pub async fn restart_with_min_session(&mut self, min_session: u32) {
        self.kill();
        self.min_session = min_session;
        assert!(
            self.spawn(false).await,
            "port {} was taken by another test's server",
            self.port
        );
    }
}

impl Drop for PrivateZk {
    fn drop(&mut self) {
        // SIGKILL ends a frozen server too.
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The answer to a four-letter command (empty if none).
async fn four_letters(port: u16, word: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ask = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        stream.write_all(word.as_bytes()).await.ok()?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.ok()?;
        Some(answer)
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()
        .flatten()
        .unwrap_or_default()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A unique name per call and run.
pub fn unique(name: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{name}-{}-{n}", std::process::id())
}

/// Makes `path` and its parents.
pub async fn mkdir(client: &zk::Client, path: &str) {
    client.mkdir(path, &PERSISTENT).await.unwrap();
}

/// A private three-server ZooKeeper ensemble on free loopback ports. Killed (and its data
/// removed) when dropped.
pub struct PrivateEnsemble {
    servers: Vec<EnsembleServer>,
}

struct EnsembleServer {
    client_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl PrivateEnsemble {
    pub async fn start() -> PrivateEnsemble {
        // Another test may take one of the "free" ports first: then try others.
        for _ in 0..3 {
            if let Some(ensemble) = PrivateEnsemble::try_start().await {
                return ensemble;
            }
        }
        panic!("no free ports for a private ZooKeeper ensemble after 3 tries");
    }

    async fn try_start() -> Option<PrivateEnsemble> {
        let ports: Vec<(u16, u16, u16)> = (0..3)
            .map(|_| (free_port(), free_port(), free_port()))
            .collect();
        let members: String = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer, election))| {
                format!("server.{}=127.0.0.1:{peer}:{election}\n", i + 1)
            })
            .collect();
        let mut ensemble = PrivateEnsemble {
            servers: Vec::new(),
        };
        for (i, (client_port, _, _)) in ports.iter().enumerate() {
            let dir = std::env::temp_dir().join(unique("baton-private-ensemble"));
            let data = dir.join("data");
            std::fs::create_dir_all(&data).unwrap();
            std::fs::write(data.join("myid"), format!("{}\n", i + 1)).unwrap();
            let config = format!(
                "tickTime=1000\nminSessionTimeout=2000\nmaxSessionTimeout=60000\ninitLimit=10\n\
                 syncLimit=5\ndataDir={}\nclientPort={client_port}\nclientPortAddress=127.0.0.1\n\
                 admin.enableServer=false\nmaxClientCnxns=0\n4lw.commands.whitelist=srvr,conf\n\
                 forceSync=no\n{members}",
                data.display(),
            );
            std::fs::write(dir.join("zoo.cfg"), config).unwrap();
            let log = std::fs::File::create(dir.join("zookeeper.log")).unwrap();
            let child = Command::new("java")
                .args(["-Xmx192m", "-cp", "/usr/share/java/zookeeper.jar"])
                .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
                .arg(dir.join("zoo.cfg"))
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("java and ZooKeeper must be installed (scripts/test installs them)");
            ensemble.servers.push(EnsembleServer {
                client_port: *client_port,
                dir,
                child: Some(child),
            });
        }
        // Every server serves, as leader or follower, and is ours (names its own data).
        for _ in 0..300 {
            let mut serving = 0;
            for server in &mut ensemble.servers {
                if let Ok(Some(_)) = server.child.as_mut().unwrap().try_wait() {
                    // It exited (a port was taken, say).
                    return None;
                }
                let conf = four_letters(server.client_port, "conf").await;
                let srvr = four_letters(server.client_port, "srvr").await;
                if conf.contains(&*server.dir.to_string_lossy()) && srvr.contains("Mode: ") {
                    serving += 1;
                }
            }
            if serving == ensemble.servers.len() {
                return Some(ensemble);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "private ZooKeeper ensemble did not start; see {}",
            ensemble.servers[0].dir.display()
        );
    }

    /// Every server's endpoint, comma-separated.
    pub fn endpoints(&self) -> String {
        self.servers
            .iter()
            .map(|server| format!("127.0.0.1:{}", server.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn url_at(&self, chroot: &str) -> String {
        format!("zk://{}{chroot}", self.endpoints())
    }

    /// The endpoint of server `i` alone.
    pub fn endpoint(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.servers[i].client_port)
    }

    /// Kills (SIGKILL) server `i`.
    pub fn kill(&mut self, i: usize) {
        self.servers[i].kill();
    }

    /// Kills (SIGKILL) the server that leads the ensemble; returns its index.
    pub async fn kill_leader(&mut self) -> usize {
        for (i, server) in self.servers.iter_mut().enumerate() {
            if four_letters(server.client_port, "srvr")
                .await
                .contains("Mode: leader")
            {
                server.kill();
                return i;
            }
        }
        panic!("no server of the ensemble leads");
    }
}

impl EnsembleServer {
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateEnsemble {
    fn drop(&mut self) {
        for server in &mut self.servers {
            server.kill();
            let _ = std::fs::remove_dir_all(&server.dir);
        }
    }
}

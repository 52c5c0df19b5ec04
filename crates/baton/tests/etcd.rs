//! The conformance suite against a real etcd (started by `scripts/test`).

#[macro_use]
mod conformance;
mod etcd_support;

use baton::{Backend, Election, Error};
use conformance::*;
use etcd_support::{delete_leader_key, etcd, url};

/// Stops (SIGSTOP) the etcd process `pid` and waits until every one of its threads has
/// stopped: a thread busy on a loaded machine can otherwise still answer one more request.
fn freeze(pid: i32) {
    // SAFETY: a signal to the etcd this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stopped = || {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return true;
        };
        tasks.flatten().all(|task| {
            std::fs::read_to_string(task.path().join("stat"))
                .ok()
                .and_then(|stat| {
                    let state = stat
                        .rsplit(')')
                        .next()?
                        .split_whitespace()
                        .next()?
                        .to_string();
                    Some(state == "T" || state == "t")
                })
                .unwrap_or(true)
        })
    };
    for _ in 0..1000 {
        if stopped() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    panic!("etcd {pid} did not stop");
}

/// The shared etcd that `scripts/test` started.
struct EtcdUnderTest;

impl conformance::BackendUnderTest for EtcdUnderTest {
    type Rewindable = PrivateEtcd;

    fn url(&self) -> String {
        url()
    }

    async fn delete_leader_entry(&self, election: &str) {
        delete_leader_key(election).await
    }

    async fn delete_all_entries(&self, election: &str) -> u64 {
        delete_all_keys(election).await
    }

    async fn rewindable(&self) -> PrivateEtcd {
        let etcd = PrivateEtcd::start().await;
        // Raise the revision well above what the fresh server will reach in a test.
        let mut client = etcd_client::Client::connect([etcd.endpoint()], None)
            .await
            .unwrap();
        for i in 0..100 {
            client.put("/filler", i.to_string(), None).await.unwrap();
        }
        etcd
    }
}

impl conformance::Rewindable for PrivateEtcd {
    fn url(&self) -> String {
        format!("etcd://{}/baton-test", self.endpoint())
    }

    async fn rewind(&mut self) {
        self.wipe().await
    }
}

conformance_suite!(EtcdUnderTest);

/// Deletes every candidate key of `election` in one revision; returns that revision.
async fn delete_all_keys(election: &str) -> u64 {
    etcd_support::delete_all_keys_at(&etcd(), election).await
}

/// An etcd of this test's own, on free loopback ports, so it can be wiped without disturbing
/// the shared one. Killed (and its data removed) when dropped.
struct PrivateEtcd {
    client_port: u16,
    peer_port: u16,
    dir: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl PrivateEtcd {
    async fn start() -> PrivateEtcd {
        let free_port = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        };
        let dir = std::env::temp_dir().join(conformance::unique("baton-private-etcd"));
        let mut etcd = PrivateEtcd {
            client_port: free_port(),
            peer_port: free_port(),
            dir,
            child: None,
        };
        // Another test may take the same "free" port first: then try other ports.
        for _ in 0..5 {
            if etcd.spawn().await {
                return etcd;
            }
            etcd.kill();
            etcd.client_port = free_port();
            etcd.peer_port = free_port();
        }
        panic!("no free ports for a private etcd after 5 tries");
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// Starts etcd on an empty data directory and waits until it answers. Returns false if
    /// another test's etcd answers on its port, or if etcd exits (a port of its was taken).
    async fn spawn(&mut self) -> bool {
        let _ = std::fs::remove_dir_all(&self.dir);
        std::fs::create_dir_all(&self.dir).unwrap();
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.dir.join("etcd.log")).unwrap();
        // A name of its own: two tests may race for the same "free" port, and then the server
        // answering there must be recognised as another test's.
        let name = format!("private-{}-{}", std::process::id(), self.client_port);
        let child = std::process::Command::new("etcd")
            .arg(format!("--name={name}"))
            .arg(format!("--data-dir={}", self.dir.join("data").display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster={name}={peer}"))
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd must be installed (scripts/test installs it)");
        self.child = Some(child);
        for _ in 0..100 {
            // etcd exits when its ports are taken (by another test since they were found free).
            if let Some(Ok(Some(_))) = self.child.as_mut().map(|child| child.try_wait()) {
                return false;
            }
            if let Ok(mut client) = etcd_client::Client::connect([self.endpoint()], None).await {
                if let Ok(members) = client.member_list().await {
                    return members.members().iter().any(|m| m.name() == name);
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        panic!("private etcd did not start; see {}", self.dir.display());
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Replaces the server by a fresh one with an empty data directory on the same ports: its
    /// revisions start again from 1.
    async fn wipe(&mut self) {
        self.kill();
        assert!(
            self.spawn().await,
            "port {} was taken by another test (its etcd, or a port a check holds)",
            self.client_port
        );
    }
}

impl Drop for PrivateEtcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn nested_prefixes_are_independent() {
    check_nested_prefixes_are_independent(&url()).await;
}

#[tokio::test]
async fn ttl_above_etcds_maximum_is_rejected() {
    let backend = baton::Backend::connect(&url()).await.unwrap();
    let maximum = std::time::Duration::from_secs(9_000_000_000);
    let at_maximum = baton::ElectionConfig::default().with_ttl(maximum);
    assert!(baton::Election::new(&backend, "ttl", at_maximum).is_ok());
    let above =
        baton::ElectionConfig::default().with_ttl(maximum + std::time::Duration::from_secs(1));
    match baton::Election::new(&backend, "ttl", above) {
        Err(error @ baton::Error::Config(_)) => {
            let message = error.to_string();
            assert!(
                message.contains("above this backend's maximum"),
                "{message}"
            )
        }
        other => panic!("expected a Config error, got {other:?}"),
    }
}

#[tokio::test]
async fn unreachable_server_is_a_clear_error() {
    // Port 1 on loopback: nothing listens there.
    let error = baton::Backend::connect("etcd://127.0.0.1:1/x")
        .await
        .unwrap_err();
    assert!(error.is_retryable());
    let message = error.to_string();
    assert!(
        message.starts_with("cannot reach etcd at 127.0.0.1:1"),
        "{message}"
    );
}

/// A fenced operation never hangs on a stalled server: with etcd frozen (SIGSTOP) it returns
/// within the leadership's local deadline (TTL 2 s), as `Timeout` or `Fenced`, not after the
/// server comes back.
#[tokio::test]
async fn fenced_operations_are_bounded_while_etcd_is_stopped() {
    let etcd = PrivateEtcd::start().await;
    let backend = Backend::connect(&format!("etcd://{}/bounded", etcd.endpoint()))
        .await
        .unwrap();
    let election = Election::new(&backend, "bounded", conformance::config()).unwrap();
    let leadership = election.campaign("a").await.unwrap();
    leadership.guarded_put("/bounded/x", "1").await.unwrap();
    let pid = etcd.child.as_ref().unwrap().id() as i32;
    // Only the etcd this test started is signalled (SIGSTOP here, SIGCONT below).
    freeze(pid);
    let started = std::time::Instant::now();
    let outcome = leadership.guarded_put("/bounded/x", "2").await;
    let took = started.elapsed();
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(
        matches!(outcome, Err(Error::Timeout { .. } | Error::Fenced { .. })),
        "{outcome:?}"
    );
    assert!(took < std::time::Duration::from_secs(2), "took {took:?}");
}

/// A campaign's lease grant is bounded like every other request: with etcd frozen and a long
/// TTL (30 s) it fails within the request timeout (5 s), not after most of the TTL.
#[tokio::test]
async fn lease_grant_is_bounded_while_etcd_is_stopped() {
    let etcd = PrivateEtcd::start().await;
    let backend = Backend::connect(&format!("etcd://{}/grant", etcd.endpoint()))
        .await
        .unwrap();
    let config = conformance::config().with_ttl(std::time::Duration::from_secs(30));
    let election = Election::new(&backend, "grant", config).unwrap();
    let pid = etcd.child.as_ref().unwrap().id() as i32;
    // Only the etcd this test started is signalled (SIGSTOP here, SIGCONT below).
    freeze(pid);
    let started = std::time::Instant::now();
    let limit = std::time::Duration::from_secs(30);
    let outcome = tokio::time::timeout(limit, election.campaign("a")).await;
    let took = started.elapsed();
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(
        matches!(outcome, Ok(Err(Error::Timeout { .. }))),
        "{:?}",
        outcome.map(|r| r.map(|l| l.token()))
    );
    assert!(took < std::time::Duration::from_secs(7), "took {took:?}");
}

/// "I cannot see the backend" is not "there is no leader": with etcd frozen the observer says
/// `Unavailable` within a few seconds (the watch alone would stay silent), and once etcd is
/// back it reports the leader again.
#[tokio::test]
async fn observer_tells_unavailable_from_no_leader() {
    use baton::Observed;
    let etcd = PrivateEtcd::start().await;
    let url = format!("etcd://{}/observe", etcd.endpoint());
    let backend = Backend::connect(&url).await.unwrap();
    let watcher = Backend::connect(&url).await.unwrap();
    let config = conformance::config().with_ttl(std::time::Duration::from_secs(30));
    let election = Election::new(&backend, "o", config.clone()).unwrap();
    let mut observer = Election::new(&watcher, "o", config)
        .unwrap()
        .observe()
        .await
        .unwrap();
    assert_eq!(observer.next().await, Some(Observed::Leader(None)));
    let leadership = election.campaign("a").await.unwrap();
    let Some(Observed::Leader(Some(seen))) = observer.next().await else {
        panic!("no leader seen");
    };
    assert_eq!(seen.token, leadership.token());
    let pid = etcd.child.as_ref().unwrap().id() as i32;
    // Only the etcd this test started is signalled (SIGSTOP here, SIGCONT below).
    freeze(pid);
    let started = std::time::Instant::now();
    let next = tokio::time::timeout(std::time::Duration::from_secs(5), observer.next()).await;
    let took = started.elapsed();
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(
        matches!(next, Ok(Some(Observed::Unavailable { .. }))),
        "{next:?}"
    );
    assert!(took < std::time::Duration::from_secs(3), "took {took:?}");
    let back = tokio::time::timeout(std::time::Duration::from_secs(10), observer.next())
        .await
        .unwrap();
    assert_eq!(back, Some(Observed::Leader(Some(seen))));
}

/// A server that went away after connecting: the campaign fails as `Unreachable` with one
/// short line that names the cause, not a dump of gRPC internals.
#[tokio::test]
async fn refused_connection_during_a_campaign_is_unreachable() {
    let mut etcd = PrivateEtcd::start().await;
    let backend = Backend::connect(&format!("etcd://{}/gone", etcd.endpoint()))
        .await
        .unwrap();
    let election = Election::new(&backend, "gone", conformance::config()).unwrap();
    etcd.kill();
    let error = tokio::time::timeout(std::time::Duration::from_secs(10), election.campaign("a"))
        .await
        .expect("the campaign must fail, not hang")
        .unwrap_err();
    assert!(matches!(error, Error::Unreachable { .. }), "{error:?}");
    let message = error.to_string();
    assert!(!message.contains('\n'), "{message}");
    assert!(message.len() < 200, "{message}");
    assert!(!message.contains("Status {"), "{message}");
    assert!(
        ["refused", "broken pipe", "reset"]
            .iter()
            .any(|cause| message.contains(cause)),
        "{message}"
    );
}

/// Observing while the server cannot be reached is not an error: the stream starts with
/// `Unavailable` and reports the leader once the server answers again.
#[tokio::test]
async fn observing_during_an_outage_starts_unavailable() {
    use baton::Observed;
    let etcd = PrivateEtcd::start().await;
    let url = format!("etcd://{}/outage", etcd.endpoint());
    let backend = Backend::connect(&url).await.unwrap();
    let watcher = Backend::connect(&url).await.unwrap();
    let config = conformance::config().with_ttl(std::time::Duration::from_secs(30));
    let leadership = Election::new(&backend, "o", config.clone())
        .unwrap()
        .campaign("a")
        .await
        .unwrap();
    let pid = etcd.child.as_ref().unwrap().id() as i32;
    // Only the etcd this test started is signalled (SIGSTOP here, SIGCONT below).
    freeze(pid);
    let election = Election::new(&watcher, "o", config).unwrap();
    let observer =
        tokio::time::timeout(std::time::Duration::from_secs(10), election.observe()).await;
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let mut observer = observer
        .expect("observe() must not hang")
        .expect("observe() must not fail while the server is away");
    let first = observer.next().await;
    assert!(
        matches!(first, Some(Observed::Unavailable { .. })),
        "{first:?}"
    );
    let back = tokio::time::timeout(std::time::Duration::from_secs(10), observer.next())
        .await
        .unwrap();
    let Some(Observed::Leader(Some(seen))) = back else {
        panic!("{back:?}");
    };
    assert_eq!(seen.token, leadership.token());
}

/// etcd knows nothing of baton's queue check: it serves a watch that asks for it as a plain
/// deletion watch (the field is skipped, never an error), and the waiter reads before leading.
#[tokio::test]
async fn etcd_ignores_the_queue_check_and_the_successor_reads() {
    use etcd_support::{checked_watch, next_events, raw_watch};
    let mut client = etcd_client::Client::connect([etcd()], None).await.unwrap();
    let prefix = format!("/queue-check-{}/", std::process::id());
    let own = format!("{prefix}b");
    client.put(format!("{prefix}a"), "", None).await.unwrap();
    let put = client.put(own.clone(), "", None).await.unwrap();
    let created = put.header().unwrap().revision();
    let (_watches, mut responses) = raw_watch(
        &etcd(),
        checked_watch(
            7,
            &format!("{prefix}a"),
            created + 1,
            &own,
            created,
            &prefix,
        ),
    )
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    client.delete(format!("{prefix}a"), None).await.unwrap();
    let response = next_events(&mut responses, 7).await;
    assert_eq!(response.events.len(), 1);
    assert_eq!(response.baton_first_at, 0);
    client
        .delete(
            prefix,
            Some(etcd_client::DeleteOptions::new().with_prefix()),
        )
        .await
        .unwrap();

    let requests = etcd_support::requests_from_resign_to_successor(&url()).await;
    assert_eq!(requests, 1, "the find-predecessor read");
}

/// The answers baton server must give as etcd 3.4 does (see `check_answers_as_etcd`), pinned
/// against the real thing.
#[tokio::test]
async fn etcd_answers_as_the_server_checks() {
    etcd_support::check_answers_as_etcd(&etcd()).await;
}

#[tokio::test]
async fn a_dead_endpoint_in_the_url_is_left_out() {
    etcd_support::check_a_dead_endpoint_is_left_out(&etcd()).await;
}

#[tokio::test]
async fn a_hung_member_in_the_url_ends_no_term() {
    etcd_support::check_a_hung_member_ends_no_term(&etcd()).await;
}

#[tokio::test]
async fn a_member_back_from_a_hang_is_used_again() {
    etcd_support::check_a_member_back_from_a_hang_is_used_again(&etcd()).await;
}

#[tokio::test]
async fn a_resign_into_a_fresh_hang_is_heard() {
    etcd_support::check_a_resign_into_a_fresh_hang_is_heard(&etcd()).await;
}

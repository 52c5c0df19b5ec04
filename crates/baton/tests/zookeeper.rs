//! The conformance suite against a real ZooKeeper (started by `scripts/test`), and ZooKeeper's
//! own tests: the layout of entries, session timeouts against TTLs, a frozen server, an
//! unreachable ensemble, bad chroots. Tests that stop or wipe a server use a private one.

#[macro_use]
mod conformance;
mod zk_support;

use std::time::{Duration, Instant};

use baton::{Backend, Election, Error, LossReason, Observed};
use conformance::*;
use zk_support::{PrivateZk, CHROOT};

/// The shared ZooKeeper that `scripts/test` started.
struct ZkUnderTest;

impl conformance::BackendUnderTest for ZkUnderTest {
    type Rewindable = PrivateZk;

    fn url(&self) -> String {
        zk_support::url()
    }

    async fn delete_leader_entry(&self, election: &str) {
        zk_support::delete_leader_entry(&zk_support::zookeeper(), CHROOT, election).await
    }

    async fn delete_all_entries(&self, election: &str) -> u64 {
        zk_support::delete_all_entries(&zk_support::zookeeper(), CHROOT, election).await
    }

    async fn rewindable(&self) -> PrivateZk {
        let zk = PrivateZk::start().await;
        // Raise the zxid well above what the fresh server will reach in a test.
        let client = zk_support::client(&zk.endpoint()).await;
        zk_support::mkdir(&client, "/filler").await;
        for i in 0..100 {
            client
                .set_data("/filler", i.to_string().as_bytes(), None)
                .await
                .unwrap();
        }
        zk
    }
}

impl conformance::Rewindable for PrivateZk {
    fn url(&self) -> String {
        self.url_at(CHROOT)
    }

    async fn rewind(&mut self) {
        self.wipe().await
    }
}

conformance_suite!(ZkUnderTest);

/// The layout the backend documents: an ephemeral sequential znode per candidate, owned by
/// the lease's session, whose czxid is the token, and an `@ids` entry holding its stem.
#[tokio::test]
async fn entries_are_ephemeral_sequential_znodes() {
    let backend = Backend::connect(&zk_support::url()).await.unwrap();
    let name = unique("layout");
    let election = Election::new(&backend, &name, config()).unwrap();
    let leadership = election.campaign("a/b").await.unwrap();
    let client = zk_support::client(&zk_support::zookeeper()).await;
    let entries = zk_support::entries(&client, CHROOT, &name).await;
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = format!("{}/{}", zk_support::candidates(CHROOT, &name), entries[0]);
    let (data, stat) = client.get_data(&entry).await.unwrap();
    assert_eq!(data, b"a/b");
    assert_eq!(stat.czxid as u64, leadership.token());
    assert_ne!(stat.ephemeral_owner, 0, "ephemeral");
    let (stem, sequence) = entries[0].rsplit_once('-').unwrap();
    assert_eq!(sequence.len(), 10, "{sequence}");
    // The id is percent-encoded into one segment.
    let (holder, id_stat) = client
        .get_data(&format!("{CHROOT}/{name}/@ids/a%2Fb"))
        .await
        .unwrap();
    assert_eq!(holder, format!("{stem}-").as_bytes());
    assert_eq!(id_stat.ephemeral_owner, stat.ephemeral_owner);
    leadership.resign().await;
    assert!(zk_support::entries(&client, CHROOT, &name).await.is_empty());
    assert!(client
        .check_stat(&format!("{CHROOT}/{name}/@ids/a%2Fb"))
        .await
        .unwrap()
        .is_none());
}

/// Reads never write: connecting, `leader`, `participants` and an observer on a URL whose
/// chroot does not exist create nothing (`baton leader` used to create the chroot), and read it
/// as an election with no candidate. The observer then sees the first campaign, which creates
/// the chroot with the election's folders.
#[tokio::test]
async fn reads_on_a_missing_chroot_create_nothing() {
    let chroot = format!("/{}/deeper", unique("fresh-chroot"));
    let url = format!("zk://{}{chroot}", zk_support::zookeeper());
    let backend = Backend::connect(&url).await.unwrap();
    let election = Election::new(&backend, "reads", config()).unwrap();
    assert_eq!(election.leader().await.unwrap(), None);
    assert!(election.participants().await.unwrap().is_empty());
    let mut observer = election.observe().await.unwrap();
    assert_eq!(observer.next().await, Some(Observed::Leader(None)));
    let client = zk_support::client(&zk_support::zookeeper()).await;
    let top = chroot.rsplit_once('/').unwrap().0;
    assert!(
        client.check_stat(top).await.unwrap().is_none(),
        "{top} was created by a read"
    );
    let leadership = within("campaign", Duration::from_secs(10), election.campaign("a"))
        .await
        .unwrap();
    match within("observe", Duration::from_secs(10), observer.next()).await {
        Some(Observed::Leader(Some(leader))) => assert_eq!(leader.id, "a"),
        other => panic!("{other:?}"),
    }
    assert!(client.check_stat(&chroot).await.unwrap().is_some());
    leadership.resign().await;
}

/// A chroot baton may not create (under an ephemeral znode, which can have no children, or
/// under a znode only readable by anyone) is reported by the first campaign, in one line that
/// says why; reads there still show no candidate and write nothing.
#[tokio::test]
async fn a_chroot_baton_may_not_create_is_reported_by_the_first_campaign() {
    use zookeeper_client as zk;
    let client = zk_support::client(&zk_support::zookeeper()).await;
    let ephemeral = format!("/{}", unique("ephemeral-parent"));
    let read_only = format!("/{}", unique("read-only-parent"));
    for (path, mode) in [
        (
            &ephemeral,
            zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all()),
        ),
        (
            &read_only,
            zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_read()),
        ),
    ] {
        client.create(path, b"", &mode).await.unwrap();
    }
    for (parent, why) in [
        (&ephemeral, "ephemeral node can not have children"),
        (&read_only, "not authorized"),
    ] {
        let url = format!("zk://{}{parent}/chroot", zk_support::zookeeper());
        let backend = Backend::connect(&url).await.unwrap();
        let election = Election::new(&backend, "refused", config()).unwrap();
        assert_eq!(election.leader().await.unwrap(), None, "{parent}");
        let error = within("campaign", Duration::from_secs(10), election.campaign("a"))
            .await
            .expect_err(parent);
        let message = error.to_string();
        assert!(message.contains(why), "{parent}: {message}");
        assert!(message.contains(&format!("{parent}/chroot")), "{message}");
        assert!(!message.contains('\n'), "{message}");
        assert!(
            client.list_children(parent).await.unwrap().is_empty(),
            "{parent}"
        );
    }
    client.delete(&read_only, None).await.unwrap();
}

/// Names ZooKeeper would refuse in a path are percent-encoded, including characters outside
/// the Basic Multilingual Plane: ZooKeeper checks paths as UTF-16, where they are surrogate
/// pairs, which it refuses.
#[tokio::test]
async fn names_outside_the_bmp_are_percent_encoded() {
    let backend = Backend::connect(&zk_support::url()).await.unwrap();
    let name = format!("{}-\u{1F600}", unique("emoji"));
    let election = Election::new(&backend, &name, config()).unwrap();
    let leadership = within(
        "campaign",
        Duration::from_secs(10),
        election.campaign("a\u{1F642}"),
    )
    .await
    .unwrap();
    let client = zk_support::client(&zk_support::zookeeper()).await;
    let encoded = name.replace('\u{1F600}', "%F0%9F%98%80");
    assert_eq!(
        zk_support::entries(&client, CHROOT, &encoded).await.len(),
        1
    );
    let (holder, _) = client
        .get_data(&format!("{CHROOT}/{encoded}/@ids/a%F0%9F%99%82"))
        .await
        .unwrap();
    assert!(!holder.is_empty());
    let leader = election.leader().await.unwrap().unwrap();
    assert_eq!(leader.id, "a\u{1F642}");
    assert_eq!(leader.token, leadership.token());
    leadership.resign().await;
    assert!(zk_support::entries(&client, CHROOT, &encoded)
        .await
        .is_empty());
}

/// The backend's TTL limits are the server's session timeout bounds, read from the server
/// (2 s and 60 s on the test servers). A TTL the server would stretch into a longer session
/// is refused as bad configuration: when the election is made, or, if the server changed its
/// mind since, when the lease is granted.
#[tokio::test]
async fn a_session_longer_than_the_ttl_is_refused() {
    let mut zk = PrivateZk::start().await;
    let backend = Backend::connect(&zk.url_at(CHROOT)).await.unwrap();
    let limits = backend.limits();
    assert_eq!(limits.min_ttl, Duration::from_secs(2));
    assert_eq!(limits.max_ttl, Duration::from_secs(60));
    assert_eq!(limits.ttl_step, Duration::from_millis(1));
    let short = config().with_ttl(Duration::from_millis(1500));
    match Election::new(&backend, "short", short) {
        Err(error @ Error::Config(_)) => {
            let message = error.to_string();
            assert!(
                message.contains("below this backend's minimum of 2s"),
                "{message}"
            );
        }
        other => panic!("expected a Config error, got {other:?}"),
    }
    // The server now negotiates at least 4 s; this backend still believes 2 s.
    zk.restart_with_min_session(4000).await;
    let election = Election::new(&backend, "stretched", config()).unwrap();
    let refused = within("campaign", Duration::from_secs(10), election.campaign("a")).await;
    match refused {
        Err(error @ Error::Config(_)) => {
            let message = error.to_string();
            assert!(
                message.contains("ttl 2s is below this backend's minimum of 4s"),
                "{message}"
            );
            assert!(!error.is_retryable());
        }
        other => panic!(
            "expected a Config error, got {:?}",
            other.map(|l| l.token())
        ),
    }
    // A fresh connection reads the new bound.
    let fresh = Backend::connect(&zk.url_at(CHROOT)).await.unwrap();
    assert_eq!(fresh.limits().min_ttl, Duration::from_secs(4));
}

/// ZooKeeper frozen (SIGSTOP) beyond the session timeout while a leader holds: `lost()` fires
/// at the local deadline, before the server could have expired the session (it could not do
/// so before the TTL after the freeze); once it resumes, the old token is refused by the
/// server and the waiter takes over with a larger token.
#[tokio::test]
async fn a_frozen_server_ends_leadership_at_the_local_deadline() {
    let zk = PrivateZk::start().await;
    let url = zk.url_at(CHROOT);
    let a_backend = Backend::connect(&url).await.unwrap();
    let b_backend = Backend::connect(&url).await.unwrap();
    let a = Election::new(&a_backend, "frozen", config()).unwrap();
    let b = Election::new(&b_backend, "frozen", config().with_requeue(true)).unwrap();
    let leadership = a.campaign("a").await.unwrap();
    let old_token = leadership.token();
    let mut waiter = b.candidacy("b").unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    zk.freeze();
    let frozen_at = tokio::time::Instant::now();
    // Answers already on their way are in by now; nothing moves the deadline after this.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let deadline = leadership.deadline().expect("still leading");
    let reason = within("loss", Duration::from_secs(3), leadership.lost()).await;
    let lost_at = tokio::time::Instant::now();
    assert_eq!(reason, LossReason::LeaseExpired);
    assert!(
        lost_at >= deadline && lost_at < deadline + Duration::from_millis(250),
        "lost {:?} after the deadline",
        lost_at.saturating_duration_since(deadline)
    );
    assert!(
        lost_at - frozen_at < config().ttl,
        "lost {:?} after the freeze",
        lost_at - frozen_at
    );
    // Frozen beyond the session timeout.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    zk.resume();
    assert!(matches!(
        leadership.guarded_put("/frozen/x", "late").await,
        Err(Error::Fenced { .. })
    ));
    let successor = within("takeover", Duration::from_secs(10), waiter.next())
        .await
        .unwrap();
    assert!(successor.token() > old_token);
    match b.guarded_put(old_token, "/frozen/x", "stale").await {
        Err(Error::Fenced { token, .. }) => assert_eq!(token, old_token),
        other => panic!("the old token was not fenced: {other:?}"),
    }
    successor.guarded_put("/frozen/x", "new").await.unwrap();
    assert_eq!(
        successor.fenced_get("/frozen/x").await.unwrap(),
        Some(b"new".to_vec())
    );
    successor.resign().await;
    waiter.resign().await;
}

/// A fenced operation never hangs on a frozen server: it returns within the leadership's
/// local deadline (TTL 2 s), as `Timeout` or `Fenced`.
#[tokio::test]
async fn fenced_operations_are_bounded_while_zookeeper_is_frozen() {
    let zk = PrivateZk::start().await;
    let backend = Backend::connect(&zk.url_at(CHROOT)).await.unwrap();
    let election = Election::new(&backend, "bounded", config()).unwrap();
    let leadership = election.campaign("a").await.unwrap();
    leadership.guarded_put("/bounded/x", "1").await.unwrap();
    zk.freeze();
    let started = Instant::now();
    let outcome = leadership.guarded_put("/bounded/x", "2").await;
    let took = started.elapsed();
    zk.resume();
    assert!(
        matches!(outcome, Err(Error::Timeout { .. } | Error::Fenced { .. })),
        "{outcome:?}"
    );
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

/// "I cannot see the backend" is not "there is no leader": with ZooKeeper frozen the observer
/// says `Unavailable` within a few seconds, and once it is back it reports the leader again.
#[tokio::test]
async fn observer_tells_unavailable_from_no_leader() {
    let zk = PrivateZk::start().await;
    let url = zk.url_at(CHROOT);
    let backend = Backend::connect(&url).await.unwrap();
    let watcher = Backend::connect(&url).await.unwrap();
    let config = config().with_ttl(Duration::from_secs(30));
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
    zk.freeze();
    let started = Instant::now();
    let next = tokio::time::timeout(Duration::from_secs(5), observer.next()).await;
    let took = started.elapsed();
    zk.resume();
    assert!(
        matches!(next, Ok(Some(Observed::Unavailable { .. }))),
        "{next:?}"
    );
    assert!(took < Duration::from_secs(4), "took {took:?}");
    let back = tokio::time::timeout(Duration::from_secs(10), observer.next())
        .await
        .unwrap();
    assert_eq!(back, Some(Observed::Leader(Some(seen))));
}

/// Observing an ensemble that went away starts with `Unavailable`, and follows once it is back.
#[tokio::test]
async fn observing_while_zookeeper_is_frozen_starts_unavailable() {
    let zk = PrivateZk::start().await;
    let backend = Backend::connect(&zk.url_at(CHROOT)).await.unwrap();
    let election = Election::new(&backend, "away", config()).unwrap();
    zk.freeze();
    let observed = tokio::time::timeout(Duration::from_secs(8), election.observe()).await;
    let mut observer = observed.expect("observe is bounded").unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), observer.next()).await;
    zk.resume();
    assert!(
        matches!(first, Ok(Some(Observed::Unavailable { .. }))),
        "{first:?}"
    );
    let back = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match observer.next().await {
                Some(Observed::Unavailable { .. }) => continue,
                other => return other,
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(back, Some(Observed::Leader(None)));
}

/// An unreachable ensemble is one line that names the cause, fast.
#[tokio::test]
async fn unreachable_ensemble_is_one_line() {
    let started = Instant::now();
    // Port 1 on loopback: nothing listens there.
    let error = Backend::connect("zk://127.0.0.1:1,127.0.0.1:2/x")
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(6));
    assert!(matches!(error, Error::Unreachable { .. }), "{error:?}");
    assert!(error.is_retryable());
    let message = error.to_string();
    assert!(
        message.starts_with("cannot reach zookeeper at 127.0.0.1:1,127.0.0.1:2: "),
        "{message}"
    );
    assert!(message.contains("refused"), "{message}");
    assert!(!message.contains('\n'), "{message}");
}

/// A bad chroot is an invalid URL, refused before anything is sent.
#[tokio::test]
async fn bad_chroots_are_invalid_urls() {
    for (url, needle) in [
        ("zk://127.0.0.1:1/a//b", "empty segments"),
        ("zk://127.0.0.1:1/a/./b", "\".\""),
        ("zk://127.0.0.1:1/zookeeper/quota", "inside /zookeeper"),
        ("zookeeper://127.0.0.1:1/a/@candidates", "reserved"),
        ("zk://127.0.0.1:1/a\u{fff0}", "does not allow"),
        // Outside the BMP: a surrogate pair in ZooKeeper's UTF-16, which it refuses.
        ("zk://127.0.0.1:1/a\u{1F600}", "does not allow"),
    ] {
        match Backend::connect(url).await {
            Err(error @ Error::InvalidUrl { .. }) => {
                let message = error.to_string();
                assert!(message.contains(needle), "{url}: {message}");
            }
            other => panic!("{url}: expected InvalidUrl, got {other:?}"),
        }
    }
}

/// Keys ZooKeeper cannot hold are refused before anything is sent; a key with children
/// cannot be deleted.
#[tokio::test]
async fn fenced_keys_are_znodes_under_the_chroot() {
    let backend = Backend::connect(&zk_support::url()).await.unwrap();
    let name = unique("keys");
    let election = Election::new(&backend, &name, config()).unwrap();
    let leadership = election.campaign("a").await.unwrap();
    for bad in ["/", "/a//b", "/a/./b", "/a/", "/a/\u{1F600}"] {
        match leadership.guarded_put(bad, "x").await {
            Err(Error::InvalidKey { .. }) => {}
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    let parent = format!("/data/{name}");
    leadership
        .guarded_put(&format!("{parent}/child"), "1")
        .await
        .unwrap();
    let client = zk_support::client(&zk_support::zookeeper()).await;
    let (value, _) = client
        .get_data(&format!("{CHROOT}{parent}/child"))
        .await
        .unwrap();
    assert_eq!(value, b"1");
    match leadership.fenced_delete(&parent).await {
        Err(Error::Unsupported(message)) => assert!(message.contains("children"), "{message}"),
        other => panic!("{other:?}"),
    }
    leadership.resign().await;
}

/// A fenced write longer than ZooKeeper takes in one request (its `jute.maxbuffer`, 1 MiB by
/// default) is refused in one line before it is sent: the server would close the connection,
/// which the client can only report as a lost connection. Just under the limit works.
#[tokio::test]
async fn a_fenced_write_too_large_for_zookeeper_is_refused() {
    let backend = Backend::connect(&zk_support::url()).await.unwrap();
    let election = Election::new(&backend, &unique("large"), config()).unwrap();
    let leadership = election.campaign("a").await.unwrap();
    let huge = "x".repeat(2 * 1024 * 1024);
    match leadership.guarded_put("/large/huge", &huge).await {
        Err(error @ Error::Unsupported(_)) => {
            let message = error.to_string();
            assert!(message.contains("jute.maxbuffer"), "{message}");
            assert!(!message.contains('\n'), "{message}");
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    let large = "x".repeat(1_000_000);
    leadership.guarded_put("/large/big", &large).await.unwrap();
    assert_eq!(
        leadership
            .fenced_get("/large/big")
            .await
            .unwrap()
            .map(|v| v.len()),
        Some(large.len())
    );
    leadership.resign().await;
}

/// A three-server ensemble: renewals (syncs through whichever server a session is connected
/// to) keep a lease alive for many TTLs, and after its leading server is killed the ensemble
/// elects another; the holder keeps its term if its session moves to a live server within the
/// TTL, else loses it at its local deadline. Either way the next leadership's token is higher:
/// a czxid carries the ensemble's epoch.
#[tokio::test]
async fn an_ensemble_outlives_its_leading_server() {
    let mut ensemble = zk_support::PrivateEnsemble::start().await;
    let url = ensemble.url_at(CHROOT);
    let a_backend = Backend::connect(&url).await.unwrap();
    let b_backend = Backend::connect(&url).await.unwrap();
    let config = config().with_ttl(Duration::from_secs(10));
    let a = Election::new(&a_backend, "ensemble", config.clone()).unwrap();
    let b = Election::new(&b_backend, "ensemble", config).unwrap();
    let leadership = a.campaign("a").await.unwrap();
    let old_token = leadership.token();
    let mut waiter = b.candidacy("b").unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    leadership.guarded_put("/ensemble/x", "1").await.unwrap();
    ensemble.kill_leader().await;
    // Longer than the TTL: a term still held then was renewed after the kill.
    let kept = tokio::time::timeout(Duration::from_secs(11), leadership.lost()).await;
    match kept {
        // Still leading: its renewals went through once the ensemble had a leader again.
        Err(_) => {
            eprintln!("the term outlived the ensemble's leader");
            assert!(leadership.is_leading());
            leadership.guarded_put("/ensemble/x", "2").await.unwrap();
            leadership.resign().await;
        }
        Ok(reason) => {
            eprintln!("the term ended at its local deadline");
            assert_eq!(reason, LossReason::LeaseExpired);
        }
    }
    let successor = within("takeover", Duration::from_secs(20), waiter.next())
        .await
        .unwrap();
    assert!(successor.token() > old_token);
    match b.guarded_put(old_token, "/ensemble/x", "stale").await {
        Err(Error::Fenced { .. }) => {}
        other => panic!("the old token was not fenced: {other:?}"),
    }
    successor.guarded_put("/ensemble/x", "3").await.unwrap();
    successor.resign().await;
    // An entry created now carries the new epoch (the high 32 bits of a zxid).
    let fresh = a.campaign("c").await.unwrap();
    assert!(
        fresh.token() >> 32 > old_token >> 32,
        "{:#x} after {old_token:#x}",
        fresh.token()
    );
    fresh.resign().await;
}

/// Concurrent compare-and-swaps of one leadership: ZooKeeper's `multi` cannot compare values,
/// so each is a read and a version-checked write, started again on a conflict. Of eight that
/// create the same absent key, exactly one succeeds and its value stays.
#[tokio::test]
async fn concurrent_compare_and_swaps_have_one_winner() {
    use baton::FencedTxn;
    let backend = Backend::connect(&zk_support::url()).await.unwrap();
    let name = unique("cas");
    let election = Election::new(&backend, &name, config()).unwrap();
    let leadership = std::sync::Arc::new(election.campaign("a").await.unwrap());
    let key = format!("/data/{name}/once");
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let (leadership, key) = (leadership.clone(), key.clone());
            tokio::spawn(async move {
                let txn = FencedTxn::new()
                    .when_value(&key, None)
                    .then_put(&key, i.to_string())
                    .otherwise_get(&key);
                (i, leadership.fenced_txn(txn).await.unwrap())
            })
        })
        .collect();
    let mut winners = Vec::new();
    for task in tasks {
        let (i, outcome) = task.await.unwrap();
        if outcome.succeeded {
            winners.push(i);
        } else {
            assert_eq!(outcome.values.len(), 1);
            assert!(outcome.values[0].is_some(), "lost, yet the key is absent");
        }
    }
    assert_eq!(winners.len(), 1, "{winners:?}");
    assert_eq!(
        leadership.fenced_get(&key).await.unwrap(),
        Some(winners[0].to_string().into_bytes())
    );
}

/// The ensemble server the leader's client is connected to is killed, and that client knows no
/// other (its URL names that server alone): it cannot move its session, so it loses at its
/// local deadline, and the waiter (connected to the other servers) leads only after the
/// session expired at the ensemble, with a higher token.
#[tokio::test]
async fn the_leaders_own_server_killed_ends_the_term_before_the_waiter_leads() {
    let mut ensemble = zk_support::PrivateEnsemble::start().await;
    let only_first = format!("zk://{}{CHROOT}", ensemble.endpoint(0));
    let others = format!(
        "zk://{},{}{CHROOT}",
        ensemble.endpoint(1),
        ensemble.endpoint(2)
    );
    let a_backend = Backend::connect(&only_first).await.unwrap();
    let b_backend = Backend::connect(&others).await.unwrap();
    let config = config().with_ttl(Duration::from_secs(4));
    let a = Election::new(&a_backend, "own-server", config.clone()).unwrap();
    let b = Election::new(&b_backend, "own-server", config).unwrap();
    let leadership = a.campaign("a").await.unwrap();
    let old_token = leadership.token();
    let mut waiter = b.candidacy("b").unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = std::time::Instant::now();
    ensemble.kill(0);
    let reason = within("loss", Duration::from_secs(5), leadership.lost()).await;
    let lost_after = killed.elapsed();
    assert_eq!(reason, LossReason::LeaseExpired);
    assert!(lost_after < Duration::from_secs(4), "{lost_after:?}");
    let successor = within("takeover", Duration::from_secs(20), waiter.next())
        .await
        .unwrap();
    let won_after = killed.elapsed();
    assert!(won_after > lost_after, "{won_after:?} vs {lost_after:?}");
    assert!(successor.token() > old_token);
    successor.resign().await;
    waiter.resign().await;
}

/// The standalone server crashes and restarts on the same data while a leader holds: the
/// session survives a restart shorter than the TTL, so the term goes on (or, if it did not,
/// ended at the local deadline); every later token is higher.
#[tokio::test]
async fn a_restarted_server_keeps_or_ends_the_term_safely() {
    let mut server = zk_support::PrivateZk::start().await;
    let url = server.url_at(CHROOT);
    let backend = Backend::connect(&url).await.unwrap();
    let config = config().with_ttl(Duration::from_secs(10));
    let election = Election::new(&backend, "restart", config).unwrap();
    let leadership = election.campaign("a").await.unwrap();
    let old_token = leadership.token();
    server.restart().await;
    // Past the TTL: a term still held then was renewed by the restarted server.
    match tokio::time::timeout(Duration::from_secs(11), leadership.lost()).await {
        Err(_) => {
            assert!(leadership.is_leading());
            leadership.guarded_put("/restart/x", "1").await.unwrap();
            leadership.resign().await;
        }
        Ok(reason) => assert_eq!(reason, LossReason::LeaseExpired),
    }
    let next = within("next term", Duration::from_secs(20), election.campaign("b"))
        .await
        .unwrap();
    assert!(next.token() > old_token);
    next.resign().await;
}

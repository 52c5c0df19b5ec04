//! The conformance suite: the same tests against every backend.
//!
//! A backend's test file implements [`BackendUnderTest`] (a URL, and the few things done behind
//! baton's back) and instantiates the whole suite in one line:
//!
//! ```ignore
//! #[macro_use]
//! mod conformance;
//! conformance_suite!(MyBackendUnderTest::new());
//! ```
//!
//! Every check asserts observable behaviour through the public API only, so each backend runs
//! exactly these.

use std::time::Duration;

use baton::{Backend, Election, ElectionConfig, Error, LeaderInfo, LossReason, Observed};

pub mod shards;

/// What the suite needs of a backend beyond its URL: the things an operator or a fault does
/// behind baton's back.
#[allow(async_fn_in_trait)]
pub trait BackendUnderTest {
    /// A backend whose history can be rewound.
    type Rewindable: Rewindable;

    /// The URL of the backend under test.
    fn url(&self) -> String;

    /// Deletes the leader's entry of `election`, as an operator would.
    async fn delete_leader_entry(&self, election: &str);

    /// Deletes every entry of `election` in one step; returns the backend's revision of it.
    async fn delete_all_entries(&self, election: &str) -> u64;

    /// A private instance of the backend, with some history already behind it.
    async fn rewindable(&self) -> Self::Rewindable;
}

/// A private backend instance whose history can go backwards.
#[allow(async_fn_in_trait)]
pub trait Rewindable {
    /// Its URL.
    fn url(&self) -> String;
    /// Restores it to an empty state (an older backup, or a wipe) at the same URL.
    async fn rewind(&mut self);
}

/// Instantiates every check of the suite as a `#[tokio::test]` against `$backend`, an
/// expression of a type that implements [`BackendUnderTest`].
#[macro_export]
macro_rules! conformance_suite {
    ($backend:expr) => {
        mod conformance_suite {
            use super::*;
            #[allow(unused_imports)]
            use $crate::conformance::{BackendUnderTest as _, Rewindable as _};

            #[tokio::test]
            async fn shards_spread_evenly_and_move_little() {
                conformance::shards::check_shards_spread_and_move_little(&$backend.url()).await;
            }

            #[tokio::test]
            async fn shards_lost_waits_for_the_holder() {
                conformance::shards::check_shards_lost_waits_for_the_holder(&$backend).await;
            }

            #[tokio::test]
            async fn shards_bad_input_is_rejected() {
                conformance::shards::check_shards_bad_input(&$backend.url()).await;
            }

            #[tokio::test]
            async fn single_candidate_leads_and_resigns() {
                conformance::check_single_candidate_leads_and_resigns(&$backend.url()).await;
            }

            #[tokio::test]
            async fn tokens_strictly_increase() {
                conformance::check_tokens_strictly_increase(&$backend.url()).await;
            }

            #[tokio::test]
            async fn waiter_takes_over_on_resign() {
                conformance::check_waiter_takes_over_on_resign(&$backend.url()).await;
            }

            #[tokio::test]
            async fn own_entry_deleted_is_reported() {
                let backend = $backend;
                conformance::check_own_key_deleted_is_reported(&backend.url(), async |e: &str| {
                    backend.delete_leader_entry(e).await
                })
                .await;
            }

            #[tokio::test]
            async fn lease_revoked_is_reported() {
                conformance::check_lease_revoked_is_reported(&$backend.url()).await;
            }

            #[tokio::test]
            async fn observe_reports_every_change() {
                conformance::check_observe_reports_every_change(&$backend.url()).await;
            }

            #[tokio::test]
            async fn guarded_put_is_fenced() {
                conformance::check_guarded_put_is_fenced(&$backend.url()).await;
            }

            #[tokio::test]
            async fn dropping_leadership_resigns() {
                conformance::check_dropping_leadership_resigns(&$backend.url()).await;
            }

            #[tokio::test]
            async fn requeue_campaigns_again() {
                let backend = $backend;
                conformance::check_requeue_campaigns_again(&backend.url(), async |e: &str| {
                    backend.delete_leader_entry(e).await
                })
                .await;
            }

            #[tokio::test]
            async fn bad_input_is_rejected() {
                conformance::check_bad_input_is_rejected(&$backend.url()).await;
            }

            #[tokio::test]
            async fn many_elections_share_one_lease() {
                conformance::check_many_elections_share_one_lease(&$backend.url()).await;
            }

            #[tokio::test]
            async fn one_resign_wakes_exactly_one_of_50_waiters() {
                conformance::check_one_resign_wakes_exactly_one_waiter(&$backend.url(), 50).await;
            }

            #[tokio::test]
            async fn one_resign_wakes_exactly_one_of_1000_waiters() {
                conformance::check_one_resign_wakes_one_of_many_waiters(&$backend.url(), 1000, 20)
                    .await;
            }

            #[tokio::test]
            async fn own_and_predecessor_deleted_at_once_never_elects_the_waiter() {
                let backend = $backend;
                conformance::check_own_and_predecessor_deleted_at_once(
                    &backend.url(),
                    async |e: &str| backend.delete_all_entries(e).await,
                    50,
                )
                .await;
            }

            #[tokio::test]
            async fn tokens_going_backwards_end_the_candidacy() {
                let mut private = $backend.rewindable().await;
                let url = private.url();
                conformance::check_tokens_going_backwards_end_the_candidacy(&url, async || {
                    private.rewind().await
                })
                .await;
            }

            #[tokio::test]
            async fn a_waiter_notices_tokens_going_backwards() {
                let mut private = $backend.rewindable().await;
                let url = private.url();
                conformance::check_a_waiter_notices_tokens_going_backwards(&url, async || {
                    private.rewind().await
                })
                .await;
            }

            #[tokio::test]
            async fn no_renewals_once_every_candidacy_ended() {
                conformance::check_no_renewals_once_every_candidacy_ended(&$backend.url()).await;
            }

            #[tokio::test]
            async fn abandoned_campaign_leaves_the_queue() {
                conformance::check_abandoned_campaign_leaves_the_queue(&$backend.url()).await;
            }

            #[tokio::test]
            async fn requeue_resigning_a_term_campaigns_again() {
                conformance::check_requeue_resigning_a_term_campaigns_again(&$backend.url()).await;
            }

            #[tokio::test]
            async fn requeue_never_spins() {
                conformance::check_requeue_never_spins(&$backend.url()).await;
            }

            #[tokio::test]
            async fn fenced_operations() {
                conformance::check_fenced_operations(&$backend.url()).await;
            }

            #[tokio::test]
            async fn leader_value_participants_and_campaign_timeout() {
                conformance::check_leader_value_participants_and_campaign_timeout(&$backend.url())
                    .await;
            }

            #[tokio::test]
            async fn duplicate_ids_are_refused() {
                conformance::check_duplicate_ids_are_refused(&$backend.url()).await;
            }

            #[tokio::test]
            async fn a_waiters_token_is_fenced() {
                conformance::check_a_waiters_token_is_fenced(&$backend.url()).await;
            }

            #[tokio::test]
            async fn close_is_final() {
                conformance::check_close_is_final(&$backend.url()).await;
            }

            #[tokio::test]
            async fn runner_with_a_duplicate_id_waits() {
                conformance::check_runner_with_a_duplicate_id_waits(&$backend.url()).await;
            }

            #[tokio::test]
            async fn runner_callbacks() {
                let backend = $backend;
                conformance::check_runner_callbacks(&backend.url(), async |e: &str| {
                    backend.delete_leader_entry(e).await
                })
                .await;
            }
        }
    };
}

/// A short TTL keeps the expiry tests quick; etcd leases are whole seconds.
pub fn config() -> ElectionConfig {
    ElectionConfig::default().with_ttl(Duration::from_secs(2))
}

/// A unique election name per check and run.
pub fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{name}-{}-{nanos}", std::process::id())
}

/// Waits until `election` lists `count` participants (its leader among them).
pub async fn queued(election: &Election, count: usize) {
    within(
        &format!("{count} participants"),
        Duration::from_secs(10),
        async {
            while election.participants().await.unwrap().len() != count {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        },
    )
    .await;
}

pub async fn within<T>(what: &str, limit: Duration, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(limit, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no result within {limit:?}"))
}

pub async fn check_single_candidate_leads_and_resigns(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    let election = Election::new(&backend, &unique("single"), config()).unwrap();
    assert_eq!(election.leader().await.unwrap(), None);
    let leadership = within("campaign", Duration::from_secs(5), election.campaign("a"))
        .await
        .unwrap();
    assert!(leadership.token() > 0);
    assert!(leadership.is_leading());
    assert_eq!(
        election.leader().await.unwrap(),
        Some(LeaderInfo {
            id: "a".into(),
            token: leadership.token(),
            value: None,
        })
    );
    leadership.resign().await;
    assert_eq!(election.leader().await.unwrap(), None);
}

pub async fn check_tokens_strictly_increase(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    let election = Election::new(&backend, &unique("tokens"), config()).unwrap();
    let mut last = 0;
    for round in 0..5 {
        let leadership = election.campaign(&format!("c{round}")).await.unwrap();
        assert!(
            leadership.token() > last,
            "round {round}: {} after {last}",
            leadership.token()
        );
        last = leadership.token();
        leadership.resign().await;
    }
}

pub async fn check_waiter_takes_over_on_resign(url: &str) {
    check_waiter_takes_over_on_resign_after(url, config(), async |_, _| {}).await;
}

/// [`check_waiter_takes_over_on_resign`] with `between` done to the backend while a leads and
/// b waits, watching a's entry (a fault the handoff must come through); it gets a's leadership
/// and b's backend to check.
pub async fn check_waiter_takes_over_on_resign_after(
    url: &str,
    config: ElectionConfig,
    between: impl AsyncFnOnce(&baton::Leadership, &Backend),
) {
    let a_backend = Backend::connect(url).await.unwrap();
    let b_backend = Backend::connect(url).await.unwrap();
    let name = unique("handoff");
    let a = Election::new(&a_backend, &name, config.clone()).unwrap();
    let b = Election::new(&b_backend, &name, config).unwrap();
    let a_lead = a.campaign("a").await.unwrap();
    let b_campaign = tokio::spawn(async move { b.campaign("b").await });
    settled(std::slice::from_ref(&b_backend), 1).await;
    between(&a_lead, &b_backend).await;
    assert!(!b_campaign.is_finished(), "b must wait while a leads");
    let a_token = a_lead.token();
    a_lead.resign().await;
    let b_lead = within("takeover", Duration::from_secs(2), b_campaign)
        .await
        .unwrap()
        .unwrap();
    assert!(b_lead.token() > a_token);
    assert_eq!(b_lead.id(), "b");
}

pub async fn check_own_key_deleted_is_reported(
    url: &str,
    delete_leader_key: impl AsyncFnOnce(&str),
) {
    let backend = Backend::connect(url).await.unwrap();
    let name = unique("deleted");
    let election = Election::new(&backend, &name, config()).unwrap();
    let leadership = election.campaign("a").await.unwrap();
    delete_leader_key(&name).await;
    let reason = within("loss", Duration::from_secs(3), leadership.lost()).await;
    assert_eq!(reason, LossReason::EntryDeleted);
    assert!(!leadership.is_leading());
}

pub async fn check_lease_revoked_is_reported(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    let election = Election::new(&backend, &unique("revoked"), config()).unwrap();
    let leadership = election.campaign("a").await.unwrap();
    backend.close().await;
    let reason = within("loss", Duration::from_secs(3), leadership.lost()).await;
    assert!(
        matches!(reason, LossReason::EntryDeleted | LossReason::LeaseExpired),
        "{reason:?}"
    );
    assert!(!leadership.is_leading());
}

pub async fn check_observe_reports_every_change(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    let other = Backend::connect(url).await.unwrap();
    let name = unique("observe");
    let election = Election::new(&backend, &name, config()).unwrap();
    let b_election = Election::new(&other, &name, config()).unwrap();
    let mut observer = election.observe().await.unwrap();
    assert_eq!(observer.next().await, Some(Observed::Leader(None)));
    let a = election.campaign("a").await.unwrap();
    let seen = within("observe a", Duration::from_secs(2), observer.next()).await;
    assert_eq!(
        seen,
        Some(Observed::Leader(Some(LeaderInfo {
            id: "a".into(),
            token: a.token(),
            value: None,
        })))
    );
    let b_waiting = tokio::spawn(async move { b_election.campaign("b").await });
    queued(&election, 2).await;
    a.resign().await;
    let b = b_waiting.await.unwrap().unwrap();
    let seen = within("observe b", Duration::from_secs(2), observer.next()).await;
    assert_eq!(
        seen,
        Some(Observed::Leader(Some(LeaderInfo {
            id: "b".into(),
            token: b.token(),
            value: None,
        })))
    );
    b.resign().await;
    let seen = within("observe none", Duration::from_secs(2), observer.next()).await;
    assert_eq!(seen, Some(Observed::Leader(None)));
}

pub async fn check_guarded_put_is_fenced(url: &str) {
    let a_backend = Backend::connect(url).await.unwrap();
    let b_backend = Backend::connect(url).await.unwrap();
    let name = unique("guarded");
    let a = Election::new(&a_backend, &name, config()).unwrap();
    let b = Election::new(&b_backend, &name, config()).unwrap();
    let data_key = format!("/baton-test-data/{name}");
    let a_lead = a.campaign("a").await.unwrap();
    a_lead.guarded_put(&data_key, "from a").await.unwrap();
    let a_token = a_lead.token();
    a.guarded_put(a_token, &data_key, "from a by token")
        .await
        .unwrap();
    a_lead.resign().await;
    let b_lead = b.campaign("b").await.unwrap();
    b_lead.guarded_put(&data_key, "from b").await.unwrap();
    // The old token is refused, by the service itself.
    match b.guarded_put(a_token, &data_key, "stale").await {
        Err(Error::Fenced { token, .. }) => assert_eq!(token, a_token),
        other => panic!("expected Fenced, got {other:?}"),
    }
}

pub async fn check_dropping_leadership_resigns(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    let election = Election::new(&backend, &unique("drop"), config()).unwrap();
    let leadership = election.campaign("a").await.unwrap();
    drop(leadership);
    within("leader gone", Duration::from_secs(2), async {
        while election.leader().await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

pub async fn check_requeue_campaigns_again(url: &str, delete_leader_key: impl AsyncFnOnce(&str)) {
    let backend = Backend::connect(url).await.unwrap();
    let name = unique("requeue");
    let election = Election::new(&backend, &name, config().with_requeue(true)).unwrap();
    let mut candidacy = election.candidacy("a").unwrap();
    let first = candidacy.next().await.unwrap();
    delete_leader_key(&name).await;
    assert_eq!(first.lost().await, LossReason::EntryDeleted);
    let second = within("requeued", Duration::from_secs(3), candidacy.next())
        .await
        .unwrap();
    assert!(second.token() > first.token());
    assert!(second.is_leading());
    // Dropping the first term's handle must not end the second term.
    drop(first);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(second.is_leading());
    assert_eq!(
        election.leader().await.unwrap().map(|l| l.token),
        Some(second.token())
    );
    second.resign().await;
    candidacy.resign().await;
}

pub async fn check_bad_input_is_rejected(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    for (name, config) in [
        ("ok", ElectionConfig::default().with_ttl(Duration::ZERO)),
        ("ok", ElectionConfig::default().with_max_drift_ppm(600_000)),
        ("a/b", config()),
        ("", config()),
    ] {
        assert!(Election::new(&backend, name, config).is_err());
    }
    let election = Election::new(&backend, &unique("bad"), config()).unwrap();
    assert!(election.candidacy("").is_err());
}

pub async fn check_many_elections_share_one_lease(url: &str) {
    // Renewal traffic must not grow with the number of elections a process holds.
    let one = Backend::connect(url).await.unwrap();
    let many = Backend::connect(url).await.unwrap();
    let _single = Election::new(&one, &unique("share1"), config())
        .unwrap()
        .campaign("a")
        .await
        .unwrap();
    let mut held = Vec::new();
    for i in 0..50 {
        let election = Election::new(&many, &unique(&format!("share{i}")), config()).unwrap();
        held.push(election.campaign("a").await.unwrap());
    }
    let (one_before, many_before) = (one.stats().renewals, many.stats().renewals);
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let one_renewals = one.stats().renewals - one_before;
    let many_renewals = many.stats().renewals - many_before;
    assert!(one_renewals >= 3, "{one_renewals}");
    assert!(
        many_renewals <= one_renewals + 1,
        "50 elections renewed {many_renewals} times, one election {one_renewals}"
    );
    assert!(held.iter().all(|l| l.is_leading()));
}

/// `waiters` candidates spread over `connections` backends (so many waiters cost few
/// connections and leases) queue behind one leader; one resign wakes exactly one of them, with
/// one watch event among all, and the next in line leads.
pub async fn check_one_resign_wakes_one_of_many_waiters(
    url: &str,
    waiters: usize,
    connections: usize,
) {
    let name = unique("many");
    // Queueing this many candidates from one test process keeps its runtime busy for seconds
    // on a small host (on ZooKeeper every one of them lists the queue), which a 2 s lease may
    // not outlive; this check is about who a resign wakes, so the leases are long.
    let long = config().with_ttl(Duration::from_secs(10));
    let leader_backend = Backend::connect(url).await.unwrap();
    let leader = Election::new(&leader_backend, &name, long.clone())
        .unwrap()
        .campaign("leader")
        .await
        .unwrap();
    let mut backends = Vec::new();
    for _ in 0..connections {
        backends.push(Backend::connect(url).await.unwrap());
    }
    let mut candidacies = Vec::new();
    for i in 0..waiters {
        let election = Election::new(&backends[i % connections], &name, long.clone()).unwrap();
        candidacies.push(election.candidacy(&format!("w{i}")).unwrap());
    }
    settled(&backends, waiters).await;
    let observer = Election::new(&leader_backend, &name, config()).unwrap();
    assert_eq!(observer.participants().await.unwrap().len(), waiters + 1);
    let wakeups = |b: &[Backend]| b.iter().map(|b| b.stats().wakeups).sum::<u64>();
    let events = |b: &[Backend]| b.iter().map(|b| b.stats().watch_events).sum::<u64>();
    let (wakeups_before, events_before) = (wakeups(&backends), events(&backends));
    // The next in line is whoever queued first, in the backend's order.
    let next_in_line = observer.participants().await.unwrap()[1].id.clone();
    let index: usize = next_in_line.trim_start_matches('w').parse().unwrap();
    leader.resign().await;
    let first = within(
        "the next waiter leads",
        Duration::from_secs(5),
        candidacies[index].next(),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        wakeups(&backends) - wakeups_before,
        1,
        "one resign, one waiter woken"
    );
    assert_eq!(
        events(&backends) - events_before,
        1,
        "one watch event among all waiters"
    );
    first.resign().await;
    for candidacy in candidacies {
        candidacy.resign().await;
    }
}

/// Waits until every one of `waiters` candidates on `backends` watches the entry ahead of it:
/// from then on the queue is still until somebody leaves it.
pub async fn settled(backends: &[Backend], waiters: usize) {
    let watching = || {
        backends
            .iter()
            .map(|b| b.stats().predecessor_watches)
            .sum::<u64>()
    };
    within("every waiter watches", Duration::from_secs(60), async {
        while watching() < waiters as u64 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

pub async fn check_one_resign_wakes_exactly_one_waiter(url: &str, waiters: usize) {
    let name = unique("herd");
    let leader_backend = Backend::connect(url).await.unwrap();
    let leader = Election::new(&leader_backend, &name, config())
        .unwrap()
        .campaign("leader")
        .await
        .unwrap();
    let mut backends = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..waiters {
        let backend = Backend::connect(url).await.unwrap();
        let election = Election::new(&backend, &name, config()).unwrap();
        tasks.push(tokio::spawn(async move {
            election.campaign(&format!("w{i}")).await
        }));
        backends.push(backend);
    }
    settled(&backends, waiters).await;
    let before: u64 = backends.iter().map(|b| b.stats().wakeups).sum();
    let events_before: u64 = backends.iter().map(|b| b.stats().watch_events).sum();
    leader.resign().await;
    within("one waiter wins", Duration::from_secs(3), async {
        while !tasks.iter().any(|t| t.is_finished()) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after: u64 = backends.iter().map(|b| b.stats().wakeups).sum();
    let events_after: u64 = backends.iter().map(|b| b.stats().watch_events).sum();
    assert_eq!(after - before, 1, "one resign must wake exactly one waiter");
    assert_eq!(
        events_after - events_before,
        1,
        "exactly one watch event among all waiters"
    );
    assert_eq!(tasks.iter().filter(|t| t.is_finished()).count(), 1);
    for task in tasks {
        task.abort();
    }
}

pub async fn check_abandoned_campaign_leaves_the_queue(url: &str) {
    let a_backend = Backend::connect(url).await.unwrap();
    let b_backend = Backend::connect(url).await.unwrap();
    let name = unique("abandoned");
    let a = Election::new(&a_backend, &name, config()).unwrap();
    let b = Election::new(&b_backend, &name, config()).unwrap();
    let a_lead = a.campaign("a").await.unwrap();
    let gave_up = tokio::time::timeout(Duration::from_millis(300), b.campaign("b")).await;
    assert!(gave_up.is_err(), "b cannot win while a leads");
    // b leaves the queue when its campaign is dropped (the removal runs in the background), so
    // once a resigns nobody leads. Had b stayed queued, its backend would keep its entry alive
    // and b would lead.
    queued(&a, 1).await;
    a_lead.resign().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(a.leader().await.unwrap(), None);
}

pub async fn check_requeue_resigning_a_term_campaigns_again(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    let election =
        Election::new(&backend, &unique("stepdown"), config().with_requeue(true)).unwrap();
    let mut candidacy = election.candidacy("a").unwrap();
    let first = candidacy.next().await.unwrap();
    let first_token = first.token();
    // With requeue, resigning one term of office keeps the candidacy going.
    first.resign().await;
    let second = within("next term", Duration::from_secs(3), candidacy.next())
        .await
        .unwrap();
    assert!(second.token() > first_token);
    assert!(second.is_leading());
    // Resigning the candidacy ends everything.
    candidacy.resign().await;
    within("no leader", Duration::from_secs(2), async {
        while election.leader().await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(!second.is_leading());
}

/// Backend prefix `P/x` with election `e`, and prefix `P` with election `x`: two elections
/// whose names nest must never see each other's candidates.
#[allow(dead_code)] // etcd's prefixes only
pub async fn check_nested_prefixes_are_independent(url: &str) {
    let outer_name = unique("nest");
    let inner_url = format!("{}/{outer_name}", url.trim_end_matches('/'));
    let outer_backend = Backend::connect(url).await.unwrap();
    let inner_backend = Backend::connect(&inner_url).await.unwrap();
    let outer = Election::new(&outer_backend, &outer_name, config()).unwrap();
    let inner = Election::new(&inner_backend, "e", config()).unwrap();
    let inner_lead = within(
        "inner campaign",
        Duration::from_secs(3),
        inner.campaign("inner"),
    )
    .await
    .unwrap();
    // The outer election has no leader: the inner one's key is not its candidate.
    assert_eq!(outer.leader().await.unwrap(), None);
    let outer_lead = within(
        "outer campaign",
        Duration::from_secs(3),
        outer.campaign("outer"),
    )
    .await
    .unwrap();
    assert!(inner_lead.is_leading() && outer_lead.is_leading());
    assert_eq!(
        inner.leader().await.unwrap(),
        Some(LeaderInfo {
            id: "inner".into(),
            token: inner_lead.token(),
            value: None,
        })
    );
    assert_eq!(
        outer.leader().await.unwrap(),
        Some(LeaderInfo {
            id: "outer".into(),
            token: outer_lead.token(),
            value: None,
        })
    );
    // A write fenced by one election's token is refused under the other election.
    let data_key = format!("/baton-test-data/{outer_name}");
    for (election, foreign) in [(&outer, inner_lead.token()), (&inner, outer_lead.token())] {
        match election.guarded_put(foreign, &data_key, "foreign").await {
            Err(Error::Fenced { token, .. }) => assert_eq!(token, foreign),
            other => panic!("{}: expected Fenced, got {other:?}", election.name()),
        }
    }
    outer
        .guarded_put(outer_lead.token(), &data_key, "outer")
        .await
        .unwrap();
    inner
        .guarded_put(inner_lead.token(), &data_key, "inner")
        .await
        .unwrap();
    // Each observer sees only its own election's leader.
    let mut outer_observer = outer.observe().await.unwrap();
    match outer_observer.next().await {
        Some(Observed::Leader(Some(leader))) => assert_eq!(leader.id, "outer"),
        other => panic!("outer observer: {other:?}"),
    }
    inner_lead.resign().await;
    outer_lead.resign().await;
    let seen = within(
        "outer observer",
        Duration::from_secs(2),
        outer_observer.next(),
    )
    .await;
    assert_eq!(
        seen,
        Some(Observed::Leader(None)),
        "the inner resign must not reach the outer observer"
    );
}

/// A leader's and its waiter's entries deleted in one step (`etcdctl del --prefix`, a shared
/// lease revoked): the waiter's own deletion wins over its predecessor's, so it never reports a
/// leadership for an entry already gone. `delete_all` deletes every entry of the election at
/// once and returns the backend's revision of that deletion.
pub async fn check_own_and_predecessor_deleted_at_once(
    url: &str,
    delete_all: impl AsyncFn(&str) -> u64,
    rounds: usize,
) {
    let leader_backend = Backend::connect(url).await.unwrap();
    let waiter_backend = Backend::connect(url).await.unwrap();
    for round in 0..rounds {
        let requeue = round % 2 == 1;
        let name = unique(&format!("both{round}"));
        let leader = Election::new(&leader_backend, &name, config()).unwrap();
        let waiter = Election::new(&waiter_backend, &name, config().with_requeue(requeue)).unwrap();
        let leadership = leader.campaign("leader").await.unwrap();
        let mut candidacy = waiter.candidacy("waiter").unwrap();
        let first = tokio::spawn(async move {
            let result = candidacy.next().await;
            (candidacy, result)
        });
        // Let the waiter queue behind the leader.
        within("the waiter queued", Duration::from_secs(5), async {
            while leader.participants().await.unwrap().len() < 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !first.is_finished(),
            "round {round}: the waiter led too soon"
        );
        let deleted_at = delete_all(&name).await;
        assert_eq!(
            within("leader's loss", Duration::from_secs(3), leadership.lost()).await,
            LossReason::EntryDeleted,
            "round {round}"
        );
        let (mut candidacy, result) = within("waiter's answer", Duration::from_secs(3), first)
            .await
            .unwrap();
        if requeue {
            // Campaigning again is right; leading on the deleted entry is not.
            let second = result.unwrap();
            assert!(
                second.token() > deleted_at,
                "round {round}: leadership with token {} for an entry deleted at {deleted_at}",
                second.token()
            );
            second.resign().await;
            candidacy.resign().await;
        } else {
            match result {
                Err(Error::CampaignLost(LossReason::EntryDeleted)) => {}
                Ok(leadership) => panic!(
                    "round {round}: leadership with token {} for an entry deleted at {deleted_at}",
                    leadership.token()
                ),
                Err(other) => panic!("round {round}: expected EntryDeleted, got {other:?}"),
            }
            // Nothing more comes from that candidacy.
            let rest = within("end", Duration::from_secs(3), candidacy.next()).await;
            assert!(rest.is_err(), "round {round}: {rest:?}");
        }
    }
}

/// The backend's history goes backwards under a requeueing leader (`rewind` restores an older
/// snapshot or wipes it, keeping the URL): the candidacy must end with
/// [`Error::TokenRegressed`] instead of campaigning with ever lower tokens, a new candidacy in
/// the same process must hear the same, nothing may panic, and no lease may be renewed for the
/// candidacies that ended.
pub async fn check_tokens_going_backwards_end_the_candidacy(url: &str, rewind: impl AsyncFnOnce()) {
    let backend = Backend::connect(url).await.unwrap();
    let name = unique("rewound");
    let election = Election::new(&backend, &name, config().with_requeue(true)).unwrap();
    let mut candidacy = election.candidacy("a").unwrap();
    let first = within("first term", Duration::from_secs(5), candidacy.next())
        .await
        .unwrap();
    let token = first.token();
    rewind().await;
    // The term ends (its lease and key are gone)...
    within(
        "loss of the first term",
        Duration::from_secs(10),
        first.lost(),
    )
    .await;
    assert!(!first.is_leading());
    // ...and the candidacy stops for good, saying why.
    let error = match within(
        "end of the candidacy",
        Duration::from_secs(15),
        candidacy.next(),
    )
    .await
    {
        Err(error) => error,
        Ok(leadership) => panic!(
            "a leadership with token {} after one with {token}",
            leadership.token()
        ),
    };
    match &error {
        Error::TokenRegressed {
            election,
            token: new,
            highest,
        } => {
            assert_eq!(election, &name);
            assert_eq!(*highest, token);
            assert!(new <= highest, "{new} > {highest}");
        }
        other => panic!("expected TokenRegressed, got {other:?}"),
    }
    let message = error.to_string();
    for needle in ["went backwards", "restored", "wiped", "fence"] {
        assert!(message.contains(needle), "{message}");
    }
    assert!(
        within("after the end", Duration::from_secs(2), candidacy.next())
            .await
            .is_err(),
        "nothing more from an ended candidacy"
    );
    // Another candidacy in this process knows the old tokens too.
    match within(
        "second candidacy",
        Duration::from_secs(5),
        election.campaign("b"),
    )
    .await
    {
        Err(Error::TokenRegressed { highest, .. }) => assert_eq!(highest, token),
        Err(other) => panic!("expected TokenRegressed, got {other:?}"),
        Ok(leadership) => panic!(
            "a leadership with token {} after one with {token}",
            leadership.token()
        ),
    }
    // The low keys are deleted.
    within("no leader", Duration::from_secs(2), async {
        while election.leader().await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // Nothing keeps renewing a lease for candidacies that are over.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let renewals = backend.stats().renewals;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(backend.stats().renewals, renewals, "renewals after the end");
}

/// A waiter in another process (its own backend connection: no token of the leader's is
/// known to it) that never led: when the backend is rewound under it, its entry goes, and the
/// entry it creates again comes out below the old one. Its candidacy ends with
/// `TokenRegressed`, as the leader's does, instead of leading on a low token unawares.
pub async fn check_a_waiter_notices_tokens_going_backwards(url: &str, rewind: impl AsyncFnOnce()) {
    let leader_backend = Backend::connect(url).await.unwrap();
    let waiter_backend = Backend::connect(url).await.unwrap();
    let name = unique("rewound-waiter");
    let config = config().with_requeue(true);
    let leader = Election::new(&leader_backend, &name, config.clone()).unwrap();
    let mut leading = leader.candidacy("a").unwrap();
    let first = within("a leads", Duration::from_secs(5), leading.next())
        .await
        .unwrap();
    let token = first.token();
    let waiter = Election::new(&waiter_backend, &name, config).unwrap();
    let mut waiting = waiter.candidacy("b").unwrap();
    within("b queues", Duration::from_secs(5), async {
        while leader.participants().await.unwrap().len() < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    rewind().await;
    match within(
        "end of b's candidacy",
        Duration::from_secs(15),
        waiting.next(),
    )
    .await
    {
        Err(Error::TokenRegressed {
            token: new,
            highest,
            ..
        }) => {
            assert!(
                highest > token,
                "b's own entry, above a's token {token}: {highest}"
            );
            assert!(new <= highest, "{new} > {highest}");
        }
        Err(other) => panic!("expected TokenRegressed, got {other:?}"),
        Ok(leadership) => panic!(
            "b led with token {} after a's {token}, its own entry above that",
            leadership.token()
        ),
    }
    drop(first);
}

/// A lease is renewed while a candidacy uses it, and no longer once the last one has ended.
pub async fn check_no_renewals_once_every_candidacy_ended(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    let election = Election::new(&backend, &unique("idle"), config()).unwrap();
    let leadership = election.campaign("a").await.unwrap();
    let before = backend.stats().renewals;
    // TTL 2 s: a renewal every 667 ms.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(backend.stats().renewals > before, "renewed while leading");
    leadership.resign().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = backend.stats().renewals;
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    assert_eq!(
        backend.stats().renewals,
        after,
        "renewals with no candidacy left"
    );
    // A later campaign gets a lease again: a new one (the old one lapsed 2 s ago), so its
    // renewals start again. A busy machine can stall the shared server for as long as this
    // 2 s lease lasts (seen with a concurrent test's private etcd starting beside a CPU-bound
    // loop): such a campaign ends with the lease, rightly, and the next one is asked for. The
    // old lease handed out again would fail every time.
    let mut attempts = 0;
    let again = loop {
        attempts += 1;
        let started = std::time::Instant::now();
        match election.campaign("a").await {
            Ok(again) => break again,
            Err(Error::CampaignLost(LossReason::LeaseExpired)) if attempts < 3 => continue,
            Err(error) => panic!(
                "campaign {attempts} after {:?}: {error} (stats {:?})",
                started.elapsed(),
                backend.stats()
            ),
        }
    };
    assert!(again.is_leading());
    within(
        "a renewal of the new lease",
        Duration::from_secs(2),
        async {
            while backend.stats().renewals == after {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        },
    )
    .await;
    again.resign().await;
}

/// After `scenario` ends the last handle that could take a term, nothing may campaign again:
/// within a second there is no leader, and over the next second the backend sees (almost) no
/// requests. A spinning requeue makes hundreds.
async fn assert_quiet_after(backend: &Backend, election: &Election, what: &str) {
    within(what, Duration::from_secs(2), async {
        while election.leader().await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = backend.stats().requests;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let requests = backend.stats().requests - before;
    assert!(
        requests <= 3,
        "{what}: {requests} requests in 1 s after it ended"
    );
    assert_eq!(election.leader().await.unwrap(), None, "{what}");
}

/// Requeue never restarts a campaign that nobody can receive: not after `campaign()` on a
/// requeue config (its `Leadership` dropped or resigned), not after dropping a queued requeue
/// `Candidacy`, not with the shutdown order "resign the term, then drop the candidacy", and not
/// when the `Candidacy` was dropped while its term went on.
pub async fn check_requeue_never_spins(url: &str) {
    let requeue = || config().with_requeue(true);
    let backend = Backend::connect(url).await.unwrap();

    let election = Election::new(&backend, &unique("spin-drop"), requeue()).unwrap();
    drop(election.campaign("a").await.unwrap());
    assert_quiet_after(&backend, &election, "campaign() then drop").await;

    let election = Election::new(&backend, &unique("spin-resign"), requeue()).unwrap();
    election.campaign("a").await.unwrap().resign().await;
    assert_quiet_after(&backend, &election, "campaign() then resign").await;

    let election = Election::new(&backend, &unique("spin-queued"), requeue()).unwrap();
    let holder = election.campaign("holder").await.unwrap();
    let queued = election.candidacy("queued").unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(queued);
    tokio::time::sleep(Duration::from_millis(200)).await;
    holder.resign().await;
    assert_quiet_after(&backend, &election, "queued candidacy dropped").await;

    let election = Election::new(&backend, &unique("spin-order"), requeue()).unwrap();
    let mut candidacy = election.candidacy("a").unwrap();
    let leadership = candidacy.next().await.unwrap();
    leadership.resign().await;
    drop(candidacy);
    assert_quiet_after(
        &backend,
        &election,
        "resign the term, then drop the candidacy",
    )
    .await;

    let election = Election::new(&backend, &unique("spin-held"), requeue()).unwrap();
    let mut candidacy = election.candidacy("a").unwrap();
    let leadership = candidacy.next().await.unwrap();
    drop(candidacy);
    // The term goes on without its candidacy...
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(leadership.is_leading());
    assert_eq!(
        election.leader().await.unwrap().map(|l| l.token),
        Some(leadership.token())
    );
    // ...and ends for good with its leadership.
    drop(leadership);
    assert_quiet_after(&backend, &election, "candidacy dropped while leading").await;
}

/// Fenced get, delete and compare-and-swap: they run only while the token leads, a lost
/// compare is reported (with the value that made it fail), and keys inside baton's candidate
/// entries, relative keys and empty keys are refused before anything is sent.
pub async fn check_fenced_operations(url: &str) {
    use baton::FencedTxn;
    let backend = Backend::connect(url).await.unwrap();
    let name = unique("fenced-ops");
    let election = Election::new(&backend, &name, config()).unwrap();
    let counter = format!("/baton-data/{name}/counter");
    let a = election.campaign("a").await.unwrap();
    assert_eq!(a.fenced_get(&counter).await.unwrap(), None);
    // Read-modify-write: create if absent, then increment with compare-and-swap.
    let created = a
        .fenced_txn(
            FencedTxn::new()
                .when_value(&counter, None)
                .then_put(&counter, "1"),
        )
        .await
        .unwrap();
    assert!(created.succeeded);
    let stale_cas = FencedTxn::new()
        .when_value(&counter, Some(b"0"))
        .then_put(&counter, "1")
        .otherwise_get(&counter);
    let refused = a.fenced_txn(stale_cas).await.unwrap();
    assert!(!refused.succeeded);
    assert_eq!(refused.values, vec![Some(b"1".to_vec())]);
    let cas = FencedTxn::new()
        .when_value(&counter, Some(b"1"))
        .then_put(&counter, "2")
        .then_get(&counter);
    let done = a.fenced_txn(cas).await.unwrap();
    assert!(done.succeeded);
    assert_eq!(done.values, vec![Some(b"2".to_vec())]);
    assert_eq!(a.fenced_get(&counter).await.unwrap(), Some(b"2".to_vec()));
    // Keys baton owns are refused, and nothing changes in the election.
    for bad in [
        format!("{}/{name}/@candidates/x", "/baton-data"),
        format!("/anything/{name}/@candidates"),
        "relative".to_string(),
        String::new(),
    ] {
        match a.guarded_put(&bad, "x").await {
            Err(Error::InvalidKey { .. }) => {}
            other => panic!("{bad:?}: {other:?}"),
        }
        match election.guarded_put(a.token(), &bad, "x").await {
            Err(Error::InvalidKey { .. }) => {}
            other => panic!("{bad:?} by token: {other:?}"),
        }
    }
    assert_eq!(election.leader().await.unwrap().unwrap().token, a.token());
    assert!(a.fenced_delete(&counter).await.unwrap());
    assert!(!a.fenced_delete(&counter).await.unwrap());
    // Once a successor leads, every operation of the old token is fenced.
    let old_token = a.token();
    let mut candidacy = election.candidacy("b").unwrap();
    a.resign().await;
    let b = within("b leads", Duration::from_secs(3), candidacy.next())
        .await
        .unwrap();
    b.guarded_put(&counter, "from b").await.unwrap();
    let stale = FencedTxn::new().then_put(&counter, "stale");
    match election.fenced_txn(old_token, stale).await {
        Err(Error::Fenced { token, .. }) => assert_eq!(token, old_token),
        other => panic!("stale token: {other:?}"),
    }
    assert_eq!(
        b.fenced_get(&counter).await.unwrap(),
        Some(b"from b".to_vec())
    );
}

/// Fencing by token admits only the leader's token: a waiter's entry revision (which
/// `participants` shows) is refused like a stale one, and so are tokens no entry ever had.
pub async fn check_a_waiters_token_is_fenced(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    let name = unique("waiter-token");
    let election = Election::new(&backend, &name, config()).unwrap();
    let key = format!("/baton-data/{name}/x");
    let leader = election.campaign("a").await.unwrap();
    let waiter = election.candidacy("b").unwrap();
    queued(&election, 2).await;
    let participants = election.participants().await.unwrap();
    let waiters_token = participants[1].token;
    for token in [waiters_token, 0, i64::MAX as u64, u64::MAX] {
        match election.guarded_put(token, &key, "x").await {
            Err(Error::Fenced { .. }) => {}
            other => panic!("token {token}: {other:?}"),
        }
    }
    election
        .guarded_put(leader.token(), &key, "x")
        .await
        .unwrap();
    drop(waiter);
    leader.resign().await;
}

/// `Backend::close` is final: a requeueing candidacy does not campaign again under a new
/// lease, observers end, and campaigns started afterwards fail without spinning.
pub async fn check_close_is_final(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    let watcher = Backend::connect(url).await.unwrap();
    let name = unique("close");
    let election = Election::new(&backend, &name, config().with_requeue(true)).unwrap();
    let outside = Election::new(&watcher, &name, config()).unwrap();
    let mut observer = election.observe().await.unwrap();
    assert_eq!(observer.next().await, Some(Observed::Leader(None)));
    let mut candidacy = election.candidacy("a").unwrap();
    let leadership = candidacy.next().await.unwrap();
    backend.close().await;
    within("lost", Duration::from_secs(1), leadership.lost()).await;
    match within("next", Duration::from_secs(3), candidacy.next()).await {
        Err(Error::Closed) => {}
        other => panic!("a candidacy campaigned again after close: {other:?}"),
    }
    assert_eq!(outside.leader().await.unwrap(), None);
    // The observer ends (what it saw until then may follow).
    within("observer ends", Duration::from_secs(3), async {
        while observer.next().await.is_some() {}
    })
    .await;
    assert!(matches!(election.observe().await, Err(Error::Closed)));
    assert!(matches!(
        within("campaign", Duration::from_secs(3), election.campaign("b")).await,
        Err(Error::Closed)
    ));
    let mut late = election.candidacy("c").unwrap();
    assert!(matches!(
        within("late candidacy", Duration::from_secs(3), late.next()).await,
        Err(Error::Closed)
    ));
    let before = backend.stats().requests;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(backend.stats().requests, before, "requests after close");
    assert_eq!(outside.leader().await.unwrap(), None);
}

/// A runner whose id a live candidate already uses waits (it requeues) rather than failing,
/// and runs its job once that candidate is gone.
pub async fn check_runner_with_a_duplicate_id_waits(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    let election = Election::new(&backend, &unique("runner-dup"), config()).unwrap();
    let holder = election.campaign("same").await.unwrap();
    let (ran_tx, ran) = tokio::sync::oneshot::channel::<u64>();
    let ran_tx = std::sync::Mutex::new(Some(ran_tx));
    let runner = election.runner("same").run(
        move |leadership| {
            if let Some(tx) = ran_tx.lock().unwrap().take() {
                let _ = tx.send(leadership.token());
            }
            async {}
        },
        std::future::pending(),
    );
    let task = tokio::spawn(runner);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!task.is_finished(), "{:?}", task.await);
    let old_token = holder.token();
    holder.resign().await;
    let token = within("the runner leads", Duration::from_secs(5), ran)
        .await
        .unwrap();
    assert!(token > old_token);
    within("the runner returns", Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
}

/// A leader value (say, an address) is published with the candidacy; `participants` lists the
/// queue in order; a campaign with a timeout gives up and leaves the queue.
pub async fn check_leader_value_participants_and_campaign_timeout(url: &str) {
    use baton::CandidateOptions;
    let backend = Backend::connect(url).await.unwrap();
    let election = Election::new(&backend, &unique("value"), config()).unwrap();
    let with_value = |v: &str| CandidateOptions::default().with_value(v);
    let a = election
        .campaign_with("a", with_value("10.0.0.1:8080"))
        .await
        .unwrap();
    let leader = election.leader().await.unwrap().unwrap();
    assert_eq!(leader.value.as_deref(), Some("10.0.0.1:8080"));
    assert_eq!(leader.token, a.token());
    let b = election.candidacy("b").unwrap();
    queued(&election, 2).await;
    let c = election
        .candidacy_with("c", with_value("multi\nline"))
        .unwrap();
    queued(&election, 3).await;
    let participants = election.participants().await.unwrap();
    let ids: Vec<&str> = participants.iter().map(|p| p.id.as_str()).collect();
    assert_eq!(ids, ["a", "b", "c"]);
    assert_eq!(participants[1].value, None);
    assert_eq!(participants[2].value.as_deref(), Some("multi\nline"));
    // A campaign that cannot win within its timeout gives up and leaves the queue.
    let started = std::time::Instant::now();
    let timeout = CandidateOptions::default().with_campaign_timeout(Duration::from_millis(300));
    match election.campaign_with("d", timeout).await {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(2));
    // d's entry is removed in the background.
    queued(&election, 3).await;
    drop((b, c));
    a.resign().await;
}

/// Two live candidates with the same id: the second is refused with `DuplicateId` (with
/// requeue it waits, and wins once the first is gone); the id is free again after a resign.
pub async fn check_duplicate_ids_are_refused(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    let other = Backend::connect(url).await.unwrap();
    let name = unique("dup");
    let election = Election::new(&backend, &name, config()).unwrap();
    let elsewhere = Election::new(&other, &name, config()).unwrap();
    let first = election.campaign("same").await.unwrap();
    match within(
        "duplicate",
        Duration::from_secs(3),
        elsewhere.campaign("same"),
    )
    .await
    {
        Err(error @ Error::DuplicateId { .. }) => {
            assert!(error.to_string().contains("\"same\""), "{error}");
        }
        other => panic!("expected DuplicateId, got {other:?}"),
    }
    // The same process, too.
    assert!(matches!(
        election.campaign("same").await,
        Err(Error::DuplicateId { .. })
    ));
    assert_eq!(election.participants().await.unwrap().len(), 1);
    // With requeue the second waits for the id to be free, then wins.
    let requeue = Election::new(&other, &name, config().with_requeue(true)).unwrap();
    let mut second = requeue.candidacy("same").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.resign().await;
    let won = within("second wins", Duration::from_secs(5), second.next())
        .await
        .unwrap();
    assert!(won.is_leading());
    second.resign().await;
    // Free again: a plain campaign with the id succeeds.
    election.campaign("same").await.unwrap().resign().await;
}

/// The callback runner: the job runs while leading and is dropped the moment leadership is
/// lost (before `on_stopped_leading`), the runner campaigns again and reruns it with a larger
/// token, `on_new_leader` sees every change, and shutdown resigns.
pub async fn check_runner_callbacks(url: &str, delete_leader_key: impl AsyncFnOnce(&str)) {
    use baton::Stopped;
    use std::sync::{Arc, Mutex};
    let backend = Backend::connect(url).await.unwrap();
    let name = unique("runner");
    let election = Election::new(&backend, &name, config()).unwrap();
    let events: Arc<Mutex<Vec<String>>> = Arc::default();
    let (tokens_tx, mut tokens) = tokio::sync::mpsc::unbounded_channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    /// Records when the job's future is dropped.
    struct Dropped(Arc<Mutex<Vec<String>>>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.lock().unwrap().push("job dropped".into());
        }
    }
    let (seen, stopped, in_job) = (events.clone(), events.clone(), events.clone());
    let runner = election
        .runner("r")
        .on_new_leader(move |leader| {
            let text = leader.map_or("none".to_string(), |l| format!("leader {}", l.id));
            seen.lock().unwrap().push(text);
        })
        .on_stopped_leading(move |why| stopped.lock().unwrap().push(format!("{why:?}")));
    let task = tokio::spawn(runner.run(
        move |leadership| {
            let tokens_tx = tokens_tx.clone();
            let guard = Dropped(in_job.clone());
            async move {
                let _guard = guard;
                tokens_tx.send(leadership.token()).unwrap();
                std::future::pending::<()>().await
            }
        },
        async {
            let _ = stop_rx.await;
        },
    ));
    let first = within("first term", Duration::from_secs(5), tokens.recv())
        .await
        .unwrap();
    delete_leader_key(&name).await;
    let second = within("second term", Duration::from_secs(5), tokens.recv())
        .await
        .unwrap();
    assert!(second > first);
    stop_tx.send(()).unwrap();
    within("runner returns", Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(election.leader().await.unwrap(), None);
    let events = events.lock().unwrap().clone();
    let lost = format!("{:?}", Stopped::Lost(LossReason::EntryDeleted));
    let at = |what: &str| events.iter().position(|e| e == what);
    let (dropped, lost_at) = (at("job dropped").unwrap(), at(&lost).unwrap());
    assert!(dropped < lost_at, "{events:?}");
    assert!(
        events.contains(&format!("{:?}", Stopped::Shutdown)),
        "{events:?}"
    );
    assert!(events.iter().any(|e| e == "leader r"), "{events:?}");
}

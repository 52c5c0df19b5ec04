//! Shard ownership checks, run against every backend with the rest of the suite.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton::shards::{ReleaseReason, ShardConfig, ShardEvent, ShardMember, ShardSet};
use baton::{Backend, Error, Leadership};

use super::{config, unique, within, BackendUnderTest};

/// Who acts on each shard now, across every member of the test: the in-process stand-in for a
/// fenced register per shard. A member enters a shard on `Acquired` and leaves it before it
/// drops the leadership, so two entries at once would be two acting owners.
#[derive(Default)]
struct Ledger {
    acting: HashMap<String, (String, u64)>,
    /// The highest token seen per shard.
    tokens: HashMap<String, u64>,
    violations: Vec<String>,
    /// Members asked to leave (each test has its own ledger, so tests that use the same member
    /// ids in one process do not ask each other's members to leave).
    leaving: Vec<String>,
}

impl Ledger {
    fn acquire(&mut self, shard: &str, id: &str, token: u64) {
        if let Some((other, other_token)) = self.acting.get(shard) {
            self.violations.push(format!(
                "shard {shard}: {id} acquired with token {token} while {other} acts with {other_token}"
            ));
        }
        let highest = self.tokens.entry(shard.to_string()).or_default();
        if token <= *highest {
            self.violations
                .push(format!("shard {shard}: token {token} not above {highest}"));
        }
        *highest = token;
        self.acting
            .insert(shard.to_string(), (id.to_string(), token));
    }

    fn release(&mut self, shard: &str, id: &str) {
        if self.acting.get(shard).is_some_and(|(owner, _)| owner == id) {
            self.acting.remove(shard);
        }
    }

    fn owners(&self) -> BTreeMap<String, String> {
        self.acting
            .iter()
            .map(|(shard, (id, _))| (shard.clone(), id.clone()))
            .collect()
    }
}

/// A member that does what a well-behaved user does: acts on a shard from `Acquired` until a
/// `Released`, then stops and drops the leadership. Ends when the member's events end.
fn drive(mut member: ShardMember, ledger: Arc<Mutex<Ledger>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let id = member.id().to_string();
        let mut held: HashMap<String, Leadership> = HashMap::new();
        let mut leaving = false;
        loop {
            let event = if leaving {
                member.next().await
            } else {
                tokio::select! {
                    event = member.next() => event,
                    // The test asks the member to leave by listing it in the ledger.
                    _ = wait_leave(&ledger, &id) => {
                        member.leave();
                        leaving = true;
                        continue;
                    }
                }
            };
            let Some(event) = event else { break };
            match event {
                ShardEvent::Acquired {
                    shard,
                    token,
                    leadership,
                } => {
                    assert_eq!(leadership.token(), token);
                    ledger.lock().unwrap().acquire(&shard, &id, token);
                    held.insert(shard, leadership);
                }
                ShardEvent::Released { shard, reason } => {
                    // Stop acting first, then give the shard up.
                    ledger.lock().unwrap().release(&shard, &id);
                    let leadership = held.remove(&shard);
                    if matches!(reason, ReleaseReason::Rebalanced | ReleaseReason::Leaving) {
                        assert!(leadership.is_some(), "{id}: {reason} for {shard} not held");
                    }
                    drop(leadership);
                }
            }
        }
        assert!(held.is_empty(), "{id} ended holding {:?}", held.keys());
    })
}

async fn wait_leave(ledger: &Arc<Mutex<Ledger>>, id: &str) {
    loop {
        if ledger.lock().unwrap().leaving.iter().any(|l| l == id) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn shard_config() -> ShardConfig {
    ShardConfig {
        election: config(),
        settle: Duration::from_millis(300),
        poll: Duration::from_millis(100),
    }
}

/// Waits until every shard has exactly the owner the assignment over `members` gives it.
async fn settled(ledger: &Arc<Mutex<Ledger>>, names: &[String], members: &[String]) {
    let expected: BTreeMap<String, String> = names
        .iter()
        .cloned()
        .zip(
            baton::shards::assign(names, members)
                .into_iter()
                .map(|o| members[o.unwrap()].clone()),
        )
        .collect();
    within(
        &format!("{} shards settled over {members:?}", names.len()),
        Duration::from_secs(60),
        async {
            loop {
                if ledger.lock().unwrap().owners() == expected {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        },
    )
    .await;
    // Counts differ by at most one.
    let mut counts: HashMap<&String, usize> = HashMap::new();
    for owner in expected.values() {
        *counts.entry(owner).or_default() += 1;
    }
    let (min, max) = (counts.values().min(), counts.values().max());
    assert!(max.unwrap() - min.unwrap() <= 1, "{counts:?}");
}

fn moved(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> usize {
    a.iter()
        .filter(|(shard, owner)| b.get(*shard) != Some(owner))
        .count()
}

/// 3 members × 256 shards: every shard owned once, evenly; a fourth member joins and takes
/// about a quarter, moving nothing else; it leaves and its shards go back. No shard ever has
/// two acting owners, tokens per shard strictly increase, the status matches, and renewals
/// stay those of one lease per member.
pub async fn check_shards_spread_and_move_little(url: &str) {
    let group = unique("shards");
    let names = baton::shards::numbered(256);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    // Fixed ids (the group alone is unique per run): which shards a join moves depends only on
    // the ids, so the figures below are the same every run. With ids made from the unique group
    // name, 1 group in 3,000 moved more than 80 and the test failed by chance.
    let ids: Vec<String> = (0..4).map(|i| format!("spread-m{i}")).collect();
    let mut backends = Vec::new();
    let mut drivers = Vec::new();
    for id in &ids[..3] {
        let backend = Backend::connect(url).await.unwrap();
        let member = ShardMember::join(&backend, &group, id, ShardSet::Count(256), shard_config())
            .await
            .unwrap();
        drivers.push(drive(member, ledger.clone()));
        backends.push(backend);
    }
    settled(&ledger, &names, &ids[..3]).await;
    let three = ledger.lock().unwrap().owners();

    // The status reads the same owners, with their tokens.
    let status = ShardMember::status(&backends[0], &group, None)
        .await
        .unwrap();
    assert_eq!(status.shards.len(), 256);
    {
        let ledger = ledger.lock().unwrap();
        for (i, shard) in status.shards.iter().enumerate() {
            assert_eq!(shard.shard, serde_json::json!(i));
            let owner = shard.owner.as_ref().expect("owned");
            assert_eq!(
                ledger.acting.get(&i.to_string()),
                Some(&(owner.id.clone(), owner.token))
            );
        }
    }

    // Renewals: one lease per member, whatever the number of shards (TTL 2 s: a renewal every
    // 667 ms, about 3 in 2 s).
    let before: Vec<u64> = backends.iter().map(|b| b.stats().renewals).collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (backend, before) in backends.iter().zip(before) {
        let renewals = backend.stats().renewals - before;
        assert!(renewals <= 5, "{renewals} renewals in 2 s for 256 shards");
    }

    // A fourth member joins.
    let backend = Backend::connect(url).await.unwrap();
    let member = ShardMember::join(
        &backend,
        &group,
        &ids[3],
        ShardSet::Count(256),
        shard_config(),
    )
    .await
    .unwrap();
    drivers.push(drive(member, ledger.clone()));
    backends.push(backend);
    settled(&ledger, &names, &ids).await;
    let four = ledger.lock().unwrap().owners();
    let joined = moved(&three, &four);
    let to_newcomer = four.values().filter(|o| **o == ids[3]).count();
    // A quarter goes to the newcomer; balancing may move a few more between the others (69 in
    // all with these ids).
    assert_eq!(to_newcomer, 64);
    assert!(joined <= 64 + 16, "a join moved {joined} of 256");

    // It leaves: its shards go back, and its event stream ends.
    ledger.lock().unwrap().leaving.push(ids[3].clone());
    within(
        "the leaver ends",
        Duration::from_secs(30),
        drivers.pop().unwrap(),
    )
    .await
    .unwrap();
    settled(&ledger, &names, &ids[..3]).await;
    let back = ledger.lock().unwrap().owners();
    assert_eq!(
        moved(&four, &back),
        joined,
        "a leave moves the leaver's shards"
    );

    let violations = ledger.lock().unwrap().violations.clone();
    assert!(violations.is_empty(), "{violations:#?}");
    for backend in backends {
        backend.close().await;
    }
    for driver in drivers {
        within("members end on close", Duration::from_secs(30), driver)
            .await
            .unwrap();
    }
}

/// Bad input to `join` and `status` fails with a clear error.
pub async fn check_shards_bad_input(url: &str) {
    let backend = Backend::connect(url).await.unwrap();
    let group = unique("shards-bad");
    let join = |set: ShardSet, group: String, id: &'static str| {
        let backend = backend.clone();
        async move { ShardMember::join(&backend, &group, id, set, shard_config()).await }
    };
    let message = |r: Result<ShardMember, Error>| r.expect_err("refused").to_string();
    assert!(message(join(ShardSet::Count(0), group.clone(), "a").await).contains("at least one"));
    assert!(message(
        join(
            ShardSet::Names(vec!["x".into(), "x".into()]),
            group.clone(),
            "a"
        )
        .await
    )
    .contains("repeated"));
    assert!(message(join(ShardSet::Count(4), "a/b".into(), "a").await).contains("'/'"));
    assert!(message(join(ShardSet::Count(4), group.clone(), "").await).contains("empty"));
    // A second member with a live member's id.
    let first = join(ShardSet::Count(4), group.clone(), "same")
        .await
        .unwrap();
    within("the member is listed", Duration::from_secs(10), async {
        while ShardMember::members(&backend, &group).await.unwrap() != ["same"] {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let error = join(ShardSet::Count(4), group.clone(), "same")
        .await
        .err()
        .unwrap();
    assert!(matches!(error, Error::DuplicateId { .. }), "{error}");
    // A member serving another shard set would leave shards unowned: refused.
    let error = join(ShardSet::Count(8), group.clone(), "other")
        .await
        .expect_err("another shard set");
    assert!(error.to_string().contains("differs"), "{error}");
    // Two members joining at the same moment with different sets may both pass the check at
    // join: then the one that joined later leaves on its own, saying why.
    let race = unique("shards-race");
    let (a, b) = tokio::join!(
        join(ShardSet::Count(4), race.clone(), "first"),
        join(ShardSet::Count(8), race.clone(), "second")
    );
    match (a, b) {
        (Ok(mut a), Ok(mut b)) => {
            async fn until_end(member: &mut ShardMember) {
                while let Some(event) = member.next().await {
                    drop(event);
                }
            }
            let a_ended = within("one of the two leaves", Duration::from_secs(20), async {
                tokio::select! {
                    _ = until_end(&mut a) => true,
                    _ = until_end(&mut b) => false,
                }
            })
            .await;
            let (ended, stays) = if a_ended { (&a, &b) } else { (&b, &a) };
            let why = ended.error().expect("why it left");
            assert!(why.contains("joined first"), "{why}");
            assert_eq!(stays.error(), None);
            within("the leaver is gone", Duration::from_secs(10), async {
                while ShardMember::members(&backend, &race).await.unwrap() != [stays.id()] {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
            .await;
        }
        (a, b) => {
            // One saw the other at join and was refused.
            let error = a.err().or(b.err()).unwrap();
            assert!(error.to_string().contains("differs"), "{error}");
        }
    }
    // Group names cannot hold ':', and plain elections cannot take a group's names.
    assert!(message(join(ShardSet::Count(4), "a:b".into(), "a").await).contains("':'"));
    for name in [
        baton::shards::members_election(&group),
        baton::shards::shard_election(&group, "0"),
    ] {
        let error = baton::Election::new(&backend, &name, config()).unwrap_err();
        assert!(error.to_string().contains("reserved"), "{error}");
    }
    // Status of a group nobody serves needs the shard count.
    let error = ShardMember::status(&backend, &unique("nobody"), None)
        .await
        .unwrap_err();
    assert!(error.to_string().contains("no live member"), "{error}");
    let status = ShardMember::status(&backend, &unique("nobody"), Some(ShardSet::Count(2)))
        .await
        .unwrap();
    assert!(status.shards.iter().all(|s| s.owner.is_none()));
    drop(first);
    backend.close().await;
}

/// A shard lost behind the member's back (its entry deleted): the holder hears of it, and the
/// member campaigns for the shard again only once the holder has let go of the old term (its
/// work may still be stopping), then with a higher token.
pub async fn check_shards_lost_waits_for_the_holder(under_test: &impl BackendUnderTest) {
    let backend = Backend::connect(&under_test.url()).await.unwrap();
    let group = unique("shards-lost");
    let mut member =
        ShardMember::join(&backend, &group, "solo", ShardSet::Count(1), shard_config())
            .await
            .unwrap();
    let Some(ShardEvent::Acquired {
        token, leadership, ..
    }) = within("acquired", Duration::from_secs(10), member.next()).await
    else {
        panic!("expected an acquisition");
    };
    under_test
        .delete_leader_entry(&baton::shards::shard_election(&group, "0"))
        .await;
    let released = within("released", Duration::from_secs(10), member.next()).await;
    assert!(
        matches!(
            released,
            Some(ShardEvent::Released {
                reason: ReleaseReason::Lost(_),
                ..
            })
        ),
        "{released:?}"
    );
    // Nothing new while the old term's holder has not let go.
    let early = tokio::time::timeout(Duration::from_secs(1), member.next()).await;
    assert!(early.is_err(), "{early:?}");
    drop(leadership);
    let Some(ShardEvent::Acquired { token: again, .. }) =
        within("acquired again", Duration::from_secs(10), member.next()).await
    else {
        panic!("expected a second acquisition");
    };
    assert!(again > token, "{again} after {token}");
    backend.close().await;
}

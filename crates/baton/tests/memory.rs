//! The conformance suite against the in-memory backend (`memory://NAME`), with its faults
//! injected through `MemoryStore`.

#[macro_use]
mod conformance;

use baton::MemoryStore;

/// One in-memory store per test: tests run in parallel, each in its own runtime.
struct MemoryUnderTest {
    name: String,
    /// Keeps the store alive between the test's backends.
    store: std::sync::OnceLock<MemoryStore>,
}

impl MemoryUnderTest {
    fn new() -> MemoryUnderTest {
        MemoryUnderTest {
            name: conformance::unique("memory"),
            store: std::sync::OnceLock::new(),
        }
    }

    fn store(&self) -> &MemoryStore {
        self.store.get_or_init(|| MemoryStore::open(&self.name))
    }
}

impl conformance::BackendUnderTest for MemoryUnderTest {
    type Rewindable = RewindableMemory;

    fn url(&self) -> String {
        self.store();
        format!("memory://{}", self.name)
    }

    async fn delete_leader_entry(&self, election: &str) {
        assert!(
            self.store().delete_leader(election),
            "no leader in {election}"
        );
    }

    async fn delete_all_entries(&self, election: &str) -> u64 {
        assert_eq!(self.store().delete_all(election), 2);
        self.store().revision()
    }

    async fn rewindable(&self) -> RewindableMemory {
        let name = conformance::unique("memory-rewind");
        let store = MemoryStore::open(&name);
        // Some history behind it: positions reach 100 before the test starts.
        let filler = baton::Backend::connect(&format!("memory://{name}"))
            .await
            .unwrap();
        let election = baton::Election::new(&filler, "filler", conformance::config()).unwrap();
        for _ in 0..50 {
            election.campaign("f").await.unwrap().resign().await;
        }
        RewindableMemory { name, store }
    }
}

struct RewindableMemory {
    name: String,
    store: MemoryStore,
}

impl conformance::Rewindable for RewindableMemory {
    fn url(&self) -> String {
        format!("memory://{}", self.name)
    }

    async fn rewind(&mut self) {
        self.store.wipe()
    }
}

conformance_suite!(MemoryUnderTest::new());

/// The in-memory store's own faults, as a library user's tests would inject them.
mod faults {
    use super::conformance;
    use baton::{Backend, Election, Error, LossReason, MemoryStore, Observed};
    use std::time::Duration;

    fn url(name: &str) -> String {
        format!("memory://{name}")
    }

    /// Unreachable: the leader's renewals fail, it loses at its local deadline (before the
    /// store expires its lease), fenced writes are refused, and observers say `Unavailable`,
    /// then the new leader once the store answers again.
    #[tokio::test]
    async fn unreachable_store_ends_leadership_before_the_lease_expires() {
        let name = conformance::unique("unreachable");
        let store = MemoryStore::open(&name);
        let backend = Backend::connect(&url(&name)).await.unwrap();
        let config = conformance::config().with_ttl(Duration::from_millis(500));
        let election = Election::new(&backend, "e", config).unwrap();
        let mut observer = election.observe().await.unwrap();
        assert_eq!(observer.next().await, Some(Observed::Leader(None)));
        let leadership = election.campaign("a").await.unwrap();
        let Some(Observed::Leader(Some(seen))) = observer.next().await else {
            panic!("no leader observed");
        };
        assert_eq!(seen.token, leadership.token());
        store.set_unreachable(true);
        assert!(matches!(
            observer.next().await,
            Some(Observed::Unavailable { .. })
        ));
        let put = leadership.guarded_put("/x", "1").await;
        assert!(matches!(put, Err(Error::Unreachable { .. })), "{put:?}");
        let reason = conformance::within("loss", Duration::from_secs(2), leadership.lost()).await;
        assert_eq!(reason, LossReason::LeaseExpired);
        // The store expires the lease after the TTL: by then the holder had stopped.
        tokio::time::sleep(Duration::from_millis(600)).await;
        store.set_unreachable(false);
        assert_eq!(observer.next().await, Some(Observed::Leader(None)));
        assert_eq!(store.value("/x"), None);
    }

    /// Observing a store that cannot be reached starts with `Unavailable`.
    #[tokio::test]
    async fn observing_an_unreachable_store_starts_unavailable() {
        let name = conformance::unique("observe-away");
        let store = MemoryStore::open(&name);
        let backend = Backend::connect(&url(&name)).await.unwrap();
        store.set_unreachable(true);
        let election = Election::new(&backend, "e", conformance::config()).unwrap();
        let mut observer = election.observe().await.unwrap();
        assert!(matches!(
            observer.next().await,
            Some(Observed::Unavailable { .. })
        ));
        store.set_unreachable(false);
        assert_eq!(observer.next().await, Some(Observed::Leader(None)));
    }

    /// A create whose reply is lost (the entry was made) is adopted by the retry, not
    /// duplicated: one entry, one leader, with requeue retrying through the loss.
    #[tokio::test]
    async fn a_lost_create_reply_is_adopted() {
        let name = conformance::unique("lost-reply");
        let store = MemoryStore::open(&name);
        let backend = Backend::connect(&url(&name)).await.unwrap();
        let election =
            Election::new(&backend, "e", conformance::config().with_requeue(true)).unwrap();
        store.lose_replies(1);
        let mut candidacy = election.candidacy("a").unwrap();
        let leadership = conformance::within("lead", Duration::from_secs(3), candidacy.next())
            .await
            .unwrap();
        let participants = election.participants().await.unwrap();
        assert_eq!(participants.len(), 1, "{participants:?}");
        assert_eq!(participants[0].token, leadership.token());
        leadership.resign().await;
        candidacy.resign().await;
    }
}

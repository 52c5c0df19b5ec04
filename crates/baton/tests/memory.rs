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

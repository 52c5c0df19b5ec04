//! The in-memory backend, `memory://NAME`: a coordination service inside this process.
//!
//! It keeps what the driver's [`Queue`] obligations ask of a server (a global revision, entries
//! bound to leases that expire on their own, deletion watches that miss nothing) in one
//! mutex-guarded state, on tokio's clock. So the candidate driver's every path runs against it
//! under tokio's paused clock, with faults injected through [`MemoryStore`]: unreachable,
//! replies lost after the change was made, entries deleted behind baton's back, history wiped.
//! Every `Backend` connected to the same name in one process shares one store, for as long as
//! any of them lives.
//!
//! It is also for users' own tests: campaign, lose, fence and observe without a server.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use baton_core::{BackendLimits, ElectionConfig};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;

use crate::backend::{BoxFuture, Connection, Fencer};
use crate::clock::Clock;
use crate::driver::{
    Fired, LeasePool, Located, OneshotWatch, PlainEntrant, Position, Queue, QueueLease, ReadPoint,
    TokenMemory,
};
use crate::election::{CandidateSpec, Command, GuardContext, LeaderInfo, Leadership, Observed};
use crate::error::{Error, Result};
use crate::fenced::{FencedCompare, FencedOp, FencedTxn, FencedTxnResponse};
use crate::lease_driver::{start_lease, LeaseHandle, LeaseTransport};
use crate::stats::Stats;

/// What in-memory leases can be: from 10 ms, in whole milliseconds.
pub(crate) const LIMITS: BackendLimits = BackendLimits {
    min_ttl: Duration::from_millis(10),
    max_ttl: Duration::from_secs(365 * 86_400),
    ttl_step: Duration::from_millis(1),
};

/// How many deletions the store remembers for watches that start in the past (like etcd's
/// history before compaction): a watch from further back is broken and the driver rechecks.
const HISTORY: usize = 4096;

/// The stores of this process by name; a store lives while a backend or handle holds it.
static STORES: Mutex<BTreeMap<String, Weak<Store>>> = Mutex::new(BTreeMap::new());

/// A candidate's entry: its election and its name there.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct MemEntry {
    election: String,
    name: String,
}

struct Record {
    name: String,
    lease: i64,
    value: String,
}

struct LeaseRecord {
    ttl: Duration,
    expires: Instant,
}

struct Deletion {
    revision: u64,
    entry: MemEntry,
    position: u64,
}

struct Watcher {
    entry: MemEntry,
    fired: oneshot::Sender<Fired<MemEntry>>,
}

/// What an observer hears of its election: its leader after each change, in order.
enum Seen {
    Leader(Option<LeaderInfo>),
    Unavailable,
}

#[derive(Default)]
struct State {
    revision: u64,
    next_lease: i64,
    leases: HashMap<i64, LeaseRecord>,
    /// Per election, its entries by position.
    elections: HashMap<String, BTreeMap<u64, Record>>,
    /// Per (election, id), the name of the entry that holds the id.
    ids: HashMap<(String, String), String>,
    deletions: VecDeque<Deletion>,
    /// Revisions at or below this are no longer in `deletions`.
    forgotten: u64,
    watchers: Vec<Watcher>,
    observers: Vec<(String, mpsc::UnboundedSender<Seen>)>,
    /// Data written through fenced transactions.
    data: BTreeMap<String, Vec<u8>>,
    unreachable: bool,
    lose_replies: u32,
}

struct Store {
    name: String,
    state: Mutex<State>,
    /// Wakes the expiry task when a lease's expiry may have moved earlier, or the store goes.
    leases_changed: Arc<Notify>,
}

impl Drop for Store {
    fn drop(&mut self) {
        self.leases_changed.notify_one();
    }
}

impl Store {
    /// The store called `name`, created (with its lease-expiry task) if none is alive.
    fn open(name: &str) -> Arc<Store> {
        let mut stores = STORES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(store) = stores.get(name).and_then(Weak::upgrade) {
            return store;
        }
        stores.retain(|_, store| store.strong_count() > 0);
        let store = Arc::new(Store {
            name: name.to_string(),
            state: Mutex::new(State::default()),
            leases_changed: Arc::new(Notify::new()),
        });
        stores.insert(name.to_string(), Arc::downgrade(&store));
        tokio::spawn(expire_leases(
            Arc::downgrade(&store),
            store.leases_changed.clone(),
        ));
        store
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The state, if the store can be reached.
    fn reach(&self, operation: &'static str) -> Result<std::sync::MutexGuard<'_, State>> {
        let state = self.lock();
        if state.unreachable {
            crate::metrics::backend_error(operation);
            return Err(self.unreachable(operation));
        }
        Ok(state)
    }

    fn unreachable(&self, operation: &'static str) -> Error {
        Error::Unreachable {
            backend: "memory",
            endpoints: self.name.clone(),
            detail: format!("the store is set unreachable (during {operation})"),
        }
    }
}

impl State {
    /// Removes the entry at `position` of `election` (and the id entry naming it) in one new
    /// revision, firing its watchers and telling observers.
    fn delete(&mut self, election: &str, position: u64) -> bool {
        let Some(record) = self
            .elections
            .get_mut(election)
            .and_then(|entries| entries.remove(&position))
        else {
            return false;
        };
        self.revision += 1;
        let entry = MemEntry {
            election: election.to_string(),
            name: record.name,
        };
        self.ids
            .retain(|(e, _), name| !(e == election && *name == entry.name));
        self.record_deletion(entry, position);
        self.tell(election);
        true
    }

    fn record_deletion(&mut self, entry: MemEntry, position: u64) {
        let (fire, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.watchers)
            .into_iter()
            .partition(|w| w.entry == entry);
        self.watchers = keep;
        for watcher in fire {
            let _ = watcher.fired.send(Fired::Deleted {
                entry: entry.clone(),
                position: Position(position),
            });
        }
        self.deletions.push_back(Deletion {
            revision: self.revision,
            entry,
            position,
        });
        while self.deletions.len() > HISTORY {
            if let Some(old) = self.deletions.pop_front() {
                self.forgotten = old.revision;
            }
        }
    }

    /// Ends lease `id` and deletes its entries, all in one revision (as etcd does).
    fn end_lease(&mut self, id: i64) {
        if self.leases.remove(&id).is_none() {
            return;
        }
        let doomed: Vec<(String, u64)> = self
            .elections
            .iter()
            .flat_map(|(election, entries)| {
                entries
                    .iter()
                    .filter(|(_, record)| record.lease == id)
                    .map(move |(position, _)| (election.clone(), *position))
            })
            .collect();
        if doomed.is_empty() {
            return;
        }
        self.revision += 1;
        for (election, position) in doomed {
            if let Some(record) = self
                .elections
                .get_mut(&election)
                .and_then(|entries| entries.remove(&position))
            {
                let entry = MemEntry {
                    election: election.clone(),
                    name: record.name,
                };
                self.ids
                    .retain(|(e, _), name| !(*e == election && *name == entry.name));
                self.record_deletion(entry, position);
                self.tell(&election);
            }
        }
    }

    /// Tells the observers of `election` its leader now (called after every change).
    fn tell(&mut self, election: &str) {
        let leader = self.leader(election);
        self.observers
            .retain(|(e, tx)| e != election || tx.send(Seen::Leader(leader.clone())).is_ok());
    }

    fn leader(&self, election: &str) -> Option<LeaderInfo> {
        let (position, record) = self.elections.get(election)?.iter().next()?;
        Some(describe(*position, record))
    }

    /// The entry of `election` at `position`, if it still exists.
    fn record(&self, election: &str, position: u64) -> Option<&Record> {
        self.elections.get(election)?.get(&position)
    }

    fn position_of(&self, entry: &MemEntry) -> Option<u64> {
        self.elections
            .get(&entry.election)?
            .iter()
            .find(|(_, record)| record.name == entry.name)
            .map(|(position, _)| *position)
    }

    /// A reply the test asked to lose (the change was made): true once per loss asked for.
    fn lose_reply(&mut self) -> bool {
        if self.lose_replies > 0 {
            self.lose_replies -= 1;
            return true;
        }
        false
    }
}

/// The store's server side of leases: ends each at its expiry, on tokio's clock.
async fn expire_leases(store: Weak<Store>, wake: Arc<Notify>) {
    loop {
        let Some(strong) = store.upgrade() else {
            return;
        };
        let next = {
            let mut state = strong.lock();
            let now = Instant::now();
            let expired: Vec<i64> = state
                .leases
                .iter()
                .filter(|(_, lease)| lease.expires <= now)
                .map(|(id, _)| *id)
                .collect();
            for id in expired {
                state.end_lease(id);
            }
            state.leases.values().map(|lease| lease.expires).min()
        };
        // Not holding the store while waiting, so it can go away (its drop wakes us).
        drop(strong);
        match next {
            Some(until) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => {}
                    _ = wake.notified() => {}
                }
            }
            None => wake.notified().await,
        }
    }
}

fn describe(position: u64, record: &Record) -> LeaderInfo {
    LeaderInfo::from_entry(position, record.value.as_bytes())
}

/// A handle on the store `memory://NAME`, for tests: inject faults and change the state behind
/// the backends' backs.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> baton::Result<()> {
/// use baton::{Backend, Election, ElectionConfig, MemoryStore};
///
/// let backend = Backend::connect("memory://doc-example").await?;
/// let election = Election::new(&backend, "cron", ElectionConfig::default())?;
/// let leadership = election.campaign("a").await?;
/// // The leader's entry is deleted behind its back (an operator's `del`):
/// MemoryStore::open("doc-example").delete_leader("cron");
/// let reason = leadership.lost().await;
/// assert_eq!(reason, baton::LossReason::EntryDeleted);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    store: Arc<Store>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("name", &self.store.name)
            .finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// The store of `memory://NAME` (created if no backend holds it yet). Must be called
    /// inside a tokio runtime.
    pub fn open(name: &str) -> MemoryStore {
        MemoryStore {
            store: Store::open(name),
        }
    }

    /// Makes every request fail as unreachable (`true`) or answer again (`false`). Leases keep
    /// expiring meanwhile, as at a real server that a partition cuts off.
    pub fn set_unreachable(&self, unreachable: bool) {
        let mut state = self.store.lock();
        state.unreachable = unreachable;
        let seen: Vec<Seen> = state
            .observers
            .iter()
            .map(|(election, _)| {
                if unreachable {
                    Seen::Unavailable
                } else {
                    Seen::Leader(state.leader(election))
                }
            })
            .collect();
        let mut seen = seen.into_iter();
        state
            .observers
            .retain(|(_, tx)| seen.next().is_some_and(|s| tx.send(s).is_ok()));
    }

    /// Makes the next `count` changing requests take effect but fail as if their reply was
    /// lost on the way back.
    pub fn lose_replies(&self, count: u32) {
        self.store.lock().lose_replies = count;
    }

    /// Deletes the leader's entry of `election` behind its back; returns whether there was one.
    pub fn delete_leader(&self, election: &str) -> bool {
        let mut state = self.store.lock();
        let first = state
            .elections
            .get(election)
            .and_then(|entries| entries.keys().next().copied());
        first.is_some_and(|position| state.delete(election, position))
    }

    /// Deletes every entry of `election` in one revision (as `etcdctl del --prefix` would).
    pub fn delete_all(&self, election: &str) -> usize {
        let mut state = self.store.lock();
        let positions: Vec<u64> = state
            .elections
            .get(election)
            .map(|entries| entries.keys().copied().collect())
            .unwrap_or_default();
        if positions.is_empty() {
            return 0;
        }
        state.revision += 1;
        for &position in &positions {
            if let Some(record) = state
                .elections
                .get_mut(election)
                .and_then(|entries| entries.remove(&position))
            {
                let entry = MemEntry {
                    election: election.to_string(),
                    name: record.name,
                };
                state
                    .ids
                    .retain(|(e, _), name| !(e == election && *name == entry.name));
                state.record_deletion(entry, position);
            }
        }
        state.tell(election);
        positions.len()
    }

    /// Breaks every deletion watch (as a connection reset or a compaction would): the
    /// candidates must find out afresh where they stand.
    pub fn break_watches(&self) {
        let watchers = std::mem::take(&mut self.store.lock().watchers);
        for watcher in watchers {
            let _ = watcher.fired.send(Fired::Broken);
        }
    }

    /// Ends every lease now, as if their TTLs had run out.
    pub fn expire_leases(&self) {
        let mut state = self.store.lock();
        let ids: Vec<i64> = state.leases.keys().copied().collect();
        for id in ids {
            state.end_lease(id);
        }
    }

    /// Wipes the store back to revision zero (a server restored from an empty backup): every
    /// entry, lease and fenced value is gone and positions start again from the bottom.
    pub fn wipe(&self) {
        let mut state = self.store.lock();
        let observers = std::mem::take(&mut state.observers);
        let watchers = std::mem::take(&mut state.watchers);
        *state = State {
            observers,
            ..State::default()
        };
        for watcher in watchers {
            let _ = watcher.fired.send(Fired::Broken);
        }
        let elections: Vec<String> = state.observers.iter().map(|(e, _)| e.clone()).collect();
        for election in elections {
            state.tell(&election);
        }
    }

    /// The store's current revision: one per change.
    pub fn revision(&self) -> u64 {
        self.store.lock().revision
    }

    /// The value a fenced transaction wrote at `key`.
    pub fn value(&self, key: &str) -> Option<Vec<u8>> {
        self.store.lock().data.get(key).cloned()
    }
}

/// A connection to an in-memory store.
pub(crate) struct MemoryBackend {
    store: Arc<Store>,
    clock: Clock,
    leases: LeasePool<MemLease>,
    tokens: TokenMemory,
    stats: Arc<Stats>,
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("store", &self.store.name)
            .finish_non_exhaustive()
    }
}

impl MemoryBackend {
    pub(crate) fn connect(name: &str) -> Result<MemoryBackend> {
        let store = Store::open(name);
        if store.lock().unreachable {
            return Err(store.unreachable("connect"));
        }
        Ok(MemoryBackend {
            store,
            clock: Clock::new(),
            leases: LeasePool::default(),
            tokens: TokenMemory::default(),
            stats: Arc::new(Stats::default()),
        })
    }

    fn fenced(&self, election: &str, token: u64, txn: &FencedTxn) -> Result<FencedTxnResponse> {
        run_fenced(&self.store, &self.stats, election, token, txn)
    }
}

/// One lease of the in-memory store.
#[derive(Debug)]
pub(crate) struct MemLease {
    id: i64,
    handle: LeaseHandle,
}

impl QueueLease for MemLease {
    fn handle(&self) -> &LeaseHandle {
        &self.handle
    }
}

/// Grants and renewals: answered at once by the store (renewals queue their answers).
struct MemLeaseTransport {
    store: Arc<Store>,
    stats: Arc<Stats>,
    id: i64,
    answers: VecDeque<Duration>,
    on_grant: Option<oneshot::Sender<i64>>,
}

impl LeaseTransport for MemLeaseTransport {
    async fn grant(&mut self, ttl: Duration) -> Result<Duration> {
        self.stats.request();
        let mut state = self.store.reach("lease grant")?;
        state.next_lease += 1;
        self.id = state.next_lease;
        state.leases.insert(
            self.id,
            LeaseRecord {
                ttl,
                expires: Instant::now() + ttl,
            },
        );
        drop(state);
        self.store.leases_changed.notify_one();
        if let Some(tx) = self.on_grant.take() {
            let _ = tx.send(self.id);
        }
        Ok(ttl)
    }

    async fn send_renewal(&mut self) -> Result<()> {
        self.stats
            .renewals
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut state = self.store.reach("lease keepalive")?;
        let answer = match state.leases.get_mut(&self.id) {
            Some(lease) => {
                lease.expires = Instant::now() + lease.ttl;
                lease.ttl
            }
            None => Duration::ZERO,
        };
        self.answers.push_back(answer);
        Ok(())
    }

    fn reopen(&mut self) {
        self.answers.clear();
    }

    async fn next_renewal(&mut self) -> Result<Duration> {
        match self.answers.pop_front() {
            Some(answer) => Ok(answer),
            None => std::future::pending().await,
        }
    }

    async fn revoke(&mut self) -> Result<()> {
        self.stats.request();
        let mut state = self.store.reach("lease revoke")?;
        state.end_lease(self.id);
        Ok(())
    }
}

impl Queue for MemoryBackend {
    type Lease = MemLease;
    type Entry = MemEntry;
    type Entrant = PlainEntrant;
    type Watch = OneshotWatch<MemEntry>;

    fn stats(&self) -> &Stats {
        &self.stats
    }

    fn tokens(&self) -> &TokenMemory {
        &self.tokens
    }

    fn leases(&self) -> &LeasePool<Self::Lease> {
        &self.leases
    }

    fn entrant(&self, spec: &CandidateSpec, serial: u64) -> PlainEntrant {
        PlainEntrant::new(spec, serial)
    }

    async fn lease(&self, config: &ElectionConfig) -> Result<Arc<MemLease>> {
        self.leases
            .get(config, async {
                let (id_tx, id_rx) = oneshot::channel();
                let transport = MemLeaseTransport {
                    store: self.store.clone(),
                    stats: self.stats.clone(),
                    id: 0,
                    answers: VecDeque::new(),
                    on_grant: Some(id_tx),
                };
                let handle = start_lease(transport, config.clone(), self.clock.clone()).await?;
                let id = id_rx.await.map_err(|_| Error::Closed)?;
                Ok(MemLease { id, handle })
            })
            .await
    }

    fn entry_name(&self, entrant: &PlainEntrant, lease: &MemLease) -> MemEntry {
        MemEntry {
            election: entrant.election.clone(),
            name: format!("{:016x}-{}", lease.id, entrant.serial),
        }
    }

    async fn create(
        &self,
        entrant: &PlainEntrant,
        entry: &MemEntry,
        lease: &MemLease,
    ) -> Result<Position> {
        self.stats.request();
        let mut state = self.store.reach("create candidate entry")?;
        if !state.leases.contains_key(&lease.id) {
            return Err(Error::Backend {
                backend: "memory",
                operation: "create candidate entry",
                detail: "requested lease not found".into(),
                retryable: true,
                source: None,
            });
        }
        if let Some(position) = state.position_of(entry) {
            let record = state.record(&entry.election, position);
            if record.is_some_and(|r| r.lease == lease.id) {
                // An earlier attempt of ours whose reply was lost: adopt it.
                return Ok(Position(position));
            }
            return Err(Error::Backend {
                backend: "memory",
                operation: "create candidate entry",
                detail: "the entry exists with another lease".into(),
                retryable: true,
                source: None,
            });
        }
        let id_key = (entrant.election.clone(), entrant.id.clone());
        if let Some(holder) = state.ids.get(&id_key) {
            return Err(Error::DuplicateId {
                election: entrant.election.clone(),
                id: entrant.id.clone(),
                entry: holder.clone(),
            });
        }
        state.revision += 1;
        let position = state.revision;
        state
            .elections
            .entry(entrant.election.clone())
            .or_default()
            .insert(
                position,
                Record {
                    name: entry.name.clone(),
                    lease: lease.id,
                    value: entrant.value.clone(),
                },
            );
        state.ids.insert(id_key, entry.name.clone());
        state.tell(&entrant.election);
        if state.lose_reply() {
            return Err(self.store.unreachable("create candidate entry"));
        }
        Ok(Position(position))
    }

    async fn locate(
        &self,
        _entrant: &PlainEntrant,
        entry: &MemEntry,
        own: Position,
    ) -> Result<Located<MemEntry>> {
        let position = own.0;
        self.stats.request();
        let state = self.store.reach("find predecessor")?;
        let Some(entries) = state.elections.get(&entry.election) else {
            return Ok(Located::Gone);
        };
        if entries.get(&position).is_none_or(|r| r.name != entry.name) {
            return Ok(Located::Gone);
        }
        let ahead = entries.range(..position).next_back().map(|(p, record)| {
            (
                MemEntry {
                    election: entry.election.clone(),
                    name: record.name.clone(),
                },
                Position(*p),
            )
        });
        Ok(Located::Exists {
            ahead,
            at: ReadPoint(state.revision),
        })
    }

    async fn confirm(&self, entry: &MemEntry, own: Position) -> Result<Option<ReadPoint>> {
        self.stats.request();
        let state = self.store.reach("get own entry")?;
        let exists = state
            .record(&entry.election, own.0)
            .is_some_and(|r| r.name == entry.name);
        Ok(exists.then_some(ReadPoint(state.revision)))
    }

    async fn watch_deletion(
        &self,
        entry: &MemEntry,
        _position: Position,
        after: ReadPoint,
    ) -> Result<OneshotWatch<MemEntry>> {
        self.stats.request();
        let mut state = self.store.reach("watch")?;
        let (tx, receiver) = oneshot::channel();
        if after.0 < state.forgotten {
            // History that far back is gone (as after a compaction): find out afresh.
            let _ = tx.send(Fired::Broken);
        } else if let Some(deletion) = state
            .deletions
            .iter()
            .find(|d| d.revision > after.0 && d.entry == *entry)
        {
            // Deleted after the read point, before the watch: replayed, not missed.
            let _ = tx.send(Fired::Deleted {
                entry: entry.clone(),
                position: Position(deletion.position),
            });
        } else {
            state.watchers.push(Watcher {
                entry: entry.clone(),
                fired: tx,
            });
        }
        Ok(OneshotWatch::new(receiver, None, self.stats.clone()))
    }

    async fn delete(&self, _entrant: &PlainEntrant, entry: &MemEntry, own: Position) -> Result<()> {
        let position = own.0;
        self.stats.request();
        let mut state = self.store.reach("delete candidate entry")?;
        if state
            .record(&entry.election, position)
            .is_some_and(|r| r.name == entry.name)
        {
            state.delete(&entry.election, position);
        }
        if state.lose_reply() {
            return Err(self.store.unreachable("delete candidate entry"));
        }
        Ok(())
    }

    async fn delete_if_on_lease(
        &self,
        _entrant: &PlainEntrant,
        entry: &MemEntry,
        lease: &MemLease,
    ) -> Result<()> {
        self.stats.request();
        let mut state = self.store.reach("delete candidate entry")?;
        if let Some(position) = state.position_of(entry) {
            if state
                .record(&entry.election, position)
                .is_some_and(|r| r.lease == lease.id)
            {
                state.delete(&entry.election, position);
            }
        }
        Ok(())
    }

    fn guard(&self, entry: &MemEntry, position: Position) -> GuardContext {
        let position = position.token();
        Arc::new(MemFencer {
            store: self.store.clone(),
            stats: self.stats.clone(),
            election: entry.election.clone(),
            position,
        })
    }
}

/// Fencing in the store: the transaction runs only while the entry at the token leads.
struct MemFencer {
    store: Arc<Store>,
    stats: Arc<Stats>,
    election: String,
    position: u64,
}

impl std::fmt::Debug for MemFencer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemFencer")
            .field("election", &self.election)
            .field("position", &self.position)
            .finish()
    }
}

impl Fencer for MemFencer {
    fn run<'a>(
        &'a self,
        election: &'a str,
        token: u64,
        txn: &'a FencedTxn,
        _limit: Duration,
    ) -> BoxFuture<'a, Result<FencedTxnResponse>> {
        debug_assert_eq!((election, token), (self.election.as_str(), self.position));
        Box::pin(async move { run_fenced(&self.store, &self.stats, election, token, txn) })
    }
}

/// Runs `txn` only if the entry at position `token` of `election` exists, atomically.
fn run_fenced(
    store: &Store,
    stats: &Stats,
    election: &str,
    token: u64,
    txn: &FencedTxn,
) -> Result<FencedTxnResponse> {
    txn.validate()?;
    stats.request();
    let mut state = store.reach("fenced transaction")?;
    // The leader's entry, not merely one at this position: a waiter's token must not pass.
    let leader = state
        .elections
        .get(election)
        .and_then(|entries| entries.keys().next().copied());
    if leader != Some(token) {
        return Err(Error::Fenced {
            election: election.to_string(),
            token,
        });
    }
    let succeeded = txn.compares.iter().all(|compare| match compare {
        FencedCompare::Value { key, value } => state.data.get(key.as_str()) == value.as_ref(),
    });
    let branch = if succeeded { &txn.then } else { &txn.otherwise };
    let mut values = Vec::new();
    for op in branch {
        match op {
            FencedOp::Put { key, value } => {
                state.data.insert(key.clone(), value.clone());
            }
            FencedOp::Delete { key } => {
                state.data.remove(key.as_str());
            }
            FencedOp::Get { key } => values.push(state.data.get(key.as_str()).cloned()),
        }
    }
    if branch.iter().any(|op| !matches!(op, FencedOp::Get { .. })) {
        state.revision += 1;
    }
    Ok(FencedTxnResponse { succeeded, values })
}

impl Connection for MemoryBackend {
    fn limits(&self) -> BackendLimits {
        LIMITS
    }

    fn stats(&self) -> crate::StatsSnapshot {
        self.stats.snapshot()
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.leases.close())
    }

    fn spawn_candidate(
        self: Arc<Self>,
        spec: CandidateSpec,
        commands_rx: mpsc::Receiver<Command>,
        commands: mpsc::Sender<Command>,
        leaderships: mpsc::Sender<Box<Result<Leadership>>>,
    ) {
        crate::driver::spawn(self, spec, commands_rx, commands, leaderships);
    }

    fn leader<'a>(&'a self, election: &'a str) -> BoxFuture<'a, Result<Option<LeaderInfo>>> {
        Box::pin(async move {
            self.stats.request();
            Ok(self.store.reach("get leader")?.leader(election))
        })
    }

    fn participants<'a>(&'a self, election: &'a str) -> BoxFuture<'a, Result<Vec<LeaderInfo>>> {
        Box::pin(async move {
            self.stats.request();
            let state = self.store.reach("get candidates")?;
            Ok(state
                .elections
                .get(election)
                .map(|entries| {
                    entries
                        .iter()
                        .map(|(position, record)| describe(*position, record))
                        .collect()
                })
                .unwrap_or_default())
        })
    }

    fn spawn_observer(
        self: Arc<Self>,
        election: String,
        tx: mpsc::Sender<Observed>,
    ) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move {
            if self.leases.is_closed() {
                return Err(Error::Closed);
            }
            let closing = self.leases.closing();
            let (seen_tx, mut seen) = mpsc::unbounded_channel();
            // A store that cannot be reached right now is not bad input: the stream starts
            // with `Unavailable` and follows once it answers.
            let first = {
                let mut state = self.store.lock();
                state.observers.push((election.clone(), seen_tx));
                (!state.unreachable).then(|| state.leader(&election))
            };
            let store = self.store.clone();
            tokio::spawn(async move {
                let mut last = first.clone();
                let said = match first {
                    Some(leader) => Observed::Leader(leader),
                    None => Observed::Unavailable {
                        reason: store.unreachable("watch").to_string(),
                    },
                };
                if tx.send(said).await.is_err() {
                    return;
                }
                let mut closing = std::pin::pin!(closing);
                loop {
                    // The stream ends with its backend (the task's end drops the sender).
                    let event = tokio::select! {
                        event = seen.recv() => event,
                        _ = closing.as_mut() => None,
                    };
                    let Some(event) = event else { return };
                    let current = match event {
                        Seen::Unavailable => {
                            last = None;
                            let reason = store.unreachable("watch").to_string();
                            if tx.send(Observed::Unavailable { reason }).await.is_err() {
                                return;
                            }
                            continue;
                        }
                        Seen::Leader(leader) => leader,
                    };
                    if last.as_ref() != Some(&current) {
                        if tx.send(Observed::Leader(current.clone())).await.is_err() {
                            return;
                        }
                        last = Some(current);
                    }
                }
            });
            Ok(())
        })
    }

    fn fenced_txn<'a>(
        &'a self,
        election: &'a str,
        token: u64,
        txn: &'a FencedTxn,
        _limit: Duration,
    ) -> BoxFuture<'a, Result<FencedTxnResponse>> {
        Box::pin(async move { self.fenced(election, token, txn) })
    }
}

/// The driver's paths under tokio's paused clock: time moves only when every task waits, so
/// each run is deterministic and takes no real time.
#[cfg(test)]
mod tests {
    use std::time::Duration;

    use baton_core::LossReason;
    use tokio::time::Instant;

    use super::MemoryStore;
    use crate::{Backend, Election, ElectionConfig, Error};

    fn config(ttl_ms: u64) -> ElectionConfig {
        ElectionConfig::default().with_ttl(Duration::from_millis(ttl_ms))
    }

    async fn connect(name: &str) -> Backend {
        Backend::connect(&format!("memory://{name}")).await.unwrap()
    }

    /// The store is cut off while A leads and B waits: A stops at its local deadline, before
    /// the store expires A's lease; B leads only after that expiry (and after the store is
    /// back), never while A may still act.
    #[tokio::test(start_paused = true)]
    async fn an_outage_ends_the_leader_before_its_lease_expires_and_the_waiter_wins_after() {
        let store = MemoryStore::open("paused-outage");
        let (a, b) = (
            connect("paused-outage").await,
            connect("paused-outage").await,
        );
        let ttl = 1_000;
        let leader = Election::new(&a, "e", config(ttl))
            .unwrap()
            .campaign("a")
            .await
            .unwrap();
        let waiter = Election::new(&b, "e", config(ttl).with_requeue(true)).unwrap();
        let mut candidacy = waiter.candidacy("b").unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let cut = Instant::now();
        store.set_unreachable(true);
        let reason = leader.lost().await;
        let lost_after = cut.elapsed();
        assert_eq!(reason, LossReason::LeaseExpired);
        // Drift 1% and margin 100 ms off the TTL, counted from the last acknowledged send,
        // which was before the cut.
        assert!(
            lost_after < Duration::from_millis(ttl - 100),
            "{lost_after:?}"
        );
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        store.set_unreachable(false);
        let next = candidacy.next().await.unwrap();
        let won_after = cut.elapsed();
        assert!(next.token() > leader.token());
        assert!(won_after > Duration::from_millis(ttl), "{won_after:?}");
        assert!(won_after > lost_after);
        next.resign().await;
        candidacy.resign().await;
    }

    /// A requeueing candidacy during a long outage retries at a bounded rate, then leads once
    /// the store answers.
    #[tokio::test(start_paused = true)]
    async fn requeue_during_an_outage_retries_at_a_bounded_rate() {
        let store = MemoryStore::open("paused-retry");
        let backend = connect("paused-retry").await;
        store.set_unreachable(true);
        let election = Election::new(&backend, "e", config(1_000).with_requeue(true)).unwrap();
        let mut candidacy = election.candidacy("a").unwrap();
        tokio::time::sleep(Duration::from_secs(10)).await;
        let requests = backend.stats().requests;
        // One attempt (a lease grant) every 200 ms: about 50 in 10 s.
        assert!((20..=80).contains(&requests), "{requests} requests in 10 s");
        store.set_unreachable(false);
        let leadership = candidacy.next().await.unwrap();
        assert!(leadership.is_leading());
        leadership.resign().await;
        candidacy.resign().await;
    }

    /// Resigning while the store cannot be reached returns promptly; the lease stops being
    /// renewed, so the entry goes with it at the store and the next candidate leads after the
    /// TTL.
    #[tokio::test(start_paused = true)]
    async fn resigning_during_an_outage_returns_promptly_and_lets_the_lease_lapse() {
        let store = MemoryStore::open("paused-resign");
        let (a, b) = (
            connect("paused-resign").await,
            connect("paused-resign").await,
        );
        let leader = Election::new(&a, "e", config(1_000))
            .unwrap()
            .campaign("a")
            .await
            .unwrap();
        store.set_unreachable(true);
        let started = Instant::now();
        leader.resign().await;
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        let renewals = a.stats().renewals;
        store.set_unreachable(false);
        let next = Election::new(&b, "e", config(1_000))
            .unwrap()
            .campaign("b")
            .await
            .unwrap();
        assert!(started.elapsed() >= Duration::from_millis(900));
        assert_eq!(
            a.stats().renewals,
            renewals,
            "renewals went on for a resigned lease"
        );
        next.resign().await;
    }

    /// Broken watches (a connection reset, a compaction) are rebuilt from a fresh read: the
    /// waiter is still woken, once, by the leader's resign, and the leader still hears of its
    /// entry being deleted.
    #[tokio::test(start_paused = true)]
    async fn broken_watches_are_rebuilt() {
        let store = MemoryStore::open("paused-broken");
        let (a, b) = (
            connect("paused-broken").await,
            connect("paused-broken").await,
        );
        let leader = Election::new(&a, "e", config(1_000))
            .unwrap()
            .campaign("a")
            .await
            .unwrap();
        let waiter = Election::new(&b, "e", config(1_000)).unwrap();
        let task = tokio::spawn(async move { waiter.campaign("b").await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        store.break_watches();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!task.is_finished(), "the waiter led on a broken watch");
        let wakeups = b.stats().wakeups;
        leader.resign().await;
        let next = task.await.unwrap().unwrap();
        assert_eq!(b.stats().wakeups, wakeups + 1);
        // The new leader's own watch was rebuilt too: a deletion behind its back is a loss.
        store.break_watches();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(store.delete_leader("e"));
        assert_eq!(next.lost().await, LossReason::EntryDeleted);
    }

    /// A create whose reply is lost is adopted (one entry), and one that fails outright
    /// without requeue reaches the caller as the error it was.
    #[tokio::test(start_paused = true)]
    async fn lost_replies_and_failed_creates() {
        let store = MemoryStore::open("paused-lost");
        let backend = connect("paused-lost").await;
        let election = Election::new(&backend, "e", config(1_000).with_requeue(true)).unwrap();
        store.lose_replies(1);
        let mut candidacy = election.candidacy("a").unwrap();
        let leadership = candidacy.next().await.unwrap();
        assert_eq!(election.participants().await.unwrap().len(), 1);
        leadership.resign().await;
        candidacy.resign().await;
        store.set_unreachable(true);
        let single = Election::new(&backend, "f", config(1_000)).unwrap();
        let error = single.campaign("a").await.unwrap_err();
        assert!(matches!(error, Error::Unreachable { .. }), "{error:?}");
        store.set_unreachable(false);
        assert!(single.participants().await.unwrap().is_empty());
    }
}

//! The backend-neutral candidate driver: one tokio task per candidacy, a loop around the
//! sans-IO [`Candidate`] core that performs its actions through a backend's [`Queue`].
//!
//! A backend supplies the queue operations (create an entry bound to a lease, locate our place,
//! watch one entry's deletion, confirm and delete our own entry, fence writes) and the leases
//! the entries are bound to. Everything else (when to campaign, when leadership begins and
//! ends, requeue, the handles' channels, metrics) is decided here and in the core, the same for
//! every backend.

use std::fmt::Debug;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use baton_core::{Candidate, CandidateAction, ElectionConfig, LossReason};
use tokio::sync::{mpsc, watch};

use crate::election::{CandidateSpec, Command, GuardContext, Leadership, Status};
use crate::error::{Error, Result};
use crate::lease_driver::{LeaseHandle, LeaseView};
use crate::stats::Stats;

/// Pause between attempts when a requeueing candidate hits a backend error.
pub(crate) const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// An entry's place in commit order: etcd's create revision, ZooKeeper's czxid, the in-memory
/// store's revision at its creation. The leader's position is its fencing token. Each backend
/// converts its own numbers in one place (no casts back and forth in the driver).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Position(pub(crate) u64);

impl Position {
    /// As a fencing token.
    pub(crate) fn token(self) -> u64 {
        self.0
    }
}

/// A point in the backend's history: the revision (etcd) or transaction id (ZooKeeper) at
/// which a read was served. A deletion watch started after a read point sees every deletion
/// that happened after that read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct ReadPoint(pub(crate) u64);

/// A lease that candidate entries are bound to: when it ends at the server, so do they.
pub(crate) trait QueueLease: Send + Sync + Debug + 'static {
    /// The lease driver's handle: its view (live, then over at the local deadline) and clock.
    fn handle(&self) -> &LeaseHandle;
}

/// Why a deletion watch fired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fired<E> {
    /// The entry was deleted; `position` is that of the incarnation deleted.
    Deleted { entry: E, position: Position },
    /// The entry (the one ahead of ours) was deleted, and the server vouches that at read
    /// point `at`, with that deletion applied, our own entry exists and is first: the same
    /// answer as a [`Queue::locate`] at `at` finding nobody ahead, without the read. Only the
    /// etcd backend's watches give it (when the server is baton's own).
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    DeletedFirst {
        entry: E,
        position: Position,
        at: ReadPoint,
    },
    /// The watch can no longer be trusted (connection lost, history compacted): the driver
    /// finds out afresh where it stands.
    Broken,
}

/// One registered watch for the deletion of one entry; dropping it cancels it.
pub(crate) trait EntryWatch<E>: Send + 'static {
    /// Resolves once, when the entry is deleted or the watch breaks; pends forever after.
    /// Must be cancel-safe.
    fn fired(&mut self) -> impl Future<Output = Fired<E>> + Send;
}

/// A candidacy's place for backends whose entries need nothing else: its election, its id,
/// its process-wide serial and the value its entry carries.
pub(crate) struct PlainEntrant {
    pub(crate) election: String,
    pub(crate) id: String,
    pub(crate) serial: u64,
    pub(crate) value: String,
}

impl PlainEntrant {
    pub(crate) fn new(spec: &CandidateSpec, serial: u64) -> PlainEntrant {
        PlainEntrant {
            election: spec.election.clone(),
            id: spec.id.clone(),
            serial,
            value: crate::election::entry_value(&spec.id, spec.value.as_deref()),
        }
    }
}

/// A deletion watch answered once through a channel — by a store, or by a task of the
/// backend's, which is aborted when the watch is dropped; a deletion heard is a watch event.
pub(crate) struct OneshotWatch<E> {
    fired: Option<tokio::sync::oneshot::Receiver<Fired<E>>>,
    task: Option<tokio::task::JoinHandle<()>>,
    stats: Arc<Stats>,
}

impl<E> OneshotWatch<E> {
    pub(crate) fn new(
        fired: tokio::sync::oneshot::Receiver<Fired<E>>,
        task: Option<tokio::task::JoinHandle<()>>,
        stats: Arc<Stats>,
    ) -> OneshotWatch<E> {
        OneshotWatch {
            fired: Some(fired),
            task,
            stats,
        }
    }
}

impl<E> Drop for OneshotWatch<E> {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

impl<E: Send + 'static> EntryWatch<E> for OneshotWatch<E> {
    async fn fired(&mut self) -> Fired<E> {
        let Some(fired) = self.fired.as_mut() else {
            return std::future::pending().await;
        };
        let outcome = fired.await.unwrap_or(Fired::Broken);
        self.fired = None;
        if matches!(outcome, Fired::Deleted { .. }) {
            self.stats.watch_events.fetch_add(1, Ordering::Relaxed);
        }
        outcome
    }
}

/// Where a candidate's entry stands in the queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Located<E> {
    /// Our entry (that incarnation) no longer exists.
    Gone,
    /// Our entry exists; `ahead` is the entry just ahead of it (with its position), `None` when
    /// it is first. `at` is the read point of this answer.
    Exists {
        ahead: Option<(E, Position)>,
        at: ReadPoint,
    },
}

/// The queue operations of one backend, on which [`spawn`] runs a candidacy.
///
/// To ensure correctness, an implementation must guarantee:
/// - **Queue order is commit order.** Each entry's [`Position`] (its fencing token when it
///   leads) is assigned when it is created, strictly increases with creation across the whole
///   election, and no entry can later appear ahead of an existing one.
/// - **Entries die with their lease.** An entry is bound to the lease it was created under and
///   the backend deletes it when that lease ends at the server.
/// - **Creating is safe to repeat.** [`Queue::entry_name`] is the same for every attempt of one
///   candidacy under one lease, and [`Queue::create`] adopts an entry of that name that already
///   exists bound to the same lease (an earlier attempt whose answer was lost) instead of
///   creating a second one.
/// - **A candidate deletes only its own incarnation.** [`Queue::delete`] deletes our entry only
///   if it still has the position we created it with; [`Queue::delete_if_on_lease`] only if it
///   is bound to our lease.
/// - **Located answers are atomic.** [`Queue::locate`] checks that our entry exists and finds
///   the one ahead of it in one read, so a deletion of both in one step is never half-seen.
/// - **Watches miss nothing.** A watch started from a read point fires for the first deletion
///   of its entry after that point, even one that happened before the watch was registered.
/// - **A vouched first is a located answer.** [`Fired::DeletedFirst`] is given only on the
///   server's word, checked as [`Queue::locate`] checks (our entry with our position, nobody
///   ahead) at one point of its history that includes the deletion.
pub(crate) trait Queue: Send + Sync + 'static {
    /// What entries are bound to.
    type Lease: QueueLease;
    /// A candidate's entry as the backend names it.
    type Entry: Clone + PartialEq + Debug + Send + Sync + 'static;
    /// The backend's view of one candidacy: where its entries live and what they hold.
    type Entrant: Send + Sync + 'static;
    /// A watch for one entry's deletion.
    type Watch: EntryWatch<Self::Entry>;

    /// The backend's request counters.
    fn stats(&self) -> &Stats;

    /// The highest token this backend has seen elected per election.
    fn tokens(&self) -> &TokenMemory;

    /// The backend's leases, shared by its candidacies.
    fn leases(&self) -> &LeasePool<Self::Lease>;

    /// Whether the backend was closed ([`crate::Backend::close`]): then it grants no lease
    /// any more, and a requeueing candidacy must not campaign again.
    fn is_closed(&self) -> bool {
        self.leases().is_closed()
    }

    /// The backend's view of a candidacy of `spec`; `serial` is unique within this process.
    fn entrant(&self, spec: &CandidateSpec, serial: u64) -> Self::Entrant;

    /// A live lease for `config` (shared by candidacies with the same lease settings).
    fn lease(
        &self,
        config: &ElectionConfig,
    ) -> impl Future<Output = Result<Arc<Self::Lease>>> + Send;

    /// A candidacy is done with `lease`: forget it unless another candidacy uses it.
    fn release_lease(&self, lease: Arc<Self::Lease>) -> impl Future<Output = ()> + Send {
        self.leases().release(lease)
    }

    /// Stops renewing `lease` so it lapses at the server (taking its entries with it), for an
    /// entry that could not be deleted.
    fn abandon_lease(&self, lease: &Arc<Self::Lease>) -> impl Future<Output = ()> + Send {
        self.leases().abandon(lease)
    }

    /// The name of our entry under `lease`: the same for every attempt under that lease.
    fn entry_name(&self, entrant: &Self::Entrant, lease: &Self::Lease) -> Self::Entry;

    /// Creates `entry` bound to `lease` (or adopts it, see the trait's rules); returns its
    /// position. Fails with [`Error::DuplicateId`] when another live candidate has our id.
    fn create(
        &self,
        entrant: &Self::Entrant,
        entry: &Self::Entry,
        lease: &Self::Lease,
    ) -> impl Future<Output = Result<Position>> + Send;

    /// Where our entry (created at `position`) stands.
    fn locate(
        &self,
        entrant: &Self::Entrant,
        entry: &Self::Entry,
        position: Position,
    ) -> impl Future<Output = Result<Located<Self::Entry>>> + Send;

    /// `Some(read point)` if our entry exists with `position`, `None` if not.
    fn confirm(
        &self,
        entry: &Self::Entry,
        position: Position,
    ) -> impl Future<Output = Result<Option<ReadPoint>>> + Send;

    /// Watches for the first deletion of `entry` (the incarnation at `position`) after read
    /// point `after`.
    fn watch_deletion(
        &self,
        entry: &Self::Entry,
        position: Position,
        after: ReadPoint,
    ) -> impl Future<Output = Result<Self::Watch>> + Send;

    /// Watches for the first deletion of `entry` (at `position`), the entry just ahead of our
    /// own `own` (at `own_position`), after read point `after`. A backend whose server can
    /// check, with that deletion, that our entry is then first answers
    /// [`Fired::DeletedFirst`], which spares the candidate its read; by default a plain
    /// deletion watch.
    fn watch_predecessor(
        &self,
        entrant: &Self::Entrant,
        own: &Self::Entry,
        own_position: Position,
        entry: &Self::Entry,
        position: Position,
        after: ReadPoint,
    ) -> impl Future<Output = Result<Self::Watch>> + Send {
        let _ = (entrant, own, own_position);
        self.watch_deletion(entry, position, after)
    }

    /// Deletes our entry if it still has `position` (and our id entry with it); bounded in
    /// time, since resigning must not hang on an unreachable server.
    fn delete(
        &self,
        entrant: &Self::Entrant,
        entry: &Self::Entry,
        position: Position,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Deletes our entry if it is bound to `lease` (a create whose answer was lost).
    fn delete_if_on_lease(
        &self,
        entrant: &Self::Entrant,
        entry: &Self::Entry,
        lease: &Self::Lease,
    ) -> impl Future<Output = Result<()>> + Send;

    /// The means to make writes that succeed only while `entry` (at `position`) leads.
    fn guard(&self, entry: &Self::Entry, position: Position) -> GuardContext;
}

/// Lease settings that must match for two elections to share a lease.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct LeaseKey {
    ttl: Duration,
    renew: Duration,
    drift_ppm: u32,
    margin: Duration,
}

impl LeaseKey {
    fn of(config: &ElectionConfig) -> LeaseKey {
        LeaseKey {
            ttl: config.ttl,
            renew: config.renew_interval(),
            drift_ppm: config.max_drift_ppm,
            margin: config.safety_margin,
        }
    }
}

/// The leases of one backend connection: one per distinct lease settings, shared by every
/// candidacy with those settings, so one process holding many elections renews one lease.
/// Closing it is final: no lease is granted afterwards.
#[derive(Debug)]
pub(crate) struct LeasePool<L> {
    leases: tokio::sync::Mutex<std::collections::HashMap<LeaseKey, Arc<L>>>,
    /// Campaign steps in flight at once (see [`CAMPAIGN_WINDOW`]).
    campaigns: tokio::sync::Semaphore,
    /// Set by [`LeasePool::close`]: no lease is granted after it (a requeueing candidacy would
    /// otherwise campaign again under a new one) and observers end.
    closed: watch::Sender<bool>,
}

impl<L> Default for LeasePool<L> {
    fn default() -> Self {
        LeasePool {
            leases: tokio::sync::Mutex::new(std::collections::HashMap::new()),
            campaigns: tokio::sync::Semaphore::new(CAMPAIGN_WINDOW),
            closed: watch::Sender::new(false),
        }
    }
}

/// How many campaign steps (creating an entry, finding the one ahead) one backend connection
/// runs at once. Thousands of campaigns started together (a member taking its shards) are
/// pipelined through this window rather than sent all at once: the server answers them as
/// fast, and the lease's renewals are not stuck behind thousands of requests (a renewal late
/// by the TTL ends every leadership under that lease).
pub(crate) const CAMPAIGN_WINDOW: usize = 128;

impl<L> LeasePool<L> {
    /// A place in the campaign window, held for one campaign step.
    pub(crate) async fn campaign_slot(&self) -> Option<tokio::sync::SemaphorePermit<'_>> {
        self.campaigns.acquire().await.ok()
    }

    /// Whether [`LeasePool::close`] was called.
    pub(crate) fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }

    /// Resolves once the pool is closed.
    pub(crate) fn closing(&self) -> impl Future<Output = ()> + Send + use<L> {
        let mut closed = self.closed.subscribe();
        async move {
            let _ = closed.wait_for(|closed| *closed).await;
        }
    }
}

impl<L: QueueLease> LeasePool<L> {
    /// A live lease with `config`'s settings, from `grant` if the last one has ended.
    pub(crate) async fn get<F>(&self, config: &ElectionConfig, grant: F) -> Result<Arc<L>>
    where
        F: Future<Output = Result<L>>,
    {
        let key = LeaseKey::of(config);
        let mut leases = self.leases.lock().await;
        if self.is_closed() {
            return Err(Error::Closed);
        }
        if let Some(lease) = leases.get(&key) {
            if lease.handle().is_live() {
                return Ok(lease.clone());
            }
        }
        let lease = Arc::new(grant.await?);
        leases.insert(key, lease.clone());
        Ok(lease)
    }

    /// A candidacy is done with `lease`: if no other candidacy uses it, forget it, so that it
    /// is revoked (when its last reference goes) rather than renewed for nobody.
    pub(crate) async fn release(&self, lease: Arc<L>) {
        let mut leases = self.leases.lock().await;
        // Ours and the map's: no other candidacy holds it, and none can take it while we hold
        // the lock (`get` hands out clones under it).
        if Arc::strong_count(&lease) == 2 {
            leases.retain(|_, held| !Arc::ptr_eq(held, &lease));
        }
    }

    /// Stops renewing `lease` (it expires at the server, taking its entries with it) and
    /// forgets it, for when an entry under it could not be deleted: an entry left behind on a
    /// lease that is still renewed would block its election for as long as this process lives.
    pub(crate) async fn abandon(&self, lease: &Arc<L>) {
        let mut leases = self.leases.lock().await;
        leases.retain(|_, held| !Arc::ptr_eq(held, lease));
        // Not a revoke: that would delete other elections' entries at once, while their
        // holders may still be acting. Letting it lapse ends every holder at its local
        // deadline first.
        lease.handle().stop_renewing();
    }

    /// Revokes every lease: all leaderships and candidacies under them end at the server. It
    /// is final: no lease is granted afterwards.
    pub(crate) async fn close(&self) {
        // Under the lock, so that no grant in progress slips past it.
        let leases: Vec<_> = {
            let mut leases = self.leases.lock().await;
            self.closed.send_replace(true);
            leases.drain().collect()
        };
        for (_, lease) in leases {
            // Holders see the lease over before it is revoked at the server, so no leadership
            // under it outlives its entry.
            lease.handle().revoke().await;
        }
    }
}

/// The highest token elected per election through one backend: a new entry at or below it
/// means the backend's history went backwards (restored from a backup, or wiped).
#[derive(Debug, Default)]
pub(crate) struct TokenMemory {
    highest: std::sync::Mutex<std::collections::HashMap<String, u64>>,
}

impl TokenMemory {
    /// The highest token elected in `election` so far.
    pub(crate) fn highest(&self, election: &str) -> Option<u64> {
        let tokens = self.highest.lock().unwrap_or_else(|e| e.into_inner());
        tokens.get(election).copied()
    }

    /// Records that `token` was elected in `election`.
    pub(crate) fn note(&self, election: &str, token: u64) {
        let mut tokens = self.highest.lock().unwrap_or_else(|e| e.into_inner());
        let highest = tokens.entry(election.to_string()).or_default();
        *highest = (*highest).max(token);
    }
}

/// Starts the driver task of one candidacy on `queue`.
pub(crate) fn spawn<Q: Queue>(
    queue: Arc<Q>,
    spec: CandidateSpec,
    commands_rx: mpsc::Receiver<Command>,
    commands: mpsc::Sender<Command>,
    leaderships: mpsc::Sender<Box<Result<Leadership>>>,
) {
    // Unique in the process, so unique within any backend: it tells apart two candidacies of
    // one election under one lease.
    static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
    let entrant = queue.entrant(&spec, serial);
    let CandidateSpec {
        election,
        id,
        config,
        ..
    } = spec;
    let driver = CandidateDriver {
        queue,
        entrant,
        election,
        id,
        core: Candidate::new(config.requeue),
        config,
        lease: None,
        own: None,
        predecessor: None,
        own_watch: None,
        predecessor_watch: None,
        known_first: None,
        status: None,
        term_metrics: None,
        commands,
        commands_rx,
        leaderships,
        failures: 0,
        resign_acks: Vec::new(),
        step_down_acks: Vec::new(),
        create_uncertain: false,
        created_position: Position(0),
    };
    tokio::spawn(driver.run());
}

/// The driver of one candidacy: a loop around [`Candidate`].
struct CandidateDriver<Q: Queue> {
    queue: Arc<Q>,
    entrant: Q::Entrant,
    election: String,
    id: String,
    config: ElectionConfig,
    core: Candidate,
    lease: Option<Arc<Q::Lease>>,
    /// Our entry's name under the current lease.
    own: Option<Q::Entry>,
    /// The entry and position we wait behind.
    predecessor: Option<(Q::Entry, Position)>,
    /// The deletion of our own entry.
    own_watch: Option<Q::Watch>,
    /// The deletion of the entry we wait behind.
    predecessor_watch: Option<Q::Watch>,
    /// Our position and the read point at which the server vouched, with our predecessor's
    /// deletion, that our entry is first ([`Fired::DeletedFirst`]): taken by the next
    /// find-predecessor in place of a read.
    known_first: Option<(Position, ReadPoint)>,
    /// The status channel of the current leadership.
    status: Option<watch::Sender<Status>>,
    /// The current leadership's metrics (`baton_is_leader` and time left), ended by dropping.
    term_metrics: Option<crate::metrics::Term>,
    commands: mpsc::Sender<Command>,
    commands_rx: mpsc::Receiver<Command>,
    leaderships: mpsc::Sender<Box<Result<Leadership>>>,
    /// Consecutive failed campaign steps (for rate-limited warnings).
    failures: u64,
    resign_acks: Vec<tokio::sync::oneshot::Sender<()>>,
    step_down_acks: Vec<tokio::sync::oneshot::Sender<()>>,
    /// A create request failed without an answer: the entry may exist. Deleted on giving up.
    create_uncertain: bool,
    /// The position of the last entry we created (for the error when it was too low).
    created_position: Position,
}

/// What woke the driver.
enum Wake<E> {
    Command(Option<Command>),
    LeaseOver,
    /// An entry's deletion; with the read point at which the server found ours first, if it
    /// checked.
    Deleted(E, Position, Option<ReadPoint>),
    WatchBroken,
    /// Nobody is waiting for a leadership any more (the campaign future was dropped).
    Abandoned,
}

impl<Q: Queue> CandidateDriver<Q> {
    async fn run(mut self) {
        self.core.campaign();
        loop {
            while let Some(action) = self.core.poll_action() {
                // Boxed: request futures are large, and a candidate spends its life waiting,
                // so the task should not carry their size while it waits (memory per election).
                Box::pin(self.perform(action)).await;
            }
            // A stepped-down term's entry has been deleted by now.
            for ack in self.step_down_acks.drain(..) {
                let _ = ack.send(());
            }
            if self.core.is_finished() {
                break;
            }
            let wake = Box::pin(self.wait()).await;
            // Requeue serves the `Candidacy` handle: once it is gone nobody can receive another
            // term, so a loss or a resigned term must end the candidacy, never campaign again
            // (a new term would be dropped at once, resign, campaign again, and so on forever).
            // Likewise once the backend is closed: it grants no lease any more.
            if self.leaderships.is_closed() || self.queue.is_closed() {
                self.core.stop_requeue();
            }
            match wake {
                Wake::Command(command) => self.handle_command(command),
                Wake::LeaseOver => self.core.handle_lease_expired(),
                Wake::Deleted(entry, position, first_at) => {
                    let ours = self.own.as_ref() == Some(&entry);
                    // The watch that fired is spent.
                    if ours {
                        self.own_watch = None;
                        self.core.handle_entry_deleted();
                    } else {
                        self.predecessor_watch = None;
                        if self
                            .predecessor
                            .as_ref()
                            .is_some_and(|(e, p)| *e == entry && *p == position)
                        {
                            self.queue.stats().wakeups.fetch_add(1, Ordering::Relaxed);
                            // Vouched for by the server: the next find-predecessor of our
                            // entry is answered from here.
                            self.known_first = first_at
                                .zip(self.core.own_position())
                                .map(|(at, own)| (Position(own), at));
                            self.core.handle_predecessor_deleted(position.0);
                        }
                    }
                }
                Wake::WatchBroken => Box::pin(self.recheck()).await,
                Wake::Abandoned => self.core.resign(),
            }
        }
        // Drain the last actions (the DeleteEntry of a resign) before acknowledging.
        while let Some(action) = self.core.poll_action() {
            Box::pin(self.perform(action)).await;
        }
        if let Some(status) = &self.status {
            status.send_if_modified(|s| {
                if *s == Status::Leading {
                    *s = Status::Resigned;
                    true
                } else {
                    false
                }
            });
        }
        self.term_metrics = None;
        for ack in self.resign_acks.drain(..) {
            let _ = ack.send(());
        }
        if let Some(lease) = self.lease.take() {
            self.queue.release_lease(lease).await;
        }
    }

    fn handle_command(&mut self, command: Option<Command>) {
        match command {
            None => self.core.resign(),
            Some(Command::Resign { term, ack }) => {
                if term.is_some() && term != self.core.token() {
                    // A leadership of an earlier term: that term is already over.
                    if let Some(ack) = ack {
                        let _ = ack.send(());
                    }
                } else if term.is_some() && self.config.requeue {
                    // The current term's holder resigned it; the candidacy goes on.
                    if let Some(status) = self.status.take() {
                        status.send_replace(Status::Resigned);
                    }
                    self.term_metrics = None;
                    self.step_down_acks.extend(ack);
                    self.core.step_down();
                } else {
                    self.resign_acks.extend(ack);
                    self.core.resign();
                }
            }
        }
    }

    async fn wait(&mut self) -> Wake<Q::Entry> {
        let mut lease_view = self
            .lease
            .as_ref()
            .map(|lease| lease.handle().watch.view.clone());
        let lease_over = async {
            match lease_view.as_mut() {
                Some(view) => {
                    let _ = view.wait_for(|v| *v == LeaseView::Over).await;
                }
                None => std::future::pending().await,
            }
        };
        let own = &mut self.own_watch;
        let predecessor = &mut self.predecessor_watch;
        let has_entry = self.core.own_position().is_some();
        let deleted = async {
            let Some(own) = own.as_mut() else {
                if has_entry {
                    // The watch could not be reopened: try again shortly.
                    tokio::time::sleep(RETRY_PAUSE).await;
                    return Wake::WatchBroken;
                }
                return std::future::pending().await;
            };
            let predecessor_fired = async {
                match predecessor.as_mut() {
                    Some(watch) => watch.fired().await,
                    None => std::future::pending().await,
                }
            };
            let fired = tokio::select! {
                fired = own.fired() => fired,
                fired = predecessor_fired => fired,
            };
            match fired {
                Fired::Deleted { entry, position } => Wake::Deleted(entry, position, None),
                Fired::DeletedFirst {
                    entry,
                    position,
                    at,
                } => Wake::Deleted(entry, position, Some(at)),
                Fired::Broken => Wake::WatchBroken,
            }
        };
        // While not leading, a dropped `Candidacy` (or campaign future) means nobody will ever
        // take the leadership: leave the queue instead of occupying a place in it.
        let leaderships = self.leaderships.clone();
        let leading = self.status.is_some();
        let abandoned = async {
            if leading {
                std::future::pending::<()>().await;
            }
            leaderships.closed().await;
        };
        tokio::select! {
            biased;
            command = self.commands_rx.recv() => Wake::Command(command),
            _ = lease_over => Wake::LeaseOver,
            wake = deleted => wake,
            _ = abandoned => Wake::Abandoned,
        }
    }

    /// After a broken watch (connection lost, compaction): find out from scratch where we
    /// stand. Our entry must still exist with our position; then its watch is reopened from
    /// the read point of that check (nothing older is replayed, so compaction cannot break it
    /// again), and a waiter looks for its predecessor anew. If the backend cannot be reached,
    /// the watch stays closed and [`CandidateDriver::wait`] tries again shortly; the lease's
    /// local deadline bounds how long a leader can act meanwhile.
    async fn recheck(&mut self) {
        self.drop_watches();
        tokio::time::sleep(RETRY_PAUSE).await;
        let (Some(position), Some(own)) = (self.core.own_position(), self.own.clone()) else {
            return;
        };
        let position = Position(position);
        let at = match self.queue.confirm(&own, position).await {
            Ok(Some(at)) => at,
            Ok(None) => return self.core.handle_entry_deleted(),
            Err(_) => return,
        };
        if self.open_own_watch(&own, position, at).await.is_err() {
            // `wait` retries shortly while an entry has no watch.
            return;
        }
        if let baton_core::CandidateState::Queued { predecessor, .. } = self.core.state() {
            self.core.handle_predecessor_deleted(predecessor);
        }
    }

    /// Stops both deletion watches.
    fn drop_watches(&mut self) {
        self.own_watch = None;
        self.predecessor_watch = None;
        self.known_first = None;
    }

    async fn perform(&mut self, action: CandidateAction) {
        match action {
            CandidateAction::CreateEntry => self.create_entry().await,
            CandidateAction::FindPredecessor { own_position } => {
                self.find_predecessor(Position(own_position)).await
            }
            CandidateAction::WatchPredecessor { position } => {
                // The watch was placed in find_predecessor; nothing more to do here.
                debug_assert!(self
                    .predecessor
                    .as_ref()
                    .is_some_and(|(_, p)| p.0 == position));
            }
            CandidateAction::Elected { token } => self.elected(token),
            CandidateAction::Lost {
                reason,
                was_leading,
            } => self.lost(reason, was_leading),
            CandidateAction::DeleteEntry { position } => {
                self.delete_entry(Position(position)).await
            }
        }
    }

    async fn create_entry(&mut self) {
        let queue = self.queue.clone();
        let _slot = queue.leases().campaign_slot().await;
        self.drop_watches();
        self.predecessor = None;
        // Tokens elected before our create is sent: our entry must come out above them. (Not
        // re-read per attempt: a retry may adopt an entry created by an earlier attempt.)
        if let Some(highest) = self.queue.tokens().highest(&self.election) {
            self.core.handle_token_seen(highest);
        }
        loop {
            match self.try_create_entry().await {
                Ok((own, position)) => {
                    // The entry exists from the create on: a deletion right after it is seen.
                    if let Err(error) = self
                        .open_own_watch(&own, position, ReadPoint(position.0))
                        .await
                    {
                        // Without a watch we cannot hear of deletions: delete and retry.
                        if self
                            .queue
                            .delete(&self.entrant, &own, position)
                            .await
                            .is_err()
                        {
                            self.create_uncertain = true;
                        }
                        if self.give_up(error).await {
                            return;
                        }
                        continue;
                    }
                    self.failures = 0;
                    self.create_uncertain = false;
                    self.created_position = position;
                    self.core.handle_entry_created(position.0);
                    return;
                }
                Err(error) => {
                    if self.give_up(error).await {
                        return;
                    }
                }
            }
        }
    }

    async fn try_create_entry(&mut self) -> Result<(Q::Entry, Position)> {
        let lease = self.queue.lease(&self.config).await?;
        let own = self.queue.entry_name(&self.entrant, &lease);
        self.own = Some(own.clone());
        self.lease = Some(lease.clone());
        match self.queue.create(&self.entrant, &own, &lease).await {
            Ok(position) => Ok((own, position)),
            Err(error) => {
                // Unless the backend refused it outright, the create may have committed even
                // though no answer came. A retry adopts such an entry; giving up deletes it.
                if !matches!(error, Error::DuplicateId { .. }) {
                    self.create_uncertain = true;
                }
                Err(error)
            }
        }
    }

    /// Without requeue a failure ends the candidacy and reaches the caller; with requeue we
    /// pause and retry (unless asked to stop). Returns whether to give up.
    async fn give_up(&mut self, error: Error) -> bool {
        if self.queue.is_closed() {
            // Closed for good: requeue cannot campaign again (no lease is granted any more).
            self.core.stop_requeue();
        }
        if !self.config.requeue || self.leaderships.is_closed() || self.queue.is_closed() {
            let _ = self.leaderships.try_send(Box::new(Err(error)));
            self.core.handle_backend_failed();
            self.clean_up_uncertain_create().await;
            return true;
        }
        // Every failure would be five lines a second during an outage: say it every 5 s.
        if self.failures % 25 == 0 {
            tracing::warn!(election = %self.election, %error, "campaign step failed; retrying");
        }
        self.failures += 1;
        // A resign must not wait for the backend to come back.
        tokio::select! {
            _ = tokio::time::sleep(RETRY_PAUSE) => false,
            command = self.commands_rx.recv() => {
                self.handle_command(command);
                let finished = self.core.is_finished();
                if finished {
                    self.clean_up_uncertain_create().await;
                }
                finished
            }
        }
    }

    /// Giving up after a create whose answer was lost: the entry may exist on a lease that is
    /// still renewed (shared with other elections), where it would block this election for
    /// the life of the process. Delete it, or failing that, let its lease lapse.
    async fn clean_up_uncertain_create(&mut self) {
        if !std::mem::take(&mut self.create_uncertain) {
            return;
        }
        let (Some(lease), Some(own)) = (self.lease.clone(), self.own.clone()) else {
            return;
        };
        if self
            .queue
            .delete_if_on_lease(&self.entrant, &own, &lease)
            .await
            .is_err()
        {
            self.queue.abandon_lease(&lease).await;
        }
    }

    /// Watches the deletion of our own entry (at `position`) after read point `after`.
    async fn open_own_watch(
        &mut self,
        own: &Q::Entry,
        position: Position,
        after: ReadPoint,
    ) -> Result<()> {
        let watch = self.queue.watch_deletion(own, position, after).await?;
        self.own_watch = Some(watch);
        Ok(())
    }

    /// Always one atomic read that also checks our own entry, even when the predecessor's
    /// deletion suggests we are first: the same step may have deleted our entry too (a prefix
    /// delete, a shared lease revoked), and its event may not have reached us yet.
    async fn find_predecessor(&mut self, position: Position) {
        let queue = self.queue.clone();
        let _slot = queue.leases().campaign_slot().await;
        loop {
            match self.try_find_predecessor(position).await {
                Ok(Some(found)) => {
                    if self.lease_over() {
                        // Our entry goes with the lease at the server, perhaps already: the
                        // core hears of the expiry first, so it never elects on a stale read
                        // (say, one answered just before a pause longer than the TTL).
                        self.core.handle_lease_expired();
                        return;
                    }
                    let ahead = found.as_ref().map(|(_, p)| p.0);
                    self.predecessor = found;
                    self.core.handle_predecessor(ahead);
                    return;
                }
                Ok(None) => {
                    self.core.handle_entry_deleted();
                    return;
                }
                Err(error) => {
                    if !error.is_retryable() || self.lease_over() {
                        self.core.handle_backend_failed();
                        // With requeue the core campaigns again; the caller hears nothing.
                        if !self.config.requeue {
                            let _ = self.leaderships.try_send(Box::new(Err(error)));
                        }
                        return;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(RETRY_PAUSE) => {}
                        command = self.commands_rx.recv() => {
                            self.handle_command(command);
                            if self.core.is_finished() {
                                return;
                            }
                        }
                    }
                }
            }
        }
    }

    fn lease_over(&self) -> bool {
        self.lease
            .as_ref()
            .is_none_or(|lease| !lease.handle().is_live())
    }

    /// `Ok(None)`: our entry is gone. `Ok(Some(None))`: we are first. `Ok(Some(Some(p)))`: `p`
    /// is ahead of us, and a watch for its deletion is in place.
    async fn try_find_predecessor(
        &mut self,
        position: Position,
    ) -> Result<Option<Option<(Q::Entry, Position)>>> {
        let Some(own) = self.own.clone() else {
            return Ok(None);
        };
        let vouched = self
            .known_first
            .take()
            .filter(|(own_position, _)| *own_position == position);
        let (ahead, at) = match vouched {
            Some((_, at)) => (None, at),
            None => match self.queue.locate(&self.entrant, &own, position).await? {
                Located::Gone => return Ok(None),
                Located::Exists { ahead, at } => (ahead, at),
            },
        };
        if let Some((entry, ahead_position)) = &ahead {
            if self.own_watch.is_none() {
                // Our entry exists as of `at` (the read checked it).
                self.open_own_watch(&own, position, at).await?;
            }
            // Watch from just after our read: a deletion in between is replayed, not missed.
            // Replacing the previous predecessor's watch cancels it.
            let watch = self
                .queue
                .watch_predecessor(&self.entrant, &own, position, entry, *ahead_position, at)
                .await?;
            self.predecessor_watch = Some(watch);
            self.queue
                .stats()
                .predecessor_watches
                .fetch_add(1, Ordering::Relaxed);
        } else {
            self.predecessor_watch = None;
        }
        Ok(Some(ahead))
    }

    fn elected(&mut self, token: u64) {
        // The core elects only right after `find_predecessor` saw our lease live and our entry
        // first, within this same step: nothing can have run in between.
        let (Some(lease), Some(own)) = (self.lease.as_ref(), self.own.as_ref()) else {
            self.core.handle_backend_failed();
            return;
        };
        self.queue.tokens().note(&self.election, token);
        self.term_metrics = Some(crate::metrics::Term::begin(
            &self.election,
            &lease.handle().watch,
        ));
        let (status_tx, status_rx) = watch::channel(Status::Leading);
        self.status = Some(status_tx);
        let leadership = Leadership::new(
            self.election.clone(),
            self.id.clone(),
            token,
            status_rx,
            lease.handle().watch.clone(),
            self.commands.clone(),
            self.queue.guard(own, Position(token)),
        );
        if self.leaderships.try_send(Box::new(Ok(leadership))).is_err() {
            // Nobody is waiting for it (the candidacy was dropped): the leadership's own drop
            // has queued a resign, which must end the candidacy rather than requeue.
            tracing::debug!(election = %self.election, "leadership not collected; resigning");
            self.core.stop_requeue();
        }
    }

    fn lost(&mut self, reason: LossReason, was_leading: bool) {
        if let Some(status) = self.status.take() {
            status.send_replace(Status::Lost(reason));
        }
        self.term_metrics = None;
        crate::metrics::lost(&self.election, reason);
        if reason == LossReason::TokenRegressed {
            // Final even with requeue: the caller must hear why.
            let error = Error::TokenRegressed {
                election: self.election.clone(),
                token: self.created_position.token(),
                highest: self.core.highest_reached().unwrap_or_default(),
            };
            // Said here only when the caller cannot hear it (the candidacy was dropped): a
            // caller that reads it (`baton run` prints it) would otherwise see it twice.
            let message = error.to_string();
            if self.leaderships.try_send(Box::new(Err(error))).is_err() {
                tracing::warn!(election = %self.election, error = %message, "candidacy ended");
            }
        } else if !was_leading && !self.config.requeue {
            let _ = self
                .leaderships
                .try_send(Box::new(Err(Error::CampaignLost(reason))));
        }
        self.drop_watches();
        self.predecessor = None;
    }

    async fn delete_entry(&mut self, position: Position) {
        // We are deleting it ourselves: stop watching it first, so nobody is told.
        self.drop_watches();
        let Some(own) = self.own.clone() else {
            return;
        };
        if self.lease_over() {
            // The entry is going with the lease at the server; one try to speed that up.
            let _ = self.queue.delete(&self.entrant, &own, position).await;
            return;
        }
        for attempt in 0..2 {
            if self
                .queue
                .delete(&self.entrant, &own, position)
                .await
                .is_ok()
            {
                return;
            }
            if attempt < 1 {
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
        // The backend is unreachable: let the lease lapse so the entry goes with it.
        if let Some(lease) = self.lease.clone() {
            tracing::warn!(election = %self.election, "could not delete our entry; ending its lease");
            self.queue.abandon_lease(&lease).await;
        }
    }
}

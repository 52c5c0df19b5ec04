//! One member: the Raft node, its applied state, lease timers, and the running gRPC server.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, Raft, ServerState, SnapshotPolicy, StoredMembership};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tonic::Status;

use crate::lease::LeaseKeeper;
use crate::log_store::{self, LogStore};
use crate::network::Network;
use crate::proto::etcdserverpb::ResponseHeader;
use crate::raft::{
    self, lock, Core, NodeId, Proposal, Reply, SharedCore, StateMachine, TypeConfig,
};
use crate::store::{Command, Store, StoreConfig};
use crate::watch::WatchHub;
use crate::{service, ServerError};

/// [`ServerConfig::quota_bytes`] unless set: elections and locks take a few hundred bytes a
/// candidate, so this is room for millions of them.
pub const DEFAULT_QUOTA_BYTES: u64 = 512 << 20;

/// The smallest quota accepted: room for two of the largest requests (1.5 MiB).
pub const MIN_QUOTA_BYTES: u64 = 4 << 20;

/// How a server runs.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Where clients connect (port 0: any free port; see [`RunningServer::addr`]).
    pub listen: SocketAddr,
    /// The data directory: Raft log, snapshots, member identity. Created if missing.
    pub data_dir: PathBuf,
    /// Revisions of history kept for watches and reads at past revisions.
    pub history_revisions: i64,
    /// A snapshot is taken after this many log entries (and the log before it purged).
    pub snapshot_every: u64,
    /// The most the live keys and values may take, in bytes: a write that adds data beyond
    /// it is refused (etcd's "database space exceeded"); deletions and compactions always
    /// pass. History is kept within a quarter of it, and a snapshot is taken whenever the log
    /// grows by a quarter of it, so memory stays a small multiple of it.
    pub quota_bytes: u64,
    /// How often idle watchers that asked for progress notifications get one.
    pub progress_interval: Duration,
    /// How long a client connection may be silent before the server pings it (HTTP/2 PING).
    pub keepalive_interval: Duration,
    /// How long the server waits for a ping's answer before it closes the connection: a
    /// client that vanished without closing (a host gone, a network cut, a stopped process)
    /// then lets go of its watches and streams.
    pub keepalive_timeout: Duration,
}

impl ServerConfig {
    /// Defaults for everything but where to listen and where to keep data.
    pub fn new(listen: SocketAddr, data_dir: impl Into<PathBuf>) -> ServerConfig {
        ServerConfig {
            listen,
            data_dir: data_dir.into(),
            history_revisions: 10_000,
            snapshot_every: 10_000,
            quota_bytes: DEFAULT_QUOTA_BYTES,
            // etcd's default.
            progress_interval: Duration::from_secs(600),
            // etcd's defaults (--grpc-keepalive-interval, --grpc-keepalive-timeout).
            keepalive_interval: Duration::from_secs(2 * 60 * 60),
            keepalive_timeout: Duration::from_secs(20),
        }
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<(), ServerError> {
        if self.history_revisions < 1 {
            return Err(ServerError::Config(
                "history must keep at least 1 revision".into(),
            ));
        }
        if self.quota_bytes < MIN_QUOTA_BYTES {
            return Err(ServerError::Config(format!(
                "the quota must be at least {} MiB",
                MIN_QUOTA_BYTES >> 20
            )));
        }
        if self.snapshot_every < 1 {
            return Err(ServerError::Config(
                "snapshots need an interval of at least 1 entry".into(),
            ));
        }
        if self.progress_interval.is_zero() {
            return Err(ServerError::Config(
                "the progress interval must be positive".into(),
            ));
        }
        if self.keepalive_interval.is_zero() || self.keepalive_timeout.is_zero() {
            return Err(ServerError::Config(
                "the keepalive interval and timeout must be positive".into(),
            ));
        }
        Ok(())
    }
}

/// What the gRPC services share.
pub struct Node {
    /// This member's id (also its etcd member id).
    pub id: NodeId,
    /// The Raft handle.
    pub raft: Raft<TypeConfig>,
    /// The applied state.
    pub core: SharedCore,
    /// Lease timers.
    pub leases: Arc<LeaseKeeper>,
    /// The settings it runs with.
    pub config: ServerConfig,
    /// Where clients reach it.
    pub client_url: String,
    /// Numbers watch streams.
    pub next_stream: Mutex<u64>,
    /// Commands on their way into the log (see [`run_proposer`]).
    proposals: mpsc::Sender<Pending>,
}

/// A command waiting for its place in the log, and where its reply goes.
type Pending = (Command, oneshot::Sender<Result<Reply, Status>>);

/// Commands that may wait for the log before new ones wait to be queued.
const MAX_QUEUED_PROPOSALS: usize = 8_192;

/// The most commands one log entry carries: bounds an entry's size and apply time.
const MAX_PROPOSAL_COMMANDS: usize = 512;

/// How long the snapshot task waits for the purge that follows a snapshot it asked for.
const SNAPSHOT_WAIT: Duration = Duration::from_secs(1);

/// Group commit: writes one log entry at a time, each carrying every command that arrived
/// while the previous one was being written (up to [`MAX_PROPOSAL_COMMANDS`], and no more than
/// the log's byte bound but for the last command). One client alone waits for one fsync, as
/// before; 64 clients share theirs.
///
/// Backpressure: while the unpurged log (held in memory too) is past twice its bound, because
/// writes outran the snapshot being built, the next entry waits for a purge. However fast big
/// values come, the log then holds at most about three times its bound (the entry appended
/// last may take it from twice to three times); what waits meanwhile is the clients' requests
/// themselves (at most [`MAX_QUEUED_PROPOSALS`] queued, the rest waiting in their handlers).
async fn run_proposer(
    raft: Raft<TypeConfig>,
    mut pending: mpsc::Receiver<Pending>,
    growth: Arc<log_store::Growth>,
) {
    while let Some(first) = pending.recv().await {
        let cap = growth.limit().saturating_mul(2);
        while !growth.at_most(cap, SNAPSHOT_WAIT).await {
            if raft.metrics().borrow().running_state.is_err() {
                break;
            }
        }
        // An entry holds up to the log's bound in commands (one command alone may be more):
        // big values written at once would otherwise make one entry of any size.
        let budget = growth.limit();
        let mut bytes = command_bytes(&first.0);
        let mut batch = vec![first];
        while batch.len() < MAX_PROPOSAL_COMMANDS && bytes < budget {
            match pending.try_recv() {
                Ok(next) => {
                    bytes = bytes.saturating_add(command_bytes(&next.0));
                    batch.push(next);
                }
                Err(_) => break,
            }
        }
        let (commands, replies): (Vec<Command>, Vec<_>) = batch.into_iter().unzip();
        match raft.client_write(Proposal(commands)).await {
            Ok(written) => {
                for (reply, result) in replies.into_iter().zip(written.data) {
                    let _ = reply.send(Ok(result));
                }
            }
            Err(error) => {
                let status = match error {
                    RaftError::APIError(ClientWriteError::ForwardToLeader(_)) => {
                        Status::unavailable("etcdserver: not leader")
                    }
                    RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => {
                        Status::failed_precondition(format!("etcdserver: {e}"))
                    }
                    RaftError::Fatal(e) => {
                        Status::unavailable(format!("etcdserver: server stopped: {e}"))
                    }
                };
                for reply in replies {
                    let _ = reply.send(Err(status.clone()));
                }
            }
        }
    }
}

/// A command's size in the log (as encoded there).
fn command_bytes(command: &Command) -> u64 {
    bincode::serialized_size(command).unwrap_or(u64::MAX)
}

impl Node {
    /// A response header at the current revision.
    pub fn header(&self) -> ResponseHeader {
        let core = lock(&self.core);
        core.header(core.store.revision())
    }

    /// Puts `command` through the log and waits until it is applied.
    pub async fn propose(&self, command: Command) -> Result<Reply, Status> {
        let (reply, replied) = oneshot::channel();
        self.proposals
            .send((command, reply))
            .await
            .map_err(|_| Status::unavailable("etcdserver: server stopping"))?;
        replied
            .await
            .map_err(|_| Status::unavailable("etcdserver: server stopping"))?
    }

    /// Waits until a read may be served from the local store and still see every write
    /// acknowledged before it began.
    ///
    /// A member that is the group's only voter and leads it has applied every write it ever
    /// acknowledged (a write is answered only once applied): its store is current, with no
    /// round to confirm leadership. With more voters, Raft's read index (openraft's
    /// `ensure_linearizable`) confirms leadership with a quorum first; openraft does that on
    /// its next heartbeat, which would cost a single member tens of milliseconds per read.
    pub async fn linearizable(&self) -> Result<(), Status> {
        let sole_voter = {
            let core = lock(&self.core);
            let mut voters = core.membership.membership().voter_ids();
            voters.next() == Some(self.id) && voters.next().is_none()
        };
        if sole_voter && self.raft.metrics().borrow().state == ServerState::Leader {
            return Ok(());
        }
        self.raft
            .ensure_linearizable()
            .await
            .map(|_| ())
            .map_err(|e| Status::unavailable(format!("etcdserver: {e}")))
    }

    /// A number for a new watch stream.
    pub fn stream_id(&self) -> u64 {
        let mut next = self.next_stream.lock().unwrap_or_else(|e| e.into_inner());
        *next += 1;
        *next
    }
}

/// How long a stopping server waits for open streams to end.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(500);

/// A started server.
pub struct RunningServer {
    addr: SocketAddr,
    node: Arc<Node>,
    shutdown: Option<oneshot::Sender<()>>,
    serving: JoinHandle<Result<(), tonic::transport::Error>>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningServer {
    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The member's id.
    pub fn member_id(&self) -> NodeId {
        self.node.id
    }

    /// Stops serving and stops the Raft node; every acknowledged write is already durable.
    pub async fn shutdown(mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        // A graceful stop waits for open requests, and watch and keep-alive streams stay open
        // as long as their clients want: give them a moment, then stop accepting regardless.
        let served = match tokio::time::timeout(SHUTDOWN_GRACE, &mut self.serving).await {
            Ok(served) => served,
            Err(_) => {
                self.serving.abort();
                Ok(Ok(()))
            }
        };
        for task in &self.tasks {
            task.abort();
        }
        let _ = self.node.raft.shutdown().await;
        match served {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ServerError::Serve(e.to_string())),
            Err(e) => Err(ServerError::Serve(e.to_string())),
        }
    }

    /// Resolves when the Raft node has stopped by itself: a write to the log or the state
    /// machine failed (a full disk, say). Nothing can be written or read consistently after
    /// that, so the caller should stop serving and exit; every acknowledged write is already on
    /// disk, and a restart on the same data directory (once the cause is fixed) goes on from
    /// there.
    pub async fn failed(&self) -> ServerError {
        let mut metrics = self.node.raft.metrics();
        loop {
            if let Err(fatal) = &metrics.borrow_and_update().running_state {
                return ServerError::Raft(format!("the Raft node stopped: {fatal}"));
            }
            if metrics.changed().await.is_err() {
                return ServerError::Raft("the Raft node stopped".into());
            }
        }
    }

    /// Waits until the server stops serving (it does not on its own, short of a fatal error).
    pub async fn wait(&mut self) -> Result<(), ServerError> {
        match (&mut self.serving).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ServerError::Serve(e.to_string())),
            Err(e) => Err(ServerError::Serve(e.to_string())),
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.serving.abort();
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts a single-member server: opens (or creates) the data directory, replays it, elects
/// itself, and serves the etcd v3 API on `config.listen`.
pub async fn start(config: ServerConfig) -> Result<RunningServer, ServerError> {
    config.validate()?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| ServerError::Listen(config.listen, e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| ServerError::Listen(config.listen, e))?;
    if std::fs::symlink_metadata(&config.data_dir).is_ok() && !config.data_dir.is_dir() {
        return Err(ServerError::Data(
            config.data_dir.clone(),
            std::io::Error::other("it exists and is not a directory (or a link to one)"),
        ));
    }
    std::fs::create_dir_all(&config.data_dir)
        .map_err(|e| ServerError::Data(config.data_dir.clone(), e))?;
    let data = |e| ServerError::Data(config.data_dir.clone(), e);
    let log_path = config.data_dir.join("raft.redb");
    let (db, identity) = if log_path.exists() {
        let db = log_store::open_database(&log_path).map_err(data)?;
        let identity = log_store::existing_identity(&db, &log_path).map_err(data)?;
        (db, identity)
    } else {
        if raft::has_snapshot(&config.data_dir) {
            // A new log would be a new member, which the snapshot's membership does not list.
            return Err(data(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!(
                    "the Raft log {} is missing beside a snapshot: restore the data directory \
                     from a backup",
                    log_path.display()
                ),
            )));
        }
        log_store::create_database(&log_path).map_err(data)?
    };
    let db = Arc::new(db);
    let store_config = StoreConfig {
        history_revisions: config.history_revisions,
        ..StoreConfig::default()
    };
    let raft::Restored {
        mut store,
        applied,
        membership,
    } = match raft::load_snapshot(&config.data_dir).map_err(data)? {
        Some(restored) => restored,
        None => raft::Restored {
            store: Store::new(store_config),
            applied: None,
            membership: StoredMembership::default(),
        },
    };
    // `--history` applies from now on, also to a data directory made with another value.
    store.set_history_revisions(config.history_revisions);
    store.set_history_bytes(config.quota_bytes / 4);
    let leases = Arc::new(LeaseKeeper::default());
    // A restart gives every surviving lease a full TTL: a live holder is never expired early.
    leases.reset_all(&store.leases());
    let core: SharedCore = Arc::new(Mutex::new(Core {
        store,
        applied,
        membership,
        watches: WatchHub::default(),
        header: ResponseHeader {
            cluster_id: identity.cluster_id,
            member_id: identity.member_id,
            revision: 0,
            raft_term: 0,
        },
    }));
    let log = LogStore::open(db).map_err(data)?;
    let log_growth = log.growth(config.quota_bytes / 4);
    // Entries folded into a snapshot are gone from the log: without that snapshot (deleted, or
    // an older one copied in) the state before them cannot be rebuilt.
    if let Some(purged) = log.last_purged() {
        let covered = applied.is_some_and(|applied| applied.index >= purged.index);
        if !covered {
            return Err(data(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the log was compacted up to entry {} into a snapshot, but {} is missing or \
                     older: restore the data directory from a backup",
                    purged.index,
                    config.data_dir.join("snapshot").display()
                ),
            )));
        }
    }
    let state_machine = StateMachine::new(core.clone(), leases.clone(), &config.data_dir);
    let raft_config = openraft::Config {
        cluster_name: "baton".into(),
        heartbeat_interval: 100,
        election_timeout_min: 300,
        election_timeout_max: 600,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(config.snapshot_every),
        // One member needs no log behind its snapshot (no follower catches up from it); the
        // memory goes back at once, which the snapshot by log size below relies on.
        max_in_snapshot_log_to_keep: 0,
        ..openraft::Config::default()
    }
    .validate()
    .map_err(|e| ServerError::Config(e.to_string()))?;
    let raft = Raft::new(
        identity.member_id,
        Arc::new(raft_config),
        Network,
        log,
        state_machine,
    )
    .await
    .map_err(|e| ServerError::Raft(e.to_string()))?;
    let client_url = format!("http://{addr}");
    if !raft
        .is_initialized()
        .await
        .map_err(|e| ServerError::Raft(e.to_string()))?
    {
        let members = BTreeMap::from([(identity.member_id, BasicNode::new(addr.to_string()))]);
        raft.initialize(members)
            .await
            .map_err(|e| ServerError::Raft(e.to_string()))?;
    }
    raft.wait(Some(Duration::from_secs(10)))
        .state(ServerState::Leader, "elect itself")
        .await
        .map_err(|e| ServerError::Raft(format!("the member did not become leader: {e}")))?;
    // Bounded: when the log cannot keep up, clients wait to be queued.
    let (proposals, pending) = mpsc::channel(MAX_QUEUED_PROPOSALS);
    let proposer = tokio::spawn(run_proposer(raft.clone(), pending, log_growth.clone()));
    let snapshots = tokio::spawn(snapshot_when_the_log_grows(raft.clone(), log_growth));
    let node = Arc::new(Node {
        id: identity.member_id,
        raft,
        proposals,
        core,
        leases,
        config,
        client_url,
        next_stream: Mutex::new(0),
    });
    let tasks = vec![
        proposer,
        snapshots,
        spawn_expiry(node.clone()),
        spawn_term_watch(node.clone()),
    ];
    let (shutdown, stopped) = oneshot::channel();
    let serving = tokio::spawn(service::serve(node.clone(), listener, async {
        let _ = stopped.await;
    }));
    Ok(RunningServer {
        addr,
        node,
        shutdown: Some(shutdown),
        serving,
        tasks,
    })
}

/// Proposes a revoke for every lease the keeper finds expired, while this member leads.
fn spawn_expiry(node: Arc<Node>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let leases = node.leases.clone();
        let metrics = node.raft.metrics();
        let proposer = node.clone();
        leases
            .run(
                || metrics.borrow().state == ServerState::Leader,
                move |id| {
                    let node = proposer.clone();
                    tokio::spawn(async move {
                        if let Err(status) = node.propose(Command::LeaseRevoke { id }).await {
                            // The lease is out of the timers either way; a member that becomes
                            // leader times every lease again from the store.
                            tracing::warn!(lease = id, %status, "could not revoke an expired lease");
                        }
                    });
                },
            )
            .await;
    })
}

/// Keeps the term in response headers current, and restarts every lease's TTL when this member
/// becomes leader.
fn spawn_term_watch(node: Arc<Node>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut metrics = node.raft.metrics();
        let mut leading = false;
        loop {
            let (term, is_leader) = {
                let m = metrics.borrow_and_update();
                (m.current_term, m.state == ServerState::Leader)
            };
            {
                let mut core = lock(&node.core);
                core.header.raft_term = term;
                if is_leader && !leading {
                    let all = core.store.leases();
                    node.leases.reset_all(&all);
                }
            }
            leading = is_leader;
            if metrics.changed().await.is_err() {
                return;
            }
        }
    })
}

/// Takes a snapshot (which purges the log, kept in memory as well) whenever an append leaves
/// the log past its bound, so that a few big values written over and over cannot fill memory
/// long before `snapshot_every` entries. Aborted with the server's other tasks.
async fn snapshot_when_the_log_grows(raft: Raft<TypeConfig>, growth: Arc<log_store::Growth>) {
    keep_the_log_small(&growth, || {
        let raft = raft.clone();
        async move { raft.trigger().snapshot().await.is_ok() }
    })
    .await
}

/// The snapshot task's loop: `snapshot` asks for one (false: the Raft node has stopped).
///
/// A log still past its bound after a snapshot is snapshotted again without waiting for another
/// append. The entry that crossed the bound may not have been in that snapshot (it is built
/// from what is applied when it is asked for, and the entry may not have been applied yet), and
/// an entry that alone is past twice the bound (big values written at once share an entry)
/// keeps the proposer from appending anything more: waiting for an append would wait for good,
/// with every write (resigns and lease expiries too) held back. Asked again as soon as the last
/// one's purge lands, else after [`SNAPSHOT_WAIT`] (a log that cannot shrink, say while its
/// entries wait for a quorum, is asked for a snapshot once a second, not in a loop).
async fn keep_the_log_small<F, Asked>(growth: &log_store::Growth, mut snapshot: F)
where
    F: FnMut() -> Asked,
    Asked: std::future::Future<Output = bool>,
{
    loop {
        while growth.bytes() <= growth.limit() {
            growth.past_limit().await;
        }
        let seen = growth.purges();
        if !snapshot().await {
            return;
        }
        // A snapshot is built in the background and then purges the log. Ask again only after
        // that (a trigger while one is being built is dropped); at most a second for one that
        // never comes.
        growth.purged_after(seen, SNAPSHOT_WAIT).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// `keep_the_log_small` over `growth` in a task of its own, asking `snapshot` for each
    /// snapshot.
    fn keeper<F, Asked>(growth: &Arc<log_store::Growth>, snapshot: F) -> tokio::task::JoinHandle<()>
    where
        F: FnMut() -> Asked + Send + 'static,
        Asked: std::future::Future<Output = bool> + Send,
    {
        let growth = growth.clone();
        tokio::spawn(async move { keep_the_log_small(&growth, snapshot).await })
    }

    /// A snapshot that stops short of the entry that crossed the bound leaves the log past it:
    /// the next one is asked for at once, with no append to signal it (the wedge: the proposer
    /// appended nothing more, and the task waited for an append).
    #[tokio::test(start_paused = true)]
    async fn a_log_still_past_its_bound_after_a_snapshot_gets_another() {
        let growth = log_store::Growth::for_test(3_000, 1_000);
        let asked = Arc::new(AtomicU32::new(0));
        let task = keeper(&growth, {
            let (growth, asked) = (growth.clone(), asked.clone());
            move || {
                let (growth, asked) = (growth.clone(), asked.clone());
                async move {
                    // The first snapshot purges what was applied, not the big entry; the
                    // second, the big entry too.
                    match asked.fetch_add(1, Ordering::SeqCst) {
                        0 => growth.purge_for_test(500),
                        _ => growth.purge_for_test(growth.bytes()),
                    }
                    true
                }
            }
        });
        growth.signal_past_for_test();
        let started = tokio::time::Instant::now();
        while growth.bytes() > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
            assert!(
                started.elapsed() < Duration::from_millis(10),
                "asked {asked:?}"
            );
        }
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        // Small again: no more snapshots until an append crosses the bound.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        task.abort();
    }

    /// A log that cannot shrink (no purge comes) is asked for a snapshot once a second.
    #[tokio::test(start_paused = true)]
    async fn a_log_that_cannot_shrink_is_not_snapshotted_in_a_loop() {
        let growth = log_store::Growth::for_test(3_000, 1_000);
        let asked = Arc::new(AtomicU32::new(0));
        let task = keeper(&growth, {
            let asked = asked.clone();
            move || {
                asked.fetch_add(1, Ordering::SeqCst);
                async { true }
            }
        });
        growth.signal_past_for_test();
        tokio::time::sleep(Duration::from_millis(4_500)).await;
        assert_eq!(asked.load(Ordering::SeqCst), 5);
        task.abort();
    }
}

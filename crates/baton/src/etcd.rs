//! The etcd v3 backend (also serves `baton server`, which speaks the same API subset).
//!
//! Layout: every candidate owns `<prefix>/<election>/@candidates/<lease id>-<n>`, created in a
//! transaction only if absent and bound to the process's lease (`candidates_scope` says why no
//! two elections can share a key). The leader is the key with the lowest create revision, and
//! that revision is the fencing token. A waiter watches only the deletion of the key with the
//! next-lower create revision, so a handoff wakes one waiter.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_core::{Candidate, CandidateAction, ElectionConfig, LossReason};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use tokio::sync::{mpsc, watch, Mutex};

use crate::clock::Clock;
use crate::election::{
    CandidateSpec, Command, GuardContext, LeaderInfo, Leadership, Observed, Status,
};
use crate::error::{Error, Result};
use crate::fenced::{FencedCompare, FencedOp, FencedTxn, FencedTxnResponse};
use crate::session::{start_lease, LeaseHandle, LeaseTransport, LeaseView};
use crate::stats::Stats;
use crate::url::{CANDIDATES_MARKER, IDS_MARKER};
use crate::watch_hub::{DeletionWatch, Fired, WatchHub};

/// etcd leases are whole seconds; the server raises anything shorter than its own minimum
/// (1.5 × election timeout, 2 s with default settings) and we use whatever it grants.
pub(crate) const MIN_TTL: Duration = Duration::from_secs(1);

/// Bound on every unary request.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Bound on connecting and on the reachability probe.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How often an observer checks that the server still answers, and how long it waits.
const OBSERVER_PROBE: Duration = Duration::from_secs(1);

/// Pause between attempts when a requeueing candidate hits a backend error.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// etcd's `MaxLeaseTTL`: the server refuses a grant above it ("too large lease TTL"). A TTL
/// above it is bad input, rejected when the election is made rather than at the first grant.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(9_000_000_000);

/// What etcd leases can be: whole seconds, from [`MIN_TTL`] to [`MAX_TTL`].
pub(crate) const LIMITS: baton_core::BackendLimits = baton_core::BackendLimits {
    min_ttl: MIN_TTL,
    max_ttl: MAX_TTL,
    ttl_step: Duration::from_secs(1),
};

fn backend_error(operation: &'static str, error: etcd_client::Error) -> Error {
    crate::metrics::backend_error(operation);
    // gRPC's UNAVAILABLE (14) is what a refused or broken connection becomes.
    const UNAVAILABLE: i32 = 14;
    let unreachable = match &error {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        // tonic reports a connection that broke under a request as UNKNOWN "transport error",
        // with the operating system's error down its source chain.
        etcd_client::Error::GRpcStatus(status) => {
            status.code() as i32 == UNAVAILABLE || has_io_source(status)
        }
        _ => false,
    };
    if unreachable {
        return Error::Unreachable {
            backend: "etcd",
            endpoints: String::new(),
            detail: format!("{} (during {operation})", root_cause(&error)),
        };
    }
    Error::Backend {
        backend: "etcd",
        operation,
        detail: root_cause(&error),
    }
}

/// Runs one request under [`REQUEST_TIMEOUT`], counting it.
async fn request<T>(
    stats: &Stats,
    operation: &'static str,
    call: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    request_within(REQUEST_TIMEOUT, stats, operation, call).await
}

/// Runs one request under `limit`, counting it.
async fn request_within<T>(
    limit: Duration,
    stats: &Stats,
    operation: &'static str,
    call: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    stats.request();
    timed(limit, operation, call).await
}

/// Runs one request under `limit`, mapping its failure and its timeout to [`Error`].
async fn timed<T>(
    limit: Duration,
    operation: &'static str,
    call: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(backend_error(operation, error)),
        Err(_) => {
            crate::metrics::backend_error(operation);
            Err(Error::Timeout {
                operation,
                after_ms: limit.as_millis() as u64,
            })
        }
    }
}

/// Bound on a delete of our own key: resigning should not hang on an unreachable server (the
/// key goes with the lease anyway).
const DELETE_TIMEOUT: Duration = Duration::from_secs(2);

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

/// One granted lease, shared by every candidate with the same settings.
#[derive(Debug)]
struct EtcdLease {
    id: i64,
    handle: LeaseHandle,
}

pub(crate) struct EtcdBackend {
    client: Client,
    prefix: String,
    clock: Clock,
    leases: Mutex<HashMap<LeaseKey, Arc<EtcdLease>>>,
    next_candidate: AtomicU64,
    /// The highest token seen elected per election, across this backend's candidacies: a new
    /// entry at or below it means etcd's revision went backwards (restored or wiped). One
    /// number per election this process has led.
    highest_tokens: std::sync::Mutex<HashMap<String, u64>>,
    pub(crate) stats: Arc<Stats>,
    /// Every candidate's deletion watches share this one stream.
    hub: WatchHub,
}

impl std::fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl EtcdBackend {
    pub(crate) async fn connect(endpoints: Vec<String>, prefix: String) -> Result<EtcdBackend> {
        let joined = endpoints.join(",");
        let unreachable = |detail: String| Error::Unreachable {
            backend: "etcd",
            endpoints: joined.clone(),
            detail,
        };
        let options = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            // HTTP/2 pings notice a dead connection (partition, crashed member), so watches and
            // renewals move to another endpoint. etcd's servers answer pings more frequent than
            // every 5 s (--grpc-keepalive-min-time), or pings without an open stream, by closing
            // the connection ("too many pings"), so stay above that. Safety never waits for
            // this: the local deadline ends leadership on its own.
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            .with_keep_alive_while_idle(false);
        let connect = Client::connect(&endpoints, Some(options));
        let mut client = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok(client)) => client,
            Ok(Err(error)) => return Err(unreachable(error.to_string())),
            Err(_) => return Err(unreachable("connection timed out".into())),
        };
        // Connecting is lazy; ask for something so an unreachable server fails here, clearly.
        let probe = client.get(
            format!("{prefix}/"),
            Some(GetOptions::new().with_count_only().with_prefix()),
        );
        match tokio::time::timeout(CONNECT_TIMEOUT, probe).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => return Err(unreachable(root_cause(&error))),
            Err(_) => return Err(unreachable("no answer within 3s".into())),
        }
        let stats = Arc::new(Stats::default());
        Ok(EtcdBackend {
            hub: WatchHub::new(client.clone(), stats.clone()),
            client,
            prefix,
            clock: Clock::new(),
            leases: Mutex::new(HashMap::new()),
            next_candidate: AtomicU64::new(0),
            highest_tokens: std::sync::Mutex::new(HashMap::new()),
            stats,
        })
    }

    /// `<prefix>/<election>/@candidates/`: every key of the election's candidates, and nothing
    /// else, lies under it; every query of the election is scoped to it.
    ///
    /// Why it is unambiguous: an election name contains no `/` and is never the marker
    /// [`CANDIDATES_MARKER`], and no segment of the prefix is the marker either (both checked
    /// on input). Cut two scopes into `/`-separated segments: `prefix segments…, election,
    /// marker`. If one scope were a prefix of another, the shorter one's marker would stand
    /// where the longer one has a prefix segment or its election name, and the marker is
    /// neither; so two scopes are equal (same prefix, same election) or disjoint. Without the
    /// marker, prefix `/x/a` with election `e` and prefix `/x` with election `a` would share
    /// `/x/a/e…`.
    fn candidates_scope(&self, election: &str) -> String {
        format!("{}/{}/{}/", self.prefix, election, CANDIDATES_MARKER)
    }

    /// A live lease with these settings, granting a new one if the last has expired.
    async fn lease(&self, config: &ElectionConfig) -> Result<Arc<EtcdLease>> {
        let key = LeaseKey::of(config);
        let mut leases = self.leases.lock().await;
        if let Some(lease) = leases.get(&key) {
            if lease.handle.is_live() {
                return Ok(lease.clone());
            }
        }
        let mut transport = EtcdLeaseTransport {
            client: self.client.clone(),
            id: 0,
            stream: None,
            stats: self.stats.clone(),
            on_grant: None,
            gone: false,
        };
        let (id_tx, id_rx) = tokio::sync::oneshot::channel();
        transport.on_grant = Some(id_tx);
        let handle = start_lease(transport, config.clone(), self.clock.clone()).await?;
        let id = id_rx.await.map_err(|_| Error::Closed)?;
        let lease = Arc::new(EtcdLease { id, handle });
        leases.insert(key, lease.clone());
        Ok(lease)
    }

    /// The highest token elected in `election` through this backend so far.
    fn highest_token(&self, election: &str) -> Option<u64> {
        let tokens = self
            .highest_tokens
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        tokens.get(election).copied()
    }

    fn note_token(&self, election: &str, token: u64) {
        let mut tokens = self
            .highest_tokens
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let highest = tokens.entry(election.to_string()).or_default();
        *highest = (*highest).max(token);
    }

    /// A candidacy is done with `lease`: if no other candidacy uses it, forget it, so that it
    /// is revoked (when its last reference goes) rather than renewed for nobody.
    async fn release_lease(&self, lease: Arc<EtcdLease>) {
        let mut leases = self.leases.lock().await;
        // Ours and the map's: no other candidacy holds it, and none can take it while we hold
        // the lock (`lease` hands out clones under it).
        if Arc::strong_count(&lease) == 2 {
            leases.retain(|_, held| !Arc::ptr_eq(held, &lease));
        }
    }

    pub(crate) async fn close(&self) {
        let leases: Vec<_> = self.leases.lock().await.drain().collect();
        for (_, lease) in leases {
            // Holders see the lease over before it is revoked at the server, so no leadership
            // under it outlives its key.
            lease.handle.revoke().await;
        }
    }

    /// Stops renewing `lease` (it expires at the server, taking its keys with it) and forgets
    /// it, for when a key under it could not be deleted: a key left behind on a lease that is
    /// still renewed would block its election for as long as this process lives.
    async fn abandon_lease(&self, lease: &Arc<EtcdLease>) {
        let mut leases = self.leases.lock().await;
        leases.retain(|_, held| !Arc::ptr_eq(held, lease));
        // Not a revoke: that would delete other elections' keys at once, while their holders
        // may still be acting. Letting it lapse ends every holder at its local deadline first.
        lease.handle.stop_renewing();
    }

    pub(crate) fn spawn_candidate(
        self: &Arc<Self>,
        spec: CandidateSpec,
        commands_rx: mpsc::Receiver<Command>,
        commands: mpsc::Sender<Command>,
        leaderships: mpsc::Sender<Box<Result<Leadership>>>,
    ) {
        let CandidateSpec {
            election,
            id,
            value,
            config,
        } = spec;
        let serial = self.next_candidate.fetch_add(1, Ordering::Relaxed);
        let driver = CandidateDriver {
            backend: self.clone(),
            client: self.client.clone(),
            prefix: self.candidates_scope(&election),
            id_key: format!("{}/{}/{}/{}", self.prefix, election, IDS_MARKER, id).into_bytes(),
            entry: encode(&id, value.as_deref()),
            election,
            id,
            serial,
            config: config.clone(),
            core: Candidate::new(config.requeue),
            lease: None,
            own_key: Vec::new(),
            predecessor: None,
            own_watch: None,
            predecessor_watch: None,
            status: None,
            term_metrics: None,
            commands,
            commands_rx,
            leaderships,
            failures: 0,
            resign_acks: Vec::new(),
            step_down_acks: Vec::new(),
            create_uncertain: false,
            created_revision: 0,
        };
        tokio::spawn(driver.run());
    }

    pub(crate) async fn leader(&self, election: &str) -> Result<Option<LeaderInfo>> {
        let mut client = self.client.clone();
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let response = request(
            &self.stats,
            "get leader",
            client.get(self.candidates_scope(election), Some(options)),
        )
        .await?;
        Ok(response
            .kvs()
            .first()
            .map(|kv| describe(kv.create_revision(), kv.value())))
    }

    /// Every candidate of `election` in queue order (the first one leads).
    pub(crate) async fn participants(&self, election: &str) -> Result<Vec<LeaderInfo>> {
        let (members, _) = self.snapshot(&self.candidates_scope(election)).await?;
        Ok(members
            .iter()
            .map(|(revision, raw)| describe(*revision, raw.as_bytes()))
            .collect())
    }

    pub(crate) async fn spawn_observer(
        self: &Arc<Self>,
        election: String,
        tx: mpsc::Sender<Observed>,
    ) -> Result<()> {
        let prefix = self.candidates_scope(&election);
        let (members, revision) = self.snapshot(&prefix).await?;
        let backend = self.clone();
        tokio::spawn(async move {
            let mut members = members;
            let mut revision = revision;
            let mut last: Option<Option<LeaderInfo>> = None;
            loop {
                let current = leader_of(&members);
                if last.as_ref() != Some(&current) {
                    if tx.send(Observed::Leader(current.clone())).await.is_err() {
                        return;
                    }
                    last = Some(current);
                }
                let error = match backend
                    .follow(&prefix, &mut members, &mut revision, &mut last, &tx)
                    .await
                {
                    Ok(()) => return,
                    Err(error) => error,
                };
                // Connection trouble, a server that stopped answering, or compaction: say so
                // (what we showed may be stale now), then resynchronise from a fresh snapshot
                // (level-triggered: the current state is what matters).
                tracing::warn!(%election, %error, "observer cannot see the backend; resynchronising");
                let unavailable = Observed::Unavailable {
                    reason: error.to_string(),
                };
                if tx.send(unavailable).await.is_err() {
                    return;
                }
                // After an outage the current leader is always reported again.
                last = None;
                loop {
                    tokio::time::sleep(RETRY_PAUSE).await;
                    if tx.is_closed() {
                        return;
                    }
                    if let Ok((fresh, at)) = backend.snapshot(&prefix).await {
                        tracing::warn!(%election, "observer resynchronised");
                        members = fresh;
                        revision = at;
                        break;
                    }
                }
            }
        });
        Ok(())
    }

    /// All candidates of an election, by create revision, and the revision of the read.
    async fn snapshot(&self, prefix: &str) -> Result<(BTreeMap<i64, String>, i64)> {
        let mut client = self.client.clone();
        let response = request(
            &self.stats,
            "get candidates",
            client.get(prefix, Some(GetOptions::new().with_prefix())),
        )
        .await?;
        let revision = response.header().map_or(0, |h| h.revision());
        let members = response
            .kvs()
            .iter()
            .map(|kv| {
                (
                    kv.create_revision(),
                    String::from_utf8_lossy(kv.value()).into_owned(),
                )
            })
            .collect();
        Ok((members, revision))
    }

    /// Applies watch events to `members`, sending each change of leader. Returns `Ok` when
    /// the observer is dropped, `Err` when the watch breaks.
    async fn follow(
        &self,
        prefix: &str,
        members: &mut BTreeMap<i64, String>,
        revision: &mut i64,
        last: &mut Option<Option<LeaderInfo>>,
        tx: &mpsc::Sender<Observed>,
    ) -> Result<()> {
        let mut client = self.client.clone();
        let options = WatchOptions::new()
            .with_prefix()
            .with_prev_key()
            .with_start_revision(*revision + 1);
        let mut stream = request(&self.stats, "watch", client.watch(prefix, Some(options))).await?;
        // A watch says nothing while the server is silent (stopped, partitioned): probe it, so
        // that "no news" is never mistaken for "no change" for long.
        let mut probe = tokio::time::interval(OBSERVER_PROBE);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        probe.tick().await;
        loop {
            let message = tokio::select! {
                message = stream.message() => message,
                _ = tx.closed() => return Ok(()),
                _ = probe.tick() => {
                    let options = GetOptions::new().with_prefix().with_count_only();
                    request_within(
                        OBSERVER_PROBE,
                        &self.stats,
                        "observer probe",
                        client.get(prefix, Some(options)),
                    )
                    .await?;
                    continue;
                }
            };
            let response = match message {
                Ok(Some(response)) => response,
                Ok(None) => return Err(Error::Closed),
                Err(error) => return Err(backend_error("watch", error)),
            };
            if response.canceled() {
                return Err(Error::Closed);
            }
            for event in response.events() {
                self.stats.watch_events.fetch_add(1, Ordering::Relaxed);
                let Some(kv) = event.kv() else { continue };
                *revision = (*revision).max(kv.mod_revision());
                match event.event_type() {
                    EventType::Put => {
                        members.insert(
                            kv.create_revision(),
                            String::from_utf8_lossy(kv.value()).into_owned(),
                        );
                    }
                    EventType::Delete => {
                        if let Some(prev) = event.prev_kv() {
                            members.remove(&prev.create_revision());
                        }
                    }
                }
            }
            let current = leader_of(members);
            if last.as_ref() != Some(&current) {
                if tx.send(Observed::Leader(current.clone())).await.is_err() {
                    return Ok(());
                }
                *last = Some(current);
            }
        }
    }

    /// Runs `txn` only while `token` leads `election` (found by its create revision).
    pub(crate) async fn fenced_txn_by_token(
        &self,
        election: &str,
        token: u64,
        txn: &FencedTxn,
        limit: Duration,
    ) -> Result<FencedTxnResponse> {
        txn.validate()?;
        let fenced = || Error::Fenced {
            election: election.to_string(),
            token,
        };
        let revision = i64::try_from(token).map_err(|_| fenced())?;
        let mut client = self.client.clone();
        let options = GetOptions::new()
            .with_prefix()
            .with_keys_only()
            .with_min_create_revision(revision)
            .with_max_create_revision(revision);
        let response = request_within(
            limit,
            &self.stats,
            "find leader key",
            client.get(self.candidates_scope(election), Some(options)),
        )
        .await?;
        let Some(kv) = response.kvs().first() else {
            return Err(fenced());
        };
        let fence = Fence {
            client: self.client.clone(),
            election,
            leader_key: kv.key().to_vec(),
            token,
        };
        fence.run(txn, limit).await
    }
}

fn leader_of(members: &BTreeMap<i64, String>) -> Option<LeaderInfo> {
    members
        .iter()
        .next()
        .map(|(revision, raw)| describe(*revision, raw.as_bytes()))
}

/// A candidate entry's value: its id, then, if it has one, a newline and its leader value (ids
/// contain no control characters, so the first newline separates them).
fn encode(id: &str, value: Option<&str>) -> String {
    match value {
        Some(value) => format!("{id}\n{value}"),
        None => id.to_string(),
    }
}

/// The candidate an entry with this create revision and value describes.
fn describe(revision: i64, raw: &[u8]) -> LeaderInfo {
    let text = String::from_utf8_lossy(raw);
    let (id, value) = match text.split_once('\n') {
        Some((id, value)) => (id.to_string(), Some(value.to_string())),
        None => (text.into_owned(), None),
    };
    LeaderInfo {
        id,
        token: revision as u64,
        value,
    }
}

/// Whether an operating-system I/O error lies down `error`'s source chain.
fn has_io_source(error: &dyn std::error::Error) -> bool {
    let mut source = error.source();
    while let Some(current) = source {
        if current.is::<std::io::Error>() {
            return true;
        }
        source = current.source();
    }
    false
}

/// The most telling message of an error chain: the operating system's "Connection refused"
/// rather than a page of gRPC status.
fn root_cause(error: &etcd_client::Error) -> String {
    let mut source: Option<&dyn std::error::Error> = match error {
        etcd_client::Error::GRpcStatus(status) => Some(status),
        _ => Some(error),
    };
    while let Some(current) = source {
        if let Some(io) = current.downcast_ref::<std::io::Error>() {
            return io.to_string();
        }
        source = current.source();
    }
    // tonic hides the operating system's error behind boxed sources; its Debug form keeps it.
    let debug = format!("{error:?}");
    for (kind, text) in [
        ("ConnectionRefused", "connection refused"),
        ("TimedOut", "connection timed out"),
        ("HostUnreachable", "host unreachable"),
        ("NetworkUnreachable", "network unreachable"),
    ] {
        if debug.contains(kind) {
            return text.to_string();
        }
    }
    let text = error.to_string();
    match text.find("message: ") {
        Some(at) => text[at + 9..]
            .split(',')
            .next()
            .unwrap_or(&text)
            .trim_matches('"')
            .to_string(),
        None => text,
    }
}

/// The fence of one leadership: its leader key, which exists with create revision `token`
/// exactly while that leadership holds (no key with a lower revision can appear later, so if it
/// exists it is still the lowest).
pub(crate) struct Fence<'a> {
    pub(crate) client: Client,
    pub(crate) election: &'a str,
    pub(crate) leader_key: Vec<u8>,
    pub(crate) token: u64,
}

impl Fence<'_> {
    /// Runs `txn` nested inside a transaction that checks the leader key first: one atomic
    /// step, bounded by `limit`.
    pub(crate) async fn run(&self, txn: &FencedTxn, limit: Duration) -> Result<FencedTxnResponse> {
        txn.validate()?;
        let revision = i64::try_from(self.token).unwrap_or(i64::MAX);
        let compares: Vec<Compare> = txn
            .compares
            .iter()
            .map(|compare| match compare {
                FencedCompare::Value { key, value: None } => {
                    Compare::create_revision(key.as_str(), CompareOp::Equal, 0)
                }
                FencedCompare::Value {
                    key,
                    value: Some(value),
                } => Compare::value(key.as_str(), CompareOp::Equal, value.clone()),
            })
            .collect();
        // An absent key has no value to compare: etcd's value comparison fails for it, which
        // is the answer we want for "equals Some(..)".
        let inner = Txn::new()
            .when(compares)
            .and_then(txn.then.iter().map(to_etcd_op).collect::<Vec<_>>())
            .or_else(txn.otherwise.iter().map(to_etcd_op).collect::<Vec<_>>());
        let outer = Txn::new()
            .when([Compare::create_revision(
                self.leader_key.clone(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::txn(inner)]);
        let mut client = self.client.clone();
        let response = timed(limit, "fenced transaction", client.txn(outer)).await?;
        if !response.succeeded() {
            return Err(Error::Fenced {
                election: self.election.to_string(),
                token: self.token,
            });
        }
        let Some(TxnOpResponse::Txn(inner)) = response.op_responses().into_iter().next() else {
            return Err(Error::Backend {
                backend: "etcd",
                operation: "fenced transaction",
                detail: "the answer lacks the nested transaction".into(),
            });
        };
        let values = inner
            .op_responses()
            .into_iter()
            .filter_map(|op| match op {
                TxnOpResponse::Get(get) => Some(get.kvs().first().map(|kv| kv.value().to_vec())),
                _ => None,
            })
            .collect();
        Ok(FencedTxnResponse {
            succeeded: inner.succeeded(),
            values,
        })
    }
}

fn to_etcd_op(op: &FencedOp) -> TxnOp {
    match op {
        FencedOp::Put { key, value } => TxnOp::put(key.as_str(), value.clone(), None),
        FencedOp::Delete { key } => TxnOp::delete(key.as_str(), None),
        FencedOp::Get { key } => TxnOp::get(key.as_str(), None),
    }
}

/// Grant and renewals of one etcd lease, over the keepalive stream.
struct EtcdLeaseTransport {
    client: Client,
    id: i64,
    stream: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    stats: Arc<Stats>,
    on_grant: Option<tokio::sync::oneshot::Sender<i64>>,
    /// The server said the lease no longer exists.
    gone: bool,
}

impl LeaseTransport for EtcdLeaseTransport {
    async fn grant(&mut self, ttl: Duration) -> Result<Duration> {
        let seconds = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX);
        self.stats.request();
        let response = self
            .client
            .lease_grant(seconds, None)
            .await
            .map_err(|error| backend_error("lease grant", error))?;
        self.id = response.id();
        if let Some(tx) = self.on_grant.take() {
            let _ = tx.send(self.id);
        }
        Ok(Duration::from_secs(response.ttl().max(0) as u64))
    }

    async fn send_renewal(&mut self) -> Result<()> {
        if self.stream.is_none() {
            // Opening the renewal stream is renewal traffic, counted with the renewals.
            self.stats.renewals.fetch_add(1, Ordering::Relaxed);
            match self.client.lease_keep_alive(self.id).await {
                Ok(opened) => self.stream = Some(opened),
                // etcd-client reports a lease the server no longer knows (TTL ≤ 0 on the
                // opening renewal) this way: the lease is gone, not the network.
                Err(etcd_client::Error::LeaseKeepAliveError(_)) => {
                    self.gone = true;
                    return Ok(());
                }
                Err(error) => return Err(backend_error("lease keepalive", error)),
            }
        }
        let (keeper, _) = self.stream.as_mut().expect("opened above");
        self.stats.renewals.fetch_add(1, Ordering::Relaxed);
        if let Err(error) = keeper.keep_alive().await {
            self.stream = None;
            return Err(backend_error("lease keepalive", error));
        }
        Ok(())
    }

    async fn next_renewal(&mut self) -> Result<Duration> {
        if self.gone {
            return Ok(Duration::ZERO);
        }
        let Some((_, stream)) = self.stream.as_mut() else {
            return std::future::pending().await;
        };
        match stream.message().await {
            Ok(Some(response)) => Ok(Duration::from_secs(response.ttl().max(0) as u64)),
            Ok(None) => {
                self.stream = None;
                Err(Error::Closed)
            }
            Err(error) => {
                self.stream = None;
                Err(backend_error("lease keepalive", error))
            }
        }
    }

    async fn revoke(&mut self) -> Result<()> {
        self.stats.request();
        self.client
            .lease_revoke(self.id)
            .await
            .map(|_| ())
            .map_err(|error| backend_error("lease revoke", error))
    }
}

/// The driver of one candidacy: a loop around [`Candidate`].
struct CandidateDriver {
    backend: Arc<EtcdBackend>,
    client: Client,
    /// `<prefix>/<election>/@ids/<id>`: created with our entry, bound to the same lease, so a
    /// second live candidate with our id is refused.
    id_key: Vec<u8>,
    /// What our entry holds: the id and the leader value (see `encode`).
    entry: String,
    /// `<prefix>/<election>/@candidates/`: the scope of every query of this election.
    prefix: String,
    election: String,
    id: String,
    serial: u64,
    config: ElectionConfig,
    core: Candidate,
    lease: Option<Arc<EtcdLease>>,
    own_key: Vec<u8>,
    /// The key and create revision we wait behind.
    predecessor: Option<(Vec<u8>, i64)>,
    /// The deletion of our own key.
    own_watch: Option<DeletionWatch>,
    /// The deletion of the key we wait behind.
    predecessor_watch: Option<DeletionWatch>,
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
    /// A create request failed without an answer: the key may exist. Deleted on giving up.
    create_uncertain: bool,
    /// The revision of the last key we created (for the error when it was too low).
    created_revision: u64,
}

/// What a create transaction found.
enum Created {
    /// Our entry exists with this create revision.
    Key(i64),
    /// Another entry holds our id.
    IdTakenBy(etcd_client::KeyValue),
}

/// What woke the driver.
enum Wake {
    Command(Option<Command>),
    LeaseOver,
    Deleted(Vec<u8>, i64),
    WatchBroken,
    /// Nobody is waiting for a leadership any more (the campaign future was dropped).
    Abandoned,
}

impl CandidateDriver {
    async fn run(mut self) {
        self.core.campaign();
        loop {
            while let Some(action) = self.core.poll_action() {
                // Boxed: request futures are large, and a candidate spends its life waiting,
                // so the task should not carry their size while it waits (memory per election).
                Box::pin(self.perform(action)).await;
            }
            // A stepped-down term's key has been deleted by now.
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
            if self.leaderships.is_closed() {
                self.core.stop_requeue();
            }
            match wake {
                Wake::Command(command) => self.handle_command(command),
                Wake::LeaseOver => self.core.handle_lease_expired(),
                Wake::Deleted(key, revision) => {
                    // The watch that fired is spent.
                    if key == self.own_key {
                        self.own_watch = None;
                    } else {
                        self.predecessor_watch = None;
                    }
                    if key == self.own_key {
                        self.core.handle_key_deleted();
                    } else if self
                        .predecessor
                        .as_ref()
                        .is_some_and(|(k, r)| *k == key && *r == revision)
                    {
                        self.backend.stats.wakeups.fetch_add(1, Ordering::Relaxed);
                        self.core.handle_predecessor_deleted(revision as u64);
                    }
                }
                Wake::WatchBroken => Box::pin(self.recheck()).await,
                Wake::Abandoned => self.core.resign(),
            }
        }
        // Drain the last actions (the DeleteKey of a resign) before acknowledging.
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
            self.backend.release_lease(lease).await;
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

    async fn wait(&mut self) -> Wake {
        let mut lease_view = self
            .lease
            .as_ref()
            .map(|lease| lease.handle.watch.view.clone());
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
        let has_key = self.core.own_revision().is_some();
        let deleted = async {
            let Some(own) = own.as_mut() else {
                if has_key {
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
                Fired::Deleted {
                    key,
                    create_revision,
                } => Wake::Deleted(key, create_revision),
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
    /// stand. Our key must still exist with our revision; then the watch is reopened from the
    /// revision of that read (nothing older is replayed, so compaction cannot break it again),
    /// and a waiter looks for its predecessor anew. If etcd cannot be reached, the watch stays
    /// closed and [`CandidateDriver::wait`] tries again shortly; the lease's local deadline
    /// bounds how long a leader can act meanwhile.
    async fn recheck(&mut self) {
        self.drop_watches();
        tokio::time::sleep(RETRY_PAUSE).await;
        let Some(own_revision) = self.core.own_revision() else {
            return;
        };
        let own_revision = own_revision as i64;
        let read_revision = match self.own_key_revision(own_revision).await {
            Ok(Some(read_revision)) => read_revision,
            Ok(None) => return self.core.handle_key_deleted(),
            Err(_) => return,
        };
        if self.open_watch(read_revision + 1).await.is_err() {
            // `wait` retries shortly while a key has no watch.
            return;
        }
        if let baton_core::CandidateState::Queued { predecessor, .. } = self.core.state() {
            self.core.handle_predecessor_deleted(predecessor);
        }
    }

    /// Stops both deletion watches (cancelled at the server by the hub).
    fn drop_watches(&mut self) {
        self.own_watch = None;
        self.predecessor_watch = None;
    }

    /// `Some(revision of the read)` if our key exists with `own_revision`, `None` if not.
    async fn own_key_revision(&mut self, own_revision: i64) -> Result<Option<i64>> {
        let response = request(
            &self.backend.stats,
            "get own key",
            self.client.get(self.own_key.clone(), None),
        )
        .await?;
        let read_revision = response.header().map_or(0, |h| h.revision());
        let exists = response
            .kvs()
            .first()
            .is_some_and(|kv| kv.create_revision() == own_revision);
        Ok(exists.then_some(read_revision))
    }

    async fn perform(&mut self, action: CandidateAction) {
        match action {
            CandidateAction::CreateKey => self.create_key().await,
            CandidateAction::FindPredecessor { own_revision } => {
                self.find_predecessor(own_revision as i64).await
            }
            CandidateAction::WatchPredecessor { revision } => {
                // The watch was extended in find_predecessor; nothing more to do here.
                debug_assert!(self
                    .predecessor
                    .as_ref()
                    .is_some_and(|(_, r)| *r == revision as i64));
            }
            CandidateAction::Elected { token } => self.elected(token),
            CandidateAction::Lost {
                reason,
                was_leading,
            } => self.lost(reason, was_leading),
            CandidateAction::DeleteKey { revision } => self.delete_key(revision as i64).await,
        }
    }

    async fn create_key(&mut self) {
        self.drop_watches();
        self.predecessor = None;
        // Tokens elected before our create is sent: our key must come out above them. (Not
        // re-read per attempt: a retry may adopt a key created by an earlier attempt.)
        if let Some(highest) = self.backend.highest_token(&self.election) {
            self.core.handle_token_seen(highest);
        }
        loop {
            match self.try_create_key().await {
                Ok(revision) => {
                    if let Err(error) = self.open_watch(revision + 1).await {
                        // Without a watch we cannot hear of deletions: delete and retry.
                        if self.try_delete(revision).await.is_err() {
                            self.create_uncertain = true;
                        }
                        if self.give_up(error).await {
                            return;
                        }
                        continue;
                    }
                    self.failures = 0;
                    self.create_uncertain = false;
                    self.created_revision = revision as u64;
                    self.core.handle_key_created(revision as u64);
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

    /// Best effort: deletes our key name if it exists bound to our lease (an attempt whose
    /// answer was lost). Later attempts adopt such a key anyway; this is for giving up.
    async fn delete_if_ours(&mut self) -> bool {
        let Some(lease) = self.lease.as_ref().map(|lease| lease.id) else {
            return true;
        };
        if self.own_key.is_empty() {
            return true;
        }
        let key = self.own_key.clone();
        self.delete_own_key_if(Compare::lease(key, CompareOp::Equal, lease))
            .await
            .is_ok()
    }

    /// Without requeue a failure ends the candidacy and reaches the caller; with requeue we
    /// pause and retry (unless asked to stop). Returns whether to give up.
    async fn give_up(&mut self, error: Error) -> bool {
        if !self.config.requeue || self.leaderships.is_closed() {
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

    /// Giving up after a create whose answer was lost: the key may exist on a lease that is
    /// still renewed (shared with other elections), where it would block this election for
    /// the life of the process. Delete it, or failing that, let its lease lapse.
    async fn clean_up_uncertain_create(&mut self) {
        if !std::mem::take(&mut self.create_uncertain) {
            return;
        }
        if !self.delete_if_ours().await {
            if let Some(lease) = self.lease.clone() {
                self.backend.abandon_lease(&lease).await;
            }
        }
    }

    async fn try_create_key(&mut self) -> Result<i64> {
        let lease = self.backend.lease(&self.config).await?;
        self.own_key = format!("{}{:016x}-{}", self.prefix, lease.id, self.serial).into_bytes();
        self.lease = Some(lease.clone());
        // Twice at most: the second attempt follows the removal of a stale id entry.
        for _ in 0..2 {
            match self.create_once(lease.id).await? {
                Created::Key(revision) => return Ok(revision),
                Created::IdTakenBy(holder) => {
                    if !self.clear_stale_id_entry(&holder).await? {
                        return Err(Error::DuplicateId {
                            election: self.election.clone(),
                            id: self.id.clone(),
                            entry: String::from_utf8_lossy(holder.value()).into_owned(),
                        });
                    }
                }
            }
        }
        Err(Error::Backend {
            backend: "etcd",
            operation: "create candidate key",
            detail: "the candidate id entry keeps changing".into(),
        })
    }

    /// One create transaction: our entry and our id entry, both bound to the lease, only if
    /// neither exists.
    async fn create_once(&mut self, lease: i64) -> Result<Created> {
        let key = self.own_key.clone();
        let leased = || Some(PutOptions::new().with_lease(lease));
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                Compare::create_revision(self.id_key.clone(), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(key.clone(), self.entry.clone(), leased()),
                TxnOp::put(self.id_key.clone(), key.clone(), leased()),
            ])
            .or_else([
                TxnOp::get(key.clone(), None),
                TxnOp::get(self.id_key.clone(), None),
            ]);
        let response = match request(
            &self.backend.stats,
            "create candidate key",
            self.client.txn(txn),
        )
        .await
        {
            Ok(response) => response,
            Err(error) => {
                // The create may have committed even though no answer came. A retry adopts
                // such a key; giving up deletes it (see `give_up`).
                self.create_uncertain = true;
                return Err(error);
            }
        };
        if response.succeeded() {
            return Ok(Created::Key(response.header().map_or(0, |h| h.revision())));
        }
        // Our key exists: an earlier attempt of ours whose answer was lost (it created the id
        // entry too). Adopt it only if it is bound to our lease. Else the id is taken.
        let mut gets = response.op_responses().into_iter().map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().cloned(),
            _ => None,
        });
        let (own, id_entry) = (gets.next().flatten(), gets.next().flatten());
        if let Some(kv) = own.filter(|kv| kv.lease() == lease) {
            return Ok(Created::Key(kv.create_revision()));
        }
        // Another candidate's, or a stale one of ours whose entry was deleted behind our back.
        if let Some(holder) = id_entry {
            return Ok(Created::IdTakenBy(holder));
        }
        Err(Error::Backend {
            backend: "etcd",
            operation: "create candidate key",
            detail: "the key exists with another lease".into(),
        })
    }

    /// An id entry whose candidate entry is gone (deleted behind baton's back, say) is stale:
    /// removes it, unless it changed meanwhile. Returns whether it was stale.
    async fn clear_stale_id_entry(&mut self, holder: &etcd_client::KeyValue) -> Result<bool> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(holder.value().to_vec(), CompareOp::Equal, 0),
                Compare::mod_revision(self.id_key.clone(), CompareOp::Equal, holder.mod_revision()),
            ])
            .and_then([TxnOp::delete(self.id_key.clone(), None)]);
        let response = request(
            &self.backend.stats,
            "clear stale id entry",
            self.client.txn(txn),
        )
        .await?;
        Ok(response.succeeded())
    }

    /// Watches our own key (deletions only) from `start_revision`.
    async fn open_watch(&mut self, start_revision: i64) -> Result<()> {
        let watch = self
            .backend
            .hub
            .watch(self.own_key.clone(), start_revision)
            .await?;
        self.own_watch = Some(watch);
        Ok(())
    }

    /// Always one transaction that also checks our own key, even when the predecessor's
    /// deletion suggests we are first: the same revision may have deleted our key too (a
    /// `del --prefix`, a shared lease revoked), and its event may not have reached us yet.
    async fn find_predecessor(&mut self, own_revision: i64) {
        loop {
            match self.try_find_predecessor(own_revision).await {
                Ok(Some(found)) => {
                    let revision = found.as_ref().map(|(_, revision)| *revision as u64);
                    self.predecessor = found;
                    self.core.handle_predecessor(revision);
                    return;
                }
                Ok(None) => {
                    self.core.handle_key_deleted();
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
            .is_none_or(|lease| !lease.handle.is_live())
    }

    /// `Ok(None)`: our key is gone. `Ok(Some(None))`: we are first. `Ok(Some(Some(p)))`: `p`
    /// is ahead of us, and a watch for its deletion is in place.
    async fn try_find_predecessor(
        &mut self,
        own_revision: i64,
    ) -> Result<Option<Option<(Vec<u8>, i64)>>> {
        // In one transaction: is our key still ours, and who is just ahead of it?
        let options = GetOptions::new()
            .with_prefix()
            .with_keys_only()
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_max_create_revision(own_revision - 1)
            .with_limit(1);
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.own_key.clone(),
                CompareOp::Equal,
                own_revision,
            )])
            .and_then([TxnOp::get(self.prefix.clone(), Some(options))]);
        let response = request(
            &self.backend.stats,
            "find predecessor",
            self.client.txn(txn),
        )
        .await?;
        if !response.succeeded() {
            return Ok(None);
        }
        let read_revision = response.header().map_or(0, |h| h.revision());
        let predecessor = response.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => get
                .kvs()
                .first()
                .map(|kv| (kv.key().to_vec(), kv.create_revision())),
            _ => None,
        });
        if let Some((key, _)) = &predecessor {
            if self.own_watch.is_none() {
                // Our key exists as of `read_revision` (the transaction checked it).
                self.open_watch(read_revision + 1).await?;
            }
            // Watch from just after our read: a deletion in between is replayed, not missed.
            // Replacing the previous predecessor's watch cancels it.
            let watch = self
                .backend
                .hub
                .watch(key.clone(), read_revision + 1)
                .await?;
            self.predecessor_watch = Some(watch);
        } else {
            self.predecessor_watch = None;
        }
        Ok(Some(predecessor))
    }

    fn elected(&mut self, token: u64) {
        if self.lease_over() {
            // Elected from a buffered event after our lease ran out (say, after a pause):
            // the key may already be gone at the server and a rival leading. Never announce it.
            if !self.config.requeue {
                let _ = self
                    .leaderships
                    .try_send(Box::new(Err(Error::CampaignLost(LossReason::LeaseExpired))));
            }
            self.core.handle_lease_expired();
            return;
        }
        let lease = self.lease.as_ref().expect("elected under a lease");
        self.backend.note_token(&self.election, token);
        self.term_metrics = Some(crate::metrics::Term::begin(
            &self.election,
            &lease.handle.watch,
        ));
        let (status_tx, status_rx) = watch::channel(Status::Leading);
        self.status = Some(status_tx);
        let leadership = Leadership::new(
            self.election.clone(),
            self.id.clone(),
            token,
            status_rx,
            lease.handle.watch.clone(),
            self.commands.clone(),
            GuardContext::Etcd {
                client: self.client.clone(),
                key: self.own_key.clone(),
            },
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
                token: self.created_revision,
                highest: self.core.highest_token().unwrap_or_default(),
            };
            tracing::warn!(election = %self.election, %error, "candidacy ended");
            let _ = self.leaderships.try_send(Box::new(Err(error)));
        } else if !was_leading && !self.config.requeue {
            let _ = self
                .leaderships
                .try_send(Box::new(Err(Error::CampaignLost(reason))));
        }
        self.drop_watches();
        self.predecessor = None;
    }

    async fn delete_key(&mut self, revision: i64) {
        // We are deleting it ourselves: stop watching it first, so nobody is told.
        self.drop_watches();
        if self.lease_over() {
            // The key is going with the lease at the server; one try to speed that up.
            let _ = self.try_delete(revision).await;
            return;
        }
        for attempt in 0..2 {
            if self.try_delete(revision).await.is_ok() {
                return;
            }
            if attempt < 1 {
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
        // etcd is unreachable: let the lease lapse so the key goes with it.
        if let Some(lease) = self.lease.clone() {
            tracing::warn!(election = %self.election, "could not delete our key; ending its lease");
            self.backend.abandon_lease(&lease).await;
        }
    }

    async fn try_delete(&mut self, revision: i64) -> Result<()> {
        // Delete only the key we created, never a later one with the same name.
        let key = self.own_key.clone();
        self.delete_own_key_if(Compare::create_revision(key, CompareOp::Equal, revision))
            .await
    }

    /// Deletes our key name in one transaction guarded by `condition`, within the delete bound.
    async fn delete_own_key_if(&mut self, condition: Compare) -> Result<()> {
        // The id entry goes with our key, but only if it is ours (it names our key).
        let id_entry = Txn::new()
            .when([Compare::value(
                self.id_key.clone(),
                CompareOp::Equal,
                self.own_key.clone(),
            )])
            .and_then([TxnOp::delete(self.id_key.clone(), None)]);
        let txn = Txn::new().when([condition]).and_then([
            TxnOp::delete(self.own_key.clone(), None),
            TxnOp::txn(id_entry),
        ]);
        request_within(
            DELETE_TIMEOUT,
            &self.backend.stats,
            "delete candidate key",
            self.client.txn(txn),
        )
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_above_etcds_maximum_or_fractional_is_refused() {
        let config = ElectionConfig::default();
        assert!(config.clone().with_ttl(MAX_TTL).validate(&LIMITS).is_ok());
        let error = config
            .clone()
            .with_ttl(MAX_TTL + Duration::from_secs(1))
            .validate(&LIMITS)
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "ttl 9000000001s is above this backend's maximum of 2500000h"
        );
        let error = config
            .with_ttl(Duration::from_millis(2500))
            .validate(&LIMITS)
            .unwrap_err();
        assert!(
            error.to_string().contains("whole multiple of 1s"),
            "{error}"
        );
    }
}
